"""Gradient parity: one forward + backward per side, gradients compared per aligned parameter."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from paritykit.base.errors import ParityKitError, UserCodeError
from paritykit.base.report import to_json
from paritykit.compare.gradients import compare_gradients
from torch import nn

from tests._pipelines import make_tiny_unet


class Branch(nn.Module):
    """proj -> LayerNorm -> fc, times an output scale read from the config."""

    def __init__(self, dim=8, eps=1e-5, out_scale=1.0):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.fc = nn.Linear(dim, dim)
        self.out_scale = out_scale

    def forward(self, x):
        return self.fc(self.norm(self.proj(x))) * self.out_scale


class TwoBranch(nn.Module):
    """Reference naming: ``left`` and ``right`` branches summed."""

    def __init__(self, left=None, right=None):
        super().__init__()
        self.left = left or Branch()
        self.right = right or Branch()

    def forward(self, x):
        return self.left(x) + self.right(x)


def _reference() -> TwoBranch:
    torch.manual_seed(0)
    model = TwoBranch()
    with torch.no_grad():  # trained-like norms: no two LayerNorms share their values
        for branch in (model.left, model.right):
            branch.norm.weight.normal_(1.0, 0.1)
            branch.norm.bias.normal_(0.0, 0.1)
    return model


# a linear loss keeps each branch's gradients independent of the other branch's output
WEIGHTS = torch.linspace(-1, 1, 8)


def linear_loss(out):
    return (out * WEIGHTS).sum()


def _inputs():
    # small activations, so a LayerNorm eps of 1e-2 instead of 1e-5 clearly matters
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 0.05


def test_identical_models_pass_with_every_parameter_compared():
    ref = _reference()
    port = copy.deepcopy(ref)
    result = compare_gradients(ref, port, _inputs(), linear_loss, None)
    assert result.exit_code == 0 and result.passed
    assert [p.reference for p in result.pairs] == [n for n, _ in ref.named_parameters()]
    assert all(p.comparison.max_abs == 0 for p in result.pairs)
    assert result.loss_reference == result.loss_port
    payload = json.loads(to_json(result.to_dict()))
    assert payload["schema_version"] == 1 and payload["verdict"] == "match" and payload["aligned"] == 12
    assert "environment" in payload


def test_layernorm_eps_fails_on_the_parameters_it_touches():
    ref = _reference()
    port = copy.deepcopy(ref)
    port.left.norm.eps = 1e-2
    result = compare_gradients(ref, port, _inputs(), linear_loss)
    assert result.exit_code == 1
    failed = {p.reference for p in result.failures}
    # the gradient reaches left.fc.bias and left.norm.bias without passing through the normalised values
    assert failed == {"left.proj.weight", "left.proj.bias", "left.norm.weight", "left.fc.weight"}
    assert not any(name.startswith("right.") for name in failed)
    assert "DIVERGE" in result.render() and "left.norm.weight" in result.render()


def test_output_scale_from_a_default_fails_its_branch_with_a_constant_scale_hint():
    ref = _reference()
    ref.right.out_scale = 0.5  # the reference config says 0.5 ...
    port = copy.deepcopy(ref)
    port.right.out_scale = 1.0  # ... the port reads the default
    result = compare_gradients(ref, port, _inputs(), linear_loss)
    failed = {p.reference for p in result.failures}
    assert failed == {n for n, _ in ref.named_parameters() if n.startswith("right.")}
    pair = next(p for p in result.pairs if p.reference == "right.fc.weight")
    assert pair.comparison.cosine == pytest.approx(1.0, abs=1e-6)  # same direction, twice the length
    assert "constant-scale" in [h.id for h in pair.comparison.hints]
    assert not result.loss_passed


# --- differently named port
# ----------------------------------------------------------------------------------
class PortBranch(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.linear_in = nn.Linear(dim, dim)
        self.layer_norm = nn.LayerNorm(dim)
        self.linear_out = nn.Linear(dim, dim)

    def forward(self, x):
        return self.linear_out(self.layer_norm(self.linear_in(x)))


class PortModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList([PortBranch(), PortBranch()])

    def forward(self, hidden_states):
        return self.branches[0](hidden_states) + self.branches[1](hidden_states)


RULES = [
    (r"^left\.", "branches.0."),
    (r"^right\.", "branches.1."),
    (r"\.proj\.", ".linear_in."),
    (r"\.norm\.", ".layer_norm."),
    (r"\.fc\.", ".linear_out."),
]


def _port_from(ref: TwoBranch) -> PortModel:
    from paritykit.base.naming import rename_all

    port = PortModel()
    names = rename_all([n for n, _ in ref.named_parameters()], RULES)
    port.load_state_dict({names[k]: v for k, v in ref.state_dict().items()})
    return port


def test_differently_named_models_align_by_rules_and_by_mapping():
    ref = _reference()
    port = _port_from(ref)
    by_rules = compare_gradients(
        ref, port, _inputs(), linear_loss, RULES, port_inputs=lambda a, k: {"hidden_states": a[0]}
    )
    assert by_rules.exit_code == 0 and by_rules.how_aligned == "rules" and len(by_rules.pairs) == 12
    assert ("left.norm.weight", "branches.0.layer_norm.weight") in [
        (p.reference, p.port) for p in by_rules.pairs
    ]

    port.branches[0].layer_norm.eps = 1e-2
    broken = compare_gradients(
        ref, port, _inputs(), linear_loss, RULES, port_inputs=lambda a, k: {"hidden_states": a[0]}
    )
    assert {p.port for p in broken.failures} == {
        "branches.0.linear_in.weight",
        "branches.0.linear_in.bias",
        "branches.0.layer_norm.weight",
        "branches.0.linear_out.weight",
    }

    port = _port_from(ref)
    mapping = {
        "right.norm.weight": "branches.1.layer_norm.weight",
        "right.fc.weight": "branches.1.linear_out.weight",
    }
    by_map = compare_gradients(ref, port, ((_inputs(),), {}), linear_loss, mapping)
    assert by_map.how_aligned == "mapping" and [p.port for p in by_map.pairs] == list(mapping.values())
    assert by_map.exit_code == 0  # only the listed (right-branch) parameters are compared


def test_module_alignment_from_align_modules_pairs_parameters():
    from paritykit.bisection.align import align_modules

    ref = _reference()
    port = _port_from(ref)
    alignment = align_modules(ref, port)  # by parameter values: the names share nothing
    result = compare_gradients(ref, port, _inputs(), linear_loss, alignment)
    assert result.how_aligned == "modules" and result.exit_code == 0, result.render()
    assert ("left.proj.weight", "branches.0.linear_in.weight") in [
        (p.reference, p.port) for p in result.pairs
    ]
    assert len(result.pairs) == 12
    port.branches[1].layer_norm.eps = 1e-2
    broken = compare_gradients(ref, port, _inputs(), linear_loss, alignment)
    assert "right.norm.weight" in {p.reference for p in broken.failures}
    assert not any(p.reference.startswith("left.") for p in broken.failures)


def test_incomplete_rules_leave_parameters_with_gradients_unaligned():
    ref = _reference()
    port = _port_from(ref)
    result = compare_gradients(ref, port, _inputs(), linear_loss, RULES[:-1])
    assert result.exit_code == 1
    assert "left.fc.weight" in result.only_reference and "branches.0.linear_out.weight" in result.only_port
    assert "left.fc.weight" in result.unaligned_with_gradient
    assert "no counterpart" in result.render()


# --- fused <-> split parameters through a conversion callable
# ------------------------------------------------
class FusedAttention(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.out(attn @ v)


class SplitAttention(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        attn = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.to_out(attn @ v)


def convert(state_dict):
    out = {}
    for kind in ("weight", "bias"):
        q, k, v = state_dict[f"qkv.{kind}"].chunk(3, dim=0)
        out.update(
            {
                f"to_q.{kind}": q,
                f"to_k.{kind}": k,
                f"to_v.{kind}": v,
                f"to_out.{kind}": state_dict[f"out.{kind}"],
            }
        )
    return out


def test_fused_qkv_aligns_with_split_projections_through_the_conversion():
    torch.manual_seed(0)
    ref = FusedAttention()
    port = SplitAttention()
    port.load_state_dict(convert(ref.state_dict()))
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    target = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(4))

    def mse(out):
        return torch.nn.functional.mse_loss(out, target)

    result = compare_gradients(ref, port, x, mse, convert, atol=1e-6, rtol=1e-5)
    assert result.how_aligned == "conversion" and len(result.pairs) == 8
    assert result.exit_code == 0, result.render()
    # the conversion inferred from the weights' values aligns the gradients the same way
    from paritykit.forensics.conversion.matching import infer_conversion_map

    inferred = infer_conversion_map(ref, port)
    by_map = compare_gradients(ref, port, x, mse, inferred, atol=1e-6, rtol=1e-5)
    assert by_map.exit_code == 0 and {p.port for p in by_map.pairs} == {p.port for p in result.pairs}
    port.to_k.weight.data[0, 0] += 0.5  # a wrong weight changes every gradient it feeds into
    assert compare_gradients(ref, port, x, mse, convert, atol=1e-6, rtol=1e-5).exit_code == 1


# --- real diffusers model
# ------------------------------------------------------------------------------------
def test_tiny_unet_groupnorm_eps_is_caught_and_state_is_left_untouched():
    unet = make_tiny_unet(sample_size=8, attention=False)
    port = copy.deepcopy(unet)
    sample = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    inputs = {"sample": sample, "timestep": torch.tensor([10, 500])}

    def loss(out):
        return out.sample.pow(2).mean()

    # pre-existing grads and the global RNG state survive the comparison
    sentinel = torch.full_like(unet.conv_in.weight, 7.0)
    unet.conv_in.weight.grad = sentinel
    rng = torch.get_rng_state()
    same = compare_gradients(unet, port, inputs, loss)
    assert same.exit_code == 0 and len(same.pairs) == len(list(unet.parameters()))
    assert unet.conv_in.weight.grad is sentinel and port.conv_in.weight.grad is None
    assert torch.equal(rng, torch.get_rng_state())

    port.up_blocks[0].resnets[0].norm2.eps = 1e-1
    result = compare_gradients(unet, port, inputs, loss)
    assert result.exit_code == 1
    assert "up_blocks.0.resnets.0.norm2.weight" in {p.reference for p in result.failures}
    assert not result.loss_passed


def test_dropout_in_train_mode_matches_under_the_shared_seed():
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8)).train()
    port = copy.deepcopy(ref)
    assert compare_gradients(ref, port, _inputs(), lambda out: out.sum()).exit_code == 0


def test_bad_loss_user_errors_and_bad_alignment():
    ref = _reference()
    port = copy.deepcopy(ref)
    with pytest.raises(ParityKitError, match="scalar"):
        compare_gradients(ref, port, _inputs(), lambda out: out)
    with pytest.raises(UserCodeError, match="reference forward or loss_fn raised"):
        compare_gradients(ref, port, torch.randn(3, 5), linear_loss)
    with pytest.raises(ParityKitError, match="left.nope"):
        compare_gradients(ref, port, _inputs(), linear_loss, {"left.nope": "left.fc.weight"})
    with pytest.raises(ParityKitError, match="torch.nn.Module"):
        compare_gradients(ref, "port", _inputs(), linear_loss)
