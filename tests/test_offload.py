"""Capture and bisect on models whose weights accelerate keeps on `meta` (disk / CPU offload, dispatch_model)
and on diffusers' group offload (run on the CPU here).

What these tests prove: our hooks coexist with accelerate's and diffusers' (theirs stay in place, ours are
removed), captured outputs are bit-identical to an uncaptured run, replay on offloaded modules works (their
hooks load the weights per call), alignment by weights reads offloaded tensors through the hooks, and the
zoom names the same culprit as on the in-memory models. The memory bound is proved by
``test_offloaded_alignment_memory_stays_below_the_weights`` (weights of ~400 MB, in a child process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paritykit.bisection.entry import bisect
from paritykit.bisection.zoom import use_zoom
from paritykit.tracing.split_traces import ModelWeights
from paritykit.tracing.trace import capture

from tests.bisect_pairs import dit_pair

accelerate = pytest.importorskip("accelerate")


def _hooked(model) -> int:
    return sum(hasattr(m, "_hf_hook") for m in model.modules())


def _ours(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _offload(kind, model, folder):
    if kind == "disk_offload":
        accelerate.disk_offload(model, str(folder), execution_device=torch.device("cpu"))
    else:  # a device map mixing CPU and disk entries
        names = [n for n, _ in model.named_children()]
        device_map = {n: "disk" if i % 2 == 0 else "cpu" for i, n in enumerate(names)}
        accelerate.dispatch_model(model, device_map=device_map, offload_dir=str(folder))
    return model


@pytest.mark.parametrize("kind", ["disk_offload", "dispatch_model"])
def test_capture_on_offloaded_weights_is_bit_identical_and_leaves_their_hooks(tmp_path, kind):
    reference, _, (args, kwargs) = dit_pair("gelu")
    with torch.no_grad():
        plain = reference(*args, **kwargs)
    offloaded = _offload(kind, reference, tmp_path)
    assert any(p.device.type == "meta" for p in offloaded.parameters())
    theirs, before = _hooked(offloaded), _ours(offloaded)
    with torch.no_grad():
        with capture(offloaded) as trace:
            captured = offloaded(*args, **kwargs)
        again = offloaded(*args, **kwargs)
    assert torch.equal(captured, plain) and torch.equal(again, plain)
    assert torch.equal(trace.root.output, plain) and len(trace) > 10
    assert _hooked(offloaded) == theirs and _ours(offloaded) == before


@pytest.mark.parametrize("kind", ["disk_offload", "dispatch_model"])
def test_offloaded_weights_are_read_through_the_hooks_one_at_a_time(tmp_path, kind):
    reference, _, _ = dit_pair(None)
    expected = {k: v.clone() for k, v in reference.state_dict().items()}
    weights = ModelWeights(_offload(kind, reference, tmp_path))
    assert weights.offloaded and set(weights) == set(expected)
    # building the mapping loads nothing: its entries are meta placeholders or the model's own tensors
    assert all(t.device.type == "meta" or t.data_ptr() for t in weights._entries.values())
    for name in weights:
        assert torch.equal(weights[name], expected[name]), name
    assert not ModelWeights(dit_pair(None)[0]).offloaded


@pytest.mark.parametrize("kind", ["disk_offload", "dispatch_model"])
def test_bisect_names_the_culprit_on_offloaded_models(tmp_path, kind):
    reference, port, inputs = dit_pair("gelu")
    in_memory = bisect(reference, port, inputs, levels="full").culprit
    _offload(kind, reference, tmp_path / "ref")
    _offload(kind, port, tmp_path / "port")
    assert use_zoom("auto", reference)  # offloaded weights choose the zoom
    report = bisect(reference, port, inputs)
    culprit = report.culprit
    assert (culprit.reference, culprit.port) == (in_memory.reference, in_memory.port)
    assert culprit.test == "replay" and culprit.max_abs == pytest.approx(in_memory.max_abs)
    # the two sides name their modules differently: the weights pass paired them from the offloaded values
    assert any(p.how == "weights" for p in report.alignment.pairs)


def tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    ).eval()
    inputs = {
        "hidden_states": torch.randn(1, 16, 4),
        "encoder_hidden_states": torch.randn(1, 5, 16),
        "pooled_projections": torch.randn(1, 8),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(5, 3),
    }
    return model, inputs


def test_diffusers_group_offload_on_cpu_coexists_with_capture():
    model, inputs = tiny_flux()
    with torch.no_grad():
        plain = model(**inputs).sample
    model.enable_group_offload(
        onload_device=torch.device("cpu"),
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
    )
    registry = model._diffusers_hook
    with torch.no_grad():
        with capture(model) as trace:
            captured = model(**inputs).sample
        again = model(**inputs).sample
    assert torch.equal(captured, plain) and torch.equal(again, plain)
    assert model._diffusers_hook is registry and "single_transformer_blocks.1" in trace


@pytest.mark.parametrize("kind", ["disk_offload", "dispatch_model"])
def test_full_capture_aligns_offloaded_models_by_weights(tmp_path, kind):
    # levels="full" skips the zoom: alignment must read the offloaded values itself, not state_dict()'s meta
    reference, port, inputs = dit_pair("gelu")
    in_memory = bisect(reference, port, inputs, levels="full")
    _offload(kind, reference, tmp_path / "ref")
    _offload(kind, port, tmp_path / "port")
    report = bisect(reference, port, inputs, levels="full")
    by_weights = {(p.reference, p.port) for p in in_memory.alignment.pairs if p.how == "weights"}
    assert by_weights
    assert by_weights == {(p.reference, p.port) for p in report.alignment.pairs if p.how == "weights"}
    assert (report.culprit.reference, report.culprit.port) == (
        in_memory.culprit.reference,
        in_memory.culprit.port,
    )


def _child(mode: str, folder: Path, env: dict[str, str]) -> str:
    script = Path(__file__).with_name("offload_memory_child.py")
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]), **env}
    done = subprocess.run(
        [sys.executable, str(script), mode, str(folder)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
def test_offloaded_alignment_memory_stays_below_the_weights(tmp_path):
    r"""Memory limit of this test: capturing, aligning by weights and zooming two disk-offloaded models (12
    Linear 2048x2048 each, ~403 MB of float32 weights in all, differently named) raises the child process's
    peak RSS by less than 50% of the weights' bytes; it measured ~50 MB. The bisect must not change because
    the weights are offloaded: same culprit and the same aligned pairs as the zoom on the in-memory models.

    glibc's mmap threshold is fixed at 1 MiB in the child (``MALLOC_MMAP_THRESHOLD_``) so that RSS measures
    what is held, not what glibc keeps after it was freed: with its default dynamic threshold, freed 16 MiB
    tensors can stay in a heap glibc does not give back (measured once with 24 layers: 1.2 GB of growth for
    806 MB of weights, RSS staying there after the run; with the fixed threshold RSS returned to its start).
    """
    _child("prepare", tmp_path, {})
    in_memory = json.loads((tmp_path / "in_memory.json").read_text())
    offloaded = json.loads(
        _child("measure", tmp_path, {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}).splitlines()[-1]
    )
    assert offloaded["culprit"] == in_memory["culprit"] == ["blocks.7.1", "layers.7.act"]
    assert offloaded["pairs"] == in_memory["pairs"]
    assert any(how == "weights" for _, _, how in offloaded["pairs"])
    assert offloaded["weight_bytes"] > 400e6
    assert offloaded["growth_bytes"] < 0.5 * offloaded["weight_bytes"], offloaded["growth_bytes"]


def _cmap_view(cmap):
    return sorted((e.target, tuple(e.sources), e.op, repr(e.args)) for e in cmap.mapping), sorted(
        a.target for a in cmap.ambiguous
    )


def _compacted(source, target):
    from paritykit.forensics.conversion.bounded import compact_pair, restore_for
    from paritykit.forensics.conversion.matching import infer_conversion_map

    src, tgt, stood_in = compact_pair(source, target)
    cmap = infer_conversion_map(src, tgt)
    restored = restore_for(cmap, source, target, src, tgt, stood_in)
    return (infer_conversion_map(src, tgt) if restored else cmap), stood_in, restored


def test_compacted_weights_give_the_same_conversion_map():
    from paritykit.forensics.conversion.matching import infer_conversion_map

    reference, port, _ = dit_pair(None)
    source, target = reference.state_dict(), port.state_dict()
    cmap, stood_in, restored = _compacted(source, target)
    assert stood_in and not restored  # most tensors never needed their values
    assert _cmap_view(cmap) == _cmap_view(infer_conversion_map(source, target))


def test_a_stand_in_hiding_a_concatenation_is_restored():
    # "a" equals "x" uniquely, and "ab" is a and b concatenated: standing in for a would hide that
    from paritykit.forensics.conversion.matching import infer_conversion_map

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    source = {"one.a": a, "one.b": b}
    target = {"two.x": a.clone(), "two.ab": torch.cat([a, b])}
    cmap, stood_in, restored = _compacted(source, target)
    assert restored and not stood_in
    assert _cmap_view(cmap) == _cmap_view(infer_conversion_map(source, target))
    assert not cmap.unmapped_target


@pytest.mark.parametrize("offloaded", [False, True])
def test_trace_weights_file_is_written_one_tensor_at_a_time_and_loads_back(tmp_path, offloaded):
    from paritykit.tracing.split_traces import write_weights
    from safetensors.torch import load_file

    reference, _, _ = dit_pair(None)
    reference.register_buffer("steps", torch.arange(5))  # an integer buffer goes through as well
    reference.half_scale = torch.nn.Parameter(torch.randn(3, 2).to(torch.bfloat16), requires_grad=False)
    expected = {k: v.clone() for k, v in reference.state_dict().items()}
    if offloaded:
        _offload("disk_offload", reference, tmp_path / "offload")
    n = write_weights(reference, tmp_path / "weights.safetensors")
    loaded = load_file(str(tmp_path / "weights.safetensors"))
    assert n == len(expected) and set(loaded) == set(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
