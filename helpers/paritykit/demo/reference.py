"""A tiny research-style denoiser: plain torch modules, its own naming, a config dict, a fused layout.

Written the way research repositories often are, so the port has real conversion work to do: a fused ``qkv``
projection, modulation stored as (shift, scale), and ``t_mlp_*`` / ``blocks.*`` names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

REFERENCE_CONFIG = {
    "img_channels": 3,
    "width": 16,
    "t_freq_dim": 16,
    "t_dim": 32,
    "depth": 2,
    # Two knobs: how strongly control features feed the base branch, and how the time embeddings mix.
    "connection_strength": 0.95,
    "time_mix": 1.0,
}


def sinusoid(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None, :]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


class TimeMix(nn.Module):
    """Blend the base and control time embeddings: ``mix * base + (1 - mix) * ctrl``."""

    def __init__(self, mix: float):
        super().__init__()
        self.mix = mix

    def forward(self, base: torch.Tensor, ctrl: torch.Tensor) -> torch.Tensor:
        return self.mix * base + (1.0 - self.mix) * ctrl


class Block(nn.Module):
    def __init__(self, width: int, t_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Linear(t_dim, 2 * width)  # rows: [shift; scale]
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        shift, scale = self.ada(F.silu(temb)).chunk(2, dim=-1)
        x = self.norm(h) * (1 + scale[:, None]) + shift[:, None]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = h + self.proj(F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0])
        return h + self.mlp(self.norm(h))


class ResearchDenoiser(nn.Module):
    """``forward(x, t, hint)`` -> flow velocity.

    The network predicts the clean image as a residual over the control image ``hint`` (x0 = hint + net) and
    returns the velocity a flow-matching sampler steps with, ``(x - x0) / sigma`` with ``sigma = t / 1000``.
    """

    def __init__(self, cfg: dict = REFERENCE_CONFIG):
        super().__init__()
        self.cfg = dict(cfg)
        c, w, td = cfg["img_channels"], cfg["width"], cfg["t_dim"]
        self.stem = nn.Conv2d(c, w, 3, padding=1)
        self.ctrl_stem = nn.Conv2d(c, w, 3, padding=1)
        self.t_mlp_base = nn.Sequential(nn.Linear(cfg["t_freq_dim"], td), nn.SiLU(), nn.Linear(td, td))
        self.t_mlp_ctrl = nn.Sequential(nn.Linear(cfg["t_freq_dim"], td), nn.SiLU(), nn.Linear(td, td))
        self.time_mix = TimeMix(cfg["time_mix"])
        self.blocks = nn.ModuleList(Block(w, td) for _ in range(cfg["depth"]))
        self.head = nn.Conv2d(w, c, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, hint: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1).expand(x.shape[0]) if t.numel() == 1 else t
        freqs = sinusoid(t, self.cfg["t_freq_dim"])
        temb = self.time_mix(self.t_mlp_base(freqs), self.t_mlp_ctrl(freqs))
        h = self.stem(x) + self.cfg["connection_strength"] * self.ctrl_stem(hint)
        b, w, hh, ww = h.shape
        tokens = h.flatten(2).transpose(1, 2)
        for block in self.blocks:
            tokens = block(tokens, temb)
        x0 = hint + self.head(tokens.transpose(1, 2).reshape(b, w, hh, ww))
        sigma = (t.float() / 1000.0).clamp(min=1e-3).view(-1, 1, 1, 1)
        return (x - x0) / sigma


def build_reference(seed: int = 0) -> ResearchDenoiser:
    torch.manual_seed(seed)
    model = ResearchDenoiser().eval()
    # Stand in for trained weights: distinct values everywhere, the large time-embedding and modulation
    # weights trained models have (which is what makes a mixing error visible), and a head whose residual over
    # the control image is small.
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.05 * torch.randn_like(param))
            if name.startswith("t_mlp_") or ".ada." in name:
                param.mul_(4.0)
            elif name.startswith("head."):
                param.mul_(0.3)
    return model
