r"""The walk of ``paritykit triage``: two recorded runs compared call by call, first difference first, each
place a sampling pipeline can part from its reference checked in the order the data flows (initial noise,
schedule, conditioning, denoiser, update, decoder input, decoder, post-processing).

A check that isolates a place feeds the port's module the reference's values at that point (replay, never a
guess) or fits each side's own relation between recorded tensors (the update rule, the decoder's input
scaling, the post-processing), so it holds even when something upstream differs too. Nothing here writes a
file: each finding carries the command that reproduces it and the files that command reads
(:mod:`paritykit.triage.reproduce`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from paritykit.base.report import environment_stamp, format_number
from paritykit.base.usercode import Spec
from paritykit.tracing.recording import Call
from paritykit.triage.conditioning_checks import ConditioningChecks
from paritykit.triage.decoder_checks import DecoderChecks
from paritykit.triage.fits import affine_words, coefficient_differences, fit_affine, update_fit
from paritykit.triage.measures import (
    THE_REFERENCES,
    bisect_finding,
    command_and_files,
    head,
    masked_words,
    module_differs,
    per_step_calls,
    plain_draw,
    repeats,
    rerun_moves,
    rounded_to,
    runs,
)
from paritykit.triage.pairs import (
    SAME_UNITS,
    BatchOrder,
    CallGroups,
    Rearrangement,
    Tolerance,
    compare,
    compare_call,
    comparison_evidence,
    leading_units,
    rel,
    same_timestep,
    timestep_units,
    within_unit,
)
from paritykit.triage.report import PLACE_ORDER, CallError, Finding, Note, Place, TriageReport
from paritykit.triage.reproduce import Commands
from paritykit.triage.roles import (
    Roles,
    kept_own,
    latents,
    output,
    roles_of,
    timestep,
    with_reference_values,
)
from paritykit.triage.schedule_checks import ScheduleChecks
from paritykit.triage.sides import SideRun

# a relative L2 error at most this, per dtype, is rounding's scale: eight times the dtype's machine epsilon
ROUNDING_SCALE = {
    "float32": 8 * 2.0**-23,
    "float64": 8 * 2.0**-52,
    "float16": 8 * 2.0**-10,
    "bfloat16": 8 * 2.0**-7,
}


class Triage(ScheduleChecks, ConditioningChecks, DecoderChecks):
    r"""The comparison of two recorded runs; :meth:`report` walks the places."""

    def __init__(
        self, spec: Spec, tol: Tolerance, ref: SideRun, port: SideRun, commands: Commands, all_causes: bool
    ):
        self.spec, self.tol, self.ref = spec, tol, ref
        self.commands, self.folders, self.all_causes = commands, commands.folders, all_causes
        self.findings: list[Finding] = []
        self.ruled_out: list[Note] = []
        self.not_checked: list[Note] = []
        self.recorded_calls = (len(ref.calls), len(port.calls))
        recorded = port
        # k calls per timestep on one side against one batched call on the other: compared step by step
        self.grouping = CallGroups.read(ref.calls, port.calls, _timesteps(ref.calls), _timesteps(port.calls))
        if self.grouping is not None and self.grouping.side == "reference":
            ref = self.ref = dataclasses.replace(ref, calls=self.grouping.merge(ref.calls))
        elif self.grouping is not None:
            port = dataclasses.replace(port, calls=self.grouping.merge(port.calls))
        self.ref_roles = [roles_of(c) for c in ref.calls]
        self.port_roles = [roles_of(c) for c in port.calls]
        # the port's run as recorded (replays feed its modules), and as compared: its latents read in the
        # reference's layout when they hold the reference's values rearranged (packed latents)
        self.port, self.port_run = port, recorded
        self.layout = None
        if ref.calls and port.calls:
            self.layout = Rearrangement.read(
                latents(ref.calls[0], self.ref_roles[0]), latents(port.calls[0], self.port_roles[0])
            )
        if self.layout is not None:
            layout = self.layout
            self.port = dataclasses.replace(
                port,
                calls=[layout.view(c, r) for c, r in zip(port.calls, self.port_roles)],
                result=layout.to_reference(port.result),
            )
        self.batch_order = None
        if ref.calls and port.calls:
            self.batch_order = BatchOrder.read(
                ref.calls[0], self.ref_roles[0], self.port.calls[0], self.port_roles[0]
            )
        if self.batch_order is not None:
            self.port = dataclasses.replace(
                self.port, calls=[self.batch_order.view(c) for c in self.port.calls]
            )
        n = min(len(ref.calls), len(port.calls))
        self.t_ref = [timestep(c, r) for c, r in zip(ref.calls, self.ref_roles)]
        self.t_port = [timestep(c, r) for c, r in zip(port.calls, self.port_roles)]
        # one schedule in other units ([0, 1] against [0, 1000]) is one schedule: compared and replayed scaled
        self.t_units = timestep_units(self.t_ref, self.t_port)
        # no map holds at every call: the one the first calls obey, for pairing and replay, said where used
        self.t_lead = 0
        if self.t_units is SAME_UNITS:
            self.t_units, self.t_lead = leading_units(self.t_ref, self.t_port)
        self.pairs = [
            compare_call(
                i, ref.calls[i], self.ref_roles[i], self.port.calls[i], self.port_roles[i], tol, self.t_units
            )
            for i in range(n)
        ]
        self.flagged = self._flagged_conditioning(tol)

    def rule_out(self, place: Place, text: str, check: str | None = None) -> None:
        self.ruled_out.append(Note(place, text, check))

    def skip(self, place: Place, text: str, check: str | None = None) -> None:
        self.not_checked.append(Note(place, text, check))

    @functools.cached_property
    def port_scheduler(self) -> Any:
        r"""The SPEC's ``port_scheduler()``, asked once (the fit, the step check and the command share it)."""
        return self.spec.call("port_scheduler")

    # -------------------------------------------------------------------------------------------- report
    def report(self) -> TriageReport:
        if self.all_causes:
            for check in (self.noise, self.schedule, self.conditioning, self.denoiser):
                check()
            self.update(step=self._update_step())
            self.decoder(independent=True)
        else:
            self.first_difference()
        if self.flagged:
            self.skip("conditioning", self.flagged)
        self.findings.sort(key=lambda f: (PLACE_ORDER[f.place], f.call or 0))
        result = self.result_comparison()
        if result.get("passed") is False and not self.findings:
            self.findings.append(
                Finding(
                    "result",
                    None,
                    "the results differ, and no place the walk compared differs (the 'not checked' lines say"
                    f" what it could not compare; {self._coverage()})"
                    if self.ruled_out
                    # nothing compared: where the run was not recorded is no more likely than the rest
                    else "the results differ, and no place before them could be checked (the 'not checked'"
                    f" lines say why; {self._coverage(missed=False)})",
                    evidence=result.get("evidence", []),
                )
            )
        return TriageReport(
            spec=str(self.spec.path),
            findings=self.findings,
            ruled_out=self.ruled_out,
            not_checked=self.not_checked,
            curve=self.curve(),
            calls=self.recorded_calls,
            grouping=self.grouping.words() if self.grouping is not None else "",
            result={k: v for k, v in result.items() if k != "evidence"},
            all_causes=self.all_causes,
            out_dir=str(self.commands.out_dir) if self.commands.out_dir is not None else None,
            environment=environment_stamp(spec=str(self.spec.path)),
        )

    def first_difference(self) -> None:
        r"""The walk: at each call its timestep, conditioning and latents, then its output; the first that
        differs is the cause; after the last call, the decoder."""
        if None not in self.t_ref and None not in self.t_port and per_step_calls(self.t_ref, self.t_port):
            return self.schedule()  # calls that cannot be paired one to one
        for pair in self.pairs:
            i = pair.index
            if i == 0 and not pair.latents_match:
                return self.noise()
            if i == 0:
                self.noise()  # the first call's latents agree: said, with the layout they were read in
            unread = pair.t_reference is None or pair.t_port is None
            if not pair.timestep_match and unread and i == 0:
                self.schedule()  # a side passes no timestep the walk can read: said once, the walk goes on
            elif not pair.timestep_match and not unread and not self._timesteps_reach_no_output(i):
                return self.schedule()
            if any(not c.passed for _, _, c in pair.conditioning):
                return self.conditioning()
            if pair.unpaired and not any(f.place == "conditioning" for f in self.findings):
                # a length or padding that differs is measured, and may be no cause (a mask in another form):
                # the walk goes on to the places after it
                self.conditioning()
            if i > 0 and not pair.latents_match:
                return self.update(step=i - 1)
            if not pair.output_match:
                return self.denoiser(call=i)
        if len(self.ref.calls) != len(self.port.calls):
            return self.schedule()
        if self.final_latents_differ():
            return self.update(step=len(self.pairs) - 1)
        ordered = f" ({self.batch_order.words()})" if self.batch_order is not None else ""
        self.rule_out(
            "denoiser",
            (
                f"latents, conditioning and output agree at every call ({len(self.pairs)}); the timestep"
                " values do not (the schedule line above)"
                if any("reaches no output" in n.text for n in self.ruled_out)
                else f"{self._inputs_words()} and output agree at every call ({len(self.pairs)})"
            )
            + ordered,
            check="calls",
        )
        self.decoder(independent=False)

    # ------------------------------------------------------------------------------------------ 1. noise
    def noise(self) -> None:
        pair = self.pairs[0] if self.pairs else None
        if pair is None:
            return
        xr = latents(self.ref.calls[0], self.ref_roles[0])
        xp = latents(self.port.calls[0], self.port_roles[0])
        if pair.latents is None:
            if xr is None or xp is None or xr.numel() != xp.numel():
                self.skip("initial noise", f"{pair.latents_note}")
                return
            import torch

            same_values = torch.equal(xr.reshape(-1).sort().values, xp.reshape(-1).sort().values.to(xr.dtype))
            summary = (
                f"the first call's latents are laid out differently: reference {tuple(xr.shape)}, port "
                f"{tuple(xp.shape)}; "
            )
            summary += (
                "the same values, rearranged: a packing (2×2 patches into tokens, channels last); calls are "
                "compared only where the layouts agree"
                if same_values
                else "the values differ too: other noise, then laid out differently"
            )
            self.findings.append(Finding("initial noise", 0, summary, evidence=[pair.latents_note]))
            return
        if pair.latents_match:
            laid_out = f" ({self.layout.words()})" if self.layout is not None else ""
            self.rule_out("initial noise", f"the first call's latents agree{laid_out}")
            return
        evidence = comparison_evidence(pair.latents)
        fit = fit_affine(xp, xr)
        absorbed = self._input_scale_absorbed(fit)
        if absorbed:
            self.rule_out("initial noise", absorbed)
            return
        summary = "the first call's latents differ"
        if fit is not None and fit.exact:
            summary += (
                f": the port's are {affine_words(fit, THE_REFERENCES)} (exact, residual"
                f" {format_number(fit.residual)})"
            )
            summary += "; a missing or extra scaling of the noise (init_noise_sigma, a sigma_max factor)"
        elif pair.latents.cosine is not None and abs(pair.latents.cosine) < 0.1:
            summary += " and are uncorrelated (cosine ~0): other noise"
        if fit is None or not fit.exact:  # what a plain draw reproduces exactly, side by side
            seeds = tuple(s for s in (self.ref.seed, self.port.seed, 0) if s is not None)
            drawn = [(side, plain_draw(x, seeds)) for side, x in (("reference", xr), ("port", xp))]
            if any(how for _, how in drawn):
                summary += "; " + "; ".join(
                    f"the {side}'s are exactly {how}" if how else f"the {side}'s are no plain CPU draw tried"
                    for side, how in drawn
                )
        self.findings.append(
            Finding(
                "initial noise",
                0,
                summary,
                evidence=evidence,
                **command_and_files(
                    self.commands.compare(0, self.ref_roles[0].latents, self.port_roles[0].latents)
                ),
            )
        )

    def _input_scale_absorbed(self, fit: Any) -> str:
        r"""Why latents that differ by an exact factor at the first call are no difference in the noise: the
        first call's outputs agree, so the two denoisers take their input in other scales (one side scales it
        before the call, the other inside its denoiser: smalldiffusion's ``Scaled`` wrapper against a port
        that calls ``scale_model_input``). The factor at each call where one fits exactly is said. Empty
        otherwise."""
        if fit is None or not fit.exact or abs(fit.coefficients[1]) > 1e-6 or not self.pairs[0].output_match:
            return ""
        factors = []
        for i in range(len(self.pairs)):
            each = fit_affine(
                latents(self.port.calls[i], self.port_roles[i]), latents(self.ref.calls[i], self.ref_roles[i])
            )
            if each is None or not each.exact or abs(each.coefficients[1]) > 1e-6:
                break
            factors.append(each.coefficients[0])
        scale = format_number(factors[0], 6)
        changes = (
            f"; the factor changes with the call: {', '.join(format_number(f, 4) for f in factors)} at calls"
            f" 0–{len(factors) - 1}"
            if len(factors) > 1 and max(factors) > min(factors) * (1 + 1e-4)
            else ""
        )
        return (
            f"the first call's latents differ by a factor (the port's are {scale} × the reference's, exact),"
            f" and that call's outputs agree: the two denoisers take their input in other scales (one side"
            f" scales it before the call, the other inside its denoiser), not other noise{changes}"
        )

    # --------------------------------------------------------------------------------------- 2. schedule
    def schedule(self) -> None:
        from paritykit.schedule import compare_schedules

        t_ref, t_port = self.t_ref, self.t_port
        if None in t_ref or None in t_port:
            self.skip("schedule", "a side's denoiser calls carry no recognisable timestep argument")
            return
        if len(t_ref) == len(t_port) and all(p.timestep_match for p in self.pairs):
            units = f" ({self.t_units.words}: compared and replayed so)" if self.t_units.words else ""
            # what was compared is the timesteps the denoiser saw; the noise levels each update uses (betas,
            # alphas, sigmas) reach it only through the update, which its own check compares
            self.rule_out("schedule", f"the {len(t_ref)} timesteps agree{units}", check="timesteps")
            return
        structure = per_step_calls(t_ref, t_port)
        if structure is not None:
            k_ref, k_port = structure
            t_ref, t_port = t_ref[::k_ref], t_port[::k_port]
            units = timestep_units(t_ref, t_port)
        repeated = repeats(self.t_ref, self.t_port)
        if structure is not None and all(same_timestep(units(r), p) for r, p in zip(t_ref, t_port)):
            side, times = ("reference", k_ref // k_port) if k_ref > k_port else ("port", k_port // k_ref)
            repeated = repeated or (side, times)
        if repeated:
            side, times = repeated
            self.findings.append(
                Finding(
                    "schedule",
                    None,
                    f"the {side} calls the denoiser {times} times per timestep where the other "
                    "calls it once (guidance halves run separately against one batch): the calls cannot be "
                    "paired one to one (a lead: batch the halves on one side to compare them; guidance off"
                    " leaves guidance's own inputs uncompared)",
                    evidence=[
                        f"reference {head(t_ref)}",
                        f"port      {head(t_port)}",
                        "the timesteps agree once the repeats are collapsed",
                    ],
                )
            )
            return
        if structure is not None:
            first = next(
                (i for i, (r, p) in enumerate(zip(t_ref, t_port)) if not same_timestep(units(r), p)), 0
            )
            where = (
                f"the timesteps differ from value {first} ({len(t_ref)} values on both sides once repeats are"
                f" collapsed: the reference calls its denoiser {k_ref} time(s) per timestep, the port"
                f" {k_port})"
            )
            first = first * k_ref
        else:
            first = next((p.index for p in self.pairs if not p.timestep_match), len(self.pairs))
            read = (
                f"; read in other units, as the first {self.t_lead} call(s) agree so: {self.t_units.words}"
                if self.t_lead
                else ""
            )
            where = (
                f"the timesteps differ from call {first} "
                f"({len(t_ref)} calls in the reference, {len(t_port)} in the port{read})"
            )
        cast = rounded_to([(units if structure is not None else self.t_units)(t) for t in t_ref], t_port)
        if cast is not None:
            # every timestep the port's denoiser gets is the reference's rounded: the schedule itself agrees
            self.findings.append(
                Finding(
                    "schedule",
                    first,
                    f"the timesteps the port's denoiser gets are the reference's rounded to {cast}, every"
                    " one: a cast between the scheduler's list and the denoiser",
                    evidence=[f"reference {head(t_ref)}", f"port      {head(t_port)}"],
                )
            )
            return
        comparison = compare_schedules(t_ref, t_port)
        evidence = [
            f"reference {head(t_ref)}",
            f"port      {head(t_port)}",
            *(f"{h.message} (A: the reference, B: the port)" for h in getattr(comparison, "hints", [])[:3]),
            *self._converted_timesteps(t_port),
        ]
        finding = Finding(
            "schedule",
            first,
            where,
            evidence=evidence,
            **command_and_files(
                self.commands.schedule(
                    self.port_scheduler if self.spec.has("port_scheduler") else None,
                    self.layout.port_shape[1] if self.layout is not None else None,
                )
            ),
            details=comparison.to_dict(),
        )
        self._fit_schedule(finding)
        self.findings.append(finding)

    # --------------------------------------------------------------------------------------- 4. denoiser
    def denoiser(self, call: int | None = None) -> None:
        r"""The port's denoiser fed the reference's inputs of one call (the first whose inputs agree, else
        call 0): a difference there is the module's own, whatever differs upstream. Where every call's
        outputs agree although some call's inputs differ (inputs in other scales that each denoiser takes in
        its own way), no replay on the reference's inputs is run: the runs already answer."""
        pairs = self.pairs
        if call is None and pairs and all(p.output_match for p in pairs):
            apart = [p.index for p in pairs if not p.inputs_agree]
            if apart:
                self.rule_out(
                    "denoiser",
                    f"every call's outputs agree ({len(pairs)} calls) although the inputs differ at"
                    f" {len(apart)} of them (from call {apart[0]}): what differs there does not reach the"
                    " denoisers' outputs, so neither is bisected",
                )
                return
        if call is None:
            call = next((p.index for p in self.pairs if p.inputs_agree), 0)
        ref_x, port_x = (
            latents(self.ref.calls[call], self.ref_roles[call]),
            latents(self.port.calls[call], self.port_roles[call]),
        )
        if ref_x is not None and port_x is not None and tuple(ref_x.shape) != tuple(port_x.shape):
            self.skip(
                "denoiser",
                f"not bisected on call {call}: its latents differ in shape (reference {tuple(ref_x.shape)},"
                f" port {tuple(port_x.shape)}), so the port's module cannot be fed the reference's inputs",
            )
            return
        apart = self._timestep_ranges_apart()
        if apart:
            self.skip("denoiser", f"not bisected on call {call}: {apart}")
            return
        if self.pairs[call].unpaired:
            # an input of another length stays the port's own: the module would not be isolated, and what
            # differs could come from that input
            self.skip(
                "denoiser",
                f"not bisected on call {call}: a conditioning input has another length on each side, so the"
                " port's module cannot be fed the reference's inputs (see the conditioning finding)",
            )
            return
        rows = None
        ref_call, port_call = (
            self.ref.calls[call],
            self.port_run.calls[call] if self.grouping is None else None,
        )
        port_roles = self.port_roles[call]
        if self.grouping is not None:
            # the port's first call of the step against the block of the reference's batch it computes
            found = self.grouping.first_of(call, self.port_run.calls)
            if found is None:
                self._grouped_denoiser(call)
                return
            port_call, rows = found
            port_roles = roles_of(port_call)
        moved = rerun_moves(self.ref.denoiser, ref_call)
        if moved is not None:
            self.skip(
                "denoiser",
                f"not bisected on call {call}: the reference's denoiser, run again on its recorded"
                f" call-{call} inputs, gives another output than the run recorded (relative"
                f" {format_number(moved)}): the module handed over is not in the state that ran (weights"
                " swapped in a scope such as EMA, hooks, randomness), so a replay would compare something"
                " else",
            )
            return
        options = {
            "t_units": self.t_units,
            "layout": self.layout.to_port if self.layout is not None else None,
        }
        mapped = with_reference_values(ref_call, self.ref_roles[call], port_call, port_roles, **options)
        own = kept_own(ref_call, self.ref_roles[call], port_call, port_roles, **options)
        report = self._bisect(self.ref.denoiser, self.port.denoiser, ref_call, mapped, rows)
        if not module_differs(report, self.pairs[call].inputs_agree and not self.pairs[call].output_match):
            self.rule_out(
                "denoiser",
                f"the port's module matches the reference's on call {call}'s inputs" + masked_words(report),
            )
            return
        finding = bisect_finding("denoiser", call, report, kept=own)
        if not self.pairs[call].inputs_agree:
            finding.evidence.insert(
                0, f"the port's own call-{call} inputs differ; it was fed the reference's"
            )
        finding.command, finding.files = self.commands.bisect("denoiser", call, ref_call, mapped, rows)
        self.findings.append(finding)

    def _grouped_denoiser(self, call: int) -> None:
        pair = self.pairs[call]
        if pair.inputs_agree and pair.output is not None and not pair.output.passed:
            self.findings.append(
                Finding(
                    "denoiser",
                    call,
                    f"the denoiser's output differs at call {call} while its inputs agree"
                    f" ({self.grouping.words()}); not bisected: a replay feeds the calls one at a time",
                    evidence=comparison_evidence(pair.output),
                )
            )
            return
        self.skip("denoiser", f"not bisected on call {call}: {self.grouping.words()}")

    def _bisect(
        self,
        reference: Any,
        port: Any,
        ref_call: Call,
        port_inputs: tuple[tuple, dict],
        rows: tuple[int, int] | None = None,
    ) -> Any:
        from paritykit.bisection import bisect
        from paritykit.tracing.recording import output_tensor

        layout = self.layout

        def select(side: str, value: Any) -> Any:  # the port's output read in the reference's layout
            found = output_tensor(value)
            if side == "reference" and rows is not None:
                return found[rows[0] : rows[1]]
            return layout.to_reference(found) if side == "port" and layout is not None else found

        # a module on one call's inputs is held to bisect's own per-dtype tolerances, or the SPEC's
        return bisect(
            reference,
            port,
            (ref_call.args, ref_call.kwargs),
            port_inputs=lambda a, k: port_inputs,
            select_output=select if layout is not None or rows is not None else None,
            atol=self.spec.tolerance.get("atol"),
            rtol=self.spec.tolerance.get("rtol"),
        )

    # ----------------------------------------------------------------------------------------- 5. update
    def update(self, step: int | None = None) -> None:
        fits = [self._update_fits(i) for i in range(len(self.pairs))]
        comparable = [
            i
            for i, (fr, fp) in enumerate(fits)
            if fr is not None and fp is not None and self._same_step_times(i)
        ]
        if step is not None and step not in comparable:
            comparable.append(step)
        for i in sorted(comparable):
            fr, fp = fits[i]
            if fr is None or fp is None:
                continue
            if not (fr.exact and fp.exact):
                continue
            differences = coefficient_differences(fr, fp)
            if differences:
                self.findings.append(
                    Finding(
                        "update",
                        i,
                        f"the update from call {i} to the next differs: " + "; ".join(differences),
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
            why = (
                "a side's update is not a linear rule of its latents and outputs"
                if fr is None or fp is None or not (fr.exact and fp.exact)
                else "the fitted rules agree, yet the next latents differ"
            )
            self.findings.append(
                Finding(
                    "update",
                    step,
                    f"the latents after step {step} differ while that step's inputs and output "
                    f"agree: the sampler's update (cause unknown: {why})",
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
        if checked and len(checked) == len(self.pairs):
            self.rule_out("update", words)
        elif checked:
            # a rule-out covers every update or none: the calls left out may hold the difference
            missed: dict[str, list[int]] = {}
            for i in range(len(self.pairs)):
                if i not in checked:
                    missed.setdefault(self._why_no_update_rule(i, fits[i]), []).append(i)
            said = "; ".join(f"not compared at calls {runs(calls)}: {why}" for why, calls in missed.items())
            self.skip("update", f"{words}; {said}")
        else:
            words = self._timesteps_words()
            self.skip(
                "update",
                "no step with an exact linear rule whose timesteps agree on both sides"
                if words == "the timesteps differ"
                else f"no step compared: {words}",
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
                residual = format_number(found.residual)
                return f"the {side}'s update is no exact linear rule there (residual {residual})"
        return "not compared"

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

    def _update_fits(self, i: int):
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

    def final_latents_differ(self) -> bool:
        if self.ref.vae is not None or self.port.vae is not None or not self.pairs:
            return False
        a, b = self.ref.result, self.port.result
        return tuple(a.shape) == tuple(b.shape) and not compare(a, b, self.tol, "final latents").passed

    def _coverage(self, missed: bool = True) -> str:
        r"""What the run recorded and (``missed``) what it did not, for a difference found outside it."""
        recorded = [f"{len(self.ref.calls)} reference and {len(self.port.calls)} port denoiser calls"]
        missing = ["what runs after the last denoiser call"]
        if self.ref.vae is not None:
            recorded.append(f"{len(self.ref.decoder_calls)} and {len(self.port.decoder_calls)} decoder calls")
        else:
            last = latents(self.ref.calls[-1], self.ref_roles[-1]) if self.ref.calls else None
            shaped_like_latents = last is not None and tuple(last.shape) == tuple(self.ref.result.shape)
            if not shaped_like_latents:  # the result is not latents: something decodes them
                missing.append("the decoder (give reference_vae() and port_vae() to record it)")
        said = f"recorded: {'; '.join(recorded)}"
        return f"{said}; not recorded: {'; '.join(missing)}" if missed else said

    # ------------------------------------------------------------------------------------- result, curve
    def result_comparison(self) -> dict[str, Any]:
        a, b = self.ref.result, self.port.result
        if tuple(a.shape) != tuple(b.shape):
            return {"error": f"shapes differ: reference {tuple(a.shape)}, port {tuple(b.shape)}"}
        c = compare(a, b, self.tol, "result")
        peak = float(a.detach().abs().max()) if a.numel() and a.is_floating_point() else 0.0
        return {
            "passed": c.passed,
            "max_abs": c.max_abs,
            "peak": peak,
            "cosine": c.cosine,
            "evidence": comparison_evidence(c),
        }

    def curve(self) -> list[CallError]:
        if None not in self.t_ref and None not in self.t_port and per_step_calls(self.t_ref, self.t_port):
            # call i of one side is not call i of the other: a row per call would pair unlike calls
            self.skip(
                "denoiser",
                "no per-call table: the two sides call their denoiser a different number of"
                " times per timestep",
                check="calls",
            )
            return []
        rows = []
        for p in self.pairs:
            i = p.index
            rows.append(
                CallError(
                    i,
                    p.t_reference,
                    p.t_port,
                    rel(
                        latents(self.ref.calls[i], self.ref_roles[i]),
                        latents(self.port.calls[i], self.port_roles[i]),
                    ),
                    rel(output(self.ref.calls[i]), output(self.port.calls[i])),
                )
            )
        return rows


def _timesteps(calls: list[Call]) -> list[float | None]:
    return [timestep(c, roles_of(c)) for c in calls]
