r"""One-dimensional minimization shared by the fits that search one number (a norm's epsilon, a schedule's
``mu``): golden-section search, one new evaluation per step, no scipy."""

from __future__ import annotations

import math
from collections.abc import Callable

GOLDEN = (math.sqrt(5) - 1) / 2


def golden_section(cost: Callable[[float], float], lo: float, hi: float, steps: int) -> tuple[float, float]:
    r"""The ``(x, cost(x))`` of lowest cost found in ``[lo, hi]`` by golden-section search over ``steps``
    steps (``cost`` unimodal there)."""
    a, b = hi - GOLDEN * (hi - lo), lo + GOLDEN * (hi - lo)
    fa, fb = cost(a), cost(b)
    for _ in range(steps):
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - GOLDEN * (hi - lo)
            fa = cost(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + GOLDEN * (hi - lo)
            fb = cost(b)
    return (a, fa) if fa <= fb else (b, fb)
