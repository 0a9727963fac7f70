"""paritykit.compare.diagnose: each detector on its own, then property tests that the right hint ranks
first."""

from __future__ import annotations

import itertools
import math

import paritykit.compare.diagnose as D
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from paritykit.compare.diagnose import Hint, diagnose

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IDS = {
    "bf16-cast",
    "fp16-cast",
    "constant-scale",
    "offset",
    "transpose",
    "permute",
    "swapped-halves",
    "zeroed",
    "masked",
    "sign-flip",
    "timestep-rounding",
    "saturation",
    "nonfinite",
}


def randn(*shape, seed=0, scale=1.0):
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def first_id(a, b):
    hints = diagnose(a, b)
    assert hints, "expected at least one hint"
    assert all(isinstance(h, Hint) and h.id in IDS for h in hints)
    assert [h.score for h in hints] == sorted((h.score for h in hints), reverse=True)
    return hints[0].id


# hypothesis inputs: a shape with every dim >= 2 and at least 16 elements, and a seed
shapes = st.lists(st.integers(2, 7), min_size=1, max_size=4).filter(lambda s: math.prod(s) >= 16)
seeds = st.integers(0, 2**31 - 1)
scales = st.floats(0.05, 8.0)


# ------------------------------------------------------------------------------------------ the contract


def test_hint_to_dict_and_render():
    hint = Hint("offset", "B ≈ A + 1 everywhere.", {"c": 1.0}, score=0.8)
    assert hint.to_dict() == {
        "id": "offset",
        "message": "B ≈ A + 1 everywhere.",
        "evidence": {"c": 1.0},
        "score": 0.8,
        "verified": None,
        "fix": None,
    }
    fixed = Hint("module-config", "eps differs", {}, verified=True, fix="norm.eps = 1e-06")
    assert fixed.to_dict()["verified"] is True and fixed.to_dict()["fix"] == "norm.eps = 1e-06"
    assert hint.render() == "[offset] B ≈ A + 1 everywhere."


@given(shapes, seeds, scales)
@PROPERTY
def test_equal_inputs_get_no_hint(shape, seed, scale):
    a = randn(*shape, seed=seed, scale=scale)
    assert diagnose(a, a.clone()) == []
    # within the default float32 tolerance is "equal" too
    assert diagnose(a, a * (1 + 1e-7)) == []


def test_equal_inputs_with_nans_and_integers_get_no_hint():
    a = randn(4, 4)
    a[1, 1] = float("nan")
    assert diagnose(a, a.clone()) == []
    t = torch.arange(10)
    assert diagnose(t, t.clone()) == []


def test_symmetric_matrix_with_noise_gets_no_transpose_hint():
    m = randn(6, 6)
    m = m + m.T
    assert all(h.id != "transpose" for h in diagnose(m, m + 1e-3 * randn(6, 6, seed=1)))


# --------------------------------------------------------------------------------- property: right hint first


@given(
    shapes,
    seeds,
    st.one_of(st.floats(0.05, 0.98), st.floats(1.02, 20.0), st.floats(-20.0, -1.05), st.floats(-0.95, -0.05)),
)
@PROPERTY
def test_constant_scale_ranks_first(shape, seed, k):
    a = randn(*shape, seed=seed)
    hints = diagnose(a, a * k)
    assert hints[0].id == "constant-scale"
    assert hints[0].evidence["k"] == pytest.approx(k, rel=1e-5)


@given(shapes, seeds, st.one_of(st.floats(0.01, 10.0), st.floats(-10.0, -0.01)))
@PROPERTY
def test_offset_ranks_first(shape, seed, c):
    a = randn(*shape, seed=seed)
    hints = diagnose(a, a + c)
    assert hints[0].id == "offset" and hints[0].evidence["c"] == pytest.approx(c, rel=1e-4, abs=1e-6)


@given(shapes, seeds, scales)
@PROPERTY
def test_sign_flip_ranks_first(shape, seed, scale):
    a = randn(*shape, seed=seed, scale=scale)
    assert first_id(a, -a) == "sign-flip"


@given(shapes, seeds, scales, st.booleans())
@PROPERTY
def test_bf16_cast_ranks_first(shape, seed, scale, rounded_is_b):
    a = randn(*shape, seed=seed, scale=scale)
    cast = a.to(torch.bfloat16).float()
    hints = diagnose(a, cast) if rounded_is_b else diagnose(cast, a)
    assert hints[0].id == "bf16-cast"
    assert hints[0].evidence["rounded_side"] == ("b" if rounded_is_b else "a")


@given(shapes, seeds, scales)
@PROPERTY
def test_fp16_cast_ranks_first(shape, seed, scale):
    a = randn(*shape, seed=seed, scale=scale)
    assert first_id(a, a.half().float()) == "fp16-cast"


@given(shapes, seeds, scales)
@PROPERTY
def test_zeroed_ranks_first(shape, seed, scale):
    a = randn(*shape, seed=seed, scale=scale)
    assert first_id(a, torch.zeros_like(a)) == "zeroed"
    assert first_id(torch.zeros_like(a), a) == "zeroed"


@given(shapes.filter(lambda s: len(s) >= 2), seeds, st.data())
@PROPERTY
def test_transpose_ranks_first(shape, seed, data):
    a = randn(*shape, seed=seed)
    i, j = data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=2, max_size=2, unique=True))
    b = a.transpose(i, j)
    assume(not (b.shape == a.shape and torch.equal(a, b)))
    hints = diagnose(a, b)
    assert hints[0].id == "transpose" and sorted(hints[0].evidence["axes"]) == sorted([i, j])


@given(shapes.filter(lambda s: len(s) >= 3), seeds, st.data())
@PROPERTY
def test_permute_ranks_first(shape, seed, data):
    a = randn(*shape, seed=seed)
    moving = [
        p for p in itertools.permutations(range(len(shape))) if sum(p[k] != k for k in range(len(p))) >= 3
    ]
    perm = data.draw(st.sampled_from(moving))
    hints = diagnose(a, a.permute(*perm))
    assert hints[0].id == "permute"
    assert a.permute(*hints[0].evidence["dims"]).equal(a.permute(*perm))


@given(shapes, seeds, st.data())
@PROPERTY
def test_swapped_halves_ranks_first(shape, seed, data):
    even_dims = [d for d, s in enumerate(shape) if s % 2 == 0]
    assume(even_dims)
    dim = data.draw(st.sampled_from(even_dims))
    a = randn(*shape, seed=seed)
    first, second = a.chunk(2, dim)
    hints = diagnose(a, torch.cat([second, first], dim))
    assert hints[0].id == "swapped-halves" and hints[0].evidence["chunks"] == 2


@given(seeds, st.integers(1, 8), st.sampled_from(["round", "trunc", "floor"]))
@PROPERTY
def test_timestep_rounding_ranks_first(seed, n, mode):
    g = torch.Generator().manual_seed(seed)
    t = 1 + 998 * torch.rand(n + 1, generator=g)
    rounded = {"round": torch.round, "trunc": torch.trunc, "floor": torch.floor}[mode](t)
    hints = diagnose(t, rounded.long() if mode == "trunc" else rounded)
    assert hints[0].id == "timestep-rounding"


@given(shapes, seeds, st.data(), st.sampled_from([float("nan"), float("inf"), -float("inf")]))
@PROPERTY
def test_nonfinite_ranks_first_even_on_top_of_another_bug(shape, seed, data, bad):
    a = randn(*shape, seed=seed)
    b = a * 0.5
    position = data.draw(st.integers(0, a.numel() - 1))
    b.view(-1)[position] = bad
    hints = diagnose(a, b)
    assert hints[0].id == "nonfinite"
    assert hints[0].evidence["first_index"] == list(torch.unravel_index(torch.tensor(position), a.shape))
    assert "constant-scale" in [h.id for h in hints[1:]]


# ------------------------------------------------------------------------------------ detectors one by one


def test_detect_nonfinite_names_the_side_and_first_position():
    a = randn(3, 4)
    b = a.clone()
    b[1, 2] = float("nan")
    a[2, 3] = float("inf")
    hint = D.detect_nonfinite(a, b)
    assert hint.evidence["first_index"] == [1, 2]
    assert (hint.evidence["a_only"], hint.evidence["b_only"]) == (1, 1)
    both = a.clone()
    both[0, 0] = float("nan")
    other = a.clone()
    other[0, 0] = float("nan")
    assert D.detect_nonfinite(both, other) is None


def test_detect_zeroed_only_for_one_all_zero_side():
    a = randn(10)
    assert D.detect_zeroed(a, torch.zeros(10)).evidence["zero_side"] == "b"
    assert D.detect_zeroed(torch.zeros(10), torch.zeros(10)) is None
    partly = a.clone()
    partly[:5] = 0
    assert D.detect_zeroed(a, partly) is None


def test_detect_transpose_across_shapes_and_not_on_unrelated_tensors():
    a = randn(2, 3, 5, 4)
    assert D.detect_transpose(a, a.transpose(1, 2)).evidence["axes"] == [1, 2]
    assert D.detect_transpose(a, a.permute(0, 2, 3, 1)).id == "permute"
    assert D.detect_transpose(a, randn(2, 5, 3, 4, seed=1)) is None
    assert D.detect_transpose(a, a.reshape(2, 5, 3, 4)) is None  # a reshape is not a transpose


def test_swapped_halves_generalises_to_chunk_orders():
    shift, scale, gate = randn(2, 8, seed=1), randn(2, 8, seed=2), randn(2, 8, seed=3)
    a = torch.cat([shift, scale, gate], dim=1)
    b = torch.cat([scale, shift, gate], dim=1)
    hint = D.detect_swapped_halves(a, b)
    assert hint.evidence == {"dim": 1, "size": 24, "chunks": 3, "order": [1, 0, 2]}
    uncond, cond = randn(1, 4, seed=4), randn(1, 4, seed=5)
    cfg = D.detect_swapped_halves(torch.cat([uncond, cond]), torch.cat([cond, uncond]))
    assert cfg.evidence["dim"] == 0 and "uncond, cond" in cfg.message
    repeated = torch.cat([shift, shift], dim=1)
    assert D.detect_swapped_halves(repeated, repeated + 1) is None


def test_detect_sign_flip_whole_and_partial():
    x = randn(100, seed=1).double()
    assert D.detect_sign_flip(x, -x).evidence["flipped_fraction"] == 1.0
    partial = x.clone()
    partial[50:] *= -1
    hint = D.detect_sign_flip(x, partial)
    assert hint.evidence["flipped_fraction"] == pytest.approx(0.5, abs=0.02) and "rotate-half" in hint.message
    assert D.detect_sign_flip(x, x * 2) is None


def test_constant_scale_names_a_power_and_the_two_concepts_pitfall():
    x = randn(1280, seed=2).double()
    hint = D.detect_constant_scale(x, x * 0.95**3)
    assert hint.evidence["power_form"] == "0.95^3" and "two concepts" in hint.message
    assert D.detect_constant_scale(x, x + 0.3) is None
    assert D.detect_constant_scale(x, -x) is None  # that is a sign flip
    assert D.detect_constant_scale(x, x * 0) is None  # that is zeroed
    noisy = x * 1.5 + 0.5 * randn(1280, seed=3).double()
    assert D.detect_constant_scale(x, noisy) is None


def test_detect_offset_rejects_noise():
    x = randn(500, seed=4).double()
    assert D.detect_offset(x, x - 0.25).evidence["c"] == pytest.approx(-0.25)
    assert D.detect_offset(x, x + 0.1 * randn(500, seed=5).double()) is None


def test_cast_detectors_tell_bf16_from_fp16():
    x = randn(4096, seed=6).double()
    bf16 = x.to(torch.bfloat16).double()
    fp16 = x.to(torch.float16).double()
    assert D.detect_bf16_cast(x, bf16).evidence["exact_fraction"] == 1.0
    assert D.detect_fp16_cast(x, bf16) is None
    assert D.detect_fp16_cast(x, fp16).id == "fp16-cast" and D.detect_bf16_cast(x, fp16) is None
    # the max_abs the issue quotes for unit-variance noise
    assert float((x - bf16).abs().max()) == pytest.approx(8e-3, rel=0.25)


def test_cast_detectors_see_a_computation_done_in_the_reduced_dtype():
    # B computed in bfloat16 from A's input: not A rounded, but every value of B lies on the bfloat16 grid
    w, v = randn(64, 64, seed=1), randn(8, 64, seed=2)
    a = (v @ w).double()
    b = (v.bfloat16() @ w.bfloat16()).double()
    hint = D.detect_bf16_cast(a, b)
    assert hint is not None and hint.evidence["grid_side"] == "b" and "grid" in hint.message
    assert D.detect_fp16_cast(a, b) is None  # bfloat16 values are also float16 values: the coarser grid wins
    half = (v.half() @ w.half()).double()
    assert D.detect_fp16_cast(a, half).evidence["grid_side"] == "b"


def _look_alikes():
    x = randn(4, 16, 32, seed=3)
    w = randn(32, 32, seed=4) / 6
    yield "gelu approximation", torch.nn.functional.gelu(x), torch.nn.functional.gelu(x, approximate="tanh")
    ln = torch.nn.functional.layer_norm
    yield "layernorm eps", ln(x, (32,), eps=1e-6), ln(x, (32,), eps=1e-12)
    yield "float noise", (x @ w) @ w, x @ (w @ w)
    yield "weights swapped", x @ w, x @ w.flip(0)
    yield "bf16-sized noise", x, x * (1 + 2**-9 * randn(4, 16, 32, seed=5))  # the old soft hint fired here


@pytest.mark.parametrize("case", list(_look_alikes()), ids=lambda c: c[0])
def test_cast_hints_need_direct_evidence(case):
    _, a, b = case
    ids = {h.id for h in diagnose(a, b)}
    assert not ids & {"bf16-cast", "fp16-cast"}, ids
    assert D.detect_bf16_cast(a.double().flatten(), b.double().flatten()) is None
    assert D.detect_fp16_cast(a.double().flatten(), b.double().flatten()) is None


def test_look_alikes_get_no_structural_hint():
    for name, a, b in _look_alikes():
        ids = {h.id for h in diagnose(a, b)}
        assert not ids, (name, ids)


def test_detect_timestep_rounding_needs_fractional_positions():
    t = torch.tensor([999.0, 979.5, 959.25, 500.0], dtype=torch.float64)
    hint = D.detect_timestep_rounding(t, torch.round(t))
    assert hint.evidence["count"] == 2 and hint.evidence["mode"] == "round"
    assert D.detect_timestep_rounding(t, t + 0.5) is None  # integers changed too
    assert D.detect_timestep_rounding(t, t + 3) is None
    assert D.detect_timestep_rounding(torch.round(t), t).evidence["rounded_side"] == "a"
    # look-alike: small values on one side, zeros on the other: rounding is not claimed (zeroed explains it)
    assert D.detect_timestep_rounding(torch.zeros(4), torch.full((4,), 1e-3)) is None
    assert D.detect_timestep_rounding(torch.full((4,), 0.3), torch.zeros(4)) is None


def test_strided_views_get_the_same_hints_as_contiguous_copies():
    base = randn(12, 10)
    a = base.T  # a strided view: scanned chunk by chunk, never copied whole
    b = a * 0.5
    b[3, 7] = float("nan")
    view_hints = diagnose(a, b)
    copy_hints = diagnose(a.contiguous(), b.contiguous())
    assert [(h.id, h.message) for h in view_hints] == [(h.id, h.message) for h in copy_hints]
    assert view_hints[0].evidence["first_index"] == [3, 7] and len(view_hints) > 1
    assert diagnose(a, torch.zeros_like(a))[0].id == "zeroed"


# ------------------------------------------------------------------------------------------ saturation


def test_a_clamp_on_one_side_is_saturation_not_rounding():
    # a research VAE clamps its video to [-1, 1], the port does not: the clamped values are the integers ±1,
    # which once read as "[timestep-rounding]"
    video = randn(4, 64, scale=1.5)
    for a, b, side in ((video, video.clamp(-1, 1), "B"), (video.clamp(-1, 1), video, "A")):
        hints = diagnose(a, b)
        assert [h.id for h in hints][:1] == ["saturation"], hints
        assert "timestep-rounding" not in {h.id for h in hints}
        assert hints[0].message.startswith(f"{side} = clamp(")
        assert hints[0].evidence["low"] == -1.0 and hints[0].evidence["high"] == 1.0


def test_saturation_does_not_fire_on_rounding_or_on_a_scale():
    t = 1 + 998 * torch.rand(200, generator=torch.Generator().manual_seed(3))
    assert first_id(t, torch.round(t)) == "timestep-rounding"
    x = randn(256)
    assert "saturation" not in {h.id for h in diagnose(x, 1.1 * x)}
    assert "saturation" not in {h.id for h in diagnose(x, x + 0.3)}
    assert diagnose(x, x.clone()) == []


def test_masked_names_the_elements_one_side_zeroes_and_only_those():
    # round 15 (voicebox-pytorch): the port masks the audio context in its pipeline, the research inside its
    # denoiser; triage said only "41.2% of elements outside tolerance"
    a = randn(2, 40, 16, seed=3)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[:, 10:27] = True
    b = a * (~mask)[..., None]
    hint = D.detect_masked(a, b)
    assert (
        hint is not None
        and hint.evidence["zero_side"] == "b"
        and hint.evidence["masked_elements"] == 2 * 17 * 16
    )
    assert first_id(a, b) == "masked"
    assert D.detect_masked(b, a).evidence["zero_side"] == "a"
    # must not fire: elsewhere the two differ too; a side all zero (that is `zeroed`); nothing zeroed
    other = b.clone()
    other[0, 0, 0] += 1
    assert D.detect_masked(a, other) is None
    assert D.detect_masked(a, torch.zeros_like(a)) is None
    assert D.detect_masked(a, a * 1.5) is None


def test_chunks_in_a_transposed_grid_order_are_said_as_tiled_against_interleaved():
    # round 29 (TimeGrad): the port tiled its conditioning with repeat where the research uses
    # repeat_interleave; the hint said "check the order of a chunked projection (shift/scale/gate) or of a
    # fused qkv". A chunk order that reads a grid transposed is now said as one.
    from paritykit.compare.diagnose import detect_swapped_halves

    a = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    hint = detect_swapped_halves(a, a[[0, 3, 1, 4, 2, 5]])
    assert hint is not None and hint.evidence["order"] == [0, 3, 1, 4, 2, 5]
    assert "read as a 2 x 3 grid" in hint.message and "repeat_interleave" in hint.message
    # must not fire: an order that is no grid read transposed keeps the plain words
    other = detect_swapped_halves(a, a[[1, 0, 2, 3, 5, 4]])
    assert other is not None and "grid" not in other.message


def test_a_scale_is_fitted_against_both_sides_not_only_the_difference():
    # round 38 (Protenix): "B ≈ 0.01845·A everywhere (… residual 0.05472 of the difference)" on outputs that
    # share no scale: B was small next to A, so any residual was small next to their difference
    from paritykit.compare.diagnose import detect_constant_scale

    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, generator=g)
    unrelated = 0.02 * a + 0.05 * torch.randn(4000, generator=g)  # must not fire: mostly not a's
    assert detect_constant_scale(a, unrelated) is None
    hint = detect_constant_scale(a, 0.5 * a + 1e-4 * torch.randn(4000, generator=g))
    assert hint is not None and abs(hint.evidence["k"] - 0.5) < 1e-3
