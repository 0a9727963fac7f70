"""Overhead of `paritykit.tracing.trace.capture` on a tiny UNet2DConditionModel (CPU), optionally beside torchlens.

Run: python benchmarks/bench_capture.py   (writes benchmarks/results/capture.txt)

The model is the one the issue names: block_out_channels (32, 64), layers_per_block 2, cross_attention_dim 32,
sample 32x32, batch 2. Each figure is the best of N interleaved timed runs after warm-up, all in one process under
torch.no_grad(); "naive" is a forward hook on every module that clones every input and output tensor.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from paritykit.tracing.trace import capture

RESULTS = Path(__file__).resolve().parent / "results" / "capture.txt"


def tiny_unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        cross_attention_dim=32,
        sample_size=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=32,
    ).eval()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
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

    model = tiny_unet()
    sample = torch.randn(2, 4, 32, 32)
    timestep = torch.tensor([10, 20])
    context = torch.randn(2, 7, 32)
    n_modules = sum(1 for _ in model.modules())

    def plain():
        with torch.no_grad():
            return model(sample, timestep, encoder_hidden_states=context).sample

    def captured():
        with torch.no_grad(), capture(model) as trace:
            model(sample, timestep, encoder_hidden_states=context)
        return trace

    def captured_outputs_only():
        with torch.no_grad(), capture(model, inputs=False):
            model(sample, timestep, encoder_hidden_states=context)

    def naive():
        store, handles = naive_hooks(model)
        try:
            plain()
        finally:
            for handle in handles:
                handle.remove()
        return store

    fns = {
        "plain forward": plain,
        "paritykit capture (inputs + outputs)": captured,
        "paritykit capture (outputs only)": captured_outputs_only,
        "naive hooks + clone of every tensor": naive,
    }
    best = interleaved_best(fns, args.repeats)
    t_plain = best["plain forward"]
    trace = captured()
    assert torch.equal(trace.root.output, plain()), "capture changed the model's output"
    rows = [(label, seconds, seconds / t_plain) for label, seconds in best.items()]

    # torchlens last and against its own plain baseline: it wraps torch functions, which must not slow the
    # figures above.
    try:
        import torchlens as tl

        def lens():
            with torch.no_grad():
                log = tl.trace(model, [sample, timestep], {"encoder_hidden_states": context})
            del log

        lens_best = interleaved_best({"plain": plain, "lens": lens}, max(5, args.repeats // 3))
        label = f"torchlens {getattr(tl, '__version__', '')} trace (every op saved)"
        rows.append((label, lens_best["lens"], lens_best["lens"] / lens_best["plain"]))
    except ImportError:
        rows.append(("torchlens (not installed)", None, None))
    except Exception as exc:  # a third-party failure must not hide our own figures
        rows.append((f"torchlens failed: {type(exc).__name__}: {exc}"[:100], None, None))

    lines = [
        f"# bench_capture: tiny UNet2DConditionModel, {n_modules} modules, {len(trace)} calls captured, "
        f"{trace.summary()['tensors']} tensors; batch 2, 32x32, CPU, {torch.get_num_threads()} threads",
        f"# torch {torch.__version__}, python {platform.python_version()}, best of {args.repeats} interleaved runs",
    ]
    for label, seconds, ratio in rows:
        if seconds is None:
            lines.append(f"{label:<48}  -")
        else:
            lines.append(f"{label:<48}  {seconds * 1e3:8.1f} ms  {ratio:6.2f}x")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
