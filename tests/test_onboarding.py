"""A new user's first hour, as the README and the skills tell it: every step runs as written."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from tests.conftest import REPO

README = REPO / "README.md"

REFERENCE_MODULE = '''"""A stand-in for a research repository: its model builder, a tiny conditional UNet."""

import torch
from diffusers import UNet2DConditionModel

CONFIG = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 1,
    "block_out_channels": (8, 16),
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 16,
    "attention_head_dim": 2,
    "norm_num_groups": 4,
}


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
    assert "from the folder `paritykit new` ran in" in header, header

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
