r"""Pair 1: a pre-norm transformer block built from ``torch.nn`` parts (``nn.MultiheadAttention`` with its
fused ``in_proj_weight``) <-> diffusers ``BasicTransformerBlock`` (``Attention`` with ``to_q/to_k/to_v``,
``to_out.0``).

The weights go across twice, independently: a hand-written conversion (:func:`hand_convert`) and the rules
``paritykit weights map --emit-rules`` infers from values (:func:`rules_convert`); the gallery checks they
agree."""

from __future__ import annotations

import torch
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import AttnProcessor
from torch import nn

from tests.gallery.base import BuiltPair, compute_in_bf16, load_exactly, seeded, with_weights

DIM, HEADS, HIDDEN, TOKENS = 32, 4, 64, 8
REFERENCE_EPS = 1e-6  # what the research block was trained with; diffusers' default is 1e-5


class TorchBlock(nn.Module):
    r"""Pre-norm self-attention block as research code writes it with ``torch.nn`` modules."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, hidden: int = HIDDEN, eps: float = REFERENCE_EPS):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def make_port(activation: str = "gelu", eps: float = REFERENCE_EPS) -> BasicTransformerBlock:
    return BasicTransformerBlock(
        DIM,
        HEADS,
        DIM // HEADS,
        activation_fn=activation,
        attention_bias=True,
        norm_eps=eps,
        ff_inner_dim=HIDDEN,
    )


def hand_convert(sd: dict[str, torch.Tensor], swap_qk: bool = False) -> dict[str, torch.Tensor]:
    r"""The conversion a person writes: split the fused projection in q, k, v order, rename the rest."""
    q, k, v = sd["attn.in_proj_weight"].chunk(3, dim=0)
    qb, kb, vb = sd["attn.in_proj_bias"].chunk(3, dim=0)
    if swap_qk:  # the planted slip: chunk order read as k, q, v
        q, k, qb, kb = k, q, kb, qb
    out = {
        "attn1.to_q.weight": q,
        "attn1.to_k.weight": k,
        "attn1.to_v.weight": v,
        "attn1.to_q.bias": qb,
        "attn1.to_k.bias": kb,
        "attn1.to_v.bias": vb,
        "attn1.to_out.0.weight": sd["attn.out_proj.weight"],
        "attn1.to_out.0.bias": sd["attn.out_proj.bias"],
    }
    for ref, port in (
        ("norm1", "norm1"),
        ("norm2", "norm3"),
        ("mlp.0", "ff.net.0.proj"),
        ("mlp.2", "ff.net.2"),
    ):
        for p in ("weight", "bias"):
            out[f"{port}.{p}"] = sd[f"{ref}.{p}"]
    return {k: t.clone() for k, t in out.items()}


def rules_convert(sd: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    r"""Convert with the rules ``weights map`` infers from the two checkpoints (what ``--emit-rules``
    writes)."""
    import paritykit

    cmap = paritykit.infer_conversion_map(sd, target)
    return paritykit.apply_rules_to_state_dict(cmap, sd)


def _plant_after_engine(port: BasicTransformerBlock, bugs: set[str]) -> None:
    r"""Bug classes planted after the repair search was written (issue 22's held-out split)."""
    with torch.no_grad():
        if (
            "out-heads-permuted" in bugs
        ):  # conversion reads the out-projection's inputs with heads 0 and 1 crossed
            w = port.attn1.to_out[0].weight
            w.copy_(torch.cat([w[:, 8:16], w[:, 0:8], w[:, 16:]], dim=1))
        if "norm-log-weight" in bugs:  # the checkpoint's log-scale written where the port wants the scale
            port.norm3.weight.copy_(port.norm3.weight.log())
        if "mlp-halves" in bugs:  # the first MLP projection's output rows loaded as (second half, first half)
            proj = port.ff.net[0].proj
            for t in (proj.weight, proj.bias):
                t.copy_(torch.cat(t.chunk(2, dim=0)[::-1], dim=0))
    if "attention-subtracted" in bugs:  # port forward code subtracts the attention branch
        port.attn1.register_forward_hook(lambda _m, _a, out: -out)


def inputs() -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(7)
    # a residual stream of modest scale, as inside a trained network
    return (0.5 * torch.randn(2, TOKENS, DIM, generator=g),), {}


def build(variant: str, bug: str | None = None) -> BuiltPair:
    r"""The pair with ``bug`` planted: None, ``math-attention``, ``eps``, ``gelu-tanh``, ``swap-qk``,
    ``attention-scale``, ``bf16-norm``, ``eps+gelu-tanh``, ``out-scale`` (forward code multiplies the
    attention out-projection by 1.01: no setting or weight explains it), ``bias-twice`` (its bias added a
    second time)."""
    bugs = set(bug.split("+")) if bug else set()
    reference = with_weights(seeded(TorchBlock), variant)
    sd = {k: t.detach().clone() for k, t in reference.state_dict().items()}
    port = make_port(
        activation="gelu-approximate" if "gelu-tanh" in bugs else "gelu",
    )
    state = hand_convert(sd, swap_qk="swap-qk" in bugs)
    load_exactly(port, state)
    if "eps" in bugs:  # the first norm built with diffusers' default eps, not the model's
        port.norm1.eps = 1e-5
    if "math-attention" in bugs:  # a different backend, not a bug: explicit softmax(QK^T)V instead of SDPA
        port.attn1.set_processor(AttnProcessor())
    if "attention-scale" in bugs:  # 1/sqrt of the model width instead of the head width (explicit attention)
        port.attn1.set_processor(AttnProcessor())
        port.attn1.scale = DIM**-0.5
    if "bf16-norm" in bugs:
        compute_in_bf16(port.norm3)
    if "out-scale" in bugs:  # a stray factor in the port's forward code, after the out-projection
        port.attn1.to_out[0].register_forward_hook(lambda _m, _a, out: out * 1.01)
    if "bias-twice" in bugs:  # forward code adds the out-projection bias a second time
        out_proj = port.attn1.to_out[0]
        out_proj.register_forward_hook(lambda m, _a, out: out + m.bias)
    _plant_after_engine(port, bugs)
    return BuiltPair(
        reference, port, inputs(), sd, {k: t.detach().clone() for k, t in port.state_dict().items()}
    )
