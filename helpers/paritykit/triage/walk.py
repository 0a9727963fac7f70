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

from paritykit.base.errors import ParityKitError
from paritykit.base.report import environment_stamp, format_number
from paritykit.base.usercode import Spec
from paritykit.tracing.recording import Call
from paritykit.triage.conditioning_checks import ConditioningChecks
from paritykit.triage.decoder_checks import DecoderChecks
from paritykit.triage.fits import affine_words, fit_affine
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
    conditioning_layouts,
    leading_units,
    rel,
    same_timestep,
    timestep_units,
    view_conditioning,
)
from paritykit.triage.report import PLACE_ORDER, CallError, Finding, Note, Place, TriageReport
from paritykit.triage.reproduce import Commands
from paritykit.triage.roles import (
    agreeing_latents,
    kept_own,
    latents,
    output,
    repeated_batch,
    roles_of,
    timestep,
    with_reference_values,
)
from paritykit.triage.schedule_checks import ScheduleChecks
from paritykit.triage.sides import SideRun
from paritykit.triage.sign_convention import NEGATED, negated_error
from paritykit.triage.units_check import UnitsMeasured, units_measured
from paritykit.triage.update_checks import UpdateChecks


class Triage(ScheduleChecks, ConditioningChecks, UpdateChecks, DecoderChecks):
    r"""The comparison of two recorded runs; :meth:`report` walks the places."""

    def __init__(
        self, spec: Spec, tol: Tolerance, ref: SideRun, port: SideRun, commands: Commands, all_causes: bool
    ):
        self.spec, self.tol, self.ref = spec, tol, ref
        self.commands, self.folders, self.all_causes = commands, commands.folders, all_causes
        self.findings: list[Finding] = []
        self.update_fit_memo: dict[int, tuple] = {}  # each call's fitted update rules (UpdateChecks)
        self.ruled_out: list[Note] = []
        self.not_checked: list[Note] = []
        self.recorded_calls = (len(ref.calls), len(port.calls))
        recorded = port
        # k calls per timestep on one side against one batched call on the other: compared step by step
        self.grouping = CallGroups.read(ref.calls, port.calls, _timesteps(ref.calls), _timesteps(port.calls))
        self.ref_single = ref.calls  # the reference's calls as recorded, one per pass
        if self.grouping is not None and self.grouping.side == "reference":
            ref = self.ref = dataclasses.replace(ref, calls=self.grouping.merge(ref.calls))
        elif self.grouping is not None:
            port = dataclasses.replace(port, calls=self.grouping.merge(port.calls))
        self.ref_roles = [roles_of(c) for c in ref.calls]
        self.port_roles = [roles_of(c) for c in port.calls]
        self.ref_roles, self.port_roles = agreeing_latents(
            ref.calls, self.ref_roles, port.calls, self.port_roles
        )
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
        # conditioning the port holds rearranged (its weights converted to read it so): compared in the
        # reference's layout, and given the reference's values in the port's layout when replayed
        self.cond_layouts = {}
        if ref.calls and self.port.calls:
            self.cond_layouts = conditioning_layouts(
                ref.calls[0], self.ref_roles[0], self.port.calls[0], self.port_roles[0], tol
            )
        if self.cond_layouts:
            self.port = dataclasses.replace(
                self.port, calls=[view_conditioning(c, self.cond_layouts) for c in self.port.calls]
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
        self.units_measured, self.units_rejected = self._measure_units(), None
        if self.units_measured is not None and self.units_measured.contradicted:
            # the port's network takes the reference's values as they are: no map, the timesteps differ
            self.units_rejected, self.t_units, self.t_lead = self.t_units, SAME_UNITS, 0
        self.pairs = [
            compare_call(
                i, ref.calls[i], self.ref_roles[i], self.port.calls[i], self.port_roles[i], tol, self.t_units
            )
            for i in range(n)
        ]
        # other numbers of calls that no grouping pairs: the first calls are one call on both sides, the
        # k-th calls after them need not be (a guidance pass, a second stage); only the table shows them
        self.table_pairs = self.pairs
        self.by_order = self.grouping is None and len(ref.calls) != len(self.port.calls)
        if self.by_order:
            self.pairs = self.pairs[:1]
            self.skip(
                "denoiser",
                f"calls after the first: the sides make {len(ref.calls)} and {len(self.port.calls)} calls and"
                " no grouping pairs them, so only the first calls are compared (the table shows the rest by"
                " order)",
                check="calls",
            )
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
            by_order=self.by_order,
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
            repeated = batch_repeats(xr, xp)
            if repeated:
                self.rule_out("initial noise", f"the first call's latents agree: {repeated}")
                return
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
            self.rule_out("initial noise", f"the first call's latents agree{laid_out}{self.later_draws()}")
            return
        if self._stacked_channels(xr, xp):
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
            summary += (
                "; a lead: the first call's input is scaled otherwise, by the noise's own scale"
                " (init_noise_sigma, sigma_max) or by a preconditioning of the denoiser's input (c_in and"
                " what sets it, such as sigma_data)"
            )
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
        if not pair.timestep_match:
            # round 31 (EDM with churn): the port churned its first step, noising its latents further for a
            # higher level; the line read as other initial noise
            summary += (
                "; call 0's timestep differs too, so a lead: the latents may be prepared for that other level"
                " (scaled by it, or noised further as a churn step does) from the same initial noise"
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
            measured = self.units_measured
            if self.t_units.words and (measured is None or not measured.supported):
                # read in other units by their values alone: whether the port's network takes them so is
                # what makes them one schedule, and it is not settled
                how = measured.words() if measured is not None else "the port's denoiser could not be run so"
                self.skip(
                    "schedule",
                    f"the {len(t_ref)} timesteps agree only read in other units ({self.t_units.words}), and"
                    f" not settled by measurement: {how}; compared and replayed read so",
                )
                return
            units = f" ({self.t_units.words}: measured: {measured.words()})" if self.t_units.words else ""
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
        if self.units_rejected is not None:
            finding.evidence.insert(
                2,
                f"read as {self.units_rejected.words} they would agree, but {self.units_measured.words()}:"
                " the port feeds its network other values than the reference feeds its own",
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
        convention = self.sign_convention if call is None else ""
        if convention:
            self.rule_out("denoiser", convention)
            return
        if call is None:
            call = next((p.index for p in self.pairs if p.inputs_agree), 0)
        ref_x, port_x = (
            latents(self.ref.calls[call], self.ref_roles[call]),
            latents(self.port.calls[call], self.port_roles[call]),
        )
        apart = ref_x is not None and port_x is not None and tuple(ref_x.shape) != tuple(port_x.shape)
        if apart and not batch_repeats(ref_x, port_x).startswith("the port's"):
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
        port_roles, ref_roles = self.port_roles[call], self.ref_roles[call]
        if self.grouping is not None and self.grouping.side == "reference":
            # the reference's first call in the stacking order against the port's call cut to its rows
            found = self.grouping.one_of(call, self.ref_single, self.port_run.calls[call])
            if found is None or self.grouping.settings_apart:
                self._grouped_denoiser(call)
                return
            ref_call, port_call = found
            ref_roles, port_roles = roles_of(ref_call), roles_of(port_call)
        elif self.grouping is not None:
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
            "laid_out": self.cond_layouts,
        }
        mapped = with_reference_values(ref_call, ref_roles, port_call, port_roles, **options)
        own = kept_own(ref_call, ref_roles, port_call, port_roles, **options)
        # with --all, every culprit: each found with the ones before given the reference's outputs
        try:
            report = self._bisect(
                self.ref.denoiser, self.port.denoiser, ref_call, mapped, rows, all_culprits=self.all_causes
            )
        except ParityKitError:
            raise
        except Exception as exc:  # a replay the two calls cannot drive: said, the other places still run
            self.skip(
                "denoiser",
                f"not bisected on call {call}: the replay on the reference's inputs raised"
                f" {type(exc).__name__}: {str(exc)[:160]}",
            )
            return
        if not module_differs(report, self.pairs[call].inputs_agree and not self.pairs[call].output_match):
            self.rule_out(
                "denoiser",
                f"the port's module matches the reference's on call {call}'s inputs" + masked_words(report),
            )
            return
        finding = bisect_finding("denoiser", call, report, kept=own)
        differ = self.pairs[call].differing_inputs()
        if self.pairs[call].latents is None and batch_repeats(
            latents(ref_call, self.ref_roles[call]), latents(self.port.calls[call], port_roles)
        ):
            differ = differ[1:]  # the latents hold the same values, repeated along the batch
        if not self.pairs[call].inputs_agree and differ:
            finding.evidence.insert(
                0,
                f"the port's own call-{call} inputs are not the reference's ({'; '.join(differ)}); it was fed"
                " the reference's",
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
        all_culprits: bool = False,
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
            all_culprits=all_culprits,
        )

    def _measure_units(self) -> UnitsMeasured | None:
        r"""Call 0 replayed on the port's denoiser with the timestep in the units the values suggest and as
        given (:mod:`paritykit.triage.units_check`); ``None`` when the timesteps need no map or the calls
        are grouped."""
        if self.t_units is SAME_UNITS or self.grouping is not None or not self.ref.calls:
            return None
        if not self.port_run.calls:
            return None
        n = min(len(self.ref.calls), len(self.port.calls))
        flipped = negated_error(
            [output(c) for c in self.ref.calls[:n]], [output(c) for c in self.port.calls[:n]]
        )
        # the first call the map moves: one at t = 0 reads the same both ways (Matcha's first call)
        moved = [
            i
            for i in range(n)
            if self.t_ref[i] is not None and not same_timestep(self.t_units(self.t_ref[i]), self.t_ref[i])
        ]
        if not moved:
            return None
        i = moved[0]
        return units_measured(
            self.ref.denoiser,
            self.port.denoiser,
            self.ref.calls[i],
            self.ref_roles[i],
            self.port_run.calls[i],
            self.port_roles[i],
            self.t_units,
            self.layout,
            sign=-1.0 if flipped is not None and flipped <= NEGATED else 1.0,
            call=i,
        )

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
        for p in self.table_pairs:
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


def batch_repeats(reference: Any, port: Any) -> str:
    r"""Words where one side's latents are the other's repeated along the batch, every row exactly (round 33,
    f5-tts: the research doubles its batch for guidance inside its denoiser, the port before the call); empty
    otherwise."""
    if reference is None or port is None:
        return ""
    for small, large, who in ((reference, port, "port"), (port, reference, "reference")):
        times = repeated_batch(small, large)
        if times:
            return (
                f"the {who}'s {tuple(large.shape)} are the other's {tuple(small.shape)} repeated {times}"
                " times along the batch (a guidance batch made before the call on one side, inside the"
                " denoiser on the other)"
            )
    return ""


def _timesteps(calls: list[Call]) -> list[float | None]:
    return [timestep(c, roles_of(c)) for c in calls]
