"""paritykit.bisection.module_fit: a configurable port module's constructor setting is found from the tensor
the reference computes inline, and bisect reports it as a verified fix at an inline culprit."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.models.embeddings import Timesteps
from paritykit.bisection.entry import bisect
from paritykit.bisection.module_fit import constructor_values, fit_module
from torch import nn

from tests.bisect_pairs import inline_time_pair

T = torch.tensor([999.0, 421.0, 3.0])


def sinusoid(t, dim, *, cos_first, shift=0.0):
    """Written here from the formula, independently of diffusers."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / (half - shift))
    angles = t[:, None] * freqs[None]
    parts = [torch.cos(angles), torch.sin(angles)] if cos_first else [torch.sin(angles), torch.cos(angles)]
    return torch.cat(parts, dim=-1)


def test_constructor_values_are_read_back_from_the_module():
    values, readable = constructor_values(Timesteps(16, flip_sin_to_cos=False, downscale_freq_shift=1))
    assert values == {"num_channels": 16, "flip_sin_to_cos": False, "downscale_freq_shift": 1, "scale": 1}
    assert set(readable) == set(values)


@pytest.mark.parametrize(
    ("kwargs", "target_kwargs", "changes"),
    [
        ({"flip_sin_to_cos": False}, {"cos_first": True}, {"flip_sin_to_cos": (False, True)}),
        ({"flip_sin_to_cos": True}, {"cos_first": False}, {"flip_sin_to_cos": (True, False)}),
        ({"flip_sin_to_cos": False}, {"cos_first": False, "shift": 1.0}, {"downscale_freq_shift": (0, 1)}),
    ],
)
def test_fit_finds_the_one_setting_that_reproduces_the_target(kwargs, target_kwargs, changes):
    module = Timesteps(32, downscale_freq_shift=0, **kwargs)
    fit = fit_module(module, ((T,), {}), sinusoid(T, 32, **target_kwargs))
    assert fit is not None and fit.changes == changes
    assert fit.before > 0.1 and fit.after < 1e-5
    assert fit.fix("time_proj") == "; ".join(f"time_proj.{k} = {new!r}" for k, (_, new) in changes.items())


def test_fit_does_not_fire_without_a_setting_that_explains_the_target():
    module = Timesteps(32, flip_sin_to_cos=True, downscale_freq_shift=0)
    noisy = sinusoid(T, 32, cos_first=True) + 0.01 * torch.randn(
        3, 32, generator=torch.Generator().manual_seed(0)
    )
    assert fit_module(module, ((T,), {}), noisy) is None


def test_fit_does_not_fire_on_modules_whose_configuration_cannot_be_read_back():
    class Hidden(nn.Module):
        def __init__(self, table):  # a required non-scalar argument: nothing to search
            super().__init__()
            self.table = table

        def forward(self, x):
            return x * 2

    x = torch.randn(4)
    assert fit_module(Hidden(object()), ((x,), {}), x) is None
    # LayerNorm's normalized_shape is a tuple, not a scalar setting: no search
    assert fit_module(nn.LayerNorm(4), ((torch.randn(2, 4),), {}), torch.randn(2, 4)) is None


def test_bisect_names_the_port_module_the_reference_computes_inline_and_verifies_its_fix():
    reference, port, inputs = inline_time_pair("flip")
    report = bisect(reference, port, inputs)
    culprit = report.culprit
    assert report.verdict == "diverge" and culprit.reference == "" and culprit.inline
    first = culprit.hints[0]
    assert first.id == "module-fit" and first.verified is True
    assert first.fix == "time_proj.flip_sin_to_cos = True"
    assert first.evidence["culprit_after"] == 0 and first.evidence["culprit_before"] > 1
    ids = [h.id for h in culprit.hints]
    assert "inline-reference" in ids and "swapped-halves" in ids and "no-signature" not in ids
    inline = next(h for h in culprit.hints if h.id == "inline-reference")
    assert inline.evidence["producers"] == ["time_proj"] and inline.evidence["child"] == "mlp"
    text = report.render()
    assert "fix (verified): time_proj.flip_sin_to_cos = True" in text
    assert "the verified fix below makes it match" in text and "the reference has no module for" not in text


def test_bisect_inline_reference_without_a_fitting_setting_says_so_and_fixes_nothing():
    reference, port, inputs = inline_time_pair("period")
    culprit = bisect(reference, port, inputs).culprit
    ids = [h.id for h in culprit.hints]
    assert "module-fit" not in ids and ids[0] == "inline-reference"
    assert not any(h.verified for h in culprit.hints)


@pytest.mark.parametrize("trained", [True, False])
def test_correct_inline_port_matches_without_hints(trained):
    reference, port, inputs = inline_time_pair(None, trained=trained)
    report = bisect(reference, port, inputs)
    assert report.verdict == "match" and report.culprit is None and report.first_output_divergence is None


def _scaled_processor():
    r"""A look-alike bug in the attention itself (its output scaled), not in the rotary module feeding it."""
    from tests.gallery.rope import RotaryProcessor

    class Scaled(RotaryProcessor):
        def __call__(
            self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None
        ):
            return 1.01 * super().__call__(attn, hidden_states, image_rotary_emb=image_rotary_emb)

    return Scaled()


@pytest.mark.parametrize(
    "bug, fix",
    [
        ("theta-default", "rope.theta = 500.0"),
        ("interpolate-default", "rope.linear_factor = 2.0"),
        # the layout flag the rotary module and the processor unpacking its output share: flipped on both
        ("half-split", "rope.interleaved = True; attn.processor.interleaved = True"),
    ],
)
def test_a_port_input_the_reference_computes_inside_the_module_is_fitted_at_its_producer(bug, fix):
    from tests.gallery import rope

    pair = rope.build("distinct", bug)
    report = bisect(pair.reference, pair.port, pair.inputs)
    culprit = report.culprit
    # replayed with the reference's x and the port's own image_rotary_emb: the attention is the culprit
    assert (culprit.reference, culprit.port, culprit.test) == ("attn", "attn", "replay")
    first = culprit.hints[0]
    assert (first.id, first.verified, first.fix) == ("module-fit", True, fix)
    assert first.evidence["culprit_after"] < first.evidence["culprit_before"]
    # the trials flip the consumer's flag on the real port; it is left as it was
    assert pair.port.attn.processor.interleaved is (bug != "half-split")


@pytest.mark.parametrize("bug", [None, "attention"])
def test_no_producer_fit_without_a_setting_that_makes_the_culprit_match(bug):
    from tests.gallery import rope

    pair = rope.build("distinct", None if bug == "attention" else bug)
    if bug == "attention":
        pair.port.attn.set_processor(_scaled_processor())
    report = bisect(pair.reference, pair.port, pair.inputs)
    if bug is None:  # must not fire: the faithful port matches
        assert report.verdict == "match" and report.culprit is None
        return
    assert (report.culprit.reference, report.culprit.port) == ("attn", "attn")
    assert not [h for h in report.culprit.hints if h.id == "module-fit"]
    located = [h for h in report.culprit.hints if h.id == "inline-reference"]
    assert located and located[0].evidence["producers"] == ["rope"]
    assert "no constructor setting" in located[0].message
