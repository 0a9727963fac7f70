r"""The schedule's and the update's checks that run the port's scheduler: its config fitted to the
reference's recorded timesteps (``schedule --fit``), its ``step()`` replayed on the reference's recorded calls
(``--step-check``), and its own timestep list read against what the port's denoiser was fed. A mixin of
:class:`paritykit.triage.walk.Triage`, which holds the runs they read."""

from __future__ import annotations

import shlex

from paritykit.base.errors import ParityKitError
from paritykit.base.report import format_number
from paritykit.schedule.schedulers import fit_name
from paritykit.triage.measures import head
from paritykit.triage.pairs import same_timestep
from paritykit.triage.report import Finding


class ScheduleChecks:
    r"""The checks of :class:`~paritykit.triage.walk.Triage` that fit or step the port's scheduler."""

    def _fit_schedule(self, finding: Finding) -> None:
        if not self.spec.has("port_scheduler"):
            self.skip("schedule", "the SPEC defines no port_scheduler()", check="fit")
            return
        if self.folders is None:
            self.skip("schedule", "no recordings were written (out=None)", check="fit")
            return
        from paritykit.schedule import fit_scheduler

        scheduler = self.port_scheduler
        seq_len = self.layout.port_shape[1] if self.layout is not None else None
        try:
            fit = fit_scheduler(
                type(scheduler),
                str(self.folders[0]),
                base_config=dict(scheduler.config),
                port=str(self.folders[1]),
                seq_len=seq_len,
            )
        except ParityKitError as exc:
            finding.evidence.append(f"schedule fit not run: {exc}")
            return
        finding.details = {"compare": finding.details, "fit": fit.to_dict()}
        finding.evidence += [n for n in fit.notes if n.startswith(("the port's own run", "mu: "))]
        if fit.unchanged:  # the port's own config gives the reference's list: a measurement, no fix
            finding.evidence.append(
                f"the port's {type(scheduler).__name__} config with set_timesteps(n) gives the reference's"
                f" recorded {fit.steps} steps: {fit.fits[0].residual_text()}"
            )
        elif fit.line:
            finding.fix = fit.line + (f"; {fit.call_line}" if fit.call_line else "")
            if fit.pasted:
                finding.fix = "replaces the schedule with the reference's list: " + finding.fix
            # verified: the recorded run reproduced, as a configuration of the port's own scheduler (a pasted
            # list reproduces anything); a fix checked at the recorded count only says so
            finding.verified = not fit.pasted
            if fit.one_count_only:
                finding.fix += f" (checked at the recorded {fit.steps} steps only)"
            others = sorted(set(fit.fits[0].counts_matched) - {fit.steps})
            finding.evidence.append(
                f"the fix reproduces the reference's recorded {fit.steps} steps:"
                f" {fit.fits[0].residual_text()}"
                + (f"; {fit.why_one_count()}" if fit.one_count_only else "")
                + (
                    f"; at {', '.join(map(str, others))} steps it follows the closed form read from the"
                    " recording (the reference was not run there)"
                    if others and fit.extrapolated
                    else (f"; and at {', '.join(map(str, others))} steps" if others else "")
                )
            )
        else:
            finding.evidence += [
                f"none of the {fit.searched} configs and set_timesteps calls of {type(scheduler).__name__}"
                " tried reproduces them"
                + (" (schedule --fit lists them)" if fit_name(type(scheduler)) is not None else ""),
                *fit.differences[:3],
            ]

    def _stochastic_reference(self) -> str:
        r"""Why the reference's update is not replayed: at every step where it can be fitted, its next latents
        are no exact linear rule of its latents and model output (sampler noise, eta > 0, an SDE, x0
        thresholding; round 17: DDIM's dynamic thresholding, which step() does reproduce, was called
        irreproducible); empty otherwise."""
        fits = [self._update_fits(i)[0] for i in range(len(self.pairs))]
        # the last step of an SDE sampler goes to sigma 0 and draws no noise: it says nothing either way
        fitted = [f for f in fits[:-1] if f is not None]
        if not fitted or any(f.exact for f in fitted):
            return ""
        worst = max(f.residual for f in fitted)
        return (
            "the reference's update is no exact linear rule of its latents and the recorded model output"
            f" at any of {len(fitted)} steps (residual up to {format_number(worst)}), so step() was not"
            " replayed on them (a lead: sampler noise, x0 clipped or thresholded, the outputs of several"
            " calls or guidance passes combined (the guidance formula, and any rescale of it), or a term the"
            " loop adds besides the model output, such as a classifier's gradient)"
        )

    def _check_step(self, finding: Finding) -> None:
        r"""With the port's scheduler: its ``step()`` replayed in lockstep with the reference's recorded calls
        over the keys that change only the update (``schedule --fit --step-check``); a fix that reproduces
        every update is verified."""
        if not self.spec.has("port_scheduler") or self.folders is None:
            return
        noisy = self._stochastic_reference()
        if noisy:
            finding.evidence.append(f"step check not run: {noisy}")
            return
        from paritykit.schedule import fit_scheduler

        scheduler = self.port_scheduler
        reference = str(self.folders[0])
        try:
            fit = fit_scheduler(
                type(scheduler), reference, base_config=dict(scheduler.config), step_check=reference
            )
        except ParityKitError as exc:
            finding.evidence.append(f"step check not run: {exc}")
            return
        check = fit.fits[0].step_check if fit.fits else None
        if check is not None and check.matched and fit.fits[0].changes:
            finding.fix, finding.verified = fit.line, True
            finding.evidence.append(
                f"the port's step() with this fix reproduces the reference's {check.steps_checked} "
                f"updates: {check.explanation}"
            )
        elif (check is None or not check.matched) and (
            fit.rejected or fit.fits
        ):  # none tried: nothing to say
            # (a config as given that reproduces the updates with step()'s defaults says nothing here)
            why = (
                fit.rejected[0].step_check.explanation if fit.rejected and fit.rejected[0].step_check else ""
            )
            tried = len(fit.rejected) + len(fit.fits)
            finding.evidence.append(
                f"none of the {tried} configs of the port's scheduler tried reproduces the reference's"
                " updates" + (f": {why}" if why else "")
            )
        name = fit_name(type(scheduler))
        if name is None:
            return
        words = ["paritykit", "schedule", reference, "--fit", name]
        finding.command = shlex.join(
            [*words, *self.commands.config_words(scheduler), "--step-check", reference]
        )
        finding.files.append(self.commands.config_file(scheduler))

    def _timesteps_reach_no_output(self, first: int) -> bool:
        r"""Timesteps that differ in value while every call's latents and output agree reach no output (the
        two sides pass the noise level in other units or another parametrization): said once, as measured."""
        if not all(p.latents_match and p.output_match for p in self.pairs):
            return False
        if not any(n.place == "schedule" for n in self.ruled_out):
            self.rule_out(
                "schedule",
                f"the values passed as the timestep differ from call {first} (reference"
                f" {format_number(self.t_ref[first])}, port {format_number(self.t_port[first])}), yet"
                f" every call's latents and output agree ({len(self.pairs)} calls): the difference reaches no"
                " output",
                check="timesteps",
            )
        return True

    def _timesteps_words(self) -> str:
        r"""Why the steps cannot be matched by timestep: one side's calls carry none, or they differ."""
        for side, values in (("reference", self.t_ref), ("port", self.t_port)):
            if values and all(v is None for v in values):
                return f"the {side}'s denoiser calls carry no recognisable timestep argument"
        return "the timesteps differ"

    def _scheduler_timesteps(self, n: int) -> list[float] | None:
        r"""The timesteps ``port_scheduler()`` gives for ``n`` steps, on a copy (the SPEC's stays as it was);
        ``None`` where it refuses that count."""
        import copy

        scheduler = copy.deepcopy(self.port_scheduler)
        try:
            scheduler.set_timesteps(n)
            return [float(t) for t in scheduler.timesteps]
        except Exception:
            return None

    def _converted_timesteps(self, t_port: list[float]) -> list[str]:
        r"""A line where the port's denoiser is fed timesteps that ``port_scheduler()`` does not give at the
        run's step count: the port's pipeline converts them before the call, so what differs may be that
        conversion as well as the schedule. The step count is the one ``port_scheduler()`` returns set (the
        port's run sets it where the SPEC returns the pipeline's own); where it was never set, the call
        count, and only where no timestep is fed twice (two calls a step, as a Heun loop makes, would be read
        as twice the steps). Empty otherwise."""
        if not self.spec.has("port_scheduler"):
            return []
        own = self._run_timesteps()
        steps = getattr(self.port_scheduler, "num_inference_steps", None)
        words = f"as port_scheduler() returned it ({steps} steps)"
        if own is None and len(set(t_port)) == len(t_port):
            own, words = self._scheduler_timesteps(len(t_port)), f"set to {len(t_port)} steps, one a call"
        if own is None:
            return []
        if len(own) == len(t_port):
            apart = [i for i, (a, b) in enumerate(zip(own, t_port)) if not same_timestep(a, b)]
        else:
            apart = [i for i, b in enumerate(t_port) if not any(same_timestep(a, b) for a in own)]
        if not apart:
            return []
        return [
            f"the port's scheduler, {words}, gives the timesteps {head(own)}, and its denoiser is"
            f" fed {head(t_port)}; from call {apart[0]} the fed value is not the scheduler's: the port's"
            " pipeline converts them before the call (a lead: the difference may be made in that conversion,"
            " not in the scheduler)"
        ]

    def _run_timesteps(self) -> list[float] | None:
        r"""The timesteps ``port_scheduler()`` holds where it was set to a step count (by the port's run,
        where the SPEC returns the pipeline's own); ``None`` where it was never set."""
        if getattr(self.port_scheduler, "num_inference_steps", None) is None:
            return None
        held = getattr(self.port_scheduler, "timesteps", None)
        try:
            values = [float(t) for t in held] if held is not None else []
        except (TypeError, ValueError):
            return None
        return values or None
