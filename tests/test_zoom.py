"""paritykit.bisection.zoom: bisect by levels names the same culprit as a full capture, while holding one
level only."""

from __future__ import annotations

import pytest
import torch
from paritykit.base.errors import ParityKitError
from paritykit.bisection.entry import bisect
from paritykit.bisection.zoom import ZOOM_BYTES, capture_level, level_children, use_zoom
from paritykit.tracing.trace import capture
from torch import nn

from tests.test_bisect import PAIRS, PLANTED


@pytest.mark.parametrize(
    ("family", "bug"), [(f, b) for f, b, *_ in PLANTED], ids=[f"{f}-{b}" for f, b, *_ in PLANTED]
)
def test_zoom_names_the_same_culprit_as_a_full_capture(family, bug):
    reference, port, inputs = PAIRS[family](bug)
    full = bisect(reference, port, inputs, levels="full")
    zoom = bisect(reference, port, inputs, levels="zoom")
    assert zoom.verdict == full.verdict == "diverge"
    a, b = full.culprit, zoom.culprit
    assert (b.reference, b.port, b.inline, b.test) == (a.reference, a.port, a.inline, a.test)
    assert b.children_passed == a.children_passed
    assert [h.id for h in b.hints] == [h.id for h in a.hints]
    assert b.max_abs == pytest.approx(a.max_abs)
    assert zoom.environment["levels"] == "zoom"
    # every block entered is an ancestor of the culprit (or the culprit itself): nothing else was re-run
    for entered in zoom.environment["entered"]:
        assert b.reference == entered or b.reference.startswith(entered + ".")


@pytest.mark.parametrize("family", sorted(PAIRS))
def test_zoom_on_faithful_ports_matches(family):
    reference, port, inputs = PAIRS[family](None)
    report = bisect(reference, port, inputs, levels="zoom")
    assert report.verdict == "match" and report.culprit is None
    assert report.environment["entered"] == []


def test_level_capture_holds_the_top_level_blocks_only():
    reference, _, (args, kwargs) = PAIRS["dit"]("gelu")
    level = capture_level(reference, args, kwargs)
    with torch.no_grad(), capture(reference) as full:
        reference(*args, **kwargs)
    blocks = level_children(reference)
    assert {r.module for r in level} == {"", *blocks}
    assert all(r.depth <= 1 for r in level)
    assert len(level) < len(full) and level.summary()["tensors"] < full.summary()["tensors"]
    # the blocks' outputs are the very values a full capture records
    for record in level:
        assert torch.equal(record.output, full[record.name].output)


def test_level_children_look_through_module_lists():
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(2, 2))
    model.add_module("blocks", nn.ModuleList([nn.Linear(2, 2), nn.ModuleDict({"a": nn.ReLU()})]))
    assert level_children(model) == ["embed", "blocks.0", "blocks.1.a"]
    assert level_children(model, "embed") == []


def test_levels_rule_follows_the_parameter_bytes_not_the_module_count():
    linear = nn.Linear(4, 4)  # 20 float32 parameters: 80 bytes
    assert not use_zoom("auto", linear, zoom_bytes=80) and use_zoom("auto", linear, zoom_bytes=79)
    many = nn.Sequential(*[nn.Identity() for _ in range(5000)])  # thousands of modules, no weight at all
    assert ZOOM_BYTES >= 1 << 30 and not use_zoom("auto", many)
    small, big = linear, nn.Linear(4, 4).half()
    assert use_zoom("auto", big, zoom_bytes=39) and not use_zoom("auto", big, zoom_bytes=40)  # by bytes
    assert use_zoom("zoom", small) and not use_zoom("full", big)
    with pytest.raises(ParityKitError, match="--levels"):
        use_zoom("deep", small)


def test_cli_levels_zoom_on_a_spec(tmp_path):
    import json

    from tests.test_bisect import run, write_spec

    spec = write_spec(tmp_path, "remix")
    zoomed = run("bisect", spec, "--levels", "zoom", "--json")
    full = run("bisect", spec, "--levels", "full", "--json")
    assert zoomed.exit_code == full.exit_code == 1, zoomed.output
    a, b = json.loads(full.stdout), json.loads(zoomed.stdout)
    assert b["environment"]["levels"] == "zoom" and "levels" not in a["environment"]
    assert (b["culprit"]["reference"], b["culprit"]["port"]) == (
        a["culprit"]["reference"],
        a["culprit"]["port"],
    )
    assert run("bisect", spec, "--levels", "deep").exit_code == 2


def test_zoom_finds_a_masked_divergence_on_the_way_down_and_not_on_a_correct_port():
    from tests.test_bisect_all import masked_vit, vit_output

    options = {"select_output": vit_output, "atol": 1e-4, "rtol": 0}
    reference, port, inputs = masked_vit("gelu")
    full = bisect(reference, port, inputs, levels="full", **options)
    zoom = bisect(reference, port, inputs, levels="zoom", **options)
    assert zoom.verdict == full.verdict == "masked" and zoom.exit_code == 1
    assert (zoom.culprit.reference, zoom.culprit.port) == (full.culprit.reference, full.culprit.port)
    assert zoom.culprits == [zoom.culprit]
    assert bisect(reference, port, inputs, levels="zoom", allow_masked=True, **options).exit_code == 0
    reference, port, inputs = masked_vit(None)
    correct = bisect(reference, port, inputs, levels="zoom", **options)
    assert correct.verdict == "match" and correct.culprit is None


def _chain(blocks: int, buggy: int | None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(8, 8), nn.GELU(approximate="tanh")) for _ in range(blocks))
    )
    if buggy is not None:
        model[buggy][1] = nn.Tanh()
    return model.eval()


@pytest.mark.parametrize("buggy", [None, 4])
def test_zoom_holds_replayed_outputs_of_failing_calls_only_and_each_boundary_tensor_once(buggy):
    from paritykit.bisection.zoom import ZoomSearch

    reference, port, x = _chain(6, None), _chain(6, buggy), torch.randn(3, 8)
    ref_trace, port_trace = capture_level(reference, (x,), {}), capture_level(port, (x,), {})
    # a block's output is the next block's input: one stored tensor, not two
    assert ref_trace["1"].input_keys["args.0"] == ref_trace["0"].output_keys["output"]
    assert ref_trace.summary()["tensors"] == 6 + 1
    zoom = ZoomSearch(reference, port, ref_trace, port_trace, rules=(), atol=None, rtol=None, ratio=10.0)
    located = zoom.locate()
    kept = {name for level in zoom.levels for name in level.searcher.replays}
    failing = {
        name for level in zoom.levels for name, r in level.searcher.results.items() if r.status == "fail"
    }
    tested = {name for level in zoom.levels for name in level.searcher.results}
    assert kept == failing and len(tested) >= (5 if buggy else 6)
    if buggy is None:
        assert kept == set()
    else:
        assert located.call.module == "4.1" and kept == {"4", "4.1"}


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
        self.unused = torch.nn.Sequential(torch.nn.Linear(4, 4))  # an encoder the decode never calls

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class _Namespace(torch.nn.Module):
    """Research style: the pipeline calls the model's blocks, never the model."""

    def __init__(self):
        super().__init__()
        self.model = _Blocks()

    def forward(self, x):
        for block in self.model.blocks:
            x = block(x)
        return x


def test_an_unused_submodule_does_not_stop_the_zoom_but_a_namespace_does():
    from paritykit.base.errors import ParityKitError
    from paritykit.bisection.entry import bisect

    x = [torch.randn(2, 4)]
    assert bisect(_Blocks(), _Blocks(), x, levels="zoom").verdict == "match"
    with pytest.raises(ParityKitError, match="model never called while the run went on"):
        bisect(_Namespace(), _Namespace(), x, levels="zoom")
    report = bisect(_Namespace(), _Namespace(), x, levels="auto")
    assert report.verdict == "match"
