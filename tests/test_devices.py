"""Models on any device torch offers. The engine analyses what capture copied to the CPU (one place by
design: ``tracing.trace.capture(to_cpu=True)``) and runs modules where they live; code that computes on a
model's own tensors creates what it combines with them on their device. The CPU tests guard the classes of
slip that crashed on a GPU (a factory call without ``device=``, a CPU accumulator added to a device tensor);
the ``cuda`` tests run where a GPU is (``pytest -m cuda``) and are skipped with their reason elsewhere."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest
import torch

from .conftest import REPO

PACKAGE = REPO / "helpers" / "paritykit"
# modules that compute on a model's own tensors (weights hashed where they live, a demo model's forward)
DEVICE_PATHS = ("forensics/conversion/fingerprints.py", "demo/reference.py", "demo/port.py")
FACTORIES = {
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "linspace",
    "tensor",
    "eye",
    "randn",
    "rand",
    "randint",
}
CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"
)


@pytest.mark.parametrize("relative", DEVICE_PATHS)
def test_tensors_made_beside_a_models_tensors_are_made_on_their_device(relative):
    tree = ast.parse((PACKAGE / relative).read_text())
    bare = [
        f"{relative}:{node.lineno} torch.{node.func.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in FACTORIES
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
        and not any(k.arg == "device" for k in node.keywords)
    ]
    assert not bare, f"factory calls without device= in a device path: {bare}"


def test_weight_hashes_accumulate_on_the_tensors_device():
    # a tensor on another device than the accumulator once crashed (`total += per_row.sum()`): the hash of a
    # tensor does not depend on where it lives, and a "meta" tensor (no values) still builds its accumulators
    from paritykit.forensics.conversion.fingerprints import multiset_hashes

    weight = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    full, pieces = multiset_hashes(weight, torch.float32, [(0, 4), (1, 2)])
    assert full == multiset_hashes(weight.flip(0), torch.float32)[0]  # layout-insensitive
    assert len(pieces[(0, 4)]) == 4 and len(pieces[(1, 2)]) == 2


@pytest.mark.cuda
@CUDA
def test_the_worked_example_bisects_and_traces_on_cuda(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "paritykit", "demo", "--out", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    spec = tmp_path / "demo" / "bisect_buggy.py"
    bisect = subprocess.run(
        [sys.executable, "-m", "paritykit", "bisect", str(spec), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bisect.returncode == 1 and "culprit: reference time_mix" in bisect.stdout, (
        bisect.stdout + bisect.stderr
    )
    # each side traced on the GPU into a folder, then the folders bisected (on the CPU, where traces load)
    for side in ("reference", "port"):
        traced = subprocess.run(
            [sys.executable, "-m", "paritykit", "trace", str(spec), "--side", side, "--device", "cuda"]
            + ["--out", str(tmp_path / side)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert traced.returncode == 0, traced.stdout + traced.stderr
    folders = subprocess.run(
        [sys.executable, "-m", "paritykit", "bisect", "--traces", str(tmp_path / "reference")]
        + [str(tmp_path / "port"), str(spec)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert folders.returncode == 1 and "time_mix" in folders.stdout, folders.stdout + folders.stderr


def _gallery_params():
    from tests.gallery.base import VARIANTS
    from tests.gallery.catalogue import ALL_CASES

    return [
        pytest.param(case.id, variant, id=f"{case.id}-{variant}")
        for case in ALL_CASES
        for variant in VARIANTS
    ]


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("case_id, variant", _gallery_params())
def test_every_gallery_case_gets_its_answer_with_models_on_cuda(case_id, variant):
    # the same ground truth as tests/test_gallery.py, both models and inputs on the GPU
    from tests.gallery.catalogue import BY_ID
    from tests.gallery.run import run_case

    o = run_case(BY_ID[case_id], variant, device="cuda")
    assert o.culprit_ok, f"expected {o.expected[:1]}, found {o.found[:1]} (verdict {o.verdict})"
    assert not o.false_hints, o.false_hints


CUDA_TRIAGE = """
import torch
from tests.triage_pairs import Pair

PAIR = Pair({bugs!r})
for name in ("ref_unet", "port_unet", "ref_ae", "port_ae"):
    setattr(PAIR, name, getattr(PAIR, name).to("cuda"))
PAIR.cond = PAIR.cond.to("cuda")
port_scheduler = PAIR.port_scheduler


def run_reference():
    with torch.device("cuda"):  # the loops' noise and timesteps are made on the GPU
        return PAIR.run_reference()


def run_port():
    with torch.device("cuda"):
        return PAIR.run_port()


def reference_denoiser():
    return PAIR.ref_unet


def port_denoiser():
    return PAIR.port_unet


def reference_vae():
    return PAIR.ref_ae.decoder


def port_vae():
    return PAIR.port_ae.decoder
"""


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize(
    "bugs, place",
    [
        ((), None),
        (("norm-eps",), "denoiser"),
        (("spacing-leading",), "schedule"),
        (("v-prediction",), "update"),
        (("decoder-groups",), "decoder"),
        (("sdxl-scale",), "decoder input"),
    ],
    ids=["clean", "norm-eps", "spacing-leading", "v-prediction", "decoder-groups", "sdxl-scale"],
)
def test_triage_runs_pipelines_on_cuda(tmp_path, bugs, place):
    from paritykit.triage import triage_spec

    spec = tmp_path / "cuda_triage.py"
    spec.write_text(CUDA_TRIAGE.format(bugs=set(bugs)))
    report = triage_spec(spec, out=tmp_path / "out")
    if place is None:
        assert report.verdict == "match" and not report.findings, report.render()
    else:
        assert [f.place for f in report.findings] == [place], report.render()


@pytest.mark.cuda
@CUDA
def test_compare_reads_tensors_saved_from_cuda(tmp_path):
    from paritykit.compare.sets import compare_paths

    x = torch.randn(4, 8, device="cuda")
    torch.save({"x": x}, tmp_path / "a.pt")
    torch.save({"x": x + 1e-2}, tmp_path / "b.pt")
    torch.save({"x": x.clone()}, tmp_path / "c.pt")
    assert compare_paths(str(tmp_path / "a.pt"), str(tmp_path / "c.pt")).exit_code == 0
    differ = compare_paths(str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert differ.exit_code == 1


def _gpu_scale():
    import importlib.util

    found = importlib.util.spec_from_file_location("gpu_scale", REPO / "benchmarks" / "gpu_scale.py")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def test_the_gpu_scale_check_names_its_planted_block_on_a_tiny_flux_in_bfloat16():
    # benchmarks/gpu_scale.py is what ../shared/gpu runs at FLUX.1-dev size; its steps here at tiny size
    from paritykit.bisection.entry import bisect

    scale = _gpu_scale()
    reference, port = scale.build("tiny", "cpu", slip=False), scale.build("tiny", "cpu", slip=True)
    assert {p.dtype for p in port.parameters()} == {torch.bfloat16}
    report = bisect(reference, port, scale.inputs("tiny", "cpu"), levels="zoom", repair=False)
    assert report.verdict == "diverge"
    assert report.culprit.port.startswith(f"single_transformer_blocks.{scale.SLIP_BLOCK['tiny']}.")
    # must not fire: the same build without the slip matches
    clean = bisect(
        reference, scale.build("tiny", "cpu", slip=False), scale.inputs("tiny", "cpu"), repair=False
    )
    assert clean.verdict == "match"


@CUDA
@pytest.mark.cuda
def test_the_gpu_scale_check_runs_a_tiny_flux_on_cuda():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_scale.py"), "--scale", "tiny", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_least_squares_are_solved_in_one_place_that_runs_on_the_cpu():
    # CUDA's lstsq takes only full-rank systems (driver gels) and crashed triage's fits on a GPU: every fit
    # goes through base.minimize.least_squares, which solves on the CPU
    calls = [
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "minimize.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("lstsq", "lstsq_ex")
    ]
    assert not calls, f"lstsq outside base/minimize.py: {calls}"
    from paritykit.base.minimize import least_squares

    columns = torch.tensor([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]])  # rank 1: the CPU driver still answers
    solution = least_squares(columns, torch.tensor([3.0, 3.0, 3.0]))
    assert solution.dtype == torch.float32 and torch.allclose(columns @ solution, torch.full((3,), 3.0))


def test_replayed_outputs_are_analysed_on_the_cpu():
    # the port's replayed output once stayed on the GPU and met the captured reference (on the CPU) in one
    # subtraction: replays hand the engine CPU tensors, detached
    from paritykit.bisection.leaves import output_leaves

    x = torch.randn(2, 3, requires_grad=True)
    (path, out), *_ = output_leaves({"sample": x * 2})
    assert path == "output.sample" and out.device.type == "cpu" and not out.requires_grad


@pytest.mark.cuda
@CUDA
def test_tf32_is_off_while_paritykit_runs_models_and_the_users_flags_come_back():
    # a 1x1 convolution and the Linear with its weights: equal in float32, 1e-3 apart under cuDNN's TF32
    from paritykit.base.precision import exact_float32
    from paritykit.bisection.entry import bisect

    conv = torch.nn.Conv2d(64, 64, 1).cuda()
    linear = torch.nn.Linear(64, 64).cuda()
    with torch.no_grad():
        linear.weight.copy_(conv.weight[:, :, 0, 0])
        linear.bias.copy_(conv.bias)

    class AsConv(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x.transpose(1, 2)[..., None])[..., 0].transpose(1, 2)

    torch.backends.cudnn.allow_tf32 = True
    with exact_float32():
        assert not torch.backends.cudnn.allow_tf32
    assert torch.backends.cudnn.allow_tf32
    report = bisect(AsConv(conv), linear, ((torch.randn(2, 256, 64, device="cuda") * 10,), {}))
    assert report.verdict == "match", report.render()
    assert torch.backends.cudnn.allow_tf32
