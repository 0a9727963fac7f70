"""Benchmark: `infer_conversion_map` time vs state-dict size (near-linear in bytes, not quadratic in keys).

A real diffusers FluxTransformer2DModel (fresh init, so RMSNorm scales are constant and ambiguous) is
written into the original repository's layout (fused QKV and QKV+MLP, swapped shift/scale, renamed
prefixes) by the test helper, then mapped back. Series:

- DEPTH (blocks x1, x2, x4): keys and bytes both grow;
- WIDTH (heads x1, x2): bytes x4 at a fixed key count;
- CONSTANTS: every tensor shares its value with n others (the worst case for value matching);
- FILES: the DEPTH x4 pair read from .safetensors (memory-mapped) instead of dicts in memory.

Figures are the median CPU seconds of this process (one torch thread) over 5 runs (constants: 3): the
machine is shared, and wall time moves with everyone else's load (wall medians are shown too).

    /work/venv/bin/python benchmarks/bench_weights_map.py  # writes benchmarks/results/weights_map.txt
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from paritykit.forensics.conversion.matching import infer_conversion_map  # noqa: E402
from test_convert import _research_layout  # noqa: E402  (the same research layout the tests map back)


def timed(fn: Callable[[], Any], repeats: int = 5) -> tuple[float, float, Any]:
    """Median wall and CPU seconds over ``repeats`` calls, and the last result."""
    walls, cpus, result = [], [], None
    for _ in range(repeats):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - wall0)
        cpus.append(time.process_time() - cpu0)
    return statistics.median(walls), statistics.median(cpus), result


def build(layers: int, singles: int, heads: int, head_dim: int = 64) -> dict[str, torch.Tensor]:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=layers,
        num_single_layers=singles,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=128,
        pooled_projection_dim=128,
        axes_dims_rope=(16, 24, 24),
    )
    return model.state_dict()


def _line(label: str, source: dict, target: dict, wall: float, cpu: float, note: str) -> str:
    mb = sum(t.numel() * t.element_size() for t in target.values()) / 2**20
    return (
        f"{label:<9} {len(source):>4} -> {len(target):>4} tensors {mb:6.1f} MB  cpu {cpu:6.3f} s"
        f" {f'{1000 * cpu / mb:5.2f}' if mb >= 1 else '    -'} ms/MB {1000 * cpu / len(target):5.2f}"
        f" ms/tensor  (wall {wall:.3f} s)  {note}"
    )


def measure(label: str, layers: int, singles: int, heads: int) -> str:
    target = build(layers, singles, heads)
    source = _research_layout(target)
    wall, cpu, cmap = timed(lambda: infer_conversion_map(source, target))
    assert cmap.exit_code == 0
    return _line(
        label, source, target, wall, cpu, f"{len(cmap.rules)} rules, {len(cmap.ambiguous)} ambiguous"
    )


def measure_files(label: str, layers: int, singles: int, heads: int, folder: Path) -> str:
    from safetensors.torch import save_file

    target = build(layers, singles, heads)
    source = _research_layout(target)
    save_file({k: v.contiguous() for k, v in source.items()}, folder / "research.safetensors")
    save_file(target, folder / "diffusers.safetensors")
    paths = (folder / "research.safetensors", folder / "diffusers.safetensors")
    wall, cpu, cmap = timed(lambda: infer_conversion_map(*paths))
    assert cmap.exit_code == 0
    return _line(label, source, target, wall, cpu, "read from .safetensors (memory-mapped)")


def measure_constants(n: int) -> str:
    # every tensor has the same value as n others, as in a freshly initialised model's norms
    source = {
        f"blocks.{i}.norm.{k}": torch.full((64,), float(k == "weight"))
        for i in range(n)
        for k in ("weight", "bias")
    }
    target = {
        f"layers.{i}.ln.{k}": torch.full((64,), float(k == "weight"))
        for i in range(n)
        for k in ("weight", "bias")
    }
    wall, cpu, cmap = timed(lambda: infer_conversion_map(source, target), repeats=3)
    assert cmap.exit_code == 0
    assert all(a.chosen.split(".")[1] == a.target.split(".")[1] for a in cmap.ambiguous)
    return _line(
        "constants", source, target, wall, cpu, f"all {len(cmap.ambiguous)} ambiguous, buckets of {n}"
    )


def main() -> None:
    torch.set_num_threads(1)
    lines = [
        "paritykit weights map: infer_conversion_map, research layout -> diffusers layout of a real",
        (
            "FluxTransformer2DModel state dict; median CPU seconds of 5 runs (constants: 3), 1 torch thread, "
            f"{platform.machine()}, torch {torch.__version__}"
        ),
        "",
    ]
    warm = build(4, 8, 4)  # first-call costs (imports, allocator growth) stay out of the figures
    infer_conversion_map(_research_layout(warm), warm)
    for label, scale in (("depth x1", 1), ("depth x2", 2), ("depth x4", 4)):
        lines.append(measure(label, 4 * scale, 8 * scale, 4))
        print(lines[-1], flush=True)
    for label, heads in (("width x1", 4), ("width x2", 8)):
        lines.append(measure(label, 4, 8, heads))
        print(lines[-1], flush=True)
    for n in (500, 1000, 2000):
        lines.append(measure_constants(n))
        print(lines[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        lines.append(measure_files("files x4", 16, 32, 4, Path(tmp)))
        print(lines[-1], flush=True)
    lines += ["", "load average during the run: " + ", ".join(f"{x:.1f}" for x in os.getloadavg())]
    out = REPO / "benchmarks" / "results" / "weights_map.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
