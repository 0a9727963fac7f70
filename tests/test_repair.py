"""The repair search (paritykit.bisection.repair): verified edits only, none on faithful ports, ambiguity
shown, --no-repair honoured. References are independent torch.nn / research-style modules, not diffusers' own
code."""

from __future__ import annotations

import pytest
import torch
from paritykit.bisection.entry import bisect
from paritykit.bisection.repair.edits import chunk_orders, inverse, snapped
from paritykit.bisection.repair.engine import Budget, repair_site
from paritykit.bisection.repair.site import Site, held_parameters
from torch import nn

from tests.bisect_pairs import time_pair
from tests.repair_sites import site_of


def _linear_site(port: nn.Module, reference: nn.Module, x: torch.Tensor, **extra) -> Site:
    return site_of(port, reference, (x,), **extra)


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    reference = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    port = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    port.load_state_dict(reference.state_dict())
    return reference, port, torch.randn(4, 8)


def test_a_transposed_weight_is_found_and_verified():
    reference, port, x = _pair()
    with torch.no_grad():
        port[0].weight.copy_(port[0].weight.t().clone())
    outcome = repair_site(_linear_site(port, reference, x), Budget(100_000))
    (edit, after), *rest = outcome.verified
    assert not rest and (edit.tier, edit.kind, edit.target) == ("parameters", "transpose", "block.0.weight")
    assert after < 1e-5 < outcome.before
    hint = outcome.hints()[0]
    assert hint.verified is True and hint.id == "repair" and hint.fix == edit.words
    assert hint.to_dict()["residual"]["max_abs_after"] == after
    # the port itself is untouched: edits go to a copy
    assert torch.equal(port[0].weight, reference[0].weight.t())


def test_nothing_is_reported_for_a_faithful_port_or_a_bug_outside_the_grammar():
    reference, port, x = _pair()
    assert repair_site(_linear_site(port, reference, x), Budget(100_000)).verified == []
    reference2, port2, x2 = _pair(1)
    with torch.no_grad():
        port2[2].bias.add_(torch.linspace(-1, 1, 8))  # an arbitrary per-channel offset: no grammar edit
    outcome = repair_site(_linear_site(port2, reference2, x2), Budget(100_000))
    assert outcome.verified == [] and outcome.tried > 50
    assert "none verified" in outcome.ruled_out()


def test_a_norm_made_insensitive_by_a_rescaled_input_is_not_claimed():
    torch.manual_seed(2)
    reference = nn.LayerNorm(16, eps=1e-6).eval()
    port = nn.LayerNorm(16, eps=1e-5).eval()
    x = 0.05 * torch.randn(3, 16)  # small activations: the eps matters
    outcome = repair_site(_linear_site(port, reference, x), Budget(100_000))
    kinds = [(e.tier, e.kind, e.target) for e, _ in outcome.verified]
    # scaling the input up would hide the eps (any large factor passes): the control factors expose that
    assert kinds == [("settings", "attribute", "block.eps")], kinds
    assert outcome.verified[0][0].parameters == {"value": 1e-6, "was": 1e-5}


def test_two_edits_that_verify_equally_are_both_shown_as_ambiguous():
    # an odd, bias-free module: negating its input or its output fixes a negated output equally
    torch.manual_seed(3)
    reference = nn.Linear(6, 6, bias=False).eval()
    port = nn.Linear(6, 6, bias=False).eval()
    port.load_state_dict(reference.state_dict())
    port.register_forward_hook(lambda _m, _a, out: -out)
    x = torch.randn(5, 6)
    outcome = repair_site(
        _linear_site(port, reference, x, held=held_parameters(reference, port)), Budget(100_000)
    )
    assert outcome.ambiguous
    tiers = {e.tier for e, _ in outcome.verified}
    assert {"inputs", "outputs"} <= tiers
    hints = outcome.hints()
    assert all(h.verified and h.message.startswith("ambiguous:") for h in hints)
    assert all(h.evidence["ambiguous"] for h in hints)


def test_held_parameters_ignore_constant_tensors():
    reference, port = nn.LayerNorm(4), nn.LayerNorm(4)  # ones and zeros: equal by value, but say nothing
    assert held_parameters(reference, port) == {}
    reference, port, _ = _pair()
    assert held_parameters(reference, port)["0.weight"] == "0.weight"


def test_bisect_leads_with_the_verified_repair_and_no_repair_turns_it_off():
    reference, port, inputs = time_pair("remix")
    on = bisect(reference, port, inputs)
    assert on.culprit.hints[0].id == "repair" and on.culprit.hints[0].verified
    assert "fix (verified): time_mixer.scale = 1" in on.render()
    off = bisect(reference, port, inputs, repair=False)
    assert all(h.id != "repair" for h in off.culprit.hints)
    assert off.culprit.hints[0].id == "remix"


def test_faithful_ports_get_no_repair():
    reference, port, inputs = time_pair(None)
    report = bisect(reference, port, inputs)
    assert report.verdict == "match" and report.culprit is None


def test_cli_no_repair_flag(tmp_path, cli):
    from tests.test_bisect import write_spec

    spec = write_spec(tmp_path, "remix")
    with_repair = cli("bisect", spec)
    without = cli("bisect", spec, "--no-repair")
    assert with_repair.returncode == without.returncode == 1
    assert "fix (verified): time_mixer.scale = 1" in with_repair.stdout
    assert "[repair]" not in without.stdout and "[remix]" in without.stdout
    # a budget is taken (that it counts edits, so the same input gives the same search, is
    # test_the_budget_counts_edits_so_the_same_input_gives_the_same_search); below 1 it is bad input
    once = cli("bisect", spec, "--repair-budget", "2000")
    assert once.returncode == 1 and "fix (verified): time_mixer.scale = 1" in once.stdout
    bad = cli("bisect", spec, "--repair-budget", "0")
    assert bad.returncode == 2 and "--repair-budget" in bad.stderr and "Traceback" not in bad.stderr


def test_the_budget_counts_edits_so_the_same_input_gives_the_same_search():
    reference, port, x = _pair(1)
    with torch.no_grad():
        port[2].bias.add_(torch.linspace(-1, 1, 8))  # outside the grammar: the search runs to its end
    full = repair_site(_linear_site(port, reference, x), Budget(100_000))
    again = repair_site(_linear_site(port, reference, x), Budget(100_000))
    assert full.tried == again.tried > 20 and not full.exhausted
    cut = repair_site(_linear_site(port, reference, x), Budget(7))
    assert cut.tried == 7 and cut.exhausted
    assert "stopped at its budget of edits; --repair-budget N raises it" in cut.ruled_out()
    # the default grows with the place's size
    assert Budget.for_modules([port]).edits > Budget.for_modules([port[0]]).edits


def test_bisect_reports_are_identical_across_runs_and_honour_repair_budget():
    reference, port, inputs = time_pair("remix")
    first, second = bisect(reference, port, inputs), bisect(reference, port, inputs)
    assert first.culprit.hints[0].message == second.culprit.hints[0].message
    assert "edits tried" in first.culprit.hints[0].message
    starved = bisect(reference, port, inputs, repair_budget=1, catalogue=False)
    assert all(h.id != "repair" for h in starved.culprit.hints)
    assert "1 edits over" in starved.render() and "budget" in starved.render()


def test_a_timestep_in_other_units_is_named_as_such():
    # the research embeds t, the port t / 1000: the verified input rescale says so, by the argument's name
    reference, port, inputs = time_pair("units")
    report = bisect(reference, port, inputs)
    fix = report.culprit.hints[0]
    assert fix.verified and "its input timestep is a timestep in other units" in fix.message
    assert "t / 1000 (in [0, 1])" in fix.message and "multiplied by 1000 it matches" in fix.message


@pytest.mark.parametrize(("value", "label"), [(1000.0, "1000"), (0.18215, "0.18215 (SD VAE scaling factor)")])
def test_fitted_numbers_snap_to_simple_constants(value, label):
    assert snapped(value * 1.001)[0][1] == label
    assert snapped(value * 1.5) == [] or snapped(value * 1.5)[0][1] != label
    assert inverse("2", 2.0) == "1/2" and inverse("1/2", 0.5) == "2"


def test_chunk_orders_cover_every_permutation_up_to_four_then_swaps():
    assert len(list(chunk_orders(3))) == 5 and len(list(chunk_orders(4))) == 23
    assert len(list(chunk_orders(6))) == 15  # pairs only beyond four chunks


class QuickGELU(nn.Module):
    """OpenAI CLIP's QuickGELU (x · sigmoid(1.702 x)) after the FFN's first projection, as research code
    has it."""

    def __init__(self, proj: nn.Module):
        super().__init__()
        self.proj = proj

    def forward(self, x):
        h = self.proj(x)
        return h * torch.sigmoid(1.702 * h)


def test_a_string_setting_of_the_enclosing_diffusers_model_is_tried_over_its_values():
    # the culprit, a FeedForward's activation, has no config: its model's activation_fn builds it, so that
    # setting is the fix ("geglu-approximate" builds diffusers' ApproximateGELU, x · sigmoid(1.702 x))
    import copy

    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    port = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        sample_size=8,
        patch_size=2,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=10,
        norm_num_groups=4,
    ).eval()
    with torch.no_grad():
        for p in port.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    reference = copy.deepcopy(port)
    ff = reference.transformer_blocks[0].ff
    ff.net[0] = QuickGELU(ff.net[0].proj)
    inputs = ((torch.randn(1, 4, 8, 8),), {"timestep": torch.tensor([10]), "class_labels": torch.tensor([1])})
    report = bisect(reference, port, inputs)
    assert report.culprit.port == "transformer_blocks.0.ff.net.0"
    fix = report.culprit.hints[0]
    assert fix.verified and "DiTTransformer2DModel(activation_fn='geglu-approximate')" in fix.fix
    # a faithful port gets no such edit
    same = copy.deepcopy(port)
    assert bisect(same, port, inputs).verdict == "match"


def test_the_repair_progress_bar_stays_off_when_stderr_is_captured():
    # an agent reads `2>&1`: a redrawn bar there is kilobytes of noise before the verdict
    import subprocess
    import sys

    code = (
        "import time\n"
        "from paritykit.bisection.repair.engine import PROGRESS_AFTER, progress_bar\n"
        "with progress_bar(3) as bar:\n"
        "    time.sleep(PROGRESS_AFTER + 0.2)\n"
        "    for _ in range(3):\n"
        "        bar.update(1)\n"
        "print(bar.disable)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "True" and "repair search" not in run.stderr, run.stderr


class _TimesW(nn.Module):
    r"""A research projection that multiplies on the right (``x @ W``), its matrix stored ``shape``."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        torch.manual_seed(5)
        self.w = nn.Parameter(torch.randn(*shape) / 4)

    def forward(self, x):
        return x @ self.w.reshape(16, 16)


@pytest.mark.parametrize("shape", [(16, 16), (4, 4, 16)], ids=["same-shape", "heads-by-dim"])
def test_a_right_multiplied_matrix_loaded_untransposed_is_a_use_of_the_values_not_a_forward_bug(shape):
    # round 17 (flow_matching): w_o (heads, head_dim, dim) reshaped into a stock nn.Linear, not transposed,
    # was told "fix that use, not the weights"; the forward is torch's, the conversion must transpose
    reference = _TimesW(shape).eval()
    port = nn.Linear(16, 16, bias=False).eval()
    with torch.no_grad():
        port.weight.copy_(reference.w.reshape(16, 16))
    report = bisect(reference, port, ((torch.randn(3, 16),), {}))
    said = report.render()
    assert "fix that use, not the weights" not in said
    assert "load them so in the conversion" in said and "transpose" in said, said
    held = "the reference's values in their order (w, shape [4, 4, 16])" if len(shape) == 3 else "exactly"
    assert held in said, said


def test_below_the_top_level_the_search_takes_no_longer_than_the_capture_before_it(monkeypatch):
    # issue 47: a repair search of 888 edits took 100 s after a 37 s capture and replay, verifying nothing;
    # without --repair-budget it now stops once it has run as long as the bisect before it (after its first
    # edits), and says so
    import paritykit.bisection.repair.culprit_sites as sites

    reference, port, x = _pair(1)
    with torch.no_grad():
        port[2].bias.add_(torch.linspace(-1, 1, 8))  # outside the grammar: nothing verifies
    cut = repair_site(
        _linear_site(port, reference, x), Budget(100_000, seconds=0.0, first=3, clock="capture")
    )
    assert cut.tried == 3 and "as long as the capture and replays before it took" in cut.ruled_out()
    # bisect hands the search that clock (a culprit below the top level, no budget asked for) ...
    seen = []
    search = sites.repair_site

    def spy(site, budget=None, **options):
        seen.append((budget.clock, budget.seconds, budget.first))
        return search(site, budget, **options)

    monkeypatch.setattr(sites, "repair_site", spy)

    class Odd(nn.Linear):  # equal weights, another computation: no detector explains it, so the search runs
        def forward(self, x):
            return super().forward(x) + 0.05 * torch.sin(3 * x).sum(-1, keepdim=True)

    odd = Odd(8, 8)
    odd.load_state_dict(port[2].state_dict())
    port[2] = odd.eval()
    bisect(reference, port, ((x,), {}))
    assert seen and all(
        clock == "capture" and seconds >= sites.MIN_SECONDS and first > 0 for clock, seconds, first in seen
    ), seen
    # ... and must not: with a budget asked for, the edits are counted and no clock is read
    seen.clear()
    counted = bisect(reference, port, ((x,), {}), repair_budget=50).render()
    assert seen and all(seconds is None for _, seconds, _ in seen) and "stopped after" not in counted
