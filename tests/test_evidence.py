"""paritykit.bisection.evidence.collect: planted bugs in independently written port pairs get one true,
verified explanation.

The pairs (tests/evidence_pairs.py) put research-style code against transformers' ViTLayer, diffusers'
Attention against torch's MultiheadAttention, and a hand-written rotary table against Llama's. Every case runs
the real ``paritykit.bisect`` and checks the culprit, that the first hint is the planted cause, that no other
explanation is offered, and that the fix, where one exists, was verified by re-running a fixed copy.
"""

from __future__ import annotations

import copy
import enum
import functools
import json

import paritykit.compare.diagnose as D
import pytest
import torch
import torch.nn.functional as F
from paritykit.base.report import to_json
from paritykit.bisection import evidence as E
from paritykit.bisection.entry import bisect
from torch import nn

from tests.evidence_pairs import mha_pair, rope_pair, vit_pair

# (pair, bug, reference culprit, port culprit, first hint id, verified, words in the fix)
PLANTED = [
    (vit_pair, "eps", "norm1", "layernorm_before", "module-config", True, "layernorm_before.eps = 1e-06"),
    (vit_pair, "gelu", "mlp.act", "mlp.activation_fn", "activation", True, "torch.nn.GELU()"),
    (
        vit_pair,
        "qk",
        "attn",
        "attention",
        "weights",
        True,
        "attention.q_proj.weight from attn.qkv.weight (chunk 0/3",
    ),
    (vit_pair, "scale", "attn", "attention", "module-config", True, "attention.scaling = 0.35355339"),
    (rope_pair, "theta", "rope", "rope", "module-config", True, "rope.inv_freq"),
]
ALL_IDS = {"module-config", "activation", "norm-eps", "attention-scale", "weights", "no-signature"}


@functools.cache
def _bisect(pair, bug, trained):
    """One bisect per case, shared by the tests that read different parts of its report."""
    reference, port, inputs = pair(bug, trained=trained)
    return bisect(reference, port, inputs)


@pytest.mark.parametrize("trained", [True, False], ids=["trained", "fresh"])
@pytest.mark.parametrize(
    ("pair", "bug", "ref_name", "port_name", "first", "verified", "fix"),
    PLANTED,
    ids=[f"{p.__name__}-{b}" for p, b, *_ in PLANTED],
)
def test_planted_bug_gets_its_true_verified_fix(
    pair, bug, ref_name, port_name, first, verified, fix, trained
):
    report = _bisect(pair, bug, trained)
    culprit = report.culprit
    assert report.verdict == "diverge" and culprit is not None
    assert culprit.reference == ref_name
    if culprit.confidence != "low":
        assert culprit.port == port_name
    else:
        # fresh init: both LayerNorms hold ones, so the weights cannot tell them apart (a low-confidence
        # pair); the port module it names has the same planted setting, so the fix is still true there
        assert bug == "eps" and not trained and culprit.port in ("layernorm_before", "layernorm_after")
        fix = fix.replace("layernorm_before", culprit.port)
    hint = culprit.hints[0]
    assert hint.id == first, [h.id for h in culprit.hints]
    assert hint.verified is verified and fix in hint.fix
    assert "evidence" in hint.message
    assert hint.evidence["max_abs_after"] < hint.evidence["max_abs_before"]
    # a verified fix explains the whole difference: nothing else is offered beside it
    assert all(h.verified for h in culprit.hints), [(h.id, h.verified) for h in culprit.hints]
    assert not {h.id for h in culprit.hints} & {"bf16-cast", "fp16-cast", "no-signature"}
    out = json.loads(to_json(report.to_dict()))
    assert out["culprit"]["hints"][0]["verified"] is True and out["culprit"]["hints"][0]["fix"] == hint.fix
    text = report.render()
    assert text.index("fix (verified): ") < text.index("hint 1: ")
    if culprit.inline:
        assert "own forward code" not in text  # settings or weights explain it, not the forward


def test_eps_names_both_values():
    hint = _bisect(vit_pair, "eps", True).culprit.hints[0]
    assert "reference LayerNorm eps=1e-06, port eps=1e-12" in hint.message


def test_gelu_names_both_functions():
    hint = _bisect(vit_pair, "gelu", True).culprit.hints[0]
    assert hint.evidence["reference"] == ["exact GELU"] and hint.evidence["port"] == ["tanh-GELU"]


def test_qk_swap_names_the_exact_slices():
    hint = _bisect(vit_pair, "qk", True).culprit.hints[0]
    assert "port attention.q_proj.weight holds chunk 1/3 of reference attn.qkv.weight" in hint.message
    assert "port attention.k_proj.weight holds chunk 0/3" in hint.message
    assert "v_proj" not in hint.message


@pytest.mark.parametrize("trained", [True, False], ids=["trained", "fresh"])
def test_fused_mha_vs_split_diffusers_attention_qk_swap_is_a_conversion_bug(trained):
    report = _bisect(mha_pair, "qk", trained)
    culprit = report.culprit
    # MultiheadAttention takes (q, k, v) where Attention takes one tensor: the call cannot be replayed, so the
    # culprit is the block holding it; the weights still say exactly what is wrong
    assert culprit.reference in ("", "attn")
    hint = culprit.hints[0]
    assert (
        hint.id == "weights"
        and "to_q.weight holds chunk 1/3" in hint.message
        and "in_proj_weight" in hint.message
    )
    assert {h.id for h in culprit.hints} == {"weights"}
    assert "forward code" not in report.render().split("hint 1")[1]


def test_dropped_norm_weights_are_named_not_blamed_on_forward_code():
    culprit = _bisect(vit_pair, "affine", True).culprit
    hints = {h.id: h for h in culprit.hints}
    assert "no-signature" not in hints
    if (culprit.reference, culprit.port) == ("norm2", "layernorm_after"):
        # aligned by order: the missing parameters are named, and putting them back is verified
        hint = culprit.hints[0]
        assert hint.id == "module-config" and hint.verified
        assert "has parameter weight" in hint.message and "has parameter bias" in hint.message
    else:
        # the un-affine LayerNorm left unaligned: the block is the culprit, and the weights say which
        # reference parameters the port lost
        assert hints["weights"].evidence["unused_reference"] == ["norm2.weight", "norm2.bias"]


@pytest.mark.parametrize("pair", [vit_pair, mha_pair, rope_pair], ids=lambda p: p.__name__)
@pytest.mark.parametrize("trained", [True, False], ids=["trained", "fresh"])
def test_float_noise_only_ports_match_with_no_hint(pair, trained):
    report = _bisect(pair, None, trained)
    assert report.verdict == "match" and report.culprit is None


# ------------------------------------------------------------------- one evidence function at a time


class Holder(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _culprit(reference: nn.Module, port: nn.Module, x: torch.Tensor) -> E.Culprit:
    """A culprit as bisect builds it: both sides replayed on the same input."""
    with torch.no_grad():
        ref_out, port_out = reference(x), port(x)

    def check(fn):
        with torch.no_grad():
            out = fn(x.clone())
        return bool(torch.allclose(out, ref_out, rtol=1.3e-6, atol=1e-5)), float((out - ref_out).abs().max())

    return E.Culprit(
        "blocks.0.norm",
        "layers.0.norm",
        reference,
        port,
        ref_out,
        port_out,
        run_reference=lambda fn: fn(x.clone()),
        run_port=lambda fn: fn(x.clone()),
        check=check,
        reference_inputs=((x,), {}),
    )


class HardCodedNorm(nn.Module):
    """A port norm whose epsilon is written into its forward, not kept as an attribute."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self._eps = eps

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self._eps)


def test_norm_eps_fits_a_hidden_epsilon():
    x = 0.01 * torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0))
    c = _culprit(nn.LayerNorm(32, eps=1e-6), HardCodedNorm(32, 1e-12), x)
    assert E.module_config(c) == []  # nothing to see in the settings: the fit is the only evidence
    (hint,) = E.norm_eps(c)
    assert hint.id == "norm-eps" and hint.verified is None  # no attribute on the port to set
    assert hint.evidence["fitting"][0] <= 1e-12 <= hint.evidence["fitting"][-1] < 1e-6
    # must not fire: the same eps on both sides, or a norm pair that differs by its weights
    assert E.norm_eps(_culprit(nn.LayerNorm(32, eps=1e-6), HardCodedNorm(32, 1e-6), x)) == []
    other = HardCodedNorm(32, 1e-6)
    with torch.no_grad():
        other.weight.mul_(1.5)
    assert E.norm_eps(_culprit(nn.LayerNorm(32, eps=1e-6), other, x)) == []


def test_module_config_turns_affine_back_on_with_the_reference_weights():
    reference = nn.LayerNorm(32, eps=1e-6)
    with torch.no_grad():
        reference.weight.normal_(generator=torch.Generator().manual_seed(1))
    port = nn.LayerNorm(32, eps=1e-6, elementwise_affine=False)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference.bias.normal_(generator=torch.Generator().manual_seed(3))
    (hint,) = E.module_config(_culprit(reference, port, x))
    # the flag itself changes nothing once the parameters are there: the fix names only what matters
    assert hint.verified is True and hint.message.startswith("2 settings differ")
    assert "has parameter weight" in hint.message and "has parameter bias" in hint.message
    assert port.weight is None  # verification worked on a copy


@pytest.mark.parametrize(
    ("reference", "port", "names"),
    [
        (nn.GELU(), nn.GELU(approximate="tanh"), (["exact GELU"], ["tanh-GELU"])),
        (nn.SiLU(), nn.Mish(), (["SiLU"], ["Mish"])),
        (nn.ReLU(), nn.Identity(), (["ReLU"], ["identity"])),
    ],
)
def test_activation_names_both_functions(reference, port, names):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    (hint,) = E.activation(_culprit(reference, port, x))
    assert (hint.evidence["reference"], hint.evidence["port"]) == names and hint.verified is True


def test_activation_must_not_fire_on_parameterised_or_equal_functions():
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(4))
    assert E.activation(_culprit(nn.GELU(), nn.GELU(), x)) == []
    assert E.activation(_culprit(nn.Linear(8, 8), nn.Linear(8, 8), x)) == []
    # ReLU and identity agree on positive inputs: no difference to explain, no hint
    assert E.activation(_culprit(nn.ReLU(), nn.Identity(), x.abs())) == []


def test_attention_scale_fit_needs_a_near_exact_fit():
    from diffusers.models.attention_processor import Attention, AttnProcessor

    torch.manual_seed(5)
    reference = Attention(32, heads=4, dim_head=8).eval()
    reference.set_processor(
        AttnProcessor()
    )  # the processor that reads attn.scale (SDPA's default ignores it)
    port = copy.deepcopy(reference)
    port.scale = 1.0
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(6))
    (hint,) = E.attention_scale(_culprit(reference, port, x))
    assert hint.verified is True and hint.evidence["fitted_scale"] == pytest.approx(8**-0.5, rel=1e-6)
    # must not fire: a port whose weights differ is not explained by any softmax scale
    wrong = copy.deepcopy(reference)
    with torch.no_grad():
        wrong.to_v.weight.mul_(-1)
    assert E.attention_scale(_culprit(reference, wrong, x)) == []


def test_weights_must_not_fire_on_a_faithful_split():
    reference, port, _ = mha_pair(None)
    c = E.Culprit("", "", reference, port, torch.zeros(1), torch.ones(1))
    assert E.weights(c) == []


class _Sined(nn.Module):
    r"""The same layers, with a sine no detector reads between them."""

    def __init__(self, layers: nn.Module):
        super().__init__()
        self.layers = copy.deepcopy(layers)

    def forward(self, x):
        return self.layers[1](torch.sin(self.layers[0](x)) * 0.5 + self.layers[0](x))


def test_no_signature_only_after_every_check_ran():
    class Doubling(nn.Module):
        def forward(self, x):
            return torch.cat([x[..., :4], 2 * torch.sin(x[..., 4:])], -1)

    class Plain(nn.Module):
        def forward(self, x):
            return torch.cat([x[..., :4], torch.sin(x[..., 4:])], -1)

    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    (hint,) = E.culprit_evidence(_culprit(Plain(), Doubling(), x))
    assert hint.id == "no-signature"
    assert "each parameter of the aligned pairs holds the values of its aligned" in hint.message
    assert "how each forward reads them, an axis or a transpose, is not compared by this)" in hint.message
    # round 28 (RePaint's linear-attention memory, square and loaded untransposed): the parameters with two
    # dims of one size are named, as their values would agree read either way; none here, so none is named
    assert "two dims of one size" not in hint.message
    square = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    (hint,) = E.culprit_evidence(_culprit(square, _Sined(square), x))
    assert hint.id == "no-signature", hint.message
    assert "0.weight (8, 8) have two dims of one size, so read with those dims swapped" in hint.message
    assert "1.weight" not in hint.message  # (4, 8): a swap would change its shape
    # a measurement, no conclusion: nothing an unmatched check cannot establish
    assert "forward code" not in hint.message and "ruled out" not in hint.message
    assert hint.evidence["ruled_out"][:5] == [
        "module config",
        "activation",
        "norm eps",
        "attention scale",
        "weight slices",
    ]
    trace_only = E.Culprit("a", "b", None, None, torch.zeros(3), torch.ones(3))
    (hint,) = E.culprit_evidence(trace_only)
    assert "were not compared" in hint.message and "holds the values" not in hint.message


def test_config_differences_over_all_aligned_pairs():
    reference, port, _ = vit_pair("eps")
    diffs = E.config_differences(
        reference, port, [("norm1", "layernorm_before"), ("norm2", "layernorm_after")]
    )
    assert [(d.reference, d.port, d.name, d.reference_value, d.port_value) for d in diffs] == [
        ("norm1", "layernorm_before", "eps", 1e-6, 1e-12),
        ("norm2", "layernorm_after", "eps", 1e-6, 1e-12),
    ]
    assert E.config_differences(reference, port, [("mlp.fc1", "mlp.fc1")]) == []


def test_bisect_json_lists_every_aligned_pair_whose_settings_differ():
    out = json.loads(to_json(_bisect(vit_pair, "eps", True).to_dict()))
    shown = {(d["reference"], d["port"], d["name"]) for d in out["config_differences"]}
    # both LayerNorms carry the planted eps, though only the first is the culprit
    assert {("norm1", "layernorm_before", "eps"), ("norm2", "layernorm_after", "eps")} <= shown
    assert out["config_differences"][0]["reference_value"] == 1e-6
    assert _bisect(vit_pair, "qk", True).config_differences == []


@pytest.mark.parametrize("bug", ["eps", "gelu"])
def test_the_skills_own_examples_get_their_setting_not_a_cast(bug):
    from tests.bisect_pairs import dit_pair

    reference, port, inputs = dit_pair(bug)
    hints = bisect(reference, port, inputs).culprit.hints
    assert hints[0].id == "module-config" and hints[0].verified
    assert ("eps" if bug == "eps" else "approximate") in hints[0].fix
    assert not {h.id for h in hints} & {"bf16-cast", "fp16-cast", "no-signature"}


def test_module_config_must_not_fire_on_equal_settings():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(8))
    assert E.module_config(_culprit(nn.LayerNorm(32, eps=1e-6), nn.LayerNorm(32, eps=1e-6), x)) == []
    assert E.module_config(_culprit(nn.GELU(), nn.GELU(), x)) == []
    # same numbers, different spellings of one setting: 1e-6 == 1e-06, `epsilon` is `eps`
    other = HardCodedNorm(32, 1e-6)
    other.epsilon = 1e-6
    assert E.module_config(_culprit(nn.LayerNorm(32, eps=1e-6), other, x)) == []


class ResearchNorm(nn.LayerNorm):
    def __init__(self, dim: int, kind: str = ""):
        super().__init__(dim, eps=1e-6)
        self.kind = kind or type(self).__name__


class PortNorm(ResearchNorm):
    pass


class ResearchRotary(nn.Module):
    """Research style: the rotary frequencies computed in __init__ and kept as a plain attribute."""

    def __init__(self, dim: int = 8, theta: float = 10000.0):
        super().__init__()
        self.freqs = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)

    def forward(self, x):
        angles = torch.arange(x.shape[-2], dtype=torch.float32)[:, None] * self.freqs
        return x * torch.cat([angles.cos(), angles.cos()], dim=-1)


def test_state_set_in_init_that_forward_reads_is_compared_and_copied():
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(9))
    (hint,) = E.module_config(_culprit(ResearchRotary(), ResearchRotary(theta=1e6), x))
    assert hint.evidence["difference"]["kind"] == "state" and "state freqs" in hint.message
    assert hint.verified is True and hint.fix.startswith("copy state")
    assert E.module_config(_culprit(ResearchRotary(), ResearchRotary(), x)) == []


def test_a_class_name_alone_is_no_setting():
    # two implementations record their class under one attribute: that they are named differently is no cause
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(8))
    assert E.module_config(_culprit(ResearchNorm(32), PortNorm(32), x)) == []
    # a string setting that differs is still one, even when one side's value happens to name its class
    found = E.module_config(_culprit(ResearchNorm(32, kind="rms"), PortNorm(32), x))
    assert [h.evidence["difference"]["name"] for h in found] == ["kind"]


class InputCast(nn.Module):
    """A port that rounds its input to bfloat16 before computing in float32."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.bfloat16().float())


def test_reduced_precision_rerun_finds_a_port_that_rounds_its_input():
    torch.manual_seed(9)
    reference = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)).eval()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10))
    c = _culprit(reference, InputCast(copy.deepcopy(reference)), x)
    # the output itself carries no trace of the cast: neither exact rounding nor the grid
    assert D.detect_bf16_cast(c.reference_output.double().flatten(), c.port_output.double().flatten()) is None
    (hint,) = E.reduced_precision(c)
    assert hint.id == "bf16-cast" and hint.evidence["rerun_error"] < 0.1 * hint.evidence["error"]
    assert "inputs rounded to bfloat16" in hint.message


def test_reduced_precision_must_not_fire_on_look_alikes():
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(11))
    linear = nn.Linear(32, 32)
    swapped = copy.deepcopy(linear)
    with torch.no_grad():
        swapped.weight.copy_(linear.weight.flip(0))
    cases = [
        (nn.GELU(), nn.GELU(approximate="tanh")),
        (nn.LayerNorm(32, eps=1e-6), nn.LayerNorm(32, eps=1e-12)),
        (linear, swapped),
    ]
    for reference, port in cases:
        assert E.reduced_precision(_culprit(reference, port, 0.01 * x)) == [], (reference, port)


def test_a_fix_that_cannot_be_tried_stays_unverified():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(12))
    c = _culprit(nn.LayerNorm(32, eps=1e-6), nn.LayerNorm(32, eps=1e-2), x)

    def broken(fn):
        raise RuntimeError("offloaded weights cannot be copied")

    c.check = broken
    (hint,) = E.module_config(c)
    assert hint.verified is None and "offloaded" in hint.evidence["verify_error"]
    assert "does not make the module match" not in hint.message


class SplitAttention(nn.Module):
    """CLIP-style self-attention: separate q/k/v projections named q_proj, k_proj, v_proj."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        b, n, c = x.shape

        def heads(t):
            return t.view(b, n, 4, 8).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        )
        return self.out_proj(o.transpose(1, 2).reshape(b, n, c))


def test_weights_names_a_k_loaded_from_v_between_two_split_layouts():
    from diffusers.models.attention_processor import Attention

    torch.manual_seed(13)
    reference = SplitAttention().eval()
    port = Attention(32, heads=4, dim_head=8, bias=True, out_bias=True).eval()
    sd = reference.state_dict()
    names = {"to_q": "q_proj", "to_k": "v_proj", "to_v": "k_proj", "to_out.0": "out_proj"}  # k and v swapped
    port.load_state_dict(
        {f"{p}.{leaf}": sd[f"{r}.{leaf}"] for p, r in names.items() for leaf in ("weight", "bias")}
    )
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(14))
    (hint,) = E.weights(_culprit(reference, port, x))
    assert hint.verified is True
    assert (
        "port layers.0.norm.to_k.weight holds reference blocks.0.norm.v_proj.weight "
        "(its name implies blocks.0.norm.k_proj.weight)" in hint.message
    )


def test_weights_names_a_transpose_only_when_undoing_it_makes_the_module_match():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(15)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(16))
    reference = nn.Linear(32, 32)
    slipped = nn.Linear(32, 32)
    with torch.no_grad():
        slipped.weight.copy_(reference.weight.T)
        slipped.bias.copy_(reference.bias)
    (hint,) = E.weights(_culprit(reference, slipped, x))
    assert hint.verified is True and "after transpose" in hint.message
    # must not fire: GPT-2's Conv1D stores the transpose by design; a port with a wrong bias is not a slip
    conv = Conv1D(32, 32)
    with torch.no_grad():
        conv.weight.normal_(generator=torch.Generator().manual_seed(17))
    port = nn.Linear(32, 32)
    with torch.no_grad():
        port.weight.copy_(conv.weight.T)
        port.bias.copy_(conv.bias + 0.5)
    hints = E.weights(_culprit(conv, port, x))
    assert not any("slip" in h.message for h in hints)


def test_no_signature_names_a_layout_it_could_not_rule_out():
    torch.manual_seed(18)
    reference, port = nn.Linear(16, 16), nn.Linear(16, 16)
    with torch.no_grad():
        port.weight.copy_(reference.weight.T)
        port.bias.copy_(reference.bias)
    x = torch.randn(3, 16)
    # captured outputs only (no replay): the transpose cannot be tried, so it must not be called identical
    c = E.Culprit("", "", reference, port, reference(x).detach(), port(x).detach())
    (hint,) = E.culprit_evidence(c)
    assert hint.id == "no-signature" and "layout op (weight (transpose 0,1))" in hint.message
    assert "weights are identical" not in hint.message


def _mlp(act: nn.Module) -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(8, 16), act, nn.Linear(16, 8)).eval()


def test_inner_activation_names_the_reference_and_port_functions_inside_an_mlp():
    from transformers.activations import QuickGELUActivation

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(8))
    (hint,) = E.inner_activation(_culprit(_mlp(QuickGELUActivation()), _mlp(nn.GELU()), x))
    assert (hint.evidence["reference"], hint.evidence["port"]) == (["quick-GELU"], ["exact GELU"])
    assert hint.evidence["port_module"] == "layers.0.norm.1" and hint.verified is None


def test_inner_activation_must_not_fire_without_a_different_function_of_the_same_input():
    from transformers.activations import QuickGELUActivation

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(8))
    # the same function on both sides
    assert E.inner_activation(_culprit(_mlp(nn.GELU()), _mlp(nn.GELU()), x)) == []
    # a different first projection: the port never sees the reference activation's input
    port = _mlp(nn.GELU())
    with torch.no_grad():
        port[0].weight.mul_(1.1)
    assert E.inner_activation(_culprit(_mlp(QuickGELUActivation()), port, x)) == []
    # a parameterless culprit belongs to E.activation
    assert E.inner_activation(_culprit(nn.GELU(), nn.SiLU(), x)) == []


class QuickGeluProjection(nn.Module):
    """Research code's ``ApproximateGELU``: a projection and x * sigmoid(1.702 x) of its output, inline."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x):
        x = self.proj(x)
        return x * torch.sigmoid(1.702 * x)


def test_a_fused_activation_is_named_by_the_diffusers_class_that_computes_it_and_verified():
    # the port built diffusers' tanh GELU where the research computes quick-GELU after the same projection:
    # the fix is diffusers' own ApproximateGELU holding the projection, verified by replay, never code
    from diffusers.models.activations import GELU

    torch.manual_seed(0)
    reference = nn.Sequential(QuickGeluProjection(8, 32), nn.Linear(32, 8))
    port = nn.Sequential(GELU(8, 32, approximate="tanh"), nn.Linear(32, 8))
    port.load_state_dict(reference.state_dict())
    x = torch.randn(4, 8) * 3
    report = bisect(reference, port, [x])
    assert report.culprit.port == "0", report.render()
    hint = next(h for h in report.culprit.hints if h.id == "activation")
    assert hint.verified and "diffusers.models.activations.ApproximateGELU(8, 32, bias=True)" in hint.fix
    assert "computes quick-GELU of its projection's output" in hint.message and "code" not in hint.message
    # must not fire: the same function on both sides
    same = nn.Sequential(GELU(8, 32, approximate="tanh"), nn.Linear(32, 8))
    same.load_state_dict(port.state_dict())
    assert bisect(port, same, [x]).verdict == "match"


def test_weights_the_culprit_lacks_are_looked_for_in_the_rest_of_the_port():
    # a conversion that swapped two layers of one shape: the culprit's reference tensors are in another port
    # layer, value for value, which is said (never "dropped or altered")
    from paritykit.bisection.evidence.weight_slices import weights

    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    port = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    port[0].load_state_dict(second.state_dict())
    port[2].load_state_dict(first.state_dict())
    x = torch.randn(2, 8)
    culprit = E.Culprit("0", "0", first, port[0], first(x), port[0](x), port_model=port)
    (hint,) = weights(culprit)
    assert "the port holds them elsewhere, value for value: 0.weight in port 2.weight" in hint.message
    assert "drops or alters" not in hint.message
    # what "equals no … layout op" was tried against is said, and what was not (a gather of scattered rows:
    # round 6/7, to_k/to_v taken per head from a fused to_kv were reported "used by no port parameter")
    assert "used by no port parameter" not in hint.message
    assert "a gather of scattered rows, or slices of several tensors joined, is not tried" in hint.message
    # must not fire: without the whole port there is nowhere else to look
    alone = E.Culprit("0", "0", first, port[0], first(x), port[0](x))
    (hint,) = weights(alone)
    assert "elsewhere" not in hint.message


class _Rope(enum.Enum):
    INTERLEAVED = "interleaved"
    SPLIT = "split"


class _RopeAttention(nn.Module):
    def __init__(self, rope_type):
        super().__init__()
        self.rope_type = rope_type
        self.proj = nn.Linear(4, 4)


def test_an_enum_setting_equals_the_string_of_its_value_or_name():
    # research code holds an enum (LTXRopeType.INTERLEAVED), the port a string ("interleaved"): one setting,
    # reported as twelve differing `module-config` hints before
    for port_value in ("interleaved", "INTERLEAVED", _Rope.INTERLEAVED):
        diffs = E.config_differences(
            _RopeAttention(_Rope.INTERLEAVED), _RopeAttention(port_value), [("", "")]
        )
        assert diffs == [], port_value
    # must not fire away: another value of the enum, or another string, still differs
    for port_value in ("split", _Rope.SPLIT, "interleave"):
        diffs = E.config_differences(
            _RopeAttention(_Rope.INTERLEAVED), _RopeAttention(port_value), [("", "")]
        )
        assert [d.name for d in diffs] == ["rope_type"], port_value


def test_a_per_frame_conv3d_and_a_conv2d_compare_their_settings_without_the_frame_axis():
    # round 13 (video-diffusion-pytorch): the research's Conv3d with kernel (1, 7, 7) against the port's
    # Conv2d applied per frame printed "[module-config] … dilation=(1, 1, 1), port dilation=(1, 1) …" 4 times
    from paritykit.bisection.evidence.settings import settings_diff

    per_frame = nn.Conv3d(4, 4, (1, 7, 7), padding=(0, 3, 3))
    assert settings_diff(per_frame, nn.Conv2d(4, 4, 7, padding=3)) == []
    assert settings_diff(nn.Conv2d(4, 4, 7, padding=3), per_frame) == []
    # must fire: a padding that differs in the axes both have, and a Conv3d whose frame axis does work
    assert [d.name for d in settings_diff(per_frame, nn.Conv2d(4, 4, 7, padding=2))] == ["padding"]
    temporal = nn.Conv3d(4, 4, (3, 7, 7), padding=(1, 3, 3))
    assert "kernel_size" in [d.name for d in settings_diff(temporal, nn.Conv2d(4, 4, 7, padding=3))]


class FusedQK(nn.Module):
    r"""A research attention whose q and k come from one fused projection ``to_qk`` (q first), as
    transfusion-pytorch writes it; v has its own."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.to_qk = nn.Linear(dim, 2 * dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        q, k = self.to_qk(x).chunk(2, dim=-1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ self.to_v(x)


class SplitQK(nn.Module):
    def __init__(self, dim: int = 8, scale: float = 1.0):
        super().__init__()
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.scale = scale

    def forward(self, x):
        q, k = self.to_q(x), self.to_k(x)
        return torch.softmax(q @ k.transpose(-1, -2) * self.scale, -1) @ self.to_v(x)


@pytest.mark.parametrize("swapped", [False, True], ids=["q-then-k", "swapped"])
def test_a_fused_qk_is_read_in_the_order_its_name_spells(swapped):
    # round 16 (transfusion): a correct split of `to_qk` was called "to_k holds chunk 1/2 (its name implies
    # chunk 0/2)", the two-chunk fused projection taken for k, v. The source's name spells q, k.
    torch.manual_seed(0)
    reference, port = FusedQK(), SplitQK(scale=1.5)  # a scale differs, so the culprit is this module
    q, k = reference.to_qk.weight.detach().chunk(2)
    with torch.no_grad():
        port.to_q.weight.copy_(k if swapped else q)
        port.to_k.weight.copy_(q if swapped else k)
        port.to_v.weight.copy_(reference.to_v.weight)
    hints = E.weights(_culprit(Holder(reference), Holder(port), torch.randn(2, 5, 8)))
    said = " ".join(h.message for h in hints)
    if swapped:
        assert "to_k.weight holds chunk 0/2 of reference" in said and "implies chunk 1/2" in said, said
    else:  # must not fire: q is chunk 0 and k chunk 1 of to_qk
        assert "conversion bug" not in said, said


def test_a_weight_whose_columns_are_reordered_is_said_as_columns():
    # round 35 (lerobot): a conversion that reordered a projection's input columns was said "after
    # permute_rows (dim 1)"
    torch.manual_seed(17)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(18))
    reference = nn.Linear(12, 6)
    slipped = nn.Linear(12, 6)
    order = [0, 1, 2, 3, 4, 5, 9, 10, 11, 6, 7, 8]  # the last two groups of three columns swapped
    with torch.no_grad():
        slipped.weight.copy_(reference.weight[:, order])
        slipped.bias.copy_(reference.bias)
    (hint,) = E.weights(_culprit(reference, slipped, x))
    assert hint.verified is True and "after its columns (dim 1) reordered" in hint.message, hint.message
    assert "permute_rows" not in hint.message
