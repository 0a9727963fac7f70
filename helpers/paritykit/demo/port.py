"""The diffusers-style port: ``ModelMixin`` + ``ConfigMixin``, diffusers naming and building blocks.

As first written the port had one ``control_scale`` for both the connection strength and the time mixture;
the fix gives the mixture its own config field, ``time_mixture``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from torch import nn


class TimeMixer(nn.Module):
    """Blend base and control time embeddings with weight ``mixture`` on the base branch."""

    def __init__(self, mixture: float):
        super().__init__()
        self.mixture = mixture

    def forward(self, base_emb: torch.Tensor, control_emb: torch.Tensor) -> torch.Tensor:
        return self.mixture * base_emb + (1.0 - self.mixture) * control_emb


class AdaLayerNormShiftScale(nn.Module):
    """LayerNorm modulated by the time embedding; the projection's rows are ordered [scale; shift]."""

    def __init__(self, dim: int, embedding_dim: int):
        super().__init__()
        self.linear = nn.Linear(embedding_dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(temb)).chunk(2, dim=-1)
        return self.norm(hidden_states) * (1 + scale[:, None]) + shift[:, None]


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.ModuleList([nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            hidden_states = layer(hidden_states)
        return hidden_states


class TinyControlBlock(nn.Module):
    def __init__(self, dim: int, embedding_dim: int):
        super().__init__()
        self.norm1 = AdaLayerNormShiftScale(dim, embedding_dim)
        self.attn = Attention(query_dim=dim, heads=1, dim_head=dim, bias=True, out_bias=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.attn(self.norm1(hidden_states, temb))
        return hidden_states + self.ff(self.norm2(hidden_states))


class TinyControlDenoiserModel(ModelMixin, ConfigMixin):
    r"""Tiny control denoiser in diffusers style.

    Args:
        control_scale: strength of the connection from the control branch into the base branch.
        time_mixture: weight of the base branch's time embedding when mixing it with the control branch's.
            As first ported the field did not exist and the mixer reused ``control_scale``; ``None`` keeps
            that behaviour, which is the bug ``paritykit demo`` hunts down.
    """

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        hidden_dim: int = 16,
        time_proj_dim: int = 16,
        time_embed_dim: int = 32,
        num_layers: int = 2,
        control_scale: float = 0.95,
        time_mixture: float | None = None,
    ):
        super().__init__()
        self.conv_in = nn.Conv2d(in_channels, hidden_dim, 3, padding=1)
        self.controlnet_cond_embedding = nn.Conv2d(in_channels, hidden_dim, 3, padding=1)
        self.time_proj = Timesteps(time_proj_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.time_embedding = TimestepEmbedding(time_proj_dim, time_embed_dim)
        self.control_time_embedding = TimestepEmbedding(time_proj_dim, time_embed_dim)
        self.time_mixer = TimeMixer(control_scale if time_mixture is None else time_mixture)
        self.transformer_blocks = nn.ModuleList(
            TinyControlBlock(hidden_dim, time_embed_dim) for _ in range(num_layers)
        )
        self.conv_out = nn.Conv2d(hidden_dim, in_channels, 3, padding=1)

    def forward(
        self, sample: torch.Tensor, timestep: torch.Tensor, controlnet_cond: torch.Tensor, return_dict=True
    ):
        timestep = timestep.reshape(-1).expand(sample.shape[0]) if timestep.numel() == 1 else timestep
        t_freq = self.time_proj(timestep)
        temb = self.time_mixer(self.time_embedding(t_freq), self.control_time_embedding(t_freq))
        hidden = self.conv_in(sample) + self.config.control_scale * self.controlnet_cond_embedding(
            controlnet_cond
        )
        batch, channels, height, width = hidden.shape
        hidden = hidden.flatten(2).transpose(1, 2)
        for block in self.transformer_blocks:
            hidden = block(hidden, temb)
        x0 = controlnet_cond + self.conv_out(hidden.transpose(1, 2).reshape(batch, channels, height, width))
        sigma = (timestep.float() / 1000.0).clamp(min=1e-3).view(-1, 1, 1, 1)
        velocity = (sample - x0) / sigma
        return Transformer2DModelOutput(sample=velocity) if return_dict else (velocity,)


def port_config_from_reference(cfg: dict, fixed: bool) -> dict:
    """The config a porter writes for the reference; the first port had nowhere to put ``time_mix``."""
    config = {
        "in_channels": cfg["img_channels"],
        "hidden_dim": cfg["width"],
        "time_proj_dim": cfg["t_freq_dim"],
        "time_embed_dim": cfg["t_dim"],
        "num_layers": cfg["depth"],
        "control_scale": cfg["connection_strength"],
    }
    if fixed:
        config["time_mixture"] = cfg["time_mix"]
    return config
