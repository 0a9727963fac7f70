r"""Fingerprints of tensor values that survive layout ops (multiset hashes, row keys), and the exact
confirmation of which op turns one tensor into another."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from paritykit.forensics.conversion.runtime import (
    BLOCK,
    apply_step,
    row_index,
)

# 32-bit mixing constants (lowbias32), written as signed values: torch integer arithmetic wraps
_GOLDEN = -1640531527


_MUL1 = 0x7FEB352D


_MUL2 = -2073254261


def informative(tensor: Any) -> bool:
    r"""A tensor whose values can identify it: more than one element, not all equal (not all ones or
    zeros)."""
    if tensor is None or not hasattr(tensor, "numel") or tensor.numel() < 2:
        return False
    flat = tensor.detach().reshape(-1)
    return bool((flat != flat[0]).any())


def _mix(z):
    """A cheap bijective scramble of integer bit patterns (int32 or int64)."""
    z = (z + _GOLDEN) * _MUL1
    z = (z ^ (z >> 15)) * _MUL2
    return z ^ (z >> 16)


def _bits(t):
    r"""Element bit patterns as int32 (int64 for 8-byte dtypes), -0.0 folded onto 0.0 as ``torch.equal`` does.

    Hash sums are accumulated in int64 by ``torch.sum``, so int32 working values keep memory traffic low.
    """
    import torch

    if t.is_complex():
        return _bits(torch.view_as_real(t))
    if t.dtype.is_floating_point:
        t = (t + 0.0).contiguous()  # -0.0 + 0.0 == +0.0
        size = t.element_size()
        if size == 8:
            return t.view(torch.int64)
        if size == 4:
            return t.view(torch.int32)
        return t.view(torch.int16 if size == 2 else torch.int8).to(torch.int32)
    if t.dtype in (torch.int64, torch.uint64):
        return t.view(torch.int64) if t.dtype == torch.uint64 else t
    return t.to(torch.int32)


def castable(src_dtype, dst_dtype) -> bool:
    return src_dtype == dst_dtype or (src_dtype.is_floating_point and dst_dtype.is_floating_point)


def multiset_hashes(t, dtype, splits: Iterable[tuple[int, int]] = ()):
    r"""Layout-insensitive hash of ``t`` cast to ``dtype``, and of its equal pieces.

    Args:
        splits: ``(dim, count)`` pairs; for each, the hashes of the ``count`` equal pieces along ``dim``.
    Returns:
        ``(full_hash, {(dim, count): [hash per piece]})``. The tensor is read in row blocks, so memory stays
        bounded; wrapping int64 sums make the result independent of element order.
    """
    import torch

    splits = list(splits)
    x = t.reshape(1) if t.ndim == 0 else t
    rows = x.shape[0]
    # accumulators on the tensor's own device: a weight on a GPU is hashed there, never added to a CPU sum
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    pieces = {s: torch.zeros(s[1], dtype=torch.int64, device=x.device) for s in splits}
    if rows == 0 or x.numel() == 0:
        return 0, {s: v.tolist() for s, v in pieces.items()}
    step = max(1, BLOCK // max(1, x.numel() // rows))
    for r0 in range(0, rows, step):
        block = x[r0 : r0 + step]
        if block.dtype != dtype:
            block = block.to(dtype)
        h = _mix(_bits(block))
        per_row = h.reshape(h.shape[0], -1).sum(1)
        total += per_row.sum()
        for dim, count in splits:
            if dim == 0:
                size = rows // count
                which = torch.arange(r0, r0 + h.shape[0], device=x.device) // size
                pieces[(dim, count)].index_add_(0, which, per_row)
            else:
                shape = h.shape
                v = h.reshape(*shape[:dim], count, shape[dim] // count, *shape[dim + 1 :])
                pieces[(dim, count)] += v.movedim(dim, 0).reshape(count, -1).sum(1)
    return int(total), {s: v.tolist() for s, v in pieces.items()}


def position_hash(t) -> int:
    """Layout-SENSITIVE hash (element value mixed with its position): groups byte-identical tensors."""
    import torch

    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), BLOCK):
        block = flat[start : start + BLOCK]
        salt = _mix(torch.arange(start, start + block.numel(), dtype=torch.int32, device=flat.device))
        total += _mix(_bits(block) ^ salt).sum()
    return int(total)


def _row_keys(m):
    """One layout-sensitive hash per row of a 2-D tensor."""
    import torch

    salt = _mix(torch.arange(m.shape[1], dtype=torch.int32, device=m.device) * 7919)
    return _mix(_bits(m) ^ salt[None, :]).sum(1).tolist()


def equal_values(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a, b)


def resolve_candidates(x, t) -> list[dict[str, Any]] | None:
    r"""Layout steps turning ``x`` (already in ``t``'s dtype) into ``t`` exactly, or ``None``.

    Tried in order of simplicity: identity, reshape, transpose/permute (of the non-singleton dims),
    swap_halves along one dim, a row permutation along one dim.
    """
    if x.numel() != t.numel():
        return None
    if equal_values(x, t):
        return []
    tshape = list(t.shape)
    if x.shape != t.shape and equal_values(x.reshape(t.shape), t):
        return [{"op": "reshape", "shape": tshape}]
    xs = [s for s in x.shape if s != 1]
    ts = [s for s in t.shape if s != 1]
    if len(xs) == len(ts) and 2 <= len(xs) <= 5 and sorted(xs) == sorted(ts):
        xv = x.reshape(xs)
        for perm in itertools.permutations(range(len(xs))):
            if perm == tuple(range(len(xs))) or [xs[i] for i in perm] != ts:
                continue
            if equal_values(xv.permute(perm).reshape(t.shape), t):
                steps = [] if list(x.shape) == xs else [{"op": "reshape", "shape": xs}]
                moved = [i for i, p in enumerate(perm) if p != i]
                if len(moved) == 2:
                    steps.append({"op": "transpose", "dims": moved})
                else:
                    steps.append({"op": "permute", "dims": list(perm)})
                if ts != tshape:
                    steps.append({"op": "reshape", "shape": tshape})
                return steps
    y = x if x.shape == t.shape else x.reshape(t.shape)
    pre = [] if x.shape == t.shape else [{"op": "reshape", "shape": tshape}]
    for dim in range(t.ndim):
        if t.shape[dim] % 2 == 0 and t.shape[dim] >= 2:
            if equal_values(apply_step(y, {"op": "swap_halves", "dim": dim}), t):
                return [*pre, {"op": "swap_halves", "dim": dim}]
    for dim in range(t.ndim):
        if t.shape[dim] < 3:
            continue
        perm = _row_permutation(y, t, dim)
        if perm is not None:
            return [*pre, {"op": "permute_rows", "dim": dim, **_describe_permutation(perm)}]
    return None


def _row_permutation(y, t, dim) -> list[int] | None:
    """``perm`` with ``t == y.index_select(dim, perm)``, found by hashing rows, or ``None``."""
    import torch

    n = t.shape[dim]
    ym = y.movedim(dim, 0).reshape(n, -1)
    tm = t.movedim(dim, 0).reshape(n, -1)
    where: dict[int, list[int]] = defaultdict(list)
    for i, key in enumerate(_row_keys(ym)):
        where[key].append(i)
    perm = []
    for key in _row_keys(tm):
        rows = where.get(key)
        if not rows:
            return None
        perm.append(rows.pop(0))
    if perm == list(range(n)) or not torch.equal(ym[torch.tensor(perm, device=ym.device)], tm):
        return None
    return perm


def _describe_permutation(perm: list[int]) -> dict[str, Any]:
    r"""A compact description of a row permutation: a known pattern when one fits, else stride runs.

    Patterns: ``deinterleave``/``interleave`` pairs within groups of ``group`` rows (rotary layouts,
    interleaved heads), ``blocks`` of ``block`` rows reordered by ``order`` (heads or fused pieces reordered),
    else ``ranges`` ``[[start, stop, stride], …]`` concatenated.
    """
    import torch

    n = len(perm)
    p = torch.tensor(perm, device="cpu")  # a list of row indices, described on the CPU
    for group in range(4, n + 1, 2):
        if n % group:
            continue
        for pattern in ("deinterleave", "interleave"):
            if torch.equal(row_index({"pattern": pattern, "group": group}, n), p):
                return {"pattern": pattern, "group": group}
    for block in range(n // 2, 1, -1):
        if n % block:
            continue
        starts = p[::block]
        if bool((starts % block == 0).all()):
            candidate = row_index(
                {"pattern": "blocks", "block": block, "order": (starts // block).tolist()}, n
            )
            if torch.equal(candidate, p):
                return {"pattern": "blocks", "block": block, "order": (starts // block).tolist()}
    ranges: list[list[int]] = []
    i = 0
    while i < n:
        j = i + 1
        stride = perm[j] - perm[i] if j < n else 1
        while j < n and perm[j] - perm[j - 1] == stride:
            j += 1
        if stride == 0:
            stride = 1
        ranges.append([perm[i], perm[j - 1] + stride, stride])
        i = j
    return {"pattern": "ranges", "ranges": ranges}
