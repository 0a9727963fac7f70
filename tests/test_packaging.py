"""The wheel carries the skills and templates, and an installed wheel finds them without the checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(REPO),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (path,) = out.glob("paritykit-*.whl")
    return path


def test_wheel_ships_skills_and_templates(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    skills = {
        Path(n).parent.name
        for n in names
        if n.startswith("paritykit/_data/skills/") and n.endswith("SKILL.md")
    }
    on_disk = {p.parent.name for p in (REPO / "skills").glob("*/SKILL.md")}
    assert skills == on_disk and skills
    templates_on_disk = {p.name for p in (REPO / "templates").iterdir() if p.is_file()}
    shipped = {Path(n).name for n in names if n.startswith("paritykit/_data/templates/")}
    assert templates_on_disk <= shipped
    assert "paritykit/cli/__init__.py" in names


def test_installed_wheel_finds_its_data_away_from_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    code = (
        "import paritykit, paritykit.base.data as d\n"
        "print(paritykit.__file__)\n"
        "print(d.data_dir('skills'))\n"
        "print(d.data_dir('templates'))\n"
    )
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    # Put the installed copy first so the checkout's helpers/ (if on sys.path) cannot win.
    run = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(target)!r}); exec({code!r})"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
    )
    assert run.returncode == 0, run.stderr
    package_file, skills_dir, templates_dir = run.stdout.split()
    assert package_file.startswith(str(target))
    assert skills_dir.startswith(str(target)) and (Path(skills_dir) / "parity-testing" / "SKILL.md").is_file()
    assert templates_dir.startswith(str(target))
