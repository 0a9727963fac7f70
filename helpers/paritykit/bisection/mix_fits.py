r"""Input-aware hints at a culprit: each side's output fitted as a linear mix of the module's inputs and its
children's outputs (``remix``: one knob standing for two concepts) and a constant scale."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from paritykit.base.inputs import is_tensor
from paritykit.base.minimize import least_squares

# a least-squares fit "explains" an output when its relative residual is below this
FIT_RESIDUAL = 1e-3


# coefficients closer than this are the same mixture
COEF_TOLERANCE = 5e-3


_FIT_SAMPLES = 1 << 18


_MAX_FIT_COLUMNS = 8


def _fit(columns: Any, target: Any) -> tuple[list[float], float]:
    import torch

    if not (bool(torch.isfinite(columns).all()) and bool(torch.isfinite(target).all())):
        return [math.nan] * columns.shape[1], math.inf  # NaN/inf in a captured tensor: nothing to fit
    try:
        solution = least_squares(columns, target)
    except RuntimeError:  # a degenerate system the LAPACK driver refuses
        return [math.nan] * columns.shape[1], math.inf
    norm = float(target.norm())
    residual = float((columns @ solution - target).norm()) / norm if norm else 0.0
    return [float(w) for w in solution], residual


def remix_hint(ref_out: Any, port_out: Any, candidates: Sequence[tuple[str, Any]]) -> Any:
    r"""Fit each side's output as a linear combination of candidate tensors (the module's tensor inputs and
    its children's outputs, broadcast to the output's shape); a ``remix`` hint when both fit and the mixtures
    differ.

    One candidate that fits both sides with different factors gives an input-aware ``constant-scale`` hint.
    """
    import torch

    from paritykit.compare.diagnose import Hint

    if not (ref_out.is_floating_point() and port_out.is_floating_point()) or ref_out.shape != port_out.shape:
        return None
    shape = ref_out.shape
    n = ref_out.numel()
    step = max(1, n // _FIT_SAMPLES)
    columns, names = [], []
    for name, tensor in candidates:
        if not is_tensor(tensor) or not tensor.is_floating_point():
            continue
        try:
            full = torch.broadcast_to(tensor.detach().cpu(), shape)
        except RuntimeError:
            continue
        column = full.reshape(-1)[::step].double()
        if float(column.norm()) == 0:
            continue
        if columns:
            # Drop columns the earlier ones already explain: collinear columns make coefficients meaningless.
            basis = torch.stack(columns, 1)
            _, residual = _fit(basis, column)
            if residual < 1e-6:
                continue
        columns.append(column)
        names.append(name)
        if len(columns) == _MAX_FIT_COLUMNS:
            break
    if not columns:
        return None
    matrix = torch.stack(columns, 1)
    y_ref = ref_out.detach().cpu().reshape(-1)[::step].double()
    y_port = port_out.detach().cpu().reshape(-1)[::step].double()
    w_ref, r_ref = _fit(matrix, y_ref)
    w_port, r_port = _fit(matrix, y_port)
    if r_ref > FIT_RESIDUAL or r_port > FIT_RESIDUAL:
        return None
    if max(abs(a - b) for a, b in zip(w_ref, w_port)) <= COEF_TOLERANCE:
        return None
    evidence = {
        "inputs": names,
        "reference": w_ref,
        "port": w_port,
        "residual_reference": r_ref,
        "residual_port": r_port,
    }
    ref_v, port_v = torch.tensor(w_ref, dtype=torch.float64), torch.tensor(w_port, dtype=torch.float64)
    k = float(ref_v @ port_v) / float(ref_v @ ref_v) if float(ref_v @ ref_v) else 0.0
    if k and float((port_v - k * ref_v).abs().max()) <= COEF_TOLERANCE * max(1.0, abs(k)):
        # Every coefficient scaled by one factor: a single output scale, not a different mixture.
        evidence["k"] = k
        terms = ", ".join(names)
        return Hint(
            "constant-scale",
            f"on identical inputs the port's output is {_coef(k)} x the reference's (coefficients"
            f" ({', '.join(_coef(w) for w in w_ref)}) vs ({', '.join(_coef(w) for w in w_port)}) of"
            f" ({terms})): an output scale read from a different place (a default instead of the config, or"
            " one knob used for two concepts)",
            evidence,
            score=0.96,
        )
    mix = ", ".join(names)
    return Hint(
        "remix",
        f"reference mixes ({', '.join(_coef(w) for w in w_ref)}), port"
        f" ({', '.join(_coef(w) for w in w_port)}) of ({mix}): one knob may mean two concepts",
        evidence,
        score=0.97,
    )


def _coef(w: float) -> str:
    value = round(w, 3)
    return repr(0.0 if value == 0 else value)


def culprit_hints(
    ref_out: Any, port_out: Any, candidates: Sequence[tuple[str, Any]], core: Sequence[Any]
) -> list:
    """Input-aware hints first, then the core detectors' hints (one hint per id, best first)."""
    hints = []
    extra = remix_hint(ref_out, port_out, candidates)
    if extra is not None:
        hints.append(extra)
    seen = {h.id for h in hints}
    for hint in sorted(core, key=lambda h: -h.score):
        if hint.id not in seen:
            hints.append(hint)
            seen.add(hint.id)
    return hints
