r"""The rule runtime: the layout ops a conversion rule applies (chunk, cat, transpose, …).

These functions are copied verbatim into emitted modules (:mod:`paritykit.forensics.conversion.emit`), so they
may use only ``re`` and ``torch``."""

from __future__ import annotations

OPS = (
    "identity",
    "cast",
    "transpose",
    "permute",
    "reshape",
    "chunk",
    "concat",
    "swap_halves",
    "permute_rows",
)


# elements hashed per block: temporaries of ~1 MB stay in cache (2x faster than 4 MB blocks here) and memory
# stays bounded however large a tensor is
BLOCK = 1 << 18


# fused tensors are split into at most this many equal pieces when looking for a target inside them
MAX_PIECES = 64

# targets still unexplained after every other phase that are probed as slices at any offset (unequal pieces)
MAX_OFFSET_TARGETS = 64


# candidates shown per ambiguous row in the text table (the JSON lists every one)
SHOWN_CANDIDATES = 3


# the text tables fit a terminal of this width
WIDTH = 120


def row_index(step, n):
    """The index tensor of a ``permute_rows`` step: target row ``i`` is source row ``index[i]``."""
    import torch

    pattern = step["pattern"]
    if pattern == "deinterleave":
        # per group of G rows: (x0, y0, x1, y1, …) -> (x0, x1, …, y0, y1, …)
        return torch.arange(n).view(-1, step["group"] // 2, 2).transpose(1, 2).reshape(-1)
    if pattern == "interleave":
        # per group of G rows: (x0, x1, …, y0, y1, …) -> (x0, y0, x1, y1, …)
        return torch.arange(n).view(-1, 2, step["group"] // 2).transpose(1, 2).reshape(-1)
    if pattern == "blocks":
        block = step["block"]
        order = torch.tensor(step["order"])
        return (order[:, None] * block + torch.arange(block)[None, :]).reshape(-1)
    if pattern == "ranges":
        return torch.cat([torch.arange(start, stop, stride) for start, stop, stride in step["ranges"]])
    raise ValueError(f"unknown permute_rows pattern {pattern!r}")


def apply_step(x, step):
    """Apply one layout step (a dict with an ``op`` and its arguments) to a tensor."""
    import torch

    op = step["op"]
    if op == "identity":
        return x
    if op == "cast":
        return x.to(getattr(torch, step["dtype"]))
    if op == "reshape":
        return x.reshape(step["shape"])
    if op == "transpose":
        return x.transpose(*step["dims"]).contiguous()
    if op == "permute":
        return x.permute(*step["dims"]).contiguous()
    if op == "chunk":
        return x.narrow(step["dim"], step["start"], step["stop"] - step["start"]).contiguous()
    if op == "swap_halves":
        first, second = x.chunk(2, dim=step["dim"])
        return torch.cat([second, first], dim=step["dim"])
    if op == "permute_rows":
        return x.index_select(step["dim"], row_index(step, x.shape[step["dim"]]))
    raise ValueError(f"unknown op {op!r}")


def _apply_op(tensors, op, args):
    """Build one target tensor from its source tensors: the main op, then the ``then`` steps in order."""
    import torch

    if op == "concat":
        parts = args.get("parts") or [[] for _ in tensors]
        pieces = []
        for tensor, steps in zip(tensors, parts):
            for step in steps:
                tensor = apply_step(tensor, step)
            pieces.append(tensor)
        x = torch.cat(pieces, dim=args["dim"])
    else:
        (x,) = tensors
        x = apply_step(x, {"op": op, **{k: v for k, v in args.items() if k != "then"}})
    for step in args.get("then", []):
        x = apply_step(x, step)
    return x


def convert_with_rules(state_dict, rules):
    """Apply conversion rules to a state dict; every rule is tried on every key (``re.fullmatch``)."""
    import re

    out = {}
    for rule in rules:
        regex = re.compile(rule["pattern"])
        for key in state_dict:
            match = regex.fullmatch(key)
            if match is None:
                continue
            names = [key, *(match.expand(template) for template in rule["sources"][1:])]
            missing = [name for name in names if name not in state_dict]
            if missing:
                raise KeyError(
                    f"rule {rule['pattern']!r} needs {missing[0]!r}, which is not in the state dict"
                )
            out[match.expand(rule["target"])] = _apply_op(
                [state_dict[n] for n in names], rule["op"], rule["args"]
            )
    return out


RUNTIME_SOURCE = (row_index, apply_step, _apply_op, convert_with_rules)
