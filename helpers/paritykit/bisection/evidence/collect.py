r"""All evidence at a culprit, ranked: the registry of detectors (``EVIDENCE``), :func:`culprit_evidence`, and
the plain ``no-signature`` hint that lists what was checked when no detector finds anything."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from paritykit.bisection.evidence.activations import activation
from paritykit.bisection.evidence.casts import reduced_precision
from paritykit.bisection.evidence.constants import attention_scale, norm_eps
from paritykit.bisection.evidence.culprit import Culprit
from paritykit.bisection.evidence.folds import folded_gain
from paritykit.bisection.evidence.settings import module_config
from paritykit.bisection.evidence.weight_slices import weights
from paritykit.compare.diagnose import Hint

# -------------------------------------------------------------------------------------------- the whole


EVIDENCE: tuple[tuple[str, Callable[[Culprit], list[Hint]]], ...] = (
    ("module config", module_config),
    ("activation", activation),
    ("norm eps", norm_eps),
    ("attention scale", attention_scale),
    ("weight slices", weights),
    ("a gain folded into the readers", folded_gain),
    ("a bf16 or fp16 cast (re-run in each)", reduced_precision),
)


def rank(hints: Sequence[Hint]) -> list[Hint]:
    r"""Verified fixes first, then by score; one hint per fix."""
    seen, out = set(), []
    for h in sorted(hints, key=lambda h: (h.verified is not True, -h.score)):
        key = h.fix or (h.id, h.message)  # two detectors proposing one fix: the first says it
        if key not in seen:
            seen.add(key)
            out.append(h)
    return out


def culprit_evidence(c: Culprit, tensor_hints: Sequence[Hint] = ()) -> list[Hint]:
    r"""Run every evidence function at a culprit; with nothing found anywhere, one ``no-signature`` hint.

    Args:
        c: the culprit.
        tensor_hints: what the tensor-level detectors (:func:`paritykit.compare.diagnose.diagnose`, remix)
            found.
    Returns:
        Hints, verified fixes first.
    """
    import torch

    found: list[Hint] = []
    ran: list[str] = []
    failed: list[str] = []
    with torch.no_grad():
        for name, fn in EVIDENCE:
            if name == "norm eps" and any(
                h.id == "module-config" and h.evidence.get("difference", {}).get("name") == "eps"
                for h in found
            ):
                continue  # the eps is named already; a fit would only repeat it
            try:
                found += fn(c)
                ran.append(name)
            except Exception as exc:  # one broken check must not hide the others, nor count as passed
                failed.append(f"{name} ({type(exc).__name__}: {str(exc)[:80]})")
    hints = rank([*found, *tensor_hints])
    verified = [h for h in hints if h.verified]
    if verified:
        return verified  # a fix that makes the module match explains all of it; the rest would only distract
    if hints:
        return hints
    return [no_signature(c, ran, failed)]


def _equal_dims(module: Any) -> list[str]:
    r"""The parameters of ``module`` with two dims of one size (above 1), as ``name (shape)``: values that
    agree as laid out would agree read with those dims swapped too."""
    if module is None:
        return []
    found = []
    for name, p in module.named_parameters():
        sizes = [d for d in p.shape if d > 1]
        if len(sizes) != len(set(sizes)):
            found.append(f"{name} {tuple(p.shape)}")
    return found


def no_signature(c: Culprit, ran: Sequence[str], failed: Sequence[str] = ()) -> Hint:
    r"""The plain statement when no detector has evidence: what was measured, which checks ran without a
    match and which could not run. It names no cause: an unmatched check is no proof of anything."""
    ruled_out = [*ran, "tensor signatures"]
    checked_all = (
        c.reference is not None and c.port is not None and "module config" in ran and "weight slices" in ran
    )
    if checked_all:
        settled = len(c.matched_subpairs)
        pairs = 1 + len(c.subpairs) - settled
        left_out = (
            f" ({settled} pair(s) inside that match on identical inputs left out: no setting there matters)"
            if settled
            else ""
        )
        square = _equal_dims(c.port)
        ambiguous = (
            f"; {', '.join(square[:4])}{f' and {len(square) - 4} more' if len(square) > 4 else ''} have two"
            " dims of one size, so read with those dims swapped they would hold the values too"
            if square
            else ""
        )
        message = (
            f"no detector matched; measured: the settings of the {pairs} aligned module pair(s) in it are"
            f" equal{left_out}, and each parameter of the aligned pairs holds the values of its aligned"
            " reference parameter (how each forward reads them, an axis or a transpose, is not compared by"
            f" this{ambiguous})"
        )
        if c.own_inputs:
            message += (
                "; the port's call takes inputs the reference's does not"
                f" ({', '.join(c.own_inputs[:4])}), fed its own values: a lead that the port's module is"
                " wired to other inputs (what calls it, or a setting there that routes them)"
            )
        if c.layouts:
            message += (
                f", some only after a layout op ({', '.join(c.layouts[:3])}): a lead, the layout not checked"
                " against what the port's forward expects"
            )
    elif c.reference is None or c.port is None:
        message = (
            "no detector matched the output tensors; the module objects were not available, so settings and"
            " weights were not compared"
        )
    else:
        message = "no detector matched; not every check could run"
    checked = [*ran, "tensor signatures (casts, transposes, scales, offsets)"]
    message += f" (checked without a match: {', '.join(checked)}"
    message += f"; could not run: {', '.join(failed)})" if failed else ")"
    return Hint("no-signature", message, {"ruled_out": ruled_out, "not_run": list(failed)}, score=0.1)
