"""Every edit kind of the repair grammar, in every tier, found and verified on a planted bug, and not on the
faithful port; every tier's edits come in cost order (the engine prunes by the first verified edit's cost).

Each reference is a plain torch module written here; each port is the same computation with one bug planted
the way a conversion or a port plants it (a weight stored transposed, inputs passed the other way round, …).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from paritykit.bisection.repair.edits import CONTROL_FACTOR, COSTS, TIERS, cost_of
from paritykit.bisection.repair.engine import GENERATORS, Budget, repair_site
from torch import nn

from tests.repair_sites import site_of


class KV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_k, self.to_v = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.cat([self.to_k(x), self.to_v(x)], dim=-1)


class Scaled(nn.Module):
    """``x * scale`` with a positive learned scale (a gain a checkpoint may store as its log)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return x * self.scale


class Mixed(nn.Module):
    """Two inputs of one shape that play different roles."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, y):
        return self.proj(x) + 2 * torch.tanh(y)


class Through(nn.Module):
    """A reference module seen through a planted change of its inputs or output."""

    def __init__(self, inner: nn.Module, before=None, after=None) -> None:
        super().__init__()
        self.inner, self.before, self.after = inner, before, after

    def forward(self, *args):
        args = self.before(*args) if self.before else args
        out = self.inner(*args)
        return self.after(out) if self.after else out


class Permuter(nn.Module):
    """A constructor argument that is a tuple (the dim order of a rearrangement), read back as a setting."""

    def __init__(self, dims: tuple[int, ...] = (0, 2, 1)) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return x.permute(self.dims).contiguous() * 1.5


class UsesTransposed(nn.Module):
    """Holds a Linear's weight as it is, but multiplies by it untransposed."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().clone())

    def forward(self, x):
        return x @ self.weight


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module).eval()


def _with(module: nn.Module, name: str, value: torch.Tensor) -> nn.Module:
    port = _copy(module)
    with torch.no_grad():
        port.get_parameter(name).copy_(value)
    return port


def _case(kind: str):
    """``(tier, kind, reference, port, inputs, site options)`` for one planted bug."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    lin = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    if kind == "swap-parameters":
        ref = KV().eval()
        port = _copy(ref)
        with torch.no_grad():
            for leaf in ("weight", "bias"):
                a, b = getattr(port.to_k, leaf), getattr(port.to_v, leaf)
                a_old = a.clone()
                a.copy_(b)
                b.copy_(a_old)
        return "parameters", ref, port, (x,), {}
    if kind == "transpose":
        return "parameters", lin, _with(lin, "0.weight", lin[0].weight.t()), (x,), {}
    if kind == "negate":
        return "parameters", lin, _with(lin, "2.weight", -lin[2].weight), (x,), {}
    if kind == "flip":
        ref = nn.Conv2d(2, 3, 3, padding=1).eval()
        return (
            "parameters",
            ref,
            _with(ref, "weight", ref.weight.flip((2, 3))),
            (torch.randn(1, 2, 5, 5),),
            {},
        )
    if kind == "permute-chunks-parameters":
        ref = nn.Linear(8, 8).eval()
        port = _with(ref, "weight", torch.cat(ref.weight.detach().chunk(2)[::-1]))
        with torch.no_grad():
            port.bias.copy_(torch.cat(ref.bias.detach().chunk(2)[::-1]))
        return "parameters", ref, port, (x,), {}
    if kind in ("exp", "log", "reciprocal"):
        ref = Scaled().eval()
        stored = {"exp": ref.scale.log(), "log": ref.scale.exp(), "reciprocal": ref.scale.reciprocal()}[kind]
        return "parameters", ref, _with(ref, "scale", stored), (x,), {}
    if kind == "rescale-parameters":
        ref = nn.Linear(8, 8, bias=False).eval()
        return "parameters", ref, _with(ref, "weight", 0.5 * ref.weight), (x,), {}
    if kind == "swap-inputs":
        ref = Mixed().eval()
        return "inputs", ref, Through(ref, before=lambda a, b: (b, a)).eval(), (x, torch.randn(4, 8)), {}
    if kind == "swap-dims":
        ref = nn.Linear(4, 4).eval()
        port = Through(ref, before=lambda a: (a.transpose(1, 2),)).eval()
        return "inputs", ref, port, (torch.randn(2, 4, 4),), {}
    if kind == "swap-halves":
        port = Through(lin, before=lambda a: (torch.cat(a.chunk(2, dim=1)[::-1], dim=1),)).eval()
        return "inputs", lin, port, (x,), {}
    if kind == "rescale-inputs":
        return "inputs", lin, Through(lin, before=lambda a: (2 * a,)).eval(), (x,), {}
    if kind == "permute-chunks-outputs":
        port = Through(lin, after=lambda out: torch.cat(out.chunk(2, dim=-1)[::-1], dim=-1)).eval()
        return "outputs", lin, port, (x,), {}
    if kind == "rescale-outputs":
        return "outputs", lin, Through(lin, after=lambda out: 2 * out).eval(), (x,), {}
    if kind == "input-residual":
        ref = nn.Linear(8, 8).eval()

        class Residual(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.inner = ref

            def forward(self, a):
                return self.inner(a) + a

        return "outputs", ref, Residual().eval(), (x,), {}
    if kind == "attribute":
        ref = nn.LayerNorm(16, eps=1e-6).eval()
        port = nn.LayerNorm(16, eps=1e-5).eval()
        return "settings", ref, port, (0.05 * torch.randn(3, 16),), {}
    if kind == "setting":
        return "settings", Permuter((0, 2, 1)), Permuter((0, 1, 2)), (torch.randn(2, 3, 3),), {}
    if kind == "uses":
        ref = nn.Linear(8, 8, bias=False).eval()
        return "uses", ref, UsesTransposed(ref).eval(), (x,), {"faithful": frozenset({"weight"})}
    raise AssertionError(kind)


KINDS = {
    "swap-parameters": "swap-parameters",
    "transpose": "transpose",
    "negate": "negate",
    "flip": "flip",
    "permute-chunks-parameters": "permute-chunks",
    "exp": "exp",
    "log": "log",
    "reciprocal": "reciprocal",
    "rescale-parameters": "rescale",
    "swap-inputs": "swap-inputs",
    "swap-dims": "swap-dims",
    "swap-halves": "swap-halves",
    "rescale-inputs": "rescale",
    "permute-chunks-outputs": "permute-chunks",
    "rescale-outputs": "rescale",
    "input-residual": "input-residual",
    "attribute": "attribute",
    "setting": "setting",
    "uses": "transpose",
}


def test_every_kind_of_the_cost_table_has_a_planted_case():
    planted = {(_case(case)[0], kind) for case, kind in KINDS.items()}
    assert {(tier, kind) for tier, kind in COSTS} <= planted
    assert {tier for tier, _ in planted} == set(TIERS)


@pytest.mark.parametrize("case", sorted(KINDS))
def test_each_edit_kind_is_found_and_verified_in_its_tier(case):
    tier, reference, port, inputs, extra = _case(case)
    site = site_of(port, reference, inputs, **extra)
    assert not site.compare(site.wanted, site.got).passed
    outcome = repair_site(site, Budget(100_000), tiers=(tier,))
    kinds = [(e.tier, e.kind) for e, _ in outcome.verified]
    assert (tier, KINDS[case]) in kinds, (kinds, outcome.ruled_out())
    edit, after = next((e, a) for e, a in outcome.verified if (e.tier, e.kind) == (tier, KINDS[case]))
    assert after < outcome.before
    # the site's module is untouched: every edit acted on a working copy and was undone
    with torch.no_grad():
        assert torch.equal(port(*inputs), site.got[0][1])


@pytest.mark.parametrize("tier", TIERS)
def test_no_tier_claims_a_bug_outside_the_grammar(tier):
    torch.manual_seed(3)
    reference = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    offset = torch.linspace(-1, 1, 8)  # an arbitrary per-channel offset: no edit of any tier expresses it
    port = Through(_copy(reference), after=lambda out: out + offset).eval()
    x = torch.randn(4, 8)
    site = site_of(port, reference, (x,), faithful=frozenset({"inner.0.weight"}))
    outcome = repair_site(site, Budget(100_000), tiers=(tier,))
    assert outcome.verified == [], [e.words for e, _ in outcome.verified]
    assert outcome.tried > 0 and "none verified" in outcome.ruled_out()


@pytest.mark.parametrize("case", ["rescale-inputs", "rescale-outputs", "rescale-parameters", "attribute"])
def test_each_tier_yields_its_edits_in_cost_order(case):
    for tier in TIERS:
        _, reference, port, inputs, extra = _case(case)
        site = site_of(port, reference, inputs, **extra)
        import copy

        costs = [edit.cost for edit in itertools.islice(GENERATORS[tier](site, copy.deepcopy(port)), 3000)]
        assert costs == sorted(costs), tier


def test_a_fitted_factor_has_its_two_controls_and_a_plain_edit_none():
    _, reference, port, inputs, _ = _case("rescale-outputs")
    site = site_of(port, reference, inputs)
    rescales = [e for e in GENERATORS["outputs"](site, port) if e.kind == "rescale"]
    assert rescales
    factor = rescales[0].parameters["factor"]
    controls = rescales[0].controls()
    assert [c.parameters["factor"] for c in controls] == [factor * CONTROL_FACTOR, factor / CONTROL_FACTOR]
    assert all(c.kind == "rescale" and c.tier == "outputs" for c in controls)
    swaps = [e for e in GENERATORS["outputs"](site, port) if e.kind == "permute-chunks"]
    assert swaps and swaps[0].controls() == []


def test_costs_of_uses_are_the_parameter_costs():
    assert cost_of("uses", "transpose") == cost_of("parameters", "transpose")
    assert cost_of("parameters", "permute-chunks", 4) == COSTS["parameters", "permute-chunks"] + 4
