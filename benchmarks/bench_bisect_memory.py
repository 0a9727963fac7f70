"""Peak memory of a bisect on a deep model, with the zoom (one level of blocks at a time) and without it.

The model is the shape issue 25 names: 64 residual MLP blocks (LayerNorm, Linear 256 -> 1024, tanh-GELU,
Linear 1024 -> 256, plus the skip) over 4096 tokens of width 256, float32, batch 1: 128 MB of weights per
side, and a full capture of every module call of one side is several GB. The port is a copy of the reference
whose block 40 computes the exact GELU in place of the tanh form; the bisect must name ``blocks.40.act``
either way.

Each run is its own child process; its peak resident memory is ``ru_maxrss`` (the whole process: Python,
torch, both models, the inputs and everything the bisect holds). The goal is a peak of at most 2 GiB with
the zoom.

    python benchmarks/bench_bisect_memory.py             # the measured size, about a minute
    python benchmarks/bench_bisect_memory.py --blocks 4  # a quick check of the mechanics (not written)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "bisect_memory.txt"
GOAL = 2 * 2**30
BLOCKS, TOKENS, WIDTH, HIDDEN, BUGGY = 64, 4096, 256, 1024, 40
CULPRIT = f"blocks.{BUGGY}.act"


def build(blocks: int):
    import copy

    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(WIDTH)
            self.fc1 = nn.Linear(WIDTH, HIDDEN)
            self.act = nn.GELU(approximate="tanh")
            self.fc2 = nn.Linear(HIDDEN, WIDTH)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(self.norm(x))))

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))
            self.out = nn.LayerNorm(WIDTH)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    torch.manual_seed(0)
    reference = Deep().eval()
    port = copy.deepcopy(reference)
    port.blocks[min(BUGGY, blocks - 1)].act = nn.GELU()
    return reference, port, torch.randn(1, TOKENS, WIDTH)


def _rss() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def child(mode: str, blocks: int) -> dict:
    import resource

    import torch

    torch.set_num_threads(2)
    reference, port, x = build(blocks)
    out = {"mode": mode, "rss_before": _rss()}
    started = time.perf_counter()
    if mode == "capture":
        from paritykit.tracing.trace import capture

        with torch.no_grad(), capture(reference) as trace:
            reference(x)
        out["captured_bytes"] = trace.summary()["bytes_in_memory"]
        out["calls"] = len(trace)
    else:
        from paritykit.bisection.entry import bisect

        report = bisect(reference, port, ((x,), {}), levels=mode)
        out["culprit"] = report.culprit.reference if report.culprit else None
        out["entered"] = report.environment.get("entered")
    out["seconds"] = time.perf_counter() - started
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run_child(mode: str, blocks: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--blocks", str(blocks)], capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"mode": mode, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(blocks: int, write: bool) -> int:
    import os
    import platform

    import torch

    rows = {mode: run_child(mode, blocks) for mode in ("zoom", "full", "capture")}
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    lines = [
        (
            f"# bench_bisect_memory: {blocks} residual blocks (LayerNorm, Linear {WIDTH}->{HIDDEN},"
            f" tanh-GELU, Linear {HIDDEN}->{WIDTH}), {TOKENS} tokens x {WIDTH}, batch 1, float32, CPU"
        ),
        (
            f"# planted bug: {CULPRIT} computes the exact GELU; torch {torch.__version__}, python "
            f"{platform.python_version()}, {cpu}, {os.cpu_count()} CPUs; one run each, in a child process"
        ),
        (
            "# peak = the child's ru_maxrss (whole process); before = its RSS with both models and the input"
            " built"
        ),
        "",
        f"{'run':<34}{'result':<34}{'before':>11}{'peak RSS':>11}{'wall':>9}",
    ]
    for mode, label in (
        ("zoom", "bisect --levels zoom"),
        ("full", "bisect --levels full"),
        ("capture", "full capture of the reference"),
    ):
        row = rows[mode]
        if "error" in row:
            result = f"failed ({row['error'][:24]})"
        elif mode == "capture":
            result = f"{gib(row['captured_bytes'])} in {row['calls']} calls"
        else:
            result = f"culprit {row.get('culprit')}"
        before, peak = gib(row.get("rss_before", 0)), gib(row.get("peak_rss", 0))
        lines.append(f"{label:<34}{result:<34}{before:>11}{peak:>11}{row.get('seconds', 0):>8.1f}s")
    zoom = rows["zoom"]
    met = zoom.get("culprit") == CULPRIT and zoom.get("peak_rss", GOAL + 1) <= GOAL
    lines += [
        "",
        f"zoom entered: {zoom.get('entered')}",
        f"goal: zoom peak <= 2 GiB with the culprit named: {'met' if met else 'NOT met'}",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if write:
        RESULT.write_text(text)
    return 0 if met else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=BLOCKS)
    parser.add_argument("--child", default=None)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(options.child, options.blocks)), flush=True)
    else:
        sys.exit(main(options.blocks, write=options.blocks == BLOCKS))
