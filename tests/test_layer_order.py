"""Layer provenance (paritykit.forensics.conversion.layer_order): a port that holds a research checkpoint's
blocks in another order (shards loaded in text order) is said first, by weights map and bisect; a renumbering
that keeps the order is not."""

from __future__ import annotations

import re

import pytest
import torch
from paritykit.forensics.conversion.layer_order import layer_orders, reordered

from tests.research import PortDenoise, ResearchDenoise, wan_dit_pair_built

NAMES = (".attn.weight", ".attn.bias", ".mlp.weight")


def pairs(index_map, source="blocks", target="layers"):
    return [(f"{source}.{j}{rest}", f"{target}.{i}{rest}") for i, j in index_map.items() for rest in NAMES]


def test_a_text_sorted_load_is_named_and_a_renumbering_is_not():
    text = dict(enumerate(sorted(range(12), key=str)))
    (order,) = reordered(pairs(text))
    assert order.text_sorted and not order.monotone
    assert order.words().startswith(
        "the port's layers are the reference's blocks in another order (port layers ← reference blocks):"
        " 2 ← 10, 3 ← 11, 4 ← 2, 5 ← 3, …; the indices were sorted as text"
    )
    assert (
        order.target_name("blocks.10.attn") == "layers.2.attn" and order.source_name("layers.4") == "blocks.2"
    )
    swapped = {0: 0, 1: 2, 2: 1, 3: 3}
    (order,) = reordered(pairs(swapped))
    assert not order.text_sorted and "1 ← 2, 2 ← 1" in order.words()
    # must not fire: the same order, the same order with an offset, layers gathered many-to-one (LDM's
    # input_blocks into diffusers' down_blocks), layers not built alike, too few layers
    assert reordered(pairs({i: i for i in range(6)})) == []
    assert reordered(pairs({i: i + 1 for i in range(6)})) == []
    gathered = [(f"input_blocks.{j}.w{j}", f"down_blocks.{(j - 1) // 3}.w{j}") for j in range(1, 10)]
    assert layer_orders(gathered) == []
    unalike = [(f"blocks.{j}.w{j}", f"layers.{i}.w{j}") for i, j in swapped.items()]
    assert reordered(unalike) == []
    assert reordered(pairs({0: 1, 1: 0})) == []


@pytest.fixture(scope="module")
def text_ordered_wan():
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    research, port, inputs = wan_dit_pair_built(num_layers=12, text_order=True)
    return research, port, convert_wan_transformer_to_diffusers(research.state_dict()), inputs


def test_weights_map_says_the_layer_order_first_and_exits_1(tmp_path, text_ordered_wan):
    from paritykit.forensics.conversion.matching import infer_conversion_map as map_weights
    from safetensors.torch import save_file

    research, port, converted, _ = text_ordered_wan
    source = {k: v.contiguous() for k, v in research.state_dict().items() if not v.is_complex()}
    save_file(source, str(tmp_path / "research.safetensors"))
    save_file({k: v.contiguous() for k, v in port.state_dict().items()}, str(tmp_path / "port.safetensors"))
    save_file({k: v.contiguous() for k, v in converted.items()}, str(tmp_path / "right.safetensors"))
    report = map_weights(
        str(tmp_path / "research.safetensors"), str(tmp_path / "port.safetensors"), allow_ambiguous=True
    )
    assert report.exit_code == 1
    lines = report.render().splitlines()
    said = next(i for i, line in enumerate(lines) if line.startswith("layer order:"))
    assert said < next(i for i, line in enumerate(lines) if line.startswith("source pattern"))  # first
    assert lines[said].startswith("layer order: the target's blocks are the source's blocks in another order")
    assert "2 ← 10, 3 ←" in lines[said]
    folded = [line for line in lines if "blocks.<i←j>.attn1.to_q" in line]
    assert len(folded) == 1 and folded[0].split()[-1] == "24"  # twelve layers' rule in one row
    right = map_weights(
        str(tmp_path / "research.safetensors"), str(tmp_path / "right.safetensors"), allow_ambiguous=True
    )
    assert right.exit_code == 0 and "layer order" not in right.render()


def test_bisect_says_the_layer_order_first_and_aligns_by_it(text_ordered_wan):
    from paritykit.bisection.entry import bisect

    research, port, _, inputs = text_ordered_wan
    report = bisect(ResearchDenoise(research), PortDenoise(port), inputs)
    assert report.verdict == "diverge"
    text = report.render()
    assert text.splitlines()[1].startswith(
        "layer order: the port's dit.blocks are the reference's dit.blocks"
    )
    pairs = {p.reference: (p.port, p.how) for p in report.alignment.pairs}
    assert pairs["dit.blocks.10"] == ("dit.blocks.2", "layer order")
    assert pairs["dit.blocks.2.norm1"] == ("dit.blocks.4.norm1", "layer order")
    # round 20 (tortoise): "96 aligned (4 by names, 63 by weights, 26 by order)" left out the 3 by layer order
    summary = report.alignment.summary()
    counted = sum(int(n) for n in re.findall(r"(\d+) by ", summary))
    assert counted == len(report.alignment.pairs) and " by layer order" in summary, summary
    assert report.culprit.reference == "" and "called in another order" in text
    assert "the tensor its name implies" not in text and "forward code" not in text
    assert report.culprit.hints[0].id == "layer-order"
    fed = [h for h in report.culprit.hints if h.id == "inline-input"]
    assert fed and "the port feeds it the output of dit.blocks.3, aligned with the reference's" in (
        fed[0].message
    )
    # the wiring is a lead: the measurement is that the two inputs differ (round 5, HunyuanVideo: a pairing
    # by order made "the port wires this call to another input" false)
    assert "lead: the call is wired to another input on one side" in fed[0].message
    assert "the port wires this call" not in fed[0].message
    # a model this small is captured whole (levels=auto zooms above 1 GiB of parameters only); asked to zoom,
    # the research pipeline calling the model's blocks, never the model, leaves levels unpaired: one line
    assert "levels" not in report.environment
    from paritykit.base.errors import ParityKitError

    with pytest.raises(ParityKitError, match="--levels zoom: dit never called .*; use --levels full"):
        bisect(ResearchDenoise(research), PortDenoise(port), inputs, levels="zoom")


def test_trace_folders_hold_weight_hashes_and_bisect_reads_the_layer_order_from_them(
    tmp_path, text_ordered_wan
):
    from paritykit.bisection.entry import bisect_traces
    from paritykit.bisection.zoom import write_fingerprints
    from paritykit.tracing.trace import Trace, capture

    research, port, converted, inputs = text_ordered_wan
    folders = {}
    for side, model in (("r", ResearchDenoise(research)), ("p", PortDenoise(port))):
        with torch.no_grad(), capture(model, to_dir=tmp_path / side):
            model(*inputs)
        assert write_fingerprints(model, tmp_path / side) == len(model.state_dict())
        folders[side] = Trace.load(tmp_path / side)
        assert folders[side].weights() is None  # no copy of the weights, their hashes only
    weight_bytes = sum(t.numel() * t.element_size() for t in port.state_dict().values())
    held = sum(f.stat().st_size for f in (tmp_path / "p").iterdir() if f.name.startswith("weights"))
    assert held < weight_bytes / 20
    report = bisect_traces(folders["r"], folders["p"])
    assert (
        report.render()
        .splitlines()[1]
        .startswith("layer order: the port's dit.blocks are the reference's dit.blocks")
    )
    assert report.alignment.pair_of("dit.blocks.10").port == "dit.blocks.2"
    # must not fire: the port built from the converter's weights holds the blocks in the reference's order
    port.load_state_dict(converted)
    fixed = PortDenoise(port)
    with torch.no_grad(), capture(fixed, to_dir=tmp_path / "q"):
        fixed(*inputs)
    write_fingerprints(port, tmp_path / "q")
    right = bisect_traces(folders["r"], Trace.load(tmp_path / "q"))
    assert (
        "layer order" not in right.render()
        and right.alignment.pair_of("dit.blocks.10").port == "dit.blocks.10"
    )


def test_a_reversed_store_is_a_renumbering_and_call_order_decides_the_claim():
    from paritykit.forensics.conversion.layer_order import LayerOrder, with_calls

    # LDM's decoder stores up.3 first where diffusers' up_blocks.0 is: reversed whole, iterated reversed
    assert reordered(pairs({i: 3 - i for i in range(4)}, "up", "up_blocks")) == []
    text = LayerOrder("blocks", "blocks", dict(enumerate(sorted(range(12), key=str))))
    ref_calls = [f"blocks.{j}" for j in range(12)]
    port_calls = [f"blocks.{i}" for i in range(12)]
    assert with_calls(text, ref_calls, port_calls).calls_differ is True
    # the port calls its layers in the order of the reference layers they hold: consistent, no claim
    held_order = [f"blocks.{i}" for i in sorted(range(12), key=lambda i: text.index_map[i])]
    assert with_calls(text, ref_calls, held_order).calls_differ is False


class Stack(torch.nn.Module):
    """Twelve residual blocks of one kind: a research model whose checkpoint is read block by block."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(12)
        )
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize("levels", ["full", "zoom"])
def test_bisect_leads_with_the_layer_order_at_every_level_setting(levels):
    # shards loaded in text order, bisected by levels or whole: the layer order leads the report either way
    from paritykit.bisection.entry import bisect

    torch.manual_seed(0)
    reference, port = Stack(), Stack()
    text = sorted(range(12), key=str)
    port.load_state_dict(
        {
            (
                f"blocks.{text.index(int(k.split('.')[1]))}." + k.split(".", 2)[2]
                if k.startswith("blocks")
                else k
            ): v
            for k, v in reference.state_dict().items()
        }
    )
    report = bisect(reference, port, [torch.randn(2, 8)], levels=levels)
    assert report.verdict == "diverge"
    lines = report.render().splitlines()
    assert lines[1].startswith("layer order: the port's blocks are the reference's blocks in another order")
    assert report.culprit is None or report.culprit.confidence != "low"
