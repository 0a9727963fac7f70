r"""Child process of ``tests/test_weights_map_memory.py`` and ``benchmarks/bench_weights_map_files.py``:
``python weights_map_child.py SOURCE TARGET`` maps SOURCE onto TARGET with :func:`infer_conversion_map` and
prints one JSON line: its wall time, its peak RSS growth (VmHWM after the run minus VmRSS before it, the peak
reset first; torch and numpy imported before), the ops used, the rule count, whether the layer order was named
and how many targets stayed unexplained. A process of its own, so nothing read before inflates its peak."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy  # noqa: F401  (imported before the measurement, as the run imports it)
import torch  # noqa: F401
from paritykit.forensics.conversion.matching import infer_conversion_map


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


if __name__ == "__main__":
    Path("/proc/self/clear_refs").write_text("5")
    before = _vm("VmRSS")
    start = time.perf_counter()
    cmap = infer_conversion_map(sys.argv[1], sys.argv[2])
    wall = time.perf_counter() - start
    print(
        json.dumps(
            {
                "wall": wall,
                "growth": _vm("VmHWM") - before,
                "ops": sorted({e.op for e in cmap.mapping}),
                "rules": len(cmap.rules),
                "layer_order": "another order" in cmap.render(),
                "unmapped": len(cmap.unmapped_target),
            }
        )
    )
