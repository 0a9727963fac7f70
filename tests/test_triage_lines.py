"""Triage's lines where the walk cannot compare a place, or compares it only in part: other noise said by the
plain draw that reproduces each side, a result no place could be checked before, an update no linear rule
explains (regression cases from rounds 16 and 17 of the agent A/B, benchmarks/results/agent_ab.md)."""

from __future__ import annotations

import pytest
import torch
from paritykit.triage import triage_spec

from tests.sampling import one_thread  # noqa: F401  (one torch thread for these tiny models)
from tests.triage_pairs import write_spec


def run(tmp_path, bugs=(), *, vae=True):
    return triage_spec(write_spec(tmp_path, bugs, vae=vae), out=tmp_path / "out")


def triage_text(tmp_path, text: str, all_causes: bool = False):
    r"""Triage of a SPEC written from ``text`` into ``tmp_path``."""
    spec = tmp_path / "spec.py"
    spec.write_text(text)
    return triage_spec(spec, out=tmp_path / "out", all_causes=all_causes)


def one_finding(tmp_path, text: str, place: str):
    r"""Triage of a SPEC written from ``text``: its one finding, which must be at ``place``."""
    report = triage_text(tmp_path, text)
    (finding,) = report.findings
    assert finding.place == place, report.render()
    return finding


@pytest.mark.parametrize("bug", ["noise-f64", "noise-seed"])
def test_other_noise_says_which_plain_draw_reproduces_each_side(tmp_path, bug):
    # round 16 (x-unet): the port drew its noise in float64 and cast it; "another generator, seed, device or
    # draw order" left the dtype out. Each side's noise is redrawn: what reproduces it exactly is said
    report = run(tmp_path, [bug], vae=False)
    finding = next(f for f in report.findings if f.place == "initial noise")
    said = "the reference's are exactly torch.randn(…, dtype=float32) after torch.manual_seed(0)"
    assert said in finding.summary, finding.summary
    if bug == "noise-f64":
        said = "the port's are exactly torch.randn(…, dtype=float64) after torch.manual_seed(0)"
        assert said in finding.summary, finding.summary
    else:  # must not name a draw: the port's generator is seeded with a number no side used
        assert "the port's are no plain CPU draw tried" in finding.summary, finding.summary


RESULT_SPEC = """
import torch
from tests.triage_pairs import Pair, ddim_loop

PAIR = Pair(set(), vae=False)
port_scheduler = PAIR.port_scheduler


class Padded(torch.nn.Module):  # the port's latents carry a fifth channel its denoiser drops
    def __init__(self, unet):
        super().__init__()
        self.unet = unet

    def forward(self, x, t, cond):
        return self.unet(x[:, :4] * 1.01, t, encoder_hidden_states=cond).sample


PORT = Padded(PAIR.port_unet)


def run_reference():
    return PAIR.run_reference()


def run_port():
    padded = lambda x, t, c: PORT(torch.cat([x, x[:, :1]], 1), t, c)  # noqa: E731
    return ddim_loop(padded, torch.randn(1, 4, 8, 8), PAIR.cond, 5, "trailing")


def reference_denoiser():
    return PAIR.ref_unet


def port_denoiser():
    return PORT
"""


def test_a_result_that_differs_where_nothing_was_comparable_points_nowhere(tmp_path):
    # round 16 (transfusion): no call could be compared, yet the result line pointed at "what runs after the
    # last denoiser call". That pointer is said only where the walk compared the places before it
    spec = tmp_path / "result_spec.py"
    spec.write_text(RESULT_SPEC)
    report = triage_spec(spec, out=tmp_path / "out")
    (finding,) = report.findings
    assert finding.place == "result", report.render()
    assert "no place before them could be checked" in finding.summary, finding.summary
    assert "what runs after the last denoiser call" not in finding.summary
    (skipped,) = [n for n in report.not_checked if n.place == "initial noise"]
    assert "latents shapes differ" in skipped.text
    # with --all, the count of places that differ says which were not checked (round 15: "1 place differ"
    # beside an update that was never compared read as "everything else agrees")
    every = triage_spec(spec, out=tmp_path / "all", all_causes=True)
    head = every.render().splitlines()[0]
    assert (
        head
        == "verdict: differ (1 place differs, each checked on its own; causes in a place are not counted; not"
        " checked: denoiser, initial noise)"
    )


THRESHOLD_SPEC = """
import torch
from diffusers import DDIMScheduler
from tests.reference_loops import alphas_cumprod, ddim_timesteps
from tests.triage_pairs import Pair

PAIR = Pair(set(), vae=False)


def port_scheduler():  # thresholding on, but sample_max_value's default 1.0 caps it: plain clipping
    return DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                         timestep_spacing="trailing", thresholding=True, dynamic_thresholding_ratio=0.95)


def run_reference():  # Imagen's dynamic thresholding (Saharia et al. 2022), written from the paper
    ac, x = alphas_cumprod(), torch.randn(1, 4, 8, 8) * 20
    steps = ddim_timesteps(5, "trailing")
    for i, t in enumerate(steps):
        eps = PAIR.ref_unet(x, torch.tensor(t), encoder_hidden_states=PAIR.cond).sample.double()
        a, a_prev = ac[t], ac[steps[i + 1]] if i + 1 < len(steps) else torch.tensor(1.0, dtype=torch.float64)
        x0 = (x.double() - (1 - a).sqrt() * eps) / a.sqrt()
        s = torch.quantile(x0.abs().reshape(1, -1), 0.95, dim=1).clamp(min=1.0)
        x0 = x0.clamp(-s, s) / s
        x = (a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps).float()
    return x


def run_port():
    scheduler = port_scheduler()
    scheduler.set_timesteps(5)
    x = torch.randn(1, 4, 8, 8) * 20
    for t in scheduler.timesteps:
        eps = PAIR.port_unet(x, t, encoder_hidden_states=PAIR.cond).sample
        x = scheduler.step(eps, t, x, return_dict=False)[0]
    return x


def reference_denoiser():
    return PAIR.ref_unet


def port_denoiser():
    return PAIR.port_unet
"""


def test_a_thresholded_update_is_not_called_irreproducible(tmp_path):
    # round 17 (make-a-video): the reference's DDIM with dynamic thresholding is no linear rule of its latents
    # and output, and "a replay of step() on those values cannot reproduce it" was false: step() with
    # thresholding does. What is measured is said, and that step() was not replayed
    finding = one_finding(tmp_path, THRESHOLD_SPEC, "update")
    said = " ".join(finding.evidence)
    assert "is no exact linear rule" in said and "so step() was not replayed on them" in said, said
    assert "cannot reproduce" not in said


@pytest.mark.parametrize("models", [False, True], ids=["traces-alone", "replayed"])
def test_a_culprit_found_by_a_jump_is_never_said_to_differ_on_identical_inputs(tmp_path, models):
    # round 17 (make-a-video): triage called a culprit compared only between the two runs' captured outputs
    # "a module that differs on identical inputs"; it was never fed them
    from paritykit.bisection.entry import bisect_traces
    from paritykit.triage.measures import bisect_finding

    from tests.test_bisect import _trace_dirs

    reference, port, rt, pt = _trace_dirs(tmp_path, "dit", "gelu")
    report = bisect_traces(rt, pt, reference=reference if models else None, port=port if models else None)
    finding = bisect_finding("denoiser", 0, report)
    assert report.culprit.test == ("replay" if models else "jump"), report.render()
    if not models:
        assert "differs on identical inputs" not in finding.summary, finding.summary
        assert "(jump: not replayed on identical inputs)" in finding.summary
    else:  # a replayed culprit was fed the reference's inputs: said so
        assert "a module that differs on identical inputs" in finding.summary


class _Table(torch.nn.Module):
    r"""An embedding computed from a table buffer and a Linear after it: the table is no module of its own."""

    def __init__(self, scale: float, flat: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("table", torch.randn(8, 6) * scale)
        self.proj = torch.nn.Linear(6, 6)
        self.flat = flat

    def forward(
        self, t
    ):  # the port's output of another shape (no view of a size-1 dim): no top-level culprit
        out = self.proj(self.table[t])
        return out.reshape(-1) if self.flat else out[None]


def test_no_culprit_is_never_said_to_be_one(tmp_path):
    # round 18 (diffwave): the port's timestep table differed; bisect named no culprit, and triage called the
    # first module whose outputs differ (a Linear fed that table) "bisect's culprit, a module that differs on
    # identical inputs"
    from paritykit.bisection.entry import bisect
    from paritykit.triage.measures import bisect_finding

    reference, port = _Table(1.0).eval(), _Table(1.0, flat=True).eval()
    port.proj.load_state_dict(reference.proj.state_dict())
    port.table.mul_(1.01)
    report = bisect(reference, port, ((torch.tensor([3, 5]),), {}))
    assert report.culprit is None and report.first_output_divergence is not None, report.render()
    finding = bisect_finding("denoiser", 0, report)
    assert "bisect named no culprit; the first aligned module whose outputs differ: proj" in finding.summary
    assert "differs on identical inputs" not in finding.summary
    assert finding.evidence[0].startswith(
        "no culprit named; first aligned module whose outputs differ: reference proj"
    )


# a denoiser of the SPECs below: a projection of the latents plus one of the timestep
TINY_NET = """class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.time = torch.nn.Linear(1, 8)

    def forward(self, x, t):
        return self.proj(x) + self.time(t.reshape(-1, 1))[:, None]
"""


HEUN_SPEC = (
    """
import math

import torch
from diffusers import EDMEulerScheduler

STEPS = 4
SIGMA_DATA = 0.5
PORT_CHURN_STEP = {port_churn}


"""
    + TINY_NET
    + """

NET = Net().eval()
SCHEDULER = EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, sigma_data=SIGMA_DATA)


def denoised(x, sigma, c_noise):  # Karras et al. (2022), table 1
    c_in = 1 / math.sqrt(sigma**2 + SIGMA_DATA**2)
    c_skip = SIGMA_DATA**2 / (sigma**2 + SIGMA_DATA**2)
    c_out = sigma * SIGMA_DATA / math.sqrt(sigma**2 + SIGMA_DATA**2)
    t = torch.tensor([c_noise], dtype=torch.float32)
    return c_skip * x + c_out * NET(c_in * x, t)


def heun(sigmas, churn_step, noise_of):
    # Karras et al. (2022), algorithm 2, its churn raising sigma at one step (without the added noise)
    x = torch.randn(1, 4, 8) * sigmas[0]
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        s_hat = s * 1.25 if i == churn_step else s
        d = (x - denoised(x, s_hat, noise_of(i, s_hat))) / s_hat
        x_next = x + (s_next - s_hat) * d
        if s_next > 0:
            d2 = (x_next - denoised(x_next, s_next, noise_of(i + 1, s_next))) / s_next
            x_next = x + (s_next - s_hat) * (d + d2) / 2
        x = x_next
    return x


def karras_sigmas(n, smin=0.002, smax=80.0, rho=7.0):
    ramp = [i / (n - 1) for i in range(n)]
    top, bottom = smax ** (1 / rho), smin ** (1 / rho)
    return [(top + r * (bottom - top)) ** rho for r in ramp] + [0.0]


def run_reference():
    return heun(karras_sigmas(STEPS), 1, lambda i, s: math.log(s) / 4)


def run_port():
    SCHEDULER.set_timesteps(STEPS)
    sigmas = [float(s) for s in SCHEDULER.sigmas]
    steps = [float(t) for t in SCHEDULER.timesteps]

    def noise_of(i, s):  # the scheduler's timestep, or the churned sigma's where the port churns
        return float(SCHEDULER.precondition_noise(torch.tensor(s))) if s != sigmas[i] else steps[i]

    return heun(sigmas, PORT_CHURN_STEP, noise_of)


def reference_denoiser():
    return NET


def port_denoiser():
    return NET


def port_scheduler():
    return SCHEDULER
"""
)


@pytest.mark.parametrize("port_churn", [None, 2])
def test_a_heun_loop_is_read_against_the_schedulers_list_for_its_own_step_count(tmp_path, port_churn):
    # round 18 (EDM, denoising-diffusion-pytorch): the port's Heun loop calls its denoiser 7 times in 4
    # steps; triage printed "the port's scheduler gives the timesteps [...] (7)", set_timesteps(7)'s list,
    # and called the port's values converted although each was its scheduler's own for the 4 steps it set
    report = triage_text(tmp_path, HEUN_SPEC.format(port_churn=port_churn))
    finding = next(f for f in report.findings if f.place == "schedule")
    assert finding.call == 2, report.render()
    text = "\n".join(finding.evidence)
    if port_churn is None:  # must not fire: every value the port feeds is its scheduler's
        assert "the port's scheduler" not in text, text
        return
    said = "the port's scheduler, as port_scheduler() returned it (4 steps), gives the timesteps"
    assert said in text and "from call 4 the fed value is not the scheduler's" in text, text


SCALED_SPEC = (
    """
import math

import torch

SIGMAS = [14.6, 7.3, 4.1, 2.5, 1.6, 0.0]
PORT = "{port}"


"""
    + TINY_NET
    + """

class Scaled(torch.nn.Module):  # the research's wrapper: the input scaled inside the denoiser
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, sigma):
        return self.net(x / torch.sqrt(1 + sigma**2), sigma)


NET = Net().eval()
REFERENCE = Scaled(NET).eval()


def euler(denoise, x):
    for s, s_next in zip(SIGMAS, SIGMAS[1:]):
        eps = denoise(x, torch.tensor([s]))
        x = x + (s_next - s) * eps
    return x


def run_reference():
    return euler(REFERENCE, torch.randn(1, 4, 8) * SIGMAS[0])


def run_port():
    x = torch.randn(1, 4, 8) * SIGMAS[0] * (0.5 if PORT == "noise" else 1.0)
    if PORT == "noise":  # the port's own wrapper, identical to the reference's: the noise alone differs
        return euler(REFERENCE, x)
    # the port scales the input before its network, as a pipeline calling scale_model_input does
    return euler(lambda x, sigma: NET(x / torch.sqrt(1 + sigma**2), sigma), x)


def reference_denoiser():
    return REFERENCE


def port_denoiser():
    return REFERENCE if PORT == "noise" else NET
"""
)


@pytest.mark.parametrize("port", ["scaled-before", "noise"])
def test_an_input_scaled_before_the_denoiser_on_one_side_and_inside_it_on_the_other_is_no_noise(
    tmp_path, port
):
    # round 19 (smalldiffusion): the research scales x by 1/sqrt(1 + sigma^2) inside its Scaled wrapper, the
    # port before its transformer; triage called the first call's latents "a missing or extra scaling of the
    # noise", and fed the port's transformer the reference's unscaled latents to name a false culprit
    report = triage_text(tmp_path, SCALED_SPEC.format(port=port), all_causes=True)
    text = report.render()
    if port == "noise":  # must not fire: the noise itself is scaled, and the outputs differ
        finding = next(f for f in report.findings if f.place == "initial noise")
        assert "a lead: the first call's input is scaled otherwise" in finding.summary, text
        assert "timestep differs too" not in finding.summary, text  # the sigmas agree
        return
    assert report.result_matches, text
    assert not any(f.place in ("initial noise", "denoiser") for f in report.findings), text
    assert "other scales" in text and "not other noise; the factor changes with the call" in text, text
    assert "every call's outputs agree (5 calls) although the inputs differ" in text, text


# a denoiser whose output scales with sigma: each step's update is an exact linear rule of latents and output
SIGMA_NET = """

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, sigma):
        return self.proj(x) * (1 + sigma.reshape(-1, 1, 1))


NET = Net().eval()
"""


ROUNDING_SPEC = (
    """
import torch

TOLERANCE = {{"atol": {tol}, "rtol": {tol}}}
SIGMAS = [3.0, 2.0, 1.2, 0.6, 0.0]
SLIP = {slip}
"""
    + SIGMA_NET
    + """

def run_reference():  # the update computed in float64, as a research loop may
    x = torch.randn(1, 4, 8) * SIGMAS[0]
    for s, s_next in zip(SIGMAS, SIGMAS[1:]):
        eps = NET(x, torch.tensor([s]))
        x = (x.double() + (s_next - s) * eps.double()).float()
    return x


def run_port():  # in float32, the step size off by SLIP
    x = torch.randn(1, 4, 8) * SIGMAS[0]
    for s, s_next in zip(SIGMAS, SIGMAS[1:]):
        eps = NET(x, torch.tensor([s]))
        x = x + (s_next - s) * (1 + SLIP) * eps
    return x


def reference_denoiser():
    return NET


def port_denoiser():
    return NET
"""
)


@pytest.mark.parametrize("slip", [0.0, 1e-4])
def test_an_update_that_differs_by_rounding_alone_is_no_place(tmp_path, slip):
    # round 20 (score-models): on the fixed port, "inside the run, update at call 6: the latents after step 6
    # differ …, the sampler's update (cause unknown …)" for a relative 2.8e-7, float32 rounding
    report = triage_text(tmp_path, ROUNDING_SPEC.format(slip=slip, tol=1e-9))
    text = report.render()
    if slip:  # must not fire: a step size 1e-4 off is a place that differs
        assert any(f.place == "update" for f in report.findings), text
        assert "eight times float32's rounding step" not in text, text
        return
    assert not any(f.place == "update" for f in report.findings), text
    assert "relative (L2) in all, under 9.54e-07, eight times float32's rounding step" in text, text


def test_update_rules_apart_by_less_than_the_tolerance_moves_are_no_place(tmp_path):
    # round 22 (autoregressive-diffusion-pytorch): the port's Karras sigmas, computed in float64, stand 1.2e-4
    # apart from the research's float32 ones at the last steps; "update at call 13: the update … differs:
    # ×1.00012" was counted as a place that differs, on the shipped port and on the fixed one alike. The two
    # rules, applied to the same latents and output, are compared under the run's tolerance
    report = triage_text(tmp_path, ROUNDING_SPEC.format(slip=1.2e-4, tol=1e-2), all_causes=True)
    text = report.render()
    assert report.verdict == "match" and not report.findings, text
    said = "at calls 0-3 they agree within the tolerance only: their coefficients differ, and applied to the"
    assert said in text, text
    # must fire where that tolerance is strict: the same rules then move the latents beyond it
    strict = tmp_path / "strict"
    strict.mkdir()
    report = triage_text(strict, ROUNDING_SPEC.format(slip=1.2e-4, tol=1e-6), all_causes=True)
    assert any(f.place == "update" for f in report.findings), report.render()


STOCHASTIC_SPEC = (
    """
import torch

SIGMAS = [3.0, 2.0, 1.2, 0.6, 0.0]
CHURN = {churn}
SKIP_FIRST_DRAW = {skip}
"""
    + SIGMA_NET
    + """

def sample(skip):
    x = torch.randn(1, 4, 8) * SIGMAS[0]
    for i, (s, s_next) in enumerate(zip(SIGMAS, SIGMAS[1:])):
        eps = NET(x, torch.tensor([s]))
        x = x + (s_next - s) * eps
        if CHURN and not (skip and i == 0):  # fresh noise after every step but the last
            x = x + CHURN * s_next * torch.randn_like(x)
    return x


def run_reference():
    return sample(False)


def run_port():
    return sample(SKIP_FIRST_DRAW)


def reference_denoiser():
    return NET


def port_denoiser():
    return NET
"""
)


@pytest.mark.parametrize("churn", [0.0, 0.1])
def test_a_rule_out_of_the_initial_noise_says_which_later_draws_it_does_not_cover(tmp_path, churn):
    # round 22 (autoregressive-diffusion-pytorch): "ruled out: initial noise: the first call's latents agree"
    # on a port that skipped one of the sampler's later noise draws, shifting every draw after it. The
    # rule-out names the calls whose latents no linear update explains, which it does not cover
    report = triage_text(tmp_path, STOCHASTIC_SPEC.format(churn=churn, skip=bool(churn)), all_causes=True)
    text = report.render()
    said = (
        "ruled out: initial noise: the first call's latents agree; the latents of calls 1-3 are no exact"
        " linear rule of the call before's latents and output on a side, so what was drawn there is not"
    )
    if churn:
        assert said in text, text
        assert report.verdict == "differ", text
    else:  # must not fire: a deterministic sampler's every later latents follow from the first call's
        assert "ruled out: initial noise: the first call's latents agree\n" in text + "\n", text
        assert "not covered" not in text, text


def test_the_progress_bars_of_the_code_run_stay_off_when_stderr_is_captured(tmp_path, cli):
    # round 22: a research sampler's tqdm bars (two nested, redrawn at every step) filled an agent's `2>&1`
    spec = tmp_path / "spec.py"
    text = STOCHASTIC_SPEC.format(churn=0.0, skip=False)
    text = text.replace(
        "enumerate(zip(SIGMAS, SIGMAS[1:]))", "enumerate(tqdm(list(zip(SIGMAS, SIGMAS[1:])), desc='steps'))"
    )
    spec.write_text("from tqdm import tqdm\n" + text)
    run = cli("triage", spec, "--out", tmp_path / "out")
    assert run.returncode == 0 and "verdict: match" in run.stdout, run.stdout + run.stderr
    assert "steps" not in run.stderr and "it/s" not in run.stderr, run.stderr
    # must not override a caller who asked for the bars
    run = cli("triage", spec, "--out", tmp_path / "out2", env={"TQDM_DISABLE": ""})
    assert "steps" in run.stderr, run.stderr


KEPT_SPEC = """
import torch

SIGMAS = [0.9, 0.6, 0.3, 0.0]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.level = torch.nn.Linear(1, 8)

    def forward(self, x, level):
        return self.proj(x) + self.level(level.reshape(-1, 1))[:, None]


class Reference(torch.nn.Module):  # the research names its noise level nothing triage reads as a timestep
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, cond, gain):  # as WaveGrad's (audio, spectrogram, noise_scale)
        return self.net(x + cond, gain)


class Port(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, sample, timestep, cond):
        return self.net(sample + cond, timestep)


NET = Net().eval()
REFERENCE, PORT = Reference(NET).eval(), Port(NET).eval()


COND = torch.linspace(-1, 1, 32).reshape(1, 4, 8)


def run_reference():  # its noise level third, shaped (batch, 1): no timestep triage reads
    x = torch.randn(1, 4, 8)
    for s, s_next in zip(SIGMAS, SIGMAS[1:]):
        x = x + (s_next - s) * REFERENCE(x, COND, torch.full((1, 1), s))
    return x


def run_port():  # the port's noise levels are off: the place is the denoiser's input, the port's own
    x = torch.randn(1, 4, 8)
    for s, s_next in zip(SIGMAS, SIGMAS[1:]):
        x = x + (s_next - s) * PORT(x, torch.full((1,), s * 0.8), COND)
    return x


def reference_denoiser():
    return REFERENCE


def port_denoiser():
    return PORT
"""


def test_a_denoiser_fed_some_of_its_own_inputs_is_never_said_to_get_identical_ones(tmp_path):
    # round 21 (wavegrad): the port's noise level paired with no reference input stayed the port's own, and
    # triage said "the port's denoiser, fed the reference's call-0 inputs, differs …; bisect's culprit, a
    # module that differs on identical inputs: (top level)"
    report = triage_text(tmp_path, KEPT_SPEC)
    finding = next(f for f in report.findings if f.place == "denoiser")
    assert "fed the reference's call-0 inputs but its own timestep" in finding.summary, finding.summary
    assert "identical inputs" not in finding.summary, finding.summary


def test_first_latents_that_differ_with_the_first_timestep_are_said_to_maybe_come_from_it(tmp_path):
    # round 31 (Karras U-Net 1-D with EDM churn): the port churned its first step (sigma 80 raised to 113,
    # noise added), and triage's first line, "initial noise at call 0: the first call's latents differ",
    # pointed at the noise draw; the timestep line below it was the cause
    report = triage_text(tmp_path, HEUN_SPEC.format(port_churn=0), all_causes=True)
    finding = next(f for f in report.findings if f.place == "initial noise")
    assert "call 0's timestep differs too, so a lead: the latents may be prepared for that other level" in (
        finding.summary
    ), report.render()
    assert any(f.place == "schedule" and f.call == 0 for f in report.findings), report.render()


FLOW_TIME_SPEC = (
    """
import torch

PORT = "{port}"
TIMES = [0.0, 0.25, 0.5, 0.75, 1.0]  # the research's flow time: noise at 0


"""
    + TINY_NET
    + """

NET = Net().eval()


class FromSigma(torch.nn.Module):  # a port denoiser that turns the scheduler's sigma into flow time inside
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x, t):  # given the scheduler's sigma
        return self.net(x, 1 - t)


PORT_DENOISER = FromSigma(NET).eval() if PORT == "inside" else NET


def run_reference():
    x = torch.randn(1, 4, 8)
    for t, t_next in zip(TIMES, TIMES[1:]):
        x = x + (t_next - t) * NET(x, torch.tensor([t]))
    return x


def run_port():
    x = torch.randn(1, 4, 8)
    sigmas = [1 - t for t in TIMES]
    for s, s_next in zip(sigmas, sigmas[1:]):
        x = x + (s - s_next) * PORT_DENOISER(x, torch.tensor([s]))
    return x


def reference_denoiser():
    return NET


def port_denoiser():
    return PORT_DENOISER
"""
)


@pytest.mark.parametrize("port", ["inside", "fed-sigma"])
def test_timesteps_that_agree_only_in_other_units_are_one_schedule_only_where_the_port_takes_them_so(
    tmp_path, port
):
    # round 32 (torchcfm + flow_matching): the port fed its network the scheduler's sigma where the research
    # feeds flow time t = 1 - sigma, and triage said "ruled out: schedule timesteps: the 16 timesteps agree
    # (the reference gives t in [0, 1] (noise at 1), the port 1 - t: compared and replayed so)". The units are
    # now measured on the port's denoiser: the reference's inputs with the timestep read so, and as given
    report = triage_text(tmp_path, FLOW_TIME_SPEC.format(port=port), all_causes=True)
    text = report.render()
    if port == "inside":  # must not fire: the port's denoiser turns sigma into flow time itself
        assert report.verdict == "match", text
        (note,) = [n for n in report.ruled_out if n.place == "schedule"]
        assert (
            "the reference gives t in [0, 1], the port 1 - t: measured: the port's denoiser fed" in note.text
        )
        return
    assert report.verdict == "differ", text
    assert not any(n.place == "schedule" for n in report.ruled_out), text
    (finding,) = [f for f in report.findings if f.place == "schedule"]
    said = "read as the reference gives t in [0, 1], the port 1 - t they would agree, but the port's denoiser"
    assert any(said in e for e in finding.evidence), text


def test_the_default_atol_is_held_to_the_scale_of_values_in_the_tens():
    # round 32 (AudioLDM, latents of RMS 47): the fixed port was "verdict: differ … update at call 3: the
    # latents after step 3 differ", max_abs 5.4e-05 on values up to 160, at elements near zero; the default
    # atol 1e-5 is set for values of order 1
    from paritykit.triage.pairs import Tolerance, compare

    torch.manual_seed(0)
    large = torch.randn(4096) * 50
    noise = torch.randn(4096) * 2e-5
    default = Tolerance(atol=1e-5, rtol=1e-4, atol_scaled=True)
    assert compare(large, large + noise, default, "x").passed
    assert not compare(large, large + noise, Tolerance(atol=1e-5, rtol=1e-4), "x").passed  # a SPEC's atol
    assert not compare(large, large * (1 + 1e-3) + 1e-2, default, "x").passed  # must not fire: a real slip
    unit = large / 50
    assert not compare(unit, unit + noise * 5, default, "x").passed  # must not fire: values of order 1


def test_a_diffusion_step_passed_third_is_read_as_the_timestep():
    # round 32 (DiffWave: model(audio, spectrogram, diffusion_step)): "not checked: schedule: a side's
    # denoiser calls carry no recognisable timestep argument", where the port's fractional steps were the
    # cause
    from paritykit.tracing.recording import timestep_argument

    audio, mel = torch.randn(2, 64), torch.randn(2, 16, 8)
    found = timestep_argument({"audio": audio, "spectrogram": mel, "diffusion_step": torch.tensor([42.9])})
    assert found is not None and found[:2] == ("diffusion_step", "timesteps"), found
    # must not fire: a third argument of another name is not taken for a timestep by its place
    assert timestep_argument({"audio": audio, "spectrogram": mel, "scale": torch.tensor([2.0])}) is None


# the two denoiser callables of a SPEC whose modules are REFERENCE and PORT
DENOISERS = """

def reference_denoiser():
    return REFERENCE


def port_denoiser():
    return PORT
"""


CARRIED_SPEC = (
    """
import torch

PORT_OFF = {off}


"""
    + TINY_NET
    + """

NET = Net().eval()


class Close(torch.nn.Module):  # predicts nearly its input: the update's difference cancels, amplifying
    def __init__(self, off):
        super().__init__()
        self.net, self.off = NET, off

    def forward(self, x, t):
        return (0.99 * x + 0.01 * self.net(x, t)) * (1 + self.off)


REFERENCE, PORT = Close(0.0).eval(), Close(PORT_OFF).eval()


def loop(denoiser):
    x = torch.randn(1, 4, 8)
    for t in (3.0, 2.0, 1.0):
        x = (x - denoiser(x, torch.tensor([t]))) * 50
    return x


def run_reference():
    return loop(REFERENCE)


def run_port():
    return loop(PORT)

"""
    + DENOISERS
)


@pytest.mark.parametrize("off", [3e-7, 0.0])
def test_an_update_finding_says_when_the_steps_inputs_agree_only_within_the_tolerance(tmp_path, off):
    # round 32 (tortoise-tts, fixed port): "update at call 13: the latents after step 13 differ while that
    # step's inputs and output agree" read as a cause; the step's output was 2e-6 apart, within the tolerance,
    # and an update dividing by a small noise level carried it to 2e-5
    report = triage_text(tmp_path, CARRIED_SPEC.format(off=off), all_causes=True)
    text = report.render()
    if off == 0.0:  # must not fire: the two runs are one
        assert report.verdict == "match", text
        return
    (finding,) = [f for f in report.findings if f.place == "update"]
    assert "that step's latents and output are not equal but" in finding.summary, text
    assert "a lead that the update carries those differences" in finding.summary, text


SIGN_SPEC = (
    """
import torch

UPDATE_FLIPPED = {flipped}
SLIP = {slip}


"""
    + TINY_NET
    + """

NET = Net().eval()


class Negated(torch.nn.Module):  # the port folds the velocity's sign into its output projection
    def __init__(self):
        super().__init__()
        self.net = NET

    def forward(self, x, t):
        return -self.net(x, t) * (1 + SLIP)


PORT = Negated().eval()


def run_reference():
    x = torch.randn(1, 4, 8)
    for t in (0.0, 0.25, 0.5, 0.75):
        x = x + 0.25 * NET(x, torch.tensor([t]))
    return x


def run_port():
    x = torch.randn(1, 4, 8)
    for t in (0.0, 0.25, 0.5, 0.75):
        x = x + (-0.25 if UPDATE_FLIPPED else 0.25) * PORT(x, torch.tensor([t]))
    return x


def reference_denoiser():
    return NET


def port_denoiser():
    return PORT
"""
)


@pytest.mark.parametrize("flipped, slip", [(True, 0.0), (False, 0.0), (True, 0.05)])
def test_one_sign_convention_on_both_sides_of_the_call_is_no_difference(tmp_path, flipped, slip):
    # round 33 (Matcha-TTS): the port negated its output projection to fit FlowMatchEulerDiscreteScheduler,
    # whose update steps the other way; the fixed port's report listed "culprit: (top) … cosine -1" and
    # "update … ×-1" as two places that differ
    report = triage_text(tmp_path, SIGN_SPEC.format(flipped=flipped, slip=slip), all_causes=True)
    text = report.render()
    if slip:  # a slip besides the convention: the update's ×-1 stays a finding, with the convention a lead
        (update,) = [f for f in report.findings if f.place == "update"]
        assert "×-1; a lead: a port that folds the output's sign into its denoiser" in update.summary, text
        return
    if not flipped:  # must not fire: the port's update keeps the reference's sign, so the result differs
        assert report.verdict == "differ", text
        assert "one sign convention" not in text, text
        return
    assert report.verdict == "match" and not report.findings, text
    ruled = {n.place for n in report.ruled_out if "one sign convention kept on both sides" in n.text}
    assert ruled == {"denoiser", "update"}, text


def test_latents_repeated_along_the_batch_are_said_to_agree_and_nothing_else():
    # round 33 (f5-tts): the research doubles its batch for guidance inside its DiT, the port before the
    # call: "not checked: initial noise: latents shapes differ: reference (1, 48, 16), port (2, 48, 16)"
    from paritykit.triage.walk import batch_repeats

    x = torch.randn(1, 48, 16)
    said = batch_repeats(x, torch.cat([x, x]))
    assert said.startswith("the port's (2, 48, 16) are the other's (1, 48, 16) repeated 2 times"), said
    assert batch_repeats(x, torch.cat([x, x + 1e-3])) == ""  # must not fire: rows that differ
    assert batch_repeats(x, x.clone()) == ""  # one shape: the ordinary comparison


PACKED_GUIDANCE_SPEC = (
    """
import torch

SLIP = {slip}


"""
    + TINY_NET
    + """

NET = Net().eval()


class Inside(torch.nn.Module):  # f5-tts's DiT: the guidance batch made inside the call
    def __init__(self):
        super().__init__()
        self.net = NET

    def forward(self, x, t):
        return self.net(torch.cat([x, x]), t)


class Before(torch.nn.Module):  # the port: fed the doubled batch
    def __init__(self):
        super().__init__()
        self.net = NET

    def forward(self, x, t):
        return self.net(x, t) * (1 + SLIP)


REFERENCE, PORT = Inside().eval(), Before().eval()


def run_reference():
    x = torch.randn(1, 4, 8)
    for t in (1.0, 0.5):
        out = REFERENCE(x, torch.tensor([t]))
        x = x - 0.5 * (out[:1] + 0.5 * (out[:1] - out[1:]))
    return x


def run_port():
    x = torch.randn(1, 4, 8)
    for t in (1.0, 0.5):
        out = PORT(torch.cat([x, x]), torch.tensor([t]))
        x = x - 0.5 * (out[:1] + 0.5 * (out[:1] - out[1:]))
    return x

"""
    + DENOISERS
)


@pytest.mark.parametrize("slip", [0.0, 0.1])
def test_a_denoiser_fed_the_guidance_batch_made_before_the_call_is_bisected_on_the_reference_latents(
    tmp_path, slip
):
    # round 33 (f5-tts): "not checked: denoiser: not bisected on call 0: its latents differ in shape
    # (reference (1, 48, 16), port (2, 48, 16))": the port's latents were the reference's repeated
    report = triage_text(tmp_path, PACKED_GUIDANCE_SPEC.format(slip=slip), all_causes=True)
    text = report.render()
    assert any(
        n.place == "initial noise" and "repeated 2 times along the batch" in n.text for n in report.ruled_out
    )
    if not slip:  # must not fire
        assert report.verdict == "match", text
        return
    (finding,) = [f for f in report.findings if f.place == "denoiser"]
    assert "fed the reference's call-0 inputs" in finding.summary, text
    # round 35 (stable-audio-tools): "the port's own call-0 inputs differ" where they were the repeated rows
    assert "own call-0 inputs" not in text, text


def test_an_update_on_complex_latents_is_fitted_over_both_parts_without_a_warning():
    # round 34 (sgmse: complex spectrograms): triage printed torch's "Casting complex values to real discards
    # the imaginary part" from its update fit, which fitted the real parts alone
    import warnings

    from paritykit.triage.fits import fit_linear

    torch.manual_seed(0)
    x, eps = torch.randn(3, 4, dtype=torch.complex64), torch.randn(3, 4, dtype=torch.complex64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = fit_linear(x * 0.9 + 0.2 * eps, {"latents": x, "output": eps})
        off = fit_linear(
            x * 0.9 + 0.2j * eps, {"latents": x, "output": eps}
        )  # must not fit: an imaginary factor
    assert fit.exact and fit.text() == "0.9·latents + 0.2·output", fit.text()
    assert not off.exact


def test_calls_repeated_at_each_timestep_are_said_so_not_other_timesteps():
    # round 34 (sgmse: a corrector call before each predictor call, both at one t): "not checked: update: not
    # replayed in lockstep with port_scheduler(): its set_timesteps(n) gives other timesteps than the port's
    # denoiser was fed", on a port whose timesteps were right
    from paritykit.triage.update_checks import _repeats_each

    assert _repeats_each([1.0, 1.0, 0.68, 0.68, 0.35, 0.35]) == 2
    assert _repeats_each([1.0, 0.68, 0.35]) == 1  # must not fire: one call per timestep
    assert _repeats_each([1.0, 1.0, 0.68]) == 1  # must not fire: not every timestep twice


PERMUTED_CONDITIONING_SPEC = (
    """
import torch

ORDER = [0, 3, 1, 4, 2, 5]  # the port lays the features out step-major where the reference interleaves them
SLIP = {slip}


class Net(torch.nn.Module):
    def __init__(self, columns=None):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.cond = torch.nn.Linear(6, 8)
        if columns is not None:  # the converter's columns, matched to the port's layout
            with torch.no_grad():
                self.cond.weight.copy_(self.cond.weight[:, columns])

    def forward(self, x, t, c):
        return self.proj(x) + self.cond(c)[:, None] * t.reshape(-1, 1, 1)


INVERSE = [ORDER.index(i) for i in range(6)]
REFERENCE, PORT = Net().eval(), Net(INVERSE if SLIP else ORDER).eval()
C = torch.randn(2, 6)


def run_reference():
    x = torch.randn(2, 4, 8)
    for t in (1.0, 0.5):
        x = x - 0.5 * REFERENCE(x, torch.tensor([t, t]), C)
    return x


def run_port():
    x = torch.randn(2, 4, 8)
    for t in (1.0, 0.5):
        x = x - 0.5 * PORT(x, torch.tensor([t, t]), C[:, ORDER])
    return x
"""
    + DENOISERS
)


@pytest.mark.parametrize("slip", [False, True])
def test_conditioning_the_port_holds_rearranged_is_compared_in_the_references_layout(tmp_path, slip):
    # round 35 (lerobot's diffusion policy): the port lays its observation features out step-major and
    # converts the weights to match (one of them the wrong way round): "conditioning at call 0: … differs
    # …, before any denoiser computation", and a weights "fix (verified)" measured on the reference's layout
    report = triage_text(tmp_path, PERMUTED_CONDITIONING_SPEC.format(slip=slip), all_causes=True)
    text = report.render()
    assert not [f for f in report.findings if f.place == "conditioning"], text
    (note,) = [n for n in report.ruled_out if n.place == "conditioning"]
    assert "hold the reference's values rearranged, 8 of 12 elements moved" in note.text, text
    if not slip:  # must not fire: the layout and the weights agree
        assert report.verdict == "match", text
        return
    (finding,) = [f for f in report.findings if f.place == "denoiser"]
    assert "cond" in finding.summary and "fix (verified)" not in text, text


STACKED_INPUT_SPEC = (
    """
import torch

SLIP = {slip}


class Net(torch.nn.Module):
    def __init__(self, slip=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.slip = torch.nn.Linear(16, 8), slip

    def forward(self, stacked, t, mask=None):  # CSDI: (observed, noisy) stacked; the port passes the mask too
        x = stacked.flatten(-2) if stacked.dim() == 4 else stacked
        return torch.nn.functional.silu(self.proj(x)) * (1 + self.slip) * t.reshape(-1, 1, 1)


REFERENCE, PORT = Net().eval(), Net(SLIP).eval()
OBSERVED, MASK = torch.randn(2, 3, 8), (torch.rand(2, 3, 8) > 0.5).float()


def run_reference():
    x = torch.randn(2, 3, 8)
    for t in (1.0, 0.5):
        x = x - 0.5 * REFERENCE(torch.stack([OBSERVED, x], -1), torch.tensor([t, t]))
    return x


def run_port():
    x = torch.randn(2, 3, 8)
    for t in (1.0, 0.5):
        x = x - 0.5 * PORT(torch.stack([OBSERVED, x], -1), torch.tensor([t, t]), MASK)
    return x
"""
    + DENOISERS
)


@pytest.mark.parametrize("slip", [0.0, 0.1])
def test_a_stacked_input_is_the_latents_on_both_sides_when_only_the_port_passes_one_of_the_outputs_shape(
    tmp_path, slip
):
    # round 35 (CSDI): the port's mask argument has the output's shape and was read as its latents, the
    # research's stacked input as its own: "not checked: denoiser: not bisected …: its latents differ in shape
    # (reference (2, 2, 4, 6), port (2, 4, 6))"
    report = triage_text(tmp_path, STACKED_INPUT_SPEC.format(slip=slip), all_causes=True)
    text = report.render()
    assert "latents differ in shape" not in text and "latents shapes differ" not in text, text
    if not slip:  # must not fire
        assert report.verdict == "match", text
        return
    assert [f for f in report.findings if f.place == "denoiser"], text


def test_the_ports_own_inputs_are_said_by_what_differs_and_nothing_that_agrees():
    # round 35 (stable-audio-tools): "the port's own call-0 inputs differ" named nothing; it now says which
    from paritykit.tracing.recording import Call
    from paritykit.triage.pairs import Tolerance, compare_call
    from paritykit.triage.roles import roles_of

    x, c, out = torch.randn(2, 4), torch.randn(2, 3), torch.randn(2, 4)

    def call(latents, cond, t):
        named = {"sample": latents, "timestep": torch.tensor([t]), "context": cond}
        return Call((), named, named, out)

    ref = call(x, c, 10.0)
    for port, said in (
        (call(x, c + 0.5, 10.0), ["context / context differ (max_abs 0.5)"]),
        (call(x + 1.0, c, 20.0), ["latents differ (max_abs 1)", "timestep 10 against 20"]),
        (call(x, c, 10.0), []),  # must not fire: every input agrees
    ):
        pair = compare_call(0, ref, roles_of(ref), port, roles_of(port), Tolerance())
        assert pair.differing_inputs() == said
        assert pair.inputs_agree == (not said)


def test_a_loop_run_once_per_sample_is_said_as_one_list_given_k_times():
    # round 35 (CSDI): two samples drawn one after the other, 20 calls over one list of 10 timesteps: "its
    # set_timesteps(n) gives other timesteps than the port's denoiser was fed"
    from paritykit.triage.update_checks import _loops_over

    steps = [9.0, 6.0, 3.0, 0.0]
    assert _loops_over(steps * 2) == 2 and _loops_over(steps * 3) == 3
    assert _loops_over(steps) == 1  # must not fire: one pass
    assert _loops_over(steps + steps[:2]) == 1  # nor for a list that does not repeat whole


TWO_SLIPS_SPEC = (
    """
import torch


class Net(torch.nn.Module):
    def __init__(self, first=1e-5, second=True):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(8, eps=first)
        self.proj = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8, bias=second)
        with torch.no_grad():
            self.proj.weight.mul_(4)

    def forward(self, x, t):
        return self.head(torch.tanh(self.proj(self.norm(x)))) * t.reshape(-1, 1, 1)


REFERENCE = Net().eval()
PORT = Net(first=0.5, second=False).eval()  # two slips: the norm's eps, the head's bias dropped
with torch.no_grad():
    PORT.load_state_dict(REFERENCE.state_dict(), strict=False)


def run_reference():
    x = torch.randn(2, 4, 8) * 0.3
    for t in (1.0, 0.5):
        x = x - 0.5 * REFERENCE(x, torch.tensor([t, t]))
    return x


def run_port():
    x = torch.randn(2, 4, 8) * 0.3
    for t in (1.0, 0.5):
        x = x - 0.5 * PORT(x, torch.tensor([t, t]))
    return x
"""
    + DENOISERS
)


@pytest.mark.parametrize("all_causes", [False, True])
def test_every_culprit_of_the_denoiser_is_said_with_all_and_counted_only_when_the_output_then_matches(
    tmp_path, all_causes
):
    # round 35 (TabDDPM): triage --all named one culprit in the denoiser (a dropped bias); the batch norms
    # reading batch statistics, the larger cause in the same place, were never said
    report = triage_text(tmp_path, TWO_SLIPS_SPEC, all_causes=all_causes)
    text = report.render()
    (finding,) = [f for f in report.findings if f.place == "denoiser"]
    said = "\n".join(finding.evidence)
    if not all_causes:  # must not fire: without --all the first culprit alone, and no count
        assert "further culprits" not in said and "culprit(s) given" not in said, text
        return
    assert "further culprits, each found with the ones before it given the reference's outputs" in said, text
    assert "): head (max_abs" in said, text
    assert "with the 2 culprit(s) given the reference's outputs, the port's output matches" in said, text


STACKED_CHANNELS_SPEC = (
    """
import torch

PORT_SCALE, PORT_SEED = {scale}, {seed}


class Net(torch.nn.Module):  # AudioSR: the low-pass latents stacked on the noise as channels
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(4, 2, 1)

    def forward(self, x, t):
        return self.conv(x) * t.reshape(-1, 1, 1)


REFERENCE, PORT = Net().eval(), Net().eval()
COND = torch.randn(2, 2, 8)


def run_reference():
    x = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(0))
    for t in (1.0, 0.5):
        x = x - 0.5 * REFERENCE(torch.cat([x, COND * 0.6], 1), torch.tensor([t, t]))
    return x


def run_port():
    x = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(PORT_SEED))
    for t in (1.0, 0.5):
        x = x - 0.5 * PORT(torch.cat([x, COND * PORT_SCALE], 1), torch.tensor([t, t]))
    return x
"""
    + DENOISERS
)


@pytest.mark.parametrize(("scale", "seed"), [(0.6, 0), (1 / 0.6, 0), (0.6, 1)])
def test_conditioning_stacked_on_the_latents_as_channels_is_said_at_the_conditioning_place(
    tmp_path, scale, seed
):
    # round 36 (AudioSR): "initial noise at call 0: the first call's latents differ" where the noise channels
    # agreed and the conditioning stacked on them as channels differed
    report = triage_text(tmp_path, STACKED_CHANNELS_SPEC.format(scale=scale, seed=seed), all_causes=True)
    text = report.render()
    if scale == 0.6 and seed == 0:  # must not fire: a correct port
        assert report.verdict == "match", text
        return
    if seed:  # must not fire: the noise itself differs, so no end of the channels agrees
        assert "stacked on the" not in text, text
        assert any(f.place == "initial noise" for f in report.findings), text
        return
    assert not any(f.place == "initial noise" for f in report.findings), text
    (finding,) = [f for f in report.findings if f.place == "conditioning"]
    assert finding.summary.startswith("channels 2-3 of the denoiser's x input, stacked on the 2 channels"), (
        text
    )
    assert any(
        "channels 0-1 of the first call's x (the output's 2) agree" in n.text for n in report.ruled_out
    )


UNUSED_TWIN_SPEC = (
    """
import torch

PORT_PASSES = "{passes}"


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, t, z_trunk, pair_z):  # Protenix: z_trunk is ignored when pair_z is given
        return self.proj(x) + pair_z.mean(1, keepdim=True) * t.reshape(-1, 1, 1)


class PortNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, t, pair):
        return self.proj(x) + pair.mean(1, keepdim=True) * t.reshape(-1, 1, 1)


REFERENCE, PORT = Net().eval(), PortNet().eval()
TRUNK, PAIR = torch.randn(2, 4, 8), torch.randn(2, 4, 8)


def run_reference():
    x = torch.randn(2, 4, 8)
    for t in (1.0, 0.5):
        x = x - 0.5 * REFERENCE(x, torch.tensor([t, t]), TRUNK, PAIR)
    return x


def run_port():
    x = torch.randn(2, 4, 8)
    for t in (1.0, 0.5):
        x = x - 0.5 * PORT(x, torch.tensor([t, t]), PAIR if PORT_PASSES == "pair" else TRUNK)
    return x
"""
    + DENOISERS
)


@pytest.mark.parametrize("passes", ["pair", "trunk"])
def test_conditioning_of_one_shape_pairs_by_name_and_value_before_order(tmp_path, passes):
    # round 38 (Protenix): "conditioning at call 0: the denoiser's conditioning input z_trunk (port: pair)
    # differs": the research's unused z_trunk was paired by order with the port's pair, which is its pair_z
    report = triage_text(tmp_path, UNUSED_TWIN_SPEC.format(passes=passes), all_causes=True)
    text = report.render()
    if passes == "pair":
        assert report.verdict == "match", text
        assert "pair_z / pair" in text and "z_trunk (port: pair)" not in text, text
    else:  # must not fire: the port passes the tensor the reference ignores; nothing pairs it with pair_z
        assert report.verdict == "differ" and "pair_z / pair" not in text, text
        assert "not compared: reference pair_z" in text, text


DICT_PASSES_SPEC = (
    """
import torch

SLIP = {slip}


class Net(torch.nn.Module):  # SDXL-like: the pooled text and size ids in a dict argument
    def __init__(self, slip=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.add, self.slip = torch.nn.Linear(16, 8), torch.nn.Linear(4, 8), slip

    def forward(self, x, t, context, added_cond_kwargs):
        extra = self.add(added_cond_kwargs["text_embeds"])[:, None].expand(-1, x.shape[1], -1)
        h = torch.cat([x + context, extra], -1)  # the batches must agree here
        return self.proj(h) * (1 + self.slip) * t.reshape(-1, 1, 1)


REFERENCE, PORT = Net().eval(), Net(SLIP).eval()
COND, UNCOND = torch.randn(1, 3, 8), torch.zeros(1, 3, 8)
POOLED, POOLED_UNCOND = torch.randn(1, 4), torch.zeros(1, 4)


def run_reference():  # one call per pass
    x = torch.randn(1, 3, 8)
    for t in (1.0, 0.5):
        tt = torch.tensor([t])
        cond = REFERENCE(x, tt, COND, {{"text_embeds": POOLED}})
        uncond = REFERENCE(x, tt, UNCOND, {{"text_embeds": POOLED_UNCOND}})
        x = x - 0.5 * (uncond + 2.0 * (cond - uncond))
    return x


def run_port():  # one call on the stacked passes
    x = torch.randn(1, 3, 8)
    for t in (1.0, 0.5):
        added = {{"text_embeds": torch.cat([POOLED, POOLED_UNCOND])}}
        out = PORT(torch.cat([x, x]), torch.tensor([t, t]), torch.cat([COND, UNCOND]), added)
        cond, uncond = out.chunk(2)
        x = x - 0.5 * (uncond + 2.0 * (cond - uncond))
    return x
"""
    + DENOISERS
)


@pytest.mark.parametrize("slip", [0.0, 0.1])
def test_a_stacked_call_with_a_dict_argument_is_cut_to_the_references_pass_whole(tmp_path, slip):
    # round 38 (DiffSynth's SDXL U-Net): the port's call cut to one pass kept its dict argument's two rows,
    # and triage stopped with "The size of tensor a (48) must match the size of tensor b (24)"
    report = triage_text(tmp_path, DICT_PASSES_SPEC.format(slip=slip), all_causes=True)
    text = report.render()
    assert "Traceback" not in text and "raised" not in text, text
    if not slip:  # must not fire
        assert report.verdict == "match", text
        return
    assert [f for f in report.findings if f.place == "denoiser"], text


SIGMA_NAMED_SPEC = (
    """
import torch

PORT_SHIFT = {shift}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, t_hat_noise_level):  # read by position: a timestep
        return self.proj(x) * t_hat_noise_level.reshape(-1, 1, 1)


class PortNet(Net):
    def forward(self, x, sigma):  # read by name: a sigma
        return self.proj(x) * sigma.reshape(-1, 1, 1)


REFERENCE, PORT = Net().eval(), PortNet().eval()


def run_reference():
    x = torch.randn(2, 3, 8)
    for s in (80.0, 10.0, 1.0):
        x = x - 0.01 * REFERENCE(x, torch.tensor([s, s]))
    return x


def run_port():
    x = torch.randn(2, 3, 8)
    for k, s in enumerate((80.0, 10.0, 1.0)):
        s = s * (1.5 if PORT_SHIFT and k == 2 else 1.0)
        x = x - 0.01 * PORT(x, torch.tensor([s, s]))
    return x
"""
    + DENOISERS
)


@pytest.mark.parametrize("shift", [False, True])
def test_one_number_fed_on_both_sides_is_one_timestep_whatever_each_argument_is_read_as(tmp_path, shift):
    # round 38 (Protenix): "schedule at call 0: the timesteps differ from call 0" where the research's
    # t_hat_noise_level (read by position as a timestep) and the port's sigma held the same numbers
    report = triage_text(tmp_path, SIGMA_NAMED_SPEC.format(shift=shift), all_causes=True)
    text = report.render()
    if not shift:  # must not fire
        assert report.verdict == "match", text
        return
    (finding,) = [f for f in report.findings if f.place == "schedule"]
    assert finding.call == 2 and "differ from call 2" in finding.summary, text
