"""Where bisect's time at FLUX.1-dev size goes: cProfile of one bisect --levels zoom on the GPU (it showed the
position hash at 34 of 61 s, one block per synchronisation). Run from the repo root."""

import cProfile
import pstats
import sys
import time

sys.path.insert(0, "benchmarks")  # run from the repo root
import gpu_scale as g  # noqa: E402
import torch  # noqa: E402
from paritykit.bisection.entry import bisect  # noqa: E402

reference, port = g.build("dev", "cuda", slip=False), g.build("dev", "cuda", slip=True)
inputs = g.inputs("dev", "cuda")
profile = cProfile.Profile()
started = time.perf_counter()
profile.enable()
report = bisect(reference, port, inputs, levels="zoom", repair=False)
profile.disable()
torch.cuda.synchronize()
print(
    f"bisect {time.perf_counter() - started:.1f} s, culprit {report.culprit.port if report.culprit else '-'}"
)
stats = pstats.Stats(profile).sort_stats("cumulative")
stats.print_stats(45)
stats.sort_stats("tottime").print_stats(25)
