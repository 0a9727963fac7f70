r"""Sampling schedules from anything a port records (record_loop folders, checkpoint folders, tensor files,
JSON lists, a SPEC.py), and the tolerances they are compared with."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError

# timesteps agree within this: integers differ by >= 1, a rounding by 0.5, while fractional timesteps that
# diffusers interpolates in float32 (Karras sigmas mapped back to t) differ from a float64 loop by ~1e-3
TIMESTEP_ATOL = 5e-3


def timestep_atol(values) -> float:
    r""":data:`TIMESTEP_ATOL` at the scale of a list's timesteps: as given for timesteps counted to 1000, a
    thousandth of it for continuous ones counted to 1 (score-models' VP SDE ends at t = 1e-5, a port's
    default at 1e-3: 9.9e-4 apart, which 5e-3 would call the same list)."""
    top = max((abs(v) for v in values if v is not None), default=1000.0)
    return TIMESTEP_ATOL * max(top, 1.0) / 1000.0


# sigmas agree within this relative error (float32 port vs float64 reference)
SIGMA_RTOL = 1e-4


SIGMA_ATOL = 1e-6


# a closed-form family explains a list when its fit leaves at most this share of the list's range
FAMILY_FIT = 1e-4


# step counts a fit is validated at besides the requested one (7 and 13 do not divide 1000)
OTHER_COUNTS = (7, 13, 20, 50)


KINDS = ("timesteps", "sigmas")


# the scheduler keys that move a timestep list by a constant, quoted by hints
OFFSET_KEYS = "timestep_spacing, steps_offset"


# ============================================================================================================
# one side: a schedule
# ============================================================================================================
@dataclass
class Schedule:
    r"""One side's sampling schedule.

    Args:
        source: where it came from (a path, ``"list"``, a scheduler class).
        timesteps: the timestep of each step, or ``None``.
        sigmas: the sigma list, or ``None`` (may hold one more entry than steps: the final sigma).
        integer: the timesteps were stored with an integer dtype.
        generator: ``(n, image_seq_len=None) -> Schedule`` when the schedule is known for every step count (a
            SPEC's ``ref_schedule``); ``sized`` when it needs the image size too.
        recorded_sizes: the image sizes of a reference recorded at several sizes (:func:`load_sized`), known
            at its own step count only.
    """

    source: str
    timesteps: list[float] | None = None
    sigmas: list[float] | None = None
    integer: bool = False
    # recorded by record_loop: one value per denoiser call, so the final sigma (never a call's input) is
    # absent
    per_call: bool = False
    # ``(n, image_seq_len=None) -> Schedule``
    generator: Callable[..., Schedule] | None = field(default=None, repr=False)
    spec: Any = field(default=None, repr=False)
    # the generator needs the image size too (``ref_schedule(n, image_seq_len)``: a size-dependent shift)
    sized: bool = False
    recorded_sizes: tuple[int, ...] = ()

    def get(self, kind: str) -> list[float] | None:
        return self.timesteps if kind == "timesteps" else self.sigmas

    @property
    def steps(self) -> int:
        if self.timesteps is not None:
            return len(dedupe(self.timesteps))
        sig = dedupe(self.sigmas or [])
        return len(sig) - 1 if sig and sig[-1] == 0 else len(sig)


def dedupe(values: Sequence[float]) -> list[float]:
    r"""Consecutive repeats dropped: a second-order scheduler (Heun) lists every timestep but the first
    twice."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def repeated(values: Sequence[float] | None) -> int:
    r"""``k`` when every value comes ``k`` times in a row (``k`` > 1: a denoiser called once per guidance
    half at each step); 1 otherwise."""
    if not values or len(values) < 2:
        return 1
    runs = [1]
    for previous, value in zip(values, values[1:]):
        if value == previous:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs[0] if runs[0] > 1 and len(set(runs)) == 1 else 1


def per_step(schedule: Schedule) -> tuple[Schedule, int]:
    r"""``schedule`` with each recorded value kept once when every one repeats ``k`` times (a denoiser called
    once per guidance half), and ``k``; the schedule itself and 1 otherwise."""
    import dataclasses

    k = max(repeated(schedule.timesteps), repeated(schedule.sigmas))
    if k == 1:
        return schedule, 1
    once = {key: getattr(schedule, key)[::k] for key in ("timesteps", "sigmas") if getattr(schedule, key)}
    return dataclasses.replace(schedule, **once), k


def _floats(value: Any, what: str) -> tuple[list[float], bool]:
    r"""The values of one list as floats, and whether they were stored as integers; an empty list or one
    holding NaN or an infinity is refused, naming ``what``."""
    values, integer = _numbers(value, what)
    if not values:
        raise ParityKitError(f"{what}: the schedule is empty")
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise ParityKitError(f"{what}: value {bad} is {values[bad]} (a schedule holds finite numbers only)")
    return values, integer


def _numbers(value: Any, what: str) -> tuple[list[float], bool]:
    import torch

    if isinstance(value, torch.Tensor):
        integer = not (value.is_floating_point() or value.is_complex())
        return [float(v) for v in value.detach().reshape(-1).double().tolist()], integer
    try:
        import numpy as np

        arr = np.asarray(value)
        if arr.dtype.kind not in "iuf":
            raise ValueError
    except (ValueError, TypeError):
        raise ParityKitError(f"{what}: expected a list of numbers") from None
    return [float(v) for v in arr.reshape(-1).tolist()], arr.dtype.kind in "iu"


def _from_mapping(data: dict[str, Any], source: str) -> Schedule:
    found: dict[str, Any] = {}
    for kind in KINDS:
        for name, value in data.items():
            if name.rsplit("/", 1)[-1] == kind and (kind not in found or name.startswith("preloop")):
                found[kind] = value
    if not found:
        raise ParityKitError(
            f"{source}: no 'timesteps' or 'sigmas' in it (have: {', '.join(data) or 'nothing'})"
        )
    schedule = Schedule(source)
    if "timesteps" in found:
        schedule.timesteps, schedule.integer = _floats(found["timesteps"], source)
    if "sigmas" in found:
        schedule.sigmas, _ = _floats(found["sigmas"], source)
    return schedule


def _from_spec(path: Path) -> Schedule:
    from paritykit.base.usercode import call_user, load_spec

    spec = load_spec(path)
    module = spec.module
    if not hasattr(module, "ref_schedule") and not hasattr(module, "ref_step"):
        raise ParityKitError(f"SPEC {str(path)!r}: define ref_schedule(n) (and ref_step for --step-check)")

    sized = hasattr(module, "ref_schedule") and _positional_count(module.ref_schedule) >= 2

    def generate(n: int, size: int | None = None) -> Schedule:
        if not hasattr(module, "ref_schedule"):
            raise ParityKitError(
                f"SPEC {str(path)!r}: define ref_schedule(n) returning the timesteps or sigmas"
            )
        if sized and size is None:
            raise ParityKitError(
                f"SPEC {str(path)!r}: ref_schedule(n, image_seq_len) depends on the image size: give the"
                " sizes to fit at (--image-seq-len 256,4096)"
            )
        args = (n, size) if sized else (n,)
        what = f"ref_schedule({', '.join(map(str, args))})"
        value = call_user(module.ref_schedule, *args, what=what, spec=spec)
        if isinstance(value, dict):
            return _from_mapping(value, str(path))
        ts, integer = _floats(value, f"{path}: {what}")
        return Schedule(str(path), timesteps=ts, integer=integer)

    return Schedule(str(path), generator=generate, spec=spec, sized=sized)


def _positional_count(fn: Callable) -> int:
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def load_sized(recordings: Mapping[int, Any]) -> Schedule:
    r"""A reference recorded at two or more image sizes, ``{image_seq_len: source}`` (each source anything
    :func:`load_schedule` reads, at the same step count): a size-dependent schedule known at those sizes."""
    if len(recordings) < 2:
        raise ParityKitError("recordings at image sizes: give two or more (SIZE=PATH,SIZE=PATH)")
    loaded = {int(size): load_schedule(source) for size, source in sorted(recordings.items())}
    counts = {size: rec.steps for size, rec in loaded.items()}
    if len(set(counts.values())) > 1:
        raise ParityKitError(
            "recordings at image sizes hold different step counts ("
            + ", ".join(f"{n} at {size}" for size, n in counts.items())
            + "): record every size at the same count"
        )
    first = next(iter(loaded.values()))

    def generate(n: int, size: int | None = None) -> Schedule | None:
        rec = loaded.get(size)
        return rec if rec is not None and n == rec.steps else None

    source = "recordings at image_seq_len " + ", ".join(
        f"{size} ({rec.source})" for size, rec in loaded.items()
    )
    return Schedule(
        source,
        timesteps=first.timesteps,
        sigmas=first.sigmas,
        integer=first.integer,
        per_call=first.per_call,
        generator=generate,
        sized=True,
        recorded_sizes=tuple(loaded),
    )


def load_schedule(source: Any) -> Schedule:
    r"""Read one side: a :class:`Schedule`, a list / tensor / array, a dict with ``timesteps`` and/or
    ``sigmas``, or a path: a checkpoint folder (its ``preloop`` checkpoint), a tensor file (``.safetensors``,
    ``.pt``, ``.npy``, …; keys named ``timesteps`` / ``sigmas``, or one bare tensor read as timesteps), a
    ``.json`` list or object, or a SPEC ``.py`` defining ``ref_schedule(n)`` (and ``ref_step`` for a step
    check)."""
    if isinstance(source, Schedule):
        return source
    if isinstance(source, dict):
        return _from_mapping(source, "dict")
    if not isinstance(source, (str, Path)):
        ts, integer = _floats(source, "schedule")
        return Schedule("list", timesteps=ts, integer=integer)
    path = Path(source)
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or folder")
    if path.suffix == ".py":
        return _from_spec(path)
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ParityKitError(f"{path}: not a JSON list or object ({exc})") from None
        if isinstance(data, dict):
            return _from_mapping(data, str(path))
        if not isinstance(data, list):
            raise ParityKitError(
                f"{path}: expected a JSON list of numbers, or an object with timesteps/sigmas "
                f"(got {type(data).__name__})"
            )
        ts, integer = _floats(data, str(path))
        return Schedule(str(path), timesteps=ts, integer=integer and all(isinstance(v, int) for v in data))
    if path.is_dir():
        from paritykit.tracing.checkpoints import load_checkpoints

        checkpoints = load_checkpoints(path)
        for name in ("preloop", *checkpoints):
            data = checkpoints[name].data if name in checkpoints else {}
            if any(kind in data for kind in KINDS):
                schedule = _from_mapping(data, f"{path} ({name})")
                schedule.per_call = "recorded_calls" in data
                return schedule
        raise ParityKitError(f"{path}: no checkpoint holds 'timesteps' or 'sigmas' (save them at preloop)")
    from paritykit.base.io import load_tensors

    tensors = load_tensors(path)
    if len(tensors) == 1 and not any(n.rsplit("/", 1)[-1] in KINDS for n in tensors):
        ((name, value),) = tensors.items()
        ts, integer = _floats(value, str(path))
        if "sigma" in name.lower():
            return Schedule(str(path), sigmas=ts)
        return Schedule(str(path), timesteps=ts, integer=integer)
    return _from_mapping(tensors, str(path))
