r"""The constants a fitted number is snapped to (powers of ten, 2 and 1/2, π, the VAE scaling factors, √d and
1/√d of the tensor sizes): shared by the repair search's rescaling edits and the value relations."""

from __future__ import annotations

import math
from collections.abc import Sequence

NAMED = (
    (1000.0, "1000"),
    (1e-3, "1/1000"),
    (2.0, "2"),
    (0.5, "1/2"),
    (math.pi, "π"),
    (2 * math.pi, "2π"),
    (1 / math.pi, "1/π"),
    (1 / (2 * math.pi), "1/(2π)"),
    (0.18215, "0.18215 (SD VAE scaling factor)"),
    (1 / 0.18215, "1/0.18215 (SD VAE scaling factor)"),
    (0.13025, "0.13025 (SDXL VAE scaling factor)"),
    (1 / 0.13025, "1/0.13025 (SDXL VAE scaling factor)"),
    (0.3611, "0.3611 (Flux VAE scaling factor)"),
    (1 / 0.3611, "1/0.3611 (Flux VAE scaling factor)"),
    (1.5305, "1.5305 (SD3 VAE scaling factor)"),
    (1 / 1.5305, "1/1.5305 (SD3 VAE scaling factor)"),
    (10.0, "10"),
    (0.1, "1/10"),
    (100.0, "100"),
    (0.01, "1/100"),
    (-1.0, "-1"),
    (-2.0, "-2"),
    (1.0, "1"),
    (0.0, "0"),
)


def simple_constants(sizes: Sequence[int] = ()) -> list[tuple[float, str]]:
    r"""The constants a fitted number is snapped to: powers of ten, 2 and 1/2, π and 2π, the VAE scaling
    factors, and √d, 1/√d, d, 1/d for every size ``d`` of the tensors at the site."""
    out = list(NAMED)
    for d in sorted({int(s) for s in sizes if int(s) > 1}):
        out += [(math.sqrt(d), f"√{d}"), (1 / math.sqrt(d), f"1/√{d}"), (float(d), str(d)), (1 / d, f"1/{d}")]
    return out


def snapped(value: float, sizes: Sequence[int] = (), rel: float = 0.05) -> list[tuple[float, str]]:
    r"""Simple constants within ``rel`` (relative) of ``value``, nearest first."""
    if not math.isfinite(value):
        return []
    near = [
        (c, name)
        for c, name in simple_constants(sizes)
        if (c == 0 and abs(value) < 1e-6) or (c != 0 and abs(value - c) <= rel * abs(c))
    ]
    return sorted(near, key=lambda cn: abs(value - cn[0]))
