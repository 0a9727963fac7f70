r"""The linear relations triage fits between one side's own recorded tensors (the update rule, the decoder's
input scaling, the post-processing), by least squares, and how two sides' fitted coefficients differ. A fit of
each side's own tensors holds whatever differs upstream."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from paritykit.base.minimize import least_squares
from paritykit.base.report import format_number

# a relation fitted by least squares is exact when it leaves at most this share of the target's norm
EXACT_FIT = 1e-5
# two fitted coefficients agree within this relative difference
COEFFICIENT_RTOL = 1e-4


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
    spread = target.is_complex() or any(r.is_complex() for r in regressors.values())
    y = _real(target, spread).reshape(-1)
    if not bool(torch.isfinite(y).all()):
        return None
    columns = torch.stack([_real(r, spread).reshape(-1) for r in regressors.values()], dim=1)
    if not bool(torch.isfinite(columns).all()):
        return None
    solution = least_squares(columns, y, driver="gelsd")
    residual = float((columns @ solution - y).norm()) / max(float(y.norm()), 1e-30)
    return LinearFit(list(regressors), [float(c) for c in solution], residual)


def _real(t: Any, spread: bool = False) -> Any:
    r"""``t`` in float64; with ``spread`` (a complex tensor in the fit: a spectrogram's latents) as real and
    imaginary parts, a real tensor with an imaginary part of 0: real coefficients fitted over both parts, as a
    complex update with real coefficients acts on each."""
    import torch

    t = t.detach()
    if not spread:
        return t.double()
    if not t.is_complex():
        t = torch.complex(t.double(), torch.zeros_like(t, dtype=torch.float64))
    return torch.view_as_real(t.resolve_conj()).double()


def fit_affine(target: Any, source: Any, per_channel: bool = False) -> LinearFit | None:
    r"""``target ≈ a · source + b``: how one side's tensor became the other's. With ``per_channel`` and a
    tensor of three or more dims, when one shift does not fit exactly, a shift per channel (dim 1) is tried: a
    scale applied before a 1×1 convolution with a bias (``post_quant_conv``) reaches its output that way."""
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


def update_terms(x: Any, eps: Any, previous: Any = None) -> dict[str, Any] | None:
    r"""The terms an update rule is fitted on, by name: the latents, the output (each batch half its own
    term when the output holds a guidance batch) and, where given and shaped alike, the previous call's
    output; ``None`` when the output fits no such shape."""
    if x is None or eps is None:
        return None
    terms = {"latents": x}
    if tuple(eps.shape) == tuple(x.shape):
        terms["output"] = eps
    elif eps.shape[0] == 2 * x.shape[0] and tuple(eps.shape[1:]) == tuple(x.shape[1:]):
        half = x.shape[0]
        terms["output[first half]"], terms["output[second half]"] = eps[:half], eps[half:]
    else:
        return None
    if previous is not None and "output" in terms and tuple(previous.shape) == tuple(eps.shape):
        terms["previous output"] = previous
    return terms


def update_fit(x: Any, eps: Any, nxt: Any, previous: Any = None) -> LinearFit | None:
    r"""One side's update from one call to the next as a linear rule: ``next ≈ a·x + b·output`` (each batch
    half of the output its own term when the output holds a guidance batch), then with the previous call's
    output as a further term (multistep samplers) when the two-term rule is not exact."""
    terms = update_terms(x, eps, previous)
    if terms is None or nxt is None:
        return None
    more = terms.pop("previous output", None)
    fit = fit_linear(nxt, terms)
    if fit is not None and not fit.exact and more is not None:
        wider = fit_linear(nxt, {**terms, "previous output": more})
        if wider is not None and wider.exact:
            return wider
    return fit


def predict(fit: LinearFit, terms: dict[str, Any]) -> Any:
    r"""``Σ coefficient · term`` of a fitted rule on the given terms (in float64), or ``None`` when a term
    the rule has is not among them."""
    if any(name not in terms for name in fit.names):
        return None
    return sum(c * terms[name].detach().double() for name, c in zip(fit.names, fit.coefficients))


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
