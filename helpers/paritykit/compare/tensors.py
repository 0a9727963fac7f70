r"""Tensor comparison of one pair, with its diagnoses (sets and nested outputs:
:mod:`paritykit.compare.sets`).

A and B are always "reference" and "port": relative error is measured against B as in
``torch.testing.assert_close`` (``|a - b| <= atol + rtol * |b|``), and ``--map`` rules rename A's names.

Every result is a dataclass with ``to_dict()`` (for ``--json``), ``render()`` (for a person) and
``exit_code``; both faces read the same fields, so they cannot disagree.

Big tensors are walked in chunks of :data:`CHUNK` elements: arithmetic in float32 (float64 when an input is
float64 or a wide integer), sums accumulated in float64 across chunks. The only full-size copies ever made are
``.contiguous()`` copies of non-contiguous inputs, so a comparison needs at most two extra full-size buffers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paritykit.base.errors import ParityKitError
from paritykit.base.report import DEFAULT_LIMIT, format_number
from paritykit.compare.diagnose import unravel_index
from paritykit.compare.tolerances import default_tolerances, dtype_name, walk_threads

if TYPE_CHECKING:
    import torch

    from paritykit.compare.diagnose import Hint

CHUNK = 1 << 18  # 1 MiB of float32: large enough to amortise dispatch, small enough to stay in cache
HEAD = 5
# The fp64-oracle rule of torch._dynamo.utils.same: RMSE(b, oracle) <= m * RMSE(a, oracle) + tol / 10,
# tol=1e-4.
ORACLE_SLACK = 1e-5


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
            "first_disagreement": (
                list(self.first_disagreement) if self.first_disagreement is not None else None
            ),
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
    A dtype difference alone is not a failure."""

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
        r"""The one-line face used by set tables: name, status, max_abs, mean_abs, cosine, mismatch %,
        heads."""
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
        r"""A multi-line report of this pair (what ``assert_parity`` raises and ``paritykit compare`` ends
        with)."""
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
                f"  mismatched   {self.mismatches} / {self.numel}"
                f" ({100 * (self.mismatch_fraction or 0):.3g}%)"
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


def relative_error(value: Any, reference: Any) -> float:
    r"""``‖value - reference‖ / ‖reference‖`` over every element, in float64: the one relative error of the
    package (``compare_tensors`` holds B as the reference the same way, element by element).

    Args:
        value: the tensor measured.
        reference: the tensor it is measured against; its norm is the denominator.

    Returns:
        The ratio; ``0.0`` for two zero tensors; ``inf`` when either is missing (``None``), the shapes differ,
        a value is not finite, or the reference is zero and the value is not.
    """
    import torch

    if value is None or reference is None or tuple(value.shape) != tuple(reference.shape):
        return math.inf
    v64 = value.detach().to("cpu", torch.float64)
    r64 = reference.detach().to("cpu", torch.float64)
    diff = float(torch.linalg.vector_norm(v64 - r64))
    if not math.isfinite(diff):
        return math.inf
    den = float(torch.linalg.vector_norm(r64))
    return diff / den if den else (0.0 if diff == 0 else math.inf)


def as_tensor(value: Any, label: str) -> torch.Tensor:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ParityKitError(f"{label}: cannot be read as a tensor ({type(value).__name__}: {exc})") from None


def _work_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    r"""float32 arithmetic unless float32 would lose information (float64, wide integers), complex if
    needed."""
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
        diagnose: attach ranked :class:`~paritykit.compare.diagnose.Hint` s to a failing pair.
        equal_nan: NaN (and same-signed Inf) at the same position on both sides count as agreement.
        name_b: B's own name when it differs from ``name`` (renamed or paired single tensors).
        note: free text shown with the pair (e.g. how shapes were aligned).

    Returns:
        A :class:`TensorComparison`.
    """
    import torch

    a, b = as_tensor(a, "a"), as_tensor(b, "b")
    default_rtol, default_atol = default_tolerances(a.dtype, b.dtype)
    rtol = default_rtol if rtol is None else float(rtol)
    atol = default_atol if atol is None else float(atol)
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise ParityKitError(f"tolerances must be non-negative numbers (got atol={atol}, rtol={rtol})")
    result = TensorComparison(
        name=name,
        status="pass",
        shape_a=tuple(a.shape),
        shape_b=tuple(b.shape),
        dtype_a=dtype_name(a.dtype),
        dtype_b=dtype_name(b.dtype),
        atol=atol,
        rtol=rtol,
        numel=a.numel(),
        name_b=name_b,
        note=note,
    )
    with torch.no_grad(), walk_threads():
        flat_a, flat_b = _flat(a), _flat(b)
        result.head_a, result.head_b = _head(flat_a), _head(flat_b)
        if a.shape != b.shape:
            result.status = "shape_mismatch"
            if diagnose:
                from paritykit.compare.diagnose import diagnose as run_diagnoses

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
            o = as_tensor(oracle, "oracle")
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
            from paritykit.compare.diagnose import diagnose as run_diagnoses

            result.hints = run_diagnoses(a, b)
    return result


def _finish(result: TensorComparison, acc: _Accumulator) -> None:
    shape = result.shape_a
    acc.nonfinite.first_disagreement = (
        unravel_index(acc.first_disagreement, shape) if acc.first_disagreement is not None else None
    )
    result.nonfinite = acc.nonfinite
    result.mismatches = acc.mismatches
    result.mismatch_fraction = acc.mismatches / result.numel if result.numel else 0.0
    if acc.n_finite == 0:
        return
    result.max_abs = acc.max_abs
    result.max_abs_index = unravel_index(acc.max_index, shape) if acc.max_index is not None else None
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
