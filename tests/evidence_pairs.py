"""Independently written port pairs for the evidence tests: research-style code vs transformers / diffusers.

Each builder returns ``(reference, port, inputs)``; ``bug`` plants one porting mistake, ``trained`` gives
every parameter distinct random values (else both sides keep the reference's fresh initialisation).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.bisect_pairs import randomize

DIM, HEADS = 32, 4


# ------------------------------------------------------------------- a research ViT block (DINO / timm style)


class ResearchAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(x), attn


class ResearchMlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ResearchBlock(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = HEADS):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = ResearchAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = ResearchMlp(dim, 2 * dim)

    def forward(self, x):
        y, _ = self.attn(self.norm1(x))
        x = x + y
        return x + self.mlp(self.norm2(x))


def convert_vit(sd: dict, swap_qk: bool = False) -> dict:
    """The upstream-style conversion: split the fused qkv into q/k/v projections, rename the rest."""
    out = {}
    names = {
        "norm1": "layernorm_before",
        "norm2": "layernorm_after",
        "attn.proj": "attention.o_proj",
        "mlp.fc1": "mlp.fc1",
        "mlp.fc2": "mlp.fc2",
    }
    for key, value in sd.items():
        module, _, leaf = key.rpartition(".")
        if module == "attn.qkv":
            q, k, v = value.chunk(3, dim=0)
            if swap_qk:
                q, k = k, q
            for name, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"attention.{name}.{leaf}"] = part.clone()
        else:
            out[f"{names[module]}.{leaf}"] = value.clone()
    return out


def vit_pair(bug: str | None = None, trained: bool = True, seed: int = 0):
    from transformers import ViTConfig
    from transformers.models.vit.modeling_vit import ViTLayer

    torch.manual_seed(seed)
    reference = ResearchBlock().eval()
    if trained:
        randomize(reference, seed)
    config = ViTConfig(
        hidden_size=DIM,
        num_attention_heads=HEADS,
        intermediate_size=2 * DIM,
        layer_norm_eps=1e-12 if bug == "eps" else 1e-6,
        hidden_act="gelu_pytorch_tanh" if bug == "gelu" else "gelu",
    )
    config._attn_implementation = "eager"
    port = ViTLayer(config).eval()
    if bug == "affine":
        port.layernorm_after = nn.LayerNorm(DIM, eps=1e-6, elementwise_affine=False)
    sd = convert_vit(reference.state_dict(), swap_qk=bug == "qk")
    port.load_state_dict(sd, strict=bug != "affine")
    if bug == "scale":
        port.attention.scaling = 1.0
    # small activations make an eps of 1e-6 matter, as in a real model's early layers
    x = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(seed + 1)) * (
        0.01 if bug == "eps" else 1.0
    )
    return reference, port, ((x,), {})


# ------------------------------------------------------------------ torch MultiheadAttention vs diffusers


class ResearchMHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class PortAttention(nn.Module):
    def __init__(self):
        from diffusers.models.attention_processor import Attention

        super().__init__()
        self.attn = Attention(DIM, heads=HEADS, dim_head=DIM // HEADS, bias=True, out_bias=True)

    def forward(self, hidden_states):
        return self.attn(hidden_states)


def mha_pair(bug: str | None = None, trained: bool = True, seed: int = 0):
    torch.manual_seed(seed)
    reference = ResearchMHA().eval()
    if trained:
        randomize(reference, seed)
    port = PortAttention().eval()
    mha = reference.attn
    q, k, v = mha.in_proj_weight.detach().chunk(3)
    qb, kb, vb = mha.in_proj_bias.detach().chunk(3)
    if bug == "qk":
        q, k, qb, kb = k, q, kb, qb
    sd = {
        "attn.to_q.weight": q,
        "attn.to_k.weight": k,
        "attn.to_v.weight": v,
        "attn.to_q.bias": qb,
        "attn.to_k.bias": kb,
        "attn.to_v.bias": vb,
        "attn.to_out.0.weight": mha.out_proj.weight.detach(),
        "attn.to_out.0.bias": mha.out_proj.bias.detach(),
    }
    port.load_state_dict({key: value.clone() for key, value in sd.items()})
    x = torch.randn(2, 6, DIM, generator=torch.Generator().manual_seed(seed + 1))
    return reference, port, ((x,), {})


# --------------------------------------------------------------------- rotary tables: research vs Llama


class ResearchRope(nn.Module):
    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        self.theta = theta
        self.register_buffer(
            "inv_freq", 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim), persistent=False
        )

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class RotaryUser(nn.Module):
    """A tiny model that rotates its input with a rotary table (rotate-half convention on both sides)."""

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.rope = rope

    def forward(self, x, position_ids):
        h = self.proj(x)
        cos, sin = self.rope(h, position_ids)
        half = torch.cat([-h[..., DIM // 2 :], h[..., : DIM // 2]], dim=-1)
        return h * cos + half * sin


def rope_pair(bug: str | None = None, trained: bool = True, seed: int = 0):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    torch.manual_seed(seed)
    reference = RotaryUser(ResearchRope(DIM)).eval()
    if trained:
        randomize(reference, seed)
    theta = 500000.0 if bug == "theta" else 10000.0
    config = LlamaConfig(hidden_size=DIM, num_attention_heads=1, head_dim=DIM, rope_theta=theta)
    port = RotaryUser(LlamaRotaryEmbedding(config)).eval()
    port.proj.load_state_dict(reference.proj.state_dict())
    x = torch.randn(1, 12, DIM, generator=torch.Generator().manual_seed(seed + 1))
    return reference, port, ((x, torch.arange(12)[None]), {})
