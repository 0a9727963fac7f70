r"""Fitted-constant evidence: the norm epsilon (``norm-eps``) or softmax scale (``attention-scale``) that
reproduces the other side's output."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from paritykit.base.minimize import golden_section
from paritykit.base.report import format_value
from paritykit.bisection.evidence.culprit import (
    EPS_NAMES,
    FIT_GAIN,
    FIT_REL,
    SCALE_NAMES,
    Culprit,
    patched_copy,
    verify_hint,
)
from paritykit.compare.diagnose import Hint
from paritykit.compare.tensors import relative_error


def _attr_of(module: Any, names: Sequence[str]) -> str | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return name
    return None


def _fit_constant(
    run: Callable[[float], Any], target: Any, candidates: Sequence[float], refine: bool
) -> tuple[float, float, list[float]]:
    r"""The candidate (then refined in log space) whose output is closest to ``target``; also every candidate
    that fits to :data:`FIT_REL` (several eps values below the data's variance are indistinguishable)."""
    scored = []
    for value in candidates:
        try:
            scored.append((relative_error(run(value), target), value))
        except Exception:
            continue
    if not scored:
        return math.nan, math.inf, []
    scored.sort()
    best_err, best = scored[0]
    if refine and best_err > FIT_REL and best > 0 and best_err < 0.5:
        # golden-section search in log space around the best candidate, one new evaluation per step
        def cost(u: float) -> float:
            return relative_error(run(math.exp(u)), target)

        point, err = golden_section(cost, math.log(best / 4), math.log(best * 4), 30)
        value = math.exp(point)
        if err < best_err:
            best_err, best = err, value
    fitting = sorted(v for e, v in scored if e <= FIT_REL)
    return best, best_err, fitting


def norm_eps(c: Culprit) -> list[Hint]:
    r"""``norm-eps``: the epsilon with which the reference's norm reproduces the port's output."""
    if c.reference is None or c.run_reference is None or "norm" not in type(c.reference).__name__.lower():
        return []
    attr = _attr_of(c.reference, EPS_NAMES)
    if attr is None:
        return []
    ref_eps = float(getattr(c.reference, attr))
    before = relative_error(c.reference_output, c.port_output)

    def run(eps: float) -> Any:
        return c.run_reference(patched_copy(c.reference, {attr: eps}))

    candidates = sorted(
        {10.0**-k for k in range(0, 15)} | {m * 10.0**-k for m in (2, 5) for k in range(1, 13)}
    )
    best, err, fitting = _fit_constant(run, c.port_output, candidates, refine=False)
    if not before > 0 or err > FIT_REL or err >= FIT_GAIN * before or not fitting:
        return []
    shown = (
        format_value(best)
        if len(fitting) == 1
        else f"any eps in [{format_value(fitting[0])}, {format_value(fitting[-1])}]"
    )
    port_attr = _attr_of(c.port, EPS_NAMES) if c.port is not None else None
    hint = Hint(
        "norm-eps",
        f"the reference norm reproduces the port's output with {shown} (relative error {err:.1e}, "
        f"{before:.1e} with its own eps={format_value(ref_eps)}) (evidence: eps fitted on the captured"
        " input)",
        {"fitted_eps": best, "fitting": fitting, "reference_eps": ref_eps, "fit_error": err, "error": before},
        score=0.88,
        fix=f"{c.port_path(attr=port_attr or 'eps')} = {ref_eps!r}",
    )
    if port_attr is not None:
        verify_hint(c, lambda: patched_copy(c.port, {port_attr: ref_eps}), hint)
    return [hint]


def _is_attention(module: Any) -> bool:
    return module is not None and "attention" in type(module).__name__.lower()


def _scale_candidates(module: Any, current: float) -> list[float]:
    dims = set()
    for name in ("head_dim", "attention_head_size", "dim_head"):
        if isinstance(getattr(module, name, None), int):
            dims.add(getattr(module, name))
    heads = next(
        (
            getattr(module, n)
            for n in ("heads", "num_heads", "num_attention_heads")
            if isinstance(getattr(module, n, None), int)
        ),
        None,
    )
    for name in ("inner_dim", "embed_dim", "all_head_size", "dim"):
        value = getattr(module, name, None)
        if isinstance(value, int):
            dims.add(value)
            if heads:
                dims.add(value // heads)
    values = {1.0, current, current * 2, current / 2, current**2, math.sqrt(abs(current))}
    for d in dims:
        if d > 0:
            values |= {d**-0.5, 1.0 / d, d**0.5}
    return sorted(v for v in values if v > 0)


def attention_scale(c: Culprit) -> list[Hint]:
    r"""``attention-scale``: the softmax scale that makes one side reproduce the other's output.

    With a scale attribute on the port, the port's copy is refitted to the reference output (the fix is that
    value, verified); else, with one on the reference, the reference is refitted to the port's output.
    """
    if not (_is_attention(c.reference) or _is_attention(c.port)):
        return []
    before = relative_error(c.port_output, c.reference_output)
    port_attr = _attr_of(c.port, SCALE_NAMES) if c.port is not None else None
    if port_attr is not None and c.run_port is not None:
        current = float(getattr(c.port, port_attr))

        def run(s: float) -> Any:
            return c.run_port(patched_copy(c.port, {port_attr: s}))

        best, err, _ = _fit_constant(run, c.reference_output, _scale_candidates(c.port, current), refine=True)
        if (
            before > 0
            and err <= FIT_REL
            and err < FIT_GAIN * before
            and not math.isclose(best, current, rel_tol=1e-4)
        ):
            hint = Hint(
                "attention-scale",
                f"the port's attention reproduces the reference output with scale {format_value(best)}"
                f" (relative error {err:.1e}); it uses {port_attr}={format_value(current)} (evidence: softmax"
                " scale fitted on the captured input)",
                {"fitted_scale": best, "port_scale": current, "fit_error": err, "error": before},
                score=0.9,
                fix=f"{c.port_path(attr=port_attr)} = {best!r}",
            )
            return [verify_hint(c, lambda: patched_copy(c.port, {port_attr: best}), hint)]
        return []
    ref_attr = _attr_of(c.reference, SCALE_NAMES) if c.reference is not None else None
    if ref_attr is None or c.run_reference is None:
        return []
    current = float(getattr(c.reference, ref_attr))

    def run_ref(s: float) -> Any:
        return c.run_reference(patched_copy(c.reference, {ref_attr: s}))

    best, err, _ = _fit_constant(run_ref, c.port_output, _scale_candidates(c.reference, current), refine=True)
    if (
        not before > 0
        or err > FIT_REL
        or err >= FIT_GAIN * before
        or math.isclose(best, current, rel_tol=1e-4)
    ):
        return []
    return [
        Hint(
            "attention-scale",
            f"the port computes attention with softmax scale {format_value(best)} where the reference uses"
            f" {format_value(current)} (evidence: the reference refitted to the port's output, relative error"
            f" {err:.1e})",
            {"fitted_scale": best, "reference_scale": current, "fit_error": err, "error": before},
            score=0.88,
            fix=f"use softmax scale {current!r} in {c.port_path()}",
        )
    ]
