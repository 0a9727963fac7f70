"""paritykit at the size of today's models, on their device: a FLUX.1-dev-size port in bfloat16.

Both sides are diffusers' `FluxTransformer2DModel` at FLUX.1-dev's config (19 double-stream and 38
single-stream blocks, width 3072, 11.9 B parameters), built on the device in bfloat16 with seeded random
weights; the port is the reference's weights with one planted slip, the shift and scale rows of one
single-stream block's modulation swapped (the conversion slip bisect must name). Inputs are FLUX.1-dev's
shapes at 1024x1024: 4096 image tokens of 64 channels and 512 text tokens of width 4096.

Run with no --scale (what ../shared/gpu runs), it does, each step printing its wall time and peak memory (on
CUDA the allocator's peak, reset per step; the process's peak RSS, reset per step through
/proc/self/clear_refs where the kernel allows it):

1. the worked example: `paritykit demo`, then its buggy port bisected with the models on the device;
2. a tiny Flux port, then 3. the FLUX.1-dev-size port (on CUDA only), each:
   `paritykit trace --levels blocks` of both sides in child processes (the folder's size: activations and
   weight fingerprints, never a copy of the weights), `bisect --traces` of the two folders in a child (its
   peak RSS is what the traces cost on the CPU), building both models, one forward of each, and `bisect`
   (zoom, one level of blocks at a time).

    python benchmarks/gpu_scale.py                             # demo, tiny, FLUX.1-dev size, on cuda
    python benchmarks/gpu_scale.py --scale tiny --device cpu   # one scale's steps on a tiny Flux, in seconds

Exit status: 0 when every bisect names its planted slip, 1 when one does not, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the single-stream block whose modulation rows the port holds swapped, by scale
SLIP_BLOCK = {"dev": 20, "tiny": 2}

DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# the same model, small: seconds on a CPU
TINY = {**DEV, "in_channels": 16, "num_layers": 1, "num_single_layers": 4, "attention_head_dim": 16}
TINY.update(num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
CONFIGS = {"dev": DEV, "tiny": TINY}
TOKENS = {"dev": (4096, 512), "tiny": (64, 8)}


def build(scale: str, device: str, slip: bool):
    import torch
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(
        torch.bfloat16
    )  # built in bfloat16: a float32 copy of 12 B would not fit beside it
    try:
        with torch.device(device):
            model = FluxTransformer2DModel(**CONFIGS[scale]).eval()
    finally:
        torch.set_default_dtype(default)
    if slip:
        with (
            torch.no_grad()
        ):  # AdaLayerNormZeroSingle: rows (shift, scale, gate); the port reads them swapped
            linear = model.single_transformer_blocks[SLIP_BLOCK[scale]].norm.linear
            shift, scale_, gate = linear.weight.chunk(3)
            linear.weight.copy_(torch.cat([scale_, shift, gate]))
            shift, scale_, gate = linear.bias.chunk(3)
            linear.bias.copy_(torch.cat([scale_, shift, gate]))
    return model


def inputs(scale: str, device: str):
    import torch

    config, (image, text) = CONFIGS[scale], TOKENS[scale]
    g = torch.Generator().manual_seed(1)
    bf16 = dict(dtype=torch.bfloat16)
    side = int(image**0.5)
    ids = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij"), -1).reshape(
        -1, 2
    )
    kwargs = dict(
        hidden_states=torch.randn(1, image, config["in_channels"], generator=g).to(**bf16),
        encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"], generator=g).to(**bf16),
        pooled_projections=torch.randn(1, config["pooled_projection_dim"], generator=g).to(**bf16),
        timestep=torch.tensor([0.5]).to(**bf16),
        img_ids=torch.cat([torch.zeros(image, 1), ids.float()], dim=1),
        txt_ids=torch.zeros(text, 3),
        guidance=torch.tensor([3.5]).to(**bf16),
        return_dict=False,
    )
    return (), {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def _peak_rss() -> int | None:
    r"""The process's peak resident memory (VmHWM) in bytes; None where /proc does not say."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024
    except (OSError, StopIteration, ValueError):
        return None


class Meter:
    r"""Wall time and peak memory of one step: the device allocator's peak on CUDA, and the process's peak
    resident memory (reset per step through /proc/self/clear_refs; where that cannot be reset, the
    process's peak since it started, said so)."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self) -> Meter:
        import torch

        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self.since = "step"
        except OSError:
            self.since = "process start"
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        self.gpu = None
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.gpu = torch.cuda.max_memory_allocated()
        self.rss = _peak_rss()
        self.seconds = time.perf_counter() - self.started


def say(step: str, meter: Meter, result: str = "") -> None:
    gpu = f"GPU peak {meter.gpu / 2**30:6.2f} GiB   " if meter.gpu is not None else ""
    rss = f"{meter.rss / 2**30:6.2f} GiB" if meter.rss is not None else "n/a"
    since = "" if meter.since == "step" else f" (since {meter.since})"
    print(f"{step:<30} {meter.seconds:8.1f} s   {gpu}peak RSS {rss}{since}   {result}", flush=True)


SPEC = """
import sys
sys.path.insert(0, {here!r})
from gpu_scale import build, inputs

def build_reference():
    return build({scale!r}, {device!r}, slip=False)

def build_port():
    return build({scale!r}, {device!r}, slip=True)

def make_inputs():
    return inputs({scale!r}, {device!r})
"""


def trace_child(spec: str, out: str, device: str, side: str) -> None:
    from paritykit.bisection.spec import trace_spec

    with Meter(device) as meter:
        summary = trace_spec(spec, side=side, out=out, device=device, levels="blocks")
    size = sum(f.stat().st_size for f in Path(out).rglob("*") if f.is_file())
    say(f"trace --levels blocks ({side})", meter, f"{summary.calls} calls, folder {size / 2**30:.2f} GiB")


def traces_child(reference: str, port: str, scale: str) -> None:
    r"""``bisect --traces`` of the two folders, no SPEC: what the trace files alone say, on the CPU."""
    from paritykit.bisection.spec import bisect_spec

    with Meter("cpu") as meter:
        report = bisect_spec(traces=(reference, port))
    culprit = report.culprit.port if report.culprit is not None else "-"
    say("bisect --traces (no SPEC)", meter, f"verdict {report.verdict}, at {culprit}")


def _child(function: str, *args: str, limit: float) -> None:
    here = str(Path(__file__).resolve().parent)
    code = f"import sys; sys.path.insert(0, {here!r}); import gpu_scale as g; g.{function}(*sys.argv[1:])"
    try:  # a child process, so the parent's models are not in memory at the same time
        subprocess.run([sys.executable, "-c", code, *args], check=False, timeout=limit)
    except subprocess.TimeoutExpired:
        print(f"{function}: stopped after {limit:.0f} s", flush=True)


def demo(device: str) -> bool:
    r"""The worked example: written by ``paritykit demo``, its buggy port bisected with the models on
    ``device``; True when the known culprit (time_mix) is named."""
    from paritykit.bisection.spec import bisect_spec

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "paritykit", "demo", "--out", f"{tmp}/demo"],
            capture_output=True,
            check=False,
        )
        print(f"{'paritykit demo (CPU)':<30} {time.perf_counter() - started:8.1f} s", flush=True)
        with Meter(device) as meter:
            report = bisect_spec(f"{tmp}/demo/bisect_buggy.py", device=device)
    culprit = report.culprit.reference if report.culprit is not None else "-"
    say(f"demo: bisect --device {device}", meter, f"verdict {report.verdict}, culprit {culprit}")
    return culprit == "time_mix"


def main(scale: str, device: str, traces: bool = True) -> bool:
    import torch
    from paritykit.bisection.entry import bisect

    params = {"dev": "11.9 B", "tiny": "tiny"}[scale]
    print(
        f"# FluxTransformer2DModel at {scale} size ({params} parameters), bfloat16, on {device}", flush=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.py"
        here = str(Path(__file__).resolve().parent)
        spec.write_text(SPEC.format(here=here, scale=scale, device=device))
        if traces:
            for side in ("reference", "port"):
                _child("trace_child", str(spec), f"{tmp}/{side}", device, side, limit=240)
            _child("traces_child", f"{tmp}/reference", f"{tmp}/port", scale, limit=180)
    with Meter(device) as meter:
        reference, port = build(scale, device, slip=False), build(scale, device, slip=True)
    count = sum(p.numel() for p in reference.parameters())
    say("build both models", meter, f"{count:,} parameters each")
    args, kwargs = inputs(scale, device)
    for name, model in (("reference", reference), ("port", port)):
        with Meter(device) as meter, torch.no_grad():
            model(*args, **kwargs)
        say(f"forward ({name})", meter)
    with Meter(device) as meter:
        report = bisect(reference, port, (args, kwargs), levels="zoom", repair=False)
    culprit = report.culprit.port if report.culprit is not None else "-"
    say("bisect --levels zoom", meter, f"verdict {report.verdict}, culprit {culprit}")
    found = culprit.startswith(f"single_transformer_blocks.{SLIP_BLOCK[scale]}.")
    print(
        json.dumps(
            {"scale": scale, "verdict": report.verdict, "culprit": culprit, "planted_block_named": found}
        )
    )
    del reference, port
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return found


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scale",
        choices=sorted(CONFIGS),
        default=None,
        help="one scale only (default: demo, tiny, then dev)",
    )
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--no-traces", action="store_true", help="skip the trace and bisect --traces steps")
    options = parser.parse_args()
    import torch

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_scale: --device cuda: torch sees no CUDA device", file=sys.stderr)
        sys.exit(2)
    if device.startswith("cuda"):
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if options.scale is not None:
        ok = main(options.scale, device, traces=not options.no_traces)
    else:
        ok = demo(device)
        ok = main("tiny", device, traces=not options.no_traces) and ok
        ok = (main("dev", device, traces=not options.no_traces) if device.startswith("cuda") else True) and ok
    sys.exit(0 if ok else 1)
