r"""Tensor comparison: one pair, nested outputs, or whole sets of named tensors, each with diagnoses.

A and B are always "reference" and "port": relative error is measured against B as in
``torch.testing.assert_close`` (``|a - b| <= atol + rtol * |b|``), and ``--map`` rules rename A's names.

Every result is a dataclass with ``to_dict()`` (for ``--json``), ``render()`` (for a person) and ``exit_code``;
both faces read the same fields, so they cannot disagree.

Big tensors are walked in chunks of :data:`CHUNK` elements: arithmetic in float32 (float64 when an input is
float64 or a wide integer), sums accumulated in float64 across chunks. The only full-size copies ever made are
``.contiguous()`` copies of non-contiguous inputs, so a comparison needs at most two extra full-size buffers.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paritykit.errors import ParityKitError
from paritykit.report import DEFAULT_LIMIT, environment_stamp, format_number, render_table

if TYPE_CHECKING:
    import torch

    # only a type here: diagnose imports this module's tolerances lazily, so neither imports the other at load
    from paritykit.diagnose import Hint

CHUNK = 1 << 18  # 1 MiB of float32: large enough to amortise dispatch, small enough to stay in cache
HEAD = 5
# torch.testing.assert_close's defaults, keyed by dtype name: (rtol, atol)
_TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex32": (1e-3, 1e-5),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
}
# The fp64-oracle rule of torch._dynamo.utils.same: RMSE(b, oracle) <= m * RMSE(a, oracle) + tol / 10, tol=1e-4.
ORACLE_SLACK = 1e-5


# Intra-op threads for the chunk walks of compare_tensors and diagnose (see walk_threads).
WALK_THREADS = 1


@contextmanager
def walk_threads(threads: int | None = None) -> Iterator[None]:
    r"""Run torch's CPU ops with ``threads`` (default :data:`WALK_THREADS`) intra-op threads inside the block.

    A chunked walk issues thousands of small ops; with several intra-op threads each op ends at a barrier,
    and on a busy machine one descheduled thread stalls every op for a whole time slice (a 20-30x slowdown
    measured on 2 shared cores). The walk is memory-bound, so one thread loses little when the machine is idle.
    """
    import torch

    threads = WALK_THREADS if threads is None else threads
    previous = torch.get_num_threads()
    if previous != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if previous != threads:
            torch.set_num_threads(previous)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def default_tolerances(dtype_a: Any, dtype_b: Any) -> tuple[float, float]:
    r"""``(rtol, atol)`` for a pair of dtypes: torch.testing's table, the looser of the two dtypes winning.

    fp16 1e-3/1e-5, bf16 1.6e-2/1e-5, fp32 1.3e-6/1e-5, fp64 1e-7/1e-7 (complex like their float parts);
    float8 types get rtol = their unit roundoff ×2; integers and bools compare exactly (0, 0).

    Args:
        dtype_a, dtype_b: ``torch.dtype`` objects or their names (``"float16"``, ``"torch.bfloat16"``).
    """
    rtols, atols = [], []
    for dtype in (dtype_a, dtype_b):
        name = _dtype_name(dtype)
        if name in _TOLERANCES:
            rtol, atol = _TOLERANCES[name]
        elif name.startswith("float8"):
            import torch

            rtol, atol = float(torch.finfo(getattr(torch, name)).eps), 1e-5
        else:
            rtol, atol = 0.0, 0.0
        rtols.append(rtol)
        atols.append(atol)
    return max(rtols), max(atols)


# ------------------------------------------------------------------------------------------ result objects


@dataclass
class NonfiniteInfo:
    r"""NaN/Inf counts on each side and whether their positions (and the signs of infinities) agree."""

    nan_a: int = 0
    nan_b: int = 0
    inf_a: int = 0
    inf_b: int = 0
    disagreements: int = 0
    first_disagreement: tuple[int, ...] | None = None

    @property
    def positions_agree(self) -> bool:
        return self.disagreements == 0

    @property
    def any(self) -> bool:
        return bool(self.nan_a or self.nan_b or self.inf_a or self.inf_b)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nan_a": self.nan_a,
            "nan_b": self.nan_b,
            "inf_a": self.inf_a,
            "inf_b": self.inf_b,
            "positions_agree": self.positions_agree,
            "first_disagreement": list(self.first_disagreement)
            if self.first_disagreement is not None
            else None,
        }

    def render(self) -> str:
        text = f"A {self.nan_a} NaN, {self.inf_a} Inf; B {self.nan_b} NaN, {self.inf_b} Inf; "
        if self.positions_agree:
            return text + "same positions"
        return text + f"{self.disagreements} positions differ, first at {self.first_disagreement}"


@dataclass
class OracleVerdict:
    r"""The fp64-oracle rule: B passes if ``RMSE(B, oracle) <= multiplier * RMSE(A, oracle) + slack``."""

    rmse_a: float
    rmse_b: float
    multiplier: float
    slack: float = ORACLE_SLACK

    @property
    def passed(self) -> bool:
        if math.isnan(self.rmse_a) or math.isnan(self.rmse_b):
            return False
        return self.rmse_b <= self.multiplier * self.rmse_a + self.slack

    def to_dict(self) -> dict[str, Any]:
        return {
            "rmse_a": self.rmse_a,
            "rmse_b": self.rmse_b,
            "multiplier": self.multiplier,
            "slack": self.slack,
            "passed": self.passed,
        }

    def render(self) -> str:
        verdict = "within" if self.passed else "NOT within"
        return (
            f"RMSE(B, fp64) = {format_number(self.rmse_b)} is {verdict} {self.multiplier:g} × RMSE(A, fp64) "
            f"= {format_number(self.rmse_a)} + {self.slack:g}"
        )


def _short(value: Any) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _head_text(values: Sequence[Any], count: int) -> str:
    shown = ", ".join(_short(v) for v in values[:count])
    return f"[{shown}{', …' if len(values) > count else ''}]"


@dataclass
class TensorComparison:
    r"""How far B is from A, element by element; ``status`` is ``pass``, ``fail`` or ``shape_mismatch``.

    Metrics cover the positions where both sides are finite; NaN/Inf are counted in ``nonfinite`` and a
    NaN or Inf on one side only is a mismatch. ``max_rel`` is over elements where B is non-zero.
    A dtype difference alone is not a failure.
    """

    name: str
    status: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    atol: float
    rtol: float
    numel: int = 0
    max_abs: float | None = None
    max_abs_index: tuple[int, ...] | None = None
    mean_abs: float | None = None
    rmse: float | None = None
    max_rel: float | None = None
    cosine: float | None = None
    mismatches: int | None = None
    mismatch_fraction: float | None = None
    nonfinite: NonfiniteInfo = field(default_factory=NonfiniteInfo)
    head_a: list[Any] = field(default_factory=list)
    head_b: list[Any] = field(default_factory=list)
    hints: list[Hint] = field(default_factory=list)
    oracle: OracleVerdict | None = None
    name_a: str | None = None
    name_b: str | None = None
    note: str | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    @property
    def passed_by_oracle(self) -> bool:
        return self.passed and bool(self.mismatches) and self.oracle is not None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "status": self.status,
            "shape_a": list(self.shape_a),
            "shape_b": list(self.shape_b),
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "numel": self.numel,
            "max_abs": self.max_abs,
            "max_abs_index": list(self.max_abs_index) if self.max_abs_index is not None else None,
            "mean_abs": self.mean_abs,
            "rmse": self.rmse,
            "max_rel": self.max_rel,
            "cosine": self.cosine,
            "mismatches": self.mismatches,
            "mismatch_fraction": self.mismatch_fraction,
            "atol": self.atol,
            "rtol": self.rtol,
            "nan_inf": self.nonfinite.to_dict(),
            "head_a": list(self.head_a),
            "head_b": list(self.head_b),
            "hints": [h.to_dict() for h in self.hints],
        }
        if self.oracle is not None:
            out["oracle"] = self.oracle.to_dict()
            out["passed_by"] = "oracle" if self.passed_by_oracle else ("tolerance" if self.passed else None)
        if self.name_a is not None:
            out["name_a"] = self.name_a
        if self.name_b is not None:
            out["name_b"] = self.name_b
        if self.note:
            out["note"] = self.note
        return out

    def table_row(self) -> list[str]:
        r"""The one-line face used by set tables: name, status, max_abs, mean_abs, cosine, mismatch %, heads."""
        status = {"pass": "pass", "fail": "FAIL", "shape_mismatch": "SHAPE"}[self.status]
        if self.passed_by_oracle:
            status = "pass*"
        mismatch = "-" if self.mismatch_fraction is None else f"{100 * self.mismatch_fraction:.3g}%"
        return [
            self.name,
            status,
            format_number(self.max_abs),
            format_number(self.mean_abs),
            "-" if self.cosine is None else f"{self.cosine:.6f}",
            mismatch,
            _head_text(self.head_a, 4),
            _head_text(self.head_b, 4),
        ]

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        r"""A multi-line report of this pair (what ``assert_parity`` raises and ``paritykit compare`` ends with)."""
        label = {"pass": "PASS", "fail": "FAIL", "shape_mismatch": "SHAPE MISMATCH"}[self.status]
        title = self.name
        if self.name_a or self.name_b:
            title += f" (A: {self.name_a or self.name}, B: {self.name_b or self.name})"
        lines = [
            f"{title}: {label}",
            f"  A            {tuple(self.shape_a)} {self.dtype_a}",
            f"  B            {tuple(self.shape_b)} {self.dtype_b}",
        ]
        if self.note:
            lines.append(f"  note         {self.note}")
        if self.status != "shape_mismatch":
            lines.append(f"  tolerance    |a-b| <= {self.atol:g} + {self.rtol:g}·|b|")
            lines.append(
                f"  mismatched   {self.mismatches} / {self.numel} ({100 * (self.mismatch_fraction or 0):.3g}%)"
            )
            where = f" at {self.max_abs_index}" if self.max_abs_index is not None else ""
            lines.append(f"  max |a-b|    {format_number(self.max_abs)}{where}")
            lines.append(f"  mean |a-b|   {format_number(self.mean_abs)}   rmse {format_number(self.rmse)}")
            lines.append(f"  max rel      {format_number(self.max_rel)}")
            lines.append(f"  cosine       {'-' if self.cosine is None else f'{self.cosine:.8f}'}")
            if self.nonfinite.any:
                lines.append(f"  nonfinite    {self.nonfinite.render()}")
            if self.oracle is not None:
                lines.append(f"  fp64 oracle  {self.oracle.render()}")
        lines.append(f"  head A       {_head_text(self.head_a, HEAD)}")
        lines.append(f"  head B       {_head_text(self.head_b, HEAD)}")
        if self.hints:
            lines.append("  likely causes:")
            lines += [f"    {h.render()}" for h in self.hints]
        elif self.status != "pass":
            lines.append("  likely causes: none of the known signatures fits")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------- one pair of tensors


def _as_tensor(value: Any, label: str) -> torch.Tensor:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ParityKitError(f"{label}: cannot be read as a tensor ({type(value).__name__}: {exc})") from None


def _work_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    r"""float32 arithmetic unless float32 would lose information (float64, wide integers), complex if needed."""
    import torch

    def needs_64(dt: torch.dtype) -> bool:
        if dt in (torch.float64, torch.complex128):
            return True
        return (
            not dt.is_floating_point and not dt.is_complex and dt != torch.bool and torch.iinfo(dt).bits > 16
        )

    wide = needs_64(a) or needs_64(b)
    if a.is_complex or b.is_complex:
        return torch.complex128 if wide else torch.complex64
    return torch.float64 if wide else torch.float32


def _unravel(flat_index: int, shape: Sequence[int]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def _head(flat: torch.Tensor) -> list[Any]:
    import torch

    values = flat[:HEAD]
    if values.is_complex():
        return [str(v) for v in values.tolist()]
    if values.dtype in (torch.bfloat16, torch.float16) or str(values.dtype).startswith("torch.float8"):
        values = values.float()
    return values.cpu().tolist()


@dataclass
class _Accumulator:
    r"""Running sums over chunks (float64 Python floats) and the extremes seen so far."""

    n_finite: int = 0
    sum_abs: float = 0.0
    sum_sq_diff: float = 0.0
    sum_sq_a: float = 0.0
    sum_sq_b: float = 0.0
    max_abs: float = 0.0
    max_index: int | None = None
    max_rel: float = 0.0
    mismatches: int = 0
    nonfinite: NonfiniteInfo = field(default_factory=NonfiniteInfo)
    first_disagreement: int | None = None


class _Buffers:
    r"""Chunk-sized scratch tensors reused for every chunk, so the walk allocates nothing per chunk."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        import torch

        real = torch.empty(0, dtype=dtype).real.dtype if dtype.is_complex else dtype
        self.diff = torch.empty(size, dtype=real, device=device)
        self.absb = torch.empty(size, dtype=real, device=device)
        self.rel = torch.empty(size, dtype=real, device=device)
        self.mask = torch.empty(size, dtype=torch.bool, device=device)


def _sq(x: torch.Tensor) -> float:
    import torch

    return float(torch.vdot(x, x).real) if x.is_complex() else float(torch.dot(x, x))


def _fast_chunk(ca, cb, start: int, rtol: float, atol: float, acc: _Accumulator, buf: _Buffers) -> bool:
    r"""Accumulate one all-finite chunk; returns False (touching nothing) when a sum is not finite."""
    import torch

    n = ca.numel()
    if ca.is_complex():
        d = torch.abs(ca - cb, out=buf.diff[:n])
    else:
        d = torch.sub(ca, cb, out=buf.diff[:n]).abs_()
    sums = (float(d.sum()), _sq(d), _sq(ca), _sq(cb))
    if not all(math.isfinite(s) for s in sums):
        return False
    acc.n_finite += n
    acc.sum_abs += sums[0]
    acc.sum_sq_diff += sums[1]
    acc.sum_sq_a += sums[2]
    acc.sum_sq_b += sums[3]
    peak, where = torch.max(d, 0)
    if acc.max_index is None or float(peak) > acc.max_abs:
        acc.max_abs, acc.max_index = float(peak), start + int(where)
    absb = torch.abs(cb, out=buf.absb[:n])
    rel = torch.div(d, absb, out=buf.rel[:n]).nan_to_num_(0.0, 0.0, 0.0)  # b == 0 is left to max_abs
    acc.max_rel = max(acc.max_rel, float(rel.max()))
    absb.mul_(rtol).add_(atol)
    acc.mismatches += int(torch.gt(d, absb, out=buf.mask[:n]).sum())
    return True


def _careful_chunk(ca, cb, start: int, rtol: float, atol: float, equal_nan: bool, acc: _Accumulator) -> None:
    r"""Accumulate a chunk holding NaN/Inf (or values whose squares overflow float32) in float64, masked."""
    import torch

    wide = torch.complex128 if ca.is_complex() else torch.float64
    ca, cb = ca.to(wide), cb.to(wide)
    nan_a, nan_b = torch.isnan(ca), torch.isnan(cb)
    inf_a, inf_b = torch.isinf(ca), torch.isinf(cb)
    both = torch.isfinite(ca) & torch.isfinite(cb)
    agree = (nan_a & nan_b) | (inf_a & inf_b & (ca == cb))
    disagree = ~both & ~agree
    info = acc.nonfinite
    info.nan_a += int(nan_a.sum())
    info.nan_b += int(nan_b.sum())
    info.inf_a += int(inf_a.sum())
    info.inf_b += int(inf_b.sum())
    n_disagree = int(disagree.sum())
    info.disagreements += n_disagree
    if n_disagree and acc.first_disagreement is None:
        acc.first_disagreement = start + int(torch.nonzero(disagree)[0, 0])
    xa = torch.where(both, ca, torch.zeros((), dtype=wide))
    xb = torch.where(both, cb, torch.zeros((), dtype=wide))
    d = (xa - xb).abs()
    acc.n_finite += int(both.sum())
    acc.sum_abs += float(d.sum())
    acc.sum_sq_diff += _sq(d)
    acc.sum_sq_a += _sq(xa)
    acc.sum_sq_b += _sq(xb)
    if int(both.sum()):
        peak, where = torch.max(torch.where(both, d, torch.full((), -1.0, dtype=d.dtype)), 0)
        if acc.max_index is None or float(peak) > acc.max_abs:
            acc.max_abs, acc.max_index = float(peak), start + int(where)
    absb = xb.abs()
    rel = (d / absb).nan_to_num_(0.0, 0.0, 0.0)
    acc.max_rel = max(acc.max_rel, float(rel.max()))
    acc.mismatches += int(((d > absb * rtol + atol) & both).sum()) + n_disagree
    if not equal_nan:
        acc.mismatches += int(agree.sum())


def _flat(t: torch.Tensor) -> torch.Tensor:
    # A view for contiguous tensors; otherwise the one full-size copy this side will ever need.
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)


def _oracle_verdict(flat_a, flat_b, flat_o, dtype_b) -> OracleVerdict:
    import torch

    sq_a = sq_b = 0.0
    n = flat_o.numel()
    for start in range(0, n, CHUNK):
        co = flat_o[start : start + CHUNK].to(torch.float64)
        da = flat_a[start : start + CHUNK].to(device=co.device, dtype=torch.float64) - co
        db = flat_b[start : start + CHUNK].to(device=co.device, dtype=torch.float64) - co
        sq_a += float(torch.dot(da, da))
        sq_b += float(torch.dot(db, db))
    multiplier = 3.0 if dtype_b in (torch.float16, torch.bfloat16) or n < 1000 else 2.0
    return OracleVerdict(math.sqrt(sq_a / max(n, 1)), math.sqrt(sq_b / max(n, 1)), multiplier)


def compare_tensors(
    a: Any,
    b: Any,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    name: str = "tensor",
    oracle: Any = None,
    diagnose: bool = True,
    equal_nan: bool = True,
    name_b: str | None = None,
    note: str | None = None,
) -> TensorComparison:
    r"""Compare B (port) against A (reference) element by element.

    Args:
        a, b: tensors or array-likes; any devices and dtypes (a dtype difference alone does not fail).
        atol, rtol: tolerances of ``|a - b| <= atol + rtol * |b|``; each defaults to
            :func:`default_tolerances` of the two dtypes.
        name: label used in reports.
        oracle: optional float64 reference output (same shape). A pair that misses the tolerances still passes
            when ``RMSE(b, oracle) <= m * RMSE(a, oracle) + 1e-5`` (m = 3 for fp16/bf16 B or < 1000 elements,
            else 2): the rule of ``torch._dynamo.utils.same``, for a low-precision port of a low-precision
            reference.
        diagnose: attach ranked :class:`~paritykit.diagnose.Hint` s to a failing pair.
        equal_nan: NaN (and same-signed Inf) at the same position on both sides count as agreement.
        name_b: B's own name when it differs from ``name`` (renamed or paired single tensors).
        note: free text shown with the pair (e.g. how shapes were aligned).

    Returns:
        A :class:`TensorComparison`.
    """
    import torch

    a, b = _as_tensor(a, "a"), _as_tensor(b, "b")
    default_rtol, default_atol = default_tolerances(a.dtype, b.dtype)
    rtol = default_rtol if rtol is None else float(rtol)
    atol = default_atol if atol is None else float(atol)
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise ParityKitError(f"tolerances must be non-negative numbers (got atol={atol}, rtol={rtol})")
    result = TensorComparison(
        name=name, status="pass", shape_a=tuple(a.shape), shape_b=tuple(b.shape),
        dtype_a=_dtype_name(a.dtype), dtype_b=_dtype_name(b.dtype), atol=atol, rtol=rtol,
        numel=a.numel(), name_b=name_b, note=note,
    )  # fmt: skip
    with torch.no_grad(), walk_threads():
        flat_a, flat_b = _flat(a), _flat(b)
        result.head_a, result.head_b = _head(flat_a), _head(flat_b)
        if a.shape != b.shape:
            result.status = "shape_mismatch"
            if diagnose:
                from paritykit.diagnose import diagnose as run_diagnoses

                result.hints = run_diagnoses(a, b)
            return result

        work = _work_dtype(a.dtype, b.dtype)
        device = a.device
        acc = _Accumulator()
        buffers = _Buffers(min(CHUNK, max(a.numel(), 1)), work, device)
        for start in range(0, a.numel(), CHUNK):
            ca = flat_a[start : start + CHUNK].to(dtype=work)
            cb = flat_b[start : start + CHUNK].to(device=device, dtype=work)
            if not _fast_chunk(ca, cb, start, rtol, atol, acc, buffers):
                _careful_chunk(ca, cb, start, rtol, atol, equal_nan, acc)
        _finish(result, acc)

        if oracle is not None:
            o = _as_tensor(oracle, "oracle")
            if o.shape != a.shape:
                raise ParityKitError(
                    f"oracle shape {tuple(o.shape)} differs from the compared shape {tuple(a.shape)}"
                )
            result.oracle = _oracle_verdict(flat_a, flat_b, _flat(o), b.dtype)

        if result.mismatches:
            oracle_saves = (
                result.oracle is not None and result.oracle.passed and result.nonfinite.positions_agree
            )
            result.status = "pass" if oracle_saves else "fail"
        if diagnose and result.status != "pass":
            from paritykit.diagnose import diagnose as run_diagnoses

            result.hints = run_diagnoses(a, b)
    return result


def _finish(result: TensorComparison, acc: _Accumulator) -> None:
    shape = result.shape_a
    acc.nonfinite.first_disagreement = (
        _unravel(acc.first_disagreement, shape) if acc.first_disagreement is not None else None
    )
    result.nonfinite = acc.nonfinite
    result.mismatches = acc.mismatches
    result.mismatch_fraction = acc.mismatches / result.numel if result.numel else 0.0
    if acc.n_finite == 0:
        return
    result.max_abs = acc.max_abs
    result.max_abs_index = _unravel(acc.max_index, shape) if acc.max_index is not None else None
    result.mean_abs = acc.sum_abs / acc.n_finite
    result.rmse = math.sqrt(acc.sum_sq_diff / acc.n_finite)
    result.max_rel = acc.max_rel
    sa, sb = acc.sum_sq_a, acc.sum_sq_b
    if sa == 0 and sb == 0:
        result.cosine = 1.0
    elif sa == 0 or sb == 0:
        result.cosine = 0.0
    else:
        # From ||a-b||² rather than a·b: exact 1.0 for equal inputs and accurate when a ≈ b.
        cosine = (sa + sb - acc.sum_sq_diff) / (2.0 * math.sqrt(sa) * math.sqrt(sb))
        result.cosine = min(1.0, max(-1.0, cosine))


# ------------------------------------------------------------------------------------------ sets of tensors


@dataclass
class SetComparison:
    r"""Named tensors of A against those of B: pairs in A's order, names present on one side only.

    ``first_divergence`` is the first pair (in order) that is not ``pass``; with checkpoint folders the order
    is execution order, so it names where the two runs part ways.
    """

    pairs: list[TensorComparison] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    value_diffs: list[dict[str, Any]] = field(default_factory=list)
    atol: float | None = None
    rtol: float | None = None
    source_a: str | None = None
    source_b: str | None = None

    @property
    def first_divergence(self) -> str | None:
        return next((p.name for p in self.pairs if not p.passed), None)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.pairs) and not (self.only_a or self.only_b or self.value_diffs)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def pair(self, name: str) -> TensorComparison:
        return next(p for p in self.pairs if p.name == name)

    def counts(self) -> dict[str, int]:
        statuses = [p.status for p in self.pairs]
        return {
            "pairs": len(self.pairs),
            "pass": statuses.count("pass"),
            "fail": statuses.count("fail"),
            "shape_mismatch": statuses.count("shape_mismatch"),
            "only_a": len(self.only_a),
            "only_b": len(self.only_b),
            "value_diffs": len(self.value_diffs),
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.source_a,
            "b": self.source_b,
            "tolerance": {
                "atol": self.atol,
                "rtol": self.rtol,
                "default": "per dtype, torch.testing's table",
            },
            "passed": self.passed,
            "summary": self.counts(),
            "pairs": [p.to_dict() for p in self.pairs],
            "only_a": list(self.only_a),
            "only_b": list(self.only_b),
            "value_diffs": list(self.value_diffs),
            "first_divergence": self.first_divergence,
            "environment": environment_stamp(),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        headers = ["name", "status", "max_abs", "mean_abs", "cosine", "mismatch", "head A", "head B"]
        c = self.counts()
        summary = (
            f"{c['pairs']} pairs: {c['pass']} pass, {c['fail']} fail, {c['shape_mismatch']} shape mismatch"
        )
        if any(p.passed_by_oracle for p in self.pairs):
            summary += " (pass* = outside tolerance, within the fp64-oracle rule)"
        lines = [render_table(headers, [p.table_row() for p in self.pairs], limit=limit, summary=summary)]
        for p in self.pairs:
            if p.status == "shape_mismatch":
                lines.append(
                    f"shape mismatch: {p.name}: A {p.shape_a} vs B {p.shape_b}"
                    + (f"; {p.note}" if p.note else "")
                )
            elif p.note:
                lines.append(f"note: {p.name}: {p.note}")
        for label, names in (("only in A", self.only_a), ("only in B", self.only_b)):
            if names:
                shown = names if not limit else names[:limit]
                more = f", … {len(names) - len(shown)} more" if len(shown) < len(names) else ""
                lines.append(f"{label} ({len(names)}): {', '.join(shown)}{more}")
        for diff in self.value_diffs[: limit or None]:
            lines.append(f"value differs: {diff['name']}: A={diff['a']} B={diff['b']}")
        first = self.first_divergence
        if first is not None:
            lines += ["", f"first divergence: {first}", self.pair(first).render()]
        elif self.passed:
            lines.append("all tensors match")
        return "\n".join(lines)


class OutputComparison(SetComparison):
    r"""Two nested outputs compared leaf by leaf; pair names are paths such as ``sample`` or ``[0].hidden[2]``."""


def _batch_alignment(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    r"""Tile the smaller side along dim 0 when the shapes differ only by a repeated batch dimension."""
    small_is_a = a.numel() < b.numel()
    small, big = (a, b) if small_is_a else (b, a)
    if small.ndim == big.ndim and small.ndim > 0 and small.shape[1:] == big.shape[1:] and small.shape[0] > 0:
        if big.shape[0] % small.shape[0]:
            return None
        times = big.shape[0] // small.shape[0]
        tiled = small.repeat(times, *([1] * (small.ndim - 1)))
    elif small.ndim + 1 == big.ndim and tuple(small.shape) == tuple(big.shape[1:]):
        times = big.shape[0]
        tiled = small.unsqueeze(0).repeat(times, *([1] * small.ndim))
    else:
        return None
    side = "A" if small_is_a else "B"
    note = f"{side} {tuple(small.shape)} repeated {times}× along dim 0 to {tuple(big.shape)} (--broadcast)"
    return (tiled, b, note) if small_is_a else (a, tiled, note)


def compare_tensor_sets(
    a: Mapping[str, Any],
    b: Mapping[str, Any],
    *,
    atol: float | None = None,
    rtol: float | None = None,
    rules: Sequence[tuple[str, str]] = (),
    broadcast: bool = False,
    only: str | None = None,
    diagnose: bool = True,
) -> SetComparison:
    r"""Compare two sets of named tensors: what ``paritykit compare`` prints.

    Args:
        a, b: name -> tensor, in order (A's order orders the report; checkpoint folders load in execution order).
        atol, rtol: tolerances for every pair (default: per dtype pair).
        rules: ``(regex, replacement)`` renaming rules applied to A's names (see :mod:`paritykit.naming`).
        broadcast: align shapes that differ only by a repeated batch dimension by tiling the smaller side.
        only: a glob (``fnmatch``) on the (renamed) names; other tensors are left out.
        diagnose: attach hints to failing pairs.

    A one-tensor A against a one-tensor B is compared whatever their names (a file against a file).
    """
    from paritykit.naming import rename_all

    renamed = rename_all(list(a), rules) if rules else {name: name for name in a}
    a_named = {renamed[name]: (name, value) for name, value in a.items()}
    b_names = list(b)
    if only is not None:
        matches = [n for n in [*a_named, *b_names] if fnmatch.fnmatchcase(n, only)]
        if not matches:
            sample = ", ".join(list(dict.fromkeys([*a_named, *b_names]))[:3])
            raise ParityKitError(f"--only {only!r} matches no tensor name (names look like: {sample})")
        a_named = {n: v for n, v in a_named.items() if fnmatch.fnmatchcase(n, only)}
        b_names = [n for n in b_names if fnmatch.fnmatchcase(n, only)]

    report = SetComparison(atol=atol, rtol=rtol)
    if len(a) == 1 and len(b) == 1 and a_named and b_names and next(iter(a_named)) != b_names[0]:
        (name, (original, value)), name_b = next(iter(a_named.items())), b_names[0]
        name_a = original if original != name else None
        report.pairs.append(
            _compare_pair(
                name, value, b[name_b], atol, rtol, broadcast, diagnose, name_a=name_a, name_b=name_b
            )
        )
        return report

    for name, (original, value) in a_named.items():
        if name not in b:
            report.only_a.append(name)
            continue
        name_a = original if original != name else None
        report.pairs.append(
            _compare_pair(name, value, b[name], atol, rtol, broadcast, diagnose, name_a=name_a)
        )
    report.only_b = [n for n in b_names if n not in a_named]
    return report


def _compare_pair(
    name, a, b, atol, rtol, broadcast, diagnose, *, name_a=None, name_b=None
) -> TensorComparison:
    a, b = _as_tensor(a, name), _as_tensor(b, name)
    note = None
    if a.shape != b.shape:
        aligned = _batch_alignment(a, b)
        if aligned is not None and broadcast:
            a, b, note = aligned
        elif aligned is not None:
            note = "shapes differ only by a repeated batch dimension: --broadcast would tile the smaller side"
    result = compare_tensors(
        a, b, atol=atol, rtol=rtol, name=name, diagnose=diagnose, name_b=name_b, note=note
    )
    result.name_a = name_a
    return result


def compare_paths(
    a: str,
    b: str,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    maps: Sequence[str] = (),
    only: str | None = None,
    broadcast: bool = False,
) -> SetComparison:
    r"""Load two tensor files/folders/checkpoint folders and compare them (what ``paritykit compare`` runs).

    Names come from :func:`paritykit.io.load_named_tensors`, as in ``weights diff``: a checkpoint file or
    model folder gives its state dict's keys (wrappers unwrapped, no file stem), so ``a.safetensors`` and
    ``port/unet`` pair up by key. ``maps`` are ``'REGEX=REPL'`` strings applied to A's names.
    """
    from paritykit.io import load_named_tensors
    from paritykit.naming import parse_map_options

    rules = parse_map_options(maps)
    for label, value in (("--atol", atol), ("--rtol", rtol)):
        if value is not None and not value >= 0:
            raise ParityKitError(f"{label} must be a non-negative number (got {value})")
    sides = []
    for path in (a, b):
        tensors = load_named_tensors(path)  # the naming `weights diff` uses too, so one --map fits both
        if not tensors:
            raise ParityKitError(f"{path}: holds no tensors")
        sides.append(tensors)
    if Path(a).is_file():  # a folder of checkpoints is in execution order already; a file's keys are sorted
        sides[0] = {name: sides[0][name] for name in run_order(list(sides[0]))}
    report = compare_tensor_sets(
        sides[0], sides[1], atol=atol, rtol=rtol, rules=rules, only=only, broadcast=broadcast
    )
    report.source_a, report.source_b = str(a), str(b)
    return report


_STAGE = re.compile(r"^(text_encoding|preloop|(?:after_)?step_(\d+)|post_loop)/")


def run_order(names: Sequence[str]) -> list[str]:
    r"""``<checkpoint>/<key>`` names in the order a run writes them: ``text_encoding``, ``preloop``,
    ``after_step_{i}`` (or ``step_{i}``) by ``i``, ``post_loop``; names are left as they are unless every one
    starts with such a checkpoint, so "first divergence" is the first in time, not alphabetically."""
    matches = [_STAGE.match(n) for n in names]
    if not names or not all(matches):
        return list(names)

    def key(i: int) -> tuple[int, int, int]:
        m = matches[i]
        stage = {"text_encoding": 0, "preloop": 1, "post_loop": 3}.get(m.group(1), 2)
        return stage, int(m.group(2) or 0), i

    return [names[i] for i in sorted(range(len(names)), key=key)]


# -------------------------------------------------------------------------------------- nested model outputs


def _is_tensor_like(value: Any) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return False
    return isinstance(value, (np.ndarray, np.generic))


def _join(path: str, key: str) -> str:
    if key.startswith("["):
        return f"{path}{key}"
    return f"{path}.{key}" if path else key


def _flatten(value: Any, path: str, out: dict[str, Any]) -> None:
    r"""Leaves of nested outputs by path: mappings (incl. diffusers ``BaseOutput``), dataclasses, sequences."""
    if _is_tensor_like(value):
        out[path] = value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _flatten(item, _join(path, str(key)), out)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _flatten(getattr(value, f.name), _join(path, f.name), out)
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        for key in value._fields:
            _flatten(getattr(value, key), _join(path, key), out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _flatten(item, _join(path, f"[{i}]"), out)
    else:
        out[path] = value


def _scalar_tensor(value: Any) -> Any:
    import torch

    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    return None


def compare_outputs(
    a: Any,
    b: Any,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    diagnose: bool = True,
) -> OutputComparison:
    r"""Compare two nested outputs (tuples, lists, dicts, dataclasses, diffusers ``BaseOutput``) leaf by leaf.

    Leaves are matched by path; tensors and numbers are compared with :func:`compare_tensors`, other values
    with ``==``. Paths present on one side only land in ``only_a`` / ``only_b``.
    """
    flat_a: dict[str, Any] = {}
    flat_b: dict[str, Any] = {}
    _flatten(a, "", flat_a)
    _flatten(b, "", flat_b)
    report = OutputComparison(atol=atol, rtol=rtol)
    for path, va in flat_a.items():
        name = path or "output"
        if path not in flat_b:
            report.only_a.append(name)
            continue
        vb = flat_b[path]
        ta = va if _is_tensor_like(va) else _scalar_tensor(va)
        tb = vb if _is_tensor_like(vb) else _scalar_tensor(vb)
        if ta is not None and tb is not None:
            report.pairs.append(compare_tensors(ta, tb, atol=atol, rtol=rtol, name=name, diagnose=diagnose))
        elif ta is not None or tb is not None:
            report.value_diffs.append({"name": name, "a": _describe(va), "b": _describe(vb)})
        elif type(va) is not type(vb) or va != vb:
            report.value_diffs.append({"name": name, "a": _describe(va), "b": _describe(vb)})
    report.only_b = [path or "output" for path in flat_b if path not in flat_a]
    return report


def _describe(value: Any) -> str:
    if _is_tensor_like(value):
        return f"{type(value).__name__}{tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def assert_parity(a: Any, b: Any, **tolerances: Any) -> TensorComparison | OutputComparison:
    r"""``assert`` for pytest: raises ``AssertionError`` with the readable report when B does not match A.

    Args:
        a, b: tensors, or nested outputs (compared with :func:`compare_outputs`).
        tolerances: ``atol``, ``rtol`` (and for tensors ``oracle``, ``equal_nan``), passed through.

    Returns:
        The comparison, for further checks when it passed.
    """
    # pytest hides this frame, so a failure starts at the user's assert_parity line and then the report.
    __tracebackhide__ = True
    if _is_tensor_like(a) and _is_tensor_like(b):
        result: TensorComparison | OutputComparison = compare_tensors(a, b, name="output", **tolerances)
    else:
        result = compare_outputs(a, b, **tolerances)
    if not result.passed:
        raise AssertionError("B does not match A (parity check failed)\n" + result.render(limit=None))
    return result
