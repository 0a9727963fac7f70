r"""The checks behind ``paritykit triage``, one per place a sampling pipeline can part from its reference.

Every check works on the two sides' recorded denoiser (and decoder) calls. A check that isolates a place feeds
the port's module the reference's values at that point (replay, never a guess) or fits each side's own
relation between recorded tensors (the update rule, the decoder's input scaling, the post-processing), so it
holds even when something upstream differs too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from paritykit.base.report import format_number
from paritykit.tracing.recording import Call
from paritykit.triage.calls import Roles, latents, output, pair_conditioning, timestep

# a relation fitted by least squares is exact when it leaves at most this share of the target's norm
EXACT_FIT = 1e-5
# two fitted coefficients agree within this relative difference
COEFFICIENT_RTOL = 1e-4


@dataclass
class Tolerance:
    atol: float | None = None
    rtol: float | None = None


def compare(a: Any, b: Any, tol: Tolerance, name: str) -> Any:
    from paritykit.compare import compare_tensors

    return compare_tensors(a, b, atol=tol.atol, rtol=tol.rtol, name=name)


def rel(a: Any, b: Any) -> float | None:
    r"""``|b - a| / |a|`` (:func:`~paritykit.compare.tensors.relative_error`, the reference ``a`` as the
    denominator), or ``None`` when the shapes differ: a curve cell left empty."""
    if a is None or b is None or tuple(a.shape) != tuple(b.shape):
        return None
    from paritykit.compare.tensors import relative_error

    return relative_error(b, a)


def same_timestep(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


# ------------------------------------------------------------------------------------------ linear relations
@dataclass
class LinearFit:
    r"""``target ≈ Σ coefficients[k] · regressors[k]`` by least squares, with the residual's share of the
    target's norm."""

    names: list[str]
    coefficients: list[float]
    residual: float

    @property
    def exact(self) -> bool:
        return self.residual <= EXACT_FIT

    def text(self) -> str:
        return " + ".join(
            _coefficient(c) if n == "offset" else f"{_coefficient(c)}·{n}"
            for c, n in zip(self.coefficients, self.names)
        )


def _coefficient(value: float) -> str:
    return format_number(0.0 if abs(value) < 1e-9 else value, 6)


def fit_linear(target: Any, regressors: dict[str, Any]) -> LinearFit | None:
    r"""Least squares in float64 over every element; ``None`` when the shapes do not agree."""
    import torch

    if any(tuple(r.shape) != tuple(target.shape) for r in regressors.values()):
        return None
    y = target.detach().double().reshape(-1)
    if not bool(torch.isfinite(y).all()):
        return None
    columns = torch.stack([r.detach().double().reshape(-1) for r in regressors.values()], dim=1)
    if not bool(torch.isfinite(columns).all()):
        return None
    solution = torch.linalg.lstsq(columns, y.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    residual = float((columns @ solution - y).norm()) / max(float(y.norm()), 1e-30)
    return LinearFit(list(regressors), [float(c) for c in solution], residual)


def fit_affine(target: Any, source: Any, per_channel: bool = False) -> LinearFit | None:
    r"""``target ≈ a · source + b``: how one side's tensor became the other's. With ``per_channel`` and a tensor
    of three or more dims, when one shift does not fit exactly, a shift per channel (dim 1) is tried: a scale
    applied before a 1×1 convolution with a bias (``post_quant_conv``) reaches its output that way."""
    import torch

    if source is None or target is None or tuple(source.shape) != tuple(target.shape):
        return None
    ones = torch.ones_like(source, dtype=torch.float64)
    fit = fit_linear(target, {"x": source, "1": ones})
    if fit is None or fit.exact or not per_channel or source.dim() < 3:
        return fit
    channels = {}
    for c in range(source.shape[1]):
        indicator = torch.zeros_like(ones)
        indicator[:, c] = 1
        channels[f"offset[channel {c}]"] = indicator
    finer = fit_linear(target, {"x": source, **channels})
    return finer if finer is not None and finer.exact else fit


def affine_words(fit: LinearFit, what: str) -> str:
    scale, *shifts = fit.coefficients
    words = f"{format_number(scale, 6)} × {what}"
    if len(shifts) > 1:
        return words + " + a shift per channel"
    if shifts and abs(shifts[0]) > 1e-6:
        words += f" {'+' if shifts[0] > 0 else '-'} {format_number(abs(shifts[0]), 6)}"
    return words


def update_fit(x: Any, eps: Any, nxt: Any, previous: Any = None) -> LinearFit | None:
    r"""One side's update from one call to the next as a linear rule: ``next ≈ a·x + b·output`` (each batch
    half of the output its own term when the output holds a guidance batch), then with the previous call's
    output as a further term (multistep samplers) when the two-term rule is not exact."""
    if x is None or eps is None or nxt is None:
        return None
    terms = {"latents": x}
    if tuple(eps.shape) == tuple(x.shape):
        terms["output"] = eps
    elif eps.shape[0] == 2 * x.shape[0] and tuple(eps.shape[1:]) == tuple(x.shape[1:]):
        half = x.shape[0]
        terms["output[first half]"], terms["output[second half]"] = eps[:half], eps[half:]
    else:
        return None
    fit = fit_linear(nxt, terms)
    if (
        fit is not None
        and not fit.exact
        and previous is not None
        and tuple(previous.shape) == tuple(eps.shape)
    ):
        if "output" in terms:
            more = fit_linear(nxt, {**terms, "previous output": previous})
            if more is not None and more.exact:
                return more
    return fit


def coefficient_differences(ref: LinearFit, port: LinearFit) -> list[str]:
    r"""The terms whose coefficients differ, in words; empty when the two rules agree."""
    if ref.names != port.names:
        return [f"the rules have different terms: reference {ref.text()}, port {port.text()}"]
    found = []
    for name, a, b in zip(ref.names, ref.coefficients, port.coefficients):
        if not math.isclose(a, b, rel_tol=COEFFICIENT_RTOL, abs_tol=1e-7):
            ratio = f", ×{format_number(b / a, 5)}" if a != 0 and abs(b) > 1e-9 else ""
            what = "the offset" if name == "offset" else f"coefficient of the {name}"
            found.append(f"{what}: reference {_coefficient(a)}, port {_coefficient(b)}{ratio}")
    return found


# ------------------------------------------------------------------------------------------------ one call
@dataclass
class CallComparison:
    r"""Call ``index`` of both sides, input by input: ``latents`` and each conditioning pair as tensor
    comparisons (``None`` when a side lacks it or the shapes differ), the timesteps as numbers, the output."""

    index: int
    latents: Any
    latents_note: str | None
    t_reference: float | None
    t_port: float | None
    timestep_kinds: tuple[str | None, str | None]
    conditioning: list[tuple[str, str, Any]]
    output: Any

    @property
    def latents_match(self) -> bool:
        return self.latents is not None and self.latents.passed

    @property
    def timestep_match(self) -> bool:
        return self.timestep_kinds[0] == self.timestep_kinds[1] and same_timestep(
            self.t_reference, self.t_port
        )

    @property
    def conditioning_match(self) -> bool:
        return all(c.passed for _, _, c in self.conditioning)

    @property
    def inputs_match(self) -> bool:
        return self.latents_match and self.timestep_match and self.conditioning_match

    @property
    def output_match(self) -> bool:
        return self.output is not None and self.output.passed


def compare_call(index: int, ref: Call, rr: Roles, port: Call, pr: Roles, tol: Tolerance) -> CallComparison:
    xr, xp = latents(ref, rr), latents(port, pr)
    note = None
    lat = None
    if xr is None or xp is None:
        note = "a side has no latents argument"
    elif tuple(xr.shape) != tuple(xp.shape):
        note = f"latents shapes differ: reference {tuple(xr.shape)}, port {tuple(xp.shape)}"
    else:
        lat = compare(xr, xp, tol, f"call {index} latents")
    conditioning = [
        (r, p, compare(ref.named[r], port.named[p], tol, f"call {index} {r} / {p}"))
        for r, p in pair_conditioning(ref, rr, port, pr)
    ]
    er, ep = output(ref), output(port)
    out = (
        compare(er, ep, tol, f"call {index} output")
        if er is not None and ep is not None and er.shape == ep.shape
        else None
    )
    return CallComparison(
        index,
        lat,
        note,
        timestep(ref, rr),
        timestep(port, pr),
        (rr.timestep_kind, pr.timestep_kind),
        conditioning,
        out,
    )


def comparison_evidence(comparison: Any) -> list[str]:
    r"""A tensor comparison's numbers and its diagnoses, one line each."""
    lines = [
        f"max_abs {format_number(comparison.max_abs)}, cosine {format_number(comparison.cosine, 7)}, "
        f"{format_number(comparison.mismatch_fraction)} of elements outside tolerance"
    ]
    lines += [hint.render() for hint in comparison.hints[:3]]
    return lines
