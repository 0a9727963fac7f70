r"""Minimization shared by the fits: golden-section search for those that search one number (a norm's epsilon,
a schedule's ``mu``), one new evaluation per step, no scipy; and least squares on the CPU for linear fits."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

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


def least_squares(columns: Any, target: Any, driver: str | None = None) -> Any:
    r"""``x`` minimizing ``|columns @ x - target|`` (``target`` a vector), solved on the CPU in float64 and
    returned in ``columns``' dtype and device: CUDA's solver takes only full-rank systems (driver ``gels``
    alone), and the fits meet rank-deficient ones (a constant column, a duplicated regressor)."""
    import torch

    a = columns.detach().to("cpu", torch.float64)
    b = target.detach().to("cpu", torch.float64).unsqueeze(1)
    solution = torch.linalg.lstsq(a, b, driver=driver).solution.squeeze(1)
    return solution.to(columns.device, columns.dtype)
