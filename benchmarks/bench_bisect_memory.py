"""Bisect by levels (zoom) vs a full capture: memory and wall time on a FluxTransformer2DModel built from config.

A port with one planted bug (the GELU of `single_transformer_blocks.1` without the tanh approximation) is
bisected against its reference. Each measurement runs in its own child process:

* the budget is enforced with RLIMIT_AS: after torch is imported, the models are built and the inputs made,
  the child's address space is capped at its current size + 2 GiB, so everything the bisect (captures,
  replays, alignment) allocates must fit in 2 GiB;
* peak resident memory is the child's `ru_maxrss` (resource.getrusage), reported as the rise over the RSS
  measured just before the bisect started.

Runs: zoom bisect under the 2 GiB cap; full-capture bisect under the same cap; and, without a cap, a full
capture of the reference alone (what one side of a full-capture bisect holds; the bisect holds both sides).

    python benchmarks/bench_bisect_memory.py            # the measured size (several minutes on a busy CPU)
    python benchmarks/bench_bisect_memory.py --blocks 6 # a quick check of the mechanics
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
BUDGET = 2 * 2**30
BATCH, SIDE, TEXT = 128, 8, 8  # 64 image tokens + 8 text tokens per sample
CULPRIT = "single_transformer_blocks.1.act_mlp"


def build(blocks: int):
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    reference = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=blocks,
        attention_head_dim=32,
        num_attention_heads=1,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(8, 12, 12),
    ).eval()
    import copy

    port = copy.deepcopy(reference)
    port.single_transformer_blocks[1].act_mlp = torch.nn.GELU()  # the reference uses approximate="tanh"
    n = SIDE * SIDE
    inputs = {
        "hidden_states": torch.randn(BATCH, n, 16),
        "encoder_hidden_states": torch.randn(BATCH, TEXT, 32),
        "pooled_projections": torch.randn(BATCH, 16),
        "timestep": torch.full((BATCH,), 0.5),
        "img_ids": torch.zeros(n, 3),
        "txt_ids": torch.zeros(TEXT, 3),
    }
    return reference, port, inputs


def _vm_and_rss() -> tuple[int, int]:
    fields = dict(
        line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmSize"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


def child(mode: str, blocks: int) -> dict:
    import resource

    import torch

    torch.set_num_threads(2)
    reference, port, inputs = build(blocks)
    vm, rss = _vm_and_rss()
    if mode != "capture-unlimited":
        resource.setrlimit(resource.RLIMIT_AS, (vm + BUDGET, vm + BUDGET))
    started = time.perf_counter()
    out = {"mode": mode, "modules": sum(1 for _ in reference.named_modules()), "rss_before": rss}
    try:
        if mode == "capture-unlimited":
            from paritykit.tracing.trace import capture

            with torch.no_grad(), capture(reference) as trace:
                reference(**inputs)
            out["captured_bytes"] = trace.summary()["bytes_in_memory"]
            out["calls"] = len(trace)
        else:
            from paritykit.bisection.search import bisect

            report = bisect(reference, port, ((), inputs), levels=mode)
            out["culprit"] = report.culprit.reference if report.culprit else None
            out["entered"] = report.environment.get("entered")
            out["ok"] = True
    except (MemoryError, RuntimeError) as exc:  # torch's allocator raises RuntimeError when the cap is hit
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    out["seconds"] = time.perf_counter() - started
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run_child(mode: str, blocks: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", mode, "--blocks", str(blocks)], capture_output=True, text=True
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"mode": mode, "ok": False, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def main(blocks: int, write: bool) -> int:
    import platform

    import torch

    rows = [run_child(mode, blocks) for mode in ("zoom", "full", "capture-unlimited")]
    zoom, full, capture = rows
    lines = [
        f"# bench_bisect_memory: FluxTransformer2DModel from config, 1 + {blocks} blocks, "
        f"{zoom.get('modules')} modules, batch {BATCH}, {SIDE * SIDE}+{TEXT} tokens, dim 32; float32, CPU",
        f"# planted bug: {CULPRIT} (GELU without tanh); torch {torch.__version__}, python "
        f"{platform.python_version()}; one run each, in a child process",
        "# budget: RLIMIT_AS = the child's address space after building the models + 2 GiB; peak = ru_maxrss",
        "",
        f"{'run':<44}{'result':<40}{'peak RSS rise':>15}{'wall':>10}",
    ]
    for row, label in (
        (zoom, "bisect --levels zoom, 2 GiB cap"),
        (full, "bisect --levels full, 2 GiB cap"),
        (capture, "full capture of the reference alone, no cap"),
    ):
        if "captured_bytes" in row:
            result = f"{gib(row['captured_bytes'])} captured ({row['calls']} calls)"
        elif row.get("ok"):
            result = f"culprit {row.get('culprit')}"
        else:
            result = f"failed ({row.get('error', '?')[:34]})"
        rise = row.get("peak_rss", 0) - row.get("rss_before", 0)
        lines.append(f"{label:<44}{result:<40}{gib(rise):>15}{row.get('seconds', 0):>9.1f}s")
    lines.append("")
    lines.append(f"zoom entered: {zoom.get('entered')}")
    text = "\n".join(lines) + "\n"
    print(text)
    if write:
        RESULT.write_text(text)
    named = zoom.get("ok") and zoom.get("culprit") == CULPRIT
    return 0 if named and not full.get("ok") else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=150)
    parser.add_argument("--child", default=None)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(options.child, options.blocks)), flush=True)
    else:
        sys.exit(main(options.blocks, write=options.blocks == 150))
