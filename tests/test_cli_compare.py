"""`paritykit compare`: exit codes, the JSON schema, one-line errors, checkpoint folders in execution
order."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from paritykit.base.errors import ParityKitError
from paritykit.cli import cli
from paritykit.compare.sets import compare_paths
from paritykit.tracing.checkpoints import Checkpoint, save_checkpoints
from safetensors.torch import save_file

from tests._pipelines import TINY_STEPS, TinyUNetPipeline, make_tiny_unet


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def run(*args):
    r"""In-process run with the real command and its exit conventions (fast); stdout/stderr kept apart."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def folders(tmp_path):
    r"""Two folders of single-tensor files; step_2 (and later) differ by a constant scale."""
    x = randn(2, 8)
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        for i in (0, 1, 2, 10):
            value = x * 0.9 if side == "a" and i >= 2 else x
            torch.save(value, tmp_path / side / f"step_{i}.pt")
    return tmp_path / "a", tmp_path / "b"


# ----------------------------------------------------------------------------------------------- exit codes


def test_identical_folders_exit_0(folders):
    a, _ = folders
    result = run("compare", a, a)
    assert result.exit_code == 0, result.output
    assert "all tensors match" in result.stdout


def test_failing_pair_exits_1_with_table_first_divergence_and_hint(folders):
    result = run("compare", *folders)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    # the answer first: the verdict and the first divergence, then the table
    assert lines[0].startswith("verdict: 2 of 4 pairs differ; first divergence: step_2 (max_abs")
    assert lines[1].split()[:6] == ["name", "status", "max_abs", "mean_abs", "cosine", "mismatch"]
    names = [line.split()[0] for line in lines[3:7]]
    assert names == ["step_0", "step_1", "step_2", "step_10"]  # natural order, not step_10 before step_2
    assert "first divergence: step_2" in result.stdout
    assert "[constant-scale]" in result.stdout


def test_shape_mismatch_and_one_sided_names_exit_1(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    torch.save(randn(2, 3), tmp_path / "a" / "x.pt")
    torch.save(randn(2, 3).T.contiguous(), tmp_path / "b" / "x.pt")
    result = run("compare", tmp_path / "a", tmp_path / "b", "--json")
    assert result.exit_code == 1
    pair = json.loads(result.stdout)["pairs"][0]
    assert pair["status"] == "shape_mismatch" and pair["hints"][0]["id"] == "transpose"

    torch.save(randn(2, 3), tmp_path / "b" / "x.pt")
    torch.save(randn(1), tmp_path / "b" / "extra.pt")
    torch.save(randn(2, 3), tmp_path / "a" / "x.pt")
    result = run("compare", tmp_path / "a", tmp_path / "b", "--json")
    payload = json.loads(result.stdout)
    assert (
        result.exit_code == 1 and payload["only_b"] == ["extra"] and payload["pairs"][0]["status"] == "pass"
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["missing_dir", "{a}"], "missing_dir"),
        (["{a}", "{a}", "--map", "(=x"], "--map"),
        (["{a}", "{a}", "--only", "nothing*"], "--only"),
        (["{a}", "{a}", "--atol", "-1"], "--atol"),
    ],
)
def test_bad_input_exits_2_with_one_line(folders, args, fragment):
    a, _ = folders
    result = run("compare", *[arg.format(a=a) for arg in args])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("paritykit: error:") and fragment in lines[0]
    assert "Traceback" not in result.output


# -------------------------------------------------------------------------------------------- JSON schema


def test_json_schema(folders):
    result = run("compare", *folders, "--json")
    payload = json.loads(result.stdout)
    assert payload["schema_version"] == 1
    assert {"pairs", "only_a", "only_b", "first_divergence", "environment"} <= set(payload)
    assert payload["first_divergence"] == "step_2"
    assert (
        payload["environment"]["torch"] == torch.__version__.split("+")[0] or payload["environment"]["torch"]
    )
    for pair in payload["pairs"]:
        for key in (
            "name",
            "status",
            "max_abs",
            "mean_abs",
            "cosine",
            "mismatch_fraction",
            "dtype_a",
            "dtype_b",
        ):
            assert key in pair
        assert pair["status"] in {"pass", "fail", "shape_mismatch"}
        for hint in pair["hints"]:
            assert isinstance(hint["id"], str) and isinstance(hint["message"], str)
    statuses = {p["name"]: p["status"] for p in payload["pairs"]}
    assert statuses == {"step_0": "pass", "step_1": "pass", "step_2": "fail", "step_10": "fail"}


def test_dtype_difference_alone_passes_with_differing_dtype_fields(tmp_path):
    x = randn(4, 4)
    torch.save(x.half(), tmp_path / "a.pt")
    torch.save(x.half().float(), tmp_path / "b.pt")
    result = run("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--json")
    pair = json.loads(result.stdout)["pairs"][0]
    assert result.exit_code == 0 and (pair["status"], pair["dtype_a"], pair["dtype_b"]) == (
        "pass",
        "float16",
        "float32",
    )


def test_nan_reaches_json_as_null_with_a_flag(tmp_path):
    x = randn(3)
    y = x.clone()
    y[0] = float("nan")
    torch.save(x, tmp_path / "a.pt")
    torch.save(y, tmp_path / "b.pt")
    result = run("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--json")
    assert result.exit_code == 1
    payload = json.loads(result.stdout, parse_constant=lambda token: pytest.fail(f"non-strict JSON: {token}"))
    assert payload["pairs"][0]["head_b"][0] is None and payload["pairs"][0]["hints"][0]["id"] == "nonfinite"
    assert payload["nonfinite"]["pairs.0.head_b.0"] == "nan"


# ------------------------------------------------------------------------------------------ options


def test_map_only_broadcast_and_limit(tmp_path):
    x = randn(1, 16)
    save_file(
        {f"model.diffusion_model.block_{i}": x.clone() for i in range(12)}, str(tmp_path / "ref.safetensors")
    )
    save_file({f"unet.block_{i}": x.repeat(2, 1) for i in range(12)}, str(tmp_path / "port.safetensors"))
    a, b = tmp_path / "ref.safetensors", tmp_path / "port.safetensors"
    unmapped = run("compare", a, b, "--json")
    assert unmapped.exit_code == 1 and len(json.loads(unmapped.stdout)["only_a"]) == 12

    mapped = run("compare", a, b, "--map", r"^model\.diffusion_model\.=unet.", "--json")
    payload = json.loads(mapped.stdout)
    assert mapped.exit_code == 1 and not payload["only_a"]
    assert {p["status"] for p in payload["pairs"]} == {"shape_mismatch"}

    both = run("compare", a, b, "--map", r"^model\.diffusion_model\.=unet.", "--broadcast", "--limit", "5")
    assert both.exit_code == 0 and "… 7 more" in both.stdout and "repeated 2×" in both.stdout

    only = run(
        "compare", a, b, "--map", r"^model\.diffusion_model\.=unet.", "--only", "unet.block_1?", "--json"
    )
    assert [p["name"] for p in json.loads(only.stdout)["pairs"]] == ["unet.block_10", "unet.block_11"]


def test_two_single_tensor_files_pair_whatever_their_names(tmp_path):
    x = randn(5)
    torch.save(x, tmp_path / "reference_out.pt")
    torch.save(x * 2, tmp_path / "port_out.pt")
    report = compare_paths(str(tmp_path / "reference_out.pt"), str(tmp_path / "port_out.pt"))
    assert [p.name for p in report.pairs] == ["reference_out"] and report.pairs[0].name_b == "port_out"
    assert report.first_divergence == "reference_out" and report.pairs[0].hints[0].id == "constant-scale"


def test_library_errors_name_the_argument(tmp_path):
    with pytest.raises(ParityKitError, match="--rtol"):
        compare_paths(str(tmp_path), str(tmp_path), rtol=-0.5)


# ------------------------------------------------------------------------- checkpoint folders, real pipeline


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    r"""A tiny DDIM pipeline run twice into checkpoint folders; in B one UNet output layer is rescaled."""
    root = tmp_path_factory.mktemp("runs")
    names = ["preloop", *[f"after_step_{i}" for i in range(TINY_STEPS)], "post_loop"]
    folders = []
    for side, scale in (("a", 1.0), ("b", 1.05)):
        pipe = TinyUNetPipeline(unet=make_tiny_unet(), scheduler=_scheduler())
        with torch.no_grad():
            pipe.unet.conv_out.weight.mul_(scale)
            pipe.unet.conv_out.bias.mul_(scale)  # so B's first noise prediction is exactly scale x A's
        checkpoints = {name: Checkpoint(save=True) for name in names}
        pipe(seed=0, _checkpoints=checkpoints)
        save_checkpoints(root / side, checkpoints)
        folders.append(root / side)
    return folders


def _scheduler():
    from diffusers import DDIMScheduler

    return DDIMScheduler(num_train_timesteps=100)


def test_checkpoint_folders_compare_in_execution_order(checkpoint_runs):
    a, b = checkpoint_runs
    report = compare_paths(str(a), str(b))
    names = [p.name for p in report.pairs]
    assert names[:2] == [
        "preloop/latents",
        "preloop/timesteps",
    ]  # manifest order: preloop before after_step_*
    assert names[-1] == "post_loop/latents"
    steps = [n.split("/")[0] for n in names]
    assert steps == sorted(steps, key=lambda s: (s != "preloop", s == "post_loop", s))
    assert report.first_divergence == "after_step_0/latents"  # keys in the order the checkpoint saved them
    assert report.pair("preloop/latents").passed and report.pair("preloop/timesteps").passed
    hint = report.pair("after_step_0/noise_pred").hints[0]
    assert hint.id == "constant-scale" and hint.evidence["k"] == pytest.approx(1.05, rel=1e-4)


def test_checkpoint_folder_cli_json_and_self_compare(checkpoint_runs, cli):
    a, b = checkpoint_runs
    same = cli("compare", a, a)
    assert same.returncode == 0, same.stderr
    differ = cli("compare", a, b, "--json", "--only", "after_step_*")
    assert differ.returncode == 1, differ.stderr
    payload = json.loads(differ.stdout)
    assert payload["first_divergence"] == "after_step_0/latents"
    assert all(p["name"].startswith("after_step_") for p in payload["pairs"])
    bad = cli("compare", a, b / "no_such_dir", "--json")
    assert bad.returncode == 2 and "no_such_dir" in json.loads(bad.stdout)["error"]
