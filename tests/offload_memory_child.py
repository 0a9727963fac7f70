r"""Child process of ``tests/test_offload.py::test_offloaded_alignment_memory_stays_below_the_weights``.

``prepare FOLDER``: build a reference (``blocks.N.0`` Linear + GELU) and a differently named port
(``layers.N.proj``, same values, tanh GELU planted in one layer), run :func:`paritykit.bisect` on them in
memory, write the culprit and aligned pairs to ``FOLDER/in_memory.json`` and each model's weights to an
accelerate offload folder. ``measure FOLDER``: build both models on ``meta``, disk-offload them from those
folders, warm up the code paths on a tiny pair, then run the same bisect on the offloaded models and print the
culprit, the pairs, the weights' bytes and the peak RSS growth (VmHWM after minus VmRSS before; the peak is
reset first). A process of its own, so the in-memory run's freed heap cannot hide the offloaded run's
allocations."""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import torch
from torch import nn

WIDTH, DEPTH, CULPRIT = 2048, 12, 7


class Reference(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class Layer(nn.Module):
    def __init__(self, width: int, approximate: str):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.act = nn.GELU(approximate=approximate)

    def forward(self, x):
        return self.act(self.proj(x))


class Port(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = DEPTH, culprit: int = CULPRIT):
        super().__init__()
        self.layers = nn.ModuleList(Layer(width, "tanh" if i == culprit else "none") for i in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def pair(width: int = WIDTH, depth: int = DEPTH, culprit: int = CULPRIT) -> tuple[nn.Module, nn.Module]:
    g = torch.Generator().manual_seed(0)
    reference = Reference(width, depth).eval()
    with torch.no_grad():
        for p in reference.parameters():
            # variance-keeping scale so the planted difference survives the depth
            p.copy_(torch.randn(p.shape, generator=g) * (2.0 / width) ** 0.5)
    port = Port(width, depth, culprit).eval()
    renamed = {
        re.sub(r"blocks\.(\d+)\.0\.", r"layers.\1.proj.", k): v for k, v in reference.state_dict().items()
    }
    port.load_state_dict(renamed)
    return reference, port


def inputs(width: int = WIDTH):
    return (torch.randn(2, width, generator=torch.Generator().manual_seed(1)),), {}


def result(report) -> dict:
    culprit = report.culprit
    return {
        "culprit": [culprit.reference, culprit.port],
        "pairs": sorted([p.reference, p.port, p.how] for p in report.alignment.pairs),
    }


def status(field: str) -> int:
    """kB from /proc/self/status."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def prepare(folder: Path) -> None:
    from accelerate.utils import offload_state_dict
    from paritykit import bisect

    reference, port = pair()
    with torch.no_grad():
        # the zoom, as the offloaded run chooses it: the same procedure on in-memory weights
        report = bisect(reference, port, inputs(), levels="zoom")
    (folder / "in_memory.json").write_text(json.dumps(result(report)))
    offload_state_dict(str(folder / "reference"), reference.state_dict())
    offload_state_dict(str(folder / "port"), port.state_dict())


def measure(folder: Path) -> None:
    import accelerate
    from paritykit import bisect
    from paritykit.bisection.zoom import use_zoom

    # every code path once on a tiny offloaded pair: imports and allocator arenas are not the weights
    small_ref, small_port = pair(64, 4, 2)
    for name, model in (("small_reference", small_ref), ("small_port", small_port)):
        accelerate.disk_offload(model, str(folder / name), execution_device=torch.device("cpu"))
    with torch.no_grad():
        bisect(small_ref, small_port, inputs(64))
    with accelerate.init_empty_weights():
        reference, port = pair_on_meta()
    for name, model in (("reference", reference), ("port", port)):
        # the folder already holds the weights (index.json): accelerate maps them, nothing is loaded
        accelerate.disk_offload(model, str(folder / name), execution_device=torch.device("cpu"))
    assert use_zoom("auto", reference)
    weight_bytes = sum(p.numel() * p.element_size() for p in [*reference.parameters(), *port.parameters()])
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = status("VmRSS")
    with torch.no_grad():
        report = bisect(reference, port, inputs())
    peak = status("VmHWM")
    print(
        json.dumps({**result(report), "weight_bytes": weight_bytes, "growth_bytes": (peak - before) * 1024})
    )


def pair_on_meta() -> tuple[nn.Module, nn.Module]:
    return Reference().eval(), Port().eval()


if __name__ == "__main__":
    {"prepare": prepare, "measure": measure}[sys.argv[1]](Path(sys.argv[2]))
