r"""The conditioning place of triage's walk: every call's conditioning inputs paired and compared whole, a
difference in length measured on the rows both sides have, an input one side passes at some calls only said
as compared where both pass it, and a tensor the reference passes alike to calls that differ in a setting
compared on the rows whose setting agrees. A mixin of :class:`paritykit.triage.walk.Triage`, which holds the
runs they read."""

from __future__ import annotations

from typing import Any

from paritykit.triage.measures import command_and_files, runs
from paritykit.triage.pairs import Tolerance, compare, comparison_evidence
from paritykit.triage.report import Finding
from paritykit.triage.roles import argument, latents, output


class ConditioningChecks:
    r"""The conditioning checks of :class:`~paritykit.triage.walk.Triage`."""

    def _flagged_conditioning(self, tol: Tolerance) -> str:
        r"""A conditioning tensor the reference passes alike to its calls of a step that differ in a setting
        (``null_cond_prob`` 0 and 1) is compared on the rows of the calls whose setting value the port's rows
        agree with; the note that says so, once (empty when no call needed it)."""
        if self.grouping is None or self.grouping.side != "reference":
            return ""
        said = ""
        for pair in self.pairs:
            for n, (r, p, c) in enumerate(pair.conditioning):
                if c is None or c.passed:
                    continue
                a, b = argument(self.ref.calls[pair.index], r), argument(self.port.calls[pair.index], p)
                note, rows = self.grouping.flagged_rows(r, a, b, tol)
                if note:
                    pair.conditioning[n] = (r, p, compare(a[rows], b[rows], tol, r))
                    said = said or note
        return said

    def _stacked_channels(self, xr: Any, xp: Any) -> bool:
        r"""Latents with more channels than the denoiser's output, the output's count of them agreeing at one
        end and the rest not (round 36, AudioSR: the low-pass latents stacked on the noise as channels 4-7,
        scaled otherwise by the port): the noise ruled out on its channels, the stacked ones a conditioning
        finding. ``False`` (nothing said) unless exactly one end agrees, and it is the end the reference's
        second call changes while the rest stays."""
        out = output(self.ref.calls[0])
        if out is None or out.dim() != xr.dim() or xr.dim() < 2 or xr.shape != xp.shape:
            return False
        c, total = out.shape[1], xr.shape[1]
        if out.shape[0] != xr.shape[0] or out.shape[2:] != xr.shape[2:] or not 0 < c < total:
            return False
        ends = [(0, c, c, total), (total - c, total, 0, total - c)]
        agree = [
            (lo, hi, rest_lo, rest_hi)
            for lo, hi, rest_lo, rest_hi in ends
            if compare(xr[:, lo:hi], xp[:, lo:hi], self.tol, "noise").passed
        ]
        if len(agree) != 1:
            return False
        lo, hi, rest_lo, rest_hi = agree[0]
        rest = compare(xr[:, rest_lo:rest_hi], xp[:, rest_lo:rest_hi], self.tol, "stacked")
        if rest.passed or len(self.ref.calls) < 2:
            return False
        # which end is the sampler's state: it changes from the reference's first call to its second, the
        # conditioning stacked on it stays (no value alone tells the two apart)
        later = latents(self.ref.calls[1], self.ref_roles[1])
        if later is None or later.shape != xr.shape:
            return False
        import torch

        if torch.equal(later[:, lo:hi], xr[:, lo:hi]) or not torch.equal(
            later[:, rest_lo:rest_hi], xr[:, rest_lo:rest_hi]
        ):
            return False
        name = self.ref_roles[0].latents
        self.rule_out(
            "initial noise",
            f"channels {lo}-{hi - 1} of the first call's {name} (the output's {c}) agree; its other"
            f" {total - c} channels, stacked on them, are said at the conditioning place",
        )
        self.findings.append(
            Finding(
                "conditioning",
                0,
                f"channels {rest_lo}-{rest_hi - 1} of the denoiser's {name} input, stacked on the {c}"
                " channels the output has (conditioning given as channels), differ at call 0, before any"
                " denoiser computation",
                evidence=comparison_evidence(rest),
            )
        )
        return True

    # ----------------------------------------------------------------------------------- 3. conditioning
    def conditioning(self) -> None:
        r"""Every call's conditioning inputs, paired by shape and compared whole; two that differ in length
        only are compared on the part both have, and the difference in length is the finding."""
        if not self.pairs or not any(p.conditioning or p.unpaired for p in self.pairs):
            self.skip("conditioning", "no conditioning inputs paired between the two denoisers")
            return
        for pair in self.pairs:
            if pair.unpaired:
                self.findings.append(
                    Finding(
                        "conditioning",
                        pair.index,
                        f"a conditioning input differs in length at call {pair.index}: " + pair.unpaired[0],
                        evidence=pair.unpaired[1:],
                    )
                )
                return
            bad = [(r, p, c) for r, p, c in pair.conditioning if not c.passed]
            if bad:
                r, p, c = bad[0]
                self.findings.append(
                    Finding(
                        "conditioning",
                        pair.index,
                        f"the denoiser's conditioning input {r} (port: {p}) differs at call {pair.index},"
                        " before any denoiser computation",
                        evidence=comparison_evidence(c),
                        **command_and_files(self.commands.compare(pair.index, r, p)),
                    )
                )
                return
        first = self.pairs[0]
        ordered = f" ({self.batch_order.words()})" if self.batch_order is not None else ""
        if self.cond_layouts:
            ordered += (
                " (the port's "
                + ", ".join(f"{p} {layout.port_shape}" for p, layout in self.cond_layouts.items())
                + " hold the reference's values rearranged, "
                + ", ".join(
                    f"{layout.moved()} of {layout.index.numel()} elements moved"
                    for layout in self.cond_layouts.values()
                )
                + ": an exact index map read at the first call; compared in the reference's layout, and the"
                " denoiser replayed on the reference's values laid out as the port's)"
            )
        everywhere, partly = self._conditioning_coverage()
        if everywhere:
            self.rule_out(
                "conditioning",
                f"{', '.join(everywhere)} are equal in shape and agree element by element "
                + (
                    f"at all {len(self.pairs)} calls"
                    if len(self.pairs) > 1
                    else "at the first call, the one compared"
                )
                + ordered,
            )
        for words, missing in partly:
            self.skip(
                "conditioning",
                f"{words} agree element by element at the calls where both sides pass them; at calls"
                f" {runs(missing)} one side passes none, so they are not compared there",
            )
        if first.one_sided:
            self.skip(
                "conditioning",
                "paired with no input of the other side by name, shape or value, not compared: "
                + ", ".join(first.one_sided),
            )

    def _inputs_words(self) -> str:
        r"""What of the calls' inputs was compared at every call: the timestep only where both sides pass one
        the walk reads, the conditioning only where each input is passed at every call."""
        unread = None in self.t_ref or None in self.t_port
        _, partly = self._conditioning_coverage()
        if not unread and not partly:
            return "inputs, timestep"
        said = "latents, conditioning" + (
            " (where both sides pass it: " + "; ".join(w for w, _ in partly) + " at some calls only)"
            if partly
            else ""
        )
        return said + ("" if unread else ", timestep")

    def _conditioning_coverage(self) -> tuple[list[str], list[tuple[str, list[int]]]]:
        r"""The conditioning pairs compared at every call (``"r / p (shape)"``), and those compared at some
        calls only, with the calls where one side passes no such input (a port whose unconditional pass
        gives ``text_ids=None`` where the reference passes its text with a drop flag)."""
        seen: dict[tuple[str, str], list[int]] = {}
        shape: dict[tuple[str, str], tuple] = {}
        for pair in self.pairs:
            for r, p, c in pair.conditioning:
                seen.setdefault((r, p), []).append(pair.index)
                shape.setdefault((r, p), tuple(c.shape_a))
        everywhere, partly = [], []
        for key, calls in seen.items():
            words = f"{key[0]} / {key[1]} {shape[key]}"
            if len(calls) == len(self.pairs):
                everywhere.append(words)
            else:
                partly.append((words, [p.index for p in self.pairs if p.index not in calls]))
        return everywhere, partly
