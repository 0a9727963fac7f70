r"""What ``paritykit schedule --fit`` reports: each candidate (a config change and a ``set_timesteps``
call) and how it fared, and the whole result, table and JSON from one object."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, format_number, render_table
from paritykit.schedule.schedulers import DEFAULT_CALL, Call, Match, python_literal, ready_line
from paritykit.schedule.step_check import StepCheck

# a fit whose worst relative error is at most this is float32 rounding of the reference: "exact"
EXACT_RTOL = 1e-6


@dataclass
class Candidate:
    r"""A config change (relative to the base config), the ``set_timesteps`` call, and how they fared.

    ``residual``: per kind, ``(max_abs, max_rel)`` over every count (and size) checked; ``mu``: the ``mu``
    passed per image size when the config shifts dynamically.
    """

    changes: dict[str, Any]
    call: Call = DEFAULT_CALL
    counts_matched: list[int] = field(default_factory=list)
    failures: dict[Any, str] = field(default_factory=dict)
    step_check: StepCheck | None = None
    residual: dict[str, tuple[float, float]] = field(default_factory=dict)
    mu: dict[int | None, float] = field(default_factory=dict)
    distance: float = math.inf
    # exact at the recorded count, but not on the closed form read from that one recording at other counts
    # (which one count cannot confirm): count -> why
    departs: dict[Any, str] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return all(rel <= EXACT_RTOL for _, rel in self.residual.values())

    def absorb(self, match: Match) -> None:
        for kind, (a, r) in match.residual.items():
            old = self.residual.get(kind, (0.0, 0.0))
            self.residual[kind] = (max(old[0], a), max(old[1], r))

    def residual_text(self) -> str:
        if not self.residual:
            return ""
        worst_abs = max(a for a, _ in self.residual.values())
        worst_rel = max(r for _, r in self.residual.values())
        where = "; ".join(
            f"{k} {format_number(a)} abs, {format_number(r)} rel" for k, (a, r) in self.residual.items()
        )
        if self.exact:
            return f"exact (float32 rounding: {where})"
        return f"fits within {format_number(worst_rel)} relative ({format_number(worst_abs)} abs; {where})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "changes": self.changes,
            "call": self.call.text,
            "counts_matched": self.counts_matched,
            "failures": {str(k): v for k, v in self.failures.items()},
            "residual": {k: {"max_abs": a, "max_rel": r} for k, (a, r) in self.residual.items()},
            "exact": self.exact if self.residual else None,
            "mu": {str(k): v for k, v in self.mu.items()},
            "departs": {str(k): v for k, v in self.departs.items()},
            "step_check": self.step_check.to_dict() if self.step_check else None,
        }


@dataclass
class FitResult:
    r"""What ``paritykit schedule REF --fit CLASS`` reports.

    ``fits`` hold the (config, call) pairs whose lists match at every count checked (and whose step matches,
    when checked), plainest first; ``rejected`` the ones that matched at the requested count but not at
    another, or whose step differs. With no fit, ``nearest`` is the closest candidate, ``differences`` name
    what still differs, and ``elsewhere`` the other scheduler classes that reproduce the reference.
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
    sizes: list[int] = field(default_factory=list)
    mu_rule: str | None = None
    # the reference was run at every count checked (a SPEC's ref_schedule(n)), not only recorded at one
    recorded_counts: bool = False
    # the port's own run was given (--port-run), whether or not it singled out the port's call
    port_given: bool = False
    nearest: Candidate | None = None
    differences: list[str] = field(default_factory=list)
    elsewhere: list[str] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=environment_stamp)

    @property
    def exit_code(self) -> int:
        return 0 if self.fits else 1

    @property
    def line(self) -> str | None:
        return ready_line(self.scheduler, self.fits[0].changes) if self.fits else None

    @property
    def unchanged(self) -> bool:
        r"""The best fit is the base config itself with the plain ``set_timesteps(n)``: no change."""
        return bool(self.fits) and not self.fits[0].changes and self.call_line is None and not self.pasted

    @property
    def one_count_only(self) -> bool:
        r"""The fix was checked at the recorded step count only: the reference follows no closed form, or the
        fix departs from the one read from that recording (one count cannot confirm either)."""
        if not self.fits:
            return False
        return len(set(self.fits[0].counts_matched)) < 2 or bool(self.fits[0].departs) or self.ambiguous

    @property
    def ambiguous(self) -> bool:
        r"""Another ``set_timesteps`` call reproduces the recorded count as well and disagrees at the others:
        one recording cannot tell them apart (the closed form read from it is one reading among them)."""
        if not self.extrapolated or not self.fits or self.fits[0].departs:
            return False
        return any(c.departs and c.call != self.fits[0].call for c in self.rejected)

    @property
    def extrapolated(self) -> bool:
        r"""The counts besides the recorded one were checked against a closed form read from the recording,
        not against the reference run at those counts."""
        return len(self.counts) > 1 and not self.recorded_counts

    @property
    def pasted(self) -> bool:
        r"""The fix passes the reference's own list to ``set_timesteps``: it replaces the port's schedule,
        it does not configure it."""
        return bool(self.fits) and self.fits[0].call.rank >= 3

    @property
    def call_line(self) -> str | None:
        r"""The ``set_timesteps`` call the fix needs, when it is not the plain ``set_timesteps(n)``."""
        if not self.fits or (self.fits[0].call == DEFAULT_CALL and not self.fits[0].mu):
            return None
        best = self.fits[0]
        text = best.call.text
        if best.mu:
            mu = self.mu_rule or format_number(next(iter(best.mu.values())), 6)
            head, _, comment = text.partition("  #")
            inner = head[len("set_timesteps(") : -1]
            inner = "num_inference_steps=n" if inner == "n" else inner
            text = f"set_timesteps({inner}, mu={mu})" + (f"  #{comment}" if comment else "")
        return f"pipe.scheduler.{text}"

    def why_one_count(self) -> str:
        if self.pasted:  # a list holds at its own length: no other count can be checked with it
            return (
                "the fix passes the reference's own list to set_timesteps, which holds at the recorded count"
                " only"
            )
        if self.ambiguous and self.port_given:
            return (
                "another set_timesteps call in the table reproduces the recorded count too and differs at"
                " other counts, and the port's own run did not single out its call (its mu follows no linear"
                " rule of base/max image_seq_len at the size given, or no --seq-len); record the reference at"
                " another count to decide"
            )
        if self.ambiguous:
            return (
                "another set_timesteps call in the table reproduces the recorded count too and differs at"
                " other counts; one recorded count cannot tell them apart (--port-run names the port's own"
                " call; or record the reference at another count)"
            )
        if self.fits and self.fits[0].departs:
            return (
                "at other counts it departs from the closed form read from the recording, which one recorded"
                " count cannot confirm; record the reference at another count (or give ref_schedule(n))"
            )
        if self.reference_families:
            return "it was checked at the recorded count only"
        return (
            "the recorded values matched none of the closed forms tried on them, so no other count was"
            " checked"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "steps": self.steps,
            "counts": self.counts,
            "sizes": self.sizes,
            "reference": self.reference,
            "reference_families": self.reference_families,
            "one_count_only": self.one_count_only,
            "extrapolated": self.extrapolated,
            "pasted": self.pasted,
            "fit": self.line,
            "call": self.call_line,
            "mu_rule": self.mu_rule,
            "fits": [c.to_dict() for c in self.fits],
            "rejected": [c.to_dict() for c in self.rejected],
            "nearest": self.nearest.to_dict() if self.nearest else None,
            "differences": self.differences,
            "elsewhere": self.elsewhere,
            "searched": self.searched,
            "warnings": self.warnings,
            "notes": self.notes,
            "step_checked": self.step_checked,
            "environment": self.environment,
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        lines = [f"reference: {self.reference} ({self.steps} steps)"]
        lines += [f"  {k}: {v}" for k, v in self.reference_families.items()]
        counts = ", ".join(map(str, self.counts))
        if self.extrapolated:
            others = ", ".join(str(c) for c in self.counts if c != self.steps)
            counts = (
                f"{self.steps} (recorded); {others} (the closed form read from the recording: the reference"
                " was not run there)"
            )
        lines.append(
            f"tried {self.searched} configs and set_timesteps calls of {self.scheduler}; step counts:"
            f" {counts}"
            + (f"; image_seq_len checked: {', '.join(map(str, self.sizes))}" if self.sizes else "")
        )
        rows = []
        for c in [*self.fits, *self.rejected]:
            status = ("fits" if not c.departs else f"fits {self.steps}") if c in self.fits else "rejected"
            status = f"exact at {self.steps}" if c.departs and c not in self.fits else status
            why = "; ".join(f"at {n}: {w}" for n, w in c.failures.items())
            if c.departs:
                why = "departs from the closed form read from the recording: " + "; ".join(
                    f"at {n}: {w}" for n, w in c.departs.items()
                )
            if c.step_check is not None and not c.step_check.matched:
                why = "; ".join(filter(None, [why, c.step_check.explanation]))
            rows.append([status, change_text(c), ",".join(map(str, c.counts_matched)), why])
        if rows:
            lines.append(
                render_table(["", "config change / call", "matches at", "why not"], rows, limit=limit)
            )
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        if self.line:
            lines.append(f"fit: {self.fits[0].residual_text()}")
            label = "replaces the schedule with the reference's list" if self.pasted else "fix"
            if self.unchanged:  # the config as given reproduces it: nothing to change, no fix to print
                lines.append(f"the {self.scheduler} config as given, with set_timesteps(n), reproduces it")
            else:
                lines.append(f"{label}: {self.line}")
            if self.call_line:
                lines.append(f"     {self.call_line}")
            if self.one_count_only:
                lines.append(
                    f"     (checked at the recorded {self.steps} steps only: {self.why_one_count()})"
                )
            check = self.fits[0].step_check
            if check is not None:
                lines.append(
                    f"step: {check.steps_checked} updates match the reference's"
                    + (f" ({check.explanation})" if check.explanation else "")
                )
            return "\n".join(lines)
        lines.append(
            f"none of the {self.searched} configs and set_timesteps calls of {self.scheduler} tried"
            " reproduces the reference"
        )
        if self.nearest is not None:
            lines.append(
                f"nearest: {change_text(self.nearest)} (worst relative error of its recorded schedule values"
                f" {format_number(self.nearest.distance)} at {self.steps} steps"
                + (
                    f"; its updates: {self.nearest.step_check.explanation or 'do not match'}"
                    if self.nearest.step_check is not None and not self.nearest.step_check.matched
                    else ""
                )
                + ")"
            )
            lines += [f"  still differs: {d}" for d in self.differences]
        lines += [f"  elsewhere: {e}" for e in self.elsewhere]
        return "\n".join(lines)


def change_text(c: Candidate) -> str:
    text = ", ".join(f"{k}={python_literal(v)}" for k, v in c.changes.items()) or "(base)"
    if c.call != DEFAULT_CALL:
        text += f"; {c.call.text.partition('  #')[0]}"
        if c.call.name == "sigmas-given-final":
            text += " (its final sigma included)"
    if c.mu:
        text += "; mu " + ", ".join(
            (f"{format_number(v, 6)} at seq {k}" if k is not None else format_number(v, 6))
            for k, v in c.mu.items()
        )
    return text
