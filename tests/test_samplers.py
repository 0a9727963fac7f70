"""Sampler parity against k-diffusion itself, the sampler library behind A1111 and ComfyUI.

k-diffusion's own ``sampling.py`` and ``external.py`` (loaded by tests/kdiffusion.py, installed --no-deps) run
on a tiny UNet; a diffusers pipeline loop runs the same UNet with the scheduler, config and ``set_timesteps``
call the parity-testing skill's table names. Every row of that table is checked here at two step counts; a row
that is not exact names its causes, and replaying k-diffusion with exactly those causes removed must then
match. The step check (``schedule --fit --step-check`` on a ``record_loop`` folder) is tested on the same
recordings."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from paritykit import fit_scheduler

from tests import reference_loops as R
from tests.kdiffusion import load
from tests.sampling import one_thread, port_loop, record, tiny_cond_unet, tiny_inputs  # noqa: F401

SKILL = Path(__file__).resolve().parents[1] / "skills" / "parity-testing" / "references" / "workflow.md"
SD_BETAS = {"beta_start": R.BETA_START, "beta_end": R.BETA_END, "beta_schedule": "scaled_linear"}
EXACT = 1e-5  # relative to the largest value of the final latents: float32 rounding of a 10-step loop
FLUX_SEQ = 1024
FLUX_CONFIG = {
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


@dataclass(frozen=True)
class Row:
    r"""One row of the skill's table: k-diffusion's sampler over a sigma list, and the diffusers scheduler,
    config and ``set_timesteps`` call that reproduce it (``why`` names the causes when not exactly)."""

    sampler: str
    sigmas: str
    scheduler: str
    config: dict = field(default_factory=dict)
    call: str = "set_timesteps(n)"
    why: str = ""

    @property
    def exact(self) -> bool:
        return not self.why

    @property
    def flow(self) -> bool:
        return self.sigmas in ("sd3", "flux")

    def cells(self) -> list[str]:
        config = ", ".join(
            f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in self.config.items()
        )
        return [
            f"`{self.sampler}`",
            SIGMA_TEXT[self.sigmas],
            f"`{self.scheduler}({config})`",
            f"`{self.call}`",
            "exact" if self.exact else f"not exact: {self.why}",
        ]


SIGMA_TEXT = {
    "default": "`get_sigmas(n)`",
    "karras": "`get_sigmas_karras`",
    "exponential": "`get_sigmas_exponential`",
    "sd3": "SD3's `linspace(1, 0, n + 1)`, shift 3",
    "flux": "Flux's `get_schedule(n, seq_len)`",
}
ROUNDED = (
    "diffusers rounds t to integers (k-diffusion feeds fractional t) and starts at `noise`, k-diffusion at "
    "`noise·σmax/√(1+σmax²)` in VP terms; no config changes either"
)
ROWS = [
    Row("euler", "default", "EulerDiscreteScheduler"),
    Row("euler_ancestral", "default", "EulerAncestralDiscreteScheduler"),
    Row("heun", "default", "HeunDiscreteScheduler"),
    Row("dpm_2", "default", "KDPM2DiscreteScheduler"),
    Row("lms", "default", "LMSDiscreteScheduler"),
    Row("euler", "karras", "EulerDiscreteScheduler", {"use_karras_sigmas": True}),
    Row("dpmpp_2m", "karras", "DPMSolverMultistepScheduler", {"use_karras_sigmas": True}, why=ROUNDED),
    Row(
        "dpmpp_2m",
        "exponential",
        "DPMSolverMultistepScheduler",
        {"use_exponential_sigmas": True},
        why=ROUNDED + "; t also lands one lower (998 at σmax)",
    ),
    Row("euler", "sd3", "FlowMatchEulerDiscreteScheduler", {"shift": 3.0}),
    Row(
        "euler",
        "flux",
        "FlowMatchEulerDiscreteScheduler",
        FLUX_CONFIG,
        "set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=calculate_shift(seq_len, ...))",
    ),
]


def table() -> str:
    head = ["k-diffusion sampler", "sigmas", "diffusers scheduler", "call", "parity"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *("| " + " | ".join(row.cells()) + " |" for row in ROWS)])


# --- running both sides
# -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kd():
    return load()


@pytest.fixture(scope="module")
def unet():
    return tiny_cond_unet()


class Eps(torch.nn.Module):
    r"""The UNet as k-diffusion's wrappers call it: ``inner_model(x, t, **extra_args)``."""

    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, sample, timestep, cond):
        return self.unet(sample, timestep, encoder_hidden_states=cond).sample


class Flow(torch.nn.Module):
    r"""A velocity model as a k-diffusion denoiser (rectified flow, Esser et al. 2024: x_σ = (1 − σ) x0 + σ ε
    and v = ε − x0, so x0 = x_σ − σ v), called at t = 1000 σ as SD3's sampler calls its model."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, sigma, cond):
        return x - sigma.reshape(-1, 1, 1, 1) * self.inner(x, sigma * 1000, cond)


def eps_denoiser(kd, unet, timesteps=None):
    r"""k-diffusion's DiscreteEpsDDPMDenoiser over SD's training schedule; ``timesteps``, ``{sigma: t}``,
    replaces its sigma → t lookup (the replay that feeds the model diffusers' timesteps)."""
    _, external = kd
    den = external.DiscreteEpsDDPMDenoiser(Eps(unet), R.alphas_cumprod().float(), quantize=False)
    if timesteps is not None:
        table = sorted(timesteps.items())

        def sigma_to_t(sigma, quantize=None):
            return torch.tensor(min(table, key=lambda st: abs(st[0] - float(sigma)))[1]).to(sigma)

        den.sigma_to_t = sigma_to_t
    return den


def sigma_list(kd, den, kind: str, n: int) -> torch.Tensor:
    sampling, _ = kd
    return {
        "default": lambda: den.get_sigmas(n),
        "karras": lambda: sampling.get_sigmas_karras(n, float(den.sigma_min), float(den.sigma_max)),
        "exponential": lambda: sampling.get_sigmas_exponential(n, float(den.sigma_min), float(den.sigma_max)),
        "sd3": lambda: torch.tensor(R.sd3_sigmas(n)),
        "flux": lambda: torch.tensor(R.flux_sigmas(n, FLUX_SEQ)),
    }[kind]().float()


def run_kdiffusion(kd, unet, row: Row, n: int, noise, cond, *, timesteps=None, start_scale=None, rec=None):
    sampling, _ = kd
    if row.flow:
        den = Flow(Eps(unet))
        sigmas = sigma_list(kd, None, row.sigmas, n)
    else:
        den = eps_denoiser(kd, unet, timesteps)
        sigmas = sigma_list(kd, den, row.sigmas, n)
    x = noise * (sigmas[0] if start_scale is None else start_scale)
    torch.manual_seed(5)  # ancestral noise: both sides draw from the global generator, one draw per step
    with torch.no_grad():
        return getattr(sampling, f"sample_{row.sampler}")(
            den, x, sigmas, extra_args={"cond": cond}, disable=True
        )


def make_port(row: Row):
    config = {**({} if row.flow else SD_BETAS), **row.config}
    return getattr(diffusers, row.scheduler)(**config)


def run_port(unet, row: Row, n: int, noise, cond):
    scheduler = make_port(row)
    call = {}
    if row.sigmas == "flux":
        s = scheduler.config
        mu = calculate_shift(FLUX_SEQ, s.base_image_seq_len, s.max_image_seq_len, s.base_shift, s.max_shift)
        call = {"sigmas": np.linspace(1.0, 1 / n, n), "mu": mu}
    torch.manual_seed(5)
    with torch.no_grad():
        return port_loop(unet, scheduler, noise, cond, n, **call), scheduler


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# --- the table
# ------------------------------------------------------------------------------------------------------------
def test_the_skill_holds_this_table():
    assert table() in SKILL.read_text(), (
        "regenerate the table: python -c 'from tests.test_samplers import table; print(table())'"
    )


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r.sampler}-{r.sigmas}")
@pytest.mark.parametrize("n", [10, 7])
def test_each_row_against_kdiffusion(kd, unet, row, n):
    noise, cond = tiny_inputs()
    reference = run_kdiffusion(kd, unet, row, n, noise, cond)
    ported, scheduler = run_port(unet, row, n, noise, cond)
    if row.exact:
        assert rel(ported, reference) <= EXACT
        return
    assert rel(ported, reference) > EXACT  # the row says "not exact": it must not be
    # replay: k-diffusion fed diffusers' timesteps and started where diffusers starts reproduces the port;
    # with either cause left in, it does not, so both named causes are real and together they are all of it
    timesteps = {float(s): float(t) for s, t in zip(scheduler.sigmas, scheduler.timesteps)}
    start = math.sqrt(1 + float(scheduler.sigmas[0]) ** 2)
    both = run_kdiffusion(kd, unet, row, n, noise, cond, timesteps=timesteps, start_scale=start)
    assert rel(ported, both) <= EXACT
    assert rel(ported, run_kdiffusion(kd, unet, row, n, noise, cond, timesteps=timesteps)) > EXACT
    assert rel(ported, run_kdiffusion(kd, unet, row, n, noise, cond, start_scale=start)) > EXACT
    den = eps_denoiser(kd, unet)
    assert any(t != round(t) for t in den.sigma_to_t(scheduler.sigmas[:-1]).tolist())  # k-diffusion's own t
    assert all(float(t) == round(float(t)) for t in scheduler.timesteps)
    if row.sigmas == "exponential":
        assert float(scheduler.timesteps[0]) == 998 and float(den.sigma_to_t(den.sigma_max)) == pytest.approx(
            999
        )


# --- the step check on recorded k-diffusion loops
# -------------------------------------------------------------------
DPM_KARRAS = ROWS[6]


def record_kdiffusion(kd, unet, row, folder, n=10, *, quantize=False, batch=1):
    r"""k-diffusion's loop recorded at the UNet wrapper (inputs scaled by c_in, outputs the model's epsilon),
    with the loop's result kept; ``quantize`` is k-diffusion's own option to feed integer timesteps."""
    noise, cond = tiny_inputs(batch)
    sampling, external = kd
    eps = Eps(unet)
    den = external.DiscreteEpsDDPMDenoiser(eps, R.alphas_cumprod().float(), quantize=quantize)
    sigmas = sigma_list(kd, den, row.sigmas, n)
    run = getattr(sampling, f"sample_{row.sampler}")
    return record(
        eps,
        folder,
        lambda: run(den, noise * sigmas[0], sigmas, extra_args={"cond": cond}, disable=True),
        final=True,
    )


def fit(name, folder, **config):
    return fit_scheduler(name, folder, base_config={**SD_BETAS, **config}, step_check=folder)


def test_dpmpp_2m_recorded_is_fitted_and_every_update_checked_with_no_hint(kd, unet, tmp_path):
    folder = record_kdiffusion(kd, unet, DPM_KARRAS, tmp_path / "ref", quantize=True)
    result = fit("DPMSolverMultistepScheduler", folder)
    assert (
        result.line
        == "DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)"
    )
    check = result.fits[0].step_check
    assert check.matched and check.steps_checked == 10 and check.quantity is None and not check.explanation


@pytest.mark.parametrize(
    ("wrong", "fix", "quantity", "step"),
    [
        ({"final_sigmas_type": "sigma_min"}, {"final_sigmas_type": "zero"}, "the final sigma", 9),
        ({"solver_order": 1}, {"solver_order": 2}, "how many previous model outputs", 1),
    ],
)
def test_step_check_names_the_quantity_its_replay_fixes(kd, unet, tmp_path, wrong, fix, quantity, step):
    folder = record_kdiffusion(kd, unet, DPM_KARRAS, tmp_path / "ref", quantize=True)
    result = fit("DPMSolverMultistepScheduler", folder, **wrong)
    best = result.fits[0]
    assert best.changes == {"use_karras_sigmas": True, **fix}
    assert best.step_check.matched and best.step_check.quantity.startswith(quantity)
    assert f"the update differs at step {step} " in best.step_check.explanation
    key, value = next(iter(fix.items()))
    assert f"{key}={json.dumps(value) if isinstance(value, str) else value}" in result.line


def test_an_update_no_step_key_explains_is_ruled_out_not_named(kd, unet, tmp_path):
    folder = record_kdiffusion(kd, unet, DPM_KARRAS, tmp_path / "ref", quantize=True)
    result = fit("UniPCMultistepScheduler", folder)  # same lists, a predictor-corrector step
    assert result.fits == [] and result.nearest.changes == {"use_karras_sigmas": True}
    check = result.nearest.step_check
    assert not check.matched and check.quantity is None and check.first_failing_step == 1
    assert "none of them, alone or in pairs, is the cause" in check.explanation
    assert "lower_order_final" in check.explanation and "solver_order" in check.explanation
    assert any(e.startswith("DPMSolverMultistepScheduler reproduces it") for e in result.elsewhere)


@pytest.mark.parametrize(
    ("row", "n", "calls"),
    [(ROWS[2], 10, 19), (ROWS[3], 10, 19), (ROWS[4], 10, 10), (ROWS[0], 9, 9)],
    ids=["heun", "dpm_2", "lms", "euler-odd-count"],
)
def test_two_call_and_multistep_schedulers_are_checked_in_lockstep(kd, unet, tmp_path, row, n, calls):
    folder = record_kdiffusion(kd, unet, row, tmp_path / "ref", n)
    result = fit(row.scheduler, folder)  # KDPM2's 2n - 1 distinct calls read as n steps; Euler's 9 stay 9
    assert result.line == f"{row.scheduler}.from_config(pipe.scheduler.config)" and result.steps == n
    assert result.fits[0].step_check.matched and result.fits[0].step_check.steps_checked == calls


def test_what_a_recording_cannot_check_is_said_not_guessed(kd, unet, tmp_path):
    # ancestral: the noise each step drew is in no recording
    folder = record_kdiffusion(kd, unet, ROWS[1], tmp_path / "ancestral")
    result = fit("EulerAncestralDiscreteScheduler", folder)
    assert result.fits and result.fits[0].step_check is None
    assert any("draws fresh noise" in n for n in result.notes)
    # a guidance batch (the same latents twice): the guided output the step used is not recorded
    noise, cond = tiny_inputs()
    guided = record(
        unet,
        tmp_path / "cfg",
        lambda: port_loop(
            unet, diffusers.EulerDiscreteScheduler(**SD_BETAS), torch.cat([noise] * 2), torch.cat([cond] * 2)
        ),
    )
    result = fit("EulerDiscreteScheduler", guided)
    assert result.fits[0].step_check is None and any("classifier-free guidance" in n for n in result.notes)
    # ... but two different images in one batch are checked as usual
    noise2, cond2 = tiny_inputs(2)
    two = record(
        unet,
        tmp_path / "two",
        lambda: port_loop(unet, diffusers.EulerDiscreteScheduler(**SD_BETAS), noise2, cond2),
        final=True,
    )
    assert fit("EulerDiscreteScheduler", two).fits[0].step_check.matched
    # the k-diffusion wrapper itself (it takes sigma and returns its x0 estimate) is not the network
    sampling, external = kd
    den = external.DiscreteEpsDDPMDenoiser(Eps(unet), R.alphas_cumprod().float(), quantize=False)
    sigmas = den.get_sigmas(10)
    wrapper = record(
        den,
        tmp_path / "wrapper",
        lambda: sampling.sample_euler(
            den, noise * sigmas[0], sigmas, extra_args={"cond": cond}, disable=True
        ),
    )
    result = fit("EulerDiscreteScheduler", wrapper)
    assert all(c.step_check is None for c in result.fits) and any("takes sigma" in n for n in result.notes)


def test_fractional_karras_timesteps_name_the_rounding_and_the_class_that_keeps_them(kd, unet, tmp_path):
    folder = record_kdiffusion(kd, unet, DPM_KARRAS, tmp_path / "ref", quantize=False)
    result = fit_scheduler("DPMSolverMultistepScheduler", folder, base_config=SD_BETAS)
    assert result.fits == [] and result.nearest.changes == {"use_karras_sigmas": True}
    assert any("[int-vs-float]" in d for d in result.differences)
    assert any(e.startswith("EulerDiscreteScheduler reproduces it") for e in result.elsewhere)
    # with the step checked, Euler keeps the timesteps but not DPM-Solver++'s update: it is not offered
    checked = fit("DPMSolverMultistepScheduler", folder)
    assert not any(e.startswith("EulerDiscreteScheduler reproduces it") for e in checked.elsewhere)
