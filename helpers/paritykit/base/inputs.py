r"""A call's inputs: ``(args, kwargs)`` from what a user gives, and moved to a device (tensors copied,
everything else as is)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def map_tensors(value: Any, fn: Any) -> Any:
    r"""``value`` with ``fn`` applied to every tensor at any depth: lists, tuples (named ones too) and dicts
    (their own class kept where it can be copied, as diffusers' ``BaseOutput``) rebuilt around the results;
    everything else as is."""
    import copy

    if is_tensor(value):
        return fn(value)
    if isinstance(value, dict):
        out = copy.copy(value) if type(value) is not dict else {}
        for k, v in value.items():
            out[k] = map_tensors(v, fn)
        return out
    if isinstance(value, (tuple, list)):
        items = [map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def to_device(value: Any, device: Any) -> Any:
    return map_tensors(value, lambda t: t.to(device))


def copy_inputs(value: Any) -> Any:
    r"""``value`` with every tensor at any depth (lists, tuples, dicts) cloned, so one side's in-place edit of
    its inputs never reaches the other's; everything else is shared."""
    return map_tensors(value, lambda t: t.detach().clone())


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
