"""paritykit.compare: metrics agree with torch's own definitions, on real tensors and a real tiny UNet."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
from paritykit.base.errors import ParityKitError
from paritykit.base.report import to_json
from paritykit.compare.sets import (
    OutputComparison,
    SetComparison,
    assert_parity,
    compare_outputs,
    compare_tensor_sets,
)
from paritykit.compare.tensors import CHUNK, TensorComparison, compare_tensors
from paritykit.compare.tolerances import default_tolerances
from torch.testing._comparison import default_tolerances as torch_default_tolerances

from tests.conftest import REPO

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def assert_close_passes(a, b, **kw) -> bool:
    try:
        torch.testing.assert_close(a, b, check_dtype=False, **kw)
    except AssertionError:
        return False
    return True


# ------------------------------------------------------------------------------------------------ tolerances


@pytest.mark.parametrize("da", FLOATS + [torch.complex64, torch.int64, torch.bool])
@pytest.mark.parametrize("db", FLOATS + [torch.int32])
def test_default_tolerances_follow_torch_testing(da, db):
    assert default_tolerances(da, db) == torch_default_tolerances(da, db)


def test_default_tolerances_accept_names_and_are_exact_for_integers():
    assert default_tolerances("float16", "torch.float32") == default_tolerances(torch.float16, torch.float32)
    assert default_tolerances(torch.int64, torch.uint8) == (0.0, 0.0)
    rtol, _ = default_tolerances(torch.float8_e4m3fn, torch.float32)
    assert rtol == torch.finfo(torch.float8_e4m3fn).eps


# ------------------------------------------------------------------------------------- one pair: the verdict


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("noise", [0.0, 1e-8, 1e-6, 1e-4, 1e-2])
def test_mismatch_count_and_verdict_agree_with_torch(dtype, noise):
    a = randn(3, 40, 7, seed=1).to(dtype)
    b = (a.double() + noise * randn(3, 40, 7, seed=2)).to(dtype)
    result = compare_tensors(a, b)
    rtol, atol = torch_default_tolerances(a, b)
    expected = int((~torch.isclose(a.double(), b.double(), rtol=rtol, atol=atol)).sum())
    assert result.mismatches == expected
    assert result.mismatch_fraction == expected / a.numel()
    assert result.passed == assert_close_passes(a, b)
    assert (result.rtol, result.atol) == (rtol, atol)


def test_explicit_tolerances_are_used():
    a = randn(100)
    b = a + 5e-3
    assert not compare_tensors(a, b).passed
    loose = compare_tensors(a, b, atol=1e-2, rtol=0)
    assert loose.passed and (loose.atol, loose.rtol) == (1e-2, 0.0)
    assert compare_tensors(a, b, atol=1e-2).rtol == default_tolerances(a.dtype, b.dtype)[0]


def test_metrics_match_direct_float64_computation():
    a, b = randn(5, 33, seed=3), randn(5, 33, seed=4)
    r = compare_tensors(a, b)
    a64, b64 = a.double(), b.double()
    diff = (a64 - b64).abs()
    assert r.max_abs == pytest.approx(float(diff.max()), rel=1e-6)
    assert r.max_abs_index == tuple(int(i) for i in torch.unravel_index(diff.argmax(), a.shape))
    assert r.mean_abs == pytest.approx(float(diff.mean()), rel=1e-6)
    assert r.rmse == pytest.approx(float(diff.pow(2).mean().sqrt()), rel=1e-6)
    assert r.max_rel == pytest.approx(float((diff / b64.abs()).max()), rel=1e-6)
    cos = torch.nn.functional.cosine_similarity(a64.flatten(), b64.flatten(), dim=0)
    assert r.cosine == pytest.approx(float(cos), abs=1e-6)  # float32 arithmetic
    assert r.head_a == a.flatten()[:5].tolist() and r.head_b == b.flatten()[:5].tolist()


def test_chunked_walk_matches_one_shot_computation():
    n = 3 * CHUNK + 17
    a = randn(n, seed=5)
    b = a + 1e-3 * randn(n, seed=6)
    b[2 * CHUNK + 5] += 7.0  # the worst element sits in a late chunk
    r = compare_tensors(a, b)
    diff = (a.double() - b.double()).abs()
    assert r.max_abs_index == (2 * CHUNK + 5,)
    assert r.max_abs == pytest.approx(float(diff.max()), rel=1e-6)
    assert r.mean_abs == pytest.approx(float(diff.mean()), rel=1e-5)
    expected = int((~torch.isclose(a, b, rtol=1.3e-6, atol=1e-5)).sum())
    assert r.mismatches == expected
    cos = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0)
    assert r.cosine == pytest.approx(float(cos), abs=1e-7)


def test_equal_inputs_give_exact_metrics():
    a = randn(4, 4)
    r = compare_tensors(a, a.clone())
    assert r.passed and r.status == "pass" and r.exit_code == 0
    assert (r.max_abs, r.mean_abs, r.mismatches, r.cosine) == (0.0, 0.0, 0, 1.0)
    assert r.hints == []


def test_non_contiguous_inputs_give_the_same_result():
    base_a, base_b = randn(64, 48, seed=7), randn(64, 48, seed=8)
    view = compare_tensors(base_a.t(), base_b.t())
    copy = compare_tensors(base_a.t().contiguous(), base_b.t().contiguous())
    assert view.to_dict() == copy.to_dict()


def test_dtype_difference_alone_is_a_pass():
    a = randn(8, 8).half()
    r = compare_tensors(a, a.float())
    assert r.passed and (r.dtype_a, r.dtype_b) == ("float16", "float32")


def test_integers_compare_exactly_even_beyond_float32_precision():
    a = torch.tensor([2**40, 3, 5], dtype=torch.int64)
    b = a.clone()
    b[0] += 1  # invisible in float32 arithmetic
    r = compare_tensors(a, b)
    assert not r.passed and r.mismatches == 1 and r.max_abs == 1.0 and (r.rtol, r.atol) == (0.0, 0.0)
    assert compare_tensors(a, a.clone()).passed
    flags = torch.tensor([True, False, True])
    assert compare_tensors(flags, ~flags).mismatches == 3


def test_complex_tensors_use_complex_distance():
    a = torch.complex(randn(50, seed=1), randn(50, seed=2))
    b = a * torch.exp(torch.tensor(1j * 1e-3, dtype=torch.complex64))
    r = compare_tensors(a, b)
    diff = (a.to(torch.complex128) - b.to(torch.complex128)).abs()
    assert r.max_abs == pytest.approx(float(diff.max()), rel=1e-5)
    assert r.mismatches == int((~torch.isclose(a, b)).sum())


def test_scalars_and_empty_tensors():
    assert compare_tensors(torch.tensor(1.0), torch.tensor(1.0)).passed
    r = compare_tensors(torch.tensor(1.0), torch.tensor(2.0))
    assert not r.passed and r.max_abs_index == () and r.max_abs == 1.0
    empty = compare_tensors(torch.empty(0, 3), torch.empty(0, 3))
    assert empty.passed and empty.mismatch_fraction == 0.0


# --------------------------------------------------------------------------------------------- NaN and Inf


def test_nan_at_the_same_positions_agrees_unless_equal_nan_is_off():
    a = randn(10)
    a[3] = float("nan")
    b = a.clone()
    r = compare_tensors(a, b)
    assert r.passed and r.nonfinite.nan_a == r.nonfinite.nan_b == 1 and r.nonfinite.positions_agree
    assert r.max_abs == 0.0 and math.isfinite(r.cosine)
    strict = compare_tensors(a, b, equal_nan=False)
    assert not strict.passed and strict.mismatches == 1
    assert strict.passed == assert_close_passes(a, b)


def test_one_sided_nan_fails_with_its_first_position_and_a_hint():
    a = randn(4, 6)
    b = a.clone()
    b[2, 1] = float("nan")
    b[3, 0] = float("inf")
    r = compare_tensors(a, b)
    assert r.status == "fail" and r.mismatches == 2
    assert r.nonfinite.first_disagreement == (2, 1) and r.nonfinite.disagreements == 2
    assert (r.nonfinite.nan_b, r.nonfinite.inf_b, r.nonfinite.nan_a) == (1, 1, 0)
    assert r.max_abs == 0.0  # metrics cover positions finite on both sides
    assert r.hints[0].id == "nonfinite" and r.hints[0].evidence["first_index"] == [2, 1]


def test_infinities_agree_only_with_the_same_sign():
    a = torch.tensor([1.0, float("inf"), -float("inf")])
    assert compare_tensors(a, a.clone()).passed
    flipped = torch.tensor([1.0, float("inf"), float("inf")])
    r = compare_tensors(a, flipped)
    assert not r.passed and r.nonfinite.first_disagreement == (2,)


def test_huge_finite_values_do_not_overflow_the_sums():
    a = torch.full((1000,), 3e30)
    r = compare_tensors(a, a * (1 + 1e-3))
    assert math.isfinite(r.rmse) and r.cosine == pytest.approx(1.0, abs=1e-9)
    assert r.mismatches == 1000 and r.nonfinite.disagreements == 0


# ------------------------------------------------------------------------------------------ shapes and errors


def test_shape_mismatch_is_a_status_with_transpose_hint():
    a = randn(2, 5, 3)
    r = compare_tensors(a, a.transpose(1, 2))
    assert r.status == "shape_mismatch" and r.exit_code == 1 and r.max_abs is None
    assert r.hints and r.hints[0].id == "transpose"


def test_bad_inputs_raise_one_line_errors():
    with pytest.raises(ParityKitError, match="tolerances"):
        compare_tensors(randn(3), randn(3), atol=-1)
    with pytest.raises(ParityKitError, match="oracle shape"):
        compare_tensors(randn(3), randn(3), oracle=randn(4).double())
    with pytest.raises(ParityKitError, match="cannot be read as a tensor"):
        compare_tensors(object(), randn(3))


# -------------------------------------------------------------------------------------------- fp64 oracle


def _oracle_case(noise_a, noise_b, n=4096, dtype=torch.float32):
    oracle = randn(n, seed=11, dtype=torch.float64)
    a = (oracle + noise_a * randn(n, seed=12)).to(dtype)
    b = (oracle + noise_b * randn(n, seed=13)).to(dtype)
    return a, b, oracle


@pytest.mark.parametrize("noise_b", [5e-4, 1.5e-3, 2.5e-3, 5e-3])
def test_oracle_rule_matches_dynamo_same(noise_b):
    from torch._dynamo.utils import same

    a, b, oracle = _oracle_case(1e-3, noise_b)
    r = compare_tensors(a, b, oracle=oracle)
    assert r.mismatches > 0  # outside plain tolerance in every case
    rmse_a = float((a.double() - oracle).pow(2).mean().sqrt())
    rmse_b = float((b.double() - oracle).pow(2).mean().sqrt())
    assert r.oracle.rmse_a == pytest.approx(rmse_a) and r.oracle.rmse_b == pytest.approx(rmse_b)
    assert r.oracle.multiplier == 2.0
    assert r.passed == same(a, b, fp64_ref=oracle, tol=1e-4)
    assert r.passed == (rmse_b <= 2 * rmse_a + 1e-5)
    assert r.to_dict()["passed_by"] == ("oracle" if r.passed else None)


def test_oracle_multiplier_is_three_for_half_precision_ports():
    a, b, oracle = _oracle_case(1e-3, 2.5e-3, dtype=torch.float32)
    assert not compare_tensors(a, b, oracle=oracle).passed
    r = compare_tensors(a, b.to(torch.bfloat16).float(), oracle=oracle)
    assert r.oracle.multiplier == 2.0
    half = compare_tensors(a.half(), b.half(), oracle=oracle)
    assert half.oracle.multiplier == 3.0


def test_oracle_never_excuses_a_one_sided_nan():
    a, b, oracle = _oracle_case(1e-3, 1e-3)
    b[0] = float("nan")
    assert not compare_tensors(a, b, oracle=oracle).passed


# -------------------------------------------------------------------------------------- the two faces


def test_to_dict_is_strict_json_and_mirrors_the_fields():
    a = randn(3, 4)
    b = a * 0.5
    b[0, 0] = float("nan")
    r = compare_tensors(a, b, name="x")
    payload = json.loads(to_json(r.to_dict()))
    for key in ("name", "status", "max_abs", "mean_abs", "cosine", "mismatch_fraction", "dtype_a", "dtype_b"):
        assert payload[key] == getattr(r, key)
    assert payload["hints"][0]["id"] == r.hints[0].id and payload["hints"][0]["message"] == r.hints[0].message
    assert payload["nan_inf"]["first_disagreement"] == [0, 0]


def test_render_and_table_row_read_the_same_numbers():
    from paritykit.base.report import format_number

    a = randn(6, 7)
    r = compare_tensors(a, a + 0.25, name="latents")
    text = r.render()
    assert "latents: FAIL" in text and f"{r.mismatches} / {r.numel}" in text
    assert format_number(r.max_abs) in text and str(r.max_abs_index) in text
    assert "[offset]" in text
    row = r.table_row()
    assert row[:4] == ["latents", "FAIL", format_number(r.max_abs), format_number(r.mean_abs)]


# --------------------------------------------------------------------------------------- nested outputs


def tiny_unet():
    from tests._pipelines import make_tiny_unet

    return make_tiny_unet(sample_size=8, attention=False)


def test_compare_outputs_on_a_real_unet_base_output():
    unet = tiny_unet()
    x = randn(1, 3, 8, 8)
    with torch.no_grad():
        same_a, same_b = unet(x, 10), unet(x.clone(), 10)
        other = unet(x, 11)
    ok = compare_outputs(same_a, same_b)
    assert isinstance(ok, OutputComparison) and ok.passed and [p.name for p in ok.pairs] == ["sample"]
    bad = compare_outputs(same_a, other)
    assert not bad.passed and bad.first_divergence == "sample" and bad.exit_code == 1
    assert compare_outputs(same_a, same_b.to_tuple()).only_a == ["sample"]


@dataclasses.dataclass
class StepOut:
    latents: torch.Tensor
    extras: dict


Pair = namedtuple("Pair", ["cond", "uncond"])


def test_compare_outputs_matches_nested_structures_by_path():
    t = randn(2, 3)
    a = StepOut(latents=t, extras={"pair": Pair(t, t * 2), "steps": [1, 2.5], "mode": "ddim", "only_a": t})
    b = StepOut(
        latents=t.clone(), extras={"pair": Pair(t, t * 3), "steps": [1, 2.5], "mode": "euler", "new": 1}
    )
    r = compare_outputs(a, b)
    names = [p.name for p in r.pairs]
    assert names == [
        "latents",
        "extras.pair.cond",
        "extras.pair.uncond",
        "extras.steps[0]",
        "extras.steps[1]",
    ]
    assert r.first_divergence == "extras.pair.uncond"
    assert r.pair("extras.pair.uncond").hints[0].id == "constant-scale"
    assert r.only_a == ["extras.only_a"] and r.only_b == ["extras.new"]
    assert r.value_diffs == [{"name": "extras.mode", "a": "'ddim'", "b": "'euler'"}]
    assert compare_outputs([t, (t,)], [t, (t,)]).passed
    shorter = compare_outputs([t, t], [t])
    assert shorter.only_a == ["[1]"]
    typed = compare_outputs({"x": t}, {"x": "tensor"})
    assert not typed.passed and typed.value_diffs[0]["name"] == "x"


def test_assert_parity_raises_a_readable_report():
    t = randn(4, 4)
    assert isinstance(assert_parity(t, t.clone()), TensorComparison)
    with pytest.raises(AssertionError) as info:
        assert_parity(t, -t)
    message = str(info.value)
    assert message.count("\n") >= 5 and "mismatched" in message and "[sign-flip]" in message
    with pytest.raises(AssertionError, match="first divergence: b"):
        assert_parity({"a": t, "b": t}, {"a": t, "b": t + 1})
    assert_parity({"a": t}, {"a": t + 1e-3}, atol=1e-2)


# ---------------------------------------------------------------------------------------- sets of tensors


def test_sets_pair_by_name_in_a_order_with_one_sided_names():
    t = randn(3, 3)
    a = {"step_0": t, "step_1": t, "step_2": t, "gone": t}
    b = {"step_2": t + 1, "step_0": t, "step_1": t * 2, "new": t}
    r = compare_tensor_sets(a, b)
    assert isinstance(r, SetComparison)
    assert [p.name for p in r.pairs] == ["step_0", "step_1", "step_2"]
    assert r.first_divergence == "step_1"  # first failing in A's (execution) order, not the worst
    assert (r.only_a, r.only_b, r.exit_code) == (["gone"], ["new"], 1)
    assert r.counts() == {
        "pairs": 3,
        "pass": 1,
        "fail": 2,
        "shape_mismatch": 0,
        "only_a": 1,
        "only_b": 1,
        "value_diffs": 0,
    }


def test_sets_apply_map_rules_to_a_and_only_filters():
    t = randn(2, 2)
    a = {"model.diffusion_model.in.weight": t, "model.diffusion_model.out.weight": t}
    b = {"unet.in.weight": t, "unet.out.weight": t + 1}
    r = compare_tensor_sets(a, b, rules=[(r"^model\.diffusion_model\.", "unet.")])
    assert [p.name for p in r.pairs] == ["unet.in.weight", "unet.out.weight"] and not r.only_a
    assert r.pairs[0].name_a == "model.diffusion_model.in.weight"
    only = compare_tensor_sets(a, b, rules=[(r"^model\.diffusion_model\.", "unet.")], only="*in*")
    assert [p.name for p in only.pairs] == ["unet.in.weight"] and only.passed
    with pytest.raises(ParityKitError, match="--only"):
        compare_tensor_sets(a, b, only="nothing*")
    with pytest.raises(ParityKitError, match="both"):
        compare_tensor_sets(a, b, rules=[(".*", "same")])


def test_single_tensors_pair_whatever_their_names():
    t = randn(3)
    r = compare_tensor_sets({"ours": t}, {"theirs": t + 1})
    assert [p.name for p in r.pairs] == ["ours"] and r.pairs[0].name_b == "theirs" and not r.only_b


def test_broadcast_tiles_a_repeated_batch_dimension():
    emb = randn(1, 320)
    a = {"time_emb": emb, "timestep": torch.tensor([999.0]), "x": randn(3, 2)}
    b = {"time_emb": emb.repeat(2, 1), "timestep": torch.tensor([999.0, 999.0]), "x": randn(2, 2)}
    plain = compare_tensor_sets(a, b)
    assert [p.status for p in plain.pairs] == ["shape_mismatch"] * 3
    assert "--broadcast" in plain.pairs[0].note and plain.pairs[2].note is None
    r = compare_tensor_sets(a, b, broadcast=True)
    assert [p.status for p in r.pairs] == ["pass", "pass", "shape_mismatch"]
    assert r.pairs[0].shape_a == (2, 320) and "repeated 2×" in r.pairs[0].note
    unbatched = compare_tensor_sets({"e": randn(320)}, {"e": randn(320).repeat(4, 1)}, broadcast=True)
    assert unbatched.pairs[0].shape_a == (4, 320)


def test_set_report_json_schema_and_table():
    t = randn(2, 8)
    r = compare_tensor_sets({"a": t, "b": t, "c": t}, {"a": t, "b": t * 0.95, "d": t})
    payload = json.loads(to_json(r.to_dict()))
    assert payload["schema_version"] == 1 and payload["first_divergence"] == "b"
    assert payload["only_a"] == ["c"] and payload["only_b"] == ["d"]
    assert "torch" in payload["environment"]
    for pair in payload["pairs"]:
        assert {
            "name",
            "status",
            "max_abs",
            "mean_abs",
            "cosine",
            "mismatch_fraction",
            "dtype_a",
            "dtype_b",
            "hints",
        } <= set(pair)
        assert pair["status"] in ("pass", "fail", "shape_mismatch")
        assert all({"id", "message"} <= set(h) for h in pair["hints"])
    text = r.render()
    assert text.splitlines()[0].startswith("verdict: ")  # the answer first, then the table
    assert text.splitlines()[1].split() == [
        "name",
        "status",
        "max_abs",
        "mean_abs",
        "cosine",
        "mismatch",
        "head",
        "A",
        "head",
        "B",
    ]
    assert "first divergence: b" in text and "[constant-scale]" in text and "only in A (1): c" in text
    many = compare_tensor_sets({f"t{i}": t for i in range(50)}, {f"t{i}": t for i in range(50)})
    assert "… 40 more" in many.render(limit=10) and "all tensors match" in many.render()


# ------------------------------------------------------------------------------------------ memory bound

_MEMORY_PROBE = """
import resource, sys, torch
from paritykit.compare import compare_tensors
n = 32 * 2**20  # 128 MiB of float32 per tensor
a = torch.randn(n); b = a.clone(); b[::7] += 1e-3
warm = 4 * 2**18  # a few chunks: fault in the same kernels' code pages before measuring
compare_tensors(a[:warm], b[:warm], diagnose=sys.argv[1] == "1")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
r = compare_tensors(a, b, diagnose=sys.argv[1] == "1")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / (4 * n), r.status)
"""


@pytest.mark.parametrize(("diagnose", "bound"), [(False, 0.1), (True, 0.35)])
def test_comparison_allocates_no_full_size_buffer(diagnose, bound):
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(int(diagnose))],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO / "helpers"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"},
    )
    assert out.returncode == 0, out.stderr
    extra_buffers, status = out.stdout.split()
    assert status == "fail" and float(extra_buffers) < bound, extra_buffers


def test_a_scale_or_an_offset_is_never_read_from_one_value():
    # one timestep 750 against 0.75: any factor and any offset relate two numbers, so neither is a finding
    from paritykit.compare.diagnose import detect_constant_scale, detect_offset

    one, other = torch.tensor([750.0]), torch.tensor([0.75])
    assert detect_constant_scale(one, other) is None and detect_offset(one, other) is None
    many = torch.linspace(1, 2, 16)
    assert detect_constant_scale(many, 3 * many).evidence["k"] == pytest.approx(3)
    assert detect_offset(many, many + 1).evidence["c"] == pytest.approx(1)
