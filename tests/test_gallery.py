r"""The real-ports gallery (tests/gallery): every catalogue case, both weight variants, through
paritykit.bisect.

Asserted: the culprit (or a plain ``match`` for clean ports), no hint the ground truth contradicts, every
culprit of the multi-bug cases with ``--all``, and that ``weights map`` exposes each planted conversion slip.
The benchmark's percentages (benchmarks/diagnosis.py) are not asserted here.

The pairs import their PyPI packages at module level on purpose: a missing package is an install bug and must
fail, never skip. Cases paritykit gets wrong today are strict xfails naming the missing capability, so a fix
that lands turns them into failures to flip."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

# imported for their side effect of failing loudly when a gallery package is missing
from tests.gallery import clip, mha, rope, vae  # noqa: F401
from tests.gallery.base import VARIANTS
from tests.gallery.catalogue import ALL_CASES, BY_ID, CASES, HELD_OUT
from tests.gallery.run import Outcome, run_case

# (case, variant or None for both) -> why paritykit gets it wrong today
CULPRIT_XFAIL: dict[tuple[str, str | None], str] = {}
HINT_XFAIL: dict[tuple[str, str | None], str] = {}
ALL_XFAIL: dict[tuple[str, str | None], str] = {}


def _params(cases, xfails: dict[tuple[str, str | None], str]) -> list:
    params = []
    for case in cases:
        for variant in VARIANTS:
            reason = xfails.get((case.id, variant)) or xfails.get((case.id, None))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(case.id, variant, marks=marks, id=f"{case.id}-{variant}"))
    return params


@pytest.fixture(autouse=True)
def one_thread():
    r"""One torch thread: on a shared 2-core machine the tiny models run faster without thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def outcome(case_id: str, variant: str, catalogue: bool = True) -> Outcome:
    return run_case(BY_ID[case_id], variant, catalogue=catalogue)


@pytest.mark.parametrize("case_id, variant", _params(ALL_CASES, CULPRIT_XFAIL))
def test_culprit_is_named_or_clean_port_matches(case_id, variant):
    o = outcome(case_id, variant)
    if o.expected:
        assert o.culprit_ok, f"expected {o.expected[0]}, found {o.found[:1]} (verdict {o.verdict})"
    else:
        assert o.culprit_ok, f"clean or invisible: verdict {o.verdict}, culprits {o.found}"
        if BY_ID[case_id].clean:  # must not fire: a faithful port matches, inside as well as at the output
            assert o.verdict == "match" and not o.found, (
                f"clean port: verdict {o.verdict}, culprits {o.found}"
            )


@pytest.mark.parametrize("case_id, variant", _params(ALL_CASES, HINT_XFAIL))
def test_no_hint_contradicts_the_ground_truth(case_id, variant):
    o = outcome(case_id, variant)
    assert not o.false_hints, f"false hints {o.false_hints}; first hint: {o.first_hint}"


@pytest.mark.parametrize("case_id, variant", _params(HELD_OUT, {}))
def test_held_out_bug_gets_a_verified_true_fix_from_the_repair_search_alone(case_id, variant):
    r"""Bug classes planted after the repair search was written, with the catalogue's detectors off: the one
    hint that leads is a verified edit that states the planted fix, and nothing false is said."""
    o = outcome(case_id, variant, False)
    if not o.expected:
        assert o.verdict == "match", o.verdict
        return
    assert o.culprit_ok, f"expected {o.expected[0]}, found {o.found[:1]}"
    assert o.fix_verified and o.first_hint_true, o.first_hint
    assert not o.false_hints, o.false_hints


@pytest.mark.parametrize("case_id, variant", _params([c for c in CASES if c.bug is not None], {}))
def test_repair_search_alone_never_says_anything_false_on_the_named_split(case_id, variant):
    r"""The named split with the catalogue off: where the repair search has no verified edit it says
    "unknown", and an edit it does report is a true fix (never a numerically lucky one)."""
    o = outcome(case_id, variant, False)
    assert not o.false_hints, f"false hints {o.false_hints}; first hint: {o.first_hint}"


@pytest.mark.parametrize("case_id, variant", _params([c for c in CASES if len(c.culprits) > 1], ALL_XFAIL))
def test_all_names_every_culprit_in_order(case_id, variant):
    o = outcome(case_id, variant)
    assert o.all_ok, f"expected {o.expected}, found {o.found}"


@pytest.mark.parametrize("case_id, variant", _params([c for c in CASES if c.conversion], {}))
def test_weights_map_exposes_the_planted_conversion_slip(case_id, variant):
    o = outcome(case_id, variant)
    assert o.conversion_ok, (
        f"weights map maps the planted tensor as the faithful conversion does: {o.conversion}"
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_emitted_rules_agree_with_the_hand_written_mha_conversion(variant, tmp_path):
    import paritykit

    pair = mha.build(variant)
    cmap = paritykit.infer_conversion_map(pair.source_state, pair.target_state)
    if variant == "fresh":
        # fresh init: both LayerNorms hold ones and zeros, so which feeds which is a guess; emit must refuse
        assert cmap.ambiguous
        for a in cmap.ambiguous:
            t = pair.target_state[a.target]
            assert torch.equal(t, torch.full_like(t, t.flatten()[0].item())), a.target
        with pytest.raises(paritykit.ParityKitError, match="ambiguous"):
            paritykit.emit_rules(cmap, tmp_path / "refused.py")
        assert not (tmp_path / "refused.py").exists()
        cmap = paritykit.infer_conversion_map(pair.source_state, pair.target_state, allow_ambiguous=True)
    path = paritykit.emit_rules(cmap, tmp_path / "mha_rules.py")
    spec = importlib.util.spec_from_file_location("mha_rules", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    converted = module.convert(pair.source_state)
    expected = mha.hand_convert(pair.source_state)
    assert sorted(converted) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(converted[key], tensor), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_map_rebuilds_diffusers_own_vae_conversion(variant):
    import paritykit

    pair = vae.build(variant)
    cmap = paritykit.infer_conversion_map(pair.source_state, pair.target_state, allow_ambiguous=True)
    assert not cmap.unmapped_target
    if variant == "distinct":
        assert not cmap.ambiguous
    for a in cmap.ambiguous:  # fresh init: only constant tensors (norm ones, zero biases) may be guesses
        t = pair.target_state[a.target]
        assert torch.equal(t, torch.full_like(t, t.flatten()[0].item())), a.target
    converted = paritykit.apply_rules_to_state_dict(cmap, pair.source_state)
    assert sorted(converted) == sorted(pair.target_state)
    for key, tensor in pair.target_state.items():
        assert torch.equal(converted[key], tensor), key
