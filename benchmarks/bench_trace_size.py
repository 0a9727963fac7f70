"""What `paritykit trace --levels blocks` writes, against the weights of the model it traces.

A trace folder holds the activations of the calls it recorded and, for the weights, one fingerprint per
tensor (shape, dtype, sums, a position hash), never a copy: the checkpoint holds the weights already, and at
12 B parameters a copy was 24 GB per side. The model here is a synthetic DiT-shaped stack in bfloat16 (the
blocks of a Flux-like model at reduced width: attention projections, a 4x MLP, adaLN modulation), built on
the CPU with random weights; its size is set by --blocks and --width. Each side is traced through the same
library function the CLI calls (`paritykit.bisection.spec.trace_spec`), in a child process whose peak RSS is
read from ru_maxrss; a third child runs `bisect --traces` on the two folders with no SPEC (the weights are
then their hashes only).

    python benchmarks/bench_trace_size.py                 # 24 blocks of width 1536: ~1.4 GB of bf16 weights
    python benchmarks/bench_trace_size.py --blocks 2 --width 256 --no-write   # a quick check
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "trace_size.txt"
TOKENS = 1024

SPEC = textwrap.dedent(
    """
    import torch
    from torch import nn

    BLOCKS, WIDTH, TOKENS = {blocks}, {width}, {tokens}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mod = nn.Linear(WIDTH, 6 * WIDTH)
            self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
            self.proj = nn.Linear(WIDTH, WIDTH)
            self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
            self.fc2 = nn.Linear(4 * WIDTH, WIDTH)
            self.heads = WIDTH // 64

        def forward(self, x, c):
            s1, b1, g1, s2, b2, g2 = self.mod(c)[:, None].chunk(6, dim=-1)
            h = nn.functional.layer_norm(x, x.shape[-1:]) * (1 + s1) + b1
            q, k, v = self.qkv(h).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
            x = x + g1 * self.proj(a)
            h = nn.functional.layer_norm(x, x.shape[-1:]) * (1 + s2) + b2
            return x + g2 * self.fc2(nn.functional.gelu(self.fc1(h), approximate="tanh"))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.out = nn.Linear(WIDTH, WIDTH)

        def forward(self, x, c):
            for block in self.blocks:
                x = block(x, c)
            return self.out(x)

    def build(seed):
        torch.manual_seed(seed)
        return Model().to(torch.bfloat16).eval()

    def build_reference():
        return build(0)

    def build_port():
        return build(0)

    def make_inputs():
        g = torch.Generator().manual_seed(1)
        x = torch.randn(1, TOKENS, WIDTH, generator=g).to(torch.bfloat16)
        c = torch.randn(1, WIDTH, generator=g).to(torch.bfloat16)
        return (x, c), {{}}
    """
)


def child(spec: str, side: str, out: str) -> dict:
    import resource

    import torch

    torch.set_num_threads(2)
    from paritykit.bisection.spec import trace_spec

    started = time.perf_counter()
    summary = trace_spec(spec, side=side, out=out, levels="blocks")
    seconds = time.perf_counter() - started
    folder = Path(out)
    written = {f.name: f.stat().st_size for f in folder.iterdir() if f.is_file()}
    return {
        "side": side,
        "seconds": seconds,
        "calls": summary.calls,
        "trace_bytes": sum(written.values()),
        "weights_bytes_in_folder": sum(v for k, v in written.items() if k.startswith("weights")),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def bisect_child(reference: str, port: str) -> dict:
    import resource

    import torch

    torch.set_num_threads(2)
    from paritykit.bisection.entry import bisect_traces
    from paritykit.tracing.trace import Trace

    started = time.perf_counter()
    report = bisect_traces(Trace.load(reference), Trace.load(port))
    return {
        "side": "bisect --traces",
        "verdict": report.verdict,
        "pairs_by_weights": sum(p.how == "weights" for p in report.alignment.pairs),
        "seconds": time.perf_counter() - started,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def weight_bytes(blocks: int, width: int) -> int:
    per_block = (6 + 3 + 1 + 4 + 4) * width * width + (6 + 3 + 1 + 4 + 1) * width
    return 2 * (blocks * per_block + width * width + width)


def main(blocks: int, width: int, write: bool) -> int:
    import os
    import platform

    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "SPEC.py"
        spec.write_text(SPEC.format(blocks=blocks, width=width, tokens=TOKENS))
        for side in ("reference", "port"):
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(spec), side, str(Path(tmp) / side)],
                capture_output=True,
                text=True,
            )
            found = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if not found:
                print((done.stderr.strip().splitlines() or ["no output"])[-1], file=sys.stderr)
                return 2
            rows.append(json.loads(found[-1]))
        done = subprocess.run(
            [sys.executable, __file__, "--bisect", str(Path(tmp) / "reference"), str(Path(tmp) / "port")],
            capture_output=True,
            text=True,
        )
        found = [line for line in done.stdout.splitlines() if line.startswith("{")]
        searched = json.loads(found[-1]) if found else None
    weights = weight_bytes(blocks, width)
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    lines = [
        f"# bench_trace_size: {blocks} DiT-shaped blocks of width {width}, {TOKENS} tokens, bfloat16, CPU;"
        f" {weights / 1e9:.2f} GB of weights per side",
        f"# paritykit trace --levels blocks, one child process per side; torch {torch.__version__}, python"
        f" {platform.python_version()}, {cpu}, {os.cpu_count()} CPUs",
        "",
        f"{'side':<11}{'calls':>7}{'trace folder':>15}{'of it weights':>15}{'/ weights':>11}{'peak RSS':>11}"
        f"{'wall':>8}",
    ]
    for row in rows:
        lines.append(
            f"{row['side']:<11}{row['calls']:>7}{row['trace_bytes'] / 1e6:>12.1f} MB"
            f"{row['weights_bytes_in_folder'] / 1e6:>12.2f} MB{row['trace_bytes'] / weights:>10.4f}x"
            f"{row['peak_rss'] / 2**30:>8.2f} GiB{row['seconds']:>7.1f}s"
        )
    if searched is not None:
        lines += [
            "",
            f"bisect --traces of the two folders, no SPEC: verdict {searched['verdict']},"
            f" {searched['pairs_by_weights']} module pairs aligned by the weight hashes, peak RSS"
            f" {searched['peak_rss'] / 2**30:.2f} GiB, {searched['seconds']:.1f} s",
        ]
    text = "\n".join(lines)
    print(text)
    if write:
        RESULT.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(*sys.argv[2:])))
        sys.exit(0)
    if len(sys.argv) == 4 and sys.argv[1] == "--bisect":
        print(json.dumps(bisect_child(*sys.argv[2:])))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    sys.exit(main(args.blocks, args.width, not args.no_write))
