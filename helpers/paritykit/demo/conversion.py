"""Convert the research checkpoint to the port's layout: renamed prefixes, a fused qkv split, shift/scale
swap."""

from __future__ import annotations

import re

import torch

_RENAMES = [
    (r"^stem\.", "conv_in."),
    (r"^ctrl_stem\.", "controlnet_cond_embedding."),
    (r"^t_mlp_base\.0\.", "time_embedding.linear_1."),
    (r"^t_mlp_base\.2\.", "time_embedding.linear_2."),
    (r"^t_mlp_ctrl\.0\.", "control_time_embedding.linear_1."),
    (r"^t_mlp_ctrl\.2\.", "control_time_embedding.linear_2."),
    (r"^blocks\.(\d+)\.proj\.", r"transformer_blocks.\1.attn.to_out.0."),
    (r"^blocks\.(\d+)\.mlp\.0\.", r"transformer_blocks.\1.ff.net.0."),
    (r"^blocks\.(\d+)\.mlp\.2\.", r"transformer_blocks.\1.ff.net.2."),
    (r"^head\.", "conv_out."),
]


def convert_reference_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reference names and layout -> port names and layout."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        fused = re.match(r"^blocks\.(\d+)\.qkv\.(weight|bias)$", key)
        ada = re.match(r"^blocks\.(\d+)\.ada\.(weight|bias)$", key)
        if fused:
            block, kind = fused.groups()
            for name, piece in zip(("to_q", "to_k", "to_v"), value.chunk(3, dim=0)):
                out[f"transformer_blocks.{block}.attn.{name}.{kind}"] = piece.clone()
        elif ada:
            block, kind = ada.groups()
            shift, scale = value.chunk(2, dim=0)
            out[f"transformer_blocks.{block}.norm1.linear.{kind}"] = torch.cat([scale, shift])
        else:
            for pattern, repl in _RENAMES:
                key = re.sub(pattern, repl, key)
            out[key] = value.clone()
    return out
