"""Shared fixtures: run the CLI the way a user does, in-process or as a whole process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str, cwd: str | os.PathLike | None = None, env: dict | None = None, input: str | None = None
):
    """Run ``python -m paritykit ARGS`` as a separate process; returns the CompletedProcess."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO / "helpers"), full_env.get("PYTHONPATH", "")])
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "paritykit", *map(str, args)],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        input=input,
        timeout=600,
    )


@pytest.fixture
def cli():
    return run_cli
