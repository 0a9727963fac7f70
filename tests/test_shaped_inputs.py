"""Inputs shaped for diffusers model classes from their forward signature and config (paritykit.model_inputs),
tried over every model class the installed diffusers ships, built tiny from its default config."""

from __future__ import annotations

import re
from pathlib import Path

import diffusers
import pytest
import torch
from paritykit import ParityKitError
from paritykit.tracing import shaped_inputs
from paritykit.tracing.shaped_inputs import model_classes, model_inputs, run_tiny, survey, tiny_config

LISTING = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "model_inputs.txt"


def _survey() -> dict[str, shaped_inputs.Survey]:
    return {model_class.__name__: survey(model_class) for model_class in model_classes()}


# the survey is a minute of model runs: one test reads it for everything it is checked against, so no two
# pytest workers make it twice
def test_every_model_class_runs_on_its_inputs_or_says_why_not_as_the_listing_says():
    surveyed = _survey()
    assert len(surveyed) > 50  # the classes diffusers exports, not a filtered few
    failures = []
    for name, found in surveyed.items():
        assert found.status in ("runs", "no tiny build", "no inputs"), found
        if found.status != "runs":
            assert found.reason and "\n" not in found.reason, found
            continue
        error = run_tiny(getattr(diffusers, name))
        if error is not None:
            failures.append(f"{name}: {error}")
    # classes whose forward is not a model's (an adapter returning nothing) are named, not hidden
    assert all(f.startswith("MotionAdapter:") for f in failures), failures
    runs = {name for name, found in surveyed.items() if found.status == "runs"}
    # the families a port targets most: UNets, DiTs (image and video, patch grids and token sequences), VAEs
    expected = {
        "UNet2DConditionModel",
        "UNet2DModel",
        "UNet3DConditionModel",
        "SD3Transformer2DModel",
        "FluxTransformer2DModel",
        "WanTransformer3DModel",
        "CogVideoXTransformer3DModel",
        "DiTTransformer2DModel",
        "AutoencoderKL",
        "AutoencoderKLWan",
        "ControlNetModel",
    }
    assert expected <= runs, sorted(expected - runs)
    _classes_that_cannot_be_built_tiny_say_why(surveyed)
    _the_shipped_listing_is_what_this_diffusers_gives(surveyed)


def _the_shipped_listing_is_what_this_diffusers_gives(surveyed):
    # benchmarks/results/model_inputs.txt says which classes cannot and why; it must stay true
    text = LISTING.read_text()
    version = re.search(r"diffusers (\S+):", text)[1]
    if version != diffusers.__version__:
        return  # the listing was made with another diffusers: nothing to hold it to
    listed = {}
    for line in text.splitlines()[4:]:
        name, rest = line.split(maxsplit=1)
        status = next(
            s for s in ("runs", "no tiny build", "no inputs", "fails on the CPU") if rest.startswith(s)
        )
        listed[name] = "runs" if status == "fails on the CPU" else status
    assert listed == {name: found.status for name, found in surveyed.items()}


def test_shapes_follow_the_config():
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    config = {
        **tiny_config(UNet2DConditionModel),
        "in_channels": 7,
        "cross_attention_dim": 24,
        "sample_size": 12,
    }
    args, kwargs = model_inputs(UNet2DConditionModel, config)
    sample, timestep, context = args
    assert sample.shape == (1, 7, 12, 12) and timestep.shape == (1,) and context.shape[-1] == 24
    assert kwargs == {}
    # a token-sequence DiT: (B, N, C) latents, with the position ids and pooled text its config asks for
    config = {**tiny_config(FluxTransformer2DModel), "in_channels": 16, "pooled_projection_dim": 12}
    args, kwargs = model_inputs(FluxTransformer2DModel, config)
    assert args[0].shape[0] == 1 and args[0].shape[-1] == 16
    assert kwargs["img_ids"].shape == (args[0].shape[1], 3)
    assert kwargs["pooled_projections"].shape == (1, 12)
    assert "guidance" not in kwargs  # guidance_embeds is off by default
    _, kwargs = model_inputs(FluxTransformer2DModel, {**config, "guidance_embeds": True})
    assert kwargs["guidance"].shape == (1,)


def test_inputs_are_seeded_and_fresh():
    from diffusers import AutoencoderKL

    first, _ = model_inputs(AutoencoderKL, seed=3)
    again, _ = model_inputs(AutoencoderKL, seed=3)
    other, _ = model_inputs(AutoencoderKL, seed=4)
    assert torch.equal(first[0], again[0]) and first[0] is not again[0]
    assert not torch.equal(first[0], other[0])


def test_required_arguments_come_positionally_in_forward_order():
    # a reference whose forward takes the same things in the same order under other names can take them
    from diffusers import WanTransformer3DModel

    args, kwargs = model_inputs(WanTransformer3DModel, tiny_config(WanTransformer3DModel))
    assert [a.dim() for a in args] == [5, 1, 3] and kwargs == {}


def test_an_argument_nothing_in_the_config_shapes_is_an_error_naming_it():
    # must not guess: an index list, a size tuple, a second modality the config does not describe
    from diffusers import CogView4Transformer2DModel

    with pytest.raises(ParityKitError) as raised:
        model_inputs(CogView4Transformer2DModel, tiny_config(CogView4Transformer2DModel))
    message = str(raised.value)
    assert message.startswith("CogView4Transformer2DModel: no inputs found")
    assert "original_size" in message and "--inputs MODULE:FUNCTION" in message and "\n" not in message
    with pytest.raises(ParityKitError) as again:  # the search is not run twice; its answer is the same
        model_inputs(CogView4Transformer2DModel, tiny_config(CogView4Transformer2DModel))
    assert str(again.value) == message


def test_a_layout_no_candidate_fits_reports_the_first_candidates_error():
    from diffusers import UNet2DModel

    class NeedsEightFrames(UNet2DModel):
        def forward(self, sample, timestep):
            if sample.dim() != 5 or sample.shape[2] != 8:
                raise ValueError("this model takes exactly 8 frames")
            return super().forward(sample[:, :, 0], timestep)

    with pytest.raises(ParityKitError, match=r"NeedsEightFrames: .*the first, sample \(1, 3, .*8 frames"):
        model_inputs(NeedsEightFrames, tiny_config(UNet2DModel))


def _classes_that_cannot_be_built_tiny_say_why(surveyed):
    # no defaults (a wrapper of several models), a default config that does not build, too large when shrunk
    assert surveyed["MultiControlNetModel"].reason == "its constructor has no default for controlnets"
    assert surveyed["Transformer2DModel"].reason.startswith("its default config does not build (ValueError")
    for found in surveyed.values():
        if found.status == "no tiny build" and found.parameters:
            assert found.parameters > shaped_inputs.TINY_PARAMETERS and "M parameters" in found.reason


def test_tiny_config_keeps_the_head_dimension_and_the_widths_tied_to_it():
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    flux = tiny_config(FluxTransformer2DModel)
    assert flux["num_layers"] == flux["num_single_layers"] == 1 and flux["num_attention_heads"] == 2
    assert "attention_head_dim" not in flux and "joint_attention_dim" not in flux  # kept: the interface
    unet = tiny_config(UNet2DConditionModel)
    assert unet["block_out_channels"] == (32, 64, 128, 128) and unet["layers_per_block"] == 1
