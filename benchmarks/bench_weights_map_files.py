"""Benchmark: `weights map` of two bf16 safetensors files: time against reading both, peak memory.

A FluxTransformer2DModel (8 double + 16 single blocks, width 1024, bf16: 0.56 B parameters) is saved twice: in
the original repository's layout (fused QKV and QKV+MLP, swapped shift/scale, renamed; the test helper) and as
diffusers' state dict with the single blocks in text order (0, 1, 10, 11, …, 2, …), the slip of loading shards
sorted as strings. Each `infer_conversion_map` runs in a child process of its own, which reports its wall time
and its peak RSS growth (VmHWM after the run minus VmRSS before it, the peak reset first; torch and numpy
imported before). Reading both files once is timed with `cat` (warm page cache, as the mapping reads them).

    python benchmarks/bench_weights_map_files.py  # writes benchmarks/results/weights_map_files.txt

``--depth dev`` builds the pair at FLUX.1-dev's depth (19 double + 38 single blocks, width 1024: 2 × ~2.7 GB)
and, where a cgroup-v1 memory controller is writable (``/sys/fs/cgroup/memory``), runs each child in a memory
cgroup limited to ``--limit`` GiB (1.5 by default), page cache included: pages of a file read once can be
reclaimed under the limit, a copy of both files cannot, and the kernel kills the child that holds one. Writes
``benchmarks/results/weights_map_files_dev.txt``.
"""

from __future__ import annotations

import argparse
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


# (double blocks, single blocks) per depth
DEPTHS = {"small": (8, 16), "dev": (19, 38)}


def write_pair(folder: Path, depth: str = "small") -> tuple[Path, Path, int]:
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO / "tests"))
    from test_convert import _research_layout  # the research layout the tests map back

    double, single = DEPTHS[depth]
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=128,
        num_attention_heads=8,
        joint_attention_dim=1024,
        pooled_projection_dim=256,
        axes_dims_rope=(16, 56, 56),
    )
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    del model
    order = sorted(range(single), key=str)
    port = {}
    for key, value in sd.items():
        m = re.match(r"single_transformer_blocks\.(\d+)\.(.*)", key)
        port[key] = sd[f"single_transformer_blocks.{order[int(m[1])]}.{m[2]}"] if m else value
    source, target = folder / "research.safetensors", folder / "port.safetensors"
    save_file({k: v.contiguous() for k, v in _research_layout(sd).items()}, source)
    save_file(port, target)
    return source, target, sum(t.numel() * t.element_size() for t in sd.values())


CGROUPS = Path("/sys/fs/cgroup/memory")


def memory_cgroup(gib: float) -> Path | None:
    r"""A fresh cgroup-v1 memory group limited to ``gib`` GiB, or ``None`` where none can be made."""
    group = CGROUPS / f"paritykit_bench_{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(int(gib * 2**30)))
    except OSError:
        return None
    return group


def _join(group: Path):
    def enter() -> None:  # runs in the child before it execs: the child and what it reads are charged there
        (group / "cgroup.procs").write_text(str(os.getpid()))

    return enter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", choices=sorted(DEPTHS), default="small")
    parser.add_argument(
        "--limit", type=float, default=1.5, help="memory cgroup limit in GiB (dev depth only)"
    )
    options = parser.parse_args()
    group = memory_cgroup(options.limit) if options.depth == "dev" else None
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "helpers"), os.environ.get("PYTHONPATH", "")]),
        "MALLOC_MMAP_THRESHOLD_": str(1 << 20),
    }
    with tempfile.TemporaryDirectory() as tmp:
        source, target, nbytes = write_pair(Path(tmp), options.depth)
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
                preexec_fn=_join(group) if group is not None else None,
            )
            runs.append(json.loads(done.stdout.splitlines()[-1]))
        peak = int((group / "memory.max_usage_in_bytes").read_text()) if group is not None else None
        copied = None
        if group is not None:
            # the limit holds: a child that copies both files into memory is killed under it
            copy = (
                "from safetensors.torch import load_file; import sys;"
                " kept = [{k: v.clone() for k, v in load_file(p).items()} for p in sys.argv[1:]]"
            )
            done = subprocess.run(
                [sys.executable, "-c", copy, str(source), str(target)],
                capture_output=True,
                preexec_fn=_join(group),
            )
            copied = done.returncode
            group.rmdir()
        files = source.stat().st_size + target.stat().st_size
    read = statistics.median(reads)
    wall = statistics.median(r["wall"] for r in runs)
    growth = max(r["growth"] for r in runs)
    layer_order = runs[0]["layer_order"]
    double, single = DEPTHS[options.depth]
    if group is not None:
        fate = "killed" if copied is not None and copied < 0 else f"exit {copied}"
        limit = (
            f"; each child in a memory cgroup limited to {options.limit:g} GiB, page cache included"
            f" (peak usage {peak / 2**30:.2f} GiB; a child copying both files into memory there: {fate})"
        )
    else:
        limit = (
            "; no memory cgroup could be made here: the limit was not applied"
            if options.depth == "dev"
            else ""
        )
    lines = [
        f"paritykit weights map: two bf16 safetensors files of a FluxTransformer2DModel ({double} + {single}"
        " blocks, width 1024),",
        f"research layout vs diffusers with the single blocks in text order; {platform.machine()},"
        f" torch in a child per run, median of 3{limit}",
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
    name = "weights_map_files.txt" if options.depth == "small" else f"weights_map_files_{options.depth}.txt"
    out = REPO / "benchmarks" / "results" / name
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
