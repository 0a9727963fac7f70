"""`paritykit schedule`: diagnoses, the config fit and the step check, against three in-repo reference loops.

Each reference loop (tests/reference_loops.py) is run on a tiny UNet2DConditionModel and recorded with
paritykit.record_loop; a port with the wrong default is diagnosed, --fit proposes the fix, and the fixed port
then matches the reference end to end (the per-step curve stays at zero).
"""

from __future__ import annotations

import json

import diffusers
import pytest
import torch
from click.testing import CliRunner
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    UNet2DConditionModel,
)
from paritykit import compare_schedules, fit_scheduler
from paritykit.cli import cli
from paritykit.compare.steps import step_curve
from paritykit.schedule.families import sigma_family, timestep_family

from tests import reference_loops as R
from tests.sampling import (  # noqa: F401 (one_thread: a fixture, applied by importing it)
    denoiser,
    one_thread,
    port_loop,
    record,
    tiny_cond_unet,
    tiny_inputs,
)

STEPS = 10
SD_BETAS = {"beta_start": R.BETA_START, "beta_end": R.BETA_END, "beta_schedule": "scaled_linear"}
# a DDIM config as Stable Diffusion ships it: no x0 clipping (the reference loops never clip)
DDIM_BASE = {**SD_BETAS, "clip_sample": False}


@pytest.fixture(scope="module")
def unet() -> UNet2DConditionModel:
    return tiny_cond_unet()


@pytest.fixture(scope="module")
def inputs():
    return tiny_inputs()


def run_cli(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def assert_flat_at_zero(ref_dir, port_dir, atol=1e-4):
    curve = step_curve(ref_dir, port_dir, key="output", atol=atol, rtol=0)
    assert len(curve.points) == STEPS
    assert all(p.max_abs <= atol for p in curve.points), [p.max_abs for p in curve.points]
    assert curve.exit_code == 0


# ------------------------------------------------------------------------------------------- DDIM, trailing
def test_ddim_trailing_port_with_leading_default_is_diagnosed_fitted_and_fixed(unet, inputs, tmp_path):
    noise, cond = inputs
    ref = record(unet, tmp_path / "ref", lambda: R.ddim_loop(denoiser(unet), noise, cond, STEPS, "trailing"))
    wrong = record(unet, tmp_path / "wrong", lambda: port_loop(unet, DDIMScheduler(**DDIM_BASE), noise, cond))

    cmp = compare_schedules(ref, wrong)
    assert cmp.exit_code == 1
    ids = {h.id: h for h in cmp.hints}
    assert "B ≈ A − 99" in ids["offset"].message and "steps_offset" in ids["offset"].message
    assert ids["offset"].keys == ["timestep_spacing", "steps_offset"]
    assert "A follows trailing spacing; B follows leading spacing" in ids["spacing"].message

    fit = fit_scheduler(DDIMScheduler, ref, base_config=DDIM_BASE, step_check=ref)
    assert fit.line == 'DDIMScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")'
    assert fit.fits[0].step_check.matched and fit.fits[0].step_check.steps_checked == STEPS - 1
    assert len(fit.counts) >= 4 and any(1000 % n for n in fit.counts)
    # the offset hint's literal fix matches at 10 steps only: it is shown rejected, never proposed
    offset_only = [c for c in fit.rejected if c.changes == {"steps_offset": 99}]
    assert offset_only and offset_only[0].counts_matched == [STEPS]
    assert "raises" in offset_only[0].failures[20] or "differ" in offset_only[0].failures[20]
    assert not any("steps_offset" in c.changes for c in fit.fits)

    fixed_scheduler = DDIMScheduler.from_config(
        DDIMScheduler(**DDIM_BASE).config, timestep_spacing="trailing"
    )
    fixed = record(unet, tmp_path / "fixed", lambda: port_loop(unet, fixed_scheduler, noise, cond))
    again = compare_schedules(ref, fixed)
    assert again.exit_code == 0 and again.hints == []
    assert_flat_at_zero(ref, fixed)


# ------------------------------------------------------------------------------------------- DDIM, linspace
def test_ddim_linspace_lists_match_but_the_step_does_not_and_fit_says_which_quantity(tmp_path):
    spec = tmp_path / "ref_ddim.py"
    spec.write_text(
        "from tests.reference_loops import ddim_step, ddim_timesteps\n\n"
        "def ref_schedule(n):\n    return ddim_timesteps(n, 'linspace')\n\n"
        "def ref_step(x, eps, t, t_prev):\n    return ddim_step(x, eps, t, t_prev)\n"
    )
    fit = fit_scheduler("DDIMScheduler", spec, steps=STEPS, base_config=DDIM_BASE, step_check=True)
    assert fit.exit_code == 1 and fit.fits == []
    failing = [c for c in fit.rejected if c.step_check is not None]
    assert failing and failing[0].changes["timestep_spacing"] == "linspace"
    assert failing[0].counts_matched == fit.counts  # the lists match at every count checked ...
    check = failing[0].step_check  # ... the update does not, from the first step
    assert check.first_failing_step == 0 and check.quantity == "previous alpha"
    ac = R.alphas_cumprod()
    assert check.reference_value == pytest.approx(float(ac[888]), rel=1e-4)
    assert check.scheduler_value == pytest.approx(float(ac[899]), rel=1e-4)
    assert "ᾱ[t=888]" in check.explanation and "ᾱ[t=899]" in check.explanation
    # no step-only key (set_alpha_to_one, clip_sample) fixes it, and the no-fit report says so under "nearest"
    assert "none of them, alone or in pairs, is the cause" in check.explanation
    assert fit.nearest is failing[0] and check.explanation in fit.differences
    assert f"still differs: {check.explanation}" in fit.render()
    # the nearest's number is its schedule's; its updates are said not to match on the same line (round 7:
    # "nearest: (base) (worst relative error 0 at 10 steps)" read as if the base config reproduced the run)
    nearest = next(line for line in fit.render().splitlines() if line.startswith("nearest:"))
    assert "worst relative error of its recorded schedule values" in nearest and "its updates:" in nearest

    code, out = run_cli("schedule", spec, "--fit", "DDIMScheduler", "--steps", 7, "--step-check", "--json")
    payload = json.loads(out)
    assert code == 1 and payload["fit"] is None
    assert any("fixed stride 1000//7 = 142" in w for w in payload["warnings"])


def test_step_check_at_a_dividing_count_has_no_stride_warning(tmp_path):
    spec = tmp_path / "ref_trailing.py"
    spec.write_text(
        "from tests.reference_loops import ddim_step, ddim_timesteps\n\n"
        "def ref_schedule(n):\n    return ddim_timesteps(n, 'trailing')\n\n"
        "def ref_step(x, eps, t, t_prev):\n    return ddim_step(x, eps, t, t_prev)\n"
    )
    fit = fit_scheduler("DDIMScheduler", spec, steps=STEPS, base_config=DDIM_BASE, step_check=True)
    assert fit.exit_code == 0 and fit.warnings == []
    assert fit.fits[0].changes == {"timestep_spacing": "trailing"}


# ------------------------------------------------------------------------------------------- Karras, rho 7
def test_karras_reference_port_without_karras_is_diagnosed_fitted_and_fixed(unet, inputs, tmp_path):
    noise, cond = inputs
    sigmas = R.karras_sigmas(STEPS)
    assert sigma_family(sigmas).name == "Karras" and sigma_family(sigmas).params["rho"] == 7
    plain = EulerDiscreteScheduler(**SD_BETAS)
    plain.set_timesteps(STEPS)
    cmp = compare_schedules({"sigmas": sigmas}, {"sigmas": plain.sigmas})
    assert cmp.exit_code == 1
    (hint,) = [h for h in cmp.hints if h.id == "sigma-family"]
    assert "A follows Karras (rho 7" in hint.message and "use_karras_sigmas" in hint.keys

    fit = fit_scheduler("EulerDiscreteScheduler", {"sigmas": sigmas}, base_config=SD_BETAS)
    assert fit.line == "EulerDiscreteScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)"

    ref = record(unet, tmp_path / "ref", lambda: R.karras_loop(denoiser(unet), noise, cond, STEPS))
    fixed_scheduler = EulerDiscreteScheduler(**SD_BETAS, use_karras_sigmas=True)
    fixed = record(unet, tmp_path / "fixed", lambda: port_loop(unet, fixed_scheduler, noise, cond))
    assert compare_schedules(ref, fixed).exit_code == 0
    assert_flat_at_zero(ref, fixed, atol=1e-3)
    # a recorded Euler loop holds scaled inputs: the step check undoes the scaling and steps in lockstep; the
    # last update is checked only when the loop's result was kept, and the report says which it did
    checked = fit_scheduler("EulerDiscreteScheduler", ref, base_config=SD_BETAS, step_check=ref)
    assert checked.fits[0].step_check.matched and checked.fits[0].step_check.steps_checked == STEPS - 1
    assert any(f"{STEPS - 1} of {STEPS} updates checked" in n for n in checked.notes)
    ref = record(
        unet, tmp_path / "ref_final", lambda: R.karras_loop(denoiser(unet), noise, cond, STEPS), True
    )
    checked = fit_scheduler("EulerDiscreteScheduler", ref, base_config=SD_BETAS, step_check=ref)
    assert checked.fits[0].step_check.steps_checked == STEPS and not any(
        "updates checked" in n for n in checked.notes
    )
    assert f"step: {STEPS} updates match the reference's" in checked.render().splitlines()


# ------------------------------------------------------------------------------------------- flow matching,
# SD3
def test_sd3_reference_against_a_default_shift_port_is_diagnosed_fitted_and_fixed(unet, inputs, tmp_path):
    noise, cond = inputs
    ref = record(
        unet, tmp_path / "ref", lambda: R.flow_loop(denoiser(unet), noise, cond, R.sd3_sigmas(STEPS))
    )
    wrong = record(
        unet, tmp_path / "wrong", lambda: port_loop(unet, FlowMatchEulerDiscreteScheduler(), noise, cond)
    )
    cmp = compare_schedules(ref, wrong)
    assert cmp.exit_code == 1 and cmp.kinds[0].first_difference == 1  # both start at t = 1000

    sigmas = {"sigmas": R.sd3_sigmas(STEPS)}
    fam = sigma_family(sigmas["sigmas"])
    assert fam.name == "flow-matching, shifted" and fam.params["shift"] == pytest.approx(3.0)
    assert "applied twice" in fam.detail  # SD3's code shifts its low end twice, and set_timesteps(n) does too
    fit = fit_scheduler(FlowMatchEulerDiscreteScheduler, sigmas, step_check=ref)
    assert fit.line == "FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=3.0)"
    assert fit.call_line is None and fit.fits[0].exact and fit.fits[0].step_check.matched

    fixed_scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    fixed = record(unet, tmp_path / "fixed", lambda: port_loop(unet, fixed_scheduler, noise, cond))
    assert compare_schedules(ref, fixed).exit_code == 0
    assert_flat_at_zero(ref, fixed, atol=1e-3)


# ------------------------------------------------------------------------------------------- diagnoses
def test_identical_schedules_exit_0_with_no_hint():
    for a, b in (
        ([999, 899, 799], [999.0, 899.0, 799.0]),  # an integer list and its float copy are the same schedule
        ({"sigmas": R.karras_sigmas(5)}, {"sigmas": R.karras_sigmas(5)}),
    ):
        cmp = compare_schedules(a, b)
        assert cmp.exit_code == 0 and cmp.hints == [], cmp.render()


def test_each_diagnosis_fires_on_its_case_and_not_on_a_look_alike():
    ts = R.ddim_timesteps(10, "linspace")
    assert [h.id for h in compare_schedules(ts, ts[::-1]).hints] == ["reversed"]
    floats = [v + 0.25 for v in ts[:-1]] + [0.0]
    ids = [h.id for h in compare_schedules(torch.tensor(ts), torch.tensor(floats)).hints]
    assert ids[0] == "int-vs-float"
    sig = R.karras_sigmas(6)
    final = compare_schedules({"sigmas": sig[:-1]}, {"sigmas": sig}).hints
    assert [h.id for h in final] == ["final-sigma-zero"] and "B appends a final sigma 0" in final[0].message
    extra = compare_schedules(ts[:-1], ts).hints
    assert [h.id for h in extra][0] == "extra-step"
    # not a constant offset: a different spacing with a varying difference gets no offset hint
    jitter = compare_schedules(ts, R.ddim_timesteps(10, "trailing")).hints
    assert "offset" not in {h.id for h in jitter}
    assert "A follows linspace spacing, integer; B follows trailing spacing" in jitter[0].message


def test_families_recognised_and_look_alikes_refused():
    assert timestep_family(R.ddim_timesteps(10, "trailing"), 1000).name == "trailing spacing"
    assert (
        timestep_family([950, 850, 750, 650], 1000) is None
        or "offset" in timestep_family([950, 850, 750, 650], 1000).name
    )
    assert sigma_family([5.0, 4.1, 2.0, 1.7, 0.3]) is None  # no closed form: nothing claimed
    exp = [14.6 * (0.03 / 14.6) ** (i / 7) for i in range(8)]
    assert sigma_family(exp).name == "exponential"


def test_fit_on_a_class_read_from_its_signature_dpm_solver():
    sched = DPMSolverMultistepScheduler(**SD_BETAS, use_karras_sigmas=True)
    sched.set_timesteps(STEPS)
    fit = fit_scheduler("DPMSolverMultistepScheduler", {"sigmas": sched.sigmas}, base_config=SD_BETAS)
    assert fit.exit_code == 0 and fit.fits[0].changes == {"use_karras_sigmas": True}


# ------------------------------------------------------------------------------------------- CLI
def test_cli_compare_and_fit(tmp_path):
    (tmp_path / "ref.json").write_text(json.dumps(R.ddim_timesteps(10, "trailing")))
    sched = DDIMScheduler(**SD_BETAS)
    sched.set_timesteps(10)
    torch.save({"timesteps": sched.timesteps}, tmp_path / "port.pt")
    code, out = run_cli("schedule", tmp_path / "ref.json", tmp_path / "port.pt")
    assert code == 1 and "B ≈ A − 99" in out
    code, out = run_cli("schedule", tmp_path / "ref.json", tmp_path / "ref.json", "--json")
    assert code == 0 and json.loads(out)["hints"] == []
    (tmp_path / "config.json").write_text(json.dumps(dict(sched.config)))
    code, out = run_cli(
        "schedule", tmp_path / "ref.json", "--fit", "DDIMScheduler", "--config", tmp_path / "config.json"
    )
    assert code == 0
    assert 'fix: DDIMScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")' in out


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["schedule", "missing.json", "missing.json"], "missing.json"),
        (["schedule", "ref.json", "--fit", "NoSuchScheduler"], "NoSuchScheduler"),
        (["schedule", "ref.json"], "PORT"),
        (["schedule", "ref.json", "ref.json", "--steps", "5"], "--steps"),
        (["schedule", "ref.json", "sigmas.json"], "share no schedule"),
        (["schedule", "sigmas.json", "--fit", "DDIMScheduler"], "does not expose"),
        (["schedule", "nan.json", "ref.json"], "nan.json: value 1 is nan"),
        (["schedule", "ref.json", "inf.json"], "inf.json: value 2 is inf"),
        (["schedule", "empty.json", "ref.json"], "empty.json: the schedule is empty"),
        (["schedule", "nan.json", "--fit", "DDIMScheduler"], "nan.json"),
        (
            ["schedule", "ref.json", "--fit", "DDIMScheduler", "--config", "bogus.json"],
            'timestep_spacing="bogus"',
        ),
        (
            ["schedule", "ref.json", "--fit", "DDIMScheduler", "--config", "typo.json"],
            "unknown key 'use_karras_sigma'",
        ),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(tmp_path, args, named):
    (tmp_path / "ref.json").write_text("[999, 899, 799]")
    (tmp_path / "sigmas.json").write_text('{"sigmas": [1.0, 0.5, 0.0]}')
    # Python's json reads NaN and Infinity: a schedule holding them must not reach the comparison
    (tmp_path / "nan.json").write_text("[999, NaN, 799]")
    (tmp_path / "inf.json").write_text('{"sigmas": [1.0, 0.5, Infinity]}')
    (tmp_path / "empty.json").write_text('{"timesteps": []}')
    (tmp_path / "bogus.json").write_text('{"timestep_spacing": "bogus"}')
    (tmp_path / "typo.json").write_text('{"use_karras_sigma": true}')
    result = CliRunner().invoke(cli, args, catch_exceptions=False, env={})
    import contextlib

    with contextlib.chdir(tmp_path):
        result = CliRunner().invoke(cli, args, catch_exceptions=True)
    assert isinstance(result.exception, SystemExit) and result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("paritykit: error: ") and named in lines[0], lines


# ------------------------------------------------------------------------------------------- reports on loops
def test_offset_hint_on_a_timestep_list_names_the_scheduler_keys_and_not_elsewhere():
    from paritykit.compare.diagnose import diagnose

    ts = torch.tensor(R.ddim_timesteps(10, "trailing"), dtype=torch.float32)
    (hint,) = [h for h in diagnose(ts, ts - 99) if h.id == "offset"]
    assert hint.message.startswith("B ≈ A − 99") and "timestep_spacing" in hint.message
    assert "steps_offset" in hint.message
    x = torch.randn(200, generator=torch.Generator().manual_seed(0))
    (plain,) = [h for h in diagnose(x, x + 0.5) if h.id == "offset"]
    assert plain.message.startswith("B ≈ A + 0.5") and "steps_offset" not in plain.message


def test_steps_growth_class_agrees_with_the_fitted_exponent():
    from paritykit.compare.steps import classify_growth

    fit = classify_growth([1e-6 * (i + 1) ** 2.74 for i in range(12)])
    assert fit.growth == "polynomial" and fit.power_exponent == pytest.approx(2.74, rel=1e-6)
    assert "step^2.74" in fit.reason
    assert classify_growth([1e-6 * 1.6**i for i in range(12)]).growth == "exponential"


# ------------------------------------------------------------------------------------------- every supported
# class
SUPPORTED = {
    "DDIMScheduler": {"timestep_spacing": "trailing"},
    "DDPMScheduler": {"timestep_spacing": "trailing"},
    "EulerDiscreteScheduler": {"use_karras_sigmas": True},
    "EulerAncestralDiscreteScheduler": {"timestep_spacing": "trailing"},
    "HeunDiscreteScheduler": {"use_karras_sigmas": True},
    "DPMSolverMultistepScheduler": {"timestep_spacing": "trailing"},
    "UniPCMultistepScheduler": {"use_karras_sigmas": True},
    "LMSDiscreteScheduler": {"use_karras_sigmas": True},
    "FlowMatchEulerDiscreteScheduler": {"shift": 3.0},
}


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_fit_recovers_a_changed_default_and_proposes_nothing_for_the_default(name):
    import diffusers

    cls = getattr(diffusers, name)
    base = {} if name.startswith("FlowMatch") else SD_BETAS
    changed = cls(**base, **SUPPORTED[name])
    changed.set_timesteps(STEPS)
    sigmas = getattr(changed, "sigmas", None)
    ref = {
        "timesteps": changed.timesteps.tolist(),
        **({"sigmas": sigmas.tolist()} if sigmas is not None else {}),
    }
    fit = fit_scheduler(name, ref, base_config=base)
    assert fit.fits and fit.fits[0].changes == SUPPORTED[name], fit.render()
    assert len(fit.counts) >= 4
    default = cls(**base)
    default.set_timesteps(STEPS)
    same = fit_scheduler(name, {"timesteps": default.timesteps.tolist()}, base_config=base)
    assert same.line == f"{name}.from_config(pipe.scheduler.config)"


def test_step_check_from_a_pipelines_checkpoint_folder(tmp_path):
    from paritykit import Checkpoint, save_checkpoints

    from tests._pipelines import TINY_STEPS, make_tiny_unet_pipeline

    pipe = make_tiny_unet_pipeline()
    checkpoints = {
        name: Checkpoint(save=True) for name in ["preloop", *(f"after_step_{i}" for i in range(TINY_STEPS))]
    }
    pipe(_checkpoints=checkpoints)
    save_checkpoints(tmp_path / "run", checkpoints)
    fit = fit_scheduler(
        "DDIMScheduler",
        tmp_path / "run",
        base_config=dict(pipe.scheduler.config),
        step_check=tmp_path / "run",
    )
    assert fit.line == "DDIMScheduler.from_config(pipe.scheduler.config)"
    assert fit.fits[0].step_check.matched and fit.fits[0].step_check.steps_checked == TINY_STEPS
    # the same run against a config whose final alpha differs: the lists still match, the update does not
    other = fit_scheduler(
        "DDIMScheduler",
        tmp_path / "run",
        base_config={**pipe.scheduler.config, "set_alpha_to_one": False},
        step_check=tmp_path / "run",
    )
    assert other.fits and other.fits[0].changes == {"set_alpha_to_one": True}


def test_cli_sides_from_npy_and_checkpoint_folder_give_strict_json_with_environment(tmp_path):
    import numpy as np
    from paritykit import Checkpoint, save_checkpoints

    np.save(tmp_path / "ref.npy", np.array(R.ddim_timesteps(10, "trailing")))
    save_checkpoints(
        tmp_path / "port", {"preloop": Checkpoint(data={"timesteps": torch.arange(9, -1, -1) * 100})}
    )
    for args, code in (
        (["schedule", tmp_path / "ref.npy", tmp_path / "port", "--json"], 1),
        (["schedule", tmp_path / "ref.npy", "--fit", "DDIMScheduler", "--json"], 0),
    ):
        result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
        payload = json.loads(result.output, parse_constant=lambda t: pytest.fail(f"non-strict JSON {t}"))
        assert (
            result.exit_code == code
            and payload["schema_version"] == 1
            and payload["environment"]["paritykit"]
        )
    bad = CliRunner().invoke(cli, ["schedule", str(tmp_path / "nope.npy"), str(tmp_path / "port"), "--json"])
    assert bad.exit_code == 2 and set(json.loads(bad.output)) == {"schema_version", "error"}


def _karras_euler_spec(tmp_path, factor: str = ""):
    r"""A reference SPEC: Karras sigmas, an Euler step, its output scaled by ``factor`` (``"1.5 * "``)."""
    spec = tmp_path / "ref_karras.py"
    spec.write_text(
        "from tests.reference_loops import karras_sigmas\n\n"
        "def ref_schedule(n):\n    return {'sigmas': karras_sigmas(n)}\n\n"
        "def ref_step(x, eps, sigma, sigma_next):\n"
        f"    return x + {factor}eps * ((sigma_next or 0.0) - sigma)\n"
    )
    return spec


def test_step_check_names_no_quantity_when_the_update_rules_differ(tmp_path):
    spec = _karras_euler_spec(tmp_path)
    euler = fit_scheduler("EulerDiscreteScheduler", spec, steps=8, base_config=SD_BETAS, step_check=True)
    assert euler.line.endswith("use_karras_sigmas=True)") and euler.fits[0].step_check.matched
    # DPM-Solver's first-order step is a different rule: the lists match, no single quantity is blamed
    dpm = fit_scheduler("DPMSolverMultistepScheduler", spec, steps=8, base_config=SD_BETAS, step_check=True)
    check = dpm.rejected[0].step_check
    assert dpm.fits == [] and check is not None and not check.matched
    assert check.quantity is None and "no one coefficient of the model output read from the updates" in (
        check.explanation
    )
    assert "differ in form" not in check.explanation and "lead: the step rules" in check.explanation


def test_a_step_that_scales_the_output_is_named_by_the_coefficient_not_by_its_sigmas(tmp_path):
    # round 17 (flow_matching): the research turned an x1 prediction into a cosine path's velocity, a factor
    # pi/2 on the same sigmas; "sigma_next - sigma 0.1963 (reference) vs -0.125" named sigmas that agree
    spec = _karras_euler_spec(tmp_path, "1.5 * ")
    fit = fit_scheduler("EulerDiscreteScheduler", spec, steps=8, base_config=SD_BETAS, step_check=True)
    check = next(f.step_check for f in (*fit.fits, *fit.rejected) if f.step_check is not None)
    assert not check.matched and check.quantity == "coefficient of the model output", check.explanation
    assert "sigma_next - sigma" not in check.explanation
    assert "the lists match, the update at step 0" in check.explanation


# ------------------------------------------------------------------------------------------ VP closed forms


def _ddpm_sigmas(n, beta_start=0.00085, beta_end=0.012, kind="scaled_linear", spacing="leading", offset=1):
    """DDPM's noise levels (Ho et al. 2020; Stable Diffusion's scaled-linear betas), read at a spacing's
    timesteps as k-diffusion's discrete wrappers do (sigma = sqrt((1 - alphā) / alphā), interpolated)."""
    import numpy as np

    if kind == "scaled_linear":
        betas = np.linspace(beta_start**0.5, beta_end**0.5, 1000) ** 2
    else:
        betas = np.linspace(beta_start, beta_end, 1000)
    alphas = np.cumprod(1 - betas)
    table = ((1 - alphas) / alphas) ** 0.5
    if spacing == "leading":
        ts = (np.arange(n) * (1000 // n))[::-1] + offset
    else:
        ts = np.round(np.arange(1000, 0, -1000 / n)) - 1
    return [float(v) for v in np.interp(ts, np.arange(1000), table)] + [0.0]


def test_vp_sigmas_read_back_their_betas_and_spacing_and_hold_at_other_counts():

    family = sigma_family(_ddpm_sigmas(20))
    assert family.name == "VP (DDPM) sigmas"
    assert family.params == {"beta_start": 0.00085, "beta_end": 0.012}
    assert family.detail == "scaled_linear betas, leading spacing, steps offset 1"
    assert family.generate(37) == pytest.approx(_ddpm_sigmas(37), rel=1e-5)
    linear = sigma_family(_ddpm_sigmas(20, 0.0001, 0.02, "linear", "trailing", 0))
    assert (
        linear.params == {"beta_start": 0.0001, "beta_end": 0.02}
        and "linear betas, trailing" in linear.detail
    )


def test_two_vp_schedules_name_the_beta_that_differs():
    cmp = compare_schedules({"sigmas": _ddpm_sigmas(20)}, {"sigmas": _ddpm_sigmas(20, beta_end=0.02)})
    assert any("differs in beta_end 0.012 (A) vs 0.02 (B)" in h.message for h in cmp.hints), cmp.render()


def test_vp_must_not_read_arbitrary_lists():

    ragged = [14.6, 9.1, 7.7, 3.2, 2.9, 1.1, 0.7, 0.03]
    assert sigma_family(ragged) is None


# ------------------------------------------------------------------------------------------- EDM, as given
def test_a_config_that_already_reproduces_the_reference_is_no_fix_and_no_closed_form_is_claimed_absent():
    r"""Round-4 exercise (lucidrains' elucidated_diffusion against EDMEulerScheduler): the port's scheduler
    already gave the reference's c_noise timesteps, and the fit printed its own config back as "fix
    (verified)", beside "none of the closed forms … fits the reference" where Karras does (in sigma units)."""
    import math

    from diffusers import EDMEulerScheduler

    n, smin, smax, rho = 12, 0.002, 80.0, 7.0
    # Karras et al. 2022, eq. 5, and c_noise = ln(sigma) / 4: what the research sampler feeds its network
    sigmas = [
        (smax ** (1 / rho) + i / (n - 1) * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho for i in range(n)
    ]
    base = dict(EDMEulerScheduler(sigma_min=smin, sigma_max=smax, rho=rho).config)
    fit = fit_scheduler(EDMEulerScheduler, {"timesteps": [math.log(s) / 4 for s in sigmas]}, base_config=base)
    text = fit.render()
    assert fit.unchanged and "fix:" not in text
    assert "the EDMEulerScheduler config as given, with set_timesteps(n), reproduces it" in text
    assert "fits the reference" not in text and "matched none of the closed forms tried on them" in text
    # with the sigmas recorded, Karras is read and checked at other counts
    fit = fit_scheduler(EDMEulerScheduler, {"sigmas": sigmas}, base_config=base)
    assert fit.unchanged and not fit.one_count_only and "Karras (rho 7" in fit.render()
    # must not fire: a port with another rho is not reproduced as given
    fit = fit_scheduler(EDMEulerScheduler, {"sigmas": sigmas}, base_config={**base, "rho": 5.0})
    assert not fit.unchanged and "config as given" not in fit.render()


def test_a_timestep_list_several_spacings_give_names_them_all():
    # round 7 (CogVideoX, 20 steps of 20 training steps): "timesteps: leading spacing" where trailing and
    # linspace give the very same list, and trailing was the reference's rule at other counts
    from paritykit.schedule.families import timestep_family

    every = timestep_family([19.0 - i for i in range(20)], 20)
    assert every.name == "leading / trailing / linspace spacing"
    assert "same list at 20 of 20 training steps" in every.describe()
    # must not fire: a list only one spacing gives keeps its one name
    assert timestep_family([900.0 - 100 * i for i in range(10)], 1000).name == "leading spacing"
    assert timestep_family([999.0 - 111 * i for i in range(10)], 1000).name == "linspace spacing, integer"


def test_a_list_no_config_comes_near_has_no_nearest_and_no_pasted_list_elsewhere():
    # round 9 (consistency models): the port's CMStochasticIterativeScheduler takes integer bins, the
    # reference's levels are sigmas; "nearest: (base); set_timesteps(timesteps=REF_TIMESTEPS) (worst relative
    # error 610)" compared the two units, and "elsewhere: EulerDiscreteScheduler reproduces it: …
    # set_timesteps(timesteps=REF_TIMESTEPS)" only fed the reference's list back
    from paritykit.schedule import fit_scheduler

    smin, smax, rho, bins = 0.002, 80.0, 7.0, 150
    grid = [
        (smin ** (1 / rho) + i / (bins - 1) * (smax ** (1 / rho) - smin ** (1 / rho))) ** rho
        for i in range(bins)
    ]
    levels = [grid[bins - 1 - k] for k in (0, 20, 60, 100, 140)]
    fit = fit_scheduler("CMStochasticIterativeScheduler", {"timesteps": levels})
    text = fit.render()
    assert not fit.fits and "tried reproduces the reference" in text
    assert fit.nearest is None or (fit.nearest.distance <= 1.0 and fit.nearest.call.rank < 3), text
    assert not any("REF_TIMESTEPS" in e or "REF_SIGMAS" in e for e in fit.elsewhere), text
    # must not fire: a near miss within 100% is still named as the nearest
    near = fit_scheduler("DDIMScheduler", {"timesteps": [999, 749, 499, 249]})
    assert near.fits or near.nearest is not None


def test_a_ports_own_scheduler_subclass_is_fitted_by_module_and_class_name(tmp_path, monkeypatch):
    # round 9: triage printed `--fit SigmaConditionedCMScheduler`, which the CLI refused as no diffusers class
    from paritykit.base.errors import ParityKitError
    from paritykit.schedule.schedulers import fit_name, resolve_scheduler

    (tmp_path / "myport").mkdir()
    (tmp_path / "myport" / "__init__.py").write_text("")
    (tmp_path / "myport" / "sched.py").write_text(
        "from diffusers import DDIMScheduler\n\n\nclass Mine(DDIMScheduler):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    cls = resolve_scheduler("myport.sched:Mine")
    assert cls.__name__ == "Mine" and fit_name(cls) == "myport.sched:Mine"
    from diffusers import DDIMScheduler

    assert fit_name(DDIMScheduler) == "DDIMScheduler"
    # a class no command can import is named by none
    local = type("Local", (DDIMScheduler,), {"__module__": "__main__"})
    assert fit_name(local) is None
    with pytest.raises(ParityKitError, match="myport.sched:Nope"):
        resolve_scheduler("myport.sched:Nope")
    with pytest.raises(ParityKitError, match="cannot import"):
        resolve_scheduler("no_such_module:Mine")


_LOG_SIGMA_SPEC = """
import numpy as np

def ref_schedule(n):
    # the CompVis / k-diffusion Euler sampler: integer-spaced timesteps from 999 to 0, each step's sigma read
    # off the trained table by interpolating log sigma, and a final sigma of 0
    betas = np.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000) ** 2
    alphas_cumprod = np.cumprod(1.0 - betas)
    log_sigmas = np.log(((1 - alphas_cumprod) / alphas_cumprod) ** 0.5)
    timesteps = np.linspace(999, 0, n)
    sigmas = np.exp(np.interp(timesteps, np.arange(1000), log_sigmas))
    return {"timesteps": timesteps.tolist(), "sigmas": [*sigmas.tolist(), 0.0]}
"""


@pytest.mark.parametrize("interpolation", ["log_linear", "linear"])
def test_log_spaced_sigmas_are_fitted_with_the_config_key_not_a_pasted_list(tmp_path, interpolation):
    # round 11 (stable-diffusion-pytorch): the port's EulerDiscreteScheduler had
    # interpolation_type="log_linear"; the fit offered set_timesteps(sigmas=REF_SIGMAS), the reference's
    # list pasted in, as its only fix
    spec = tmp_path / "ref_loop.py"
    spec.write_text(_LOG_SIGMA_SPEC)
    base = {**SD_BETAS, "timestep_spacing": "linspace", "interpolation_type": interpolation}
    fit = fit_scheduler(EulerDiscreteScheduler, str(spec), steps=4, base_config=base)
    text = fit.render()
    assert fit.fits and "REF_SIGMAS" not in text, text
    if interpolation == "log_linear":
        assert fit.fits[0].changes == {"interpolation_type": "linear"}
        fix = 'EulerDiscreteScheduler.from_config(pipe.scheduler.config, interpolation_type="linear")'
        assert f"fix: {fix}" in text
        assert set(fit.fits[0].counts_matched) >= {4, 7, 13}
    else:  # must not fire: the port already reads sigmas so; nothing to change
        assert fit.unchanged and "fix:" not in text


def test_a_schedule_in_other_units_is_named_as_such_and_nothing_else_is():
    # round 12 (rectified-flow-pytorch): times i/8 against the port's 125·i were "unknown cause: not
    # reversed, not a constant offset, … neither side follows a closed form that would name the difference"
    times = [i / 8 for i in range(8)]
    scaled = compare_schedules({"timesteps": times}, {"timesteps": [1000 * t for t in times]})
    assert [h.id for h in scaled.hints] == ["units"] and "B = 1000 × A at every step" in scaled.render()
    flipped = compare_schedules({"timesteps": times}, {"timesteps": [1000 - 1000 * t for t in times]})
    assert [h.id for h in flipped.hints] == ["units"] and "B = -1000 × A + 1000" in flipped.render()
    # must not fire: a constant offset is an offset, and a squared list no affine map of the other
    shifted = compare_schedules({"timesteps": [999.0, 666.0, 333.0]}, {"timesteps": [998.0, 665.0, 332.0]})
    assert "offset" in [h.id for h in shifted.hints] and "units" not in [h.id for h in shifted.hints]
    squared = compare_schedules({"timesteps": times}, {"timesteps": [t * t for t in times]})
    assert "units" not in [h.id for h in squared.hints]
    # nor two spacings: evenly spaced lists are always some affine map of each other
    spaced = compare_schedules(R.ddim_timesteps(10, "linspace"), R.ddim_timesteps(10, "trailing"))
    assert "units" not in [h.id for h in spaced.hints]


def test_a_config_holding_its_betas_as_an_array_is_searched_without_error():
    # round 13 (audio-diffusion-pytorch): a port's DDIMScheduler built with trained_betas=numpy array made
    # `triage --all` end in a traceback ("The truth value of an array … is ambiguous")
    import numpy as np

    betas = np.linspace(1e-4, 0.02, 1000)
    base = dict(DDIMScheduler(trained_betas=betas, clip_sample=False).config)
    assert isinstance(base["trained_betas"], np.ndarray)
    fit = fit_scheduler(DDIMScheduler, {"timesteps": [999, 899, 799, 699, 599]}, base_config=base)
    assert fit.searched > 0 and "beta_schedule" not in {k for c in fit.fits for k in c.changes}


def test_interpolation_type_is_searched_only_where_the_reference_holds_sigmas():
    # nothing runs that cannot change the answer: interpolation_type changes the sigmas only, so a reference
    # of timesteps alone cannot tell its two values apart (and the search would double for nothing)
    from paritykit.schedule.fit import _axes
    from paritykit.schedule.load import Schedule
    from paritykit.schedule.schedulers import accepted_keys

    keys = accepted_keys(EulerDiscreteScheduler)
    timesteps = Schedule("list", [999.0, 666.0, 333.0, 0.0], None)
    with_sigmas = Schedule("list", [999.0, 666.0, 333.0, 0.0], [14.6, 3.2, 0.8, 0.03, 0.0])

    def searched(ref):
        return {key for axis in _axes(keys, {}, ref, set()) for option in axis for key in option}

    assert "interpolation_type" not in searched(timesteps)
    assert "interpolation_type" in searched(with_sigmas)


def test_a_scheduler_built_before_is_handed_out_fresh_and_unshared():
    # the fit builds each config at several counts and keeps one built copy per config: what it hands out is
    # the constructor's state every time, never a scheduler a caller already moved
    from paritykit.schedule.schedulers import make_scheduler

    config = {"num_train_timesteps": 1000, "timestep_spacing": "trailing"}
    first = make_scheduler(diffusers.KDPM2DiscreteScheduler, config)
    built = first.timesteps.clone()
    first.set_timesteps(7)
    second = make_scheduler(diffusers.KDPM2DiscreteScheduler, config)
    assert second is not first and torch.equal(second.timesteps, built)
    other = make_scheduler(diffusers.KDPM2DiscreteScheduler, {**config, "use_karras_sigmas": True})
    other.set_timesteps(7)
    second.set_timesteps(7)
    assert not torch.equal(other.sigmas, second.sigmas)


@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_continuous_timesteps_are_compared_at_their_own_scale_and_sampling_eps_is_fitted(eps):
    # round 20 (score-models' VP SDE, from t = 1 down to 1e-5): the port's ScoreSdeVpScheduler kept
    # diffusers' sampling_eps 1e-3, and the fit said its config "as given … reproduces it" within 9.9e-4, the
    # tolerance of timesteps counted to 1000. Timesteps counted to 1 are held to a thousandth of it; the
    # reference's last timestep is tried as sampling_eps
    from diffusers.schedulers import ScoreSdeVpScheduler

    n = 8
    # Song et al. (2021)'s sampler: n times evenly from 1 down to eps
    timesteps = [1.0 - (1.0 - eps) * i / (n - 1) for i in range(n)]
    base = dict(ScoreSdeVpScheduler().config)  # sampling_eps 1e-3
    fit = fit_scheduler(ScoreSdeVpScheduler, {"timesteps": timesteps}, base_config=base)
    text = fit.render()
    if eps == 1e-3:  # must not fire: the port's own eps, as given
        assert fit.unchanged and "fix:" not in text, text
        return
    assert "config as given" not in text, text
    assert fit.fits and fit.fits[0].changes == {"sampling_eps": 1e-05}, text


@pytest.mark.parametrize("out_channels", [4, 2])
def test_a_loop_that_mixes_several_outputs_before_step_is_said_not_checked_not_a_solver_error(
    tmp_path, out_channels
):
    # round 30 (a weighted objective: the network returns noise, x0 and their weights, the loop mixes them):
    # the lockstep check fed the raw 4-channel output to DDPMScheduler.step and reported "step() failed …
    # (RuntimeError: torch.linalg.lstsq …)". Twice the channels is a learned variance step() splits off: it
    # must still be stepped
    from paritykit.schedule.step_check import lockstep

    torch.manual_seed(0)
    net = torch.nn.Conv2d(1, out_channels, 1)
    variance = "fixed_small" if out_channels == 4 else "learned_range"
    scheduler = DDPMScheduler(num_train_timesteps=10, variance_type=variance)
    scheduler.set_timesteps(4)

    def loop():
        x = torch.randn(1, 1, 4, 4)
        for t in scheduler.timesteps:
            out = net(x)
            eps = out[:, :1] * out[:, 1:2] if out_channels == 4 else out
            x = scheduler.step(eps, t, x, generator=torch.Generator().manual_seed(1)).prev_sample
        return x

    folder = record(net, tmp_path / "rec", loop)
    check = lockstep(DDPMScheduler(**scheduler.config), folder)
    if out_channels == 4:
        assert isinstance(check, str) and "(1, 4, 4, 4) is not shaped like its latents (1, 1, 4, 4)" in check
    else:
        assert not isinstance(check, str), check


def test_a_scheduler_whose_step_cannot_take_a_learned_variance_output_is_a_failed_candidate_not_a_crash(
    tmp_path,
):
    # round 34's rerun of round 26 (learned variance): the step check of a sibling scheduler (Euler) fed the
    # recorded 2C-channel outputs raised from inside diffusers and ended triage with a traceback
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv = torch.nn.Conv2d(1, 2, 1)

        def forward(self, sample, timestep):
            return self.conv(sample) * (1 + timestep / 100)

    net = Net()
    scheduler = DDPMScheduler(num_train_timesteps=10, variance_type="learned_range")
    scheduler.set_timesteps(4)

    def loop():
        x = torch.randn(1, 1, 4, 4)
        for t in scheduler.timesteps:
            x = scheduler.step(net(x, t), t, x, generator=torch.Generator().manual_seed(1)).prev_sample
        return x

    folder = record(net, tmp_path / "rec", loop)
    fit = fit_scheduler("EulerDiscreteScheduler", folder, step_check=folder)
    assert "step() failed on the recorded calls" in fit.render(), fit.render()


def test_a_config_holding_numpy_trained_betas_is_compared_element_by_element():
    # round 36 (Lumiere): a port's DDIMScheduler built with numpy trained_betas crashed the fit's search
    # ("The truth value of an array with more than one element is ambiguous")
    import numpy as np
    from paritykit.schedule.schedulers import config_changes

    betas = np.linspace(1e-4, 0.02, 10)
    assert config_changes({"trained_betas": betas.copy()}, {}, {"trained_betas": betas}) == {}
    assert config_changes({"trained_betas": betas.tolist()}, {}, {"trained_betas": betas}) == {}
    changed = config_changes({"trained_betas": betas * 2}, {}, {"trained_betas": betas})  # must fire
    assert list(changed) == ["trained_betas"]
