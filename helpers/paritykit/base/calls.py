r"""A call's inputs: ``(args, kwargs)`` from what a user gives, and moved to a device (tensors copied,
everything else as is)."""

from __future__ import annotations

from typing import Any

from paritykit.base.errors import ParityKitError


def is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def to_device(value: Any, device: Any) -> Any:
    if is_tensor(value):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    return value


def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict):
        return tuple(inputs[0]), dict(inputs[1])
    raise ParityKitError("inputs must be (args, kwargs) or a kwargs dict")
