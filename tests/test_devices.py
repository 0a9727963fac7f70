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
def test_the_worked_example_bisects_on_cuda(tmp_path):
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


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_planted_eps_is_found_with_models_on_cuda(dtype):
    from paritykit.bisection.entry import bisect

    from tests.evidence_pairs import vit_pair

    reference, port, ((x,), _) = vit_pair("eps")
    reference, port = reference.to("cuda", dtype), port.to("cuda", dtype)
    report = bisect(reference, port, ((x.to("cuda", dtype),), {}))
    assert report.culprit is not None and report.culprit.hints[0].verified, report.render()


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
def test_the_gpu_scale_check_runs_at_flux_dev_size_on_cuda():
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_scale.py"), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
