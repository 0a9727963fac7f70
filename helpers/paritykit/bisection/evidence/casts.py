r"""Reduced-precision evidence (``bf16-cast`` / ``fp16-cast``): the reference re-run in that dtype reproduces
the port's output."""

from __future__ import annotations

import math
from typing import Any

from paritykit.bisection.evidence.culprit import (
    Culprit,
)
from paritykit.compare.diagnose import Hint
from paritykit.compare.tensors import relative_error

# a rerun in reduced precision "reproduces" the port when it leaves at most this share of the error
CAST_GAIN = 0.1


def reduced_precision(c: Culprit) -> list[Hint]:
    r"""``bf16-cast`` / ``fp16-cast``: the reference module re-run with its inputs rounded to that dtype, or
    under ``torch.autocast`` in it, reproduces the port's output far more closely than its own output does.

    An activation approximation, an eps change or swapped weights leave the error where it was after such a
    rerun, so those look-alikes get no cast hint.
    """
    import torch

    if c.reference is None or c.run_reference is None:
        return []
    before = relative_error(c.reference_output, c.port_output)
    if not (before > 0 and math.isfinite(before)):
        return []  # an all-zero port output has no relative error to shrink: a rerun proves nothing
    device = next((t.device.type for t in (*c.reference.parameters(), *c.reference.buffers())), "cpu")
    for dtype_name, hint_id in (("bfloat16", "bf16-cast"), ("float16", "fp16-cast")):
        dtype = getattr(torch, dtype_name)

        def rounded(*args: Any, _dtype: Any = dtype, **kwargs: Any) -> Any:
            def r(v: Any) -> Any:
                return (
                    v.to(_dtype).to(v.dtype)
                    if hasattr(v, "is_floating_point") and v.is_floating_point()
                    else v
                )

            return c.reference(*(r(a) for a in args), **{k: r(v) for k, v in kwargs.items()})

        def autocast(*args: Any, _dtype: Any = dtype, **kwargs: Any) -> Any:
            with torch.autocast(device_type=device, dtype=_dtype):
                return c.reference(*args, **kwargs)

        for how, fn in (
            (f"with its inputs rounded to {dtype_name}", rounded),
            (f"under torch.autocast({dtype_name})", autocast),
        ):
            try:
                out = c.run_reference(fn)
            except Exception:  # autocast unsupported for this dtype on this device
                continue
            err = relative_error(out.to(c.port_output.dtype), c.port_output)
            if math.isfinite(err) and err <= CAST_GAIN * before:
                return [
                    Hint(
                        hint_id,
                        f"the reference module re-run {how} reproduces the port's output (relative error"
                        f" {err:.1e}, against {before:.1e} as it is) (evidence: the rerun): the port computes"
                        f" this module or its input in {dtype_name}",
                        {"rerun_error": err, "error": before, "dtype": dtype_name, "rerun": how},
                        score=0.92,
                    )
                ]
    return []
