"""`paritykit new`: every template renders, lints and runs as generated.

The execution tests render every template into one temp folder, then pay torch's import twice: once for a
driver that exercises the pipeline stubs with tiny real components (and saves the models the generated tests
load), once for a single pytest run over every generated test file, whose per-test outcomes the tests below
read from a JUnit report."""

from __future__ import annotations

import ast
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from paritykit.base.errors import ParityKitError
from paritykit.pack import scaffold

from tests.conftest import REPO

FIXTURES = REPO / "tests" / "_scaffold_fixtures"
RUFF = Path(sys.executable).with_name("ruff")
if not RUFF.exists():
    RUFF = Path(shutil.which("ruff") or "ruff")
KINDS = (
    "bisect-spec",
    "component-test",
    "config-diff",
    "pipeline-stub",
    "pipeline-stub-modular",
    "stage-test",
    "triage-spec",
)
COMMANDS = (
    "bisect-spec",
    "component-test",
    "config-diff",
    "pipeline-stub",
    "pipeline-stub --modular",
    "stage-test",
    "triage-spec",
    "diffusers-tests",
)


def _env(*paths: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "helpers"), *map(str, paths), env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"  # tiny local models only; never wait on the network
    # Tiny models run fastest on one thread; on a busy machine torch's spinning workers cost 10-50x here.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _ruff(folder: Path) -> None:
    # ruff's own defaults, no project config: generated files land in the user's tree, not ours.
    for args in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        result = subprocess.run([str(RUFF), *args, "--isolated", str(folder)], capture_output=True, text=True)
        assert result.returncode == 0, f"ruff {args[0]}:\n{result.stdout}{result.stderr}"


def _render_all(out: Path) -> dict[str, str]:
    """Every template in several variants; none of the paths exists (the user may render before
    converting)."""
    variants = [
        ("component-test", "unet", {"reference": "pkg.ref:build", "diffusers": "UNet2DModel"}),
        (
            "component-test",
            "cond",
            {
                "reference": "pkg.ref:build",
                "diffusers": "UNet2DConditionModel",
                "convert": "conv:convert",
                "pretrained": "/models/cond",
            },
        ),
        ("component-test", "vae", {"reference": "r:b", "diffusers": "my.port:MyVAE", "inputs": "i:make"}),
        ("pipeline-stub", "Tiny", {}),
        ("pipeline-stub", "PixelPipeline", {"components": "scheduler,unet"}),
        ("pipeline-stub", "DiT", {"components": "transformer,scheduler,vae"}),
        ("pipeline-stub", "TextDiT", {"components": "transformer,scheduler,text_encoder,tokenizer"}),
        ("stage-test", "tiny", {"pipeline": "p:TinyPipeline", "reference": "r:run", "pretrained": "/x/pipe"}),
        ("stage-test", "factory", {"pipeline": "p:build_pipeline", "reference": "r:run"}),
        ("config-diff", "unet", {"reference": "/ref/config.yaml", "diffusers": "/port/unet"}),
        ("bisect-spec", "plain", {"reference": "r:ref", "port": "p:port", "inputs": "i:make"}),
        (
            "bisect-spec",
            "mapped",
            {"reference": "r:ref", "port": "p:port", "inputs": "i:make", "port_inputs": "i:to_port"},
        ),
        (
            "triage-spec",
            "sd",
            {
                "pipeline": "p:Pipe",
                "pretrained": "/x/pipe",
                "reference": "r:run",
                "reference_denoiser": "r:unet",
            },
        ),
    ]
    variants += [
        ("pipeline-stub-modular", "Tiny", {}),
        ("pipeline-stub-modular", "Pixel", {"components": "unet,scheduler"}),
        ("pipeline-stub-modular", "DiT", {"components": "transformer,scheduler,vae,text_encoder,tokenizer"}),
    ]
    texts = {}
    for kind, name, options in variants:
        for path in scaffold.generate(kind, name, out_dir=out, **options).paths:
            texts[path.relative_to(out).as_posix()] = path.read_text()
    return texts


# ------------------------------------------------------------------------------------- rendering, linting
def test_list_shows_every_template_with_one_line(cli):
    # every `paritykit new` subcommand is listed, the rendered sets too (diffusers-tests was once missing)
    from paritykit.cli.new import new

    assert {c.split()[0] for c in COMMANDS} == set(new.commands)
    result = cli("new", "--list")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == len(COMMANDS)
    for line, command in zip(lines, COMMANDS):
        assert line.startswith(command + "  ") and len(line[len(command) :].strip()) > 20, line


def test_every_template_declares_its_variables_in_one_spec(tmp_path):
    specs = scaffold.templates()
    assert sorted(specs) == sorted(KINDS)
    for kind, spec in specs.items():
        stem = kind.replace("-", "_")
        root = scaffold.data_dir("templates")
        assert (
            spec.path in (root / f"{stem}.py.j2", root / stem / "__init__.py.j2") and "name" in spec.variables
        )

    # the registry holds a template to its spec: a variable used but not declared is refused
    broken = tmp_path / "broken.py.j2"
    spec = (
        "{#- spec\nsummary: s\noutput: x_{name}.py\nrun: python {filename}\nvariables:\n  name:"
        " identifier\n-#}\n"
    )
    broken.write_text(spec + "X = {{ name|pystr }}\nY = {{ undeclared }}\n")
    with pytest.raises(ParityKitError, match=r"used but not declared: \['undeclared'\]"):
        scaffold.templates(tmp_path)
    broken.write_text(spec + "X = {{ name|pystr }}\n")
    [rendered] = scaffold.render("broken", "ok", template_dir=tmp_path)
    assert (rendered.filename, rendered.text) == ("x_ok.py", 'X = "ok"\n')


def test_generated_files_lint_clean_with_headers_and_no_markers(tmp_path):
    texts = _render_all(tmp_path)
    assert len(texts) == 13 + 3 * 7
    assert {name for name in texts if name.startswith("modular_tiny/")} == {
        f"modular_tiny/{part}.py"
        for part in (
            "__init__",
            "modular_pipeline",
            "encoders",
            "before_denoise",
            "denoise",
            "decoders",
            "modular_blocks",
        )
    }
    _ruff(tmp_path)
    for filename, text in texts.items():
        body = text.removeprefix("#!/usr/bin/env python3\n")
        assert body.startswith('"""'), filename
        header = body.split('"""')[1]
        assert "Generated by paritykit" in header and "paritykit new " in header and "\nRun" in header
        assert filename in header or "PIPELINE_DIR" in header or "/" in filename, filename
        for marker in ("{{", "}}", "{%", "%}", "{#", "#}"):
            assert marker not in text, (filename, marker)


def test_string_literals_round_trip_and_keep_ruffs_quote_style(tmp_path):
    rng = random.Random(0)
    alphabet = "ab/ .-_" + "\"'\\" + "üé漢" + "\t\n\x00"
    values = ["", "plain", 'we"ird', "it's", "\\\\server\\share"]
    values += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    source = "".join(f"V{i} = {scaffold.python_str(value)}\n" for i, value in enumerate(values))
    tree = ast.parse(source)
    assert [node.value.value for node in tree.body] == values
    (tmp_path / "literals.py").write_text(source, encoding="utf-8")
    _ruff(tmp_path)


def test_header_command_reproduces_the_file(tmp_path, cli):
    originals = _render_all(tmp_path / "a")
    for filename in ("test_cond_component.py", "modular_dit/denoise.py", "test_tiny_stages.py"):
        header = originals[filename].split('"""')[1]
        command = header.split("Generated by paritykit")[1].splitlines()[1].strip()
        args = shlex.split(command)
        assert args[:2] == ["paritykit", "new"], command
        result = cli(*args[1:], "--out", tmp_path / "b")
        assert result.returncode == 0, result.stderr
        # The header's run line names the file from where `paritykit new` ran: it follows --out.
        again = (tmp_path / "b" / filename).read_text()
        assert again.replace(str(tmp_path / "b"), str(tmp_path / "a")) == originals[filename]


def test_relative_paths_are_anchored_at_the_generated_file(tmp_path, cli):
    result = cli(
        "new",
        "config-diff",
        "rel",
        "--reference",
        "configs/ref.yaml",
        "--diffusers",
        "port/unet",
        "--out",
        "tests/generated",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(Path("tests/generated/config_diff_rel.py"))
    text = (tmp_path / "tests/generated/config_diff_rel.py").read_text()
    assert 'REFERENCE = HERE / "../../configs/ref.yaml"' in text
    assert 'DIFFUSERS = HERE / "../../port/unet"' in text


@pytest.mark.parametrize(
    ("kind", "name", "options", "rule"),
    [
        ("component-test", "my-vae", {"reference": "a:b", "diffusers": "X"}, "must be a Python identifier"),
        ("component-test", "class", {"reference": "a:b", "diffusers": "X"}, "not a keyword"),
        ("component-test", "2vae", {"reference": "a:b", "diffusers": "X"}, "must be a Python identifier"),
        ("pipeline-stub", "my_model", {"components": "unet,scheduler"}, "must be a CamelCase class name"),
        (
            "stage-test",
            "s",
            {"pipeline": "pkg.mod", "reference": "a:b"},
            "--pipeline 'pkg.mod' must be MODULE:NAME",
        ),
        (
            "stage-test",
            "s",
            {"pipeline": "a:b", "reference": "a.:b"},
            "--reference 'a.:b' must be MODULE:NAME",
        ),
        (
            "component-test",
            "v",
            {"reference": "a:b", "diffusers": "bad name"},
            "--diffusers 'bad name' must be",
        ),
        ("component-test", "v", {"reference": "a:b", "diffusers": "X", "convert": "x:import"}, "--convert"),
        ("pipeline-stub", "P", {"components": "unet,scheduler,vea"}, "unknown component 'vea'"),
        ("pipeline-stub", "P", {"components": "unet,transformer,scheduler"}, "exactly one denoiser"),
        ("pipeline-stub", "P", {"components": "unet"}, "must include 'scheduler'"),
        ("pipeline-stub", "P", {"components": "unet,scheduler,tokenizer"}, "go together"),
        ("config-diff", "c", {"reference": "", "diffusers": "b"}, "needs --reference"),
        ("component-test", "v", {"reference": "a:b", "diffusers": "X", "atol": "abc"}, "--atol 'abc'"),
        ("stage-test", "s", {"pipeline": "a:b", "reference": "r:b", "rtol": "-1"}, "--rtol '-1'"),
        ("component-test", "v", {"reference": "a:b", "diffusers": "X", "rtol": "inf"}, "non-negative number"),
    ],
)
def test_invalid_values_are_refused_naming_the_rule(tmp_path, kind, name, options, rule):
    with pytest.raises(ParityKitError, match=None) as excinfo:
        scaffold.generate(kind, name, out_dir=tmp_path, **options)
    assert rule in str(excinfo.value)
    assert not any(tmp_path.iterdir()), "a refused render must write nothing"


def test_invalid_name_from_the_cli_is_one_line_exit_2(tmp_path, cli):
    result = cli("new", "pipeline-stub", "my-model", "--out", tmp_path)
    assert result.returncode == 2
    assert (
        result.stderr.count("\n") == 1 and "CamelCase" in result.stderr and "Traceback" not in result.stderr
    )
    assert not any(tmp_path.iterdir())


def test_existing_file_is_refused_byte_identical_until_force(tmp_path, cli):
    args = ("new", "component-test", "vae", "--reference", "r:build", "--diffusers", "AutoencoderKL")
    target = tmp_path / "test_vae_component.py"
    target.write_bytes(b"# my own edits\n")
    before = target.stat()

    result = cli(*args, "--out", tmp_path)
    assert result.returncode == 2
    assert "already exists" in result.stderr and "--force" in result.stderr and str(target) in result.stderr
    assert target.read_bytes() == b"# my own edits\n" and target.stat().st_mtime_ns == before.st_mtime_ns

    result = cli(*args, "--out", tmp_path, "--force")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target)
    assert "Generated by paritykit" in target.read_text()
    assert [p.name for p in tmp_path.iterdir()] == [target.name], "no temp file may be left behind"


def test_new_without_a_template_prints_help(cli):
    result = cli("new")
    assert result.returncode == 0 and "--list" in result.stdout
    for command in ("component-test", "config-diff", "pipeline-stub --modular", "stage-test"):
        assert command in result.stdout


def test_out_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ParityKitError, match="cannot create the folder"):
        scaffold.generate(
            "pipeline-stub", "P", out_dir=tmp_path / "file" / "sub", components="unet,scheduler"
        )


def test_out_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ParityKitError, match="is a file"):
        scaffold.generate("pipeline-stub", "P", out_dir=tmp_path / "file", components="unet,scheduler")


def test_new_imports_neither_torch_nor_diffusers(tmp_path):
    code = (
        "import sys\n"
        "from paritykit.cli import cli\n"
        "for args in (['new', '--list'], ['new', 'pipeline-stub', 'Tiny', '--out', sys.argv[1]],\n"
        "             ['new', 'component-test', 'u', '--reference', 'a:b', '--diffusers', 'UNet2DModel',\n"
        "              '--out', sys.argv[1]]):\n"
        "    try:\n"
        "        cli.main(args)\n"
        "    except SystemExit as exc:\n"
        "        assert not exc.code, exc.code\n"
        "print('HEAVY=' + ','.join(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=_env()
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "HEAVY=", result.stdout


def test_config_diff_script_exit_codes(tmp_path):
    # quotes, a backslash and non-ASCII in the path must survive into the generated string literals
    odd = tmp_path / 'we"ird \\ dir ü'
    odd.mkdir()
    (odd / "a.json").write_text('{"in_channels": 4, "block_out_channels": [32, 64], "_class_name": "X"}')
    (odd / "same.json").write_text('{"in_channels": 4.0, "block_out_channels": [32, 64]}')
    (odd / "other.json").write_text('{"in_channels": 8, "block_out_channels": [32, 64]}')
    runs = {}
    for name, other in (("same", "same.json"), ("differ", "other.json"), ("missing", "nope.json")):
        written = scaffold.generate(
            "config-diff",
            name,
            out_dir=tmp_path / "gen",
            reference=str(odd / "a.json"),
            diffusers=str(odd / other),
        )
        script = written.paths[0]
        assert os.access(script, os.X_OK)
        args = [sys.executable, str(script), *(["--json"] if name == "differ" else [])]
        runs[name] = subprocess.run(args, capture_output=True, text=True, env=_env())
    _ruff(tmp_path / "gen")
    assert runs["same"].returncode == 0, runs["same"].stdout + runs["same"].stderr
    assert runs["differ"].returncode == 1, runs["differ"].stdout + runs["differ"].stderr
    report = json.loads(runs["differ"].stdout)
    assert report["schema_version"] == 1
    assert [d["key"] for d in report["differences"]] == ["in_channels"]
    assert runs["missing"].returncode == 2 and "nope.json" in runs["missing"].stderr
    assert "Traceback" not in runs["missing"].stderr


# ------------------------------------------------------------------------------------ running what we made
@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Render everything into one folder, drive the stubs, then run every generated test in one pytest."""
    work = tmp_path_factory.mktemp("scaffold_run")
    unet = {
        "reference": "scaffold_parts:build_reference",
        "diffusers": "UNet2DModel",
        "convert": "scaffold_parts:convert",
        "pretrained": "saved_unet",
    }
    stages = {
        "pipeline": "pipeline_tiny:TinyPipeline",
        "pretrained": "saved_pipeline",
        "reference": "scaffold_parts:run_reference",
    }
    render = [
        ("pipeline-stub", "Tiny", {}),
        ("pipeline-stub", "Pixel", {"components": "unet,scheduler"}),
        ("pipeline-stub", "DiT", {"components": "transformer,scheduler,vae"}),
        ("pipeline-stub-modular", "Tiny", {}),
        ("pipeline-stub-modular", "Pixel", {"components": "unet,scheduler"}),
        ("component-test", "unet", unet),
        ("component-test", "stale", {**unet, "pretrained": "stale_unet"}),
        ("component-test", "eps", {**unet, "reference": "scaffold_parts:build_reference_eps6"}),
        (
            "component-test",
            "epsloose",
            {**unet, "reference": "scaffold_parts:build_reference_eps6", "atol": "1e-4", "rtol": "1e-4"},
        ),
        ("component-test", "badconv", {**unet, "convert": "scaffold_parts:convert_with_bug"}),
        ("component-test", "custom", {**unet, "inputs": "scaffold_parts:unet_inputs"}),
        (
            "component-test",
            "module",
            {**unet, "convert": "scaffold_parts:convert_to_model", "pretrained": None},
        ),
        (
            "component-test",
            "cond",
            {
                **unet,
                "reference": "scaffold_parts:build_reference_cond_unet",
                "diffusers": "UNet2DConditionModel",
                "pretrained": "saved_cond_unet",
            },
        ),
        (
            "component-test",
            "vae",
            {
                **unet,
                "reference": "scaffold_parts:build_reference_vae",
                "diffusers": "AutoencoderKL",
                "pretrained": "saved_vae",
            },
        ),
        (
            "component-test",
            "wan",
            {
                "reference": "scaffold_parts:build_reference_wan",
                "diffusers": "WanTransformer3DModel",
                "convert": "scaffold_parts:convert_wan",
                "pretrained": "saved_wan",
            },
        ),
        (
            "component-test",
            "rope",
            {
                "reference": "scaffold_parts:build_reference_rope",
                "diffusers": "UNet2DModel",
                "convert": "scaffold_parts:convert_rope",
                "inputs": "scaffold_parts:rope_inputs",
            },
        ),
        (
            "component-test",
            "ropeslip",
            {
                "reference": "scaffold_parts:build_reference_rope",
                "diffusers": "UNet2DModel",
                "convert": "scaffold_parts:convert_rope_slip",
                "inputs": "scaffold_parts:rope_inputs",
            },
        ),
        ("stage-test", "tiny", stages),
        ("stage-test", "buggy", {**stages, "reference": "scaffold_parts:run_reference_with_decode_bug"}),
        (
            "stage-test",
            "modular",
            {"pipeline": "scaffold_parts:build_modular_port", "reference": stages["reference"]},
        ),
    ]
    cwd = os.getcwd()
    os.chdir(work)  # relative --pretrained paths, as a user in that folder would type them
    try:
        for kind, name, options in render:
            scaffold.generate(kind, name, out_dir="generated", **options)
    finally:
        os.chdir(cwd)
    generated = work / "generated"
    _ruff(generated)

    env = _env(FIXTURES, generated)
    env["SCAFFOLD_PIPELINE_DIR"] = str(work / "saved_pipeline")
    # The driver also saves work/saved_pipeline, saved_unet and stale_unet, which the generated tests load.
    driver = subprocess.run(
        [sys.executable, str(FIXTURES / "drive_stub.py"), str(work)],
        capture_output=True,
        text=True,
        env=_env(FIXTURES, generated),
        cwd=work,
        timeout=600,
    )
    junit = work / "junit.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "generated"],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        timeout=600,
    )
    outcomes, messages = {}, {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            failure = case.find("failure")
            skipped = case.find("skipped")
            outcomes[case.get("name")] = (
                "failed" if failure is not None else "skipped" if skipped is not None else "passed"
            )
            if failure is not None:
                messages[case.get("name")] = (failure.get("message") or "") + (failure.text or "")
    return {"driver": driver, "run": run, "outcomes": outcomes, "messages": messages, "generated": generated}


def _outcome(executed, test: str) -> str:
    outcome = executed["outcomes"].get(test)
    assert outcome is not None, (
        f"{test} did not run:\n{executed['run'].stdout[-3000:]}{executed['run'].stderr}"
    )
    return outcome


def _check_passed(executed, check: str) -> None:
    driver = executed["driver"]
    assert f"CHECK {check} OK" in driver.stdout, driver.stdout[-6000:] + driver.stderr[-3000:]


def test_pipeline_stub_runs_end_to_end_and_its_checkpoints_save_stop_load(executed):
    _check_passed(executed, "text")  # UNet2DConditionModel + DDIM + AutoencoderKL + tiny CLIP
    _check_passed(executed, "pixel")  # UNet2DModel + DDIM, no VAE
    _check_passed(executed, "transformer")  # Transformer2DModel + DDIM + AutoencoderKL
    assert executed["driver"].returncode == 0


def test_modular_pipeline_stub_matches_the_standard_stub(executed):
    _check_passed(executed, "modular")


def test_component_test_passes_on_a_faithful_port(executed):
    # inputs shaped from the port class's forward and config (UNet2DModel, UNet2DConditionModel,
    # AutoencoderKL, and Wan's DiT against its research implementation, called positionally); then --inputs
    for name in ("unet", "cond", "vae", "wan", "custom"):
        for mode in ("fresh", "saved"):
            test = f"test_{name}_{mode}"
            assert _outcome(executed, test) == "passed", executed["messages"].get(test, "")[-3000:]
    # a conversion that returns the model itself needs no saved config; the saved test skips until one exists
    assert _outcome(executed, "test_module_fresh") == "passed", executed["messages"].get("test_module_fresh")
    assert _outcome(executed, "test_module_saved") == "skipped"


def test_a_complex_rotary_buffer_keeps_its_dtype_and_the_test_tells_the_slip_from_the_port(executed):
    # the reference holds its rotary table as a complex buffer: cast wholesale to float32 it would lose the
    # imaginary part and the correct port would fail; cast real tensors only, the port passes, the slip fails
    assert _outcome(executed, "test_rope_fresh") == "passed", executed["messages"].get("test_rope_fresh")
    assert _outcome(executed, "test_ropeslip_fresh") == "failed"


def test_component_test_fails_readably_on_one_perturbed_weight(executed):
    # a stale save: the fresh conversion is right, the saved model is not
    assert _outcome(executed, "test_stale_fresh") == "passed"
    assert _outcome(executed, "test_stale_saved") == "failed"
    # a conversion bug: the fresh test catches it, the (correct) saved model passes
    assert _outcome(executed, "test_badconv_fresh") == "failed"
    assert _outcome(executed, "test_badconv_saved") == "passed"
    for test in ("test_stale_saved", "test_badconv_fresh"):
        report = executed["messages"][test]
        assert "AssertionError" in report and "max" in report.lower(), report[-2000:]


def test_component_test_catches_a_groupnorm_eps_bug_at_paritykits_default_tolerances(executed):
    # The reference's GroupNorms use eps 1e-6, the port's 1e-5 (max |diff| ~8e-5 here): a fixed 1e-4
    # tolerance passed it; the generated test uses paritykit's float32 defaults, as `compare` does.
    for test in ("test_eps_fresh", "test_eps_saved"):
        assert _outcome(executed, test) == "failed", executed["messages"].get(test, "")[-2000:]
        report = executed["messages"][test]
        assert "B does not match A" in report and "atol" in report, report[-2000:]


def test_a_tolerance_the_user_sets_is_the_one_the_generated_test_uses(executed):
    # --atol/--rtol 1e-4 (the old fixed tolerance): the same eps difference now passes, as the user asked.
    text = (executed["generated"] / "test_epsloose_component.py").read_text()
    assert "ATOL: float | None = 0.0001" in text and "--atol 1e-4" in text
    for test in ("test_epsloose_fresh", "test_epsloose_saved"):
        assert _outcome(executed, test) == "passed", executed["messages"].get(test, "")[-2000:]


def test_assert_parity_failure_starts_with_the_report_not_library_source(executed):
    # __tracebackhide__: pytest shows the generated test's line, then the report; never paritykit's source.
    report = executed["messages"]["test_eps_fresh"]
    assert "def assert_parity" not in report and "raise AssertionError(" not in report, report[-3000:]


def test_stage_tests_pass_against_the_stub_and_a_reference_callable(executed):
    for stage in ("encode", "decode", "denoise"):
        test = f"test_tiny_{stage}"
        assert _outcome(executed, test) == "passed", executed["messages"].get(test, "")[-3000:]


def test_stage_tests_run_against_the_modular_stub_too(executed):
    for stage in ("encode", "decode", "denoise"):
        test = f"test_modular_{stage}"
        assert _outcome(executed, test) == "passed", executed["messages"].get(test, "")[-3000:]


def test_stage_tests_isolate_a_decode_bug(executed):
    assert _outcome(executed, "test_buggy_encode") == "passed"
    assert _outcome(executed, "test_buggy_denoise") == "passed"
    assert _outcome(executed, "test_buggy_decode") == "failed"


def test_a_generated_test_runs_with_plain_pytest_from_another_folder(tmp_path):
    # the user's module sits in the folder `paritykit new` ran in; plain `pytest` (no -m, so that folder is
    # not on sys.path) run from elsewhere must still import it: the generated file puts it there
    import torch
    from diffusers import UNet2DModel

    tiny = dict(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )
    torch.manual_seed(0)
    UNet2DModel(**tiny).save_pretrained(tmp_path / "saved")
    (tmp_path / "user_models.py").write_text(
        "from pathlib import Path\n\nfrom diffusers import UNet2DModel\n\n\n"
        "def build_reference():\n"
        "    return UNet2DModel.from_pretrained(Path(__file__).parent / 'saved')\n"
    )
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        options = {
            "reference": "user_models:build_reference",
            "diffusers": "UNet2DModel",
            "pretrained": "saved",
        }
        scaffold.generate("component-test", "unet", out_dir="tests_out", **options)
    finally:
        os.chdir(cwd)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(REPO / "helpers")
    pytest_bin = Path(sys.executable).with_name("pytest")
    run = subprocess.run(
        [
            str(pytest_bin),
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "tests_out" / "test_unet_component.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=elsewhere,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
