"""Overhead of `paritykit.tracing.trace.capture` on a forward pass (CPU), against plain forward hooks.

Run: python benchmarks/bench_capture.py   (writes benchmarks/results/capture.txt)

Two models built from configs: the tiny UNet2DConditionModel (block_out_channels (32, 64), layers_per_block 2,
cross_attention_dim 32, sample 32x32, batch 2) and a Flux-shaped FluxTransformer2DModel (2 double-stream and 4
single-stream blocks, 2 heads of 32, 1024 image + 64 text tokens, batch 1). Each figure is the best of N
interleaved timed runs after warm-up, all in one process under torch.no_grad().

The baseline the goal is stated against is *plain forward hooks*: a pre- and a post-hook on every module, as
`capture` registers, that keep references to each call's inputs and outputs (what a hand-written recorder does
before it worries about in-place changes). `capture` does that and also names calls, nests them, copies each
tensor once (a tensor seen again is not copied again) and keeps the structure for replay. "naive" is a hook on
every module that clones every input and output tensor. torchlens (if installed) is timed on the UNet only.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel
from paritykit.tracing.trace import capture

RESULTS = Path(__file__).resolve().parent / "results" / "capture.txt"
GOAL = 1.2


def tiny_unet() -> tuple[torch.nn.Module, tuple, dict, str]:
    torch.manual_seed(0)
    model = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        cross_attention_dim=32,
        sample_size=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=32,
    ).eval()
    args = (torch.randn(2, 4, 32, 32), torch.tensor([10, 20]))
    return (
        model,
        args,
        {"encoder_hidden_states": torch.randn(2, 7, 32)},
        "tiny UNet2DConditionModel, batch 2, 32x32",
    )


def flux_shaped() -> tuple[torch.nn.Module, tuple, dict, str]:
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        axes_dims_rope=(8, 12, 12),
    ).eval()
    image, text = 1024, 64
    kwargs = {
        "hidden_states": torch.randn(1, image, 16),
        "encoder_hidden_states": torch.randn(1, text, 64),
        "pooled_projections": torch.randn(1, 32),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(image, 3),
        "txt_ids": torch.zeros(text, 3),
    }
    return model, (), kwargs, f"FluxTransformer2DModel 2+4 blocks, batch 1, {image}+{text} tokens, dim 64"


def interleaved_best(fns: dict, repeats: int) -> dict[str, float]:
    """Best time of each function, runs interleaved so machine load hits all of them alike (timeit's rule:
    the minimum is the figure least disturbed by other processes)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


def plain_hooks(model):
    """A pre- and a post-hook on every module keeping references to inputs and outputs (no copies)."""
    store = []

    def pre(module, args, kwargs):
        store.append((args, kwargs))

    def post(module, args, kwargs, output):
        store.append(output)

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return store, handles


def naive_hooks(model):
    store = []

    def clone_all(obj):
        if isinstance(obj, torch.Tensor):
            store.append(obj.detach().clone())
        elif isinstance(obj, (tuple, list)):
            for item in obj:
                clone_all(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                clone_all(item)

    def hook(module, args, kwargs, output):
        clone_all(args)
        clone_all(kwargs)
        clone_all(output)

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in model.modules()]
    return store, handles


def _hooked(model, make_hooks, forward):
    def run():
        store, handles = make_hooks(model)
        try:
            forward()
        finally:
            for handle in handles:
                handle.remove()
        return store

    return run


def measure(build, repeats: int, lens: bool) -> list[str]:
    model, args, kwargs, label = build()
    n_modules = sum(1 for _ in model.modules())

    def plain():
        with torch.no_grad():
            return model(*args, **kwargs).sample

    def captured():
        with torch.no_grad(), capture(model) as trace:
            model(*args, **kwargs)
        return trace

    def captured_outputs_only():
        with torch.no_grad(), capture(model, inputs=False):
            model(*args, **kwargs)

    fns = {
        "plain forward": plain,
        "plain forward hooks (references)": _hooked(model, plain_hooks, plain),
        "paritykit capture (inputs + outputs)": captured,
        "paritykit capture (outputs only)": captured_outputs_only,
        "naive hooks + clone of every tensor": _hooked(model, naive_hooks, plain),
    }
    best = interleaved_best(fns, repeats)
    trace = captured()
    assert torch.equal(trace.root.output, plain()), "capture changed the model's output"
    t_plain, t_hooks = best["plain forward"], best["plain forward hooks (references)"]
    rows = [(name, seconds, seconds / t_plain, seconds / t_hooks) for name, seconds in best.items()]

    # torchlens last and against its own plain baseline: it wraps torch functions, which must not slow the
    # figures above.
    if lens:
        try:
            import torchlens as tl

            def traced():
                with torch.no_grad():
                    log = tl.trace(model, list(args), kwargs)
                del log

            lens_best = interleaved_best({"plain": plain, "lens": traced}, max(5, repeats // 3))
            name = f"torchlens {getattr(tl, '__version__', '')} trace (every op saved)"
            rows.append((name, lens_best["lens"], lens_best["lens"] / lens_best["plain"], None))
        except ImportError:
            rows.append(("torchlens (not installed)", None, None, None))
        except Exception as exc:  # a third-party failure must not hide our own figures
            rows.append((f"torchlens failed: {type(exc).__name__}: {exc}"[:100], None, None, None))

    ratio = best["paritykit capture (inputs + outputs)"] / t_hooks
    lines = [
        f"## {label}: {n_modules} modules, {len(trace)} calls captured, {trace.summary()['tensors']} tensors",
        f"{'':<48}  {'best':>11}  {'vs plain':>8}  {'vs hooks':>8}",
    ]
    for name, seconds, vs_plain, vs_hooks in rows:
        if seconds is None:
            lines.append(f"{name:<48}  -")
            continue
        hooks = f"{vs_hooks:7.2f}x" if vs_hooks is not None else f"{'-':>8}"
        lines.append(f"{name:<48}  {seconds * 1e3:8.1f} ms  {vs_plain:7.2f}x  {hooks}")
    verdict = "met" if ratio <= GOAL else "NOT met"
    lines.append(
        f"capture (inputs + outputs) / plain forward hooks = {ratio:.2f}x; goal <= {GOAL}x: {verdict}"
    )
    return lines


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=60)  # fewer leave the minima to the machine's noise
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (1 gives steadier figures on a busy machine; default: torch's choice)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")), "?")
    lines = [
        (
            f"# bench_capture: torch {torch.__version__}, python {platform.python_version()}, {cpu},"
            f" {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads; best of {args.repeats}"
            " interleaved runs"
        ),
    ]
    for build, lens in ((tiny_unet, True), (flux_shaped, False)):
        lines += ["", *measure(build, args.repeats, lens)]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
