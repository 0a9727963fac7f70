"""paritykit.bisection.align: differently named modules are paired by names, rules, weights and order."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from paritykit.base.report import to_json
from paritykit.bisection.align import align_modules
from paritykit.tracing.trace import Trace, capture
from torch import nn

from tests.bisect_pairs import conv_pair, dit_pair, randomize, time_pair


def traced(model, inputs):
    args, kwargs = inputs
    with torch.no_grad(), capture(model) as trace:
        model(*args, **kwargs)
    return trace


def aligned(reference, port, inputs, **kw):
    return align_modules(reference, port, traced(reference, inputs), traced(port, inputs), **kw)


@pytest.fixture(scope="module")
def dit_alignment():
    reference, port, inputs = dit_pair()
    return aligned(reference, port, inputs)


def test_weights_pair_leaves_and_containers_across_naming(dit_alignment):
    al = dit_alignment
    assert al.port_of("embed") == "proj_in"
    assert al.port_of("blocks.0.norm_a") == "transformer_blocks.0.norm1"
    assert al.port_of("blocks.1.mlp.fc2") == "transformer_blocks.1.ff.linear_2"
    # containers pair when the parameters under them map onto each other
    assert al.port_of("blocks.0") == "transformer_blocks.0"
    assert al.port_of("blocks.0.attn") == "transformer_blocks.0.attn1"
    assert al.port_of("blocks.0.mlp") == "transformer_blocks.0.ff"
    assert al.port_of("final_norm") == "norm_out"
    assert al.pair_of("blocks.0.attn").how == "weights"


def test_fused_qkv_gives_a_one_to_many_group(dit_alignment):
    group = [p for p in dit_alignment.pairs if p.reference == "blocks.0.attn.qkv"]
    assert sorted(p.port for p in group) == [f"transformer_blocks.0.attn1.to_{x}" for x in "kqv"]
    assert all(p.group and p.how == "weights" for p in group)
    assert dit_alignment.port_of("blocks.0.attn.qkv") is None  # not one-to-one


def test_row_permuted_weights_are_flagged_as_a_layout(dit_alignment):
    pair = dit_alignment.pair_of("final_norm.emb")
    assert pair.port == "norm_out.linear" and pair.layout == "swap_halves"


def test_parameterless_modules_align_by_order_and_class(dit_alignment):
    al = dit_alignment
    act = al.pair_of("blocks.1.mlp.act")
    assert act.port == "transformer_blocks.1.ff.act" and act.how == "order" and act.confidence == "medium"
    assert al.port_of("final_norm.norm") == "norm_out.norm"
    # modules with no counterpart are listed, per side
    assert set(al.unaligned_port) == {
        "transformer_blocks.0.attn1.to_out.1",
        "transformer_blocks.1.attn1.to_out.1",
        "norm_out.silu",
    }
    assert al.unaligned_reference == []


def test_parameterless_modules_of_different_classes_pair_when_alone_between_neighbours():
    reference, port, inputs = time_pair("bf16")
    al = aligned(reference, port, inputs)
    assert al.pair_of("freq").port == "time_proj" and al.pair_of("freq").how == "order"
    assert al.pair_of("mix").port == "time_mixer"
    assert al.pair_of("base_mlp.1").port == "time_embedding.act"


def test_identical_names_come_first():
    reference, _, inputs = conv_pair()
    twin = copy.deepcopy(reference)
    al = aligned(reference, twin, inputs)
    assert {p.how for p in al.pairs} == {"names"}
    assert len(al.pairs) == len({r.module for r in traced(reference, inputs)})
    assert al.exit_code == 0


def test_map_rules_rename_reference_names():
    reference, port, inputs = conv_pair()
    rules = [(r"^stem$", "conv_in"), (r"^res\.in_conv$", "resnet.conv1"), (r"^res$", "resnet")]
    al = aligned(reference, port, inputs, rules=rules)
    for ref_name, port_name in (("stem", "conv_in"), ("res.in_conv", "resnet.conv1"), ("res", "resnet")):
        pair = al.pair_of(ref_name)
        assert pair.port == port_name and pair.how == "map"
    assert al.pair_of("res.in_norm").how == "weights"


def test_fallback_by_order_and_shape_is_low_confidence():
    reference, port, inputs = conv_pair()
    randomize(port, seed=7)  # unrelated weights: value matching finds nothing
    al = aligned(reference, port, inputs)
    stem = al.pair_of("stem")
    assert stem.port == "conv_in" and stem.how == "order" and stem.confidence == "low"
    assert al.port_of("res.in_conv") == "resnet.conv1"
    assert al.port_of("to_out") == "conv_out"


def test_without_weights_pass_the_order_fallback_still_pairs(dit_alignment):
    reference, port, inputs = dit_pair()
    al = aligned(reference, port, inputs, use_weights=False)
    assert "weights" not in {p.how for p in al.pairs}
    assert al.port_of("blocks.0.norm_a") == "transformer_blocks.0.norm1"


def test_alignment_from_trace_folders_uses_their_weight_hashes(tmp_path):
    from paritykit.bisection.zoom import write_fingerprints

    reference, port, inputs = time_pair()
    for side, model in (("r", reference), ("p", port)):
        args, kwargs = inputs
        with torch.no_grad(), capture(model, to_dir=tmp_path / side):
            model(*args, **kwargs)
        write_fingerprints(model, tmp_path / side)
    al = align_modules(None, None, Trace.load(tmp_path / "r"), Trace.load(tmp_path / "p"))
    assert al.pair_of("ctrl_mlp").port == "control_time_embedding"
    assert al.pair_of("ctrl_mlp").how == "weights"
    assert al.pair_of("mix").port == "time_mixer"
    # must not fire: weights that are not the reference's pair nothing by weights
    randomize(port, seed=3)
    write_fingerprints(port, tmp_path / "p")
    al = align_modules(None, None, Trace.load(tmp_path / "r"), Trace.load(tmp_path / "p"))
    assert "weights" not in {p.how for p in al.pairs}


def test_report_faces(dit_alignment):
    payload = json.loads(to_json(dit_alignment.to_dict()))
    assert payload["aligned"] == len(dit_alignment.pairs)
    assert payload["by"]["weights"] > 0 and payload["by"]["order"] > 0
    assert {"reference", "port", "how", "confidence", "group"} <= set(payload["pairs"][0])
    text = dit_alignment.render(limit=5)
    assert "more" in text and "unaligned port:" in text
    assert "(top level)" in dit_alignment.render(limit=0)


class _TokenReference(nn.Module):
    """Research style: an embedding table, positions added inline from a fixed sinusoid."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] / 10 ** (torch.arange(16) / 16)
        return self.out(self.tok(ids) + torch.sin(pos))


class _PortEmbeddings(nn.Module):
    """Port style: a block that holds the table and adds the positions in its own forward."""

    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(50, 16)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] / 10 ** (torch.arange(16) / 16)
        return self.word_embeddings(ids) + torch.sin(pos)


class _TokenPort(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = _PortEmbeddings()
        self.proj = nn.Linear(16, 16)

    def forward(self, input_ids):
        return self.proj(self.embeddings(input_ids))


def test_a_table_pairs_with_the_table_not_with_the_block_that_also_adds_positions():
    reference = randomize(_TokenReference())
    port = _TokenPort().eval()
    port.load_state_dict(
        {
            "embeddings.word_embeddings.weight": reference.tok.weight,
            "proj.weight": reference.out.weight,
            "proj.bias": reference.out.bias,
        }
    )
    al = aligned(reference, port, ((torch.tensor([[1, 2, 3]]),), {}))
    assert al.port_of("tok") == "embeddings.word_embeddings"
    assert al.reference_of("embeddings") is None and "embeddings" in al.unaligned_port


def test_pairs_from_constant_weights_are_low_confidence():
    from tests.bisect_pairs import vit_pair

    reference, port, inputs = vit_pair(None, trained=False)
    al = aligned(reference, port, inputs)
    # fresh LayerNorms (all ones, all zeros) carry no information about which is which
    assert al.pair_of("blocks.0.norm1").confidence == "low"
    # linear layers keep their random initialisation: value-unique, high confidence
    assert al.pair_of("blocks.0.mlp.0").confidence == "high"
    assert al.pair_of("blocks.0.mlp.0").port == "layers.0.mlp.fc1"
    # a LayerNorm never falls back onto a parameterless module that returns the same shape
    assert all(
        al.pair_of(f"blocks.{i}.norm{j}").port.endswith("layernorm_" + ("before", "after")[j - 1])
        for i in range(2)
        for j in (1, 2)
    )


def test_trained_weights_keep_high_confidence_and_name_split_work():
    from tests.bisect_pairs import vit_pair

    reference, port, inputs = vit_pair(None, trained=True)
    al = aligned(reference, port, inputs)
    assert al.pair_of("blocks.0.norm1").confidence == "high"
    assert [s.to_dict() for s in al.split_work] == [
        {"port": "embeddings", "reference": "", "parameters": ["cls_token", "pos_embed"]}
    ]
    assert json.loads(to_json(al.to_dict()))["split_work"][0]["port"] == "embeddings"


class _TorchMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.mlp(x)


class _DiffusersMlp(nn.Module):
    r"""diffusers' FeedForward: its GELU module holds the Linear and applies the activation; a Dropout
    follows."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        from diffusers.models.attention import FeedForward

        self.ff = FeedForward(
            8, inner_dim=16, activation_fn="gelu" if approximate == "none" else "gelu-approximate"
        )

    def forward(self, x):
        return self.ff(x)


def _mlp_pair(approximate: str = "none"):
    reference = randomize(_TorchMlp(), 0)
    port = _DiffusersMlp(approximate).eval()
    sd = reference.state_dict()
    port.load_state_dict(
        {
            "ff.net.0.proj.weight": sd["mlp.0.weight"],
            "ff.net.0.proj.bias": sd["mlp.0.bias"],
            "ff.net.2.weight": sd["mlp.2.weight"],
            "ff.net.2.bias": sd["mlp.2.bias"],
        }
    )
    return reference, port, ((torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)),), {})


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_an_activation_never_pairs_with_the_dropout_after_the_module_that_applies_it(approximate):
    from paritykit.bisection.entry import bisect

    reference, port, inputs = _mlp_pair(approximate)
    al = aligned(reference, port, inputs)
    assert al.port_of("mlp.0") == "ff.net.0.proj"
    assert al.port_of("mlp.1") != "ff.net.1"  # the Dropout does none of GELU's work
    report = bisect(reference, port, inputs)
    if approximate == "none":  # must not fire: the faithful port matches with no culprit
        assert report.verdict == "match" and report.culprit is None
    else:
        assert report.culprit.port in ("ff", "ff.net.0")
        assert all(h.fix is None or "ff.net.1" not in h.fix for h in report.culprit.hints)


class _Norms(nn.Module):
    def __init__(self, names: tuple[str, str, str], affine: bool = True):
        super().__init__()
        conv_in, norm, conv_out = names
        self.names = names
        setattr(self, conv_in, nn.Conv2d(4, 8, 3, padding=1))
        setattr(self, norm, nn.GroupNorm(4, 8, affine=affine))
        setattr(self, conv_out, nn.Conv2d(8, 4, 1))

    def forward(self, x):
        conv_in, norm, conv_out = (getattr(self, n) for n in self.names)
        return conv_out(torch.relu(norm(conv_in(x))))


def test_a_norm_without_parameters_pairs_by_order_with_its_class_not_with_another():
    reference = randomize(_Norms(("conv1", "norm", "conv2")), 0)
    inputs = ((torch.randn(1, 4, 5, 5),), {})
    port = _Norms(("conv_in", "norm_out", "conv_out"), affine=False)
    sd = reference.state_dict()
    port.load_state_dict(
        {
            k.replace("conv1", "conv_in").replace("conv2", "conv_out"): v
            for k, v in sd.items()
            if "norm" not in k
        }
    )
    assert aligned(reference, port, inputs).port_of("norm") == "norm_out"
    # must not fire: a parameterless module of another class (an identity) is no counterpart of the norm
    other = copy.deepcopy(port)
    other.norm_out = nn.Identity()
    assert aligned(reference, other, inputs).port_of("norm") is None


def test_a_map_rule_overrides_a_same_name_partner():
    from paritykit.bisection.align import align_modules

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = torch.nn.LayerNorm(8)
            self.norm2 = torch.nn.LayerNorm(8)

        def forward(self, x):
            return self.norm2(self.norm1(x))

    ref, port = Two(), Two()
    x = torch.randn(2, 8)
    with torch.no_grad(), capture(ref) as rt:
        ref(x)
    with torch.no_grad(), capture(port) as pt:
        port(x)
    plain = {p.reference: (p.port, p.how) for p in align_modules(ref, port, rt, pt).pairs}
    assert plain["norm1"] == ("norm1", "names")  # by name, without a rule
    mapped = align_modules(ref, port, rt, pt, rules=[("^norm1$", "norm2")])
    pairs = {p.reference: (p.port, p.how) for p in mapped.pairs}
    assert pairs["norm1"] == ("norm2", "map")


class _ResidualUnit(torch.nn.Module):
    r"""A research residual unit: ``x + layers(x)``, the skip outside the Sequential that holds every
    weight (so the unit and its ``layers`` hold one parameter set)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Conv1d(width, width, 3, padding=1), torch.nn.Tanh(), torch.nn.Conv1d(width, width, 1)
        )

    def forward(self, x):
        return x + self.layers(x)


class _ResidualPort(torch.nn.Module):
    r"""Its port: one module with the convolutions as attributes and the skip inside."""

    def __init__(self, unit: _ResidualUnit, scale: float = 1.0):
        super().__init__()
        self.conv1 = torch.nn.Conv1d(8, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv1d(8, 8, 1)
        with torch.no_grad():
            self.conv1.load_state_dict(unit.layers[0].state_dict())
            self.conv2.load_state_dict(unit.layers[2].state_dict())
            self.conv2.weight.mul_(scale)

    def forward(self, x):
        return x + self.conv2(torch.tanh(self.conv1(x)))


class _Units(torch.nn.Module):
    def __init__(self, units):
        super().__init__()
        self.units = torch.nn.ModuleList(units)

    def forward(self, x):
        for unit in self.units:
            x = unit(x)
        return x


def _residual_pair(scale: float = 1.0):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(_ResidualUnit(), _ResidualUnit()).eval()
    port = _Units([_ResidualPort(u, scale) for u in reference]).eval()  # other names: weights pair them
    return reference, port, ((torch.randn(2, 8, 12),), {})


def test_a_unit_and_the_sequential_inside_it_pair_by_which_output_agrees():
    # the unit and its `layers` hold the same weights; innermost-first paired the port's unit (skip included)
    # with the Sequential (skip excluded), and bisect then reported that pair's outputs as differing
    reference, port, inputs = _residual_pair()
    alignment = aligned(reference, port, inputs)
    assert alignment.port_of("0") == "units.0" and alignment.port_of("1") == "units.1"
    assert alignment.port_of("0.layers") is None


def test_a_unit_whose_outputs_agree_with_no_member_pairs_by_what_both_add():
    # with a planted scale neither member's output agrees, so the values decide nothing; the structure does,
    # measured on both sides (round 25): the research unit returns its input plus its `layers`' output, the
    # port's unit its input plus `conv2`'s, so the two units pair (the port never computes `layers` alone).
    # A port module that returns the branch alone keeps the branch:
    # test_boundaries_r22.py::test_a_block_that_adds_its_input_pairs_with_the_residual_wrapper_not_its_branch
    reference, port, inputs = _residual_pair(scale=1.5)
    alignment = aligned(reference, port, inputs)
    assert alignment.port_of("0") == "units.0" and alignment.port_of("0.layers") is None


def test_a_module_is_not_paired_with_a_block_that_also_holds_another_modules_work():
    # round 8 (the DALL-E 2 prior): the reference attention and the port block both hold the null key/value
    # themselves; the block also holds the feed-forward the reference keeps apart, so they are no pair
    from tests import null_kv_pairs

    reference, port, x = null_kv_pairs.build()
    al = aligned(reference, port, ((x,), {}))
    for i in range(null_kv_pairs.DEPTH):
        assert al.port_of(f"layers.{i}.0") is None
        assert al.port_of(f"layers.{i}.0.to_q") == f"transformer_blocks.{i}.attn.to_q"
        assert al.port_of(f"layers.{i}.0.norm") == f"transformer_blocks.{i}.norm1"
    # where one module's tensors do map onto one port module whole, the pair stays
    assert al.port_of("norm") == "norm_out"


class _Embedder(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 16), nn.SiLU(), nn.Linear(16, 16))

    def forward(self, x):
        return self.mlp(x)


class _Embedders(nn.Module):
    r"""Research style: the time and the pooled-text embedders side by side, each an ``mlp`` in a wrapper."""

    def __init__(self):
        super().__init__()
        self.t_embedder, self.y_embedder = _Embedder(8), _Embedder(12)

    def forward(self, t, y):
        return self.t_embedder(t) + self.y_embedder(y)


class _Joined(nn.Module):
    def __init__(self):
        super().__init__()
        self.timestep_embedder = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 16))
        self.text_embedder = nn.Sequential(nn.Linear(12, 16), nn.SiLU(), nn.Linear(16, 16))

    def forward(self, t, y):
        return self.timestep_embedder(t) + self.text_embedder(y)


class _JoinedPort(nn.Module):
    r"""diffusers style: one ``time_text_embed`` holding both."""

    def __init__(self):
        super().__init__()
        self.time_text_embed = _Joined()

    def forward(self, t, y):
        return self.time_text_embed(t, y)


def test_a_block_is_not_paired_with_a_module_whose_sibling_is_paired_inside_it():
    # round 10 (MMDiT): the reference's y_embedder was paired with the port's time_text_embed (time + text),
    # whose timestep_embedder was already the reference's t_embedder
    reference = randomize(_Embedders())
    port = _JoinedPort()
    port.time_text_embed.timestep_embedder.load_state_dict(reference.t_embedder.mlp.state_dict())
    port.time_text_embed.text_embedder.load_state_dict(reference.y_embedder.mlp.state_dict())
    inputs = ((torch.randn(2, 8), torch.randn(2, 12)), {})
    al = aligned(reference, port.eval(), inputs)
    assert al.port_of("t_embedder.mlp") == "time_text_embed.timestep_embedder"
    assert al.port_of("y_embedder.mlp") == "time_text_embed.text_embedder"
    assert al.port_of("y_embedder") != "time_text_embed"


class _ResConv(nn.Module):
    r"""v-diffusion's residual block: ``main(x) + x``, its ``main`` a Sequential holding every weight."""

    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))

    def forward(self, x):
        return self.main(x) + x


class _ResConvPort(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.act, self.conv2 = (
            nn.Conv2d(4, 4, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1),
        )

    def forward(self, x):
        return self.conv2(self.act(self.conv1(x))) + x


class _Shifted(nn.Module):
    def __init__(self, block, shift):
        super().__init__()
        self.block, self.shift = block, shift

    def forward(self, x):
        return self.block(x + self.shift)


class _PortNet(nn.Module):
    def __init__(self, resnet):
        super().__init__()
        self.resnet = resnet

    def forward(self, x):
        return self.resnet(x)


def test_a_residual_block_pairs_with_the_chain_member_the_port_computes_like_on_its_own_inputs():
    # round 11 (v-diffusion): with inputs already differing upstream, the port's residual block was paired
    # with the reference's skip-free inner Sequential, and "input added once too often" was "verified" on a
    # correct port; run on each member's own captured inputs, the port block reproduces the outer member only
    torch.manual_seed(0)
    ref_block = randomize(_ResConv())
    port_block = _ResConvPort()
    port_block.conv1.load_state_dict(ref_block.main[0].state_dict())
    port_block.conv2.load_state_dict(ref_block.main[2].state_dict())
    reference, port = _Shifted(ref_block, 0.5), _PortNet(port_block.eval())  # inputs differ upstream
    al = aligned(reference, port, ((torch.randn(1, 4, 6, 6),), {}))
    assert al.port_of("block") == "resnet"
    assert al.port_of("block.main") != "resnet"


class _NestedUNet(nn.Module):
    """A research layout: the whole body in one ``unet`` container, the output conv outside it."""

    def __init__(self):
        super().__init__()
        self.unet = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.SiLU())
        self.final = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        return self.final(self.unet(x))


class _FlatUNet(nn.Module):
    """The diffusers layout of the same work: the body's layers at the top level."""

    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(3, 4, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.SiLU())
        self.conv_out = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        return self.conv_out(self.block(self.conv_in(x)))


def _unet_layouts(convert: bool = True):
    torch.manual_seed(0)
    reference, port = _NestedUNet().eval(), _FlatUNet().eval()
    if convert:
        port.conv_in.load_state_dict(reference.unet[0].state_dict())
        port.block[0].load_state_dict(reference.unet[1].state_dict())
        port.conv_out.load_state_dict(reference.final.state_dict())
    return reference, port, ((torch.randn(1, 3, 6, 6),), {})


@pytest.mark.parametrize("convert", [True, False])
def test_a_container_whose_weights_the_port_spreads_over_several_blocks_never_pairs_by_order(convert):
    from paritykit.bisection.zoom import capture_level

    reference, port, (args, kwargs) = _unet_layouts(convert)
    # one level of each, as the zoom captures it: the reference's ``unet`` holds the port's ``conv_in`` and
    # ``block``; it has the output shape of ``block`` only
    ref_level, port_level = capture_level(reference, args, kwargs), capture_level(port, args, kwargs)
    al = align_modules(reference, port, ref_level, port_level)
    assert al.port_of("final") == "conv_out"
    if convert:  # the weights place unet's work in conv_in and block: no order pairs it with block
        assert al.port_of("unet") is None and al.pair_of("final").how == "weights"
    else:  # unrelated weights say nothing: order and shape still pair them, at low confidence
        pair = al.pair_of("unet")
        assert (pair.port, pair.how, pair.confidence) == ("block", "order", "low")
