r"""Scheduler parity: compare two sampling schedules, and find the diffusers scheduler config that reproduces
one.

A research loop writes its own timestep list and sigma formula; a port picks a diffusers scheduler whose
defaults differ (``timestep_spacing``, ``steps_offset``, Karras sigmas, a flow-match ``shift``, a final sigma
0, the previous timestep a step reads). The UNet is identical on both sides, so ``bisect`` cannot see it.

* :func:`compare_schedules` aligns two timestep / sigma lists and names what differs, with its evidence.
* :func:`fit_scheduler` searches the config keys a scheduler class accepts (read from its ``__init__``) for
  the configs whose ``set_timesteps`` reproduces a reference at the requested step count *and* at other counts
  (a setting that matches at one count only is never proposed), and optionally checks one ``step()`` against
  the reference's own update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, format_number, render_table
from paritykit.schedule.families import Family, family_of, lists_close
from paritykit.schedule.load import (
    KINDS,
    OFFSET_KEYS,
    SIGMA_ATOL,
    SIGMA_RTOL,
    load_schedule,
    timestep_atol,
)


# ============================================================================================================
# comparing two schedules
# ============================================================================================================
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
    r"""What ``paritykit schedule REF PORT`` reports: per kind (timesteps, sigmas) the aligned lists, each
    side's closed form where one fits, and hints. ``exit_code`` 0 when every kind both sides hold agrees, else
    1."""

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
                ok = va is not None and vb is not None and lists_close([va], [vb], k.kind, like=k.b)
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
                "  unknown cause: not reversed, not a constant offset, not a count or int/float difference,"
                " and neither side follows a closed form that would name the difference"
            ]
        return "\n".join(lines)


def first_list_difference(a: list[float], b: list[float], kind: str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if not lists_close([x], [y], kind, like=b):
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _hints_for(k: KindComparison, int_a: bool, int_b: bool) -> list[ScheduleHint]:
    a, b, kind = k.a, k.b, k.kind
    hints: list[ScheduleHint] = []
    if len(a) == len(b) and len(a) > 1 and lists_close(a[::-1], b, kind):
        return [
            ScheduleHint(
                "reversed",
                kind,
                f"B is A in reverse order ({format_number(a[0])} … "
                f"{format_number(a[-1])} vs {format_number(b[0])} … {format_number(b[-1])}).",
            )
        ]
    # integers by dtype, or by value: a float list of whole numbers against one with fractions
    int_a = int_a or (kind == "timesteps" and all(v == round(v) for v in a))
    int_b = int_b or (kind == "timesteps" and all(v == round(v) for v in b))
    if kind == "timesteps" and len(a) == len(b) and int_a != int_b:
        ints, floats, side = (a, b, "A") if int_a else (b, a, "B")
        if all(abs(f - i) <= 0.5 for f, i in zip(floats, ints)) and any(v != round(v) for v in floats):
            other = "B" if side == "A" else "A"
            return [
                ScheduleHint(
                    "int-vs-float",
                    kind,
                    f"{side} holds whole-number timesteps, {other} fractional ones that round to them (first"
                    f" at step {k.first_difference}: {format_number(floats[k.first_difference or 0], 6)} vs"
                    f" {format_number(ints[k.first_difference or 0], 6)}): one side rounds the timesteps it"
                    " feeds the model (or casts them to an integer dtype).",
                    ["timestep_spacing"],
                )
            ]
    if len(a) != len(b):
        short, long_, s_name, l_name = (a, b, "A", "B") if len(a) < len(b) else (b, a, "B", "A")
        extra = long_[len(short) :]
        if lists_close(short, long_[: len(short)], kind):
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
                    f"A has {len(a)} values, B {len(b)}; neither is the other with values added at its end.",
                )
            )
    elif len(a) > 1:
        diffs = [y - x for x, y in zip(a, b)]
        c = sum(diffs) / len(diffs)
        tol = timestep_atol(a) if kind == "timesteps" else SIGMA_ATOL + SIGMA_RTOL * max(map(abs, a))
        if abs(c) > tol and all(abs(d - c) <= tol for d in diffs):
            sign = "+" if c > 0 else "−"
            keys = ["timestep_spacing", "steps_offset"] if kind == "timesteps" else []
            where = f" (scheduler keys that shift a timestep list: {OFFSET_KEYS})" if keys else ""
            hints.append(
                ScheduleHint(
                    "offset", kind, f"B ≈ A {sign} {format_number(abs(c))} at every step{where}.", keys
                )
            )
        else:
            units = _units(a, b, kind)
            if units is not None:
                hints.append(units)
    fa, fb = k.family_a, k.family_b
    twice = _shift_twice(fa, fb)
    if twice is not None:
        hints.append(twice)
    elif (fa is not None or fb is not None) and not any(h.id == "units" for h in hints):
        # (two lists in other units are not two closed forms to set side by side)
        da = fa.describe() if fa else "no closed form found"
        db = fb.describe() if fb else "no closed form found"
        if da == db and not hints:
            hints.append(_parameters_differ(fa, fb, k))
        elif da != db:
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
                    f"A follows {da}; B follows {db}." + _differing_parameters(fa, fb),
                    keys,
                )
            )
    return hints


# the scale between timesteps in [0, 1] and in [0, 1000) / [0, 1000], either way round
_UNIT_SCALES = (1000.0, 999.0, 1 / 1000, 1 / 999)


def _units(a: list[float], b: list[float], kind: str) -> ScheduleHint | None:
    r"""``B = s·A + c`` at every step (least squares, every residual within tolerance) with ``s`` a unit
    change (±1000 or ±999, or their inverses) and ``c`` none or the range's end: one schedule in other units
    (a timestep in [0, 1] against [0, 1000], or ``1000 - t``); ``None`` otherwise. Any two evenly spaced lists
    are some affine map of each other (linspace against trailing spacing): only a unit change says "units"."""
    n = len(a)
    mean_a, mean_b = sum(a) / n, sum(b) / n
    var = sum((x - mean_a) ** 2 for x in a)
    if var == 0:
        return None
    s = sum((x - mean_a) * (y - mean_b) for x, y in zip(a, b)) / var
    c = mean_b - s * mean_a
    base = timestep_atol(b) if kind == "timesteps" else SIGMA_ATOL
    tol = max(base, SIGMA_RTOL * max(map(abs, b)))
    unit = any(abs(abs(s) - u) <= 1e-3 * u for u in _UNIT_SCALES)
    end = any(abs(abs(c) - e) <= tol for e in (0.0, 1.0, 999.0, 1000.0))
    if not (unit and end) or any(abs(s * x + c - y) > tol for x, y in zip(a, b)):
        return None
    offset = "" if abs(c) <= tol else f" {'+' if c > 0 else '−'} {format_number(abs(c))}"
    return ScheduleHint(
        "units",
        kind,
        f"B = {format_number(s)} × A{offset} at every step (within {format_number(tol)}): the same values"
        " in other units.",
    )


def _differing_parameters(fa: Family | None, fb: Family | None) -> str:
    r"""Two closed forms of one family (flow matching shifted by 3 against 1): the parameters that differ and
    the ones that agree, so the fix is one setting."""
    if fa is None or fb is None or fa.name.split(",")[0] != fb.name.split(",")[0]:
        return ""
    differ = [
        f"{key} {format_number(fa.params[key])} (A) vs {format_number(fb.params[key])} (B)"
        for key in fa.params.keys() & fb.params.keys()
        if abs(fa.params[key] - fb.params[key]) > 1e-4 * max(abs(fa.params[key]), 1e-12)
    ]
    same = (
        "; the rest of the form is the same"
        if fa.detail == fb.detail
        else f"; also {fa.detail} vs {fb.detail}"
    )
    mu = ""
    if "shift" in fa.params and "shift" in fb.params and min(fa.params["shift"], fb.params["shift"]) > 0:
        # an exponential time shift (Flux's time_shift(mu, 1, t)) is this shift with mu = ln(shift); a linear
        # one (diffusers' time_shift_type="linear") has mu = shift itself
        mu = (
            f" (as an exponential time shift: mu {format_number(math.log(fa.params['shift']))} vs"
            f" {format_number(math.log(fb.params['shift']))}; as a linear one: mu"
            f" {format_number(fa.params['shift'])} vs {format_number(fb.params['shift'])})"
        )
    if not differ:
        if fa.detail == fb.detail:
            return ""
        return f" Same family and parameters; differs in its range: {fa.detail} (A) vs {fb.detail} (B)."
    return f" Same family; differs in {', '.join(differ)}{mu}{same}."


def _shift_twice(fa: Family | None, fb: Family | None) -> ScheduleHint | None:
    r"""Both sides shifted flow matching with one shift, one of them ending its unshifted range at the shifted
    table's end (so its end point was shifted twice)."""
    if fa is None or fb is None or not (fa.name.startswith("flow") and fb.name.startswith("flow")):
        return None
    s = fa.params["shift"]
    if abs(s - 1) < 1e-3 or abs(fb.params["shift"] - s) > 1e-3 * s:
        return None
    marks = ["applied twice" in f.detail for f in (fa, fb)]
    if marks[0] == marks[1]:
        return None
    twice, once = ("A", "B") if marks[0] else ("B", "A")
    f_once = fb if marks[0] else fa
    return ScheduleHint(
        "shift-twice",
        "sigmas",
        f"both sides shift flow-matching sigmas by {format_number(s)}, but {twice} starts from an end point"
        f" that was already shifted ({(fa if marks[0] else fb).detail}): the shift is applied twice at the"
        f" low end; {once} goes {f_once.detail}.",
        ["shift", "use_dynamic_shifting"],
    )


def _parameters_differ(fa: Family | None, fb: Family | None, k: KindComparison) -> ScheduleHint:
    r"""Both sides fit the same closed form, the values still differ: name the parameters at full
    precision."""
    fam = fa or fb
    pa, pb = (fa.params if fa else {}), (fb.params if fb else {})
    diffs = [f"{p} {pa.get(p)!r} vs {pb.get(p)!r}" for p in sorted({*pa, *pb}) if pa.get(p) != pb.get(p)]
    what = "; ".join(diffs) if diffs else "the fitted parameters agree to their precision"
    return ScheduleHint(
        "family-parameters",
        k.kind,
        f"both sides follow {fam.describe()}, but the values differ from step {k.first_difference}: {what} "
        "(A vs B).",
    )


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
    from paritykit.base.files import check_sides, same_path_warning

    check_sides(a, b)
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
                notes.append(
                    f"{side} was recorded per denoiser call, so its final sigma is unknown; the other "
                    "side's final 0 is not compared"
                )
        first = first_list_difference(va, vb, kind)
        kinds.append(
            KindComparison(
                kind,
                va,
                vb,
                first is None,
                first,
                family_of(kind, va, num_train_timesteps),
                family_of(kind, vb, num_train_timesteps),
            )
        )
    if not kinds:
        raise ParityKitError(
            f"{sa.source} and {sb.source} share no schedule: one holds only timesteps, the other only sigmas"
        )
    hints = [h for k in kinds if not k.same for h in _hints_for(k, sa.integer, sb.integer)]
    notes += filter(None, [same_path_warning(a, b)])
    return ScheduleComparison(sa.source, sb.source, kinds, hints, only, notes)
