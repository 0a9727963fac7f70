"""Three research-style sampling loops written from the papers' formulas, with no diffusers scheduler inside.

* DDIM (Song et al. 2020, eq. 12 with eta = 0) over an evenly spaced timestep list that reads the previous
  timestep from its own list, the last step going to alpha-bar 1.
* Euler over the Karras et al. (2022, eq. 5) sigma schedule, rho 7, a final sigma of 0, in the
  k-diffusion convention (epsilon model called with c_in = 1/sqrt(sigma^2 + 1) and the timestep whose sigma it is).
* Flow-matching Euler over a linear schedule with the SD3 time shift sigma' = s·t / (1 + (s - 1)·t), s = 3.

Every loop takes a ``denoiser(sample, timestep, encoder_hidden_states)`` returning a tensor, so the same tiny
UNet runs both the reference and the port.
"""

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
    """Evenly spaced integer timesteps, high to low: ``linspace`` from T-1 to 0, or ``trailing`` (stride T/n, ending at T/n - 1)."""
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


# --- Karras sigmas, Euler -------------------------------------------------------------------------------------
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


# --- flow matching, shift 3 -------------------------------------------------------------------------------------
def flow_sigmas(n: int, shift: float = 3.0, train_steps: int = TRAIN_STEPS) -> list[float]:
    """t linear from 1 to the shifted 1/T, then shifted: sigma = s t / (1 + (s - 1) t); a final 0."""

    def shifted(t: float) -> float:
        return shift * t / (1 + (shift - 1) * t)

    t_end = shifted(1 / train_steps)
    return [shifted(1 + i / (n - 1) * (t_end - 1)) for i in range(n)] + [0.0]


def flow_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float | None) -> torch.Tensor:
    return x + v * ((sigma_next or 0.0) - sigma)


def flow_loop(denoiser, noise: torch.Tensor, cond: torch.Tensor, n: int, shift: float = 3.0) -> torch.Tensor:
    sigmas = flow_sigmas(n, shift)
    x = noise
    for i in range(n):
        v = denoiser(x, torch.tensor(sigmas[i] * TRAIN_STEPS), cond)
        x = flow_step(x, v, sigmas[i], sigmas[i + 1])
    return x
