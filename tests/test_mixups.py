"""Mixed-up folders are refused, never matched: two trace folders must be one reference and one port of the
same spec (by content) and the same inputs, in that order, written in a format this paritykit reads; a damaged
shard is named in one line; `compare` of a path with itself says so."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from paritykit.cli import cli

SPEC = """import os
import torch


def make_inputs():
    return (torch.{fill}(int(os.environ.get("PK_BATCH", "2")), 3),), {{}}


def build_reference():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.GELU(), torch.nn.Linear(3, 3))


def build_port():
    torch.manual_seed(0)
    gelu = torch.nn.GELU(approximate="{approximate}")
    return torch.nn.Sequential(torch.nn.Linear(3, 3), gelu, torch.nn.Linear(3, 3))
"""


def run(*args, env=None):
    result = CliRunner().invoke(cli, [str(a) for a in args], env=env)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixups")
    (root / "spec.py").write_text(SPEC.format(fill="ones", approximate="tanh"))
    (root / "other.py").write_text(SPEC.format(fill="ones", approximate="none"))  # another port, same inputs
    (root / "zeros.py").write_text(SPEC.format(fill="zeros", approximate="tanh"))
    for spec, side, out, env in (
        ("spec.py", "reference", "ref", None),
        ("spec.py", "port", "port", None),
        ("spec.py", "reference", "ref2", None),
        ("spec.py", "port", "port4", {"PK_BATCH": "4"}),
        ("other.py", "port", "other_port", None),
        ("zeros.py", "port", "zeros_port", None),
    ):
        code, out_text = run("trace", root / spec, "--side", side, "--out", root / out, env=env)
        assert code == 0, out_text
    return root


def test_the_right_pair_is_bisected(folders):
    code, out = run("bisect", "--traces", folders / "ref", folders / "port", folders / "spec.py")
    assert code == 1 and "verdict: " in out and "tanh-GELU" in out, (
        out
    )  # the search ran and found the culprit
    # two environments' specs may differ (each builds its own side): the same inputs make them a pair
    code, out = run("bisect", "--traces", folders / "ref", folders / "other_port")
    assert code in (0, 1) and "verdict: " in out, out


@pytest.mark.parametrize(
    ("pair", "spec", "message"),
    [
        (("ref", "ref"), None, "is given twice"),
        (("ref", "ref2"), None, "both hold the reference's trace"),
        (("port", "ref"), None, "swapped"),
        (("ref", "zeros_port"), None, "agree in shape (arg0 (2, 3)) but not in value"),
        (("ref", "port4"), None, "different inputs: "),
        (("ref", "port"), "zeros.py", "the traces and SPEC's make_inputs() agree in shape"),
    ],
    ids=["same-folder", "two-references", "swapped", "other-values", "other-shapes", "other-inputs-now"],
)
def test_a_mixed_up_pair_is_refused_in_one_line(folders, pair, spec, message):
    code, out = run("bisect", "--traces", *(folders / p for p in pair), *([folders / spec] if spec else []))
    assert code == 2 and message in out and len(out.strip().splitlines()) == 1, out
    assert "verdict" not in out and "Traceback" not in out


def test_inputs_are_named_by_shape(folders):
    _, out = run("bisect", "--traces", folders / "ref", folders / "port4")
    assert "arg0 (2, 3)" in out and "arg0 (4, 3)" in out


def test_damaged_and_newer_trace_folders_are_named(folders, tmp_path):
    broken = tmp_path / "ref_broken"
    shutil.copytree(folders / "ref", broken)
    shard = next(broken.glob("tensors-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated mid-header
    code, out = run("bisect", "--traces", broken, folders / "port")
    assert code == 2 and str(shard) in out and "Traceback" not in out, out
    newer = tmp_path / "ref_newer"
    shutil.copytree(folders / "ref", newer)
    manifest = json.loads((newer / "trace.json").read_text())
    (newer / "trace.json").write_text(json.dumps({**manifest, "version": 99}))
    code, out = run("bisect", "--traces", newer, folders / "port")
    assert code == 2 and "trace format 99, this paritykit reads 2" in out


def test_a_newer_checkpoint_schema_is_refused_and_a_self_compare_warns(tmp_path):
    import torch
    from paritykit import Checkpoint, save_checkpoints

    run_ = {"preloop": Checkpoint(data={"latents": torch.ones(2), "timesteps": torch.tensor([999, 499])})}
    run_.update({f"after_step_{i}": Checkpoint(data={"latents": torch.ones(2) * i}) for i in range(2)})
    save_checkpoints(tmp_path / "run", run_)
    code, out = run("compare", tmp_path / "run", tmp_path / "run")
    assert code == 0 and "warning: A and B are the same path" in out
    code, out = run("steps", tmp_path / "run", tmp_path / "run", "--key", "latents")
    assert "warning: A and B are the same path" in out, out
    code, out = run("schedule", tmp_path / "run", tmp_path / "run")
    assert code == 0 and "A and B are the same path" in out, out
    other = tmp_path / "run2"
    save_checkpoints(other, run_)
    code, out = run("compare", tmp_path / "run", other)
    assert code == 0 and "warning" not in out  # two runs that agree: no warning
    manifest = json.loads((other / "paritykit.json").read_text())
    (other / "paritykit.json").write_text(json.dumps({**manifest, "schema_version": 7}))
    code, out = run("compare", tmp_path / "run", other)
    assert code == 2 and "checkpoint schema 7, this paritykit reads 1" in out and "Traceback" not in out


def test_run_folders_that_record_their_side_are_paired_only_as_reference_then_port(tmp_path):
    import torch
    from paritykit import Checkpoint, record_loop, save_checkpoints

    def run_(side, folder, shift=0.0):
        data = {"preloop": Checkpoint(data={"latents": torch.ones(2), "timesteps": torch.tensor([999, 499])})}
        data.update(
            {f"after_step_{i}": Checkpoint(data={"latents": torch.ones(2) * i + shift}) for i in range(2)}
        )
        save_checkpoints(tmp_path / folder, data, side=side)
        return tmp_path / folder

    ref, ref2, port = run_("reference", "ref"), run_("reference", "ref2"), run_("port", "port", 1e-3)
    plain = run_(None, "plain")
    for command in (["compare"], ["steps"], ["schedule"]):
        code, out = run(*command, ref, ref2)
        assert code == 2 and "both hold a reference run" in out and len(out.strip().splitlines()) == 1, out
        code, out = run(*command, port, ref)
        assert code == 2 and "swapped" in out, out
        code, out = run(*command, ref, port)
        assert code in (0, 1) and "paritykit: error" not in out, out  # the right order is compared
        code, out = run(*command, ref, plain)  # a folder that records no side is not judged
        assert code in (0, 1), out
    # record_loop writes the side it was given
    net = torch.nn.Linear(2, 2)
    with torch.no_grad(), record_loop(net, out=tmp_path / "rec", side="port"):
        net(torch.ones(1, 2))
    assert json.loads((tmp_path / "rec" / "paritykit.json").read_text())["side"] == "port"
    with pytest.raises(Exception, match="expected 'reference' or 'port'"):
        save_checkpoints(tmp_path / "bad", {"preloop": Checkpoint(data={"x": torch.ones(1)})}, side="both")
