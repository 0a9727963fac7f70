"""Tiny real diffusers pipelines for tests: built from configs, no downloads, deterministic on CPU."""

from __future__ import annotations

import torch
from diffusers import DDIMScheduler, DiffusionPipeline, UNet2DModel
from paritykit.tracing.checkpoints import maybe_checkpoint, seeded_noise

TINY_STEPS = 4
TINY_SAMPLE_SIZE = 16


class TinyUNetPipeline(DiffusionPipeline):
    r"""A DDIM pipeline over a tiny ``UNet2DModel``, instrumented with paritykit checkpoints.

    Checkpoints: ``preloop`` (latents, timesteps), ``after_step_{i}`` (latents, noise_pred), ``post_loop``
    (latents). Returns the final latents mapped to ``[0, 1]`` as the "image".
    """

    def __init__(self, unet: UNet2DModel, scheduler: DDIMScheduler):
        super().__init__()
        self.register_modules(unet=unet, scheduler=scheduler)

    @torch.no_grad()
    def __call__(
        self,
        batch_size: int = 1,
        num_inference_steps: int = TINY_STEPS,
        seed: int = 0,
        _checkpoints=None,
    ) -> torch.Tensor:
        config = self.unet.config
        shape = (batch_size, config.in_channels, config.sample_size, config.sample_size)
        latents = seeded_noise(shape, seed, dtype=self.unet.dtype, device=self.unet.device)
        self.scheduler.set_timesteps(num_inference_steps)
        state = maybe_checkpoint(_checkpoints, "preloop", latents=latents, timesteps=self.scheduler.timesteps)
        latents, timesteps = state["latents"], state["timesteps"]
        for i, t in enumerate(timesteps):
            noise_pred = self.unet(latents, t).sample
            latents = self.scheduler.step(noise_pred, t, latents, eta=0.0).prev_sample
            state = maybe_checkpoint(_checkpoints, f"after_step_{i}", latents=latents, noise_pred=noise_pred)
            latents = state["latents"]
        latents = maybe_checkpoint(_checkpoints, "post_loop", latents=latents)["latents"]
        return (latents / 2 + 0.5).clamp(0, 1)


def make_tiny_unet(seed: int = 0, sample_size: int = TINY_SAMPLE_SIZE, attention: bool = True) -> UNet2DModel:
    r"""A two-level ``UNet2DModel`` (one attention block unless ``attention=False``), weights drawn from
    ``seed``."""
    torch.manual_seed(seed)
    blocks = {"attention_head_dim": 4} if attention else {}
    return UNet2DModel(
        sample_size=sample_size,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "AttnDownBlock2D" if attention else "DownBlock2D"),
        up_block_types=("AttnUpBlock2D" if attention else "UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
        **blocks,
    ).eval()


def make_tiny_unet_pipeline(seed: int = 0) -> TinyUNetPipeline:
    r""":class:`TinyUNetPipeline` over :func:`make_tiny_unet` and a default ``DDIMScheduler``."""
    pipe = TinyUNetPipeline(unet=make_tiny_unet(seed), scheduler=DDIMScheduler(num_train_timesteps=1000))
    pipe.set_progress_bar_config(disable=True)
    return pipe
