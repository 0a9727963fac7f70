"""Benchmark: `weights map` of two ~1.1 GB bf16 safetensors files: time against reading both, peak memory.

A FluxTransformer2DModel (8 double + 16 single blocks, width 1024, bf16: 0.56 B parameters) is saved twice: in
the original repository's layout (fused QKV and QKV+MLP, swapped shift/scale, renamed; the test helper) and as
diffusers' state dict with the single blocks in text order (0, 1, 10, 11, …, 2, …), the slip of loading shards
sorted as strings. Each `infer_conversion_map` runs in a child process of its own, which reports its wall time
and its peak RSS growth (VmHWM after the run minus VmRSS before it, the peak reset first; torch and numpy
imported before). Reading both files once is timed with `cat` (warm page cache, as the mapping reads them).

    python benchmarks/bench_weights_map_files.py  # writes benchmarks/results/weights_map_files.txt
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = REPO / "tests" / "weights_map_child.py"


def write_pair(folder: Path) -> tuple[Path, Path, int]:
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "tests"))
    from test_convert import _research_layout  # the research layout the tests map back

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=8,
        num_single_layers=16,
        attention_head_dim=128,
        num_attention_heads=8,
        joint_attention_dim=1024,
        pooled_projection_dim=256,
        axes_dims_rope=(16, 56, 56),
    )
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    del model
    order = sorted(range(16), key=str)
    port = {}
    for key, value in sd.items():
        m = re.match(r"single_transformer_blocks\.(\d+)\.(.*)", key)
        port[key] = sd[f"single_transformer_blocks.{order[int(m[1])]}.{m[2]}"] if m else value
    source, target = folder / "research.safetensors", folder / "port.safetensors"
    save_file({k: v.contiguous() for k, v in _research_layout(sd).items()}, source)
    save_file(port, target)
    return source, target, sum(t.numel() * t.element_size() for t in sd.values())


def main() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "helpers"), os.environ.get("PYTHONPATH", "")]),
        "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
    }
    with tempfile.TemporaryDirectory() as tmp:
        source, target, nbytes = write_pair(Path(tmp))
        reads = []
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run(["cat", str(source), str(target)], stdout=subprocess.DEVNULL, check=True)
            reads.append(time.perf_counter() - start)
        runs = []
        for _ in range(3):
            done = subprocess.run(
                [sys.executable, str(CHILD), str(source), str(target)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            runs.append(json.loads(done.stdout.splitlines()[-1]))
        files = source.stat().st_size + target.stat().st_size
    read = statistics.median(reads)
    wall = statistics.median(r["wall"] for r in runs)
    growth = max(r["growth"] for r in runs)
    layer_order = runs[0]["layer_order"]
    lines = [
        "paritykit weights map: two bf16 safetensors files of a FluxTransformer2DModel (8 + 16 blocks,"
        " width 1024),",
        f"research layout vs diffusers with the single blocks in text order; {platform.machine()},"
        f" torch in a child per run, median of 3",
        "",
        f"files                 {files / 1e9:.2f} GB in all ({nbytes / 1e9:.2f} GB of weights per side)",
        f"cat of both files     {read:.2f} s (warm page cache)",
        f"weights map           {wall:.2f} s  = {wall / read:.1f}x the read;"
        f" peak RSS growth {growth / 2**20:.0f} MiB (max of 3)",
        f"answer                {runs[0]['rules']} rules, {runs[0]['unmapped']} unexplained,"
        f" layer order named: {layer_order}",
        "",
        f"load average during the run: {', '.join(f'{x:.1f}' for x in os.getloadavg())}",
    ]
    out = REPO / "benchmarks" / "results" / "weights_map_files.txt"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
