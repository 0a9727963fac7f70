r"""Scheduler parity: compare two sampling schedules, and find the diffusers scheduler config that reproduces one.

A research loop writes its own timestep list and sigma formula; a port picks a diffusers scheduler whose
defaults differ (``timestep_spacing``, ``steps_offset``, Karras sigmas, a flow-match ``shift``, a final sigma
0, the previous timestep a step reads). The UNet is identical on both sides, so ``bisect`` cannot see it.

* :func:`compare_schedules` aligns two timestep / sigma lists and names what differs, with its evidence.
* :func:`fit_scheduler` searches the config keys a scheduler class accepts (read from its ``__init__``) for the
  configs whose ``set_timesteps`` reproduces a reference at the requested step count *and* at other counts
  (a setting that matches at one count only is never proposed), and optionally checks one ``step()`` against
  the reference's own update.
"""

from __future__ import annotations

import inspect
import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.errors import ParityKitError
from paritykit.report import DEFAULT_LIMIT, environment_stamp, format_number, render_table

# timesteps agree within this: integers differ by >= 1, a rounding by 0.5, while fractional timesteps that
# diffusers interpolates in float32 (Karras sigmas mapped back to t) differ from a float64 loop by ~1e-3
TIMESTEP_ATOL = 5e-3
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


# ================================================================================================================
# one side: a schedule
# ================================================================================================================
@dataclass
class Schedule:
    r"""One side's sampling schedule.

    Args:
        source: where it came from (a path, ``"list"``, a scheduler class).
        timesteps: the timestep of each step, or ``None``.
        sigmas: the sigma list, or ``None`` (may hold one more entry than steps: the final sigma).
        integer: the timesteps were stored with an integer dtype.
        generator: ``n -> Schedule`` when the schedule is known for every step count (a SPEC's ``ref_schedule``).
    """

    source: str
    timesteps: list[float] | None = None
    sigmas: list[float] | None = None
    integer: bool = False
    # recorded by record_loop: one value per denoiser call, so the final sigma (never a call's input) is absent
    per_call: bool = False
    generator: Callable[[int], Schedule] | None = field(default=None, repr=False)
    spec: Any = field(default=None, repr=False)

    def get(self, kind: str) -> list[float] | None:
        return self.timesteps if kind == "timesteps" else self.sigmas

    @property
    def steps(self) -> int:
        if self.timesteps is not None:
            return len(_dedupe(self.timesteps))
        sig = _dedupe(self.sigmas or [])
        return len(sig) - 1 if sig and sig[-1] == 0 else len(sig)


def _dedupe(values: Sequence[float]) -> list[float]:
    r"""Consecutive repeats dropped: a second-order scheduler (Heun) lists every timestep but the first twice."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def _floats(value: Any, what: str) -> tuple[list[float], bool]:
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
    from paritykit.spec import call_user, load_spec

    spec = load_spec(path)
    module = spec.module
    if not hasattr(module, "ref_schedule") and not hasattr(module, "ref_step"):
        raise ParityKitError(f"SPEC {str(path)!r}: define ref_schedule(n) (and ref_step for --step-check)")

    def generate(n: int) -> Schedule:
        if not hasattr(module, "ref_schedule"):
            raise ParityKitError(
                f"SPEC {str(path)!r}: define ref_schedule(n) returning the timesteps or sigmas"
            )
        value = call_user(module.ref_schedule, n, what=f"ref_schedule({n})", spec=spec)
        if isinstance(value, dict):
            return _from_mapping(value, str(path))
        ts, integer = _floats(value, f"{path}: ref_schedule({n})")
        return Schedule(str(path), timesteps=ts, integer=integer)

    return Schedule(str(path), generator=generate, spec=spec)


def load_schedule(source: Any) -> Schedule:
    r"""Read one side: a :class:`Schedule`, a list / tensor / array, a dict with ``timesteps`` and/or ``sigmas``,
    or a path: a checkpoint folder (its ``preloop`` checkpoint), a tensor file (``.safetensors``, ``.pt``,
    ``.npy``, …; keys named ``timesteps`` / ``sigmas``, or one bare tensor read as timesteps), a ``.json`` list
    or object, or a SPEC ``.py`` defining ``ref_schedule(n)`` (and ``ref_step`` for a step check)."""
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
        ts, integer = _floats(data, str(path))
        return Schedule(str(path), timesteps=ts, integer=integer and all(isinstance(v, int) for v in data))
    if path.is_dir():
        from paritykit.checkpoints import load_checkpoints

        checkpoints = load_checkpoints(path)
        for name in ("preloop", *checkpoints):
            data = checkpoints[name].data if name in checkpoints else {}
            if any(kind in data for kind in KINDS):
                schedule = _from_mapping(data, f"{path} ({name})")
                schedule.per_call = "recorded_calls" in data
                return schedule
        raise ParityKitError(f"{path}: no checkpoint holds 'timesteps' or 'sigmas' (save them at preloop)")
    from paritykit.io import load_tensors

    tensors = load_tensors(path)
    if len(tensors) == 1 and not any(n.rsplit("/", 1)[-1] in KINDS for n in tensors):
        ((name, value),) = tensors.items()
        ts, integer = _floats(value, str(path))
        if "sigma" in name.lower():
            return Schedule(str(path), sigmas=ts)
        return Schedule(str(path), timesteps=ts, integer=integer)
    return _from_mapping(tensors, str(path))


# ================================================================================================================
# closed-form families a list may follow
# ================================================================================================================
def spacing_lists(n: int, train_steps: int) -> dict[str, list[float]]:
    r"""The timesteps diffusers' ``timestep_spacing`` values give for ``n`` steps (``steps_offset`` 0)."""
    import numpy as np

    ratio = train_steps // n if n else 1
    return {
        "leading": [float(v) for v in (np.arange(n) * ratio)[::-1]],
        "trailing": [float(v) for v in np.round(np.arange(train_steps, 0, -train_steps / n)) - 1],
        "linspace": [float(v) for v in np.linspace(0, train_steps - 1, n)[::-1]],
    }


def _close(a: Sequence[float], b: Sequence[float], kind: str) -> bool:
    if len(a) != len(b):
        return False
    if kind == "timesteps":
        return all(abs(x - y) <= TIMESTEP_ATOL for x, y in zip(a, b))
    return all(abs(x - y) <= SIGMA_ATOL + SIGMA_RTOL * abs(y) for x, y in zip(a, b))


@dataclass
class Family:
    r"""A closed form a list follows; ``generate(n)`` gives the same family at ``n`` steps."""

    name: str
    params: dict[str, float] = field(default_factory=dict)
    generate: Callable[[int], list[float]] | None = field(default=None, repr=False)
    # other closed forms the same list fits equally well (a list of whole numbers may be float linspace)
    alternatives: list[Callable[[int], list[float]]] = field(default_factory=list, repr=False)

    def describe(self) -> str:
        extra = ", ".join(f"{k} {format_number(v)}" for k, v in self.params.items())
        return f"{self.name} ({extra})" if extra else self.name


def timestep_family(ts: Sequence[float], train_steps: int) -> Family | None:
    r"""Which spacing a timestep list follows: exact families first, then one with a constant offset."""
    n = len(ts)
    if n < 2:
        return None
    lists = spacing_lists(n, train_steps)
    integral = all(v == round(v) for v in ts)
    for name, values in lists.items():
        rounded = [float(round(v)) for v in values]
        if _close(ts, values, "timesteps") or _close(ts, rounded, "timesteps"):
            # an integer list is read as the rounded family: at other counts it stays integer
            exact = not integral

            def generate(m: int, name=name, exact=exact) -> list[float]:
                vals = spacing_lists(m, train_steps)[name]
                return vals if exact else [float(round(v)) for v in vals]

            family = Family(
                f"{name} spacing" + ("" if exact or name != "linspace" else ", integer"), {}, generate
            )
            if not exact and name == "linspace":
                family.alternatives.append(lambda m, name=name: spacing_lists(m, train_steps)[name])
            return family
    for name, values in lists.items():
        shift = ts[-1] - values[-1]
        if shift and _close(ts, [v + shift for v in values], "timesteps"):

            def generate(m: int, name=name, shift=shift) -> list[float]:
                return [v + shift for v in spacing_lists(m, train_steps)[name]]

            return Family(f"{name} spacing + offset", {"offset": shift}, generate)
    return None


def _linear_residual(ys: Sequence[float]) -> float:
    r"""Largest deviation of ``ys`` from its least-squares line in the index, as a share of its range."""
    n = len(ys)
    mx = (n - 1) / 2
    my = sum(ys) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    slope = sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sxx
    span = max(ys) - min(ys)
    if span == 0:
        return 0.0
    return max(abs(y - (my + slope * (i - mx))) for i, y in enumerate(ys)) / span


def _golden(f: Callable[[float], float], lo: float, hi: float, iters: int = 60) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(iters):
        c, d = b - g * (b - a), a + g * (b - a)
        if f(c) < f(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def _best(f: Callable[[float], float], grid: Sequence[float]) -> float:
    i = min(range(len(grid)), key=lambda k: f(grid[k]))
    return _golden(f, grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)])


def _shift(u: float, s: float) -> float:
    return s * u / (1 + (s - 1) * u)


def _unshift(sigma: float, s: float) -> float:
    return sigma / (s - (s - 1) * sigma)


def sigma_family(sigmas: Sequence[float]) -> Family | None:
    r"""Karras (with its rho), exponential, or flow-matching (with its fitted shift), else ``None``.

    Trailing zeros are set aside (``final sigma 0``) and regenerated.
    """
    tail = 0
    while tail < len(sigmas) and sigmas[len(sigmas) - 1 - tail] == 0:
        tail += 1
    pos = list(sigmas[: len(sigmas) - tail])
    if len(pos) < 3 or min(pos) <= 0 or any(b >= a for a, b in zip(pos, pos[1:])):
        return None
    zeros = [0.0] * tail
    smax, smin = pos[0], pos[-1]

    def lin(a: float, b: float, m: int) -> list[float]:
        return [a + (b - a) * i / (m - 1) for i in range(m)] if m > 1 else [a]

    if abs(smax - 1) < 1e-5 and smax <= 1 + 1e-5:

        def resid(log_s: float) -> float:
            return _linear_residual([_unshift(p, math.exp(log_s)) for p in pos])

        log_s = _best(resid, [math.log(v) for v in (0.1, 0.3, 0.5, 1, 2, 3, 5, 8, 12, 20, 40)])
        if resid(log_s) <= FAMILY_FIT:
            s = math.exp(log_s)
            s = round(s, 4) if resid(math.log(round(s, 4))) <= FAMILY_FIT else s
            u0, u1 = _unshift(smax, s), _unshift(smin, s)

            def generate(m: int) -> list[float]:
                return [_shift(u, s) for u in lin(u0, u1, m)] + zeros

            name = "flow-matching, shifted" if abs(s - 1) > 1e-3 else "flow-matching, linear"
            return Family(name, {"shift": s}, generate)
    if _linear_residual([math.log(p) for p in pos]) <= FAMILY_FIT:

        def generate(m: int) -> list[float]:
            return [math.exp(v) for v in lin(math.log(smax), math.log(smin), m)] + zeros

        return Family("exponential", {"sigma_min": smin, "sigma_max": smax}, generate)

    def resid_rho(rho: float) -> float:
        return _linear_residual([p ** (1 / rho) for p in pos])

    rho = _best(resid_rho, [1, 2, 3, 4, 5, 6, 7, 8, 10, 14, 20, 30])
    if resid_rho(rho) <= FAMILY_FIT:
        rho = float(round(rho)) if resid_rho(float(round(rho))) <= FAMILY_FIT else rho

        def generate(m: int) -> list[float]:
            a, b = smax ** (1 / rho), smin ** (1 / rho)
            return [v**rho for v in lin(a, b, m)] + zeros

        return Family("Karras", {"rho": rho, "sigma_min": smin, "sigma_max": smax}, generate)
    return None


def family_of(kind: str, values: Sequence[float] | None, train_steps: int) -> Family | None:
    if values is None:
        return None
    values = _dedupe(values)
    return timestep_family(values, train_steps) if kind == "timesteps" else sigma_family(values)


# ================================================================================================================
# comparing two schedules
# ================================================================================================================
@dataclass
class ScheduleHint:
    r"""One explanation of a schedule difference: a stable ``id``, a sentence with its evidence, and the
    scheduler keys that produce it."""

    id: str
    kind: str
    message: str
    keys: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "message": self.message, "keys": self.keys}


@dataclass
class KindComparison:
    kind: str
    a: list[float]
    b: list[float]
    same: bool
    first_difference: int | None
    family_a: Family | None
    family_b: Family | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "same": self.same,
            "count_a": len(self.a),
            "count_b": len(self.b),
            "first_difference": self.first_difference,
            "family_a": self.family_a.describe() if self.family_a else None,
            "family_b": self.family_b.describe() if self.family_b else None,
            "a": self.a,
            "b": self.b,
        }


@dataclass
class ScheduleComparison:
    r"""What ``paritykit schedule REF PORT`` reports: per kind (timesteps, sigmas) the aligned lists, each side's
    closed form where one fits, and hints. ``exit_code`` 0 when every kind both sides hold agrees, else 1."""

    a: str
    b: str
    kinds: list[KindComparison]
    hints: list[ScheduleHint]
    only_one_side: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=environment_stamp)

    @property
    def same(self) -> bool:
        return all(k.same for k in self.kinds)

    @property
    def exit_code(self) -> int:
        return 0 if self.same else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "same": self.same,
            "kinds": [k.to_dict() for k in self.kinds],
            "hints": [h.to_dict() for h in self.hints],
            "only_one_side": self.only_one_side,
            "notes": self.notes,
            "environment": self.environment,
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        lines = [f"A (reference): {self.a}", f"B (port):      {self.b}"]
        for k in self.kinds:
            fa = k.family_a.describe() if k.family_a else "no closed form found"
            fb = k.family_b.describe() if k.family_b else "no closed form found"
            lines += ["", f"{k.kind}: {len(k.a)} vs {len(k.b)} values — A: {fa}; B: {fb}"]
            rows = []
            for i in range(max(len(k.a), len(k.b))):
                va = k.a[i] if i < len(k.a) else None
                vb = k.b[i] if i < len(k.b) else None
                diff = vb - va if va is not None and vb is not None else None
                ok = va is not None and vb is not None and _close([va], [vb], k.kind)
                rows.append([str(i), va, vb, diff, "" if ok else "≠"])
            lines.append(render_table(["i", "A", "B", "B - A", ""], rows, limit=limit))
        for name in self.only_one_side:
            lines.append(f"{name}: held by one side only, not compared")
        lines += [f"note: {n}" for n in self.notes]
        lines.append("")
        if self.same:
            lines.append("same: every schedule both sides hold agrees")
        else:
            lines.append("differ:")
            lines += [f"  [{h.id}] {h.message}" for h in self.hints] or [
                "  unknown cause: not reversed, not a constant offset, not a count or int/float difference"
            ]
        return "\n".join(lines)


def _first_difference(a: list[float], b: list[float], kind: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if not _close([x], [y], kind):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _hints_for(k: KindComparison, int_a: bool, int_b: bool) -> list[ScheduleHint]:
    a, b, kind = k.a, k.b, k.kind
    hints: list[ScheduleHint] = []
    if len(a) == len(b) and len(a) > 1 and _close(a[::-1], b, kind):
        return [
            ScheduleHint(
                "reversed",
                kind,
                f"B is A in reverse order ({format_number(a[0])} … "
                f"{format_number(a[-1])} vs {format_number(b[0])} … {format_number(b[-1])}).",
            )
        ]
    if kind == "timesteps" and len(a) == len(b) and int_a != int_b:
        ints, floats, side = (a, b, "A") if int_a else (b, a, "B")
        if [round(v) for v in floats] == [round(v) for v in ints] and any(v != round(v) for v in floats):
            other = "B" if side == "A" else "A"
            return [
                ScheduleHint(
                    "int-vs-float",
                    kind,
                    f"{side} holds integer timesteps, {other} float ones that "
                    f"round to them (first at step {k.first_difference}): one side rounds or casts "
                    "the linspace schedule.",
                    ["timestep_spacing"],
                )
            ]
    if len(a) != len(b):
        short, long_, s_name, l_name = (a, b, "A", "B") if len(a) < len(b) else (b, a, "B", "A")
        extra = long_[len(short) :]
        if _close(short, long_[: len(short)], kind):
            if kind == "sigmas" and all(v == 0 for v in extra):
                hints.append(
                    ScheduleHint(
                        "final-sigma-zero",
                        kind,
                        f"{l_name} appends a final sigma 0 that "
                        f"{s_name} lacks ({s_name} ends at {format_number(short[-1])}): the last "
                        "step goes to 0 on one side only.",
                        ["final_sigmas_type"],
                    )
                )
            else:
                hints.append(
                    ScheduleHint(
                        "extra-step",
                        kind,
                        f"{l_name} has {len(extra)} extra final "
                        f"value(s) ({', '.join(format_number(v) for v in extra)}) after "
                        f"{len(short)} identical ones.",
                        ["num_inference_steps"],
                    )
                )
        else:
            hints.append(
                ScheduleHint(
                    "count",
                    kind,
                    f"A has {len(a)} values, B {len(b)}: a different step count or a different final step.",
                )
            )
    elif len(a) > 1:
        diffs = [y - x for x, y in zip(a, b)]
        c = sum(diffs) / len(diffs)
        tol = TIMESTEP_ATOL if kind == "timesteps" else SIGMA_ATOL + SIGMA_RTOL * max(map(abs, a))
        if abs(c) > tol and all(abs(d - c) <= tol for d in diffs):
            sign = "+" if c > 0 else "−"
            keys = ["timestep_spacing", "steps_offset"] if kind == "timesteps" else []
            where = f" (scheduler keys that shift a timestep list: {OFFSET_KEYS})" if keys else ""
            hints.append(
                ScheduleHint(
                    "offset", kind, f"B ≈ A {sign} {format_number(abs(c))} at every step{where}.", keys
                )
            )
    fa, fb = k.family_a, k.family_b
    if fa is not None or fb is not None:
        da = fa.describe() if fa else "no closed form found"
        db = fb.describe() if fb else "no closed form found"
        if da != db:
            keys = (
                ["timestep_spacing", "steps_offset"]
                if kind == "timesteps"
                else [
                    "use_karras_sigmas",
                    "use_exponential_sigmas",
                    "shift",
                    "flow_shift",
                    "final_sigmas_type",
                ]
            )
            hints.append(
                ScheduleHint(
                    "spacing" if kind == "timesteps" else "sigma-family",
                    kind,
                    f"A follows {da}; B follows {db}.",
                    keys,
                )
            )
    return hints


def compare_schedules(a: Any, b: Any, num_train_timesteps: int = 1000) -> ScheduleComparison:
    r"""Compare two schedules (anything :func:`load_schedule` reads), reference first.

    Args:
        a: the reference's schedule.
        b: the port's schedule.
        num_train_timesteps: the training schedule's length, used to recognise ``leading`` / ``trailing`` /
            ``linspace`` spacing.

    Returns:
        A :class:`ScheduleComparison` (exit code 0 same, 1 differ).

    Raises:
        ParityKitError: the two sides share neither timesteps nor sigmas.
    """
    sa, sb = load_schedule(a), load_schedule(b)
    for s in (sa, sb):
        if s.generator is not None:
            raise ParityKitError(f"{s.source}: a SPEC gives a schedule per step count; use it with --fit")
    kinds, only, notes = [], [], []
    for kind in KINDS:
        va, vb = sa.get(kind), sb.get(kind)
        if va is None and vb is None:
            continue
        if va is None or vb is None:
            only.append(kind)
            continue
        for side, short, other in (("A", sa, vb), ("B", sb, va)):
            mine = short.get(kind)
            if kind == "sigmas" and short.per_call and len(other) == len(mine) + 1 and other[-1] == 0:
                # a recorded loop never sees the sigma its last step goes to: compare what both sides hold
                va, vb = va[: len(mine)], vb[: len(mine)]
                notes.append(f"{side} was recorded per denoiser call, so its final sigma is unknown; the other "
                             "side's final 0 is not compared")  # fmt: skip
        first = _first_difference(va, vb, kind)
        kinds.append(
            KindComparison(
                kind,
                va,
                vb,
                first is None,
                first,
                family_of(kind, va, num_train_timesteps),
                family_of(kind, vb, num_train_timesteps),
            )  # fmt: skip
        )
    if not kinds:
        raise ParityKitError(
            f"{sa.source} and {sb.source} share no schedule: one holds only timesteps, the other only sigmas"
        )
    hints = [h for k in kinds if not k.same for h in _hints_for(k, sa.integer, sb.integer)]
    return ScheduleComparison(sa.source, sb.source, kinds, hints, only, notes)


# ================================================================================================================
# fitting a scheduler config
# ================================================================================================================
def resolve_scheduler(cls: Any) -> type:
    r"""A diffusers scheduler class from itself or its name (``"DDIMScheduler"``)."""
    if isinstance(cls, type):
        return cls
    import diffusers

    try:
        found = getattr(diffusers, str(cls), None)
    except (ImportError, AttributeError):
        found = None
    if isinstance(found, type) and "dummy" in found.__module__:
        raise ParityKitError(
            f"--fit {cls}: diffusers needs an optional package for it (scipy: pip install scipy)"
        )
    if not isinstance(found, type) or not hasattr(found, "set_timesteps"):
        raise ParityKitError(f"--fit {cls!r}: not a diffusers scheduler class (e.g. DDIMScheduler)")
    return found


def accepted_keys(cls: type) -> dict[str, Any]:
    r"""The config keys ``cls.__init__`` accepts, with their defaults."""
    params = inspect.signature(cls.__init__).parameters
    keys = {n: p.default for n, p in params.items() if n != "self" and p.kind == p.POSITIONAL_OR_KEYWORD}
    if not keys:
        raise ParityKitError(
            f"{cls.__name__}: cannot read its config keys (diffusers may need an optional package for it, "
            "e.g. scipy for LMSDiscreteScheduler)"
        )
    return keys


def _scheduler_lists(scheduler: Any, n: int) -> dict[str, list[float]]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler.set_timesteps(n)
    out = {"timesteps": [float(v) for v in scheduler.timesteps.double().tolist()]}
    sigmas = getattr(scheduler, "sigmas", None)
    if sigmas is not None and hasattr(sigmas, "tolist"):
        out["sigmas"] = [float(v) for v in sigmas.double().tolist()]
    return out


def _make(cls: type, config: dict[str, Any]) -> Any:
    # keys are filtered to those __init__ accepts, so the constructor is enough (from_config re-reads the
    # signature for every key: 10x slower over a search)
    import logging

    logger = logging.getLogger("diffusers.configuration_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return cls(**config)
    finally:
        logger.setLevel(level)


def _matches(ref: Schedule, got: dict[str, list[float]]) -> tuple[bool, str]:
    compared = 0
    for kind in KINDS:
        want = ref.get(kind)
        if want is None or kind not in got:
            continue
        have = got[kind]
        if len(have) != len(want) and len(_dedupe(have)) != len(have):
            have, want = _dedupe(have), _dedupe(want)  # one model call per list entry vs per step
        if kind == "sigmas" and len(have) == len(want) + 1:
            have = have[: len(want)]  # a recorded loop sees no final sigma
        compared += 1
        if not _close(have, want, kind):
            first = _first_difference(have, want, kind)
            return False, f"{kind} differ from step {first}"
    return (compared > 0), "" if compared else "nothing comparable"


def _format_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def ready_line(cls_name: str, changes: dict[str, Any]) -> str:
    args = "".join(f", {k}={_format_value(v)}" for k, v in changes.items())
    return f"{cls_name}.from_config(pipe.scheduler.config{args})"


@dataclass
class Candidate:
    r"""A config change (relative to the base config) and how it fared."""

    changes: dict[str, Any]
    counts_matched: list[int] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)
    step_check: StepCheck | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "changes": self.changes,
            "counts_matched": self.counts_matched,
            "failures": {str(k): v for k, v in self.failures.items()},
            "step_check": self.step_check.to_dict() if self.step_check else None,
        }


@dataclass
class StepCheck:
    r"""One ``step()`` of the scheduler against the reference's update, given the same model output."""

    matched: bool
    steps_checked: int
    first_failing_step: int | None = None
    max_abs: float | None = None
    quantity: str | None = None
    reference_value: float | None = None
    scheduler_value: float | None = None
    explanation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class FitResult:
    r"""What ``paritykit schedule REF --fit CLASS`` reports.

    ``fits`` hold the configs whose lists match at every count checked (and whose step matches, when checked);
    ``rejected`` the ones that matched at the requested count but not at another, or whose step differs.
    ``exit_code`` 0 when a fit was found, else 1.
    """

    scheduler: str
    steps: int
    counts: list[int]
    reference: str
    reference_families: dict[str, str]
    fits: list[Candidate]
    rejected: list[Candidate]
    searched: int
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    step_checked: bool = False
    environment: dict[str, Any] = field(default_factory=environment_stamp)

    @property
    def exit_code(self) -> int:
        return 0 if self.fits else 1

    @property
    def line(self) -> str | None:
        return ready_line(self.scheduler, self.fits[0].changes) if self.fits else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "steps": self.steps,
            "counts": self.counts,
            "reference": self.reference,
            "reference_families": self.reference_families,
            "fit": self.line,
            "fits": [c.to_dict() for c in self.fits],
            "rejected": [c.to_dict() for c in self.rejected],
            "searched": self.searched,
            "warnings": self.warnings,
            "notes": self.notes,
            "step_checked": self.step_checked,
            "environment": self.environment,
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        lines = [f"reference: {self.reference} ({self.steps} steps)"]
        lines += [f"  {k}: {v}" for k, v in self.reference_families.items()]
        lines.append(
            f"searched {self.searched} configs of {self.scheduler}; step counts checked: "
            + ", ".join(map(str, self.counts))
        )
        rows = []
        for c in [*self.fits, *self.rejected]:
            status = "fits" if c in self.fits else "rejected"
            why = "; ".join(f"at {n}: {w}" for n, w in c.failures.items())
            if c.step_check is not None and not c.step_check.matched:
                why = "; ".join(filter(None, [why, c.step_check.explanation]))
            rows.append(
                [
                    status,
                    ", ".join(f"{k}={_format_value(v)}" for k, v in c.changes.items()) or "(base)",
                    ",".join(map(str, c.counts_matched)),
                    why,
                ]
            )
        if rows:
            lines.append(render_table(["", "config change", "matches at", "why not"], rows, limit=limit))
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        if self.line:
            lines.append(f"fix: {self.line}")
        else:
            lines.append(f"no config of {self.scheduler} reproduces the reference")
        return "\n".join(lines)


# --- the search space: known keys, each with its bounded set of values -----------------------------------------
_SIGMA_TYPE_KEYS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


def _axes(keys: dict[str, Any], base: dict[str, Any], ref: Schedule, offsets: set[float]) -> list[list[dict]]:
    r"""Each axis is a list of alternative partial configs; a candidate takes one entry per axis."""

    def now(key: str) -> Any:
        return base.get(key, keys.get(key))

    axes: list[list[dict]] = []
    if "timestep_spacing" in keys:
        axes.append([{"timestep_spacing": v} for v in ("leading", "trailing", "linspace")])
    if "steps_offset" in keys:
        values = sorted({int(now("steps_offset") or 0), 0, 1, *(int(o) for o in offsets if o == int(o))})
        axes.append([{"steps_offset": v} for v in values])
    types = [k for k in _SIGMA_TYPE_KEYS if k in keys]
    if types:
        axes.append([{k: False for k in types}] + [{k: k == t for k in types} for t in types])
    if "final_sigmas_type" in keys:
        axes.append([{"final_sigmas_type": v} for v in ("zero", "sigma_min")])
    if "rescale_betas_zero_snr" in keys:
        axes.append([{"rescale_betas_zero_snr": v} for v in (False, True)])
    fam = sigma_family(ref.sigmas) if ref.sigmas else None
    fitted = fam.params.get("shift") if fam is not None and fam.name.startswith("flow") else None
    for key in ("shift", "flow_shift"):
        if key in keys:
            axes.append([{key: v} for v in dict.fromkeys([now(key), 1.0, *([fitted] if fitted else [])])])
    if "use_flow_sigmas" in keys and fitted is not None:
        axes.append([{"use_flow_sigmas": v} for v in (False, True)])
    if ref.sigmas and fam is not None and fam.name in ("Karras", "exponential"):
        for key, value in (("sigma_min", fam.params["sigma_min"]), ("sigma_max", fam.params["sigma_max"])):
            if key in keys:
                axes.append([{key: v} for v in dict.fromkeys([now(key), value])])
    if now("use_dynamic_shifting"):
        axes.append([{"use_dynamic_shifting": False}])  # set_timesteps would need `mu` from the pipeline
    return axes


def _changes(candidate: dict[str, Any], keys: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in candidate.items() if base.get(k, keys.get(k)) != v}


def _validation_counts(steps: int, train_steps: int) -> list[int]:
    others = [c for c in OTHER_COUNTS if c != steps][:3]
    if all(train_steps % c == 0 for c in others):
        others.append(next(c for c in range(7, 100) if train_steps % c and c != steps))
    return [steps, *others]


def _reference_at(
    ref: Schedule, n: int, families: dict[str, Callable[[int], list[float]]]
) -> Schedule | None:
    if ref.generator is not None:
        return ref.generator(n)
    if n == ref.steps:
        return ref
    if not families:
        return None
    out = Schedule(ref.source)
    for kind, generate in families.items():
        values = generate(n)
        if kind == "timesteps":
            out.timesteps = values
        else:
            out.sigmas = values
    return out


def fit_scheduler(
    cls: Any,
    reference: Any,
    steps: int | None = None,
    base_config: dict[str, Any] | str | Path | None = None,
    step_check: Any = None,
) -> FitResult:
    r"""Search ``cls``'s config for the settings whose ``set_timesteps`` reproduces ``reference``.

    Only keys the class accepts are searched, each over a small set of values (``timestep_spacing``,
    ``steps_offset``, Karras / exponential / beta sigmas, ``final_sigmas_type``, ``rescale_betas_zero_snr``,
    ``shift`` / ``flow_shift`` with the shift fitted from the reference, ``sigma_min`` / ``sigma_max``). A
    config that matches at ``steps`` is then checked at three or more other counts (some not dividing
    ``num_train_timesteps``): the reference at those counts comes from a SPEC's ``ref_schedule(n)``, or from the
    closed form the reference's list follows (spacing, Karras, exponential, shifted flow matching).

    Args:
        cls: a diffusers scheduler class or its name.
        reference: anything :func:`load_schedule` reads.
        steps: the step count (default: the reference's).
        base_config: the port's scheduler config (dict or JSON file); changes are reported relative to it.
        step_check: also verify ``step()``: a SPEC ``.py`` with ``ref_step(x, eps, t, t_prev)``, or a checkpoint
            folder with the reference's per-step latents and model output; ``True`` uses the reference SPEC.

    Returns:
        A :class:`FitResult`; ``line`` is the ready fix, e.g.
        ``DDIMScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")``.
    """
    cls = resolve_scheduler(cls)
    keys = accepted_keys(cls)
    base = _load_base(base_config)
    base = {k: v for k, v in base.items() if k in keys}
    train_steps = int(base.get("num_train_timesteps", keys.get("num_train_timesteps") or 1000))
    ref = load_schedule(reference)
    if steps is None:
        if ref.generator is not None:
            raise ParityKitError(f"{ref.source}: give --steps N (a SPEC's schedule depends on the count)")
        steps = ref.steps
    if steps < 2:
        raise ParityKitError(f"--steps {steps}: need at least 2 steps")
    ref_n = _reference_at(ref, steps, {})
    if ref_n is None or ref_n.steps != steps:
        raise ParityKitError(f"{ref.source}: holds {ref.steps} steps, not --steps {steps}")
    families = {
        kind: fam for kind in KINDS if (fam := family_of(kind, ref_n.get(kind), train_steps)) is not None
    }
    notes = []
    if ref.generator is None and not families:
        notes.append("the reference follows no known closed form: configs are checked at its own count only")
    counts = _validation_counts(steps, train_steps) if (ref.generator or families) else [steps]

    base_lists = _safe_lists(cls, base, steps)
    if base_lists is not None and not any(ref_n.get(k) is not None and k in base_lists for k in KINDS):
        raise ParityKitError(
            f"{ref.source}: holds only {', '.join(k for k in KINDS if ref_n.get(k) is not None)}, which "
            f"{cls.__name__} does not expose; nothing to compare"
        )
    offsets = set()
    if base_lists and ref_n.timesteps and len(base_lists["timesteps"]) == steps:
        d = [r - p for r, p in zip(ref_n.timesteps, base_lists["timesteps"])]
        if max(d) - min(d) <= TIMESTEP_ATOL:
            offsets.add(round(d[0]))
    axes = _axes(keys, base, ref_n, offsets)
    seen: dict[str, Candidate] = {}
    matched_here: list[Candidate] = []
    for combo in itertools.product(*axes):
        config = {k: v for part in combo for k, v in part.items()}
        changes = _changes(config, keys, base)
        tag = json.dumps(changes, sort_keys=True, default=str)
        if tag in seen:
            continue
        cand = seen[tag] = Candidate(changes)
        ok, why = _try(cls, {**base, **config}, ref_n, steps)
        if ok:
            cand.counts_matched.append(steps)
            matched_here.append(cand)
    fits, rejected = [], []
    variants = [
        dict(zip(families, gens))
        for gens in itertools.product(*([f.generate, *f.alternatives] for f in families.values()))
    ]
    for cand in sorted(matched_here, key=lambda c: len(c.changes)):
        for variant in variants or [{}]:  # the candidate must follow one reading of REF at every count
            cand.counts_matched, cand.failures = [steps], {}
            for n in counts[1:]:
                ok, why = _try(cls, {**base, **cand.changes}, _reference_at(ref, n, variant), n)
                if ok:
                    cand.counts_matched.append(n)
                else:
                    cand.failures[n] = why
            if not cand.failures:
                break
        (rejected if cand.failures else fits).append(cand)
    fits = _minimal(fits)
    result = FitResult(
        cls.__name__, steps, counts, ref.source,
        {k: f.describe() for k, f in families.items()}, fits, rejected[:10], len(seen), notes=notes,
    )  # fmt: skip
    if step_check is not None and step_check is not False:
        _run_step_check(result, cls, base, keys, ref, ref_n, steps, step_check, train_steps)
    return result


def _load_base(base_config: Any) -> dict[str, Any]:
    if base_config is None:
        return {}
    if isinstance(base_config, dict):
        return dict(base_config)
    from paritykit.configs import load_config

    loaded = load_config(base_config)
    return dict(loaded if isinstance(loaded, dict) else getattr(loaded, "config", loaded))


def _safe_lists(cls: type, config: dict[str, Any], n: int) -> dict[str, list[float]] | None:
    try:
        return _scheduler_lists(_make(cls, config), n)
    except Exception:
        return None


def _try(cls: type, config: dict[str, Any], ref: Schedule | None, n: int) -> tuple[bool, str]:
    if ref is None:
        return False, "reference unknown at this count"
    try:
        got = _scheduler_lists(_make(cls, config), n)
    except Exception as exc:  # a config that crashes at some count is exactly what must never be proposed
        return False, f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    return _matches(ref, got)


def _minimal(fits: list[Candidate]) -> list[Candidate]:
    r"""Drop a fit whose changes include another fit's changes: the extra keys change nothing here."""
    kept = []
    for c in fits:
        items = set(map(str, c.changes.items()))
        if not any(o is not c and set(map(str, o.changes.items())) < items for o in fits):
            kept.append(c)
    return kept


# --- step check --------------------------------------------------------------------------------------------------
def _ddim_like(cls: type, keys: dict[str, Any]) -> bool:
    return "set_alpha_to_one" in keys


def _reference_updates(ref: Schedule, ref_n: Schedule, steps: int, source: Any, shape=(1, 4, 8, 8)):
    r"""Yield ``(i, x, eps, x_next)`` of the reference loop: from a SPEC's ``ref_step`` on seeded random
    tensors, or from a checkpoint folder (``preloop``/``after_step_{i}`` latents + model output, or a
    ``record_loop`` folder's ``step_{i}`` sample/output)."""
    import torch

    from paritykit.spec import call_user

    spec = ref.spec
    if source is not True and isinstance(source, (str, Path)) and Path(source).suffix == ".py":
        spec = load_schedule(source).spec
    if spec is not None:
        if not hasattr(spec.module, "ref_step"):
            raise ParityKitError(f"SPEC {spec.path}: define ref_step(x, eps, t, t_prev) for --step-check")
        values = ref_n.timesteps if ref_n.timesteps is not None else ref_n.sigmas
        gen = torch.Generator().manual_seed(0)
        for i in range(steps):
            x = torch.randn(shape, generator=gen, dtype=torch.float64)
            eps = torch.randn(shape, generator=gen, dtype=torch.float64)
            t_prev = values[i + 1] if i + 1 < len(values) else None
            out = call_user(spec.module.ref_step, x.clone(), eps.clone(), values[i], t_prev,
                            what=f"ref_step at step {i}", spec=spec)  # fmt: skip
            yield i, x.float(), eps.float(), torch.as_tensor(out).float()
        return
    if source is True or not Path(source).is_dir():
        raise ParityKitError(
            "--step-check: give a SPEC .py with ref_step, or the reference's checkpoint folder"
        )
    from paritykit.checkpoints import load_checkpoints

    ck = load_checkpoints(source)
    outputs = ("noise_pred", "model_output", "output", "eps")

    def pick(data: dict, names: Sequence[str]) -> Any:
        return next((data[n] for n in names if n in data), None)

    if "after_step_0" in ck:
        x = pick(ck.get("preloop", {}).data if "preloop" in ck else {}, ("latents", "sample"))
        for i in range(steps):
            data = ck.get(f"after_step_{i}")
            if data is None or x is None:
                return
            eps, nxt = pick(data.data, outputs), pick(data.data, ("latents", "sample"))
            if eps is None or nxt is None:
                raise ParityKitError(f"{source}: after_step_{i} needs the latents and the model output "
                                     f"({', '.join(outputs)})")  # fmt: skip
            yield i, x.float(), eps.float(), nxt.float()
            x = nxt
        return
    for i in range(steps - 1):
        a, b = ck.get(f"step_{i}"), ck.get(f"step_{i + 1}")
        if a is None or b is None:
            return
        yield i, a.data["sample"].float(), a.data["output"].float(), b.data["sample"].float()


def _implied(kind: str, x, eps, nxt, alpha_t: float | None) -> tuple[float, float]:
    r"""The one number an update depends on — the previous alpha (DDIM-like) or sigma_next - sigma — and the
    share of the update that reading leaves unexplained (large: the update is not of that form at all)."""
    import torch

    if kind == "previous alpha":
        x0 = (x - (1 - alpha_t) ** 0.5 * eps) / alpha_t**0.5
        basis = torch.stack([x0.reshape(-1), eps.reshape(-1)], 1).double()
        target = nxt.reshape(-1, 1).double()
        coef = torch.linalg.lstsq(basis, target).solution
        resid = float((basis @ coef - target).norm() / target.norm().clamp_min(1e-30))
        p, q = (float(v) for v in coef.reshape(-1))
        resid = max(resid, abs(p * p + q * q - 1))  # sqrt(a)² + sqrt(1 - a)² must be 1
        return p * p, resid
    d = eps.reshape(-1).double()
    step = (nxt - x).reshape(-1).double()
    dt = float((step @ d) / (d @ d))
    return dt, float((step - dt * d).norm() / step.norm().clamp_min(1e-30))


def _check_one(cls: type, config: dict[str, Any], steps: int, updates: list, keys: dict) -> StepCheck:
    scheduler = _make(cls, config)
    scheduler.set_timesteps(steps)
    alpha_based = getattr(scheduler, "sigmas", None) is None and hasattr(scheduler, "alphas_cumprod")
    quantity = "previous alpha" if alpha_based else "sigma_next - sigma"
    checked = 0
    for i, x, eps, nxt in updates:
        t = scheduler.timesteps[i]
        kwargs = {"eta": 0.0} if "eta" in inspect.signature(scheduler.step).parameters else {}
        if hasattr(scheduler, "scale_model_input") and not alpha_based:
            scheduler.scale_model_input(x, t)  # marks the input as scaled; the step itself reads x as given
        out = scheduler.step(eps, t, x, return_dict=False, **kwargs)[0]
        checked += 1
        err = float((out - nxt).abs().max())
        if err <= 1e-4 * max(1.0, float(nxt.abs().max())):
            continue
        alpha_t = float(scheduler.alphas_cumprod[int(t)]) if alpha_based else None
        ref_v, ref_r = _implied(quantity, x, eps, nxt, alpha_t)
        port_v, port_r = _implied(quantity, x, eps, out, alpha_t)
        head = f"the lists match, the update at step {i} (t={format_number(float(t))}) does not (max_abs {format_number(err)})"
        if max(ref_r, port_r) > 1e-3:
            # one number cannot account for it: say so instead of naming a quantity that is not the cause
            return StepCheck(False, checked, i, err, None, None, None,
                             f"{head}; the two updates differ in form, not by one {quantity} (unexplained "
                             f"share {format_number(max(ref_r, port_r))}): compare the step rules themselves "
                             "(solver, x0 clipping, prediction_type)")  # fmt: skip
        where = ""
        if alpha_based:
            ac = scheduler.alphas_cumprod.double()

            def at(v: float, ac=ac) -> str:
                if abs(v - 1) < 1e-4:
                    return "1 (final alpha)"
                j = int((ac - v).abs().argmin())
                return f"ᾱ[t={j}]" if abs(float(ac[j]) - v) <= 1e-3 * v else "no training timestep"

            where = f" — reference ≈ {at(ref_v)}, {cls.__name__} ≈ {at(port_v)}"
        return StepCheck(
            False, checked, i, err, quantity, ref_v, port_v,
            f"{head}: {quantity} {format_number(ref_v)} (reference) vs {format_number(port_v)} "
            f"({cls.__name__}){where}",
        )  # fmt: skip
    return StepCheck(True, checked)


def _recorded_inputs_are_scaled(cls: type, base: dict[str, Any], steps: int, source: Any) -> bool:
    import torch

    if source is True or not isinstance(source, (str, Path)) or not Path(source).is_dir():
        return False
    from paritykit.io import read_manifest

    names = {entry.get("name") for entry in read_manifest(Path(source))["checkpoints"]}
    if "step_0" not in names or "after_step_0" in names:
        return False
    scheduler = _make(cls, base)
    if not hasattr(scheduler, "scale_model_input"):
        return False
    scheduler.set_timesteps(steps)
    x = torch.ones(1, 1, 2, 2)
    return not torch.equal(scheduler.scale_model_input(x, scheduler.timesteps[0]), x)


def _run_step_check(result: FitResult, cls, base, keys, ref, ref_n, steps, source, train_steps) -> None:
    result.step_checked = True
    if "Ancestral" in cls.__name__ or cls.__name__.startswith(("Heun", "KDPM2")):
        result.notes.append(f"--step-check: {cls.__name__} is not checked (a stochastic or two-call step); "
                            "schedule only")  # fmt: skip
        return
    if _ddim_like(cls, keys) and train_steps % steps:
        result.warnings.append(
            f"{cls.__name__} steps back by the fixed stride {train_steps}//{steps} = {train_steps // steps} "
            f"(num_train_timesteps {train_steps} is not a multiple of {steps}): its previous timestep is not "
            "the next entry of its own list"
        )
    if _recorded_inputs_are_scaled(cls, base, steps, source):
        result.notes.append(
            f"--step-check: {cls.__name__} scales the denoiser's input (scale_model_input), so a record_loop "
            "folder holds scaled samples, not the loop's latents; check with a SPEC's ref_step or the pipeline's "
            "after_step_<i> checkpoints instead"
        )
        return
    updates = list(_reference_updates(ref, ref_n, steps, source))
    if not updates:
        result.notes.append("--step-check: no reference update found to check against")
        return
    # keys that change the update but not the lists, each with its bounded values
    step_axes = [[{k: v} for v in (False, True)] for k in ("set_alpha_to_one", "clip_sample") if k in keys]
    extra = [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*step_axes)]
    extra.sort(key=lambda more: len(_changes(more, keys, base)))
    good, bad = [], []
    for cand in result.fits:
        checks = []
        for more in extra:
            config = {**base, **cand.changes, **more}
            check = _check_one(cls, config, steps, updates, keys)
            checks.append((more, check))
            if check.matched:
                break
        more, check = next(((m, c) for m, c in checks if c.matched), checks[0])
        cand.changes.update(_changes(more, keys, base))
        cand.step_check = check
        (good if check.matched else bad).append(cand)
    result.fits = good
    result.rejected = bad + result.rejected
    if bad and not good:
        first = bad[0].step_check
        result.notes.append(
            f"no config of {cls.__name__} reproduces the reference's step: {first.explanation}"
        )
