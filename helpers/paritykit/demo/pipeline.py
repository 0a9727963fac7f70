"""A small diffusers pipeline around either side, instrumented with paritykit checkpoints."""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

from paritykit.tracing.checkpoints import maybe_checkpoint, seeded_noise


class TinyControlPipeline(DiffusionPipeline):
    r"""Denoise from seeded noise under a control ``hint``; works with the reference or the port as
    ``denoiser``.

    Checkpoints: ``preloop`` (latents, hint, timesteps), ``after_step_{i}`` (latents), ``post_loop``
    (latents)."""

    def __init__(self, denoiser: torch.nn.Module, scheduler: FlowMatchEulerDiscreteScheduler):
        super().__init__()
        self.register_modules(denoiser=denoiser, scheduler=scheduler)

    def _predict(self, latents: torch.Tensor, timestep: torch.Tensor, hint: torch.Tensor) -> torch.Tensor:
        out = self.denoiser(latents, timestep.expand(latents.shape[0]), hint)
        return out.sample if hasattr(out, "sample") else out

    @torch.no_grad()
    def __call__(
        self,
        hint: torch.Tensor,
        num_inference_steps: int = 8,
        seed: int = 0,
        output_type: str = "pt",
        _checkpoints=None,
    ) -> torch.Tensor:
        latents = seeded_noise(tuple(hint.shape), seed)
        self.scheduler.set_timesteps(num_inference_steps)
        timesteps = self.scheduler.timesteps
        loop_inputs = maybe_checkpoint(
            _checkpoints, "preloop", latents=latents, hint=hint, timesteps=timesteps
        )
        latents, hint = loop_inputs["latents"], loop_inputs["hint"]
        for i, t in enumerate(self.progress_bar(timesteps)):
            noise_pred = self._predict(latents, t, hint)
            latents = self.scheduler.step(noise_pred, t, latents).prev_sample
            latents = maybe_checkpoint(_checkpoints, f"after_step_{i}", latents=latents)["latents"]
        latents = maybe_checkpoint(_checkpoints, "post_loop", latents=latents)["latents"]
        if output_type == "latent":
            return latents
        return (latents / 2 + 0.5).clamp(0, 1)


def make_pipeline(denoiser: torch.nn.Module) -> TinyControlPipeline:
    pipe = TinyControlPipeline(denoiser.eval(), FlowMatchEulerDiscreteScheduler(shift=1.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_hint(size: int = 32, batch: int = 1) -> torch.Tensor:
    """A deterministic control image in [-1, 1]: a sun over hills under a sky gradient."""
    coords = torch.linspace(0, 1, size)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    sky = torch.stack([0.35 + 0.4 * yy, 0.55 + 0.3 * yy, torch.full_like(yy, 0.95)])
    sun = ((xx - 0.7) ** 2 + (yy - 0.3) ** 2 < 0.02).float()
    hills = (yy > 0.65 + 0.08 * torch.sin(9 * xx)).float()
    image = sky * (1 - sun) + torch.tensor([1.0, 0.85, 0.2])[:, None, None] * sun
    image = image * (1 - hills) + torch.stack([0.2 * (1 - yy), 0.45 + 0.3 * (1 - yy), 0.15 * yy]) * hills
    return (image * 2 - 1)[None].repeat(batch, 1, 1, 1)
