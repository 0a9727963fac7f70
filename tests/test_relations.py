"""Arguments paired by value across signatures (paritykit.bisection.relations): each relation fires on the
case it names and not on values that only look alike."""

from __future__ import annotations

import torch
from paritykit.bisection.relations import pair_by_value, unexplained


def close(a, b):
    return bool(torch.allclose(a.to(torch.float64), b.to(torch.float64), rtol=1e-5, atol=1e-6))


def kinds(ref, port):
    found = pair_by_value(ref, port, close)
    return {port[j][0]: (r.kind, [ref[i][0] for i in r.sources]) for j, r in found.items()}, found


def test_each_relation_pairs_the_argument_it_names():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, generator=g)
    t = torch.rand(2, generator=g)
    heads = torch.randn(2, 4, 16, 6, generator=g)
    per_sample = [torch.randn(5, 8, generator=g), torch.randn(3, 8, generator=g)]
    angles = torch.randn(16, 1, 3, generator=g, dtype=torch.float64)
    table = torch.polar(torch.ones_like(angles), angles)
    ref = [
        ("args.0", x),
        ("args.1", t),
        ("args.2", heads),
        ("args.3.0", per_sample[0]),
        ("args.3.1", per_sample[1]),
        ("args.4", table),
    ]
    padded = torch.zeros(2, 5, 8)
    padded[0], padded[1, :3] = per_sample[0], per_sample[1]
    port = [
        ("hidden_states", x.clone()),
        ("timestep", t * 1000),
        ("temb", t.reshape(2, 1).expand(2, 16).contiguous()),
        ("q", heads.permute(0, 2, 1, 3).contiguous()),
        ("flat", x.reshape(2, 128)),
        ("half", x.half()),
        ("batch", padded),
        ("cos", table.real.repeat_interleave(2, -1).reshape(1, 16, 1, 6).float()),
        ("sin", table.imag.repeat_interleave(2, -1).reshape(1, 16, 1, 6).float()),
    ]
    found, relations = kinds(ref, port)
    assert found == {
        "hidden_states": ("exact", ["args.0"]),
        "timestep": ("scale", ["args.1"]),
        "temb": ("broadcast", ["args.1"]),
        "q": ("layout", ["args.2"]),
        "flat": ("reshape", ["args.0"]),
        "half": ("dtype", ["args.0"]),
        "batch": ("stack", ["args.3.0", "args.3.1"]),
        "cos": ("rotary", ["args.4"]),
        "sin": ("rotary", ["args.4"]),
    }
    by_name = {port[j][0]: r for j, r in relations.items()}
    assert "× 1000" in by_name["timestep"].words
    for j, relation in relations.items():  # each relation carries the reference's value into the port's form
        assert close(relation(ref), port[j][1]), port[j][0]


def test_values_that_only_look_alike_are_not_paired():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 8, generator=g)
    ref = [("args.0", x)]
    port = [
        ("other", torch.randn(2, 16, 8, generator=g)),  # same shape, other values
        ("scaled", x * 3.7),  # a factor, but no round constant
        ("noisy", x + 1e-2 * torch.randn(2, 16, 8, generator=g)),  # beyond tolerance
        ("shifted", x.roll(1, dims=1)),  # the same values in another order along a dim
        ("negated", -x),  # an activation's negative or double is a difference, not the same argument
        ("doubled", x * 2),
    ]
    found, _ = kinds(ref, port)
    assert found == {}
    port_left, ref_left = unexplained(ref, port, {})
    assert port_left == [0, 1, 2, 3, 4, 5] and ref_left == [0]  # an input that differs is not the port's own


def test_a_port_input_nothing_could_stand_for_is_its_own():
    x = torch.randn(2, 16, 8)
    mask = torch.ones(2, 16, dtype=torch.bool)
    ref = [("args.0", x), ("args.1", torch.tensor([16, 16]))]  # an integer length the port does not take
    port = [("hidden_states", x.clone()), ("mask", mask), ("rotary", torch.randn(1, 7, 3))]
    found, relations = kinds(ref, port)
    assert found == {"hidden_states": ("exact", ["args.0"])}
    assert unexplained(ref, port, relations) == ([], [])


def test_complex_tables_pair_with_complex_tables_only_when_equal():
    angles = torch.randn(16, 1, 3, dtype=torch.float64)
    table = torch.polar(torch.ones_like(angles), angles)
    ref = [("args.0", torch.randn(2, 16, 8)), ("args.1", table)]
    same = [("freqs_cis", table.to(torch.complex64).reshape(1, 16, 1, 3))]
    found, _ = kinds(ref, same)
    assert found == {"freqs_cis": ("reshape", ["args.1"])}
    turn = torch.polar(torch.ones(1, dtype=torch.float64), torch.tensor([0.3], dtype=torch.float64))
    rotated = [("freqs_cis", table * turn)]
    found, relations = kinds(ref, rotated)
    assert found == {} and unexplained(ref, rotated, relations) == ([0], [1])  # differs: never "own"


def test_equal_reference_arguments_are_ties():
    x = torch.randn(2, 4, 8)
    ref = [("args.0", x), ("args.1", x.clone())]  # at block 0 the residual stream may equal the input
    _, relations = kinds(ref, [("hidden_states", x.clone())])
    assert relations[0].ties == 1
    _, relations = kinds([("args.0", x), ("args.1", torch.randn(2, 4, 8))], [("hidden_states", x.clone())])
    assert relations[0].ties == 0


def test_a_real_angle_table_pairs_with_its_cos_and_sin_and_nothing_else():
    # round 15 (voicebox-pytorch): the research passes its rotary angles, the port cos and sin of them; the
    # attention was "untestable" (inputs cannot be paired), and the slip inside it was never reached
    g = torch.Generator().manual_seed(1)
    freqs = torch.randn(16, 4, generator=g)
    angles = torch.cat([freqs, freqs], dim=-1)  # the table written twice: (16, 8)
    ref = [("args.0", torch.randn(2, 16, 8, generator=g)), ("kwargs.rotary_emb", angles)]
    port = [("hidden_states", ref[0][1].clone()), ("rope.0", angles.cos()), ("rope.1", angles.sin())]
    found, relations = kinds(ref, port)
    assert found["rope.0"] == ("rotary", ["kwargs.rotary_emb"]) and found["rope.1"][0] == "rotary"
    assert "cos of kwargs.rotary_emb (angles)" in relations[1].words
    # one angle per pair, the port's table interleaved
    half = [("args.0", ref[0][1]), ("kwargs.rotary_emb", freqs)]
    inter = [
        ("cos", freqs.cos().repeat_interleave(2, dim=-1)),
        ("sin", freqs.sin().repeat_interleave(2, dim=-1)),
    ]
    found, _ = kinds(half, inter)
    assert found == {"cos": ("rotary", ["kwargs.rotary_emb"]), "sin": ("rotary", ["kwargs.rotary_emb"])}
    # must not pair: the cos of other angles, or of angles scaled
    other = [("rope.0", (angles * 1.01).cos()), ("rope.1", (angles + 0.1).sin())]
    found, _ = kinds(ref, other)
    assert found == {}
