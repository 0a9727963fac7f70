r"""The decoder's places of triage's walk: the decoder's input scaling (a scale and per-channel shift fitted),
the decoder module bisected on the reference's recorded input, and the post-processing (each side's result as
a scale and shift of its own decoder output). A mixin of :class:`paritykit.triage.walk.Triage`, which holds
the runs they read."""

from __future__ import annotations

from paritykit.base.report import format_number
from paritykit.tracing.recording import Call
from paritykit.triage.fits import affine_words, coefficient_differences, fit_affine
from paritykit.triage.measures import (
    THE_REFERENCES,
    bisect_finding,
    command_and_files,
    first_tensor,
    identity,
    masked_words,
    module_differs,
    unclamped_affine,
    with_first_tensor,
)
from paritykit.triage.pairs import compare, comparison_evidence, rel
from paritykit.triage.report import Finding
from paritykit.triage.roles import output


class DecoderChecks:
    r"""The checks of :class:`~paritykit.triage.walk.Triage` after the last denoiser call."""

    # ---------------------------------------------------------------------------------------- 6. decoder
    def decoder(self, independent: bool) -> None:
        if self.ref.vae is None or self.port.vae is None:
            if self.ref.vae is not None or self.port.vae is not None:
                self.skip("decoder", "only one side's SPEC defines its vae()")
            return
        if not self.ref.decoder_calls or not self.port.decoder_calls:
            self.skip("decoder", "a side's vae() module was never called during its run")
            return
        ref_call, port_call = self.ref.decoder_calls[-1], self.port.decoder_calls[-1]
        zr, zp = first_tensor(ref_call), first_tensor(port_call)
        same_input = (
            zr is not None
            and zp is not None
            and zr.shape == zp.shape
            and compare(zr, zp, self.tol, "decoder input").passed
        )
        if not same_input and zr is not None and zp is not None:
            fit = fit_affine(zp, zr, per_channel=True)
            if fit is not None and fit.exact and not identity(fit):
                self.findings.append(
                    Finding(
                        "decoder input",
                        None,
                        f"the latents reach the decoder as {affine_words(fit, THE_REFERENCES)} (exact,"
                        f" residual {format_number(fit.residual)}): the scaling between the loop and the"
                        " decoder (scaling_factor, shift_factor) differs",
                        evidence=[
                            "fitted over every element of the decoder's input (relative error "
                            f"{format_number(rel(zr, zp))} before the fit)"
                        ],
                        **command_and_files(self.commands.compare_tensors("decoder_input", zr, zp)),
                    )
                )
                if not independent:
                    return
            elif not independent:
                residual = f"residual {format_number(fit.residual)}" if fit is not None else "shapes differ"
                self.findings.append(
                    Finding(
                        "decoder input",
                        None,
                        "the decoder's input differs though every denoiser call agrees: the last update"
                        " (after the last call) or the latents' preparation for the decoder; no scale and"
                        f" shift relates the two ({residual})",
                        evidence=comparison_evidence(compare(zr, zp, self.tol, "decoder input")),
                        **command_and_files(self.commands.compare_tensors("decoder_input", zr, zp)),
                    )
                )
                return
        mapped = with_first_tensor(port_call, zr)  # the reference's input, so the module alone is compared
        if mapped is None:
            self.skip("decoder", "the two decoders' inputs cannot be paired (shapes differ)")
            return
        report = self._bisect(self.ref.vae, self.port.vae, ref_call, mapped)
        if module_differs(report, same_input and not self._same_output(ref_call, port_call)):
            finding = bisect_finding("decoder", None, report)
            if not same_input:
                finding.evidence.insert(0, "the port's decoder was fed the reference's decoder input")
            finding.command, finding.files = self.commands.bisect(
                "decoder", len(self.ref.decoder_calls) - 1, ref_call, mapped
            )
            self.findings.append(finding)
            if independent:  # each side's map from its own decoder output holds whatever the decoders do
                self.post_processing(ref_call, port_call)
            return
        self.rule_out(
            "decoder", "the port's module matches on the reference's decoder input" + masked_words(report)
        )
        self.post_processing(ref_call, port_call)

    def _same_output(self, ref_call: Call, port_call: Call) -> bool:
        a, b = output(ref_call), output(port_call)
        return (
            a is not None
            and b is not None
            and a.shape == b.shape
            and compare(a, b, self.tol, "decoded").passed
        )

    def post_processing(self, ref_call: Call, port_call: Call) -> None:
        r"""Each side's result as a scale and shift of its own decoder's output, fitted where the result is
        not clamped; the two maps compared."""
        fr = unclamped_affine(self.ref.result, output(ref_call))
        fp = unclamped_affine(self.port.result, output(port_call))
        if fr is None or fp is None:
            self.skip("post-processing", "a result is not laid out like its decoder's output")
            return
        if not (fr.exact and fp.exact):
            self.skip(
                "post-processing",
                "a side's result is not a scale and shift of its decoder's output where unclamped",
            )
            return
        differences = coefficient_differences(fr, fp)
        if differences:
            self.findings.append(
                Finding(
                    "post-processing",
                    None,
                    "the decoded image is mapped differently: " + "; ".join(differences),
                    evidence=[
                        f"reference: result = {fr.text()} where unclamped",
                        f"port:      result = {fp.text()} where unclamped",
                    ],
                )
            )
        else:
            self.rule_out(
                "post-processing", "both results are the same scale and shift of the decoder's output"
            )
