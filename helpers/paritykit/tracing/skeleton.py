r"""The skeleton of a captured call: its inputs and outputs with each tensor replaced by a reference to its
key in the trace, written to JSON and read back, and rebuilt into the values a replay passes."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from paritykit.base.errors import ParityKitError


@dataclass(frozen=True)
class TensorRef:
    """A captured tensor inside an input/output skeleton, stored under ``key`` in the trace."""

    key: str


@dataclass(frozen=True)
class Opaque:
    """A non-tensor value that could not be written to JSON; calls holding one cannot be replayed from
    disk."""

    text: str

    def __repr__(self) -> str:
        return f"<opaque {self.text}>"


class OutputDict(dict):
    """Stands in for a ``BaseOutput`` read from disk: ``out.sample``, ``out["sample"]`` and ``out[0]`` all
    work."""

    def __getattr__(self, item: str) -> Any:
        try:
            return self[item]
        except KeyError:
            raise AttributeError(item) from None

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, int):
            return list(self.values())[item]
        return super().__getitem__(item)


@dataclass(frozen=True)
class DictSkeleton:
    """A captured dict (or ``BaseOutput``) with its original class, so replay rebuilds the same type."""

    items: dict[str, Any]
    cls: type = dict


def encode(node: Any) -> Any:
    """Skeleton -> JSON. Tensors become ``{"tensor": key}``; values JSON cannot hold become ``{"opaque":
    repr}``."""
    if isinstance(node, TensorRef):
        return {"tensor": node.key}
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if isinstance(node, float):
        return node if math.isfinite(node) else {"float": repr(node)}
    if isinstance(node, DictSkeleton):
        output = node.cls is not dict
        return {"dict": [[str(k), encode(v)] for k, v in node.items.items()], "output": output}
    if isinstance(node, tuple):
        return {"tuple": [encode(v) for v in node]}
    if isinstance(node, list):
        return {"list": [encode(v) for v in node]}
    if isinstance(node, Opaque):
        return {"opaque": node.text}
    text = type(node).__module__ + "." + type(node).__qualname__
    try:
        import torch

        if isinstance(node, torch.dtype):
            return {"dtype": str(node).removeprefix("torch.")}
        if isinstance(node, torch.device):
            return {"device": str(node)}
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return {"opaque": f"{text}: {repr(node)[:200]}"}


def decode(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    if "tensor" in node:
        return TensorRef(node["tensor"])
    if "float" in node:
        return float(node["float"])
    if "dict" in node:
        return DictSkeleton(
            {k: decode(v) for k, v in node["dict"]}, OutputDict if node.get("output") else dict
        )
    if "tuple" in node:
        return tuple(decode(v) for v in node["tuple"])
    if "list" in node:
        return [decode(v) for v in node["list"]]
    if "dtype" in node:
        import torch

        return getattr(torch, node["dtype"])
    if "device" in node:
        import torch

        return torch.device(node["device"])
    return Opaque(node.get("opaque", "?"))


def unpack_call(node: Any, tensor: Any) -> Any:
    if isinstance(node, TensorRef):
        return tensor(node.key)
    if isinstance(node, DictSkeleton):
        values = {k: unpack_call(v, tensor) for k, v in node.items.items()}
        try:
            return node.cls(**values) if node.cls is not dict else values
        except TypeError:
            return OutputDict(values)
    if isinstance(node, tuple):
        return tuple(unpack_call(v, tensor) for v in node)
    if isinstance(node, list):
        return [unpack_call(v, tensor) for v in node]
    if isinstance(node, Opaque):
        raise ParityKitError(f"cannot rebuild a captured value from disk: {node.text}")
    return node


def has_opaque(node: Any) -> bool:
    if isinstance(node, Opaque):
        return True
    if isinstance(node, DictSkeleton):
        return any(has_opaque(v) for v in node.items.values())
    if isinstance(node, (tuple, list)):
        return any(has_opaque(v) for v in node)
    return False


def tensor_paths(node: Any, prefix: str = "") -> Iterable[tuple[str, str]]:
    """``(path, key)`` for every tensor in a skeleton, in order."""
    if isinstance(node, TensorRef):
        yield prefix, node.key
    elif isinstance(node, DictSkeleton):
        for k, v in node.items.items():
            yield from tensor_paths(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, (tuple, list)):
        for i, v in enumerate(node):
            yield from tensor_paths(v, f"{prefix}.{i}" if prefix else str(i))
