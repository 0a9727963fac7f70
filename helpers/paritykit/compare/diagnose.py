r"""Diagnoses: given two tensors that should match but do not, name the likely cause with evidence.

Each detector is a small function that either recognises one signature of a porting bug or returns ``None``.
:func:`diagnose` runs them all and ranks what they found. The ids are stable: the skill pack maps its pitfalls
to them, so rename nothing.

Ids, roughly in rank order:

- ``nonfinite``: NaN/Inf on one side only (first position reported).
- ``transpose`` / ``permute``: B is A with two axes swapped / its axes reordered (also across differing
  shapes).
- ``swapped-halves``: B is A with the halves (or k chunks) along one dim reordered (shift/scale order).
- ``zeroed``: one side is all zeros (a branch disabled or scaled by 0).
- ``saturation``: one side is the other clamped to ``[lo, hi]`` (an output clamp only one side has).
- ``timestep-rounding``: differences only where values have a fractional part, one side rounded there.
- ``bf16-cast`` / ``fp16-cast``: one side is the other rounded to that dtype, or only one side lies on its
  grid.
- ``sign-flip``: magnitudes agree, signs differ (everywhere or on part of the tensor).
- ``constant-scale``: B ≈ k·A (a scale knob differs; one knob may stand for two concepts).
- ``offset``: B ≈ A + c.

Every detector demands that its transform *explains* the difference: the transformed A must be much closer to
B than A itself is, so two nearly equal tensors never get a structural hint by coincidence.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paritykit.base.report import format_number

if TYPE_CHECKING:
    import torch

# A transform "explains" a difference when what remains is at most this share of ||B - A||.
EXPLAINED = 0.1
# A structural match (transpose, halves, cast) leaves at most this relative error ||T(A) - B|| / ||B||.
MATCH_REL = 1e-3
# Elementwise detectors look at an evenly strided sample of at most this many elements.
SAMPLE = 1 << 18
# Whole-tensor scans walk flat chunks of this many elements.
CHUNK = 1 << 18
# Structural detectors confirm a candidate on a leading block of at most this many elements.
BLOCK = 1 << 20


@dataclass
class Hint:
    r"""One likely cause of a mismatch.

    Args:
        id: stable identifier (``constant-scale``, ``transpose``, …) that skills and tools key on.
        message: one sentence for a person: what differs, the evidence for it, and what to check.
        evidence: the supporting numbers (scale factor, axes, counts, residuals, before/after errors).
        score: confidence in [0, 1] used for ranking; higher first.
        verified: ``True`` when the fix was applied to a copy of the port and the module then matched the
            reference, ``False`` when that was tried and it did not match, ``None`` when not tried.
        fix: one line saying what to change (``blocks.0.norm.eps = 1e-06``), when a cause is that concrete.
    """

    id: str
    message: str
    evidence: dict[str, Any] = field(default_factory=dict)
    score: float = 0.5
    verified: bool | None = None
    fix: str | None = None

    def fix_scope(self) -> str:
        r"""Where a verified fix was measured beyond its module: the whole model's output with it, and
        without it; empty when it was not run there."""
        after, before = self.evidence.get("model_max_abs_after"), self.evidence.get("model_max_abs_before")
        if after is None or before is None:
            return ""
        from paritykit.base.report import format_number

        return (
            f" (the module then matches; the whole output with it: max_abs {format_number(after)}, without it"
            f" {format_number(before)})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "message": self.message,
            "evidence": dict(self.evidence),
            "score": self.score,
            "verified": self.verified,
            "fix": self.fix,
        }

    def render(self) -> str:
        return f"[{self.id}] {self.message}"


# ----------------------------------------------------------------------------------------------- helpers


def _norm(x: torch.Tensor) -> float:
    import torch

    return float(torch.linalg.vector_norm(x.double()))


def unravel_index(flat_index: int, shape: Sequence[int]) -> tuple[int, ...]:
    r"""The index of element ``flat_index`` of a row-major tensor of ``shape`` (a size-0 dim gives 0
    there)."""
    index = []
    for size in reversed(shape):
        index.append(flat_index % size if size else 0)
        flat_index = flat_index // size if size else 0
    return tuple(reversed(index))


def _metric(value: float) -> str:
    return str(value) if value == 0 else format_number(value, 3, exponent_digits=3)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _as_real(t: Any) -> torch.Tensor:
    import torch

    t = torch.as_tensor(t)
    if t.is_complex():
        t = torch.view_as_real(t)
    if not t.is_floating_point():
        t = t.to(torch.float64)
    return t.detach()


def _gather(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    r"""Elements at row-major ``positions``, without the full-size copy ``reshape(-1)`` makes of a strided
    view."""
    import torch

    if t.is_contiguous():
        return t.reshape(-1)[positions]
    return t[torch.unravel_index(positions, t.shape)]


def _chunks(t: torch.Tensor, size: int = CHUNK) -> Iterator[tuple[int, torch.Tensor]]:
    r"""``(start, flat chunk)`` pairs covering ``t`` in row-major order."""
    import torch

    n = t.numel()
    flat = t.reshape(-1) if t.is_contiguous() else None
    for start in range(0, n, size):
        if flat is not None:
            yield start, flat[start : start + size]
        else:
            yield start, _gather(t, torch.arange(start, min(start + size, n), device=t.device))


def _sample(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The same evenly strided positions of both tensors in float64, restricted to where both are finite."""
    import torch

    step = max(1, math.ceil(a.numel() / SAMPLE))
    positions = torch.arange(0, a.numel(), step, device=a.device)
    x = _gather(a, positions).to(torch.float64)
    y = _gather(b, positions.to(b.device)).to(device=x.device, dtype=torch.float64)
    finite = torch.isfinite(x) & torch.isfinite(y)
    if not bool(finite.all()):
        x, y = x[finite], y[finite]
    return x, y


def _block(shape: tuple[int, ...], max_elements: int) -> tuple[slice, ...]:
    r"""Slices of a leading block of ``shape`` with at most ``max_elements`` elements (largest dims shrink
    first)."""
    sizes = list(shape)
    while math.prod(sizes) > max_elements:
        i = max(range(len(sizes)), key=lambda k: sizes[k])
        sizes[i] = max(1, sizes[i] // 2)
    return tuple(slice(0, s) for s in sizes)


def _rel_gap(x: torch.Tensor, y: torch.Tensor) -> float:
    """||x - y|| / ||y|| (0 when both are zero), in at least float32 with one temporary."""
    import torch

    work = torch.promote_types(torch.promote_types(x.dtype, y.dtype), torch.float32)
    x, y = x.to(work), y.to(device=x.device, dtype=work)
    num = float(torch.linalg.vector_norm(x - y))
    den = float(torch.linalg.vector_norm(y))
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def _structural_match(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    r"""Whether ``t`` (a view of A shaped like B) matches B, checked on a tiny leading block, then a large
    one.

    On equal shapes the match must also *explain* the difference: ``t`` much closer to B than A itself.
    """
    gap = math.inf
    for limit in (64, BLOCK):
        blk = _block(tuple(b.shape), limit)
        gap = _rel_gap(t[blk], b[blk])
        if gap > MATCH_REL:
            return False, gap
    if a.shape == b.shape and not gap <= EXPLAINED * _rel_gap(a[blk], b[blk]):
        return False, gap
    return True, gap


# ------------------------------------------------------------------------------------- whole-tensor detectors


def detect_nonfinite(a: torch.Tensor, b: torch.Tensor) -> Hint | None:
    r"""NaN/Inf on one side where the other side is finite; reports counts and the first such position."""
    import torch

    if a.shape != b.shape:
        return None
    counts = {"a_only": 0, "b_only": 0}
    first: int | None = None
    for (start, ca), (_, cb) in zip(_chunks(a), _chunks(b)):
        ok_a = torch.isfinite(ca)
        ok_b = torch.isfinite(cb.to(ok_a.device))
        only_a = ~ok_a & ok_b
        only_b = ok_a & ~ok_b
        n_a, n_b = int(only_a.sum()), int(only_b.sum())
        if (n_a or n_b) and first is None:
            first = start + int(torch.nonzero(only_a | only_b)[0, 0])
        counts["a_only"] += n_a
        counts["b_only"] += n_b
    if first is None:
        return None
    index = unravel_index(first, tuple(a.shape))
    va, vb = float(a[index]), float(b[index])
    if counts["b_only"] and not counts["a_only"]:
        where = f"B has {_count(counts['b_only'], 'NaN/Inf value')} where A is finite"
    elif counts["a_only"] and not counts["b_only"]:
        where = f"A has {_count(counts['a_only'], 'NaN/Inf value')} where B is finite"
    else:
        where = (
            f"A and B have NaN/Inf in different places ({counts['a_only']} in A only, {counts['b_only']} in B"
            " only)"
        )
    return Hint(
        "nonfinite",
        f"{where} (first at index {index}: A={_metric(va)}, B={_metric(vb)}); look for an overflow (fp16"
        " range), a division by zero or a log/sqrt of a non-positive value on that side.",
        {
            "a_only": counts["a_only"],
            "b_only": counts["b_only"],
            "first_index": list(index),
            "a": va,
            "b": vb,
        },
        score=1.0,
    )


def detect_zeroed(a: torch.Tensor, b: torch.Tensor) -> Hint | None:
    r"""One side all zeros while the other is not: a branch disabled, or scaled by 0."""
    import torch

    if a.shape != b.shape or a.numel() == 0:
        return None
    zero_a = all(int(torch.count_nonzero(c)) == 0 for _, c in _chunks(a))
    zero_b = all(int(torch.count_nonzero(c)) == 0 for _, c in _chunks(b))
    if zero_a == zero_b:
        return None
    side, other, t = ("B", "A", a) if zero_b else ("A", "B", b)
    peak = max(float(c.abs().nan_to_num(0.0).max()) for _, c in _chunks(t))
    return Hint(
        "zeroed",
        f"{side} is all zeros while {other} is not (max |{other}| = {_metric(peak)}): a branch is disabled or"
        f" scaled by 0 on {side}'s side (a zero-initialised layer, a scale or mask set to 0).",
        {"zero_side": side.lower(), f"max_abs_{other.lower()}": peak},
        score=0.95,
    )


def _relu_of(x: torch.Tensor, y: torch.Tensor) -> bool:
    r"""Whether ``y`` is ``x`` with exactly its negative values zeroed: a ReLU (the saturation hint says
    so), not a mask."""
    return bool(((x < 0) == ((y == 0) & (x != 0))).all())


def detect_masked(a: torch.Tensor, b: torch.Tensor) -> Hint | None:
    r"""One side equals the other except at some elements, where it is exactly 0 and the other is not: values
    masked to zero on that side only (a mask one side applies before the call, the other inside it)."""
    if a.shape != b.shape or a.numel() < 2 or not a.is_floating_point():
        return None
    scale = max(float(c.abs().nan_to_num(0.0).max()) for _, c in _chunks(a))
    if scale == 0:
        return None
    for side, other, (x, y) in (("B", "A", (a, b)), ("A", "B", (b, a))):
        zeroed = agree_elsewhere = kept = 0
        for (_, cx), (_, cy) in zip(_chunks(x), _chunks(y), strict=True):
            cx, cy = cx.double(), cy.to(device=cx.device).double()
            hole = (cy == 0) & (cx != 0)
            zeroed += int(hole.sum())
            kept += int((cy != 0).sum())
            rest = ~hole
            agree_elsewhere += int(((cx[rest] - cy[rest]).abs() <= 1e-5 * scale).sum())
        if zeroed and kept and zeroed + agree_elsewhere == a.numel() and not _relu_of(x, y):
            share = zeroed / a.numel()
            return Hint(
                "masked",
                f"{side} equals {other} except at {_count(zeroed, 'element')} ({share:.1%}), where {side} is"
                f" 0 and {other} is not: values masked to zero on {side}'s side only (a mask one side applies"
                " before this call and the other inside it, or one side alone).",
                {"zero_side": side.lower(), "masked_elements": zeroed, "share": share},
                score=0.9,
            )
    return None


def detect_transpose(a: torch.Tensor, b: torch.Tensor) -> Hint | None:
    r"""B is A with its axes reordered: ``transpose`` for one swapped pair, ``permute`` otherwise.

    Works across differing shapes (``(B, S, H, D)`` vs ``(B, H, S, D)``) and on equal shapes (square
    matrices)."""
    if a.ndim != b.ndim or a.ndim < 2 or a.ndim > 6 or a.numel() != b.numel() or a.numel() == 0:
        return None
    identity = tuple(range(a.ndim))
    for perm in itertools.permutations(identity):
        if perm == identity or tuple(a.shape[p] for p in perm) != tuple(b.shape):
            continue
        ok, gap = _structural_match(a.permute(*perm), a, b)
        if not ok:
            continue
        moved = [i for i in identity if perm[i] != i]
        if len(moved) == 2:
            i, j = moved
            return Hint(
                "transpose",
                f"B equals A with axes {i} and {j} swapped (evidence: relative residual {_metric(gap)} after "
                "swapping them): a transpose is missing or extra on one side "
                "(Conv1D vs Linear weights, (batch, heads, seq, dim) vs (batch, seq, heads, dim)).",
                {"axes": [i, j], "shape_a": list(a.shape), "shape_b": list(b.shape), "residual": gap},
                score=0.97,
            )
        return Hint(
            "permute",
            f"B equals A.permute{perm} (evidence: relative residual {_metric(gap)} after permuting): the axis"
            " order differs between the sides (channels-last vs channels-first, head/sequence layout).",
            {"dims": list(perm), "shape_a": list(a.shape), "shape_b": list(b.shape), "residual": gap},
            score=0.97,
        )
    return None


def detect_swapped_halves(a: torch.Tensor, b: torch.Tensor) -> Hint | None:
    r"""B is A with the two halves (or ``k`` equal chunks) along one dim in another order.

    The classic case is ``shift, scale = emb.chunk(2)`` on one side and ``scale, shift`` on the other; along a
    batch of two it is the (uncond, cond) order of classifier-free guidance.
    """
    if a.shape != b.shape or a.ndim == 0:
        return None
    for k in (2, 3, 4, 6):
        for dim in reversed(range(a.ndim)):
            size = a.shape[dim]
            if size < k or size % k:
                continue
            order = _chunk_order(a, b, dim, k)
            if order is None:
                continue
            evidence = {"dim": dim, "size": size, "chunks": k, "order": order}
            if k == 2:
                message = (
                    f"B is A with its two halves along dim {dim} (size {size}) swapped (evidence: each half "
                    "matches the other's place, not its own): check the order of a "
                    "chunked pair such as (shift, scale) in adaptive norms, or (uncond, cond) in guidance."
                )
            elif (grid := _grid_transpose(order)) is not None:
                rows, cols = grid
                message = (
                    f"B is A with its {k} chunks along dim {dim} (size {size}) reordered as {order}"
                    " (evidence: each chunk matches another chunk's place, not its own): read as a"
                    f" {rows} x {cols} grid, one side's order is the other's transposed, as a batch repeated"
                    " whole (repeat) against one repeated item by item (repeat_interleave), or a fused"
                    " projection's pieces laid out per head against per piece."
                )
            else:
                message = (
                    f"B is A with its {k} chunks along dim {dim} (size {size}) reordered as {order}"
                    " (evidence: each chunk matches another chunk's place, not its own): check the order of"
                    " a chunked projection (shift/scale/gate) or of a fused qkv."
                )
            return Hint("swapped-halves", message, evidence, score=0.96)
    return None


def _grid_transpose(order: list[int]) -> tuple[int, int] | None:
    r"""``(rows, cols)`` where ``order`` reads ``rows x cols`` chunks in the transposed order
    (``[0, 3, 1, 4, 2, 5]``: a 2 x 3 grid, items tiled against items interleaved); ``None`` otherwise."""
    n = len(order)
    for rows in range(2, n // 2 + 1):
        if n % rows:
            continue
        cols = n // rows
        if order == [(i % rows) * cols + i // rows for i in range(n)]:
            return rows, cols
    return None


def _chunk_order(a: torch.Tensor, b: torch.Tensor, dim: int, k: int) -> list[int] | None:
    r"""For each chunk of B the index of the chunk of A it equals, if that is a non-identity permutation.

    A moved chunk must match its new place much better than the chunk of A that sits there already, so a
    tensor whose chunks happen to be alike gets no hint.
    """
    step = a.shape[dim] // k
    chunks_a = [a.narrow(dim, i * step, step) for i in range(k)]
    chunks_b = [b.narrow(dim, i * step, step) for i in range(k)]
    tiny = _block(tuple(chunks_b[0].shape), 64)
    large = _block(tuple(chunks_b[0].shape), max(64, BLOCK // k))
    order: list[int] = []
    for i, cb in enumerate(chunks_b):
        found = None
        for j, ca in enumerate(chunks_a):
            if j in order or _rel_gap(ca[tiny], cb[tiny]) > MATCH_REL:
                continue
            gap = _rel_gap(ca[large], cb[large])
            if gap <= MATCH_REL and (j == i or gap <= EXPLAINED * _rel_gap(chunks_a[i][large], cb[large])):
                found = j
                break
        if found is None:
            return None
        order.append(found)
    return None if order == list(range(k)) else order


# ---------------------------------------------------------------------------------- elementwise detectors
# These take x (from A) and y (from B): the same positions, float64, both finite.


def detect_sign_flip(x: torch.Tensor, y: torch.Tensor) -> Hint | None:
    r"""|B| = |A| but signs differ: everywhere (B = -A) or on part of the tensor (a sign convention)."""
    if x.numel() == 0:
        return None
    base = _rel_gap(x, y)
    if base == 0 or _rel_gap(x.abs(), y.abs()) > MATCH_REL:
        return None
    scale = float(x.abs().max())
    significant = (x.abs() > 1e-6 * scale) & (y.abs() > 1e-6 * scale)
    n = int(significant.sum())
    if n == 0:
        return None
    flipped = int(((x.sign() != y.sign()) & significant).sum())
    fraction = flipped / n
    if flipped == 0:
        return None
    if fraction > 0.999:
        return Hint(
            "sign-flip",
            "B = -A (evidence: every sign flipped, magnitudes equal): a sign convention differs (negated"
            " velocity or noise direction, sin vs -sin, subtraction order).",
            {"flipped_fraction": fraction},
            score=0.93,
        )
    return Hint(
        "sign-flip",
        f"Magnitudes agree but signs differ at {fraction:.1%} of elements (evidence: |A| = |B|): a sign "
        "convention differs on part of "
        "the tensor (e.g. rotary embeddings' rotate-half, or one negated branch).",
        {"flipped_fraction": fraction},
        score=0.85,
    )


def _power_form(k: float) -> str | None:
    r"""Express ``k`` as ``r^n`` with a two-decimal ``r`` and n in 2..4 (0.857375 → "0.95^3"), if it is
    one."""
    if k <= 0:
        return None
    for n in (2, 3, 4):
        root = k ** (1.0 / n)
        nice = round(root, 2)
        if nice not in (0.0, 1.0) and abs(nice**n - k) <= 1e-4 * k:
            return f"{nice:g}^{n}"
    return None


# a scale or an offset fitted over fewer values than this is no evidence (one value fits any of them)
MIN_FIT_VALUES = 4


def detect_constant_scale(x: torch.Tensor, y: torch.Tensor) -> Hint | None:
    r"""B ≈ k·A with one steady factor k (not 0, not -1): a scale knob differs between the sides."""
    import torch

    if x.numel() < MIN_FIT_VALUES:
        return None  # one value is k·(another) for some k: no evidence of a scale
    xx = float(torch.dot(x, x))
    if xx == 0:
        return None
    k = float(torch.dot(x, y)) / xx
    base = _norm(y - x)
    if base == 0 or abs(k) < 1e-6 or abs(k + 1) < 1e-3:
        return None
    residual = _norm(y - k * x) / base
    if residual > EXPLAINED:
        return None
    # measured against B itself too: a B far smaller than A leaves a residual small next to the difference
    # (nearly all of A) and large next to B (round 38, Protenix: "B ≈ 0.01845·A everywhere")
    if _norm(y - k * x) > EXPLAINED * _norm(y):
        return None
    power = _power_form(k)
    shown = _metric(k) + (f" (= {power})" if power else "")
    evidence: dict[str, Any] = {"k": k, "residual": residual}
    if power:
        evidence["power_form"] = power
    return Hint(
        "constant-scale",
        f"B ≈ {shown}·A everywhere (evidence: least-squares factor, residual {_metric(residual)} of the "
        "difference): one scale between the two sides (a lead: one knob may stand for two concepts, e.g. a"
        " control scale also applied to a time mixture).",
        evidence,
        score=0.9 - 0.5 * residual,
    )


def detect_offset(x: torch.Tensor, y: torch.Tensor, name: str | None = None) -> Hint | None:
    r"""B ≈ A + c with one constant c: a bias or shift term differs (a missing or extra ``1 +``).

    On a timestep or sigma list (``name`` says so, or the values are a non-negative monotone sequence) the
    hint names the scheduler keys that shift a schedule, and ``paritykit schedule`` to confirm.
    """
    if x.numel() < MIN_FIT_VALUES:
        return None  # two values always differ by some constant: no evidence of an offset
    diff = y - x
    base = _norm(diff)
    if base == 0:
        return None
    c = float(diff.mean())
    residual = _norm(diff - c) / base
    if c == 0 or residual > EXPLAINED:
        return None
    steps = x[1:] - x[:-1]
    schedule = any(k in (name or "").lower() for k in ("timestep", "sigma")) or (
        1 < x.numel() <= 10_000 and bool((x >= 0).all()) and bool((steps < 0).all() or (steps > 0).all())
    )
    what = (
        "on a timestep/sigma list: the scheduler keys that shift a schedule are timestep_spacing and "
        "steps_offset (check with `paritykit schedule`)"
        if schedule
        else (
            "a constant shift differs (a bias, a shift term, or a constant such as `+ 1` added on one side"
            " only)"
        )
    )
    return Hint(
        "offset",
        f"B ≈ A {'+' if c > 0 else '−'} {_metric(abs(c))} everywhere: {what}.",
        {"c": c, "residual": residual},
        score=0.88 - 0.5 * residual,
    )


def _on_grid(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r"""Elementwise: the value is exactly representable in ``dtype`` (a round trip leaves it unchanged)."""
    import torch

    return t.to(dtype).to(torch.float64) == t


def _grid_share(t: torch.Tensor, dtype: torch.dtype) -> float:
    return float(_on_grid(t, dtype).double().mean()) if t.numel() else 0.0


def _make_cast_detector(dtype_name: str, hint_id: str, coarser: str | None) -> Callable:
    def detect(x: torch.Tensor, y: torch.Tensor) -> Hint | None:
        import torch

        dtype = getattr(torch, dtype_name)
        if x.numel() == 0 or _rel_gap(x, y) == 0:
            return None
        for src, dst, side in ((x, y, "B"), (y, x, "A")):
            rounded = src.to(dtype).to(torch.float64)
            if bool((rounded == src).all()):
                continue  # already representable: rounding explains nothing
            exact = float((rounded == dst).double().mean())
            if exact >= 0.99:
                other = "A" if side == "B" else "B"
                return Hint(
                    hint_id,
                    f"{side} equals {other} rounded to {dtype_name} at {exact:.1%} of elements (evidence: "
                    f"exact equality after rounding): {side}'s side casts this tensor (or its input) to "
                    f"{dtype_name}.",
                    {"exact_fraction": exact, "rounded_side": side.lower()},
                    score=0.94,
                )
        return _grid_hint(x, y, dtype, dtype_name, hint_id, coarser)

    detect.__name__ = f"detect_{hint_id.replace('-', '_')}"
    detect.__doc__ = (
        f"One side equals the other rounded to {dtype_name}, or only one side's values lie on the"
        f" {dtype_name} grid. Relative errors of the order of the unit roundoff alone are not evidence (float"
        " noise, GELU approximations and eps changes produce them too)."
    )
    return detect


# the grid test needs this many non-trivial values: a few on-grid numbers happen by chance
_GRID_MIN = 64


def _grid_hint(x, y, dtype, dtype_name: str, hint_id: str, coarser: str | None) -> Hint | None:
    r"""Every value of one side lies on ``dtype``'s grid, and the other side's values mostly do not.

    Random float32 values land on the bfloat16 grid with probability 2^-16, so a whole tensor of them there is
    direct evidence of a computation in that dtype. Integers and values on a ``coarser`` grid (bfloat16 values
    are also float16 values) say nothing about ``dtype``.
    """
    import torch

    for side_t, other_t, side in ((y, x, "B"), (x, y, "A")):
        keep = (side_t != torch.round(side_t)) & torch.isfinite(side_t)
        if int(keep.sum()) < _GRID_MIN:
            continue
        values = side_t[keep]
        share = _grid_share(values, dtype)
        other_share = _grid_share(other_t[other_t != torch.round(other_t)], dtype)
        if share < 0.999 or other_share > 0.5:
            continue
        if coarser is not None and _grid_share(values, getattr(torch, coarser)) >= 0.999:
            continue
        other = "A" if side == "B" else "B"
        return Hint(
            hint_id,
            f"every non-integer value of {side} ({int(keep.sum())} checked) is exactly representable in "
            f"{dtype_name}, but only {other_share:.1%} of {other}'s are (evidence: the {dtype_name} grid): "
            f"{side}'s side computes this tensor in {dtype_name}.",
            {"grid_fraction": share, "grid_fraction_other": other_share, "grid_side": side.lower()},
            score=0.9,
        )
    return None


detect_bf16_cast = _make_cast_detector("bfloat16", "bf16-cast", None)
detect_fp16_cast = _make_cast_detector("float16", "fp16-cast", "bfloat16")


def detect_saturation(x: torch.Tensor, y: torch.Tensor) -> Hint | None:
    r"""One side is the other clamped: they agree inside ``[lo, hi]``, and where they differ the clamped side
    sits at its own least or greatest value with the other beyond it (an output clamp to [-1, 1] that only one
    implementation has)."""
    import torch

    tiny = 1e-6 * torch.clamp(x.abs(), min=1.0)
    differ = (x - y).abs() > tiny
    n = int(differ.sum())
    if n == 0:
        return None
    for src, dst, side in ((x, y, "B"), (y, x, "A")):
        lo, hi = float(dst.min()), float(dst.max())
        if not lo < hi:
            continue
        clamped = torch.clamp(src, lo, hi)
        if not bool(((clamped - dst).abs() <= tiny).all()):
            continue
        # the differing values all sit at a bound, with the other side beyond it: nothing else explains them
        at_bound = (dst[differ] == lo) | (dst[differ] == hi)
        if not bool(at_bound.all()):
            continue
        # a bound is a clamp's only when several values were cut to it: one value at each end of a tensor is
        # as well explained by rounding those two
        cut = [int((dst[differ] == b).sum()) for b in (lo, hi)]
        if any(0 < k < 2 for k in cut):
            continue
        other = "A" if side == "B" else "B"
        hits = [int((src < lo).sum()), int((src > hi).sum())]
        bounds = [f"{b} {_metric(v)}" for b, v, hit in (("min", lo, hits[0]), ("max", hi, hits[1])) if hit]
        from paritykit.base.report import clamp_words

        return Hint(
            "saturation",
            f"{side} = {clamp_words(other, lo, hi, hits)}: the two agree elsewhere and {side} is cut at its"
            f" {' and '.join(bounds)} ({_count(n, 'value')}): one side clamps (or saturates) where the other"
            " does not.",
            {"clamped_side": side.lower(), "low": lo, "high": hi, "count": n},
            score=0.95,
        )
    return None


def detect_timestep_rounding(x: torch.Tensor, y: torch.Tensor) -> Hint | None:
    r"""A and B differ only where values have a fractional part, and one side is the other rounded there."""
    import torch

    tiny = 1e-6 * torch.clamp(x.abs(), min=1.0)
    differ = (x - y).abs() > tiny
    n = int(differ.sum())
    if n == 0:
        return None
    if detect_saturation(x, y) is not None:
        return None  # values cut at ±1 are integers too: a clamp, not a rounding
    xd, yd = x[differ], y[differ]
    if float((xd - yd).abs().max()) > 1.0 + 1e-9:
        return None
    for src, dst, side in ((xd, yd, "B"), (yd, xd, "A")):
        if not bool((dst == torch.round(dst)).all()) or bool((src == torch.round(src)).any()):
            continue
        if bool((dst == 0).all()):
            # only small values sent to 0: a zeroed side explains it as well, so rounding is not claimed
            continue
        for mode, fn in (
            ("round", torch.round),
            ("floor", torch.floor),
            ("trunc", torch.trunc),
            ("ceil", torch.ceil),
        ):
            share = float((fn(src) == dst).double().mean())
            if share >= 0.99:
                i = int(torch.nonzero(differ)[0, 0])
                other = "A" if side == "B" else "B"
                return Hint(
                    "timestep-rounding",
                    f"A and B differ only at the {_count(n, 'value')} with a fractional part, where {side} ="
                    f" {mode}({other}) (e.g. A={_metric(float(x[i]))}, B={_metric(float(y[i]))}): one side"
                    " rounds or casts to int (timesteps as int64 vs float).",
                    {"mode": mode, "rounded_side": side.lower(), "count": n, "share": share},
                    # above an exact cast: integer-valued B on a tiny tensor can also be a bf16 rounding
                    score=0.945,
                )
    return None


# -------------------------------------------------------------------------------------------- the ranking

WHOLE_TENSOR: tuple[Callable[[torch.Tensor, torch.Tensor], Hint | None], ...] = (
    detect_nonfinite,
    detect_zeroed,
    detect_masked,
    detect_transpose,
    detect_swapped_halves,
)
ELEMENTWISE: tuple[Callable[[torch.Tensor, torch.Tensor], Hint | None], ...] = (
    detect_sign_flip,
    detect_constant_scale,
    detect_offset,
    detect_bf16_cast,
    detect_fp16_cast,
    detect_saturation,
    detect_timestep_rounding,
)


def _close_everywhere(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    r"""Whether A and B agree within the given tolerances (matching NaN/Inf positions count as agreement)."""
    import torch

    for (_, ca), (_, cb) in zip(_chunks(a), _chunks(b)):
        ca = ca.to(torch.float64)
        cb = cb.to(device=ca.device, dtype=torch.float64)
        if not bool(torch.isclose(ca, cb, rtol=rtol, atol=atol, equal_nan=True).all()):
            return False
    return True


def diagnose(a: Any, b: Any) -> list[Hint]:
    r"""Rank likely causes of a mismatch between A (reference) and B (port).

    Args:
        a, b: tensors (or array-likes). Shapes may differ: then only axis reorderings are considered.

    Returns:
        Hints, most likely first; empty when A and B agree within their default tolerances or nothing fits.
    """
    import torch

    from paritykit.compare.tolerances import default_tolerances, walk_threads

    with torch.no_grad(), walk_threads():
        a_t, b_t = _as_real(a), _as_real(b)
        if a_t.shape != b_t.shape:
            hints = [h for h in (detect_transpose(a_t, b_t),) if h is not None]
            return hints
        rtol, atol = default_tolerances(torch.as_tensor(a).dtype, torch.as_tensor(b).dtype)
        if _close_everywhere(a_t, b_t, rtol, atol):
            return []
        hints = [h for h in (det(a_t, b_t) for det in WHOLE_TENSOR) if h is not None]
        x, y = _sample(a_t, b_t)
        hints += [h for h in (det(x, y) for det in ELEMENTWISE) if h is not None]
    hints.sort(key=lambda h: -h.score)
    return hints
