"""paritykit.bisection.value_relations: relations derived from the two tensors at a located place, each said
in the tensor's own axes, and none where the values do not bear it out."""

from __future__ import annotations

import pytest
import torch
from paritykit.bisection.entry import bisect
from paritykit.bisection.value_relations import (
    index_map,
    missing_term,
    rearrangement,
    relate,
    scale,
    sequence_rows,
)
from torch import nn

from tests.relation_pairs import CASES, CLEAN

STATED = ("  fix (verified):", "  relation:", "  hint 1:")


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ rearrangement


def test_half_split_against_interleaved_pairs_is_a_sub_axis_exchange():
    x = randn(1, 16, 8)
    interleaved = x.view(1, 16, 2, 4).transpose(-1, -2).reshape(1, 16, 8)
    relation = rearrangement(x, interleaved)
    assert relation is not None and relation.residual == 0.0
    assert "axis 2 (8) is read as (2, 4) in the reference and (4, 2) in the port" in relation.words
    assert "pairs interleaved on one side, halves on the other" in relation.words
    assert torch.equal(relation.undo(interleaved, {}), x)


def test_a_rotary_table_with_repeated_values_still_reads():
    # cos/sin tables repeat each frequency: no unique index map, the sub-axis reading is checked on values
    angles = torch.arange(6.0)[:, None] * 10000 ** (-torch.arange(0, 8, 2) / 8)
    halves, pairs = torch.cat([angles, angles], -1).cos(), angles.repeat_interleave(2, -1).cos()
    relation = rearrangement(halves, pairs)
    assert "axis 1 (8) is read as (2, 4) in the reference and (4, 2) in the port" in relation.words


def test_a_patch_flattened_channels_last_names_the_exchanged_sub_axes():
    patches = randn(1, 4, 3, 2, 2)  # (batch, tokens, channels, p, p)
    channels_first = patches.reshape(1, 4, 12)
    channels_last = patches.permute(0, 1, 3, 4, 2).reshape(1, 4, 12)
    relation = rearrangement(channels_first, channels_last, axes=("batch", "tokens", "features"))
    assert "features (12) is read as (3, 4) in the reference and (4, 3) in the port" in relation.words


def test_an_unpatchify_reading_features_channels_first_is_a_block_read_in_another_order():
    tokens = randn(1, 2, 2, 12)  # (batch, rows, cols, p·p·C) as a DiT's final linear gives them
    ref = tokens.reshape(1, 2, 2, 2, 2, 3).permute(0, 5, 1, 3, 2, 4).reshape(1, 3, 4, 4)
    port = tokens.reshape(1, 2, 2, 3, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(1, 3, 4, 4)
    relation = rearrangement(ref, port)
    assert (
        "within each block of 12 values spanning axis 1, axis 2, axis 3 the order differs" in relation.words
    )
    assert "(2, 2, 3) against (3, 2, 2)" in relation.words
    assert torch.equal(relation.undo(port, {}), ref)


def test_rows_reordered_in_float_noise_still_read_as_a_reordered_axis():
    x = randn(1, 16, 8)
    rotated = torch.cat([x[:, 4:], x[:, :4]], 1) + 1e-7 * randn(1, 16, 8, seed=9)
    relation = rearrangement(x, rotated)
    assert "axis 1 (16) reordered: entries 0–11 ← 4–15, 12–15 ← 0–3" in relation.words
    assert "reversed" in rearrangement(x, x.flip(1)).words


def test_heads_in_another_order_and_blocks_sorted_as_text():
    x = randn(1, 16, 8)
    heads = x.view(1, 16, 2, 4).flip(2).reshape(1, 16, 8)
    assert "axis 2 (8) reordered: entries 0–3 ← 4–7, 4–7 ← 0–3" in rearrangement(x, heads).words
    rows = randn(12, 5)
    order = sorted(range(12), key=str)
    words = rearrangement(rows, rows[order]).words
    assert "axis 0 (12) reordered" in words and "sorted as text" in words


def test_rearrangement_must_not_fire_without_exact_copies():
    x = randn(4, 8)
    assert rearrangement(x, x.clone()) is None  # the same places
    assert rearrangement(x, x.flip(1) + 1e-3) is None  # values moved, then changed
    assert rearrangement(x, randn(4, 8, seed=1)) is None
    tied = torch.zeros(4, 8)
    assert index_map(tied, tied.flip(0)) is None  # repeated values: no unique map to state


# ------------------------------------------------------------------------------------------ sequence rows


def test_a_token_on_one_side_only_and_concatenation_order():
    image = randn(1, 16, 8)
    with_token = torch.cat([randn(1, 1, 8, seed=2), image], dim=1)
    relation = sequence_rows(image, with_token)
    assert relation.words.startswith("along axis 1: port rows 0 are not in the reference")
    assert "port rows 1–16 are reference rows 0–15" in relation.words
    assert relation.evidence["extra"] == [0]
    text = randn(1, 4, 8, seed=3)
    swapped = sequence_rows(torch.cat([text, image], 1), torch.cat([image, text], 1))
    assert "port rows 0–15 are reference rows 4–19, 16–19 are reference rows 0–3" in swapped.words
    dropped = sequence_rows(image, image[:, 1:])
    assert "reference rows 0 are not in the port (dropped)" in dropped.words


def test_sequence_rows_must_not_fire_when_rows_were_recomputed():
    x = randn(1, 16, 8)
    assert sequence_rows(x, x.clone()) is None
    assert sequence_rows(x, torch.cat([randn(1, 1, 8), x * 1.01], 1)) is None  # every row changed


# ------------------------------------------------------------------------------------------ scale and terms


@pytest.mark.parametrize(("factor", "label"), [(1000.0, "1000"), (0.001, "1/1000"), (8**-0.5, "1/√8")])
def test_a_scale_snaps_to_its_constant(factor, label):
    x = randn(4, 8)
    relation = scale(x, x * factor)
    assert relation is not None and relation.words == f"port = {label} × reference"


def test_scale_must_not_fire_on_an_arbitrary_factor_or_noise():
    x = randn(4, 8)
    assert scale(x, x * 1.2345) is None
    assert scale(x, x + 1e-7 * randn(4, 8, seed=1)) is None
    assert scale(x, 1000 * x + 0.1 * randn(4, 8, seed=1)) is None


def test_a_missing_or_extra_term_is_fitted_over_the_captured_tensors():
    x, residual, gate = randn(2, 5, 8), randn(2, 5, 8, seed=1), randn(2, 1, 8, seed=2)
    terms = {"hidden_states": residual, "gate": gate}
    added = missing_term(x, x + residual, terms)
    assert added.words.startswith("port = reference + hidden_states")
    halved = missing_term(x, x - 0.5 * residual, terms)
    assert halved.words.startswith("port = reference − 1/2·hidden_states")
    # a broadcast term (one value per channel) is a term too
    assert "gate" in missing_term(x, x + gate, terms).words


def test_missing_term_must_not_fire_on_a_term_that_is_not_there():
    x, residual = randn(2, 5, 8), randn(2, 5, 8, seed=1)
    assert missing_term(x, x + 0.37 * residual, {"hidden_states": residual}) is None  # no simple constant
    assert missing_term(x, x + randn(2, 5, 8, seed=4), {"hidden_states": residual}) is None
    assert missing_term(x, x.clone(), {"hidden_states": residual}) is None


def test_relate_on_equal_or_float_noise_tensors_says_nothing():
    x = randn(3, 16, 8)
    assert relate(x, x.clone()) == []
    assert relate(x, x + 1e-7 * randn(3, 16, 8, seed=5), {"x": x}) == []
    assert relate(x, x.double().float()) == []


# ------------------------------------------------------------------------------------------ in a bisect


class Block(nn.Module):
    def __init__(self, residual_twice: bool = False):
        super().__init__()
        self.norm, self.lin, self.twice = nn.LayerNorm(8), nn.Linear(8, 8), residual_twice

    def forward(self, x):
        out = x + self.lin(self.norm(x))
        return out + x if self.twice else out


class Net(nn.Module):
    def __init__(self, residual_twice: bool = False):
        super().__init__()
        self.inp, self.block, self.outp = nn.Linear(8, 8), Block(residual_twice), nn.Linear(8, 8)

    def forward(self, x):
        return self.outp(self.block(self.inp(x)))


def test_bisect_states_the_relation_at_the_culprit_and_none_on_a_faithful_port():
    torch.manual_seed(0)
    reference = Net().eval()
    port = Net(residual_twice=True).eval()
    port.load_state_dict(reference.state_dict())
    inputs = ((randn(2, 5, 8),), {})
    report = bisect(reference, port, inputs)
    assert report.culprit.reference == "block"
    assert [r.kind for r in report.culprit.relations] == ["term"]
    assert "relation: port = reference + x: a term the port adds" in report.render()
    assert report.to_dict()["culprit"]["relations"][0]["evidence"]["terms"] == ["x"]
    faithful = Net().eval()
    faithful.load_state_dict(reference.state_dict())
    clean = bisect(reference, faithful, inputs)
    assert clean.verdict == "match" and clean.culprit is None and "relation:" not in clean.render()


# ------------------------------------------------------------------------------------------ the split


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_relation_pair_gets_its_true_cause_first_and_verified(name):
    # the benchmark split (benchmarks/relations.py): the first stated cause is a true one, verified by replay
    reference, port, inputs, culprit, causes = CASES[name]()
    report = bisect(reference, port, inputs)
    assert report.culprit is not None and report.culprit.port == culprit, report.render()
    stated = [line for line in report.render().splitlines() if line.startswith(STATED)]
    assert any(cause in stated[0] for cause in causes), stated
    assert stated[0].startswith("  fix (verified):") or "(verified by replay" in stated[0], stated[0]
    for relation in report.culprit.relations:  # every relation stated there is a true one
        assert any(cause in relation.words for cause in causes), relation.words


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_correct_ports_of_the_split_get_no_relation(name):
    reference, port, inputs, _, _ = CLEAN[name]()
    report = bisect(reference, port, inputs)
    assert report.verdict == "match" and report.culprit is None and "relation:" not in report.render()


# ------------------------------------------------------------------------------------------ transplant


class RMSNorm(nn.Module):
    """Research RMSNorm (Zhang & Sennrich 2019): x / rms(x) · weight, no centring."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * randn(dim, seed=11))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class CentredNorm(RMSNorm):
    """The port's norm centres first: a LayerNorm without bias where the research has an RMSNorm."""

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class NormNet(nn.Module):
    def __init__(self, norm: type = RMSNorm):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(8, 8), norm(), nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.norm(self.inp(x)))


def test_a_module_whose_code_differs_is_transplanted_and_its_first_differing_op_named():
    torch.manual_seed(0)
    reference = NormNet().eval()
    port = NormNet(CentredNorm).eval()
    port.load_state_dict(reference.state_dict())
    report = bisect(reference, port, ((randn(2, 3, 8),), {}))
    first = report.culprit.hints[0]
    assert first.id == "transplant" and first.verified
    assert (
        "a copy of the reference's RMSNorm (norm) in place of the port's CentredNorm (norm)" in first.message
    )
    assert "the first port op whose result the reference never computes" in first.message
    assert "Tensor.mean" in first.message
    # a faithful port, and a culprit a setting explains, get no transplant
    same = NormNet().eval()
    same.load_state_dict(reference.state_dict())
    assert bisect(reference, same, ((randn(2, 3, 8),), {})).culprit is None
    torch.manual_seed(0)
    eps_ref = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-6), nn.Linear(8, 8)).eval()
    eps_port = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-2), nn.Linear(8, 8)).eval()
    eps_port.load_state_dict(eps_ref.state_dict())
    hints = bisect(eps_ref, eps_port, ((0.05 * randn(2, 3, 8),), {})).culprit.hints
    assert all(h.id != "transplant" for h in hints)


def test_one_dimensional_and_scalar_tensors_are_handled():
    a, b = torch.tensor([0.1785, 0.5487]), torch.tensor([0.4774, 0.4744])
    assert relate(a, b) == []
    assert "reordered" in rearrangement(a, a.flip(0)).words
    assert relate(torch.tensor(1.0), torch.tensor(2.0)) == []


# ------------------------------------------------------------------------------------------ pointwise maps


@pytest.mark.parametrize(
    ("name", "f"),
    [
        ("tanh", torch.tanh),
        ("sigmoid", torch.sigmoid),
        ("SiLU", torch.nn.functional.silu),
        ("exp", torch.exp),
    ],
)
def test_a_function_one_side_applies_once_more_is_named(name, f):
    x = randn(4, 16)
    (relation,) = relate(x, f(x))
    assert relation.words.startswith(f"port = {name}(reference)")
    (relation,) = relate(f(x), x)
    assert relation.words.startswith(f"reference = {name}(port)")
    assert torch.allclose(relation.undo(x, {}), f(x))  # the reference's side applied to the port's values


def test_pointwise_maps_must_not_fire_on_look_alikes():
    x = randn(4, 16)
    assert relate(x, 1.3 * x + 0.1) == []
    assert relate(x, torch.nn.functional.gelu(x) + 1e-3 * randn(4, 16, seed=3)) == []
    t = 1000 * torch.rand(50, generator=torch.Generator().manual_seed(2))
    assert [r.words.split(":")[0] for r in relate(t, t.round())] == ["port = round(reference)"]


def test_the_first_differing_pair_gets_the_relation_of_its_captured_outputs():
    reference, port, inputs, _, _ = CASES["joint-concat-order"]()
    text = bisect(reference, port, inputs).render()
    assert "first aligned module whose outputs differ: block.attn <-> block.attn" in text
    assert (
        "relation of the captured outputs there: the port holds the reference's values in other places:"
        in text
    )


def test_long_rows_are_matched_by_projection_then_checked_in_full():
    x = randn(1, 256, 384)
    rotated = torch.cat([x[:, 64:], x[:, :64]], 1)
    assert "axis 1 (256) reordered: entries 0–191 ← 64–255, 192–255 ← 0–63" in relate(x, rotated)[0].words
    assert [r.words for r in relate(x, x * 2**-0.5)] == ["port = 1/√2 × reference"]
    near = rotated.clone()
    near[0, 5, 7] += 1e-2  # one value off in one row: not a reordering
    assert all(r.kind != "rearrangement" for r in relate(x, near))


def test_the_first_differing_input_of_an_inline_culprit_says_how_it_relates():
    # a top-level culprit whose children all pass: the hint at the first differing input says how the two
    # inputs relate there (a timestep in other units), not only where they differ
    from tests.bisect_pairs import time_pair

    reference, port, inputs = time_pair("units")
    report = bisect(reference, port, inputs, repair=False)
    (hint,) = [h for h in report.culprit.hints if h.id == "inline-input"]
    assert "freq <-> time_proj (max_abs 998); there, port = 1/1000 × reference" in hint.message


class Embed(nn.Module):
    def __init__(self, register: bool):
        super().__init__()
        self.proj, self.register = nn.Linear(8, 8), register

    def forward(self, x):
        tokens = self.proj(x)
        if self.register:  # a token of zeros prepended on one side only
            tokens = torch.cat([torch.zeros_like(tokens[:, :1]), tokens], 1)
        return tokens


class TokenNet(nn.Module):
    r"""A patch embedding, a mixing layer over the last five tokens and a head; ``register`` makes the
    embedding prepend a token, which shifts the window the mixing reads."""

    def __init__(self, register: bool = False):
        super().__init__()
        self.embed, self.mix, self.head = Embed(register), nn.Linear(5, 5), nn.Linear(8, 8)

    def forward(self, x):
        tokens = self.embed(x)
        return self.head(self.mix(tokens[:, :5].transpose(1, 2)).transpose(1, 2))


def test_an_untestable_child_gets_the_relation_of_its_captured_outputs():
    torch.manual_seed(0)
    reference = TokenNet().eval()
    port = TokenNet(register=True).eval()
    port.load_state_dict(reference.state_dict())
    inputs = ((randn(2, 5, 8),), {})
    report = bisect(reference, port, inputs)
    assert [t.status for t in report.tested if t.reference == "embed"] == ["untestable"]
    (row,) = [r for r in report.culprit.relations if "untestable" in r.words]
    assert row.words.startswith("at embed <-> embed (untestable, captured outputs): along axis 1:")
    assert "port rows 0 are not in the reference" in row.words
    assert "added on the port's side" in row.words and row.verified is None
    # a faithful port: nothing untestable, no relation
    faithful = TokenNet().eval()
    faithful.load_state_dict(reference.state_dict())
    clean = bisect(reference, faithful, inputs)
    assert clean.culprit is None and "untestable" not in clean.render()
