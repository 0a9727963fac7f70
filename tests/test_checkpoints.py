import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from paritykit.base.errors import ParityKitError
from paritykit.base.io import load_tensors
from paritykit.tracing.checkpoints import (
    Checkpoint,
    CheckpointNotReached,
    PipelineStop,
    load_checkpoints,
    maybe_checkpoint,
    run_until_stop,
    save_checkpoints,
    seeded_noise,
)
from safetensors.torch import load_file

from tests._pipelines import TINY_STEPS, make_tiny_unet_pipeline

REPO = Path(__file__).resolve().parents[1]
ALL_POINTS = ["preloop", *(f"after_step_{i}" for i in range(TINY_STEPS)), "post_loop"]


@pytest.fixture(scope="module")
def pipe():
    # one thread: tiny models run fastest that way on a busy machine, and every run here (the other process
    # included) must use the same count for bit-identical results
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make_tiny_unet_pipeline()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(pipe):
    r"""One run with every checkpoint saved: (output, checkpoints)."""
    checkpoints = {name: Checkpoint(save=True) for name in ALL_POINTS}
    return pipe(seed=0, _checkpoints=checkpoints), checkpoints


# ------------------------------------------------------------------------------------------- in the pipeline


def test_saving_checkpoints_leaves_the_output_bit_identical(pipe, reference):
    output, checkpoints = reference
    plain = pipe(seed=0)
    assert torch.equal(plain, output)
    unused = {
        "text_encoding": Checkpoint(save=True, stop=True, load=True)
    }  # a point this pipeline never reaches
    assert torch.equal(pipe(seed=0, _checkpoints=unused), output)
    assert torch.equal(pipe(seed=0, _checkpoints={}), output)

    assert all(checkpoints[name].data for name in ALL_POINTS)
    assert set(checkpoints["preloop"].data) == {"latents", "timesteps"}
    assert torch.equal(checkpoints["preloop"].data["latents"], seeded_noise(plain.shape, 0))
    final = checkpoints["post_loop"].data["latents"]
    assert torch.equal((final / 2 + 0.5).clamp(0, 1), output)
    assert not final.requires_grad


def test_injecting_preloop_reproduces_the_other_run(pipe, reference):
    output_a, checkpoints_a = reference
    other_seed = pipe(seed=1)
    assert not torch.equal(other_seed, output_a)  # the injection below has something to undo

    injected = {"preloop": Checkpoint(load=True, data=checkpoints_a["preloop"].data)}
    output_b = pipe(seed=1, _checkpoints=injected)
    assert torch.equal(output_b, output_a)


def test_injecting_mid_loop_continues_from_the_saved_latents(pipe, reference):
    output_a, checkpoints_a = reference
    injected = {
        "after_step_1": Checkpoint(load=True, data={"latents": checkpoints_a["after_step_1"].data["latents"]})
    }
    assert torch.equal(pipe(seed=7, _checkpoints=injected), output_a)


def test_stop_raises_after_saving_and_run_until_stop_returns_none(pipe, reference):
    _, checkpoints_a = reference
    checkpoints = {"after_step_1": Checkpoint(save=True, stop=True), "post_loop": Checkpoint(save=True)}
    with pytest.raises(PipelineStop) as stopped:
        pipe(seed=0, _checkpoints=checkpoints)
    assert stopped.value.name == "after_step_1"
    assert torch.equal(
        checkpoints["after_step_1"].data["latents"], checkpoints_a["after_step_1"].data["latents"]
    )
    assert checkpoints["post_loop"].data == {}  # never reached

    again = {"preloop": Checkpoint(stop=True)}
    assert run_until_stop(pipe, seed=0, _checkpoints=again) is None
    assert again["preloop"].data == {}  # stop without save stores nothing
    assert run_until_stop(pipe, seed=0) is not None


def test_a_checkpoint_name_never_reached_is_reported_after_the_run(pipe):
    checkpoints = {"prelop": Checkpoint(save=True), "post_loop": Checkpoint(save=True)}
    with pytest.warns(CheckpointNotReached, match=r"'prelop' \(did you mean 'preloop'\?\)") as caught:
        assert run_until_stop(pipe, seed=0, _checkpoints=checkpoints) is not None
    (warning,) = caught
    assert "post_loop" not in str(warning.message)  # reached: not reported
    assert checkpoints["post_loop"].reached and not checkpoints["prelop"].reached


def test_names_after_a_stop_are_reported_with_where_the_run_stopped(pipe):
    checkpoints = {"preloop": Checkpoint(save=True, stop=True), "post_loop": Checkpoint(save=True)}
    with pytest.warns(CheckpointNotReached, match="'post_loop'.*stopped at 'preloop'"):
        assert run_until_stop(pipe, seed=0, _checkpoints=checkpoints) is None


def test_every_checkpoint_reached_warns_nothing(pipe, recwarn):
    checkpoints = {name: Checkpoint(save=True) for name in ALL_POINTS}
    run_until_stop(pipe, seed=0, _checkpoints=checkpoints)
    stopped = {"preloop": Checkpoint(save=True, stop=True)}
    run_until_stop(pipe, seed=0, _checkpoints=stopped)
    assert not [w for w in recwarn if issubclass(w.category, CheckpointNotReached)]


# --------------------------------------------------------------------------------------------
# maybe_checkpoint


def test_load_casts_to_the_local_dtype_and_never_aliases_the_stored_tensor():
    stored = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    checkpoint = Checkpoint(load=True, data={"latents": stored, "scale": 2.0})
    local = torch.zeros(2, 3, dtype=torch.float16)
    out = maybe_checkpoint({"x": checkpoint}, "x", latents=local, mask=None, scale=1.0)
    assert out["latents"].dtype == torch.float16 and out["latents"].device == local.device
    assert torch.equal(out["latents"], stored.half())
    assert (
        out["mask"] is None and out["scale"] == 2.0
    )  # non-tensors pass through; data wins where it has the key

    same_dtype = maybe_checkpoint({"x": checkpoint}, "x", latents=torch.zeros(2, 3))["latents"]
    same_dtype.add_(100)  # a pipeline updating its latents in place
    assert torch.equal(checkpoint.data["latents"], torch.arange(6, dtype=torch.float32).reshape(2, 3))


def test_save_stores_detached_clones():
    latents = torch.ones(3, requires_grad=True) * 2
    checkpoint = Checkpoint(save=True)
    out = maybe_checkpoint({"x": checkpoint}, "x", latents=latents, step=3)
    assert out["latents"] is latents and out["step"] == 3
    saved = checkpoint.data["latents"]
    assert not saved.requires_grad and saved.data_ptr() != latents.data_ptr()
    with torch.no_grad():
        latents.mul_(0)
    assert torch.equal(saved, torch.full((3,), 2.0))
    assert checkpoint.data["step"] == 3


def test_no_checkpoints_is_a_no_op():
    latents = torch.randn(2)
    assert maybe_checkpoint(None, "preloop", latents=latents)["latents"] is latents
    assert (
        maybe_checkpoint({"other": Checkpoint(stop=True)}, "preloop", latents=latents)["latents"] is latents
    )


def test_load_mistakes_are_reported():
    with pytest.raises(ParityKitError, match="'preloop' has load=True but no data"):
        maybe_checkpoint({"preloop": Checkpoint(load=True)}, "preloop", latents=torch.zeros(1))
    with pytest.raises(ParityKitError, match="none of its keys"):
        maybe_checkpoint({"preloop": Checkpoint(load=True, data={"x": torch.zeros(1)})}, "preloop", latents=1)


def test_seeded_noise_is_the_same_for_every_dtype():
    base = seeded_noise((2, 3, 4), seed=5)
    assert base.dtype == torch.float32 and base.device.type == "cpu"
    expected = torch.randn((2, 3, 4), generator=torch.Generator().manual_seed(5))
    assert torch.equal(base, expected)
    half = seeded_noise([2, 3, 4], seed=5, dtype=torch.float16, device=torch.device("cpu"))
    assert half.dtype == torch.float16 and torch.equal(half, base.half())
    assert not torch.equal(seeded_noise((2, 3, 4), seed=6), base)


# ------------------------------------------------------------------------------------------------------ on
# disk


def test_save_and_load_round_trip_in_execution_order(tmp_path, reference):
    _, checkpoints = reference
    # a dict built in another order: the manifest must still follow execution order
    shuffled = {name: checkpoints[name] for name in reversed(ALL_POINTS)}
    manifest_path = save_checkpoints(tmp_path / "ref", shuffled)
    manifest = json.loads(manifest_path.read_text())
    assert manifest["order"] == ALL_POINTS
    assert torch.__version__.startswith(manifest["environment"]["torch"].split("+")[0])
    assert manifest["environment"]["paritykit"] and manifest["environment"]["diffusers"]
    assert sorted(p.name for p in (tmp_path / "ref").iterdir()) == sorted(
        ["paritykit.json", *(f"{name}.safetensors" for name in ALL_POINTS)]
    )

    restored = load_checkpoints(tmp_path / "ref")
    assert list(restored) == ALL_POINTS
    for name in ALL_POINTS:
        assert not (restored[name].save or restored[name].stop or restored[name].load)
        assert list(restored[name].data) == list(checkpoints[name].data)
        for key, value in checkpoints[name].data.items():
            assert restored[name].data[key].dtype == value.dtype and torch.equal(
                restored[name].data[key], value
            )

    names = list(load_tensors(tmp_path / "ref"))
    assert names[:3] == ["preloop/latents", "preloop/timesteps", "after_step_0/latents"]
    assert names[-1] == "post_loop/latents"


def test_non_tensor_values_go_to_the_manifest(tmp_path):
    data = {
        "latents": torch.randn(2, dtype=torch.bfloat16),
        "scale": 7.5,
        "mask": None,
        "sizes": (64, 64),
        "floor": float("-inf"),
    }
    checkpoints = {"text_encoding": Checkpoint(data={**data, "generator": torch.Generator()})}
    manifest = json.loads(save_checkpoints(tmp_path, checkpoints).read_text())
    entry = manifest["checkpoints"][0]
    assert entry["values"] == {"scale": 7.5, "mask": None, "sizes": [64, 64]}
    assert entry["skipped"] == {"generator": "Generator"} and entry["nonfinite"] == {"floor": "-inf"}
    assert entry["tensors"] == {"latents": {"dtype": "bfloat16", "shape": [2]}}
    assert list(load_file(tmp_path / "text_encoding.safetensors")) == ["latents"]

    restored = load_checkpoints(tmp_path)["text_encoding"].data
    assert list(restored) == ["latents", "scale", "mask", "sizes", "floor"]
    assert torch.equal(restored["latents"], data["latents"]) and restored["scale"] == 7.5
    assert restored["floor"] == float("-inf")


def test_disk_errors_name_the_path(tmp_path):
    with pytest.raises(ParityKitError, match="no such checkpoint folder"):
        load_checkpoints(tmp_path / "absent")
    with pytest.raises(ParityKitError, match="no paritykit.json"):
        load_checkpoints(tmp_path)
    with pytest.raises(ParityKitError, match="checkpoint name '../escape'"):
        save_checkpoints(tmp_path / "out", {"../escape": Checkpoint(data={"x": torch.zeros(1)})})
    save_checkpoints(tmp_path / "ok", {"preloop": Checkpoint(data={"x": torch.zeros(1)})})
    (tmp_path / "ok" / "preloop.safetensors").unlink()
    with pytest.raises(ParityKitError, match=r"preloop\.safetensors"):
        load_checkpoints(tmp_path / "ok")


_REFERENCE_PROCESS = textwrap.dedent("""
    import sys

    import torch
    from safetensors.torch import save_file
    from paritykit.tracing.checkpoints import Checkpoint, save_checkpoints
    from tests._pipelines import make_tiny_unet_pipeline

    torch.set_num_threads(1)
    checkpoints = {"preloop": Checkpoint(save=True), "post_loop": Checkpoint(save=True)}
    output = make_tiny_unet_pipeline()(seed=int(sys.argv[2]), _checkpoints=checkpoints)
    save_checkpoints(sys.argv[1], checkpoints)
    save_file({"output": output.contiguous()}, sys.argv[1] + "-output.safetensors")
    """)


def test_checkpoints_cross_processes(tmp_path, pipe):
    folder = tmp_path / "reference"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "helpers"), os.environ.get("PYTHONPATH", "")]),
    )
    subprocess.run(
        [sys.executable, "-c", _REFERENCE_PROCESS, str(folder), "3"],
        cwd=REPO,
        env=env,
        check=True,
        timeout=300,
    )
    reference_output = load_file(f"{folder}-output.safetensors")["output"]

    injected = load_checkpoints(folder)
    injected["preloop"].load = True
    assert not torch.equal(pipe(seed=0), reference_output)
    assert torch.equal(pipe(seed=0, _checkpoints=injected), reference_output)
