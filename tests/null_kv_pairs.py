"""A prior-style transformer whose attention keeps a learned null key/value, on two sides that group it apart.

The REFERENCE (research style) gives its attention module everything attention uses: a pre-norm, ``to_q``, a
fused ``to_kv``, the ``null_kv`` pair and an output projection; the feed-forward is a second module of the
layer. The PORT (diffusers names) keeps the norm and the null pair on the block, next to a diffusers
``Attention`` (split ``to_k``/``to_v``) and a ``FeedForward``. The only tensor the reference attention and the
port block hold *themselves* is ``null_kv``, so a pairing from directly held tensors would put an attention
against a whole block (attention plus feed-forward).

Latents are ``(batch, tokens, dim)``; ``bug`` plants one or more slips (comma-separated):
``"null_kv"`` (the port reads the null pair's rows the other way round: key as value), ``"final_eps"`` (the
port's final norm has eps 1e-2 where the reference has 1e-5: a small difference on identical inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention
from torch import nn

DIM, HEADS, TOKENS, DEPTH = 32, 4, 6, 2


def _attend(q, k, v, heads):
    b, n, c = q.shape
    q, k, v = (t.reshape(b, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).reshape(b, n, c)


def _with_null(null_kv, k, v):
    b = k.shape[0]
    nk, nv = (t.expand(b, 1, -1) for t in null_kv.unbind(0))
    return torch.cat([nk, k], dim=1), torch.cat([nv, v], dim=1)


class NullAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, 2 * dim, bias=False)
        self.null_kv = nn.Parameter(torch.randn(2, dim))
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        k, v = self.to_kv(h).chunk(2, dim=-1)
        k, v = _with_null(self.null_kv, k, v)
        return self.to_out(_attend(self.to_q(h), k, v, self.heads))


class ReferencePrior(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS, depth: int = DEPTH):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleList(
                [
                    NullAttention(dim, heads),
                    nn.Sequential(
                        nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)
                    ),
                ]
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        for attn, ff in self.layers:
            x = x + attn(x)
            x = x + ff(x)
        return self.proj(self.norm(x))


class PortBlock(nn.Module):
    def __init__(self, dim: int, heads: int, swap_null: bool):
        super().__init__()
        self.swap_null = swap_null
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads=heads, dim_head=dim // heads, bias=False, out_bias=False)
        self.null_kv = nn.Parameter(torch.randn(2, dim))
        self.norm2 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, mult=2, activation_fn="gelu", bias=True)

    def forward(self, hidden_states):
        h = self.norm1(hidden_states)
        null = self.null_kv.flip(0) if self.swap_null else self.null_kv
        k, v = _with_null(null, self.attn.to_k(h), self.attn.to_v(h))
        out = _attend(self.attn.to_q(h), k, v, self.attn.heads)
        hidden_states = hidden_states + self.attn.to_out[0](out)
        return hidden_states + self.ff(self.norm2(hidden_states))


class PortPrior(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS, depth: int = DEPTH, bug: str | None = None):
        super().__init__()
        bugs = set((bug or "").split(","))
        swap = "null_kv" in bugs
        self.transformer_blocks = nn.ModuleList(PortBlock(dim, heads, swap) for _ in range(depth))
        self.norm_out = nn.LayerNorm(dim, eps=1e-2 if "final_eps" in bugs else 1e-5)
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, hidden_states):
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states)
        return self.proj_out(self.norm_out(hidden_states))


def convert(reference: ReferencePrior) -> dict[str, torch.Tensor]:
    r"""The reference's weights under the port's names: ``to_kv`` split into ``to_k``/``to_v``, the
    attention's norm and null pair moved up to the block."""
    out = {}
    for i, (attn, ff) in enumerate(reference.layers):
        blk = f"transformer_blocks.{i}"
        out[f"{blk}.norm1.weight"], out[f"{blk}.norm1.bias"] = attn.norm.weight, attn.norm.bias
        out[f"{blk}.attn.to_q.weight"] = attn.to_q.weight
        out[f"{blk}.attn.to_k.weight"], out[f"{blk}.attn.to_v.weight"] = attn.to_kv.weight.chunk(2, dim=0)
        out[f"{blk}.attn.to_out.0.weight"] = attn.to_out.weight
        out[f"{blk}.null_kv"] = attn.null_kv
        out[f"{blk}.norm2.weight"], out[f"{blk}.norm2.bias"] = ff[0].weight, ff[0].bias
        out[f"{blk}.ff.net.0.proj.weight"], out[f"{blk}.ff.net.0.proj.bias"] = ff[1].weight, ff[1].bias
        out[f"{blk}.ff.net.2.weight"], out[f"{blk}.ff.net.2.bias"] = ff[3].weight, ff[3].bias
    out["norm_out.weight"], out["norm_out.bias"] = reference.norm.weight, reference.norm.bias
    out["proj_out.weight"], out["proj_out.bias"] = reference.proj.weight, reference.proj.bias
    return {k: v.detach().clone() for k, v in out.items()}


def build(bug: str | None = None, seed: int = 0) -> tuple[ReferencePrior, PortPrior, torch.Tensor]:
    r"""The seeded reference (every parameter random, norms included), its port loaded through
    :func:`convert`, and one input."""
    torch.manual_seed(seed)
    reference = ReferencePrior()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (p.ndim == 1))
    port = PortPrior(bug=bug)
    port.load_state_dict(convert(reference), strict=True)
    x = torch.randn(2, TOKENS, DIM, generator=g)
    return reference.eval(), port.eval(), x
