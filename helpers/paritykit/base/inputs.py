r"""A call's inputs: ``(args, kwargs)`` from what a user gives, and moved to a device (tensors copied,
everything else as is)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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


def copy_inputs(value: Any) -> Any:
    r"""``value`` with every tensor at any depth (lists, tuples, dicts) cloned, so one side's in-place edit of
    its inputs never reaches the other's; everything else is shared."""
    if is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copy_inputs(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(copy_inputs(v) for v in value)
    return value


def split_inputs(inputs: Any) -> tuple[tuple, dict]:
    r"""A call's inputs as ``(args, kwargs)``, from any of the forms a user writes.

    Args:
        inputs: ``(args, kwargs)``; a kwargs mapping; a list or tuple of positional arguments; or one
            positional value (a tensor).

    Returns:
        ``(args, kwargs)``, new containers holding the same values.
    """
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if (
        isinstance(inputs, tuple)
        and len(inputs) == 2
        and isinstance(inputs[0], (tuple, list))
        and isinstance(inputs[1], Mapping)
    ):
        return tuple(inputs[0]), dict(inputs[1])
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}
