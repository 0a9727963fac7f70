r"""The update place of triage's walk: each side's scheduler step fitted as a relation between its recorded
latents, compared step by step, with the lockstep and rounding checks that tell a differing update from one
fed other values. A mixin of :class:`paritykit.triage.walk.Triage`, which holds the runs they read."""

from __future__ import annotations

import functools
from typing import Any

from paritykit.base.report import format_number
from paritykit.triage.fits import coefficient_differences, predict, update_fit, update_terms
from paritykit.triage.measures import command_and_files, per_step_calls, runs
from paritykit.triage.pairs import SAME_UNITS, compare, comparison_evidence, same_timestep, within_unit
from paritykit.triage.report import Finding
from paritykit.triage.roles import Roles, latents, output
from paritykit.triage.sides import SideRun
from paritykit.triage.sign_convention import NEGATED, convention_words, negated_error, opposite_output_terms

# a relative L2 error at most this, per dtype, is rounding's scale: eight times the dtype's machine epsilon
ROUNDING_SCALE = {
    "float32": 8 * 2.0**-23,
    "float64": 8 * 2.0**-52,
    "float16": 8 * 2.0**-10,
    "bfloat16": 8 * 2.0**-7,
}


# an update finding says its step's inputs may be carried only where the latents after it differ by at most
# CARRIED_LIMIT (relative L2) and at most CARRIED_GAIN times the step's own latents or output
CARRIED_LIMIT = 1e-3
CARRIED_GAIN = 1000.0


class UpdateChecks:
    r"""The update checks of :class:`~paritykit.triage.walk.Triage`: between a denoiser call and the next."""

    # ----------------------------------------------------------------------------------------- 5. update
    @functools.cached_property
    def sign_convention(self) -> str:
        r"""Words for one sign convention kept on both sides of the call
        (:mod:`paritykit.triage.sign_convention`): every call's output negated and every update's output term
        too; empty otherwise. Read once, by the denoiser's place and the update's."""
        if self.by_order or not self.pairs or not all(p.inputs_agree for p in self.pairs):
            return ""
        n = len(self.pairs)
        error = negated_error(
            [output(self.ref.calls[i]) for i in range(n)], [output(self.port.calls[i]) for i in range(n)]
        )
        if error is None or error > NEGATED:
            return ""
        terms = opposite_output_terms([self._update_fits(i) for i in range(n - 1)])
        return convention_words(n, error, terms) if terms else ""

    def update(self, step: int | None = None) -> None:
        convention = self.sign_convention
        if convention:
            self.rule_out("update", convention)
            return
        if self.by_order:  # the next calls are not one call on both sides: no update is compared
            self.skip(
                "update",
                "the calls after the first are not paired (the sides make other numbers of calls), so no"
                " update between two calls is compared",
            )
            return
        fits = [self._update_fits(i) for i in range(len(self.pairs))]
        comparable = [
            i
            for i, (fr, fp) in enumerate(fits)
            if fr is not None and fp is not None and self._same_step_times(i)
        ]
        if step is not None and step not in comparable:
            comparable.append(step)
        within: dict[int, Any] = {}  # calls whose rules differ by less than the tolerance moves: the effect
        for i in sorted(comparable):
            fr, fp = fits[i]
            if fr is None or fp is None:
                continue
            if not (fr.exact and fp.exact):
                continue
            differences = coefficient_differences(fr, fp)
            effect = self._rules_effect(i, fr, fp) if differences else None
            if effect is not None and effect.passed:
                within[i] = effect
                continue
            if differences:
                flipped = opposite_output_terms([(fr, fp)]) is not None
                lead = (
                    "; a lead: a port that folds the output's sign into its denoiser (a negated"
                    " output layer, to fit a scheduler stepping the other way) applies it so; then the"
                    " outputs agree up to sign (the denoiser line compares them as they are)"
                    if flipped
                    else ""
                )
                self.findings.append(
                    Finding(
                        "update",
                        i,
                        f"the update from call {i} to the next differs: " + "; ".join(differences) + lead,
                        evidence=[
                            f"reference: next latents = {fr.text()} (residual {format_number(fr.residual)})",
                            f"port:      next latents = {fp.text()} (residual {format_number(fp.residual)})",
                            (
                                "timesteps, latents and output of the step agree"
                                if step == i
                                else "the step's timesteps agree on both sides"
                            ),
                        ],
                        **command_and_files(self.commands.steps()),
                    )
                )
                self._check_step(self.findings[-1])
                return
        if step is not None and self._update_within_rounding(step):
            return
        if step is not None:
            fr, fp = fits[step] if step < len(fits) else (None, None)
            if fr is None or fp is None or not (fr.exact and fp.exact):
                why = "a side's update is not a linear rule of its latents and outputs"
            elif step in within:
                why = (
                    "the fitted rules' coefficients differ by less than moves the next latents beyond the"
                    " tolerance on the reference's inputs, yet with each side's own inputs they end beyond it"
                )
            else:
                why = "the fitted rules agree, yet the next latents differ"
            self.findings.append(
                Finding(
                    "update",
                    step,
                    f"the latents after step {step} differ while that step's inputs and output "
                    f"agree: the sampler's update (cause unknown: {why})" + self._carried(step),
                    evidence=comparison_evidence(self._next_latents_comparison(step)),
                    **command_and_files(self.commands.steps()),
                )
            )
            self._check_step(self.findings[-1])
            return
        if self._update_in_lockstep():
            return
        checked = [i for i in comparable if fits[i][0] is not None and fits[i][0].exact and fits[i][1].exact]
        words = (
            "each side's update is an exact linear rule of its latents and outputs, and the two rules agree"
            f" at {len(checked)} of {len(self.pairs)} recorded calls"
        )
        if within:
            largest = max(within.values(), key=lambda c: c.max_abs)
            words += (
                f"; at calls {runs(sorted(within))} they agree within the tolerance only: their"
                " coefficients differ, and applied to the reference's latents and outputs the two rules' next"
                f" latents differ by at most {format_number(largest.max_abs)}"
                f" (atol {format_number(largest.atol)}, rtol {format_number(largest.rtol)})"
            )
        if checked and len(checked) == len(self.pairs):
            self.rule_out("update", words)
        elif checked:
            # a rule-out covers every update or none: the calls left out may hold the difference
            missed: dict[str, list[int]] = {}
            for i in range(len(self.pairs)):
                if i not in checked:
                    missed.setdefault(self._why_no_update_rule(i, fits[i]), []).append(i)
            said = "; ".join(
                f"not compared at calls {runs(calls)}: {why}{self._residuals(calls, fits)}"
                for why, calls in missed.items()
            )
            self.skip("update", f"{words}; {said}")
        else:
            words = self._timesteps_words()
            self.skip(
                "update",
                "no step with an exact linear rule whose timesteps agree on both sides"
                if words == "the timesteps differ"
                else f"no step compared: {words}",
            )

    def _rules_effect(self, i: int, fr: Any, fp: Any) -> Any:
        r"""The two sides' fitted update rules at call ``i`` applied to the reference's own terms (latents,
        output, previous output), compared under the run's tolerance: what the rules' difference does to the
        next latents, measured. ``None`` where a rule has a term the reference's call lacks."""
        run, roles = self.ref, self.ref_roles
        previous = output(run.calls[i - 1]) if i > 0 else None
        terms = update_terms(latents(run.calls[i], roles[i]), output(run.calls[i]), previous)
        if terms is None:
            return None
        a, b = predict(fr, terms), predict(fp, terms)
        if a is None or b is None:
            return None
        return compare(a, b, self.tol, f"next latents of the two update rules at call {i}")

    def _carried(self, step: int) -> str:
        r"""Where the step's latents and output agree within the tolerance but not exactly, words saying how
        far apart they are against the next latents (round 32, tortoise-tts: float rounding of 1e-6 carried
        through an update dividing by a small sqrt(alpha-bar) ended 2e-5 apart, read as a cause); empty where
        they are equal."""
        from paritykit.triage.pairs import rel

        before = [
            rel(
                latents(self.ref.calls[step], self.ref_roles[step]),
                latents(self.port.calls[step], self.port_roles[step]),
            ),
            rel(output(self.ref.calls[step]), output(self.port.calls[step])),
        ]
        after = rel(
            self._next_latents(self.ref, self.ref_roles, step),
            self._next_latents(self.port, self.port_roles, step),
        )
        if None in before or after is None or max(before) == 0:
            return ""
        if not (after <= CARRIED_LIMIT and after <= CARRIED_GAIN * max(before)):
            return ""  # far beyond what rounding carried through one update reaches (a clamp on one side)
        return (
            f"; that step's latents and output are not equal but {format_number(before[0])} and"
            f" {format_number(before[1])} apart (relative L2), the latents after it {format_number(after)}: a"
            " lead that the update carries those differences (an update that divides by a small noise level"
            " amplifies them), not measured"
        )

    def _update_within_rounding(self, step: int) -> bool:
        r"""Where the latents after ``step`` differ beyond the tolerance element by element but, in all, by
        a relative L2 error at the scale of the dtype's rounding (:data:`ROUNDING_SCALE`), a rule-out
        saying so, measured; ``False`` (nothing said) otherwise."""
        from paritykit.compare.tensors import relative_error

        a = self._next_latents(self.ref, self.ref_roles, step)
        b = self._next_latents(self.port, self.port_roles, step)
        if a is None or b is None or tuple(a.shape) != tuple(b.shape) or not a.is_floating_point():
            return False
        limit = ROUNDING_SCALE.get(str(a.dtype).removeprefix("torch."))
        error = relative_error(b, a)
        if limit is None or not error <= limit:
            return False
        self.rule_out(
            "update",
            f"the latents after step {step} differ beyond the tolerance element by element, but by"
            f" {format_number(error)} relative (L2) in all, under {format_number(limit)}, eight times"
            f" {str(a.dtype).removeprefix('torch.')}'s rounding step: no place is named for it",
        )
        return True

    def _update_step(self) -> int | None:
        r"""The first step whose inputs and output agree on both sides while the latents after it differ (the
        next call's, or the final latents after the last call): a difference the update makes, measured, be
        the update a linear rule or not. ``None`` where no step is so."""
        for i, pair in enumerate(self.pairs):
            if not (pair.inputs_agree and pair.output_match and self._same_step_times(i)):
                continue
            last = i + 1 == len(self.pairs)
            if self.final_latents_differ() if last else not self.pairs[i + 1].latents_match:
                return i
        return None

    def _why_no_update_rule(self, i: int, fit: tuple[Any, Any]) -> str:
        r"""Why call ``i``'s update was not compared, measured."""
        if not self._same_step_times(i):
            return "the timesteps of that step differ"
        for side, found in zip(("reference", "port"), fit):
            if found is None:
                return f"the {side}'s latents, output or next latents are missing there or shaped apart"
            if not found.exact:
                return f"the {side}'s update is no exact linear rule there"
        return "not compared"

    def _residuals(self, calls: list[int], fits: list[tuple[Any, Any]]) -> str:
        r"""The residuals of the inexact fits at ``calls``, as a value or a range (words for a grouped
        line)."""
        found = [f.residual for i in calls for f in fits[i] if f is not None and not f.exact]
        if not found:
            return ""
        low, high = min(found), max(found)
        if low == high:
            return f" (residual {format_number(low)})"
        return f" (residuals {format_number(low)} to {format_number(high)})"

    def _update_in_lockstep(self) -> bool:
        r"""With ``port_scheduler()``: its ``step()`` replayed on the reference's recorded model outputs and
        latents, update by update. A difference is a finding (with the scheduler key whose change removes
        it, verified, when one does); agreement rules the update out with its coverage. ``False`` when the
        replay cannot run (then the fitted rules decide, and the reason is kept)."""
        if not self.spec.has("port_scheduler") or self.folders is None:
            return False
        if not self.pairs or not all(p.timestep_match for p in self.pairs):
            # the port's scheduler would step other timesteps: that is the schedule's difference, not the
            # update's, and replaying it here would blame the update for it
            self.skip("update", f"not replayed in lockstep with port_scheduler(): {self._timesteps_words()}")
            return False
        if per_step_calls(self.t_ref, self.t_port):
            self.skip(
                "update",
                "not replayed in lockstep with port_scheduler(): the two sides call their denoiser a"
                " different number of times per timestep",
            )
            return False
        noisy = self._stochastic_reference()
        if noisy:
            self.skip("update", f"not replayed in lockstep with port_scheduler(): {noisy}")
            return False
        repeats = _repeats_each(self.t_port)
        if repeats > 1:
            self.skip(
                "update",
                "not replayed in lockstep with port_scheduler(): the port calls its denoiser"
                f" {repeats} times at each timestep (a corrector before the predictor, or a second-order"
                " step), so one step() per call does not replay it",
            )
            return False
        loops = _loops_over(self.t_port)
        if loops > 1 and not self._scheduler_steps_the_run():
            self.skip(
                "update",
                "not replayed in lockstep with port_scheduler(): the port's run goes through one list of"
                f" {len(self.t_port) // loops} timesteps {loops} times (the loop run once per sample, one"
                " after another), and the replay steps one pass of a loop",
            )
            return False
        if not self._scheduler_steps_the_run():
            self.skip(
                "update",
                "not replayed in lockstep with port_scheduler(): its set_timesteps(n) gives other timesteps"
                " than the port's denoiser was fed",
            )
            return False
        from paritykit.schedule.step_check import lockstep

        check = lockstep(self.port_scheduler, str(self.folders[0]))
        if isinstance(check, str):
            self.skip("update", f"not replayed in lockstep with port_scheduler(): {check}")
            return False
        if check.matched:
            self.rule_out(
                "update",
                f"{check.steps_checked} of {len(self.ref.calls)} updates replayed in lockstep with"
                " port_scheduler() on the reference's model outputs and latents",
            )
            return True
        step = check.first_failing_step
        self.findings.append(
            Finding(
                "update",
                step,
                "the port's scheduler, fed the reference's model outputs and latents, does not reproduce the"
                f" reference's update: {check.explanation}",
                evidence=[
                    f"replayed in lockstep over {check.steps_checked} updates before the one that differs"
                ],
                **command_and_files(self.commands.steps()),
            )
        )
        self._check_step(self.findings[-1])
        return True

    def _scheduler_steps_the_run(self) -> bool:
        r"""Whether ``port_scheduler()`` set to the run's step count gives the timesteps the port's run
        passed its denoiser (the lockstep replay builds it so)."""
        timesteps = self._scheduler_timesteps(len(self.port.calls))
        return (
            timesteps is not None
            and len(timesteps) == len(self.t_port)
            and all(same_timestep(a, b) for a, b in zip(timesteps, self.t_port))
        )

    def _timestep_ranges_apart(self) -> str:
        r"""Why the reference's timestep cannot be fed to the port's denoiser as it is: the two sides give
        timesteps in other ranges (one within [0, 1], the other beyond it) and no unit map pairs them; empty
        otherwise."""
        if self.t_units is not SAME_UNITS or not self.t_ref or not self.t_port:
            return ""
        if None in self.t_ref or None in self.t_port:
            return ""
        if within_unit(self.t_ref) == within_unit(self.t_port):
            return ""
        top_ref = max(abs(t) for t in self.t_ref)
        top_port = max(abs(t) for t in self.t_port)
        return (
            f"the reference gives timesteps up to {format_number(top_ref)}, the port up to"
            f" {format_number(top_port)}, and no unit map pairs them at the first calls: fed the reference's"
            " timestep, the port's module would not get identical inputs"
        )

    def _same_step_times(self, i: int) -> bool:
        if not self.pairs[i].timestep_match:
            return False
        return i + 1 >= len(self.pairs) or self.pairs[i + 1].timestep_match

    def _next_latents(self, run: SideRun, roles: list[Roles], i: int) -> Any:
        if i + 1 < len(run.calls):
            return latents(run.calls[i + 1], roles[i + 1])
        if run.vae is None:
            return run.result  # the run returns the final latents
        return None

    def later_draws(self) -> str:
        r"""Words naming the calls whose latents are no exact linear rule of the call before's latents and
        output, on either side (a stochastic sampler's noise drawn there, a new start): what a rule-out of the
        initial noise does not cover; empty when every step's update is such a rule on both sides."""
        calls = [
            i + 1
            for i in range(len(self.pairs) - 1)
            if any(fit is not None and not fit.exact for fit in self._update_fits(i))
        ]
        if not calls:
            return ""
        return (
            f"; the latents of calls {runs(calls)} are no exact linear rule of the call before's latents and"
            " output on a side, so what was drawn there is not covered by this check"
        )

    def _update_fits(self, i: int):
        if i not in self.update_fit_memo:
            self.update_fit_memo[i] = self._fit_update(i)
        return self.update_fit_memo[i]

    def _fit_update(self, i: int):
        sides = []
        for run, roles in ((self.ref, self.ref_roles), (self.port, self.port_roles)):
            previous = output(run.calls[i - 1]) if i > 0 else None
            sides.append(
                update_fit(
                    latents(run.calls[i], roles[i]),
                    output(run.calls[i]),
                    self._next_latents(run, roles, i),
                    previous,
                )
            )
        return tuple(sides)

    def _next_latents_comparison(self, i: int) -> Any:
        a = self._next_latents(self.ref, self.ref_roles, i)
        b = self._next_latents(self.port, self.port_roles, i)
        return compare(a, b, self.tol, f"latents after step {i}")


def _repeats_each(values: list[Any]) -> int:
    r"""``k`` where every value of ``values`` comes ``k`` times in a row (k > 1: several calls per timestep);
    1 otherwise."""
    if not values or None in values:
        return 1
    runs, count = [], 1
    for a, b in zip(values, values[1:]):
        if same_timestep(a, b):
            count += 1
        else:
            runs.append(count)
            count = 1
    runs.append(count)
    return runs[0] if len(set(runs)) == 1 and runs[0] > 1 else 1


def _loops_over(values: list[Any]) -> int:
    r"""``k`` where ``values`` is one list of two or more values given ``k`` > 1 times in a row (a sampling
    loop run once per sample); 1 otherwise."""
    if not values or None in values:
        return 1
    for k in range(2, len(values) // 2 + 1):
        n = len(values) // k
        if len(values) % k or n < 2:
            continue
        if all(same_timestep(values[i], values[i % n]) for i in range(len(values))):
            return k
    return 1
