"""paritykit.tracing.trace: capture is complete, non-destructive, leak-free, and round-trips through
to_dir."""

from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DConditionModel
from paritykit.base.errors import ParityKitError
from paritykit.tracing.skeleton import OutputDict
from paritykit.tracing.trace import Trace, capture
from torch import nn

from tests.bisect_pairs import conv_pair, dit_pair


def tiny_unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=16,
        sample_size=16,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
        norm_num_groups=16,
    ).eval()


@pytest.fixture(scope="module")
def unet_run():
    model = tiny_unet()
    sample = torch.randn(2, 4, 16, 16)
    timestep = torch.tensor([10, 20])
    context = torch.randn(2, 5, 16)
    with torch.no_grad():
        plain = model(sample, timestep, encoder_hidden_states=context).sample
        with capture(model) as trace:
            captured = model(sample, timestep, encoder_hidden_states=context).sample
    return model, (sample, timestep, context), plain, captured, trace


def hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks)
        + len(m._forward_pre_hooks)
        + len(getattr(m, "_forward_hooks_always_called", {}))
        for m in model.modules()
    )


def test_capture_is_bit_identical_and_removes_hooks(unet_run):
    model, _, plain, captured, trace = unet_run
    assert torch.equal(plain, captured)
    assert hook_count(model) == 0
    assert torch.equal(trace.root.output, plain)


def test_every_called_module_and_the_top_level_are_recorded_in_order(unet_run):
    model, _, _, _, trace = unet_run
    names = trace.names()
    assert names[0] == ""
    assert trace.root.parent is None and trace.root.depth == 0
    called = {r.module for r in trace}
    # Every module with parameters ran in this forward; all of them are recorded.
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            assert name in called, name
    # Start order is a pre-order of the call tree; completion order puts children first.
    child = trace["down_blocks.0.resnets.0.conv1"]
    assert child.parent == "down_blocks.0.resnets.0"
    assert trace[child.parent].order < child.order
    assert child.done < trace[child.parent].done
    assert trace.completion_order()[-1].name == ""


def test_inputs_keep_positional_and_keyword_arguments(unet_run):
    _, (sample, timestep, context), _, _, trace = unet_run
    root = trace.root
    assert torch.equal(root.inputs["args.0"], sample)
    assert torch.equal(root.inputs["kwargs.encoder_hidden_states"], context)
    args, kwargs = root.call_inputs()
    assert torch.equal(args[1], timestep) and torch.equal(kwargs["encoder_hidden_states"], context)
    attn = trace["down_blocks.0.attentions.0"]
    assert "kwargs.encoder_hidden_states" in attn.inputs
    assert attn.replayable


def test_nested_outputs_are_flattened_by_path(unet_run):
    _, _, _, _, trace = unet_run
    assert list(trace.root.output_keys) == ["output.sample"]
    assert type(trace.root.output_value()).__name__ == "UNet2DConditionOutput"
    # a down block returns (hidden_states, (residual, …)): a tuple nested in a tuple
    paths = list(trace["down_blocks.0"].output_keys)
    assert paths[0] == "output.0" and any(p.startswith("output.1.") for p in paths)


def test_repeated_calls_get_call_counts():
    reference, _, ((x,), _) = conv_pair()
    with torch.no_grad(), capture(reference) as trace:
        reference(x)
    assert "res.act" in trace and "res.act#1" in trace and "res.act#2" not in trace
    second = trace["res.act#1"]
    assert second.call == 1 and second.module == "res.act"
    assert [r.name for r in trace.calls("res.act")] == ["res.act", "res.act#1"]
    # the second SiLU sees the second GroupNorm's output
    assert torch.equal(second.inputs["args.0"], trace["res.out_norm"].output)


def test_same_tensor_is_stored_once():
    reference, _, ((x,), _) = conv_pair()
    with torch.no_grad(), capture(reference) as trace:
        reference(x)
    # the stem's output is the residual block's input: one stored copy
    assert trace["stem"].output_keys["output"] == trace["res"].input_keys["args.0"]


def test_a_dropped_trace_frees_its_tensors_at_once_and_a_kept_record_still_reads_them():
    # a trace and its records must not form a reference cycle: repeated captures (bisect, a loop of them)
    # would otherwise hold every dropped trace's copies until Python's cyclic collector happened to run
    import gc
    import weakref

    reference, _, ((x,), _) = conv_pair()
    gc.disable()
    try:
        with torch.no_grad(), capture(reference) as trace:
            expected = reference(x)
        record = trace[""]
        stored = weakref.ref(record.output)
        gone = weakref.ref(trace)
        del trace
        assert gone() is None
        assert torch.equal(record.output, expected)  # a record kept alone keeps what it reads
        del record
        assert stored() is None  # and with it gone, the copies go too
    finally:
        gc.enable()


def test_kwargs_nested_containers_and_none_keep_their_paths():
    class Takes(nn.Module):
        def forward(self, x, *, pair=None, extra=None, mask=None):
            return {"sum": x + pair[0] + extra["scale"], "same": x}

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Takes()

        def forward(self, x):
            return self.inner(x, pair=(x * 2, 3), extra={"scale": x - 1, "name": "k"}, mask=None)

    x = torch.randn(2, 3)
    model = Outer()
    with torch.no_grad(), capture(model) as trace:
        out = model(x)
    record = trace["inner"]
    assert set(record.input_keys) == {"args.0", "kwargs.pair.0", "kwargs.extra.scale"}
    assert set(record.output_keys) == {"output.sum", "output.same"}
    # x is the input, the "same" output and the outer call's input: one copy, one key
    assert record.input_keys["args.0"] == record.output_keys["output.same"] == trace[""].input_keys["args.0"]
    args, kwargs = record.call_inputs()
    assert torch.equal(args[0], x) and kwargs["pair"][1] == 3 and kwargs["mask"] is None
    assert kwargs["extra"]["name"] == "k" and torch.equal(kwargs["extra"]["scale"], x - 1)
    assert torch.equal(record.output_value()["sum"], out["sum"])


class InPlaceParent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.lin(x)
        y.mul_(3)  # changes the child's output after it was recorded
        return self.relu(y)  # changes its own input in place


@pytest.mark.parametrize("to_cpu", [True, False])
def test_in_place_changes_after_a_call_do_not_alter_what_was_recorded(to_cpu):
    torch.manual_seed(0)
    model = InPlaceParent().eval()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected_lin = model.lin(x).clone()
        with capture(model, to_cpu=to_cpu) as trace:
            out = model(x)
    assert torch.equal(trace["lin"].output, expected_lin)
    assert torch.equal(trace["relu"].inputs["args.0"], expected_lin * 3)
    assert torch.equal(trace["relu"].output, out)
    assert (trace["relu"].inputs["args.0"] < 0).any()


def test_hooks_are_removed_when_the_block_or_a_forward_raises():
    reference, _, ((x,), _) = conv_pair()

    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    with pytest.raises(ValueError), capture(reference):
        reference(x)
        raise ValueError("user error inside the block")
    assert hook_count(reference) == 0

    reference.res.act = Boom()
    with pytest.raises(RuntimeError, match="boom"), capture(reference):
        reference(x)
    assert hook_count(reference) == 0


def test_module_selection_by_glob_and_type():
    reference, _, ((x, c), _) = dit_pair()
    with torch.no_grad(), capture(reference, modules=["blocks.*.attn", nn.LayerNorm]) as trace:
        reference(x, c)
    modules = {r.module for r in trace}
    assert {"blocks.0.attn", "blocks.1.attn", "blocks.0.norm_a", "final_norm.norm"} <= modules
    assert "" not in modules and "blocks.0.attn.qkv" not in modules
    # records nest under the nearest captured caller only
    assert trace["blocks.0.norm_a"].parent is None


def test_outputs_only_capture_cannot_replay():
    reference, _, ((x,), _) = conv_pair()
    with torch.no_grad(), capture(reference, inputs=False) as trace:
        reference(x)
    assert trace["res"].inputs == {} and not trace["res"].replayable
    with pytest.raises(ParityKitError, match="inputs=False"):
        trace["res"].call_inputs()


def test_to_dir_round_trip_streams_shards(tmp_path, monkeypatch, unet_run):
    import paritykit.tracing.trace as trace_module

    model, (sample, timestep, context), plain, _, memory = unet_run
    monkeypatch.setattr(trace_module, "_SHARD_BYTES", 1 << 20)
    with torch.no_grad(), capture(model, to_dir=tmp_path / "t") as streamed:
        model(sample, timestep, encoder_hidden_states=context)
    assert len(list((tmp_path / "t").glob("tensors-*.safetensors"))) > 1
    assert not streamed._tensors.in_memory  # nothing kept in memory

    loaded = Trace.load(tmp_path / "t")
    assert loaded.names() == memory.names()
    assert loaded.modules.keys() == memory.modules.keys()
    for record in loaded:
        other = memory[record.name]
        assert (record.parent, record.order, record.done) == (other.parent, other.order, other.done)
        assert record.output_keys.keys() == other.output_keys.keys()
        for path, tensor in record.outputs.items():
            assert torch.equal(tensor, other.outputs[path]), (record.name, path)
    out = loaded.root.output_value()
    assert isinstance(out, OutputDict) and torch.equal(out.sample, plain) and torch.equal(out[0], plain)
    args, kwargs = loaded["down_blocks.0.attentions.0"].call_inputs()
    assert torch.equal(kwargs["encoder_hidden_states"], context)
    # a record taken from a trace that is not kept still reads its tensors from the folder
    assert torch.equal(Trace.load(tmp_path / "t")[""].output, plain)

    # an in-memory trace saves to the same format
    memory.save(tmp_path / "saved")
    again = Trace.load(tmp_path / "saved")
    assert torch.equal(again["mid_block"].output, memory["mid_block"].output)


def test_load_refuses_a_folder_that_is_not_a_trace(tmp_path):
    with pytest.raises(ParityKitError, match="not a paritykit trace folder"):
        Trace.load(tmp_path)
    (tmp_path / "trace.json").write_text("{broken")
    with pytest.raises(ParityKitError, match="unreadable"):
        Trace.load(tmp_path)


# ------------------------------------------------------------------------------------------- two machines

DIT_SPEC = """
import sys
sys.path.insert(0, {tests!r})
from bisect_pairs import dit_pair

def build_reference():
    return dit_pair("gelu")[0]

def build_port():
    return dit_pair("gelu")[1]

def make_inputs():
    return dit_pair("gelu")[2]
"""


def _cli(*args):
    from click.testing import CliRunner
    from paritykit.cli import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def _bisect_json(*args):
    import json

    result = _cli("bisect", *args, "--json")
    assert result.exit_code == 1, result.output
    return json.loads(result.stdout)


def test_two_machine_zoom_loop_follows_its_own_printed_commands(tmp_path, monkeypatch):
    import json
    import shlex
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    Path("SPEC.py").write_text(DIT_SPEC.format(tests=str(Path(__file__).resolve().parent)))
    for side, out in (("reference", "ref"), ("port", "port")):
        result = _cli("trace", "SPEC.py", "--side", side, "--out", out, "--levels", "blocks")
        assert result.exit_code == 0, result.output
    # self-describing: what was traced, how, and fingerprints of the weights it ran with
    about = Trace.load("ref").about
    assert (about["side"], about["spec"], about["levels"], about["inside"]) == (
        "reference",
        "SPEC.py",
        "blocks",
        None,
    )
    assert about["environment"]["torch"]
    fingerprints = json.loads(Path("port/weights.json").read_text())
    assert Trace.load("port").weights() is None  # hashes, not a copy
    assert set(Trace.load("port").weight_keys()) == {k for k, v in fingerprints.items() if "hash" in v}
    assert all(len(r.name.split(".")) <= 2 for r in Trace.load("ref"))  # blocks only: "", "blocks.0", …

    seen = []
    payload = _bisect_json("--traces", "ref", "port")
    while payload["next_steps"]:
        seen.append(payload["culprit"]["reference"])
        *traces, again = payload["next_steps"]
        for command in traces:
            words = shlex.split(command)
            assert words[:2] == ["paritykit", "trace"] and "--inside" in words
            result = _cli(*words[1:])
            assert result.exit_code == 0, result.output
        words = shlex.split(again)
        assert words[:3] == ["paritykit", "bisect", "--traces"] and words[-2] == "--zoom"
        payload = _bisect_json(*words[2:])
    assert seen == ["blocks.0", "blocks.0.mlp"]
    assert (payload["culprit"]["reference"], payload["culprit"]["port"]) == (
        "blocks.0.mlp.act",
        "transformer_blocks.0.ff.act",
    )
    # a full trace names the same culprit in one go, and asks for nothing more
    for side, out in (("reference", "ref_full"), ("port", "port_full")):
        assert _cli("trace", "SPEC.py", "--side", side, "--out", out).exit_code == 0
    full = _bisect_json("--traces", "ref_full", "port_full")
    assert full["culprit"]["reference"] == "blocks.0.mlp.act" and full["next_steps"] == []


def test_zoom_request_must_match_the_folders(tmp_path, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    Path("SPEC.py").write_text(DIT_SPEC.format(tests=str(Path(__file__).resolve().parent)))
    assert (
        _cli("trace", "SPEC.py", "--side", "reference", "--out", "r", "--inside", "blocks.1").exit_code == 0
    )
    assert _cli("trace", "SPEC.py", "--side", "port", "--out", "p", "--levels", "blocks").exit_code == 0
    wrong = _cli("bisect", "--traces", "r", "p", "--zoom", "blocks.0")
    assert wrong.exit_code == 2 and "traced inside 'blocks.1'" in wrong.output
    unknown = _cli("trace", "SPEC.py", "--side", "port", "--out", "q", "--inside", "no.such")
    assert unknown.exit_code == 2 and "--inside 'no.such'" in unknown.output


def test_comparing_loaded_traces_keeps_no_tensor_in_memory(tmp_path):
    from paritykit.bisection.entry import bisect_traces

    reference, port, (args, kwargs) = dit_pair("gelu")
    with torch.no_grad(), capture(reference, to_dir=tmp_path / "r"):
        reference(*args, **kwargs)
    with torch.no_grad(), capture(port, to_dir=tmp_path / "p"):
        port(*args, **kwargs)
    rt, pt = Trace.load(tmp_path / "r"), Trace.load(tmp_path / "p")
    report = bisect_traces(rt, pt, reference=reference, port=port)
    assert report.culprit.reference == "blocks.0.mlp.act"
    # every tensor was read from its shard when needed and dropped; the traces cache none
    assert rt.summary()["bytes_in_memory"] == pt.summary()["bytes_in_memory"] == 0
