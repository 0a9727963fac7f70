"""Flow-matching schedules from the research code people compare against: Flux's size-dependent schedule
(black-forest-labs/flux, shifted once) and SD3's sampler (Stability's sd3_infer.py, low end shifted twice),
both written in tests/reference_loops.py from that code, never from diffusers.

The fit must find the set_timesteps call (sigmas=np.linspace(1, 1/n, n), mu= with dynamic shifting) and read
mu as a function of the image size; `schedule A B` must name a shift applied twice and stay silent on
look-alikes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from paritykit import compare_schedules, fit_scheduler
from paritykit.cli import cli

from tests import reference_loops as R

STEPS = 10
FLOW = "FlowMatchEulerDiscreteScheduler"


def flux_spec(tmp_path, base_shift=0.5, max_shift=1.15):
    spec = tmp_path / f"flux_{base_shift}_{max_shift}.py"
    spec.write_text(
        "import math\nfrom tests.reference_loops import flux_mu\n\ndef ref_schedule(n, image_seq_len):\n   "
        f" mu = flux_mu(image_seq_len, {base_shift}, {max_shift})\n    times = [1 - i / n for i in range(n +"
        " 1)]\n    return {'sigmas': [math.exp(mu) / (math.exp(mu) + (1 / t - 1)) if t > 0 else 0.0 for t"
        " in times]}\n"
    )
    return spec


def test_flux_reference_with_its_own_formula_matches_what_flux_code_computes():
    # the SPEC above restates R.flux_sigmas with other shifts; at Flux's defaults they are one schedule
    sig = R.flux_sigmas(STEPS, 4096)
    assert sig[0] == 1.0 and sig[-1] == 0.0 and len(sig) == STEPS + 1
    mu = R.flux_mu(4096)
    assert mu == pytest.approx(1.15)
    t = 1 - 3 / STEPS
    assert sig[3] == pytest.approx(math.exp(mu) / (math.exp(mu) + 1 / t - 1))


def test_flux_schedule_is_fitted_with_the_call_and_mu_as_a_function_of_size(tmp_path):
    fit = fit_scheduler(FLOW, flux_spec(tmp_path), steps=STEPS, image_seq_len=[256, 4096])
    assert fit.exit_code == 0, fit.render()
    best = fit.fits[0]
    assert best.changes == {"use_dynamic_shifting": True}  # Flux's 0.5 / 1.15 are diffusers' defaults
    assert fit.call_line.startswith(
        "pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=calculate_shift("
    )
    assert best.mu[256] == pytest.approx(0.5) and best.mu[4096] == pytest.approx(1.15)
    assert 2176 in fit.sizes  # validated between the sizes given, too
    assert best.exact and "exact" in fit.render()
    # a static shift fits one size only: it is rejected at the other, never proposed
    static = [c for c in fit.rejected if "shift" in c.changes and not c.mu]
    assert static and any("seq 4096" in str(k) for k in static[0].failures)

    # the fix, pasted: diffusers' own calculate_shift at a size never fitted reproduces Flux's schedule
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        FlowMatchEulerDiscreteScheduler().config, **best.changes
    )
    c = scheduler.config
    for size in (1024, 3000):
        mu = calculate_shift(size, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 13, 13), mu=mu)
        assert scheduler.sigmas.double().tolist() == pytest.approx(
            R.flux_sigmas(13, size), rel=1e-6, abs=1e-7
        )


def test_other_size_constants_are_read_back_as_config_values(tmp_path):
    fit = fit_scheduler(FLOW, flux_spec(tmp_path, 0.3, 1.5), steps=STEPS, image_seq_len=[512, 2048])
    assert fit.fits[0].changes == pytest.approx(
        {"use_dynamic_shifting": True, "base_shift": 0.3, "max_shift": 1.5}
    )
    assert "base_shift=0.3" in fit.line and "max_shift=1.5" in fit.line


def test_once_shifted_list_is_fitted_with_the_linspace_call_and_the_double_shift_is_named():
    ref = {"sigmas": R.flux_sigmas(STEPS, 4096)}  # one size: a shift of e^1.15
    fit = fit_scheduler(FLOW, ref)
    assert (
        fit.exit_code == 0
        and fit.call_line == "pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n))"
    )
    shift = fit.fits[0].changes["shift"]
    assert shift == pytest.approx(math.exp(1.15), rel=1e-4)
    # against set_timesteps(n) with the same static shift: the shift is applied twice at the low end
    port = FlowMatchEulerDiscreteScheduler(shift=shift)
    port.set_timesteps(STEPS)
    cmp = compare_schedules(ref, {"sigmas": port.sigmas})
    assert cmp.exit_code == 1 and [h.id for h in cmp.hints] == ["shift-twice"]
    assert "B starts from an end point that was already shifted" in cmp.hints[0].message
    assert "unknown cause" not in cmp.render()
    # a measurement only: no advice that was never run (round 4: "use_dynamic_shifting with mu does the
    # latter" was false for Wan's schedule), no claim about other models' samplers
    assert (
        "use_dynamic_shifting" not in cmp.hints[0].message and "reference sampler" not in cmp.hints[0].message
    )


def test_sd3_against_set_timesteps_n_is_the_same_and_no_hint_fires():
    port = FlowMatchEulerDiscreteScheduler(shift=3.0)
    port.set_timesteps(STEPS)
    cmp = compare_schedules({"sigmas": R.sd3_sigmas(STEPS)}, {"sigmas": port.sigmas})
    assert cmp.exit_code == 0 and cmp.hints == []
    flux = {"sigmas": R.flux_sigmas(STEPS, 1024)}
    assert compare_schedules(flux, flux).hints == []


def test_a_shift_difference_is_not_called_a_double_shift():
    a = {"sigmas": R.sd3_sigmas(STEPS, shift=3.0)}
    b = {"sigmas": R.sd3_sigmas(STEPS, shift=2.0)}
    cmp = compare_schedules(a, b)
    assert cmp.exit_code == 1 and "shift-twice" not in [h.id for h in cmp.hints]
    assert [h.id for h in cmp.hints] == ["sigma-family"]


def test_flux_port_end_to_end_with_the_fitted_call(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Conv2d(4, 4, 3, padding=1).double()

    def denoiser(x, t, cond):
        return model(x) * (1 + t / 1000)

    noise = torch.randn(1, 4, 8, 8, dtype=torch.float64)
    ref = R.flow_loop(denoiser, noise, None, R.flux_sigmas(STEPS, 1024))
    fit = fit_scheduler(FLOW, flux_spec(tmp_path), steps=STEPS, image_seq_len=[256, 4096])
    scheduler = FlowMatchEulerDiscreteScheduler(**fit.fits[0].changes)
    c = scheduler.config
    mu = calculate_shift(1024, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / STEPS, STEPS), mu=mu)
    x = noise
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(denoiser(x, t.double(), None), t, x, return_dict=False)[0]
        default = FlowMatchEulerDiscreteScheduler(shift=math.exp(mu))
        default.set_timesteps(STEPS)
        y = noise
        for t in default.timesteps:
            y = default.step(denoiser(y, t.double(), None), t, y, return_dict=False)[0]
    assert (x - ref).abs().max() < 1e-5 * ref.abs().max()
    assert (y - ref).abs().max() > 1e-3 * ref.abs().max()  # the double-shifted default really differs


def test_cli_fit_with_sizes_and_its_bad_input(tmp_path):
    spec = flux_spec(tmp_path)
    ok = CliRunner().invoke(
        cli, ["schedule", str(spec), "--fit", FLOW, "--steps", "8", "--image-seq-len", "256,4096"]
    )
    assert ok.exit_code == 0, ok.output
    assert "mu=calculate_shift(" in ok.output and "fit: exact" in ok.output
    for args, named in (
        ([str(spec), "--fit", FLOW, "--steps", "8"], "--image-seq-len"),
        ([str(spec), "--fit", FLOW, "--steps", "8", "--image-seq-len", "256"], "two or more sizes"),
        ([str(spec), "--fit", FLOW, "--steps", "8", "--image-seq-len", "a,b"], "whole numbers"),
    ):
        bad = CliRunner().invoke(cli, ["schedule", *args])
        lines = [line for line in bad.output.splitlines() if line.strip()]
        assert bad.exit_code == 2 and len(lines) == 1 and named in lines[0], bad.output


# ------------------------------------------------------------------------------------- recordings at several
# sizes
def _record_flux(tmp_path, seq, n=STEPS, sigmas=None):
    from tests.sampling import denoiser, record, tiny_cond_unet, tiny_inputs

    unet, (noise, cond) = tiny_cond_unet(), tiny_inputs()
    sigmas = sigmas or R.flux_sigmas(n, seq)
    return record(
        unet, tmp_path / f"ref_{seq}", lambda: R.flow_loop(denoiser(unet), noise, cond, sigmas), True
    )


def test_recordings_at_two_sizes_give_mu_as_a_line_and_say_it_is_unchecked_between(tmp_path):
    folders = {seq: _record_flux(tmp_path, seq) for seq in (256, 4096)}
    fit = fit_scheduler(FLOW, folders)  # the recordings hold the model's timesteps, t = 1000 σ
    assert fit.fits[0].changes == {"use_dynamic_shifting": True} and fit.sizes == [256, 4096]
    assert fit.fits[0].mu == {256: pytest.approx(0.5), 4096: pytest.approx(1.15)} and fit.fits[0].exact
    assert fit.call_line.startswith(
        "pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=calculate"
    )
    assert any("not checked between them" in n for n in fit.notes)
    # a third recorded size checks the line: the note goes, and a size off the line is refused
    folders[1024] = _record_flux(tmp_path, 1024)
    three = fit_scheduler(FLOW, folders)
    assert three.line == fit.line and not any("between them" in n for n in three.notes)
    folders[1024] = _record_flux(
        tmp_path, 999, sigmas=R.flux_sigmas(STEPS, 4096 * 4)
    )  # not Flux's mu at 1024
    bent = fit_scheduler(FLOW, folders)
    assert any("mu is not linear in image_seq_len" in n for n in bent.notes)


def test_recordings_of_a_size_independent_schedule_fit_a_static_shift(tmp_path):
    from tests.sampling import denoiser, record, tiny_cond_unet, tiny_inputs

    unet, (noise, cond) = tiny_cond_unet(), tiny_inputs()
    folders = {
        seq: record(
            unet,
            tmp_path / f"sd3_{seq}",
            lambda: R.flow_loop(denoiser(unet), noise, cond, R.sd3_sigmas(STEPS)),
        )
        for seq in (256, 4096)
    }
    fit = fit_scheduler(FLOW, folders)
    assert fit.line == f"{FLOW}.from_config(pipe.scheduler.config, shift=3.0)" and fit.call_line is None
    assert fit.mu_rule is None and not fit.fits[0].mu


def test_cli_recordings_at_sizes_and_their_bad_input(tmp_path):
    a, b = _record_flux(tmp_path, 256), _record_flux(tmp_path, 4096)
    short = _record_flux(tmp_path, 1024, n=7)
    ok = CliRunner().invoke(cli, ["schedule", f"256={a},4096={b}", "--fit", FLOW])
    assert ok.exit_code == 0 and "mu=calculate_shift(image_seq_len" in ok.output
    for ref, message in (
        (f"256={a}", "give two or more"),
        (f"256={a},256={b}", "a size is given twice"),
        (f"256={a},4096={tmp_path / 'nope'}", "no such file or folder"),
        (f"256={a},1024={short}", "different step counts (10 at 256, 7 at 1024)"),
    ):
        bad = CliRunner().invoke(cli, ["schedule", ref, "--fit", FLOW])
        assert bad.exit_code == 2 and message in bad.output and "Traceback" not in bad.output, bad.output


# ------------------------------------------------------------------------ closed forms read from the values


def test_a_flow_schedule_given_as_timesteps_has_its_closed_form():
    # SD3/Flux-style: linspace(1, 1/12, 12) shifted once by 3, recorded as timesteps t = 1000 σ
    u = np.linspace(1, 1 / 12, 12)
    shifted = [float(3 * v / (1 + 2 * v)) for v in u]
    cmp = compare_schedules({"timesteps": [1000 * v for v in shifted]}, {"timesteps": [1000 * v for v in u]})
    (hint,) = cmp.hints
    assert (
        "flow-matching, shifted (shift 3, unshifted t from 1 to 1/n; timesteps = 1000 × sigma)"
        in hint.message
    )
    assert "Same family; differs in shift 3 (A) vs 1 (B) (as an exponential time shift: mu 1.099 vs 0;" in (
        hint.message
    )
    assert "as a linear one: mu 3 vs 1)" in hint.message
    assert hint.message.endswith("; the rest of the form is the same.")


def test_a_flow_unipc_starting_at_one_minus_one_over_t_is_a_closed_form_at_every_count():
    from paritykit.schedule.families import sigma_family

    family = sigma_family(R.wan_unipc_sigmas(STEPS))
    assert family.name == "flow-matching, shifted" and family.params["shift"] == pytest.approx(5.0)
    assert family.detail == "unshifted t from 1 − 1/1000 to (1 − 1/1000)/n"
    for n in (7, 25, 50):  # the form holds at other step counts, as the research code computes them
        assert family.generate(n) == pytest.approx(R.wan_unipc_sigmas(n), rel=1e-6)


def test_flow_forms_must_not_be_read_into_other_families():
    from paritykit.schedule.families import sigma_family

    assert sigma_family(R.karras_sigmas(STEPS)).name == "Karras"
    exponential = [float(v) for v in np.exp(np.linspace(np.log(0.9), np.log(0.01), STEPS))]
    assert sigma_family(exponential).name == "exponential"
    noisy = [v + (0.01 if i == 4 else 0.0) for i, v in enumerate(R.wan_unipc_sigmas(STEPS)[:-1])]
    assert sigma_family(noisy) is None or not sigma_family(noisy).name.startswith("flow")


def test_a_copied_list_is_labelled_as_holding_at_its_count_only(tmp_path):
    # a reference that follows no closed form: passing its own list fits, but only at its own step count
    ragged = {"sigmas": [1.0, 0.93, 0.71, 0.66, 0.31, 0.12, 0.0]}
    fit = fit_scheduler(FLOW, ragged)
    if fit.line is None:
        pytest.skip("no set_timesteps call of this diffusers takes a sigma list")
    assert fit.one_count_only and "(checked at the recorded 6 steps only" in fit.render()
    # a closed form is checked at other counts: no such label
    closed = fit_scheduler(FLOW, {"sigmas": R.sd3_sigmas(STEPS)})
    assert closed.line is not None and not closed.one_count_only
    assert "holds at" not in closed.render()


def _qwen_exercise_recordings(folder):
    r"""A regression case from a port exercise written from DiffSynth-Studio's Qwen-Image sampler, that
    nobody here tuned on: the research schedule (mu from its own rule at 768 tokens, a terminal stretch to
    0.02), recorded once per guidance half; the port's FlowMatchEulerDiscreteScheduler left at FLUX's
    base/max shift keys, called as diffusers' flow pipelines call it, and its model given t in [0, 1]."""
    import json

    from paritykit.schedule.fit import mu_rule

    from tests.research import research_module

    flow = research_module("diffsynth", "diffusion/flow_match.py")
    _, timesteps = flow.FlowMatchScheduler.set_timesteps_qwen_image(8, dynamic_shift_len=768)
    (folder / "ref.json").write_text(json.dumps({"timesteps": [float(t) for t in timesteps for _ in (0, 1)]}))
    config = {"use_dynamic_shifting": True, "shift_terminal": 0.02, "time_shift_type": "exponential"}
    port = FlowMatchEulerDiscreteScheduler(**config)
    port.set_timesteps(sigmas=np.linspace(1.0, 1 / 8, 8), mu=mu_rule(dict(port.config), 768))
    recorded = [float(t) / 1000 for t in port.timesteps for _ in (0, 1)]
    (folder / "port.json").write_text(json.dumps({"timesteps": recorded}))
    return dict(port.config)


def test_a_dynamic_shift_is_fitted_with_the_ports_own_call_and_says_what_it_checked(tmp_path):
    config = _qwen_exercise_recordings(tmp_path)
    fit = fit_scheduler(
        "FlowMatchEulerDiscreteScheduler",
        str(tmp_path / "ref.json"),
        base_config=config,
        port=str(tmp_path / "port.json"),
        seq_len=768,
    )
    best = fit.fits[0]
    # the port's pipeline call is kept, and the mu that reproduces the research is its own rule's at 8192/0.9
    assert best.call.name == "sigmas-linspace" and not fit.pasted, fit.render()
    assert abs(next(iter(best.mu.values())) - (0.5 + 0.4 * 512 / 7936)) < 1e-4
    assert any(
        n.startswith("mu: the reference's schedule needs 0.5258") and "0.586667" in n for n in fit.notes
    )
    # one recording cannot say what the reference does at another count: said, never claimed
    assert fit.one_count_only and fit.extrapolated
    text = fit.render()
    assert "8 (recorded); 7, 13, 20 (the closed form read from the recording" in text
    assert "checked at the recorded 8 steps only" in text and "REF_SIGMAS" not in text.split("fix:")[1]
    # without the port's run two calls reproduce the recording and part elsewhere: said, no choice claimed
    alone = fit_scheduler("FlowMatchEulerDiscreteScheduler", str(tmp_path / "ref.json"), base_config=config)
    assert alone.ambiguous and alone.one_count_only
    assert "one recorded count cannot tell them apart" in alone.render()


def test_ascending_recorded_timesteps_are_read_as_flow_time():
    # a model called at t = 1 - sigma (denoising from t = 0) records ascending values: read as flow time,
    # they are the same shifted schedule, never a schedule of its own run backwards
    from paritykit.schedule.fit_inputs import as_flow as _as_flow
    from paritykit.schedule.load import Schedule

    sigmas = [1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]
    read, words = _as_flow(Schedule("list", timesteps=[1 - s for s in sigmas]), 1000)
    assert read.sigmas == pytest.approx(sigmas) and "flow time t = 1 − σ" in words
    read, words = _as_flow(Schedule("list", timesteps=list(sigmas)), 1000)
    assert read.sigmas == pytest.approx(sigmas) and "flow-matching sigmas themselves" in words


def test_timesteps_of_a_flow_grid_follow_its_sigmas_and_the_closed_form_fix_holds_at_every_count():
    # round 10 (torchcfm): an even flow grid was read as "leading spacing + offset (offset 125)" for its
    # timesteps, so the closed-form call departed at every other count, the fix fell back to the reference's
    # own list, and its note said the values "matched none of the closed forms tried"
    from paritykit.schedule import fit_scheduler

    n = 8
    sigmas = [1 - i / n for i in range(n)] + [0.0]
    fit = fit_scheduler(
        "FlowMatchEulerDiscreteScheduler", {"sigmas": sigmas, "timesteps": [v * 1000 for v in sigmas[:-1]]}
    )
    text = fit.render()
    assert "timesteps: the flow sigmas (times 1000)" in text and "leading spacing" not in text
    assert fit.fits and not fit.pasted and not fit.one_count_only
    assert sorted(fit.fits[0].counts_matched) == [7, 8, 13, 20]
    assert "set_timesteps(sigmas=np.linspace(1.0, 1 / n, n))" in text
    assert "matched none of the closed forms" not in text


def test_a_pasted_list_says_it_holds_at_its_own_count_only():
    from paritykit.schedule.fit_result import Candidate, FitResult
    from paritykit.schedule.load import Schedule
    from paritykit.schedule.schedulers import calls_for

    ref = Schedule("ref", sigmas=[1.0, 0.5, 0.0], timesteps=[1000.0, 500.0])
    given = [c for c in calls_for(FlowMatchEulerDiscreteScheduler, {"shift": 1.0}, ref) if c.rank >= 3][0]
    result = FitResult(
        "FlowMatchEulerDiscreteScheduler",
        8,
        [8],
        "ref",
        {"sigmas": "flow"},
        [Candidate({}, given, [8])],
        [],
        1,
    )
    assert result.pasted and result.one_count_only
    assert "holds at the recorded count only" in result.why_one_count()
    assert "matched none of the closed forms" not in result.why_one_count()


def test_a_linear_grid_in_unit_range_is_not_said_to_be_flow_sigmas_alone():
    # round 30 (continuous-time DDPM): the port fed its U-Net t in [0, 1] where the research feeds log-SNR(t);
    # "B follows flow-matching, linear (…; the values read as sigmas)" pointed away from the fix. The words
    # now say a continuous time reads the same, and that the list cannot tell which one the denoiser expects.
    from paritykit.schedule import compare_schedules

    port = [1 - k / 8 for k in range(8)]
    reference = [-10.0, -7.6, -5.9, -4.4, -3.0, -1.5, 0.4, 3.1]
    text = " ".join(h.message for h in compare_schedules(reference, port).hints)
    assert "a continuous time t in [0, 1] reads the same" in text, text
