"""Research-style sampling loops written from the papers' formulas, with no diffusers scheduler inside.

* DDIM (Song et al. 2020, eq. 12 with eta = 0) over an evenly spaced timestep list that reads the previous
  timestep from its own list, the last step going to alpha-bar 1.
* Euler over the Karras et al. (2022, eq. 5) sigma schedule, rho 7, a final sigma of 0, in the
  k-diffusion convention (epsilon model called with c_in = 1/sqrt(sigma^2 + 1) and the timestep whose sigma it
  is).
* Flow-matching Euler over SD3's schedule (Stability's sd3_infer.py: its low end shifted twice) and over
  Flux's (black-forest-labs/flux: linspace(1, 0, n + 1) shifted once, by a mu that grows with the image size).

Every loop takes a ``denoiser(sample, timestep, encoder_hidden_states)`` returning a tensor, so the same tiny
UNet runs both the reference and the port."""

from __future__ import annotations

import math

import torch

TRAIN_STEPS = 1000
BETA_START, BETA_END = 0.00085, 0.012


def alphas_cumprod(train_steps: int = TRAIN_STEPS) -> torch.Tensor:
    """The "scaled linear" training schedule: betas linear in sqrt space, float64."""
    betas = torch.linspace(BETA_START**0.5, BETA_END**0.5, train_steps, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0)


# --- DDIM ---------------------------------------------------------------------------------------------------
def ddim_timesteps(n: int, spacing: str = "linspace", train_steps: int = TRAIN_STEPS) -> list[int]:
    """Evenly spaced integer timesteps, high to low: ``linspace`` from T-1 to 0, or ``trailing`` (stride T/n,
    ending at T/n - 1)."""
    if spacing == "linspace":
        return [round((train_steps - 1) * (n - 1 - i) / (n - 1)) for i in range(n)]
    return [round(train_steps - i * train_steps / n) - 1 for i in range(n)]


def ddim_step(x: torch.Tensor, eps: torch.Tensor, t: int, t_prev: int | None) -> torch.Tensor:
    """x_{t_prev} = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps, with a_prev = 1 after the last step."""
    ac = alphas_cumprod()
    a_t = ac[int(t)]
    a_prev = ac[int(t_prev)] if t_prev is not None else torch.tensor(1.0, dtype=torch.float64)
    x0 = (x.double() - (1 - a_t).sqrt() * eps.double()) / a_t.sqrt()
    return (a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps.double()).to(x.dtype)


def ddim_loop(
    denoiser, noise: torch.Tensor, cond: torch.Tensor, n: int, spacing: str = "linspace"
) -> torch.Tensor:
    timesteps = ddim_timesteps(n, spacing)
    x = noise
    for i, t in enumerate(timesteps):
        eps = denoiser(x, torch.tensor(t), cond)
        x = ddim_step(x, eps, t, timesteps[i + 1] if i + 1 < n else None)
    return x


# --- Karras sigmas, Euler
# -------------------------------------------------------------------------------------
def training_sigmas() -> torch.Tensor:
    ac = alphas_cumprod()
    return ((1 - ac) / ac).sqrt()


def karras_sigmas(n: int, rho: float = 7.0) -> list[float]:
    """sigma_i = (smax^(1/rho) + i/(n-1) (smin^(1/rho) - smax^(1/rho)))^rho, then a final 0."""
    train = training_sigmas()
    smin, smax = float(train[0]), float(train[-1])
    a, b = smax ** (1 / rho), smin ** (1 / rho)
    return [(a + i / (n - 1) * (b - a)) ** rho for i in range(n)] + [0.0]


def sigma_to_t(sigma: float) -> float:
    """The (fractional) training timestep whose sigma this is, interpolating log sigma linearly."""
    log_sigmas = training_sigmas().log()
    s = math.log(sigma)
    j = int(
        torch.searchsorted(log_sigmas, torch.tensor(s, dtype=torch.float64)).clamp(1, len(log_sigmas) - 1)
    )
    lo, hi = float(log_sigmas[j - 1]), float(log_sigmas[j])
    return (j - 1) + (s - lo) / (hi - lo)


def karras_loop(denoiser, noise: torch.Tensor, cond: torch.Tensor, n: int) -> torch.Tensor:
    sigmas = karras_sigmas(n)
    x = noise * sigmas[0]
    for i in range(n):
        sigma, nxt = sigmas[i], sigmas[i + 1]
        eps = denoiser(x / (sigma**2 + 1) ** 0.5, torch.tensor(sigma_to_t(sigma)), cond)
        x = x + eps * (nxt - sigma)
    return x


# --- flow matching: SD3's sampler and Flux's
# ----------------------------------------------------------------------
def _time_shift(t: float, shift: float) -> float:
    """SD3's resolution shift of a flow time (Esser et al. 2024, eq. 23): s t / (1 + (s - 1) t)."""
    return shift * t / (1 + (shift - 1) * t)


def sd3_sigmas(n: int, shift: float = 3.0, train_steps: int = TRAIN_STEPS) -> list[float]:
    """What Stability's SD3 reference sampler (sd3_infer.py, ``get_sigmas`` over sd3_impls.py's
    ``ModelSamplingDiscreteFlow``) computes: a table of the shifted sigmas of timesteps 1 … T; its smallest
    and largest entries, read back as timesteps (sigma · T), are spaced linearly over n steps and each is
    shifted *again*, then a final 0. The low end is therefore shifted twice — the reference's own
    behaviour."""
    table_min = _time_shift(1 / train_steps, shift)  # sigma(timestep 1)
    table_max = _time_shift(1.0, shift)  # sigma(timestep T) = 1
    start, end = table_max * train_steps, table_min * train_steps
    timesteps = [start + (end - start) * i / (n - 1) for i in range(n)]
    return [_time_shift(t / train_steps, shift) for t in timesteps] + [0.0]


def wan_unipc_sigmas(n: int, shift: float = 5.0, train_steps: int = TRAIN_STEPS) -> list[float]:
    """Wan 2.1's research flow UniPC (wan/utils/fm_solvers_unipc.py, ``set_timesteps``): its training table
    is ``1 - linspace(1, 1/T, T)`` reversed, so ``sigma_max = 1 - 1/T`` and ``sigma_min = 0``; the n sigmas
    are ``linspace(sigma_max, sigma_min, n + 1)`` without the last, each shifted once, then a final 0."""
    sigma_max, sigma_min = 1 - 1 / train_steps, 0.0
    times = [sigma_max + (sigma_min - sigma_max) * i / n for i in range(n)]
    return [_time_shift(t, shift) for t in times] + [0.0]


def flux_mu(image_seq_len: int, base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """Flux's ``get_lin_function``: mu on the line through (256, base_shift) and (4096, max_shift)."""
    slope = (max_shift - base_shift) / (4096 - 256)
    return base_shift + slope * (image_seq_len - 256)


def flux_sigmas(n: int, image_seq_len: int) -> list[float]:
    """Flux's ``get_schedule`` (black-forest-labs/flux, src/flux/sampling.py): n + 1 times evenly from 1 to 0,
    each moved by ``time_shift(mu, 1, t) = e^mu / (e^mu + (1/t - 1))`` with mu from the image size; t = 0
    stays 0. The shift is applied once."""
    mu = flux_mu(image_seq_len)
    times = [1 - i / n for i in range(n + 1)]
    return [math.exp(mu) / (math.exp(mu) + (1 / t - 1)) if t > 0 else 0.0 for t in times]


def flow_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float | None) -> torch.Tensor:
    """The flow-matching Euler update both SD3 and Flux take: x + (sigma_next - sigma) v."""
    return x + v * ((sigma_next or 0.0) - sigma)


def flow_loop(denoiser, noise: torch.Tensor, cond: torch.Tensor, sigmas: list[float]) -> torch.Tensor:
    """Euler over a flow sigma list ending in 0; the model sees the timestep sigma · T."""
    x = noise
    for i in range(len(sigmas) - 1):
        v = denoiser(x, torch.tensor(sigmas[i] * TRAIN_STEPS), cond)
        x = flow_step(x, v, sigmas[i], sigmas[i + 1])
    return x
