"""Outputs laid out differently on the two sides, parameterless modules of two streams, and masked divergences
read from every captured aligned pair."""

from __future__ import annotations

import pytest
import torch
from paritykit.bisection.entry import bisect
from paritykit.bisection.leaves import dim_orders, pair_layouts

from tests.bisect_pairs import joint_pair, two_stream_pair
from tests.test_align import aligned


def test_dim_orders_are_the_permutations_reaching_the_target_shape():
    assert dim_orders((2, 6, 4, 8), (2, 4, 6, 8)) == [(0, 2, 1, 3)]
    assert dim_orders((2, 3, 4), (2, 3, 4)) == []  # the identity is not a re-layout
    assert dim_orders((2, 3, 4), (2, 3, 5)) == []
    assert dim_orders((2, 3), (2, 3, 1)) == []
    # two equal dims: both orders reach the shape, and values decide between them
    assert sorted(dim_orders((3, 2, 2), (2, 3, 2))) == [(1, 0, 2), (2, 0, 1)]


def test_pair_layouts_reads_the_port_leaf_in_the_references_layout():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(2, 3, 5, 4, generator=g)  # [B, H, L, D]
    port = ref.transpose(1, 2).contiguous()  # [B, L, H, D]
    pairs, moved, orders = pair_layouts([("output", ref)], [("output", port)])
    assert pairs == [(0, 0)] and orders == {"output": (0, 2, 1, 3)}
    assert torch.equal(moved[0][1], ref)
    # equal dims: the order that brings the leaf closest to the reference's wins, not the first one found
    square = torch.randn(2, 4, 4, 3, generator=g)
    found = pair_layouts([("output", square)], [("output", square.permute(0, 3, 2, 1).contiguous())])
    assert found is not None and torch.equal(found[1][0][1], square)
    # must not fire: alike shapes pair as they are, and a shape no permutation reaches is not paired
    assert pair_layouts([("output", ref)], [("output", ref.clone())])[2] == {}
    assert pair_layouts([("output", ref)], [("output", torch.zeros(2, 3, 5, 5))]) is None


def test_a_norm_laid_out_differently_is_tested_and_named_with_its_fix():
    # reference q/k norms run on [B, H, L, D], diffusers' FluxAttention's on [B, L, H, D]: without pairing up
    # to the permutation the norm is untestable and the attention around it takes the blame
    reference, port, inputs = joint_pair("eps")
    report = bisect(reference, port, inputs)
    culprit = report.culprit
    assert (culprit.reference, culprit.port) == ("attn.img_norm.query_norm", "attn.norm_q")
    assert culprit.test == "replay" and "permuted (0, 2, 1, 3)" in culprit.note
    first = culprit.hints[0]
    assert first.verified and first.edit["kind"] == "attribute" and first.edit["parameters"]["value"] == 1e-6


def test_a_faithful_port_with_other_layouts_matches_inside_too():
    reference, port, inputs = joint_pair()
    report = bisect(reference, port, inputs)
    assert report.verdict == "match" and report.culprit is None
    tests = {t.port: t for t in report.tested}
    # no layout-permuted pair is left out of the comparison because of its layout
    assert all(t.status != "untestable" for t in tests.values())


def _streams(bug=None):
    reference, port, inputs = two_stream_pair(bug)
    return reference, port, inputs, aligned(reference, port, inputs)


def test_parameterless_norms_pair_inside_their_own_stream():
    # the reference runs the text stream first, the port the image stream: by order alone the text norm would
    # meet the image norm; what each reads tells them apart
    *_, alignment = _streams()
    assert alignment.port_of("txt_norm") == "norm2_context"
    assert alignment.port_of("img_norm") == "norm2"


def test_a_masked_stream_bug_is_named_in_its_stream():
    # only the image stream is compared at the output: the text stream's norm is found by its captured output
    reference, port, inputs, _ = _streams("context-eps")
    report = bisect(reference, port, inputs)
    assert report.verdict == "masked" and report.exit_code == 1
    assert (report.culprit.reference, report.culprit.port) == ("txt_norm", "norm2_context")
    assert not report.culprit.through_inputs


def test_a_difference_no_module_makes_on_its_own_is_masked_and_says_so():
    # the port's text-stream residual is scaled inline before the MLP: no aligned module fails on identical
    # inputs, yet the text MLP's captured output differs. The verdict is masked, naming where it shows and
    # claiming no cause there
    reference, port, inputs, _ = _streams()
    port.forward = _scaled_context_forward(port)
    report = bisect(reference, port, inputs)
    assert report.verdict == "masked"
    culprit = report.culprit
    assert culprit.through_inputs and culprit.port == "ff_context"
    assert not any(h.verified for h in culprit.hints)
    assert "passes on identical inputs" in culprit.note
    assert "an aligned module's captured outputs differ" in report.render()


def _scaled_context_forward(port):
    def forward(hidden_states, encoder_hidden_states):
        hidden_states = hidden_states + port.ff(port.norm2(hidden_states))
        normed = port.norm2_context(encoder_hidden_states) * 1.5
        return hidden_states, encoder_hidden_states + port.ff_context(normed)

    return forward


class _ChannelsFirst(torch.nn.Module):
    r"""A research block on ``[B, C, L]``: a 1x1 Conv1d projection after a channel mix (``C == L`` here, so
    both layouts have one shape)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.mix = torch.nn.Conv1d(width, width, 1)
        self.proj_out = torch.nn.Conv1d(width, width, 1)

    def forward(self, x):  # x: [B, C, L]
        return self.proj_out(torch.tanh(self.mix(x)))


class _ChannelsLast(torch.nn.Module):
    r"""Its port on ``[B, L, C]`` with Linear layers holding the same weights."""

    def __init__(self, reference: _ChannelsFirst, scale: float = 1.0):
        super().__init__()
        width = reference.mix.in_channels
        self.mix = torch.nn.Linear(width, width)
        self.to_out = torch.nn.Linear(width, width)
        with torch.no_grad():
            self.mix.weight.copy_(reference.mix.weight[..., 0] * scale)
            self.mix.bias.copy_(reference.mix.bias)
            self.to_out.weight.copy_(reference.proj_out.weight[..., 0])
            self.to_out.bias.copy_(reference.proj_out.bias)

    def forward(self, x):  # x: [B, C, L] in, as the reference's callers pass it
        return self.to_out(torch.tanh(self.mix(x.transpose(1, 2)))).transpose(1, 2)


def _channels_pair(scale: float = 1.0):
    torch.manual_seed(0)
    reference = _ChannelsFirst().eval()
    port = _ChannelsLast(reference, scale).eval()
    return reference, port, ((torch.randn(2, 16, 16),), {})


def test_a_same_shape_channels_last_port_is_compared_in_the_references_layout():
    # [B, C, L] against [B, L, C] with C == L: elementwise the two disagree although every module computes
    # the same; compared as laid out, the projection was named a culprit (replay fail) on a correct port
    reference, port, inputs = _channels_pair()
    report = bisect(reference, port, inputs, repair=False)
    assert report.verdict == "match" and report.culprit is None, report.render()
    tests = {t.port: t for t in report.tested}
    assert tests["to_out"].status == "pass"


def test_a_same_shape_layout_does_not_hide_the_real_culprit_upstream():
    # the channel mix scaled wrongly: the projection fed by it is not blamed; the mix is, on its own replay
    reference, port, inputs = _channels_pair(scale=1.5)
    report = bisect(reference, port, inputs, repair=False)
    assert report.verdict == "diverge"
    assert (report.culprit.reference, report.culprit.port) == ("mix", "mix"), report.render()
    assert all(t.status != "fail" for t in report.tested if t.port == "to_out")


def test_a_replay_fed_in_the_wrong_same_shape_layout_is_retried_in_the_other():
    # the projection's replay on the reference's [B, C, L] input: fed as it is, the Linear reads channels as
    # positions and fails; read with dims 1 and 2 exchanged it passes, and the note says so
    reference, port, inputs = _channels_pair()
    alignment = aligned(reference, port, inputs)
    report = bisect(reference, port, inputs, repair=False)
    tests = {t.port: t for t in report.tested}
    assert alignment.port_of("proj_out") == "to_out"
    assert tests["to_out"].test == "replay" and tests["to_out"].status == "pass"
    assert "another layout" in tests["to_out"].note and "(0, 2, 1)" in tests["to_out"].note


def test_pair_layouts_keeps_same_shape_leaves_as_laid_out_unless_another_layout_agrees():
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(2, 8, 8, generator=g)
    # agrees once dims 1 and 2 are exchanged: read in the reference's layout
    moved = [("output", ref.transpose(1, 2).contiguous())]
    assert pair_layouts([("output", ref)], moved, same_shape=True)[2] == {"output": (0, 2, 1)}
    # must not fire: a slightly different leaf stays as laid out, and so does an unrelated one; and never
    # without same_shape (where a transposed output is the difference, as when an edit is verified)
    assert pair_layouts([("output", ref)], [("output", ref * 1.01)], same_shape=True)[2] == {}
    unrelated = [("output", torch.randn(2, 8, 8, generator=g))]
    assert pair_layouts([("output", ref)], unrelated, same_shape=True)[2] == {}
    assert pair_layouts([("output", ref)], moved)[2] == {}


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(torch.tanh(self.a(x)))


class _RowsPermutedPort(torch.nn.Module):
    r"""A port whose output projection holds the reference's rows permuted (a conversion slip, OmniGen's
    proj_out in round 7), unpatchified as the reference does: the output comes out scrambled."""

    def __init__(self, reference: _TwoLayers, perm):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)
        self.a.load_state_dict(reference.a.state_dict())
        with torch.no_grad():
            self.out.weight.copy_(reference.proj.weight[perm])
            self.out.bias.copy_(reference.proj.bias[perm])

    def forward(self, x):
        return self.out(torch.tanh(self.a(x)))


def test_an_inline_culprit_says_the_pairs_it_could_not_compare():
    # the permuted projection is aligned with its outputs reordered and not compared; the inline line said
    # "the difference is made outside those calls" without saying a pair inside was never compared
    torch.manual_seed(0)
    reference = _TwoLayers().eval()
    for perm, named in ((torch.tensor([1, 0, 3, 2, 5, 4, 7, 6]), True), (torch.arange(8), False)):
        port = _RowsPermutedPort(reference, perm).eval()
        report = bisect(reference, port, ((torch.randn(3, 8),), {}), repair=False)
        text = report.render()
        if named:
            assert "outputs reordered by the weight conversion, not compared: proj" in text
            assert "(the pairs the note names were not compared)" in text
        else:  # must not fire: the same port without the permutation matches, nothing left uncompared
            assert report.verdict == "match" and "not compared" not in text


class _ChannelsLastShifted(_ChannelsLast):
    r"""The channels-last port with a shift added in its own forward code, between its two layers."""

    def forward(self, x):
        return self.to_out(torch.tanh(self.mix(x.transpose(1, 2))) + 0.1).transpose(1, 2)


def test_captured_values_of_a_same_shape_pair_are_measured_in_the_layout_its_replay_found():
    # the projection passes its replay once its inputs are read as [B, L, C]; its captured outputs differ
    # (the shift comes in before it): the reported numbers are those of the values read in that layout
    torch.manual_seed(0)
    reference = _ChannelsFirst().eval()
    port = _ChannelsLastShifted(reference).eval()
    x = torch.randn(2, 16, 16)
    report = bisect(reference, port, ((x,), {}), repair=False)
    with torch.no_grad():
        h = torch.tanh(reference.mix(x))
        ref_out = reference.proj_out(h)
        port_out = port.to_out(torch.tanh(port.mix(x.transpose(1, 2))) + 0.1)  # [B, L, C]
    first = report.first_output_divergence
    assert (first.reference, first.port) == ("proj_out", "to_out"), report.render()
    assert first.max_abs == pytest.approx(float((port_out.transpose(1, 2) - ref_out).abs().max()), rel=1e-5)
    # as laid out (elementwise [B, L, C] against [B, C, L]) the number is another one
    assert first.max_abs != pytest.approx(float((port_out - ref_out).abs().max()), rel=1e-3)


def test_the_repair_search_at_a_top_level_culprit_stops_at_its_clock_and_says_so(monkeypatch):
    # round 6 (LTX-2): the search at a top-level culprit, each edit a whole-port replay, ran 19.5 minutes;
    # it now stops at TOP_LEVEL_SECONDS unless --repair-budget is given (here the clock is set to 0 s)
    import paritykit.bisection.repair.culprit_sites as sites

    torch.manual_seed(0)
    reference = _TwoLayers().eval()
    port = _RowsPermutedPort(reference, torch.tensor([1, 0, 3, 2, 5, 4, 7, 6])).eval()
    x = torch.randn(3, 8)
    monkeypatch.setattr(sites, "TOP_LEVEL_SECONDS", 0.0)
    report = bisect(reference, port, ((x,), {}))
    assert report.culprit.reference == "" and "stopped after 0 s" in report.render()
    # must not fire: with a budget asked for, the edits are counted and the clock is not used
    report = bisect(reference, port, ((x,), {}), repair_budget=20)
    assert "stopped after" not in report.render() and "20 edits" in report.render()
