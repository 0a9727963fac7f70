r"""What two machines exchange when each side is traced on its own: a model's weights read one tensor at a
time (also when accelerate offloaded them), written to one safetensors file or summed into fingerprints, and
the checks that two trace folders are one reference and one port fed the same inputs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.tracing.trace import Trace


class ModelWeights(Mapping):
    r"""A model's state dict that reads weights offloaded by accelerate (``disk_offload``, ``dispatch_model``
    with disk or CPU entries: the parameter itself sits on ``meta``) from the offload, one tensor per access.

    Nothing is loaded up front, and nothing is kept: each ``weights[name]`` reads that tensor (memory-mapped
    from the offload folder for disk entries). Weights that are not offloaded are the model's own tensors.
    """

    def __init__(self, model: Any):
        self.model = model
        # meta tensors for offloaded weights, references (not copies) for the others
        self._entries = model.state_dict(keep_vars=True)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __getitem__(self, name: str) -> Any:
        tensor = self._entries[name]
        if tensor.device.type != "meta":
            return tensor.detach()
        owner, _, local = name.rpartition(".")
        module = self.model.get_submodule(owner) if owner else self.model
        hook = getattr(module, "_hf_hook", None)
        for each in getattr(hook, "hooks", None) or [hook]:
            stored = getattr(each, "weights_map", None)
            if stored is not None:
                try:
                    return stored[local]
                except KeyError:
                    continue
        raise ParityKitError(f"weight {name!r} is on 'meta' and no accelerate hook holds its value")

    @property
    def offloaded(self) -> bool:
        """Whether any weight sits on ``meta`` (read from an offload on access)."""
        return any(t.device.type == "meta" for t in self._entries.values())


# safetensors' names of torch dtypes
_SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def write_weights(model: Any, path: str | Path) -> int:
    r"""Write ``model``'s state dict to one safetensors file, one tensor at a time: offloaded weights are read
    from their offload (:class:`ModelWeights`) and dropped once written, so memory holds one tensor, not the
    model. The header comes first from shapes and dtypes, which the ``meta`` placeholders know. Returns the
    number of tensors written."""
    import struct

    import torch

    weights = ModelWeights(model)
    header: dict[str, Any] = {}
    offset = 0
    for name in weights:
        entry = weights._entries[name]
        dtype = str(entry.dtype).removeprefix("torch.")
        if dtype not in _SAFETENSORS_DTYPES:
            raise ParityKitError(f"weight {name!r}: dtype {dtype} cannot be written to safetensors")
        size = entry.numel() * entry.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in weights:
            tensor = weights[name].detach().cpu().contiguous()
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            del tensor
    return len(header)


def weight_fingerprints(
    model: Any, hasher: Callable[[Any], int | None] | None = None
) -> dict[str, dict[str, Any]]:
    r"""Shape, dtype and value statistics of every tensor of ``model``'s state dict, and with ``hasher`` its
    hash, read one tensor at a time (offloaded weights too, through :class:`ModelWeights`) on the tensor's own
    device. A trace folder keeps these in place of a copy of the weights: the other machine tells from them
    whether both sides loaded the same checkpoint, and alignment pairs modules and finds layers held in
    another order by the hashes (:func:`fingerprint_keys`). ``hasher`` returns ``None`` for a tensor that
    identifies nothing (an all-ones norm)."""
    out = {}
    weights = ModelWeights(model)
    for name in weights:
        tensor = weights[name].detach()
        values = tensor.double()
        entry = {
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "sum": float(values.sum()) if values.numel() else 0.0,
            "abs_sum": float(values.abs().sum()) if values.numel() else 0.0,
        }
        del values
        digest = hasher(tensor) if hasher is not None else None
        if digest is not None:
            entry["hash"] = digest
        out[name] = entry
    return out


def check_pair(ref_trace: Trace, port_trace: Trace, inputs: dict[str, Any] | None = None) -> None:
    r"""Refuse two trace folders that are not one reference and one port fed the same inputs: the same
    folder twice, two folders of one side, swapped sides, different input shapes or values (``make_inputs()``
    fingerprints), or a SPEC given now whose inputs are not the ones traced (``inputs``: its fingerprint). The
    specs themselves may differ (each environment's spec builds only its own side). What a folder does not
    record (a trace written by ``capture(to_dir=)`` without ``about``) is not checked."""
    ref_dir, port_dir = Path(ref_trace.directory), Path(port_trace.directory)
    if ref_dir.resolve() == port_dir.resolve():
        raise ParityKitError(
            f"--traces: {ref_dir} is given twice; give the reference's folder, then the port's"
        )
    a, b = ref_trace.about, port_trace.about
    sides = a.get("side"), b.get("side")
    if sides == ("port", "reference"):
        raise ParityKitError(
            f"--traces: swapped: {ref_dir} holds the port's trace and {port_dir} the reference's; "
            "give the reference's folder first"
        )
    if sides[0] is not None and sides[0] == sides[1]:
        raise ParityKitError(f"--traces: {ref_dir} and {port_dir} both hold the {sides[0]}'s trace")
    for folder, side, wanted in ((ref_dir, sides[0], "reference"), (port_dir, sides[1], "port")):
        if side is not None and side != wanted:
            raise ParityKitError(f"--traces: {folder} holds the {side}'s trace where the {wanted}'s belongs")
    _same_inputs(
        a.get("inputs"),
        b.get("inputs"),
        f"{ref_dir} was traced on",
        f"{port_dir} on",
        f"{ref_dir} and {port_dir}",
    )
    traced = a.get("inputs") or b.get("inputs")
    _same_inputs(
        traced,
        inputs,
        "the traces were written on",
        "SPEC's make_inputs() gives",
        "the traces and SPEC's make_inputs()",
    )


def _same_inputs(first: Any, second: Any, said_first: str, said_second: str, both: str) -> None:
    if not isinstance(first, dict) or not isinstance(second, dict):
        return
    if first.get("shapes") != second.get("shapes"):
        raise ParityKitError(
            f"--traces: different inputs: {said_first} {_shapes_text(first.get('shapes'))}, "
            f"{said_second} {_shapes_text(second.get('shapes'))}"
        )
    if first.get("sha256") != second.get("sha256"):
        raise ParityKitError(
            f"--traces: different inputs: {both} agree in shape ({_shapes_text(first.get('shapes'))}) "
            "but not in value: a different make_inputs(), or one that is not seeded"
        )


def _shapes_text(shapes: Any) -> str:
    if isinstance(shapes, dict):
        return (
            ", ".join(f"{k} {tuple(v) if isinstance(v, list) else v}" for k, v in shapes.items())
            or "no tensors"
        )
    return str(shapes)


def check_request(ref_trace: Trace, port_trace: Trace, zoom: str | None) -> None:
    r"""``bisect --traces … --zoom BLOCK``: both folders must have been traced inside that block (reference
    naming for the reference folder); without ``--zoom`` nothing is checked."""
    if zoom is None:
        return
    inside = ref_trace.about.get("inside")
    if inside != zoom:
        where = f"inside {inside!r}" if inside is not None else "without --inside"
        folder = ref_trace.directory
        raise ParityKitError(
            f"--zoom {zoom!r}: {folder} was traced {where}; trace it with `paritykit trace … --inside {zoom}`"
        )
    if port_trace.about.get("inside") is None:
        raise ParityKitError(f"--zoom {zoom!r}: {port_trace.directory} was not traced with --inside")
