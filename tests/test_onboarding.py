"""A new user's first hour, as the README and the skills tell it: every step runs as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from tests._scaffold_fixtures.scaffold_parts import COND_UNET_CONFIG
from tests.conftest import REPO

README = REPO / "README.md"

REFERENCE_MODULE = f'''"""A stand-in for a research repository: its model builder, a tiny conditional UNet."""

import torch
from diffusers import UNet2DConditionModel

CONFIG = {COND_UNET_CONFIG!r}


def build():
    torch.manual_seed(0)
    return UNet2DConditionModel(**CONFIG)
'''
CONVERT_MODULE = "def convert(state_dict):\n    return dict(state_dict)\n"


def readme_command(prefix: str) -> list[str]:
    """The one ``paritykit …`` line of the README's bash blocks that starts with ``prefix``."""
    lines = [line.strip() for line in README.read_text().splitlines() if line.strip().startswith(prefix)]
    assert len(lines) == 1, lines
    return shlex.split(lines[0].split("  #")[0])


def header_run_command(text: str) -> list[str]:
    """The command under ``Run …:`` in a generated file's docstring."""
    match = re.search(r"\nRun[^\n]*:\n\s+(?P<command>[^\n]+)\n", text)
    assert match, text[:800]
    return shlex.split(match.group("command"))


def test_readme_component_test_runs_as_its_header_says(tmp_path, cli):
    """The README's ``new component-test … --out parity/``, then the header's command from where it says."""
    project = tmp_path / "project"
    (project / "repo").mkdir(parents=True)
    (project / "repo" / "model.py").write_text(REFERENCE_MODULE)
    (project / "convert_rules.py").write_text(CONVERT_MODULE)
    saver = "import sys\nfrom repo.model import build\nbuild().save_pretrained(sys.argv[1])\n"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "helpers"), env.get("PYTHONPATH", "")])
    saved = subprocess.run(
        [sys.executable, "-c", saver, "models/port/unet"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert saved.returncode == 0, saved.stderr[-2000:]

    words = readme_command("paritykit new component-test unet ")
    assert words[-2:] == ["--out", "parity/"], words
    made = cli(*words[1:], cwd=project)
    assert made.returncode == 0, made.stderr
    generated = project / "parity" / "test_unet_component.py"
    header = generated.read_text().split('"""')[1]
    assert "Run it from any folder" in header and "`paritykit new` ran in is put on sys.path" in header, (
        header
    )

    command = header_run_command(header)
    assert command[:3] == ["python", "-m", "pytest"] and command[-1] == "parity/test_unet_component.py"
    run = subprocess.run(
        [sys.executable, *command[1:], "-p", "no:cacheprovider"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "No module named" not in run.stdout + run.stderr, run.stdout[-3000:]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "2 passed" in run.stdout, run.stdout[-2000:]


# ------------------------------------------------------------------------------------------ the words


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a markdown text."""
    match = re.search(rf"^## {re.escape(title)}\n(?P<body>.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no '## {title}' section"
    return match.group("body")


def test_readme_says_how_to_get_paritykit_on_path_after_make_demo():
    setup = section(README.read_text(), "Set up")
    assert setup.index("make demo") < setup.index("source .venv/bin/activate"), setup


def test_readme_shows_installing_into_your_own_environment():
    body = section(README.read_text(), "Install into your own environment")
    assert re.search(r"^pip install /path/to/paritykit", body, re.M), body
    assert re.search(r"^pip install \S+\.whl", body, re.M) and "python -m build --wheel" in body, body
    assert "torch" in body and "diffusers" in body  # what pip keeps, stated


def test_every_skill_that_uses_the_cli_says_how_to_get_it_at_the_top():
    for skill in sorted((REPO / "skills").glob("*/SKILL.md")):
        text = skill.read_text()
        if not re.search(r"^paritykit ", text, re.M):
            continue
        body = text.split("\n---\n", 1)[1]
        top = "\n".join(body.strip().splitlines()[:3])  # title, blank line, the note
        assert "Getting the CLI" in top and "pip install" in top and "paritykit --help" in top, skill


def test_the_order_of_work_is_stated_once_in_the_skill_and_linked_from_the_readme():
    readme = README.read_text()
    porting = section(readme, "Porting a model with paritykit")
    assert "skills/parity-testing/references/workflow.md" in porting
    assert not re.search(r"^\d+\. ", porting, re.M), (
        "the README restates the steps; link to the skill instead"
    )
    workflow = (REPO / "skills" / "parity-testing" / "references" / "workflow.md").read_text()
    assert "\n## The order of work\n" in workflow


def test_no_step_uses_convert_rules_before_a_step_writes_it():
    workflow = (REPO / "skills" / "parity-testing" / "references" / "workflow.md").read_text()
    for text in (workflow, README.read_text()):
        assert text.index("--emit-rules convert_rules.py") < text.index("convert_rules:convert")


def test_readme_shows_saving_the_reference_sides_checkpoints():
    porting = section(README.read_text(), "Porting a model with paritykit")
    code = "\n".join(re.findall(r"```python\n(.*?)```", porting, re.S))
    assert "save_checkpoints(" in code and "Checkpoint(save=True)" in code, porting
    assert "paritykit steps ref_ckpts" in porting


TRACE_SPEC = (
    "import torch\n\n\ndef make_inputs():\n    return (torch.ones(2, 3),), {}\n\n\n"
    "def build_reference():\n    torch.manual_seed(0)\n    return torch.nn.Linear(3, 3)\n\n\n"
    "def build_port():\n    torch.manual_seed(0)\n    return torch.nn.Linear(3, 3)\n"
)


def test_trace_suggests_the_other_side_only_after_the_first(tmp_path):
    from paritykit.bisection.spec import trace_spec

    (tmp_path / "spec.py").write_text(TRACE_SPEC)
    first = trace_spec(tmp_path / "spec.py", side="reference", out=tmp_path / "ref_trace")
    assert first.other is None
    assert "next: trace the port" in first.render() and "--side port" in first.next_command()
    second = trace_spec(tmp_path / "spec.py", side="port", out=tmp_path / "port_trace")
    text = second.render()
    assert "trace the" not in text and "--side" not in text, text
    assert second.next_command().split()[:3] == ["paritykit", "bisect", "--traces"]
    assert second.next_command().split()[3:5] == [str(tmp_path / "ref_trace"), str(tmp_path / "port_trace")]
    # a trace of another spec beside it is not the other side
    (tmp_path / "other.py").write_text(TRACE_SPEC)
    lone = trace_spec(tmp_path / "other.py", side="port", out=tmp_path / "other_port")
    assert lone.other is None and "next: trace the reference" in lone.render()
