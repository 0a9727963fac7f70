r"""Fingerprints of tensor values that survive layout ops (multiset hashes, row keys), and the exact
confirmation of which op turns one tensor into another."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from paritykit.forensics.conversion.runtime import (
    BLOCK,
    MAX_PIECES,
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
    return not all_equal(tensor.detach())


def all_equal(t) -> bool:
    r"""Every element equal to the first (``==``, so a NaN anywhere makes it False). A short prefix settles
    almost every real tensor, so the whole tensor is read only when the prefix is constant."""
    flat = t.reshape(-1)
    if flat.numel() <= 1:
        return True
    first = flat[0]
    if not bool((flat[:64] == first).all()):
        return False
    return bool((flat == first).all())


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


def _raw_bits(block):
    r"""The block's element bit patterns as a same-width signed integer tensor (a view where possible), with
    -0.0 folded onto 0.0 (a copy only where a -0.0 is present), as ``torch.equal`` compares."""
    import torch

    if block.is_complex():
        block = torch.view_as_real(block)
    if not block.dtype.is_floating_point:
        if block.dtype == torch.uint64:
            return block.view(torch.int64)
        return block if block.dtype == torch.int64 else block.to(torch.int64)
    size = block.element_size()
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[size]
    block = block.contiguous()
    bits = block.view(as_int)
    # -0.0 is the sign bit alone: the smallest signed pattern, so a min (vectorised in numpy) finds it
    lowest = bits.numpy().min() if bits.device.type == "cpu" else bits.min()
    if int(lowest) == torch.iinfo(as_int).min:
        bits = (block + 0.0).view(as_int)
    return bits


def _float_bits_numpy(x):
    r"""The bit patterns of a contiguous real floating CPU tensor as a numpy integer view of its memory (no
    copy), or ``None`` for any other tensor."""
    import torch

    if not x.dtype.is_floating_point or not x.is_contiguous():
        return None
    as_int = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[x.element_size()]
    return x.view(as_int).numpy()


def _fold_negative_zero(bits):
    r"""Float bit patterns (numpy) with -0.0 (the sign bit alone: the lowest signed pattern) made 0.0, as
    :func:`_raw_bits` does: a copy only where one is present."""
    import numpy as np

    lowest = np.iinfo(bits.dtype).min
    if bits.size and int(bits.min()) == lowest:
        return np.where(bits == lowest, 0, bits).astype(bits.dtype)
    return bits


def _sums(bits, splits: list[tuple[int, int]], row0: int, rows: int, pieces: dict, kept: Any = None) -> int:
    r"""Wrapping int64 sum of ``bits`` (rows ``row0 …`` of a tensor with ``rows`` rows), adding each split's
    piece sums into ``pieces``, and each row's sum into ``kept`` where given (a numpy array, one per row).
    CPU blocks are summed by numpy, whose integer reductions are vectorised (torch's are several times slower
    on the CPU); other devices stay on their device."""
    import numpy as np
    import torch

    if isinstance(bits, np.ndarray) or bits.device.type == "cpu":
        a = bits if isinstance(bits, np.ndarray) else bits.numpy()
        if not splits and kept is None:
            return _numpy_sum(a)
        per_row = _row_sums(a)
        if kept is not None:
            kept[row0 : row0 + a.shape[0]] = per_row
        for dim, count in splits:
            if dim == 0:
                which = (np.arange(row0, row0 + a.shape[0]) // (rows // count)).astype(np.int64)
                np.add.at(pieces[(dim, count)], which, per_row)
            else:
                v = a.reshape(*a.shape[:dim], count, a.shape[dim] // count, *a.shape[dim + 1 :])
                axes = tuple(i for i in range(v.ndim) if i != dim)
                pieces[(dim, count)] += v.sum(axis=axes, dtype=np.int64)
        return int(per_row.sum(dtype=np.int64))
    wide = bits.to(torch.int64)
    per_row = wide.reshape(wide.shape[0], -1).sum(1)
    for dim, count in splits:
        if dim == 0:
            which = torch.arange(row0, row0 + wide.shape[0], device=wide.device) // (rows // count)
            pieces[(dim, count)].index_add_(0, which, per_row)
        else:
            v = wide.reshape(*wide.shape[:dim], count, wide.shape[dim] // count, *wide.shape[dim + 1 :])
            pieces[(dim, count)] += v.movedim(dim, 0).reshape(count, -1).sum(1)
    return int(per_row.sum())


def _row_sums(a) -> Any:
    r"""Each row's exact sum (int64, wrapping) of an integer block: in int32 where the row cannot leave it
    (elements of at most two bytes, at most 2**15 of them: numpy's int32 reduction is the faster)."""
    import numpy as np

    rows = a.reshape(a.shape[0], -1)
    if a.itemsize <= 2 and rows.shape[1] <= _NARROW_RUN:
        return rows.sum(1, dtype=np.int32).astype(np.int64)
    return rows.sum(1, dtype=np.int64)


# elements of at most 16 bits summed this many at a time cannot leave int32 (2**15 * 2**15 = 2**30)
_NARROW_RUN = 1 << 15


def _numpy_sum(a) -> int:
    r"""Exact sum of an integer array as a Python int (wrapping int64, as the hashes take it). Elements of at
    most two bytes are summed in int32 over runs first: numpy's int32 reduction is faster than its widening
    one to int64."""
    import numpy as np

    flat = a.reshape(-1)
    if a.itemsize > 2 or flat.size < 2 * _NARROW_RUN:
        return int(flat.sum(dtype=np.int64))
    whole = flat.size - flat.size % _NARROW_RUN
    runs = flat[:whole].reshape(-1, _NARROW_RUN).sum(1, dtype=np.int32)
    return int(runs.sum(dtype=np.int64)) + int(flat[whole:].sum(dtype=np.int64))


def multiset_hashes(t, dtype, splits: Iterable[tuple[int, int]] = ()):
    r"""Layout-insensitive fingerprint of ``t`` cast to ``dtype``, and of its equal pieces.

    The fingerprint is the wrapping int64 sum of the elements' bit patterns (-0.0 counted as 0.0): one
    vectorised pass, independent of element order, and changed by any single changed element. It is a bucket
    key, not a proof: every match built on it is confirmed by comparing the values themselves
    (:func:`resolve_candidates`), so a collision costs a comparison, never a wrong answer.

    Args:
        splits: ``(dim, count)`` pairs; for each, the fingerprints of the ``count`` equal pieces along
            ``dim``.
    Returns:
        ``(full_hash, {(dim, count): [hash per piece]})``. The tensor is read in row blocks, so memory stays
        bounded.
    """
    full, pieces, _ = _hashes(t, dtype, list(splits), keep_rows=False)
    return full, {s: [int(h) for h in v.tolist()] for s, v in pieces.items()}


def multiset_rows(t, dtype) -> tuple[int, Any]:
    r""":func:`multiset_hashes`'s full hash of ``t`` cast to ``dtype``, and the hash of each of its rows
    (dim 0; a numpy int64 array, wrapping): the hash of any range of rows is their wrapping sum, so the pieces
    of a fused tensor along dim 0 are hashed without reading it again. Rows are kept for CPU tensors of two
    or more dims; ``None`` otherwise."""
    keep = t.ndim >= 2 and t.device.type == "cpu" and 2 <= t.shape[0] <= MAX_KEPT_ROWS
    full, _, rows = _hashes(t, dtype, [], keep_rows=keep)
    return full, rows


# rows a tensor keeps hashes of (8 bytes each), at most: a bound on what the fingerprints hold
MAX_KEPT_ROWS = 1 << 17


def _hashes(t, dtype, splits: list[tuple[int, int]], keep_rows: bool) -> tuple[int, dict, Any]:
    import numpy as np
    import torch

    x = t.reshape(1) if t.ndim == 0 else t
    rows = x.shape[0]
    on_cpu = x.device.type == "cpu"
    pieces = {
        s: np.zeros(s[1], dtype=np.int64) if on_cpu else torch.zeros(s[1], dtype=torch.int64, device=x.device)
        for s in splits
    }
    kept = np.zeros(rows, dtype=np.int64) if keep_rows else None
    total = 0
    if rows and x.numel():
        step = max(1, BLOCK // max(1, x.numel() // rows))
        whole = _float_bits_numpy(x) if on_cpu and x.dtype == dtype else None
        for r0 in range(0, rows, step):
            if whole is not None:  # numpy slices alone in the loop: the reductions run without the GIL
                total += _sums(_fold_negative_zero(whole[r0 : r0 + step]), splits, r0, rows, pieces, kept)
                continue
            block = x[r0 : r0 + step]
            if block.dtype != dtype:
                block = block.to(dtype)
            total += _sums(_raw_bits(block), splits, r0, rows, pieces, kept)
    wrap = (total + (1 << 63)) % (1 << 64) - (1 << 63)
    return wrap, pieces, kept


def position_hash(t) -> int:
    r"""Layout-SENSITIVE hash of ``t``'s values (-0.0 counted as 0.0): groups tensors whose values are equal
    element for element.

    A weighted sum, wrapping at 64 bits, of the elements' bit patterns, each weighted by a fixed pseudo-random
    odd int64 of its position in its block of :data:`BLOCK` elements, and each block's sum by one of its block
    number. One multiply-add per element on the tensor's own device (CPU blocks by numpy); every device gives
    the same value, so hashes written on one machine compare with those of another.
    """
    return _position_hash(t, by_numpy=t.device.type == "cpu")


def _position_hash(t, *, by_numpy: bool) -> int:
    r""":func:`position_hash` by numpy (CPU tensors, block by block) or by torch ops on the tensor's device
    (:data:`DEVICE_BLOCKS` blocks at a time, one synchronisation each): one value."""
    import numpy as np

    flat = t.reshape(-1)
    if not by_numpy:
        return _position_hash_by_torch(flat)
    total = 0
    for number, start in enumerate(range(0, flat.numel(), BLOCK)):
        bits = _raw_bits(flat[start : start + BLOCK])
        weights = _position_weights("cpu")[: bits.numel()]
        block_sum = int((bits.numpy() * weights).sum(dtype=np.int64))
        total = (total + block_sum * _splitmix(number)) % (1 << 64)
    return total - (1 << 64) if total >= 1 << 63 else total


# blocks hashed together on a device: a 64-bit copy of 16 M elements (128 MiB) at a time
DEVICE_BLOCKS = 64


def _position_hash_by_torch(flat) -> int:
    r"""The position hash of a flat tensor by torch ops where it lives: each block's weighted sum and the
    sum of those weighted by their block numbers' multipliers, in int64 arithmetic that wraps as the
    numpy path's modulo does."""
    import torch

    weights = _position_weights(flat.device, as_tensor=True)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    span = BLOCK * DEVICE_BLOCKS
    for start in range(0, flat.numel(), span):
        bits = _raw_bits(flat[start : start + span]).to(torch.int64)
        count = -(-bits.numel() // BLOCK)
        if bits.numel() != count * BLOCK:  # zeros past the end add nothing
            bits = torch.cat([bits, bits.new_zeros(count * BLOCK - bits.numel())])
        sums = (bits.view(count, BLOCK) * weights).sum(1)
        numbers = torch.from_numpy(_splitmix_array(start // BLOCK, count)).to(flat.device)
        total += (sums * numbers).sum()
    return int(total)


_MASK64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    r"""splitmix64 of ``x``, made odd: a well-spread multiplier for a position."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) | 1


# device -> the weights of one block's positions (numpy on the CPU, a tensor elsewhere), made once
_WEIGHTS: dict[str, Any] = {}


def _splitmix_array(start: int, count: int):
    r""":func:`_splitmix` of ``start .. start + count - 1``, a numpy int64 array (the uint64s' bits)."""
    import numpy as np

    z = np.arange(start, start + count, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) | np.uint64(1)).view(np.int64)


def _position_weights(device, as_tensor: bool = False):
    key = f"{device}:{as_tensor}"
    if key not in _WEIGHTS:
        weights = _splitmix_array(0, BLOCK)
        if not as_tensor:
            _WEIGHTS[key] = weights
        else:
            import torch

            _WEIGHTS[key] = torch.from_numpy(weights).to(device)
    return _WEIGHTS[key]


def _row_keys(m):
    """One layout-sensitive hash per row of a 2-D tensor."""
    import torch

    salt = _mix(torch.arange(m.shape[1], dtype=torch.int32, device=m.device) * 7919)
    return _mix(_bits(m) ^ salt[None, :]).sum(1).tolist()


def equal_values(a, b) -> bool:
    r"""``torch.equal`` (elementwise ``==``: -0.0 equals 0.0, NaN equals nothing) of same-shape tensors; CPU
    tensors of one dtype are compared by numpy, several times faster than ``torch.equal`` there."""
    import torch

    if a.shape != b.shape:
        return False
    fast = _numpy_equal(a, b)
    return torch.equal(a, b) if fast is None else fast


def _numpy_equal(a, b) -> bool | None:
    r"""``torch.equal`` by numpy for CPU tensors of one real dtype, or ``None`` where torch must decide."""
    import numpy as np
    import torch

    if a.device.type != "cpu" or b.device.type != "cpu" or a.dtype != b.dtype or a.is_complex():
        return None
    if a.dtype != torch.bfloat16:
        try:
            return bool(np.array_equal(a.numpy(), b.numpy()))
        except (TypeError, RuntimeError):  # a dtype numpy lacks (float8, uint16 …)
            return None
    ia, ib = a.view(torch.int16).numpy(), b.view(torch.int16).numpy()  # numpy has no bfloat16
    if np.array_equal(*_widest(ia, ib)):
        # equal patterns differ only as NaN: above +inf's pattern signed (0x7F80), or above -inf's unsigned
        # (0xFF80); two plain maxima, no masked copy
        return not ia.size or (int(ia.max()) <= 0x7F80 and int(ia.view(np.uint16).max()) <= 0xFF80)
    if ia.size and min(int(ia.min()), int(ib.min())) == -32768:
        return None  # a -0.0 on either side: torch compares it equal to 0.0
    return False


def _widest(ia, ib):
    r"""Two same-shape integer arrays as int64 views of their bytes where both allow it (contiguous, a
    multiple of 8 bytes): equal bytes read in a quarter of the steps."""
    import numpy as np

    if ia.nbytes % 8 == 0 and ia.flags.c_contiguous and ib.flags.c_contiguous:
        try:
            return ia.reshape(-1).view(np.int64), ib.reshape(-1).view(np.int64)
        except ValueError:  # an offset that is not a multiple of 8 bytes
            pass
    return ia, ib


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


def piece_gaps(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """Ranges of ``[0, length)`` not covered by ``spans``."""
    out, pos = [], 0
    for start, stop in sorted(set(spans)):
        if start > pos:
            out.append((pos, start))
        pos = max(pos, stop)
    if pos < length:
        out.append((pos, length))
    return out


def even_splits(shape: tuple[int, ...], numels: set[int]) -> list[tuple[int, int]]:
    r"""The ``(dim, count)`` splits of a tensor of ``shape`` into ``count`` equal pieces (2 to
    :data:`~paritykit.forensics.conversion.runtime.MAX_PIECES`) whose size is one of ``numels``."""
    total = math.prod(shape)
    counts = sorted({total // n for n in numels if n and total % n == 0 and 2 <= total // n <= MAX_PIECES})
    return [(d, k) for d in range(len(shape)) for k in counts if shape[d] % k == 0]
