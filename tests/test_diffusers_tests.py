"""`paritykit new diffusers-tests`: the tests a diffusers pull request asks for, rendered for a port.

The reference is Wan 2.1's research DiT as published (DiffSynth-Studio), the port diffusers'
``WanTransformer3DModel`` holding its weights moved by diffusers' own converter
(tests/diffusers_tests_pair.py).
The generated files are run with pytest inside a diffusers source checkout (its tests/ and testing utilities,
from the repository): PARITYKIT_DIFFUSERS_REPO names it, a work tree or a git directory; `make test` sets it
to the fetched repository when the machine has one, and those tests skip without it. Generation itself, the
slice's provenance and the file safety rules are tested everywhere.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paritykit.base.errors import ParityKitError
from paritykit.pack.diffusers_tests import generate_diffusers_tests

from tests.diffusers_tests_pair import build_reference, save_port

REFERENCE = "tests.diffusers_tests_pair:build_reference"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    r"""A diffusers checkout's tests/ and pyproject.toml in a scratch folder (its own tests never change)."""
    source = os.environ.get("PARITYKIT_DIFFUSERS_REPO", "")
    if not source:
        pytest.skip("no diffusers checkout: set PARITYKIT_DIFFUSERS_REPO to a work tree or git directory")
    source_path = Path(source)
    root = tmp_path_factory.mktemp("diffusers")
    if (source_path / "tests" / "models" / "testing_utils").is_dir():
        shutil.copytree(source_path / "tests", root / "tests")
        shutil.copy(source_path / "pyproject.toml", root / "pyproject.toml")
    else:
        archive = subprocess.run(
            ["git", f"--git-dir={source_path}", "archive", "HEAD", "tests", "pyproject.toml"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    return root


@pytest.fixture(scope="module")
def saved_port(tmp_path_factory) -> Path:
    return save_port(tmp_path_factory.mktemp("port") / "transformer")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(ROOT)  # --reference names a module of this repository's tests package


def run_pytest(root: Path, *args: str, slow: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RUN_SLOW")}
    # this repository's root would shadow the checkout's `tests` package; the rest of the path stays (a
    # machine whose diffusers is on PYTHONPATH, as the GPU check installs it)
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    if slow:
        env["RUN_SLOW"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def ruff(root: Path, *args: str) -> subprocess.CompletedProcess:
    if not (Path(sys.executable).parent / "ruff").exists():
        pytest.skip("ruff is not installed beside this Python (the dev extra)")
    return subprocess.run(
        [str(Path(sys.executable).parent / "ruff"), *args, "--config", str(root / "pyproject.toml")],
        cwd=root,
        capture_output=True,
        text=True,
    )


def slow_test_parts(path: Path) -> tuple[list[float], float, dict]:
    r"""The expected slice, atol and inputs the generated slow test holds, read from its source: its
    ``get_inputs`` run here as written."""
    from diffusers.utils.torch_utils import randn_tensor

    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Integration")]
    values = {
        n.targets[0].id: ast.literal_eval(n.value)
        for n in cls.body
        if isinstance(n, ast.Assign) and n.targets[0].id in ("expected_slice", "atol")
    }
    (get_inputs,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_inputs"]
    namespace = {"torch": torch, "randn_tensor": randn_tensor, "torch_device": "cpu"}
    exec(compile(ast.Module([get_inputs], []), str(path), "exec"), namespace)  # noqa: S102 - our own output
    return values["expected_slice"], values["atol"], namespace["get_inputs"](None)


def test_the_expected_slice_is_the_references_on_the_tests_own_inputs(tmp_path, saved_port):
    result = generate_diffusers_tests(
        "wan_ref",
        "WanTransformer3DModel",
        reference=REFERENCE,
        pretrained=saved_port,
        convert="tests.diffusers_tests_pair:convert",
        out_dir=tmp_path,
    )
    (path,) = result.paths
    assert path == tmp_path / "tests/models/transformers/test_models_transformer_wan_ref.py"
    expected, atol, inputs = slow_test_parts(path)
    # the research code run on the inputs the test draws gives the slice the file holds
    reference = build_reference()
    with torch.no_grad():
        out = reference(
            inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"]
        ).flatten()
    assert torch.tensor(expected).tolist() == torch.cat([out[:8], out[-8:]]).tolist()
    # the tolerance comes from the measured float floors, and says so
    text = path.read_text()
    comments = " ".join(line.strip()[2:] for line in text.splitlines() if line.strip().startswith("# "))
    assert f"atol {atol:.2e}: 4 x (reference float floor " in comments and 1e-7 < atol < 1e-4
    assert "it was not taken from this port" in comments
    assert result.port_matches and "the port matches the reference's slice today" in result.render()
    assert "does not hold the converted reference weights" not in result.render()  # --convert agrees
    assert f'pretrained_model_name_or_path = "{saved_port}"' in text


def test_a_port_with_a_bug_gets_the_references_slice_and_a_warning(tmp_path):
    planted = save_port(tmp_path / "planted", plant="eps")

    def stale(state_dict):  # a conversion that moves one tensor more than the saved port holds
        from tests.diffusers_tests_pair import convert

        converted = convert(state_dict)
        converted["blocks.0.attn1.to_q.weight"] = converted["blocks.0.attn1.to_q.weight"] * 2
        return converted

    result = generate_diffusers_tests(
        "wan_bug",
        "WanTransformer3DModel",
        reference=REFERENCE,
        pretrained=planted,
        hub_id="org/wan-diffusers",
        convert=stale,
        out_dir=tmp_path / "out",
    )
    assert 'pretrained_model_name_or_path = "org/wan-diffusers"' in result.paths[0].read_text()
    assert (
        f"warning: {planted} does not hold the converted reference weights (0 missing, 1 differ; first"
        " blocks.0.attn1.to_q.weight)"
    ) in result.render()
    expected, atol, inputs = slow_test_parts(result.paths[0])
    from diffusers import WanTransformer3DModel

    port = WanTransformer3DModel.from_pretrained(str(planted)).eval()
    with torch.no_grad():
        out = port(**inputs, return_dict=False)[0].flatten()
    port_slice = torch.cat([out[:8], out[-8:]])
    # never the port's values: the planted eps moves them past the tolerance
    assert (port_slice - torch.tensor(expected)).abs().max() > atol
    assert result.port_matches is False
    assert result.render().startswith("warning: the port differs from the reference by ")


def test_files_are_written_only_where_asked_and_never_over_a_file_without_force(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = generate_diffusers_tests("tiny", "UNet2DModel")
    (path,) = result.paths
    assert path == Path("diffusers-tests-tiny/tests/models/unets/test_models_unet_tiny.py")
    assert "no slow test: it needs --reference" in result.render()
    path.write_text("# the porter's edits\n")
    with pytest.raises(ParityKitError, match="already exists; pass --force"):
        generate_diffusers_tests("tiny", "UNet2DModel")
    assert path.read_text() == "# the porter's edits\n"
    generate_diffusers_tests("tiny", "UNet2DModel", force=True)
    assert "class TestUNet2DModel(UNet2DModelTesterConfig, ModelTesterMixin):" in path.read_text()


def test_pipelines_paritykit_cannot_build_offline_are_refused_in_one_line(tmp_path):
    with pytest.raises(ParityKitError) as found:
        generate_diffusers_tests("flux", "FluxTransformer2DModel", pipeline="FluxPipeline", out_dir=tmp_path)
    message = str(found.value)
    assert message.startswith(
        "--pipeline FluxPipeline: its text_encoder, tokenizer, text_encoder_2, tokenizer_2"
    )
    assert "come from transformers" in message and "\n" not in message
    with pytest.raises(ParityKitError, match="--pipeline UNet2DModel: not a DiffusionPipeline"):
        generate_diffusers_tests("x", "UNet2DModel", pipeline="UNet2DModel", out_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_what_the_reference_was_given_is_said(tmp_path, saved_port):
    class TakesAnything(torch.nn.Module):  # a wrapper whose forward takes the optional inputs as **kwargs
        def __init__(self):
            super().__init__()
            self.inner = build_reference()

        def forward(self, x, timestep, context, **kwargs):
            self.seen = sorted(kwargs)
            return self.inner(x, timestep, context)

    reference = TakesAnything()
    result = generate_diffusers_tests(
        "wan_any",
        "WanTransformer3DModel",
        reference=lambda: reference,
        pretrained=saved_port,
        out_dir=tmp_path,
    )
    said = "the reference was called with hidden_states, timestep, encoder_hidden_states positionally"
    assert said in result.render()
    assert "not passed" not in result.render() and reference.seen == []  # Wan's inputs are all required


def test_bad_arguments_are_named(tmp_path, saved_port):
    with pytest.raises(ParityKitError, match="NAME 'Wan'"):
        generate_diffusers_tests("Wan", "WanTransformer3DModel", out_dir=tmp_path)
    with pytest.raises(ParityKitError, match="--model-class NoSuch"):
        generate_diffusers_tests("wan", "NoSuch", out_dir=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ParityKitError, match=f"--pretrained {empty}: no config.json"):
        generate_diffusers_tests("wan", "WanTransformer3DModel", reference=REFERENCE, pretrained=empty)
    with pytest.raises(ParityKitError, match="--reference .*<lambda>: returned a str, not a model"):
        generate_diffusers_tests(
            "wan", "WanTransformer3DModel", reference=lambda: "no model", pretrained=saved_port
        )
    with pytest.raises(ParityKitError, match="--convert returned a NoneType: return the port's state dict"):
        generate_diffusers_tests(
            "wan",
            "WanTransformer3DModel",
            reference=REFERENCE,
            pretrained=saved_port,
            convert=lambda sd: None,
        )
    with pytest.raises(ParityKitError, match=f"--pretrained {empty}: no config.json"):
        generate_diffusers_tests(
            "wan", "WanTransformer3DModel", pretrained=empty
        )  # checked with no --reference
    assert not list(tmp_path.glob("diffusers-tests-*")) and not (tmp_path / "tests").exists()
    ignored = generate_diffusers_tests(
        "unused", "UNet2DModel", hub_id="org/x", convert=lambda sd: sd, out_dir=tmp_path / "unused"
    )
    assert (
        "no slow test: it needs --reference (the expected slice comes from it) and --pretrained (the saved"
        in (ignored.render())
    )
    assert "; --hub-id and --convert unused" in ignored.render()


# ------------------------------------------------------------------------------- inside a diffusers checkout


# classes diffusers tests with its own configs, rendered from their defaults shrunk; PixArt's added
# conditions come from --inputs (no signature shapes them)
CLASSES = {
    "SD3Transformer2DModel": None,
    "PixArtTransformer2DModel": "tests.diffusers_tests_pair:pixart_inputs",
}


@pytest.fixture(scope="module")
def rendered(checkout, tmp_path_factory) -> dict:
    r"""Every file rendered into the checkout, then one pytest run over all of them (slow tests on): the Wan
    port with its slow test, the DiT and DDPM pipelines, and the set of classes above."""
    from diffusers import DiTTransformer2DModel

    scratch = tmp_path_factory.mktemp("ports")
    port = save_port(scratch / "transformer")
    wan = generate_diffusers_tests(
        "wan_port", "WanTransformer3DModel", reference=REFERENCE, pretrained=port, out_dir=checkout
    )
    DiTTransformer2DModel(
        out_channels=8, num_layers=2, num_attention_heads=4, attention_head_dim=16, sample_size=8
    ).save_pretrained(str(scratch / "dit"))
    dit = generate_diffusers_tests(
        "dit_port",
        "DiTTransformer2DModel",
        pipeline="DiTPipeline",
        pretrained=scratch / "dit",
        out_dir=checkout,
    )
    # an unconditional pipeline, no saved port: the UNet's unset sample size takes its input's
    ddpm = generate_diffusers_tests("ddpm_port", "UNet2DModel", pipeline="DDPMPipeline", out_dir=checkout)
    rest = [
        generate_diffusers_tests(f"set_{i}", name, inputs=inputs, out_dir=checkout)
        for i, (name, inputs) in enumerate(CLASSES.items())
    ]
    paths = [str(p.relative_to(checkout)) for r in (wan, dit, ddpm, *rest) for p in r.paths]
    run = run_pytest(checkout, *(p for p in paths if not p.endswith("__init__.py")), "-rA", slow=True)
    return {"port": port, "paths": paths, "run": run, "wan": str(wan.paths[0].relative_to(checkout))}


def test_every_rendered_file_follows_diffusers_ruff_settings(checkout, rendered):
    assert ruff(checkout, "check", *rendered["paths"]).returncode == 0
    assert ruff(checkout, "format", "--check", *rendered["paths"]).returncode == 0


def test_the_rendered_tests_pass_in_diffusers(rendered):
    run = rendered["run"]
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "failed" not in run.stdout
    summary = run.stdout.split("short test summary")[1]
    for path in rendered["paths"]:
        if not path.endswith("__init__.py"):
            assert f"PASSED {path}::" in summary, path  # every file ran and passed tests
    assert "TestWanTransformer3DModelIntegration::test_output_matches_reference" in summary
    assert rendered["paths"][1:7] == [
        "tests/models/transformers/test_models_transformer_dit_port.py",
        "tests/pipelines/dit_port/__init__.py",
        "tests/pipelines/dit_port/test_dit_port.py",
        "tests/models/unets/test_models_unet_ddpm_port.py",
        "tests/pipelines/ddpm_port/__init__.py",
        "tests/pipelines/ddpm_port/test_ddpm_port.py",
    ]


def test_the_pipeline_test_claims_a_shape_and_no_values(checkout, rendered):
    text = (checkout / "tests/pipelines/dit_port/test_dit_port.py").read_text()
    assert "self.assertEqual(tuple(output.shape), (1, 8, 8, 3))" in text and "expected_slice" not in text


def test_the_slow_test_fails_on_a_port_with_a_planted_bug(checkout, rendered):
    # the same file, the saved port replaced by one with a planted bug: the slow test fails, and says why
    port = rendered["port"]
    shutil.rmtree(port)
    save_port(port, plant="eps")
    run = run_pytest(checkout, rendered["wan"], "-k", "Integration", slow=True)
    assert run.returncode == 1, run.stdout[-3000:]
    assert "from the reference's slice > atol" in run.stdout


def test_inputs_given_by_a_function_are_rendered_by_kind(tmp_path):
    def inputs():  # no config argument: called without one
        return {
            "sample": torch.randn(1, 3, 32, 32),
            "timestep": torch.tensor([3.0]),
            "class_labels": None,
        }

    (path,) = generate_diffusers_tests("given", "UNet2DModel", inputs=inputs, out_dir=tmp_path).paths
    text = path.read_text()
    assert '"sample": randn_tensor(\n                (1, 3, 32, 32),' in text  # noise of the tensor's shape
    assert '"timestep": torch.tensor([3.0], dtype=torch.float32).to(torch_device),' in text  # its value
    assert '"class_labels": None,' in text
    with pytest.raises(ParityKitError, match="--inputs: sample is a list"):
        generate_diffusers_tests("given", "UNet2DModel", inputs=lambda: {"sample": [1]}, out_dir=tmp_path)
    with pytest.raises(ParityKitError, match="--inputs returned a str"):
        generate_diffusers_tests("given", "UNet2DModel", inputs=lambda config: "x", out_dir=tmp_path)
