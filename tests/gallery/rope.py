r"""Pair 3: rotary attention with ``rotary-embedding-torch`` (PyPI; interleaved pairs, ``theta``,
``interpolate_factor``) <-> the same attention as diffusers models write it: a diffusers ``Attention`` whose
processor applies ``apply_rotary_emb`` with cos/sin from ``get_1d_rotary_pos_embed``.

The reference rotates inside its attention's forward (the rotary module is never called as a module); the port
computes cos/sin in a small configurable module of its own, the way diffusers transformers do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention
from diffusers.models.embeddings import apply_rotary_emb, get_1d_rotary_pos_embed
from rotary_embedding_torch import RotaryEmbedding
from torch import nn

from tests.gallery.base import BuiltPair, load_exactly, seeded, with_weights

DIM, HEADS, TOKENS = 32, 2, 12
HEAD_DIM = DIM // HEADS
THETA = 500.0  # the research model's configured base (not the 10000 default)
INTERPOLATE = 2.0  # positions divided by 2: context stretched after training


class RotaryAttention(nn.Module):
    r"""Research attention: fused qkv, rotary-embedding-torch on q and k, SDPA, output projection."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.rotary = RotaryEmbedding(dim=HEAD_DIM, theta=THETA, interpolate_factor=INTERPOLATE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, HEADS, HEAD_DIM).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        q = self.rotary.rotate_queries_or_keys(q)
        k = self.rotary.rotate_queries_or_keys(k)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, DIM))


class ResearchModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = RotaryAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x)


class RotaryPosEmbed(nn.Module):
    r"""cos/sin tables for 1-D positions through diffusers' ``get_1d_rotary_pos_embed``."""

    def __init__(
        self, dim: int, theta: float = 10000.0, interleaved: bool = True, linear_factor: float = 1.0
    ):
        super().__init__()
        self.dim, self.theta, self.interleaved, self.linear_factor = dim, theta, interleaved, linear_factor

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return get_1d_rotary_pos_embed(
            self.dim,
            positions,
            theta=self.theta,
            use_real=True,
            linear_factor=self.linear_factor,
            repeat_interleave_real=self.interleaved,
        )


class RotaryProcessor:
    r"""Self-attention with rotary q/k, as diffusers processors write it."""

    def __init__(self, interleaved: bool = True):
        self.interleaved = interleaved

    def __call__(
        self,
        attn: Attention,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        image_rotary_emb=None,
    ):
        b, n, _ = hidden_states.shape
        q, k, v = (
            proj(hidden_states).view(b, n, attn.heads, -1).transpose(1, 2)
            for proj in (attn.to_q, attn.to_k, attn.to_v)
        )
        unbind = -1 if self.interleaved else -2
        q = apply_rotary_emb(q, image_rotary_emb, use_real_unbind_dim=unbind)
        k = apply_rotary_emb(k, image_rotary_emb, use_real_unbind_dim=unbind)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, -1)
        return attn.to_out[1](attn.to_out[0](out))


class PortModel(nn.Module):
    def __init__(self, theta: float = THETA, interleaved: bool = True, linear_factor: float = INTERPOLATE):
        super().__init__()
        self.rope = RotaryPosEmbed(
            HEAD_DIM, theta=theta, interleaved=interleaved, linear_factor=linear_factor
        )
        self.attn = Attention(
            DIM, heads=HEADS, dim_head=HEAD_DIM, bias=True, processor=RotaryProcessor(interleaved)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freqs = self.rope(torch.arange(x.shape[1], dtype=torch.float32))
        return x + self.attn(x, image_rotary_emb=freqs)


def convert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for p in ("weight", "bias"):
        for name, t in zip(("to_q", "to_k", "to_v"), sd[f"attn.qkv.{p}"].chunk(3, dim=0)):
            out[f"attn.{name}.{p}"] = t.clone()
        out[f"attn.to_out.0.{p}"] = sd[f"attn.proj.{p}"].clone()
    return out


def inputs() -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(5)
    return (torch.randn(2, TOKENS, DIM, generator=g),), {}


def build(variant: str, bug: str | None = None) -> BuiltPair:
    r"""The pair with ``bug`` planted: None, ``half-split`` (layout), ``theta-default``,
    ``interpolate-default`` (linear factor left at 1), ``half-split+theta-default``."""
    bugs = set(bug.split("+")) if bug else set()
    reference = with_weights(seeded(ResearchModel), variant)
    sd = {k: t.detach().clone() for k, t in reference.state_dict().items() if "rotary" not in k}
    port = PortModel(
        theta=10000.0 if "theta-default" in bugs else THETA,
        interleaved="half-split" not in bugs,
        linear_factor=1.0 if "interpolate-default" in bugs else INTERPOLATE,
    )
    load_exactly(port, convert(sd))
    if "cos-sin-swapped" in bugs:  # planted after the repair search: the port hands attention (sin, cos)
        port.rope.register_forward_hook(lambda _m, _a, out: (out[1], out[0]))
    target = {k: t.detach().clone() for k, t in port.state_dict().items()}
    return BuiltPair(reference, port, inputs(), sd, target)
