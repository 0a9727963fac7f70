"""Survey: inputs shaped for every model class diffusers ships, from its forward signature and config.

Each ModelMixin class diffusers exports is shrunk from its default config (`paritykit.tracing.shaped_inputs.
tiny_config`: one layer per stack, two heads, narrower channels), its inputs are searched on the meta device
(`input_layout`), and each class that gets a layout is then built on the CPU and run once with the seeded
inputs `model_inputs` makes, as a generated component test would. The file lists every class: the layout
that ran, or why the class cannot be built tiny or given inputs.

    python benchmarks/model_inputs.py  # writes benchmarks/results/model_inputs.txt (also run by `make bench`)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "helpers"))

from paritykit.tracing.shaped_inputs import model_classes, run_tiny, survey  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "model_inputs.txt"


def main() -> int:
    import diffusers

    start = time.perf_counter()
    rows, counts = [], {}
    for model_class in model_classes():
        found = survey(model_class)
        status = found.status
        if status == "runs":
            error = run_tiny(model_class)
            status, detail = ("runs", found.layout) if error is None else ("fails on the CPU", error)
        else:
            detail = found.reason
        counts[status] = counts.get(status, 0) + 1
        size = f"{found.parameters / 1e6:.1f} M" if found.parameters else "-"
        rows.append(f"{found.name:44s} {status:16s} {size:>9s}  {detail}")
        print(rows[-1][:160], flush=True)
    total = sum(counts.values())
    header = [
        f"Model classes in diffusers {diffusers.__version__}: {total}; "
        + ", ".join(f"{status}: {count}" for status, count in sorted(counts.items())),
        f"({time.perf_counter() - start:.0f} s on this machine)",
        "",
        f"{'class':44s} {'status':16s} {'params':>9s}  inputs that ran, or why not",
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(header + rows) + "\n")
    print("\n".join(header[:2]))
    print(f"wrote {OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
