r"""Default tolerances per dtype pair, and the thread count of the comparison walk."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# torch.testing.assert_close's defaults, keyed by dtype name: (rtol, atol)
_TOLERANCES: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex32": (1e-3, 1e-5),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
}


# Intra-op threads for the chunk walks of compare_tensors and diagnose (see walk_threads).
WALK_THREADS = 1


@contextmanager
def walk_threads(threads: int | None = None) -> Iterator[None]:
    r"""Run torch's CPU ops with ``threads`` (default :data:`WALK_THREADS`) intra-op threads inside the block.

    A chunked walk issues thousands of small ops; with several intra-op threads each op ends at a barrier,
    and on a busy machine one descheduled thread stalls every op for a whole time slice (a 20-30x slowdown
    measured on 2 shared cores). The walk is memory-bound, so one thread loses little when the machine is
    idle."""
    import torch

    threads = WALK_THREADS if threads is None else threads
    previous = torch.get_num_threads()
    if previous != threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if previous != threads:
            torch.set_num_threads(previous)


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def default_tolerances(dtype_a: Any, dtype_b: Any) -> tuple[float, float]:
    r"""``(rtol, atol)`` for a pair of dtypes: torch.testing's table, the looser of the two dtypes winning.

    fp16 1e-3/1e-5, bf16 1.6e-2/1e-5, fp32 1.3e-6/1e-5, fp64 1e-7/1e-7 (complex like their float parts);
    float8 types get rtol = their unit roundoff ×2; integers and bools compare exactly (0, 0).

    Args:
        dtype_a, dtype_b: ``torch.dtype`` objects or their names (``"float16"``, ``"torch.bfloat16"``).
    """
    rtols, atols = [], []
    for dtype in (dtype_a, dtype_b):
        name = dtype_name(dtype)
        if name in _TOLERANCES:
            rtol, atol = _TOLERANCES[name]
        elif name.startswith("float8"):
            import torch

            rtol, atol = float(torch.finfo(getattr(torch, name)).eps), 1e-5
        else:
            rtol, atol = 0.0, 0.0
        rtols.append(rtol)
        atols.append(atol)
    return max(rtols), max(atols)
