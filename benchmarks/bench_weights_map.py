"""Benchmark: `infer_conversion_map` time vs state-dict size (near-linear in bytes, not quadratic in keys).

A real diffusers FluxTransformer2DModel (fresh init, so RMSNorm scales are constant and ambiguous) is
written into the original repository's layout (fused QKV and QKV+MLP, swapped shift/scale, renamed
prefixes) by the test helper, then mapped back. Two series: DEPTH (blocks x1, x2, x4: keys and bytes both
grow) and WIDTH (heads x1, x2: bytes x4 at a fixed key count). Median of 3 runs each.

    /work/venv/bin/python benchmarks/bench_weights_map.py  # writes benchmarks/results/weights_map.txt
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from paritykit.convert import infer_conversion_map  # noqa: E402
from test_convert import _research_layout  # noqa: E402  (the same research layout the tests map back)


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


def measure(label: str, layers: int, singles: int, heads: int) -> str:
    target = build(layers, singles, heads)
    source = _research_layout(target)
    mb = sum(t.numel() * t.element_size() for t in target.values()) / 2**20
    times = []
    for _ in range(3):
        started = time.perf_counter()
        cmap = infer_conversion_map(source, target)
        times.append(time.perf_counter() - started)
        assert cmap.exit_code == 0
    t = statistics.median(times)
    return (
        f"{label:<11} {len(source):>5} -> {len(target):>5} tensors  {mb:7.1f} MB  {t:6.3f} s  "
        f"{1000 * t / mb:6.2f} ms/MB  {1000 * t / len(target):6.2f} ms/tensor  "
        f"{len(cmap.rules)} rules, {len(cmap.ambiguous)} ambiguous"
    )


def measure_files(label: str, layers: int, singles: int, heads: int, folder: Path) -> str:
    from safetensors.torch import save_file

    target = build(layers, singles, heads)
    source = _research_layout(target)
    save_file({k: v.contiguous() for k, v in source.items()}, folder / "research.safetensors")
    save_file(target, folder / "diffusers.safetensors")
    mb = sum(t.numel() * t.element_size() for t in target.values()) / 2**20
    times = []
    for _ in range(3):
        started = time.perf_counter()
        cmap = infer_conversion_map(folder / "research.safetensors", folder / "diffusers.safetensors")
        times.append(time.perf_counter() - started)
        assert cmap.exit_code == 0
    t = statistics.median(times)
    return (
        f"{label:<11} {len(source):>5} -> {len(target):>5} tensors  {mb:7.1f} MB  {t:6.3f} s  "
        f"{1000 * t / mb:6.2f} ms/MB  {1000 * t / len(target):6.2f} ms/tensor  (read from .safetensors, memory-mapped)"
    )


def measure_constants(n: int) -> str:
    # the worst case for value matching: every tensor has the same value as n others (fresh norms)
    source = {
        f"blocks.{i}.norm.{kind}": torch.full((64,), float(kind == "weight"))
        for i in range(n)
        for kind in ("weight", "bias")
    }
    target = {
        f"layers.{i}.ln.{kind}": torch.full((64,), float(kind == "weight"))
        for i in range(n)
        for kind in ("weight", "bias")
    }
    started = time.perf_counter()
    cmap = infer_conversion_map(source, target)
    t = time.perf_counter() - started
    assert cmap.exit_code == 0 and all(
        a.chosen.split(".")[1] == a.target.split(".")[1] for a in cmap.ambiguous
    )
    return (
        f"constants  {len(source):>5} -> {len(target):>5} tensors, all {len(cmap.ambiguous)} ambiguous "
        f"(buckets of {n})  {t:6.3f} s  {1000 * t / len(target):6.2f} ms/tensor  {len(cmap.rules)} rule(s)"
    )


def main() -> None:
    torch.set_num_threads(1)
    lines = [
        "paritykit weights map: infer_conversion_map on a real FluxTransformer2DModel state dict",
        f"(research layout -> diffusers layout), median of 3, 1 torch thread, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}",
        "",
    ]
    warm = build(1, 1, 2)  # first-call costs (imports, allocator) stay out of the figures
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
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        lines.append(measure_files("files x4", 16, 32, 4, Path(tmp)))
        print(lines[-1], flush=True)
    lines += ["", "load average during the run: " + ", ".join(f"{x:.1f}" for x in os.getloadavg())]
    out = REPO / "benchmarks" / "results" / "weights_map.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
