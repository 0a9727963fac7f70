r"""Pair 4: a transformers ``CLIPEncoderLayer`` (eager attention, separate q/k/v projections) <-> diffusers
``BasicTransformerBlock``, converted by renaming.

transformers is a separate code base (its own attention, norms and MLP); it installs from PyPI without
torchvision."""

from __future__ import annotations

import torch
from diffusers.models.attention import BasicTransformerBlock
from transformers import CLIPVisionConfig
from transformers.models.clip.modeling_clip import CLIPEncoderLayer

from tests.gallery.base import BuiltPair, load_exactly, seeded, with_weights

DIM, HEADS, HIDDEN, TOKENS = 32, 4, 64, 7

RENAMES = {
    "layer_norm1": "norm1",
    "self_attn.q_proj": "attn1.to_q",
    "self_attn.k_proj": "attn1.to_k",
    "self_attn.v_proj": "attn1.to_v",
    "self_attn.out_proj": "attn1.to_out.0",
    "layer_norm2": "norm3",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
}


def make_reference(act: str = "gelu") -> CLIPEncoderLayer:
    config = CLIPVisionConfig(
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_attention_heads=HEADS,
        hidden_act=act,
        attention_dropout=0.0,
    )
    config._attn_implementation = "eager"  # explicit softmax(QK^T)V; the port uses SDPA
    return CLIPEncoderLayer(config)


def convert(sd: dict[str, torch.Tensor], swap_kv: bool = False) -> dict[str, torch.Tensor]:
    renames = dict(RENAMES)
    if swap_kv:  # the planted slip: k and v targets crossed in the rename table
        renames["self_attn.k_proj"], renames["self_attn.v_proj"] = "attn1.to_v", "attn1.to_k"
    out = {}
    for key, t in sd.items():
        module, param = key.rsplit(".", 1)
        out[f"{renames[module]}.{param}"] = t.clone()
    return out


def inputs() -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(11)
    return (torch.randn(2, TOKENS, DIM, generator=g), None), {}


def port_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return (args[0],), {}


def build(variant: str, bug: str | None = None) -> BuiltPair:
    r"""The pair with ``bug`` planted: None, ``swap-kv``, ``swap-kv+gelu-tanh``, ``quick-gelu`` (the reference
    is an OpenAI CLIP with quick_gelu, the port keeps exact GELU), ``eps`` (port norm1 eps 1e-6, CLIP's 1e-5).
    """
    bugs = set(bug.split("+")) if bug else set()
    act = "quick_gelu" if "quick-gelu" in bugs else "gelu"
    reference = with_weights(seeded(lambda: make_reference(act)), variant)
    sd = {k: t.detach().clone() for k, t in reference.state_dict().items()}
    port = BasicTransformerBlock(
        DIM,
        HEADS,
        DIM // HEADS,
        activation_fn="gelu-approximate" if "gelu-tanh" in bugs else "gelu",
        attention_bias=True,
        norm_eps=reference.layer_norm1.eps,
        ff_inner_dim=HIDDEN,
    )
    load_exactly(port, convert(sd, swap_kv="swap-kv" in bugs))
    if "eps" in bugs:  # the first norm written with a common default, not CLIP's layer_norm_eps
        port.norm1.eps = 1e-6
    with (
        torch.no_grad()
    ):  # bug classes planted after the repair search was written (issue 22's held-out split)
        if "k-heads-permuted" in bugs:  # k_proj rows read with heads 0 and 1 crossed (q and v are not)
            for t in (port.attn1.to_k.weight, port.attn1.to_k.bias):
                t.copy_(torch.cat([t[8:16], t[0:8], t[16:]], dim=0))
        if "norm-inverse-weight" in bugs:  # a converter that stores the reciprocal of the second norm's scale
            port.norm3.weight.copy_(port.norm3.weight.reciprocal())
    target = {k: t.detach().clone() for k, t in port.state_dict().items()}
    return BuiltPair(reference, port, inputs(), sd, target, port_inputs=port_inputs)
