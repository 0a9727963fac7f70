"""Whole-process start-up of `paritykit --help` vs `python -c 'import torch'` (goal: help <= 0.15 s median).

Run: `.venv/bin/python benchmarks/bench_startup.py` — writes benchmarks/results/startup.txt.
"""

from __future__ import annotations

import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RUNS = 21


def median_seconds(cmd: list[str], runs: int = RUNS) -> float:
    subprocess.run(cmd, capture_output=True, check=True)  # warm the page cache once
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    script = shutil.which("paritykit", path=str(Path(sys.executable).parent))
    help_cmd = [script, "--help"] if script else [sys.executable, "-m", "paritykit", "--help"]
    lines = [
        f"machine: {platform.machine()}, {platform.python_version()}, runs per figure: {RUNS}",
        f"paritykit --help (whole process, median): {median_seconds(help_cmd):.3f} s",
        (
            "python -c 'import torch' (whole process, median):"
            f" {median_seconds([sys.executable, '-c', 'import torch'], 7):.3f} s"
        ),
        (
            "python -c 'pass' (interpreter floor, median):"
            f" {median_seconds([sys.executable, '-c', 'pass']):.3f} s"
        ),
    ]
    out = Path(__file__).parent / "results" / "startup.txt"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
