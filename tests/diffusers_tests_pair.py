"""The port pair `paritykit new diffusers-tests` is tested on: Wan 2.1's research DiT (DiffSynth-Studio's
``WanModel``, as published) with seeded weights, and diffusers' ``WanTransformer3DModel`` holding them moved
by diffusers' own converter, saved with ``save_pretrained``. ``plant`` saves the port with one bug."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.research import ResearchDenoise, wan_dit_pair_built


def build_reference() -> torch.nn.Module:
    r"""The research DiT with the pair's seeded weights, called as DiffSynth's pipeline calls it (its
    ``WanModel.forward`` is not the path the research code runs): what ``--reference`` names."""
    research, _, _ = wan_dit_pair_built(num_layers=1)
    return ResearchDenoise(research)


def save_port(folder: str | Path, plant: str = "") -> Path:
    r"""The converted port saved in ``folder``. ``plant="eps"``: its norms' eps 1e-5 instead of 1e-6, a bug no
    fast test sees (they build the model from its own config)."""
    _, port, _ = wan_dit_pair_built(num_layers=1)
    if plant == "eps":
        port.register_to_config(eps=1e-5)
        for module in port.modules():
            if module is not port and getattr(module, "eps", None) == 1e-6:
                module.eps = 1e-5
    port.save_pretrained(str(folder))
    return Path(folder)


def pixart_inputs(config: dict) -> dict:
    r"""PixArt-α's transformer inputs for ``config`` (what ``--inputs`` names): its forward takes the extra
    conditions as ``added_cond_kwargs``, which no signature shapes."""
    size = config["sample_size"]
    return {
        "hidden_states": torch.randn(1, config["in_channels"], size, size),
        "encoder_hidden_states": torch.randn(1, 8, config["cross_attention_dim"]),
        "timestep": torch.tensor([10]),
        "added_cond_kwargs": {
            "resolution": torch.tensor([[8.0 * size] * 2]),
            "aspect_ratio": torch.tensor([[1.0]]),
        },
    }


def convert(state_dict: dict) -> dict:
    r"""The reference's weights as the port holds them (what ``--convert`` names): diffusers' own Wan
    converter on the research DiT's keys."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    return convert_wan_transformer_to_diffusers({k.removeprefix("dit."): v for k, v in state_dict.items()})
