r"""One sign convention kept on both sides of the denoiser call: the port's denoiser returns the reference's
output negated at every call, and its update applies the output with the opposite sign, so the latents agree
(round 33, Matcha-TTS: a port folding the velocity's sign into its output projection to fit
``FlowMatchEulerDiscreteScheduler``; the fixed port's report had "culprit: (top) … cosine -1" and "update …
×-1" as two places that differ)."""

from __future__ import annotations

import math
from typing import Any

from paritykit.base.report import format_number

# the port's output is the reference's negated where its distance from the negated output is at most this
# (relative L2)
NEGATED = 1e-4


def negated_error(ref_outputs: list[Any], port_outputs: list[Any]) -> float | None:
    r"""The largest relative L2 distance of each port output from the reference's negated, over the calls;
    ``None`` where a pair is missing, shaped apart or closer to the reference's as it is."""
    from paritykit.compare.tensors import relative_error

    worst = 0.0
    if not ref_outputs or len(ref_outputs) != len(port_outputs):
        return None
    for a, b in zip(ref_outputs, port_outputs):
        if a is None or b is None or tuple(a.shape) != tuple(b.shape) or not a.is_floating_point():
            return None
        flipped = relative_error(b.double(), -a.double())
        if not math.isfinite(flipped) or flipped >= relative_error(b.double(), a.double()):
            return None
        worst = max(worst, flipped)
    return worst


def opposite_output_terms(fits: list[tuple[Any, Any]]) -> list[float] | None:
    r"""The reference's output coefficients where every exact pair of update rules has the same terms, the
    output's coefficient negated on the port's side and every other coefficient equal; ``None`` otherwise."""
    found = []
    for fr, fp in fits:
        if fr is None or fp is None or not (fr.exact and fp.exact) or fr.names != fp.names:
            return None
        for name, a, b in zip(fr.names, fr.coefficients, fp.coefficients):
            same = b if name != "output" else -b
            if not math.isclose(a, same, rel_tol=1e-4, abs_tol=1e-7):
                return None
            if name == "output":
                found.append(a)
    return found or None


def convention_words(calls: int, error: float, coefficients: list[float]) -> str:
    shown = format_number(coefficients[0])
    return (
        f"every call's output is the reference's negated ({calls} calls, relative L2 at most"
        f" {format_number(error)} from it) and every update applies the output with the opposite sign"
        f" (coefficient -{shown} against {shown} at the first): one sign convention kept on both sides of the"
        " call, not a difference"
    )
