r"""How the port's tensor relates to the reference's at a located place, derived from the two values.

An expert at a culprit does not look a cause up; they ask how the two tensors relate. Each function here takes
the reference's tensor ``R`` and the port's ``P`` (and, for a missing term, the tensors captured at that
place) and states a relation only when it reproduces ``P`` from ``R`` to float precision, with its residual:

* :func:`rearrangement`: ``P`` holds exactly ``R``'s values in other places. The index map is derived (by
  sorting both) and said in the tensor's own axes and sub-axes: an axis whose entries are reordered (which to
  which), or an axis read as sub-axes in another order (``8`` read ``(2, 4)`` against ``(4, 2)``: halves
  against interleaved pairs; a patch flattened channels-last).
* :func:`sequence_rows`: one side's rows along an axis are the other's with rows added, dropped or reordered,
  said in row ranges (a class token on one side only, text and image tokens concatenated in the other order).
* :func:`scale`: ``P = k·R`` with ``k`` snapped to a constant (1000, 1/1000, 2π, √d, a VAE factor).
* :func:`missing_term`: ``P = R + Σ c_i·T_i`` over the tensors captured at the place, by least squares, each
  ``c_i`` snapped (``port = reference − 1·x``: a residual added once more, or dropped).

None of them guesses: each returns ``None`` unless its relation holds everywhere within the float tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.minimize import least_squares
from paritykit.base.report import clamp_words, format_number

# a relation holds when it reproduces P from R to within this share of P's scale, or float noise
HOLDS = 1e-5
# a missing-term fit reads at most MAX_TERMS captured tensors, and tries pairs of them only among MAX_PAIRED
# terms of at most MAX_PAIRED_ELEMENTS values (each pair is a least-squares fit over the whole tensor)
MAX_TERMS = 32
MAX_PAIRED = 12
MAX_PAIRED_ELEMENTS = 1_000_000
SHOWN = 6  # entries of an index map shown before "…"


@dataclass
class Relation:
    r"""One derived relation: ``kind``, the statement (``words``), its residual (max |relation(R) − P|) and
    the numbers behind it."""

    kind: str
    words: str
    residual: float
    evidence: dict[str, Any] = field(default_factory=dict)
    # None: not checked by replay; True: the port with this relation undone at the place matches the
    # reference's final output; False: it does not
    verified: bool | None = None
    # how to undo it on the port's tensor: ``undo(port_tensor, terms) -> reference-like tensor``
    undo: Any = field(default=None, repr=False, compare=False)

    def line(self) -> str:
        state = {
            True: " (verified by replay: undone there, the port's output matches)",
            False: " (undone by replay there, the port's output still differs)",
            None: "",
        }[self.verified]
        return f"{self.words} (residual {format_number(self.residual)}){state}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "words": self.words,
            "residual": self.residual,
            "verified": self.verified,
            "evidence": self.evidence,
        }


def _tolerance(t: Any) -> float:
    return HOLDS * max(float(t.detach().abs().max()), 1e-12) if t.numel() else 0.0


def _float(t: Any) -> Any:
    import torch

    return t.detach().to("cpu", torch.float64)


# ------------------------------------------------------------------------------------------ rearrangement


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def index_map(reference: Any, port: Any) -> Any | None:
    r"""For each flat position of ``port``, the flat position of ``reference`` holding its value, when the two
    hold the same values (exactly, as a copy does) with no value repeated; else ``None``."""
    import torch

    r, p = reference.detach().flatten().cpu(), port.detach().flatten().cpu()
    if r.numel() != p.numel() or r.numel() < 2 or r.dtype != p.dtype:
        return None
    r_sorted, r_order = torch.sort(r)
    p_sorted, p_order = torch.sort(p)
    if not torch.equal(r_sorted, p_sorted) or bool((r_sorted[1:] == r_sorted[:-1]).any()):
        return None
    source = torch.empty_like(p_order)
    source[p_order] = r_order
    return source


def rearrangement(reference: Any, port: Any, axes: Sequence[str] = ()) -> Relation | None:
    r"""``port`` is ``reference``'s values in other places: the index map, in axes and sub-axes.

    Tried in turn, each checked on the values to float tolerance (so a map computed in another summation
    order, or a table whose values repeat, still reads): one axis read as two sub-axes in the other order
    (halves against interleaved pairs); one axis's entries reordered (slices matched by value); and, when
    every value is distinct, the exact index map: a permutation of sub-axes across axes, or a block of values
    one side reshapes in another order (a patch's features flattened channels-last)."""
    import torch

    if reference.numel() != port.numel() or reference.numel() < 2:
        return None
    names = list(axes) + [f"axis {d}" for d in range(len(axes), port.dim())]
    tol = max(_tolerance(reference), _tolerance(port))
    r, p = _float(reference), _float(port)
    if tuple(reference.shape) == tuple(port.shape):
        if float((r - p).abs().max()) <= tol:
            return None
        found = _exchanged_sub_axes(r, p, tol, names) or _reordered_axis(r, p, tol, names)
        if found is not None:
            words, undo = found
            residual = float((undo(port, {}).double() - r).abs().max())
            return Relation("rearrangement", words, residual, {"shape": list(port.shape)}, undo=undo)
    source = index_map(reference, port)
    if source is None or bool(torch.equal(source, torch.arange(source.numel()))):
        return None
    words = _sub_axes(source, tuple(reference.shape), tuple(port.shape), names)
    words = words or _block_reading(source, tuple(reference.shape), tuple(port.shape), names)
    if words is None:
        return None
    ref_shape = tuple(reference.shape)

    def undo(tensor: Any, _terms: dict) -> Any:
        flat = tensor.reshape(-1)
        back = torch.empty_like(flat)
        back[source.to(flat.device)] = flat
        return back.reshape(ref_shape)

    return Relation("rearrangement", words, 0.0, {"shape": list(port.shape)}, undo=undo)


_LEAD = "the port holds the reference's values in other places: "


def _match_rows(ps: Any, rs: Any) -> tuple[Any, Any]:
    r"""For each row of ``ps``, the nearest row of ``rs`` and the largest difference to it. Rows are first
    matched on a seeded projection to 8 numbers (cheap on long rows), then compared in full."""
    import torch

    if ps.shape[1] > 8:
        generator = torch.Generator().manual_seed(0)
        projection = torch.randn(ps.shape[1], 8, generator=generator, dtype=ps.dtype)
        candidates = torch.cdist(ps @ projection, rs @ projection).argmin(dim=1)
    else:
        candidates = torch.cdist(ps, rs).argmin(dim=1)
    distance = (ps - rs[candidates]).abs().amax(dim=1)
    return distance, candidates


def _exchanged_sub_axes(r: Any, p: Any, tol: float, names: list[str]) -> tuple[str, Any] | None:
    r"""One axis of size ``a·b`` that the reference reads as ``(a, b)`` and the port as ``(b, a)``."""
    for d, size in enumerate(r.shape):
        for a in range(2, size):
            if size % a or size // a < 2:
                continue
            b = size // a
            moved = r.unflatten(d, (a, b)).transpose(d, d + 1).flatten(d, d + 1)
            if float((moved - p).abs().max()) <= tol:
                gloss = (
                    ": pairs interleaved on one side, halves on the other"
                    if 2 in (a, b)
                    else ": one side reshapes that axis in the other order"
                )

                def undo(t: Any, _terms: dict, d=d, a=a, b=b) -> Any:
                    return t.unflatten(d, (b, a)).transpose(d, d + 1).flatten(d, d + 1)

                words = (
                    f"{_LEAD}{names[d]} ({size}) is read as ({a}, {b}) in the reference and ({b}, {a}) in the"
                    f" port{gloss}"
                )
                return words, undo
    return None


def _reordered_axis(r: Any, p: Any, tol: float, names: list[str]) -> tuple[str, Any] | None:
    r"""One axis's entries in another order: each port slice along it matched to the reference slice equal to
    it, the rest of the tensor in place."""
    import torch

    for d, size in enumerate(r.shape):
        if size < 2:
            continue
        rs, ps = r.movedim(d, 0).reshape(size, -1), p.movedim(d, 0).reshape(size, -1)
        best, order = _match_rows(ps, rs)
        if float(best.max()) > tol or len(set(order.tolist())) != size:
            continue
        order_list = order.tolist()
        if order_list == list(range(size)):
            continue
        index = order.clone()

        def undo(t: Any, _terms: dict, d=d, index=index) -> Any:
            back = torch.empty_like(index)
            back[index] = torch.arange(len(index))
            return t.index_select(d, back.to(t.device))

        return f"{_LEAD}{names[d]} ({size}) reordered: " + _describe_order(order_list), undo
    return None


def _block_reading(
    source: Any, ref_shape: tuple[int, ...], port_shape: tuple[int, ...], names: list[str]
) -> str | None:
    r"""The map keeps some digits of each position (the outer structure) and scrambles the rest: a block of
    values one side reads in another shape. Said as the block's size and the axes it spans, with the two
    readings when the block is a flat vector reshaped in two orders."""
    import itertools

    import torch

    if ref_shape != port_shape:
        return None
    digits: list[tuple[int, int, int]] = []  # (axis, factor, stride within the flat index)
    strides = [math.prod(port_shape[d + 1 :]) for d in range(len(port_shape))]
    for d, size in enumerate(port_shape):
        inner = strides[d]
        for f in reversed(_prime_factors(size)):
            digits.append((d, f, inner))
            inner *= f
    index = torch.arange(source.numel())
    kept, moved = [], []
    for d, f, stride in digits:
        same = torch.equal(index // stride % f, source // stride % f)
        (kept if same else moved).append((d, f, stride))
    if not moved or len(moved) > 6:
        return None
    readable = len(moved) <= 4 and source.numel() <= 4_000_000  # two readings tried over every value
    size = math.prod(f for _, f, _ in moved)
    spans = sorted({d for d, _, _ in moved})
    where = ", ".join(names[d] for d in spans)

    def flat(position: Any, order: Sequence[tuple[int, int, int]]) -> Any:
        out = torch.zeros_like(position)
        for _, f, stride in order:
            out = out * f + position // stride % f
        return out

    readings = ""
    # the block as one flat vector: the reference reads it in one order of its digits, the port in another
    for port_order in itertools.permutations(moved) if readable else ():
        for ref_order in itertools.permutations(moved):
            if ref_order == port_order:
                continue
            if torch.equal(flat(index, port_order), flat(source, ref_order)):
                shape_p = tuple(f for _, f, _ in port_order)
                shape_r = tuple(f for _, f, _ in ref_order)
                readings = (
                    f"; read as {_grouped(ref_order, names)} in the reference and"
                    f" {_grouped(port_order, names)}"
                    f" in the port ({shape_r} against {shape_p}): one side flattens it in another order (a"
                    " patch's features channels-last on one side)"
                )
                break
        if readings:
            break
    return f"{_LEAD}within each block of {size} values spanning {where} the order differs{readings}"


def _grouped(order: Sequence[tuple[int, int, int]], names: list[str]) -> str:
    r"""A reading of a block's digits, as the axes they come from (``(axis 1, axis 2, axis 3)``)."""
    return "(" + ", ".join(f"{names[d]}:{f}" for d, f, _ in order) + ")"


def _per_axis(source: Any, shape: tuple[int, ...], names: list[str]) -> str | None:
    r"""Each axis reordered on its own (the map separates by axis): which entries went where."""
    import torch

    dst = torch.stack(torch.unravel_index(torch.arange(source.numel()), shape))
    src = torch.stack(torch.unravel_index(source, shape))
    parts = []
    for d, size in enumerate(shape):
        order = torch.full((size,), -1, dtype=torch.long)
        order[dst[d]] = src[d]
        if bool((order < 0).any()):
            return None
        # the map along d must not depend on the other coordinates
        if not bool(torch.equal(order[dst[d]], src[d])):
            return None
        moved = [(i, int(j)) for i, j in enumerate(order.tolist()) if i != j]
        if moved:
            parts.append(f"{names[d]} ({size}) reordered: " + _describe_order(order.tolist()))
    return "the port holds the reference's values in other places: " + "; ".join(parts) if parts else None


def _describe_order(order: list[int]) -> str:
    r"""``port i ← reference j`` for the moved entries, as runs where they are contiguous."""
    if order == list(range(len(order)))[::-1]:
        return "reversed (entry i ← entry n − 1 − i)"
    runs = _runs(list(enumerate(order)))
    moved = [r for r in runs if r[0] != r[1]]
    if len(runs) <= 4 and all(length > 1 for _, _, length in runs):
        shown = [f"{a}–{a + n - 1} ← {b}–{b + n - 1}" for a, b, n in moved]
        text = "entries " + ", ".join(shown) + " (blocks in another order)"
    else:
        pairs = [f"{i} ← {j}" for i, j in enumerate(order) if i != j]
        text = ", ".join(pairs[:SHOWN]) + (f", … ({len(pairs)} moved)" if len(pairs) > SHOWN else "")
    if len(order) > 10 and order == sorted(range(len(order)), key=str):
        text += "; the indices were sorted as text (0, 1, 10, 11, …, 2)"
    return text


def _sub_axes(
    source: Any, ref_shape: tuple[int, ...], port_shape: tuple[int, ...], names: list[str]
) -> str | None:
    r"""The map as a permutation of sub-axes: each port axis split into factors, each factor read from one
    reference sub-axis. Linear in the mixed-radix digits, so found from the unit steps and checked
    everywhere."""
    import torch

    digits: list[tuple[int, int]] = []  # (port axis, factor), outermost first
    for d, size in enumerate(port_shape):
        digits += [(d, f) for f in _prime_factors(size)]
    if not digits:
        return None
    radix = [f for _, f in digits]
    strides = [math.prod(radix[k + 1 :]) for k in range(len(radix))]
    steps = [int(source[s]) - int(source[0]) for s in strides]
    index = torch.arange(source.numel())
    predicted = torch.full_like(index, int(source[0]))
    for k, (radius, stride) in enumerate(zip(radix, strides)):
        predicted += (index // stride % radius) * steps[k]
    if int(source[0]) != 0 or not bool(torch.equal(predicted, source)):
        return None
    # merge neighbouring digits of one port axis that stay contiguous in the reference
    groups: list[list[int]] = []
    for k in range(len(digits)):
        last = groups[-1] if groups else None
        if last and digits[last[-1]][0] == digits[k][0] and steps[last[-1]] == steps[k] * radix[k]:
            last.append(k)
        else:
            groups.append([k])
    ref_strides = [math.prod(ref_shape[d + 1 :]) for d in range(len(ref_shape))]
    described = []
    for group in groups:
        size = math.prod(radix[k] for k in group)
        step = steps[group[-1]]
        axis = next(
            (d for d, s in enumerate(ref_strides) if step % s == 0 and step // s < ref_shape[d]), None
        )
        if axis is None:
            return None
        within = step // ref_strides[axis]
        described.append((digits[group[0]][0], size, axis, within))
    # say only the port axes whose pieces do not come straight from the same reference axis in order
    parts = []
    for d, size in enumerate(port_shape):
        pieces = [(s, a, w) for pd, s, a, w in described if pd == d]
        straight = len(pieces) == 1 and pieces[0][1] == d and pieces[0][2] == 1 and ref_shape[d] == size
        if straight or size == 1:
            continue
        read = ", ".join(
            f"{s} from {names[a] if a < len(names) else f'axis {a}'}" + (f" (step {w})" if w != 1 else "")
            for s, a, w in pieces
        )
        parts.append(f"{names[d]} ({size}) is read as ({read})")
    if not parts:
        return None
    return (
        "the port holds the reference's values in other places, a permutation of sub-axes: "
        + "; ".join(parts)
        + _sub_axis_gloss(described, port_shape)
    )


def _sub_axis_gloss(described: list[tuple[int, int, int, int]], port_shape: tuple[int, ...]) -> str:
    r"""A plain reading of the commonest case: one axis's two factors exchanged (halves vs interleaved
    pairs)."""
    for d in range(len(port_shape)):
        pieces = [(s, a, w) for pd, s, a, w in described if pd == d]
        if len(pieces) == 2 and pieces[0][1] == pieces[1][1] == d and pieces[0][2] == 1:
            outer, inner = pieces[0][0], pieces[1][0]
            if 2 in (outer, inner):
                return (
                    f" — axis {d}'s two sub-axes ({inner}, {outer}) are taken in the other order: pairs "
                    "interleaved on one side, halves on the other"
                )
            return f" — axis {d}'s sub-axes ({inner}, {outer}) are taken in the other order"
    return ""


# ------------------------------------------------------------------------------------------ sequence rows


def sequence_rows(reference: Any, port: Any, axis: int | None = None) -> Relation | None:
    r"""Along one axis (the one whose length differs, else ``axis``), the port's rows are the reference's with
    rows added, dropped or reordered: each port row matched to the reference row equal to it."""
    import torch

    if reference.dim() != port.dim() or reference.dim() < 2:
        return None
    differing = [d for d in range(port.dim()) if reference.shape[d] != port.shape[d]]
    if len(differing) > 1:
        return None
    d = differing[0] if differing else (axis if axis is not None else 1)
    r = _float(reference).movedim(d, 0)
    r = r.reshape(r.shape[0], -1)
    p = _float(port).movedim(d, 0)
    p = p.reshape(p.shape[0], -1)
    if r.shape[1] != p.shape[1] or r.shape[1] == 0:
        return None
    tol = max(_tolerance(reference), _tolerance(port))
    best, match = _match_rows(p, r)
    matched = best <= tol
    source = [int(j) if ok else -1 for j, ok in zip(match.tolist(), matched.tolist())]
    used = {j for j in source if j >= 0}
    if len(used) != sum(j >= 0 for j in source) or not used:
        return None  # a reference row matched twice: rows are not distinct enough to say
    if source == list(range(r.shape[0])) and p.shape[0] == r.shape[0]:
        return None
    extra = [i for i, j in enumerate(source) if j < 0]
    dropped = [j for j in range(r.shape[0]) if j not in used]
    kept = [(i, j) for i, j in enumerate(source) if j >= 0]
    if len(kept) < max(2, min(r.shape[0], p.shape[0]) // 2):
        return None  # most rows differ: not a rearrangement of rows
    parts = []
    if extra:
        parts.append(f"port rows {_ranges(extra)} are not in the reference (added on the port's side)")
    if dropped:
        parts.append(f"reference rows {_ranges(dropped)} are not in the port (dropped)")
    runs = _runs(kept)
    if len(runs) > 1 or (runs and runs[0][0] != runs[0][1]):
        parts.append(
            "port rows "
            + ", ".join(f"{a}–{a + n - 1} are reference rows {b}–{b + n - 1}" for a, b, n in runs[:SHOWN])
        )
    if not parts:
        return None
    residual = float(max((best[i] for i, _ in kept), default=0.0))
    undo = None
    if not dropped:  # rows the port lacks cannot be made back from its own
        rows = [i for i, _ in sorted(kept, key=lambda ij: ij[1])]

        def undo(tensor: Any, _terms: dict) -> Any:
            return tensor.index_select(d, torch.tensor(rows, device=tensor.device))

    return Relation(
        "sequence",
        f"along axis {d}: " + "; ".join(parts),
        residual,
        {"axis": d, "extra": extra, "dropped": dropped, "runs": runs},
        undo=undo,
    )


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for i, j in pairs:
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == j:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, j, 1))
    return runs


def _ranges(values: list[int]) -> str:
    runs = _runs([(v, v) for v in values])
    return ", ".join(f"{a}" if n == 1 else f"{a}–{a + n - 1}" for a, _, n in runs)


# ------------------------------------------------------------------------------------------ scale and terms


def scale(reference: Any, port: Any, sizes: Sequence[int] = ()) -> Relation | None:
    r"""``port = k·reference`` for a constant ``k`` snapped to a simple or named constant."""
    from paritykit.bisection.constants import snapped

    if tuple(reference.shape) != tuple(port.shape) or reference.numel() < 2:
        return None
    r, p = _float(reference).flatten(), _float(port).flatten()
    norm = float(r @ r)
    if norm == 0.0:
        return None
    k = float(r @ p) / norm
    # √2 and 1/√2 (a residual sum rescaled) besides the sizes of the tensor
    near = snapped(k, (*(sizes or tuple(reference.shape)), 2), rel=1e-3)
    if not near or near[0][0] in (0.0, 1.0):
        return None
    value, label = near[0]
    residual = float((value * r - p).abs().max())
    if residual > max(_tolerance(port), _tolerance(reference)):
        return None
    return Relation(
        "scale",
        f"port = {label} × reference",
        residual,
        {"factor": value, "fitted": k},
        undo=lambda tensor, _terms: tensor / value,
    )


def missing_term(
    reference: Any, port: Any, terms: dict[str, Any], sizes: Sequence[int] = ()
) -> Relation | None:
    r"""``port = reference + Σ c_i·term_i`` by least squares over the captured ``terms`` (same numel as the
    output, or broadcastable to it), each ``c_i`` snapped to a simple constant; only when the snapped sum
    reproduces the port within tolerance and no smaller set of terms does."""
    import itertools

    import torch

    from paritykit.bisection.constants import snapped

    if tuple(reference.shape) != tuple(port.shape):
        return None
    r, p = _float(reference), _float(port)
    difference = (p - r).flatten()
    tol = max(_tolerance(port), _tolerance(reference))
    if float(difference.abs().max()) <= tol:
        return None
    columns = {}
    for name, t in terms.items():
        try:
            column = torch.broadcast_to(_float(t), r.shape).flatten()
        except (RuntimeError, TypeError):
            continue
        if float(column.abs().max()) > 0 and not any(torch.equal(column, c) for c in columns.values()):
            columns[name] = column
    names = list(columns)[:MAX_TERMS]
    # pairs of terms only while their fits stay cheap (a big place with many captured tensors: single terms)
    counts = (1, 2) if len(names) <= MAX_PAIRED and difference.numel() <= MAX_PAIRED_ELEMENTS else (1,)
    for count in counts:
        for chosen in itertools.combinations(names, count):
            basis = torch.stack([columns[n] for n in chosen], dim=1)
            fit = least_squares(basis, difference)
            snaps = [snapped(abs(float(c)), (*(sizes or tuple(reference.shape)), 2), rel=1e-3) for c in fit]
            if not all(snaps) or any(s[0][0] == 0.0 for s in snaps):
                continue
            signs = [math.copysign(1.0, float(c)) for c in fit]
            values = torch.tensor([g * s[0][0] for g, s in zip(signs, snaps)], dtype=torch.float64)
            residual = float((basis @ values - difference).abs().max())
            if residual > tol:
                continue
            sum_words = " ".join(
                f"{'−' if v < 0 else '+'} {_coefficient(label, v)}{n}"
                for n, v, label in zip(chosen, values.tolist(), (s[0][1] for s in snaps))
            )
            coefficients = values.tolist()

            def undo(tensor: Any, given: dict, chosen=chosen, coefficients=coefficients) -> Any:
                out = tensor
                for name, c in zip(chosen, coefficients):
                    out = out - c * given[name].to(out.dtype)
                return out

            return Relation(
                "term",
                f"port = reference {sum_words}: a term the port adds (or the reference drops)",
                residual,
                {"terms": list(chosen), "coefficients": coefficients},
                undo=undo,
            )
    return None


def _coefficient(label: str, value: float) -> str:
    return "" if abs(abs(value) - 1.0) < 1e-12 else f"{label}·"


def saturation(reference: Any, port: Any) -> Relation | None:
    r"""One side is the other clamped to ``[lo, hi]`` (its own least and greatest values, each reached by
    several values the other side has beyond it): an output clamp one implementation has."""
    import torch

    if tuple(reference.shape) != tuple(port.shape) or reference.numel() < 4:
        return None
    r, p = _float(reference), _float(port)
    tol = max(_tolerance(reference), _tolerance(port))
    for clamped, free, side, other in ((r, p, "reference", "port"), (p, r, "port", "reference")):
        lo, hi = float(clamped.min()), float(clamped.max())
        if not lo < hi or float((torch.clamp(free, lo, hi) - clamped).abs().max()) > tol:
            continue
        beyond = (free < lo - tol) | (free > hi + tol)
        cut = [int((free < lo - tol).sum()), int((free > hi + tol).sum())]
        if not bool(beyond.any()) or any(0 < k < 2 for k in cut):
            continue
        undo = (lambda t, _terms, lo=lo, hi=hi: torch.clamp(t, lo, hi)) if side == "reference" else None
        return Relation(
            "saturation",
            f"{side} = {clamp_words(other, lo, hi, cut)}: the {side} cuts where the {other} does not"
            f" ({int(beyond.sum())} values beyond)",
            float((torch.clamp(free, lo, hi) - clamped).abs().max()),
            {"clamped": side, "low": lo, "high": hi},
            undo=undo,
        )
    return None


def _pointwise_functions() -> dict[str, tuple[Any, Any]]:
    r"""Named elementwise maps a port applies once more or once less: ``name -> (f, inverse or None)``."""
    import torch
    import torch.nn.functional as F

    return {
        "tanh": (torch.tanh, lambda y: torch.atanh(y.clamp(-1 + 1e-7, 1 - 1e-7))),
        "sigmoid": (torch.sigmoid, lambda y: torch.logit(y, eps=1e-7)),
        "SiLU": (F.silu, None),
        "GELU": (F.gelu, None),
        "GELU (tanh)": (lambda x: F.gelu(x, approximate="tanh"), None),
        "QuickGELU x·sigmoid(1.702x)": (lambda x: x * torch.sigmoid(1.702 * x), None),
        "ReLU": (F.relu, None),
        "softplus": (F.softplus, lambda y: torch.where(y > 20, y, torch.log(torch.expm1(y)))),
        "exp": (torch.exp, lambda y: torch.log(y)),
        "round": (torch.round, None),
    }


def pointwise_map(reference: Any, port: Any) -> Relation | None:
    r"""One side is a named elementwise function of the other (``port = tanh(reference)``: an activation, an
    exp or a rounding one side applies once more): the first function that reproduces it to tolerance."""
    import torch

    if tuple(reference.shape) != tuple(port.shape) or reference.numel() < 8:
        return None
    r, p = _float(reference), _float(port)
    tol = max(_tolerance(reference), _tolerance(port), 1e-6)
    if float((r - p).abs().max()) <= tol:
        return None
    for name, (f, inverse) in _pointwise_functions().items():
        for src, dst, side, other in ((r, p, "port", "reference"), (p, r, "reference", "port")):
            with torch.no_grad():
                mapped = f(src)
            residual = float((mapped - dst).abs().max())
            if residual > tol:
                continue
            if side == "reference":

                def undo(t: Any, _terms: dict, f=f) -> Any:
                    return f(t)

            elif inverse is not None:

                def undo(t: Any, _terms: dict, inverse=inverse) -> Any:
                    return inverse(t).to(t.dtype)

            else:
                undo = None
            return Relation(
                "pointwise",
                f"{side} = {name}({other}): the {side} applies {name} to the {other}'s values once more",
                residual,
                {"function": name, "applied_by": side},
                undo=undo,
            )
    return None


def relate(
    reference: Any, port: Any, terms: dict[str, Any] | None = None, axes: Sequence[str] = ()
) -> list[Relation]:
    r"""Every relation that holds between the reference's and the port's tensor at one place, the most
    specific first: a rearrangement, a sequence of rows, a scale, a missing term."""
    import torch

    if not (isinstance(reference, torch.Tensor) and isinstance(port, torch.Tensor)):
        return []
    if not (reference.is_floating_point() and port.is_floating_point()):
        return []
    if reference.shape == port.shape and bool(torch.equal(reference, port)):
        return []
    found = []
    for relation in (
        rearrangement(reference, port, axes),
        saturation(reference, port),
        pointwise_map(reference, port),
        sequence_rows(reference, port) if reference.shape != port.shape else None,
        scale(reference, port),
        missing_term(reference, port, terms or {}),
    ):
        if relation is not None:
            found.append(relation)
    return found[:1] if found and found[0].kind == "rearrangement" else found
