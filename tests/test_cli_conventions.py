"""Every command against the CLI conventions a user relies on at 2 a.m.

* bad input: exit 2 and exactly one ``paritykit: error: …`` line naming the file or argument, never a
  traceback (a spec's own exception: that line plus its traceback trimmed to the user's files);
* with ``--json``: stdout is one strict JSON object ``{"schema_version": 1, "error": "…"}``;
* comparisons exit 0 same / 1 differ, and their JSON carries ``schema_version`` 1 and an ``environment``;
* no user file is lost: generated code is never overwritten without ``--force``; reports are;
* ``--help``, ``skills list`` and ``new --list`` never import torch or diffusers.

Real files throughout. Commands run in-process through ``paritykit.cli.cli.main`` (the very entry point
``python -m paritykit`` calls, with its error handling) so torch is imported once; an uncaught exception
is reported the way a whole process would show it, as a traceback with exit 1. Import checks and the demo
run as separate processes."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from paritykit.cli import cli as paritykit_cli

from tests.conftest import REPO

# ------------------------------------------------------------------------------------------------ fixtures


class _Evil:
    """Pickles to a call of os.system: a loader that honours it would run a shell command."""

    def __reduce__(self):
        return (os.system, ("echo paritykit-test-should-never-run",))


SPEC_HEAD = "import torch\n\n\ndef make_inputs():\n    return (torch.ones(2, 3),), {}\n\n\n"
SPEC_OK = (
    SPEC_HEAD
    + "def build_reference():\n    torch.manual_seed(0)\n    return torch.nn.Sequential(torch.nn.Linear(3,"
    " 3), torch.nn.ReLU())\n\n\ndef build_port():\n    torch.manual_seed(0)\n    return"
    " torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())\n"
)
SPEC_DIVERGE = SPEC_OK.replace(
    "def build_port():\n    torch.manual_seed(0)\n    return torch.nn.Sequential(torch.nn.Linear(3, 3),"
    " torch.nn.ReLU())",
    "def build_port():\n    torch.manual_seed(0)\n    port = torch.nn.Sequential(torch.nn.Linear(3, 3),"
    " torch.nn.ReLU())\n    with torch.no_grad():\n        port[0].bias.add_(0.5)\n    return port",
)
TRIAGE_OK = """import torch


class Denoiser(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, t):
        return self.lin(x) * t / 3


REF, PORT = Denoiser(), Denoiser()


def loop(model):
    x = torch.randn(1, 4)
    for t in (3.0, 2.0, 1.0):
        x = x - 0.1 * model(x, torch.tensor(t))
    return x


def run_reference():
    return loop(REF)


def run_port():
    return loop(PORT)


def reference_denoiser():
    return REF


def port_denoiser():
    return PORT
"""
TRIAGE_DIFFER = TRIAGE_OK.replace(
    "REF, PORT = Denoiser(), Denoiser()", "REF, PORT = Denoiser(), Denoiser()\nPORT.lin.bias.data += 0.5"
)
SPEC_RAISE = (
    SPEC_HEAD + "def build_reference():\n    return torch.nn.Linear(3, 3)\n\n\n"
    "def _helper():\n    raise RuntimeError('boom in user code')\n\n\n"
    "def build_port():\n    return _helper()\n"
)


@pytest.fixture(scope="session")
def files(tmp_path_factory) -> Path:
    """A folder of tiny real inputs, good and bad, shared by the read-only tests."""
    import numpy as np
    import torch
    from paritykit.tracing.checkpoints import Checkpoint, save_checkpoints
    from PIL import Image
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("conventions")
    gen = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    save_file(a, str(root / "a.safetensors"))
    save_file({"w": a["w"] + 1.0, "b": a["b"]}, str(root / "b.safetensors"))
    save_file({"w": a["w"], "extra": torch.zeros(2)}, str(root / "c.safetensors"))
    save_file({"x": torch.tensor([1.0, float("nan"), 3.0])}, str(root / "nan1.safetensors"))
    save_file({"x": torch.tensor([1.0, float("nan"), float("inf")])}, str(root / "nan2.safetensors"))
    raw = (root / "a.safetensors").read_bytes()
    (root / "trunc.safetensors").write_bytes(raw[: len(raw) // 2])
    (root / "empty.safetensors").write_bytes(b"")
    torch.save(a, root / "a.pt")
    torch.save([1, 2, 3], root / "list.pt")
    (root / "evil.pt").write_bytes(pickle.dumps({"w": _Evil()}))
    (root / "garbage.pt").write_bytes(b"garbage, not a pickle\n")
    (root / "x.unknown").write_text("what is this\n")
    (root / "adir").mkdir()
    (root / "c1.json").write_text(json.dumps({"sample_size": 32, "layers": 2}))
    (root / "c2.json").write_text(json.dumps({"sample_size": 32, "layers": 3}))
    (root / "bad.json").write_text("{not json")
    (root / "sigmas.json").write_text("[1.0, 0.75, 0.5, 0.25]")
    (root / "sched_a.json").write_text("[999, 749, 499, 249]")
    (root / "sched_b.json").write_text("[999, 750, 500, 250]")
    pixels = (np.random.RandomState(0).rand(8, 8, 3) * 255).astype("uint8")
    Image.fromarray(pixels).save(root / "i1.png")
    Image.fromarray(255 - pixels).save(root / "i2.png")
    (root / "notimg.png").write_bytes(b"not a png at all")
    for name, drift in (("steps_a", 0.0), ("steps_b", 0.25)):
        save_checkpoints(
            root / name,
            {
                f"after_step_{i}": Checkpoint(data={"latents": torch.ones(2, 2) * (1 + drift * i)})
                for i in range(4)
            },
        )
    (root / "spec_ok.py").write_text(SPEC_OK)
    (root / "spec_diverge.py").write_text(SPEC_DIVERGE)
    (root / "spec_raise.py").write_text(SPEC_RAISE)
    (root / "spec_syntax.py").write_text("def build_reference(:\n    pass\n")
    (root / "spec_empty.py").write_text("x = 1\n")
    (root / "triage_ok.py").write_text(TRIAGE_OK)
    (root / "triage_differ.py").write_text(TRIAGE_DIFFER)
    return root


# ------------------------------------------------------------------------------------------------ running


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str


def invoke(cwd: Path, *args: str) -> Run:
    """``paritykit ARGS`` in ``cwd`` through the real entry point; an escaping exception shows as a
    traceback."""
    runner = CliRunner()
    with contextlib.chdir(cwd):
        result = runner.invoke(
            paritykit_cli, [str(a) for a in args], catch_exceptions=True, prog_name="paritykit"
        )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        shown = "".join(traceback.format_exception(*result.exc_info))
        return Run(1, result.stdout, result.stderr + shown)
    return Run(result.exit_code, result.stdout, result.stderr)


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "helpers"), env.get("PYTHONPATH", "")])
    return env


def strict_json(text: str) -> dict:
    """Exactly one JSON object, no NaN/Infinity tokens."""

    def refuse(token):
        raise AssertionError(f"non-strict JSON token {token} in {text!r}")

    payload = json.loads(text, parse_constant=refuse)
    assert isinstance(payload, dict), text
    return payload


def error_lines(run: Run) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.strip()]


def assert_one_line_error(run: Run, *names: str) -> str:
    assert "Traceback" not in run.stderr, run.stderr
    assert run.code == 2, (run.code, run.stdout, run.stderr)
    lines = error_lines(run)
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("paritykit: error: "), lines[0]
    for name in names:
        assert name in lines[0], f"{name!r} not named in: {lines[0]}"
    return lines[0]


def assert_json_error(run: Run, *names: str) -> str:
    assert "Traceback" not in run.stderr, run.stderr
    assert run.code == 2, (run.code, run.stdout, run.stderr)
    payload = strict_json(run.stdout)
    assert set(payload) == {"schema_version", "error"}, payload
    assert payload["schema_version"] == 1
    message = payload["error"]
    assert isinstance(message, str) and message and "\n" not in message, payload
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"
    return message


# ------------------------------------------------------------------------------------------------ bad input

# (id, arguments, strings the error line must contain, whether the command takes --json)
BAD_INPUT = [
    # compare
    ("compare-missing", ["compare", "missing.safetensors", "a.safetensors"], ["missing.safetensors"], True),
    ("compare-empty-dir", ["compare", "adir", "a.safetensors"], ["adir"], True),
    ("compare-truncated", ["compare", "trunc.safetensors", "a.safetensors"], ["trunc.safetensors"], True),
    ("compare-empty-file", ["compare", "empty.safetensors", "a.safetensors"], ["empty.safetensors"], True),
    ("compare-dangerous-pickle", ["compare", "evil.pt", "a.safetensors"], ["evil.pt", "system"], True),
    ("compare-garbage-pickle", ["compare", "garbage.pt", "a.safetensors"], ["garbage.pt"], True),
    ("compare-non-dict", ["compare", "list.pt", "a.safetensors"], ["list.pt"], True),
    ("compare-unknown-suffix", ["compare", "x.unknown", "a.safetensors"], ["x.unknown"], True),
    ("compare-bad-map", ["compare", "a.safetensors", "b.safetensors", "--map", "(=x"], ["--map"], True),
    (
        "compare-bad-map-replacement",
        ["compare", "a.safetensors", "b.safetensors", "--map", "x=\\9"],
        ["--map", "replacement"],
        True,
    ),
    ("compare-map-no-equals", ["compare", "a.safetensors", "b.safetensors", "--map", "w"], ["--map"], True),
    ("compare-bad-atol", ["compare", "a.safetensors", "b.safetensors", "--atol", "abc"], ["--atol"], True),
    ("compare-negative-atol", ["compare", "a.safetensors", "b.safetensors", "--atol", "-1"], ["atol"], True),
    ("compare-bad-limit", ["compare", "a.safetensors", "b.safetensors", "--limit", "-1"], ["--limit"], True),
    # config-diff
    ("config-missing", ["config-diff", "missing.json", "c1.json"], ["missing.json"], True),
    ("config-empty-dir", ["config-diff", "adir", "c1.json"], ["adir"], True),
    ("config-truncated", ["config-diff", "trunc.safetensors", "c1.json"], ["trunc.safetensors"], True),
    ("config-not-json", ["config-diff", "bad.json", "c1.json"], ["bad.json"], True),
    ("config-unknown-suffix", ["config-diff", "c1.json", "x.unknown"], ["x.unknown"], True),
    ("config-bad-map", ["config-diff", "c1.json", "c2.json", "--map", "(=x"], ["--map"], True),
    (
        "config-bad-map-replacement",
        ["config-diff", "c1.json", "c2.json", "--map", "x=\\9"],
        ["--map", "replacement"],
        True,
    ),
    # weights diff
    (
        "wdiff-missing",
        ["weights", "diff", "missing.safetensors", "a.safetensors"],
        ["missing.safetensors"],
        True,
    ),
    ("wdiff-empty-dir", ["weights", "diff", "adir", "a.safetensors"], ["adir"], True),
    (
        "wdiff-truncated",
        ["weights", "diff", "trunc.safetensors", "a.safetensors"],
        ["trunc.safetensors"],
        True,
    ),
    (
        "wdiff-truncated-keys-only",
        ["weights", "diff", "a.safetensors", "trunc.safetensors", "--keys-only"],
        ["trunc.safetensors"],
        True,
    ),
    ("wdiff-dangerous-pickle", ["weights", "diff", "evil.pt", "a.safetensors"], ["evil.pt", "system"], True),
    ("wdiff-non-dict", ["weights", "diff", "list.pt", "a.safetensors"], ["list.pt"], True),
    ("wdiff-unknown-suffix", ["weights", "diff", "x.unknown", "a.safetensors"], ["x.unknown"], True),
    ("wdiff-bad-map", ["weights", "diff", "a.safetensors", "b.safetensors", "--map", "(=x"], ["--map"], True),
    (
        "wdiff-bad-map-replacement",
        ["weights", "diff", "a.safetensors", "b.safetensors", "--map", "x=\\9"],
        ["--map", "replacement"],
        True,
    ),
    (
        "wdiff-bad-metric",
        ["weights", "diff", "a.safetensors", "b.safetensors", "--metric", "abc"],
        ["--metric"],
        True,
    ),
    (
        "wdiff-plot-is-dir",
        ["weights", "diff", "a.safetensors", "b.safetensors", "--plot", "adir"],
        ["adir"],
        True,
    ),
    (
        "wdiff-plot-under-file",
        ["weights", "diff", "a.safetensors", "b.safetensors", "--quiet", "--plot", "a.pt/x.png"],
        ["a.pt"],
        True,
    ),
    (
        "wdiff-plot-unwritable-format",
        ["weights", "diff", "a.safetensors", "b.safetensors", "--quiet", "--plot", "a.safetensors"],
        ["a.safetensors"],
        True,
    ),
    (
        "wdiff-plot-keys-only",
        ["weights", "diff", "a.safetensors", "b.safetensors", "--keys-only", "--plot", "p.png"],
        ["--plot"],
        True,
    ),
    # weights map
    (
        "wmap-missing",
        ["weights", "map", "missing.safetensors", "a.safetensors"],
        ["missing.safetensors"],
        True,
    ),
    ("wmap-empty-dir", ["weights", "map", "a.safetensors", "adir"], ["adir"], True),
    ("wmap-truncated", ["weights", "map", "trunc.safetensors", "a.safetensors"], ["trunc.safetensors"], True),
    ("wmap-dangerous-pickle", ["weights", "map", "evil.pt", "a.safetensors"], ["evil.pt", "system"], True),
    ("wmap-non-dict", ["weights", "map", "list.pt", "a.safetensors"], ["list.pt"], True),
    ("wmap-unknown-suffix", ["weights", "map", "x.unknown", "a.safetensors"], ["x.unknown"], True),
    (
        "wmap-emit-rules-is-dir",
        ["weights", "map", "a.safetensors", "b.safetensors", "--emit-rules", "adir"],
        ["--emit-rules"],
        True,
    ),
    ("wmap-force-alone", ["weights", "map", "a.safetensors", "b.safetensors", "--force"], ["--force"], True),
    # bisect
    ("bisect-missing-spec", ["bisect", "missing_spec.py"], ["missing_spec.py"], True),
    ("bisect-spec-is-dir", ["bisect", "adir"], ["adir"], True),
    ("bisect-spec-incomplete", ["bisect", "spec_empty.py"], ["spec_empty.py", "build_reference"], True),
    ("bisect-bad-atol", ["bisect", "spec_ok.py", "--atol", "abc"], ["--atol"], True),
    ("bisect-bad-rtol", ["bisect", "spec_ok.py", "--rtol", "abc"], ["--rtol"], True),
    ("bisect-bad-map", ["bisect", "spec_ok.py", "--map", "(=x"], ["--map"], True),
    (
        "bisect-bad-map-replacement",
        ["bisect", "spec_ok.py", "--map", "x=\\9"],
        ["--map", "replacement"],
        True,
    ),
    ("bisect-nothing", ["bisect"], ["SPEC"], True),
    ("triage-missing-spec", ["triage", "missing_spec.py"], ["missing_spec.py"], True),
    ("triage-spec-incomplete", ["triage", "spec_empty.py"], ["spec_empty.py", "run_reference"], True),
    (
        "triage-out-is-a-file",
        ["triage", "triage_ok.py", "--out", "spec_ok.py"],
        ["--out", "spec_ok.py"],
        True,
    ),
    ("bisect-bad-device", ["bisect", "spec_ok.py", "--device", "gpu"], ["--device", "gpu"], True),
    ("bisect-traces-not-traces", ["bisect", "--traces", "adir", "adir"], ["adir"], True),
    # trace
    (
        "trace-missing-spec",
        ["trace", "missing_spec.py", "--side", "port", "--out", "t"],
        ["missing_spec.py"],
        True,
    ),
    ("trace-bad-side", ["trace", "spec_ok.py", "--side", "both", "--out", "t"], ["--side"], True),
    (
        "trace-bad-device",
        ["trace", "spec_ok.py", "--side", "port", "--out", "t", "--device", "gpu"],
        ["--device"],
        True,
    ),
    ("trace-out-is-file", ["trace", "spec_ok.py", "--side", "port", "--out", "a.pt"], ["a.pt"], True),
    ("trace-out-under-file", ["trace", "spec_ok.py", "--side", "port", "--out", "a.pt/t"], ["a.pt"], True),
    # steps
    ("steps-missing", ["steps", "missing", "steps_b"], ["missing"], True),
    ("steps-file-not-folder", ["steps", "a.safetensors", "steps_b"], ["a.safetensors"], True),
    ("steps-empty-dir", ["steps", "adir", "steps_b"], ["adir"], True),
    ("steps-bad-atol", ["steps", "steps_a", "steps_b", "--atol", "abc"], ["--atol"], True),
    ("steps-missing-sigmas", ["steps", "steps_a", "steps_b", "--sigmas", "sig.json"], ["sig.json"], True),
    ("steps-bad-sigmas", ["steps", "steps_a", "steps_b", "--sigmas", "bad.json"], ["bad.json"], True),
    ("steps-unknown-key", ["steps", "steps_a", "steps_b", "--key", "noise"], ["noise"], True),
    ("steps-plot-is-dir", ["steps", "steps_a", "steps_b", "--plot", "adir"], ["adir"], True),
    ("steps-plot-under-file", ["steps", "steps_a", "steps_b", "--plot", "a.pt/x.png"], ["a.pt"], True),
    (
        "steps-plot-is-an-input",
        ["steps", "steps_a", "steps_b", "--sigmas", "sigmas.json", "--plot", "sigmas.json"],
        ["--plot"],
        True,
    ),
    # images
    ("images-missing", ["images", "missing.png", "i1.png"], ["missing.png"], True),
    ("images-not-an-image", ["images", "notimg.png", "i1.png"], ["notimg.png"], True),
    ("images-unknown-suffix", ["images", "i1.png", "x.unknown"], ["x.unknown"], True),
    ("images-dir", ["images", "adir", "i1.png"], ["adir"], True),
    ("images-truncated", ["images", "trunc.safetensors", "i1.png"], ["trunc.safetensors"], True),
    ("images-dangerous-pickle", ["images", "evil.pt", "i1.png"], ["evil.pt", "system"], True),
    ("images-bad-psnr", ["images", "i1.png", "i2.png", "--psnr-min", "abc"], ["--psnr-min"], True),
    ("images-out-is-dir", ["images", "i1.png", "i2.png", "--out", "adir"], ["adir"], True),
    ("images-out-under-file", ["images", "i1.png", "i2.png", "--out", "a.pt/d.png"], ["a.pt"], True),
    (
        "images-out-is-an-input",
        ["images", "i1.png", "i2.png", "--out", "./i2.png"],
        ["--out", "i2.png"],
        True,
    ),
    # new (torch-free, no --json)
    (
        "new-name-digit",
        ["new", "component-test", "1vae", "--reference", "r:b", "--diffusers", "UNet2DModel"],
        ["1vae"],
        False,
    ),
    (
        "new-name-keyword",
        ["new", "component-test", "class", "--reference", "r:b", "--diffusers", "UNet2DModel"],
        ["class"],
        False,
    ),
    (
        "new-bad-reference",
        ["new", "component-test", "vae", "--reference", "nocolon", "--diffusers", "UNet2DModel"],
        ["--reference"],
        False,
    ),
    (
        "new-bad-diffusers",
        ["new", "component-test", "vae", "--reference", "r:b", "--diffusers", "no class"],
        ["--diffusers"],
        False,
    ),
    ("new-stub-lowercase", ["new", "pipeline-stub", "my_model"], ["my_model"], False),
    ("new-stub-space", ["new", "pipeline-stub", "My Model"], ["My Model"], False),
    (
        "new-stage-dash",
        ["new", "stage-test", "x-y", "--pipeline", "p:P", "--reference", "r:run"],
        ["x-y"],
        False,
    ),
    (
        "new-config-slash",
        ["new", "config-diff", "a/b", "--reference", "c1.json", "--diffusers", "c2.json"],
        ["a/b"],
        False,
    ),
    (
        "new-out-is-file",
        ["new", "config-diff", "ok", "--reference", "c1.json", "--diffusers", "c2.json", "--out", "a.pt"],
        ["a.pt"],
        False,
    ),
    ("new-unknown-template", ["new", "nonesuch", "x"], ["nonesuch"], False),
    (
        "new-diffusers-tests-class",
        ["new", "diffusers-tests", "x", "--model-class", "NoSuchModel"],
        ["--model-class", "NoSuchModel"],
        False,
    ),
    (
        "new-diffusers-tests-name",
        ["new", "diffusers-tests", "Wan", "--model-class", "UNet2DModel"],
        ["NAME", "Wan"],
        False,
    ),
    (
        "new-diffusers-tests-pretrained",
        [
            "new",
            "diffusers-tests",
            "x",
            "--model-class",
            "UNet2DModel",
            "--reference",
            "nocolon",
            "--pretrained",
            "adir",
        ],
        ["--pretrained", "adir"],
        False,
    ),
    # skills
    ("skills-show-unknown", ["skills", "show", "nonesuch"], ["nonesuch"], False),
    ("skills-show-path", ["skills", "show", "../README"], ["../README"], False),
    ("skills-validate-missing", ["skills", "validate", "missing_dir"], ["missing_dir"], True),
    ("skills-validate-file", ["skills", "validate", "a.pt"], ["a.pt"], True),
    (
        "skills-install-bad-agent",
        ["skills", "install", "--agent", "bogus", "--target", "adir"],
        ["bogus"],
        True,
    ),
    (
        "skills-install-missing-target",
        ["skills", "install", "--agent", "claude", "--target", "nowhere", "--dry-run"],
        ["nowhere"],
        True,
    ),
    ("skills-uninstall-missing-target", ["skills", "uninstall", "--target", "nowhere"], ["nowhere"], True),
    # demo
    ("demo-out-is-file", ["demo", "--out", "a.pt"], ["a.pt"], False),
]


@pytest.mark.parametrize(
    ("args", "names", "mode"),
    [
        pytest.param(args, names, mode, id=f"{case}-{mode}")
        for case, args, names, takes_json in BAD_INPUT
        for mode in (("text", "json") if takes_json else ("text",))
    ],
)
def test_bad_input_is_one_line_exit_2(files, args, names, mode):
    if mode == "json":
        assert_json_error(invoke(files, *args, "--json"), *names)
    else:
        assert_one_line_error(invoke(files, *args), *names)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["compare", "evil.pt", "a.safetensors"], id="compare-pickle"),
        pytest.param(
            ["weights", "diff", "trunc.safetensors", "a.safetensors", "--keys-only", "--json"],
            id="keys-only-json",
        ),
    ],
)
def test_in_process_runs_match_a_real_process(files, cli, args):
    """The harness above is faithful: ``python -m paritykit`` prints the same bytes and exits the same."""
    process = cli(*args, cwd=files)
    here = invoke(files, *args)
    assert (process.returncode, process.stdout, process.stderr) == (here.code, here.stdout, here.stderr)


def test_dangerous_pickle_is_never_run(files, capfd):
    for command in (["compare"], ["weights", "diff"], ["weights", "map"], ["images"]):
        assert_one_line_error(invoke(files, *command, "evil.pt", "a.safetensors"), "evil.pt")
    assert "paritykit-test-should-never-run" not in capfd.readouterr().out


@pytest.mark.parametrize("command", ["bisect", "trace"])
def test_spec_raising_shows_one_line_then_the_user_traceback(files, tmp_path, command):
    args = [command, files / "spec_raise.py"] + (
        ["--side", "port", "--out", tmp_path / "t"] if command == "trace" else []
    )
    run = invoke(files, *args)
    assert run.code == 2, (run.code, run.stdout, run.stderr)
    first, *rest = error_lines(run)
    assert first.startswith("paritykit: error: "), run.stderr
    assert "build_port" in first and "spec_raise.py" in first and "boom in user code" in first
    shown = "\n".join(rest)
    assert "spec_raise.py" in shown and "_helper" in shown  # the user's own frames ...
    assert "paritykit" + os.sep not in shown and "click" not in shown  # ... and only those
    payload = strict_json(invoke(files, *args, "--json").stdout)
    assert payload["schema_version"] == 1
    assert set(payload) == {"schema_version", "error", "traceback"}
    assert "\n" not in payload["error"] and "build_port" in payload["error"]
    assert "_helper" in payload["traceback"] and "paritykit" + os.sep not in payload["traceback"]


def test_spec_syntax_error_traceback_is_the_users_file_only(files):
    run = invoke(files, "bisect", "spec_syntax.py")
    assert run.code == 2, run.stderr
    first, *rest = error_lines(run)
    assert first.startswith("paritykit: error: ") and "spec_syntax.py" in first
    shown = "\n".join(rest)
    assert "spec_syntax.py" in shown and "SyntaxError" in shown
    assert "<frozen" not in shown, shown


# ------------------------------------------------------------------------------------------------ success

# (id, arguments, expected exit code); every one of these takes --json
RESULTS = [
    ("compare-same", ["compare", "a.safetensors", "a.safetensors"], 0),
    ("compare-differ", ["compare", "a.safetensors", "b.safetensors"], 1),
    ("compare-nonfinite", ["compare", "nan1.safetensors", "nan2.safetensors"], 1),
    ("compare-checkpoint-folders", ["compare", "steps_a", "steps_b"], 1),
    ("config-same", ["config-diff", "c1.json", "c1.json"], 0),
    ("config-differ", ["config-diff", "c1.json", "c2.json"], 1),
    ("wdiff-same", ["weights", "diff", "a.safetensors", "a.pt", "--quiet"], 0),
    ("wdiff-differ", ["weights", "diff", "a.safetensors", "b.safetensors", "--quiet"], 1),
    ("wdiff-keys-same", ["weights", "diff", "a.safetensors", "b.safetensors", "--keys-only"], 0),
    ("wdiff-keys-differ", ["weights", "diff", "a.safetensors", "c.safetensors", "--keys-only"], 1),
    ("wmap-explained", ["weights", "map", "a.pt", "a.safetensors"], 0),
    ("wmap-unexplained", ["weights", "map", "a.safetensors", "b.safetensors"], 1),
    ("triage-match", ["triage", "triage_ok.py", "--out", "triage_ok_out"], 0),
    ("triage-differ", ["triage", "triage_differ.py", "--out", "triage_differ_out"], 1),
    ("bisect-match", ["bisect", "spec_ok.py"], 0),
    ("bisect-diverge", ["bisect", "spec_diverge.py"], 1),
    ("trace", ["trace", "spec_ok.py", "--side", "reference", "--out", "trace_ref"], 0),
    ("steps-same", ["steps", "steps_a", "steps_a"], 0),
    ("steps-differ", ["steps", "steps_a", "steps_b"], 1),
    ("images-same", ["images", "i1.png", "i1.png"], 0),
    ("images-differ", ["images", "i1.png", "i2.png"], 1),
    ("schedule-same", ["schedule", "sched_a.json", "sched_a.json"], 0),
    ("schedule-differ", ["schedule", "sched_a.json", "sched_b.json"], 1),
    ("skills-list", ["skills", "list"], 0),
    ("skills-validate-pack", ["skills", "validate"], 0),
    ("skills-validate-broken", ["skills", "validate", "adir"], 1),
    (
        "skills-install-dry-run",
        ["skills", "install", "--agent", "claude", "--target", "adir", "--dry-run"],
        0,
    ),
    (
        "skills-uninstall-dry-run",
        ["skills", "uninstall", "--agent", "claude", "--target", "adir", "--dry-run"],
        0,
    ),
]


@pytest.mark.parametrize(("args", "code"), [pytest.param(a, c, id=i) for i, a, c in RESULTS])
def test_exit_code_and_strict_json(files, args, code):
    text = invoke(files, *args)
    assert "Traceback" not in text.stderr, text.stderr
    assert text.code == code, (text.stdout, text.stderr)
    assert text.stdout.strip(), "no report printed"
    as_json = invoke(files, *args, "--json")
    assert "Traceback" not in as_json.stderr, as_json.stderr
    assert as_json.code == code, (as_json.stdout, as_json.stderr)
    payload = strict_json(as_json.stdout)
    assert payload["schema_version"] == 1
    assert "error" not in payload
    # One verdict field for every report: an agent need not know each command's own vocabulary.
    assert payload["passed"] is (code == 0), payload.get("passed")
    assert isinstance(payload["verdict"], str) and payload["verdict"], payload.get("verdict")


def _json_commands(group, path=()) -> list[tuple[str, ...]]:
    import click

    found = []
    for name in group.list_commands(None):
        command = group.get_command(None, name)
        if isinstance(command, click.Group):
            found += _json_commands(command, (*path, name))
        elif any("--json" in getattr(param, "opts", ()) for param in command.params):
            found.append((*path, name))
    return found


def test_every_command_with_json_is_swept_here():
    # A new report command joins RESULTS, so its verdict/passed fields and exit codes are checked like the
    # rest.
    swept = {
        tuple(arg for arg in args if not arg.startswith("-") and "." not in arg)[:2] for _, args, _ in RESULTS
    }
    missing = [" ".join(c) for c in _json_commands(paritykit_cli) if not any(c == s[: len(c)] for s in swept)]
    assert not missing, f"commands with --json missing from RESULTS: {missing}"


@pytest.mark.parametrize("args", [pytest.param(a, id=i) for i, a, _ in RESULTS])
def test_json_report_has_environment_stamp(files, args):
    payload = strict_json(invoke(files, *args, "--json").stdout)
    stamp = payload.get("environment")
    assert isinstance(stamp, dict) and stamp.get("paritykit"), payload.keys()


def test_images_a_port_rendering_nan_differs(files, tmp_path):
    import torch

    torch.save(torch.full((8, 8, 3), float("nan")), tmp_path / "port.pt")
    run = invoke(files, "images", "i1.png", tmp_path / "port.pt", "--json")
    assert run.code == 1, run.stdout
    strict_json(run.stdout)


def test_nonfinite_values_reach_json_as_null_and_are_listed(files):
    payload = strict_json(invoke(files, "compare", "nan1.safetensors", "nan2.safetensors", "--json").stdout)
    assert payload.get("nonfinite"), "NaN/Inf in the report should be listed under 'nonfinite'"
    assert all(value in ("nan", "inf", "-inf") for value in payload["nonfinite"].values())


# ------------------------------------------------------------------------------------------------ user files


NEW_CASES = {
    "component-test": (
        "component-test",
        ["vae", "--reference", "ref.model:build", "--diffusers", "AutoencoderKL"],
        "test_vae_component.py",
    ),
    "pipeline-stub": ("pipeline-stub", ["MyModel"], "pipeline_my_model.py"),
    "pipeline-stub-modular": (
        "pipeline-stub",
        ["MyModel", "--modular"],
        "modular_my_model/modular_pipeline.py",
    ),
    "stage-test": (
        "stage-test",
        ["my", "--pipeline", "port.pipe:MyPipeline", "--reference", "ref.run:run"],
        "test_my_stages.py",
    ),
    "config-diff": (
        "config-diff",
        ["my", "--reference", "c1.json", "--diffusers", "c2.json"],
        "config_diff_my.py",
    ),
}


@pytest.mark.parametrize("case", sorted(NEW_CASES))
def test_new_never_overwrites_without_force(tmp_path, case):
    template, args, filename = NEW_CASES[case]
    command = ["new", template, *args, "--out", "gen"]
    first = invoke(tmp_path, *command)
    assert first.code == 0, first.stderr
    target = tmp_path / "gen" / filename
    assert target.is_file()
    target.write_text("# the user's edits\n")
    assert_one_line_error(invoke(tmp_path, *command), Path(filename).parts[0], "--force")
    assert target.read_text() == "# the user's edits\n"
    forced = invoke(tmp_path, *command, "--force")
    assert forced.code == 0, forced.stderr
    assert target.read_text() != "# the user's edits\n"


def test_emit_rules_never_overwrites_without_force(files, tmp_path):
    rules = tmp_path / "convert_rules.py"
    rules.write_text("# the user's conversion\n")
    command = ["weights", "map", files / "a.pt", files / "a.safetensors", "--emit-rules", rules]
    assert_one_line_error(invoke(tmp_path, *command), "convert_rules.py", "--force")
    assert_json_error(invoke(tmp_path, *command, "--json"), "convert_rules.py")
    assert rules.read_text() == "# the user's conversion\n"
    forced = invoke(tmp_path, *command, "--force")
    assert forced.code == 0, forced.stderr
    assert "def convert" in rules.read_text()


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(
            ["weights", "diff", "a.safetensors", "b.safetensors", "--quiet", "--plot"], id="weights-diff-plot"
        ),
        pytest.param(["steps", "steps_a", "steps_b", "--plot"], id="steps-plot"),
        pytest.param(["images", "i1.png", "i2.png", "--out"], id="images-out"),
    ],
)
def test_reports_asked_for_are_overwritten(files, tmp_path, args):
    report = tmp_path / "report.png"
    report.write_bytes(b"an older report")
    run = invoke(files, *args, report)
    assert run.code == 1, run.stderr
    assert report.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("args", "victim"),
    [
        pytest.param(
            ["images", "ref.png", "port.png", "--out", "port.png"], "port.png", id="images-out-port"
        ),
        pytest.param(["images", "ref.png", "port.png", "--out", "./ref.png"], "ref.png", id="images-out-ref"),
        pytest.param(
            ["steps", "sa", "sb", "--sigmas", "s.json", "--plot", "s.json"], "s.json", id="steps-plot-sigmas"
        ),
        pytest.param(
            ["weights", "diff", "w.safetensors", "b.safetensors", "--plot", "w.safetensors"],
            "w.safetensors",
            id="wdiff-plot-input",
        ),
    ],
)
def test_a_report_path_never_destroys_an_input(files, tmp_path, args, victim):
    import shutil

    for name, source in {
        "ref.png": "i1.png",
        "port.png": "i2.png",
        "s.json": "sigmas.json",
        "w.safetensors": "a.safetensors",
        "b.safetensors": "b.safetensors",
    }.items():
        shutil.copy(files / source, tmp_path / name)
    for name, source in {"sa": "steps_a", "sb": "steps_b"}.items():
        shutil.copytree(files / source, tmp_path / name)
    before = (tmp_path / victim).read_bytes()
    assert_one_line_error(
        invoke(tmp_path, *args, "--quiet" if args[0] == "weights" else "--limit=40"), victim
    )
    assert (tmp_path / victim).read_bytes() == before


def test_trace_refuses_a_folder_holding_a_users_file(files, tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("precious\n")
    assert_one_line_error(invoke(files, "trace", "spec_ok.py", "--side", "port", "--out", tmp_path), "--out")
    assert mine.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_skills_install_never_replaces_a_users_skill(tmp_path):
    skill = tmp_path / ".claude" / "skills" / "parity-testing" / "SKILL.md"
    skill.parent.mkdir(parents=True)
    skill.write_text("my own skill\n")
    command = ["skills", "install", "--agent", "claude", "--target", tmp_path]
    assert_one_line_error(invoke(tmp_path, *command), "parity-testing", "--force")
    assert_json_error(invoke(tmp_path, *command, "--json"), "parity-testing")
    assert skill.read_text() == "my own skill\n"
    assert sorted(p.name for p in skill.parent.parent.iterdir()) == ["parity-testing"]


class GuardedDemo:
    """``paritykit demo --out OUT`` in its own process, killed at once if ``precious`` disappears.

    Started when the module's first test runs, so the demo's imports overlap the in-process sweep.
    """

    def __init__(self, out: Path, precious: Path, timeout: float = 240.0):
        self.precious = precious
        self.outcome: Run | None = None  # None: killed because the user's file vanished (or timed out)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "paritykit", "demo", "--out", str(out)],
            cwd=out.parent,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.thread = threading.Thread(target=self._watch, args=(time.monotonic() + timeout,), daemon=True)
        self.thread.start()

    def _watch(self, deadline: float) -> None:
        while self.proc.poll() is None:
            if not self.precious.exists() or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.communicate()
                return
            time.sleep(0.02)
        stdout, stderr = self.proc.communicate()
        self.outcome = Run(self.proc.returncode, stdout, stderr)

    def result(self) -> Run | None:
        self.thread.join()
        return self.outcome


@pytest.fixture(scope="module", autouse=True)
def demo_runs(request, tmp_path_factory):
    """Both demo scenarios, started early; nothing is started when no demo test is selected."""
    if not any(item.name.startswith("test_demo_") for item in request.session.items):
        yield {}
        return
    root = tmp_path_factory.mktemp("demo")
    mine = root / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious\n")
    earlier = root / "demo-output"
    earlier.mkdir()
    (earlier / ".paritykit-demo").write_text("written by paritykit demo\n")
    (earlier / "my_notes.txt").write_text("precious\n")
    runs = {
        "user-folder": GuardedDemo(mine, mine / "notes.txt"),
        "earlier-demo-folder": GuardedDemo(earlier, earlier / "my_notes.txt"),
    }
    yield runs
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.kill()
        run.thread.join()


def test_demo_refuses_a_folder_holding_a_users_file(demo_runs):
    run = demo_runs["user-folder"]
    result = run.result()
    assert result is not None, "the demo went ahead in a folder holding the user's file"
    assert_one_line_error(result, "--out")
    assert run.precious.read_text() == "precious\n"


def test_demo_rerun_keeps_a_users_file_added_to_its_folder(demo_runs):
    run = demo_runs["earlier-demo-folder"]
    result = run.result()
    assert result is not None, "the demo deleted the user's file"
    assert run.precious.read_text() == "precious\n"


# ------------------------------------------------------------------------------------------------ torch-free

LIGHT = [
    ["--help"],
    ["skills", "list"],
    ["skills", "list", "--json"],
    ["skills", "show", "parity-testing"],
    ["new", "--list"],
    ["new", "--help"],
    ["weights", "diff", "a.safetensors", "c.safetensors", "--keys-only"],
    ["--version"],
    ["skills", "validate"],
    ["skills", "install", "--agent", "claude", "--target", "adir", "--dry-run"],
    ["skills", "show", "nonesuch"],
    [
        "new",
        "component-test",
        "vae",
        "--reference",
        "r:b",
        "--diffusers",
        "UNet2DModel",
        "--out",
        "gen_light",
    ],
    ["new", "pipeline-stub", "lower_case"],
]


@pytest.mark.parametrize("args", [pytest.param(a, id=" ".join(a)) for a in LIGHT])
def test_light_paths_never_import_torch(files, args):
    code = (
        "import sys\n"
        "from paritykit.cli import cli\n"
        "code = None\n"
        "try:\n"
        f"    cli.main({args!r})\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "heavy = sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy), 'EXIT=%s' % code)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=files,
        env=subprocess_env(),
        timeout=120,
    )
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("HEAVY= EXIT="), result.stdout[-500:] + result.stderr
    assert last.split("EXIT=")[1] in ("0", "1", "2"), last


@pytest.mark.parametrize(
    "group", [[], ["weights"], ["skills"], ["new"]], ids=lambda g: " ".join(["paritykit", *g])
)
def test_group_without_subcommand_shows_its_help(files, group):
    run = invoke(files, *group)
    assert run.code == 0, run.stderr
    assert run.stderr == ""
    assert run.stdout.startswith("Usage: paritykit") and run.stdout.count("\n") > 5, run.stdout


def test_every_help_is_torch_free():
    helps = [
        ["--help"],
        ["compare", "--help"],
        ["config-diff", "--help"],
        ["weights", "--help"],
        ["weights", "diff", "--help"],
        ["weights", "map", "--help"],
        ["bisect", "--help"],
        ["trace", "--help"],
        ["steps", "--help"],
        ["images", "--help"],
        ["new", "--help"],
        ["new", "component-test", "--help"],
        ["new", "pipeline-stub", "--help"],
        ["new", "stage-test", "--help"],
        ["new", "config-diff", "--help"],
        ["new", "diffusers-tests", "--help"],
        ["skills", "--help"],
        ["skills", "install", "--help"],
        ["demo", "--help"],
    ]
    code = (
        f"import sys\nfrom paritykit.cli import cli\nfor argv in {helps!r}:\n    try:\n       "
        " cli.main(argv)\n    except SystemExit as exc:\n        assert exc.code in (0, None), (argv,"
        " exc.code)\nheavy = sorted(m for m in ('torch', 'diffusers', 'transformers', 'matplotlib') if m in"
        " sys.modules)\nprint('HEAVY=' + ','.join(heavy))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "HEAVY=", result.stdout[-300:] + result.stderr


def test_every_two_path_command_says_when_both_paths_are_the_same(tmp_path):
    import json as _json

    import numpy as np
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    from tests.conftest import run_cli

    weights = tmp_path / "w.safetensors"
    save_file({"layer.weight": torch.randn(4, 4)}, str(weights))
    config = tmp_path / "config.json"
    config.write_text(_json.dumps({"in_channels": 4}))
    image = tmp_path / "a.png"
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(image)
    for command, path in (
        (["weights", "diff"], weights),
        (["weights", "map"], weights),
        (["config-diff"], config),
        (["images"], image),
        (["compare"], weights),
    ):
        result = run_cli(*command, path, path)
        assert "are the same path: it is compared with itself" in result.stderr, (command, result.stderr)
        other = tmp_path / f"copy{path.suffix}"
        other.write_bytes(path.read_bytes())
        assert "same path" not in run_cli(*command, path, other).stderr  # a copy is another path


def test_json_puts_the_same_answer_first(tmp_path):
    import json as _json

    import torch
    from safetensors.torch import save_file

    from tests.conftest import run_cli

    save_file({"layer.weight": torch.ones(4, 4)}, str(tmp_path / "a.safetensors"))
    save_file({"layer.weight": torch.ones(4, 4) * 2}, str(tmp_path / "b.safetensors"))
    result = run_cli("compare", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--json")
    payload = _json.loads(result.stdout)
    assert list(payload)[1:4] == ["verdict", "passed", "answer"]
    text = run_cli("compare", tmp_path / "a.safetensors", tmp_path / "b.safetensors").stdout
    assert payload["answer"][0] == text.splitlines()[0] and payload["answer"][0].startswith("verdict: ")


@pytest.mark.parametrize(
    "args",
    [
        ["bisect", "nope.py"],
        ["schedule", "nope.json", "--fit", "DDIMScheduler"],
        ["schedule", "256=nope.json,1024=nope2.json", "--fit", "FlowMatchEulerDiscreteScheduler"],
        ["weights", "map", "a.safetensors", "b.safetensors"],
        ["weights", "diff", "a.safetensors", "b.safetensors"],
        ["compare", "a.pt", "b.pt"],
        ["steps", "a", "b"],
        ["images", "a.png", "b.png"],
        ["triage", "--reference-script", "a.py", "--port-script", "b.py"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_a_missing_path_is_one_line_before_torch_is_imported(tmp_path, args):
    # an agent's typo costs a fraction of a second, not torch's import
    code = (
        "import sys\n"
        "from paritykit.cli import main\n"
        f"sys.argv = ['paritykit', *{args!r}]\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    lines = run.stderr.strip().splitlines()
    assert lines[-1] == "exit 2 False", run.stderr
    assert len(lines) == 2 and lines[0].startswith("paritykit: error: "), run.stderr
    assert lines[0].endswith("': no such file or folder")


@pytest.mark.parametrize("command", ["bisect", "triage"])
@pytest.mark.parametrize("tolerance", ["1e-4", "{'atol': 1e-4, 'eps': 1}", "{'atol': '1e-4'}"])
def test_a_tolerance_written_wrong_is_refused_before_the_spec_runs(tmp_path, command, tolerance):
    # round 12: an agent's `TOLERANCE = 1e-4` was refused only after the SPEC had built both models (12 s)
    marker = tmp_path / "ran.txt"
    spec = tmp_path / "spec_tol.py"
    head = f"from pathlib import Path\n\nPath({str(marker)!r}).write_text('built')\n"
    spec.write_text(head + f"TOLERANCE = {tolerance}\n")
    line = assert_one_line_error(invoke(tmp_path, command, spec.name), "spec_tol.py", "TOLERANCE")
    assert "'atol'" in line and not marker.exists()
    # must not fire: a well-formed TOLERANCE, or one computed at import, is left to the run
    spec.write_text(head + "TOLERANCE = dict(atol=1e-4)\n")
    run = invoke(tmp_path, command, spec.name)
    assert marker.exists() and "TOLERANCE" not in run.stderr, run.stderr
