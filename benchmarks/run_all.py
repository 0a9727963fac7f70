"""Run every benchmark in this folder in turn (`make bench`); each writes its own file under results/.

The speed benchmarks are `bench_*.py`; `diagnosis.py` scores the quality of bisect's answers on the gallery;
`relations.py` scores the value-relations split (bug classes no detector names); `first_screen.py` measures
whether those answers sit in a report's first 10 lines; `model_inputs.py` lists
every diffusers model class with the inputs paritykit shapes for it, or why not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    failed = []
    surveys = [
        HERE / "diagnosis.py",
        HERE / "relations.py",
        HERE / "first_screen.py",
        HERE / "model_inputs.py",
    ]
    for script in [*sorted(HERE.glob("bench_*.py")), *surveys]:
        print(f"== {script.name}", flush=True)
        if subprocess.run([sys.executable, str(script)]).returncode != 0:
            failed.append(script.name)
    sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
