"""Shared pieces of the sampler tests: the one-thread fixture, one tiny conditional UNet, its inputs, the
diffusers-style port loop, and recording a loop with paritykit.record_loop."""

from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DConditionModel
from paritykit import record_loop


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one thread is far faster than oversubscribed ones. Import it
    into a test module to apply it there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_cond_unet(layers_per_block: int = 1) -> UNet2DConditionModel:
    r"""A two-block UNet2DConditionModel (cross-attention width 8), seeded: the same weights every call."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=layers_per_block,
        block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8,
        attention_head_dim=2,
        norm_num_groups=4,
    ).eval()


def tiny_inputs(batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, 4, 8, 8, generator=gen), torch.randn(batch, 3, 8, generator=gen)


def denoiser(unet):
    return lambda x, t, cond: unet(x, t, encoder_hidden_states=cond).sample


def port_loop(unet, scheduler, noise, cond, n=10, **call):
    r"""A diffusers pipeline's loop: ``set_timesteps`` (``n``, or the ``call``'s keyword lists), the latents
    scaled by ``init_noise_sigma``, then ``scale_model_input`` → UNet → ``step`` per timestep."""
    scheduler.set_timesteps(None if call else n, **call)
    x = noise * getattr(scheduler, "init_noise_sigma", 1.0)
    for t in scheduler.timesteps:
        scaled = scheduler.scale_model_input(x, t) if hasattr(scheduler, "scale_model_input") else x
        eps = unet(scaled, t, encoder_hidden_states=cond).sample
        x = scheduler.step(eps, t, x, return_dict=False)[0]
    return x


def record(module, folder, run, final=False):
    r"""Run ``run()`` with every call of ``module`` recorded into ``folder``; ``final`` keeps its result
    too."""
    with torch.no_grad(), record_loop(module, out=folder) as rec:
        result = run()
        if final:
            rec.final(result)
    return folder
