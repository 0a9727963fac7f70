"""`make claude` / `make codex` / `make clean-ai` in a temp copy of the repository, through the skills
installer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_skills import tree_state, write

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


@pytest.fixture
def repo(tmp_path) -> Path:
    r"""A copy of the checkout without a venv, holding a user's own skill and a real CLAUDE.md."""
    root = tmp_path / "paritykit"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("helpers", "skills", ".ai"):
        shutil.copytree(REPO / name, root / name, ignore=ignore)
    shutil.copy2(REPO / "Makefile", root / "Makefile")
    write(root / ".claude" / "skills" / "mine" / "SKILL.md", "---\nname: mine\ndescription: My own.\n---\n")
    write(root / "CLAUDE.md", "my own claude notes\n")
    return root


def make(repo: Path, *targets: str, **variables: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS", "TARGET")}
    args = [f"{k}={v}" for k, v in {"PYTHON": sys.executable, **variables}.items()]
    result = subprocess.run(
        ["make", "--no-print-directory", *targets, *args], cwd=repo, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def skill_names(repo: Path) -> list[str]:
    names = sorted(p.name for p in (repo / "skills").iterdir() if (p / "SKILL.md").is_file())
    assert names
    return names


def links_into(root: Path, *targets: Path) -> list[str]:
    r"""Every symlink under ``root`` that resolves into one of ``targets``."""
    found = []
    for directory, subdirs, files in os.walk(root):
        for name in subdirs + files:
            path = Path(directory) / name
            if path.is_symlink():
                real = Path(os.path.realpath(path))
                if any(real == t or t in real.parents for t in targets):
                    found.append(str(path.relative_to(root)))
    return found


def test_make_claude_links_each_skill_and_keeps_the_users_files(repo):
    mine = tree_state(repo / ".claude" / "skills" / "mine")
    claude_md = (repo / "CLAUDE.md").read_bytes()
    result = make(repo, "claude")
    for name in skill_names(repo):
        link = repo / ".claude" / "skills" / name
        assert link.is_symlink() and os.readlink(link) == f"../../skills/{name}"
    assert not (repo / ".claude" / "skills").is_symlink()
    assert (repo / "CLAUDE.md").read_bytes() == claude_md and not (repo / "CLAUDE.md").is_symlink()
    assert "CLAUDE.md exists" in result.stdout
    assert tree_state(repo / ".claude" / "skills" / "mine") == mine


def test_make_claude_twice_is_harmless(repo):
    make(repo, "claude")
    after_first = tree_state(repo)
    make(repo, "claude")
    assert tree_state(repo) == after_first


def test_make_codex_links_agents_md_when_no_real_one_exists(repo):
    make(repo, "codex")
    assert os.readlink(repo / "AGENTS.md") == ".ai/AGENTS.md"
    for name in skill_names(repo):
        assert os.readlink(repo / ".agents" / "skills" / name) == f"../../skills/{name}"


def test_make_clean_ai_restores_the_checkout_byte_for_byte(repo):
    before = tree_state(repo)
    make(repo, "claude")
    make(repo, "codex")
    make(repo, "clean-ai")
    assert links_into(repo, repo / "skills", repo / ".ai") == []
    assert tree_state(repo) == before  # the user's skill and real CLAUDE.md included
    make(repo, "clean-ai")  # nothing left to do is fine too
    assert tree_state(repo) == before


def test_make_clean_ai_removes_links_made_before_the_installer(repo):
    before = tree_state(repo)
    for name in skill_names(repo):
        os.symlink(f"../../skills/{name}", repo / ".claude" / "skills" / name)
    os.symlink(".ai/AGENTS.md", repo / "AGENTS.md")
    make(repo, "clean-ai")
    assert links_into(repo, repo / "skills", repo / ".ai") == []
    assert tree_state(repo) == before


def test_target_installs_into_another_checkout_without_its_instruction_files(repo, tmp_path):
    fork = tmp_path / "diffusers"
    write(fork / "AGENTS.md", "the fork's own agents file\n")
    write(fork / ".claude" / "skills" / "self-review" / "SKILL.md", "the fork's skill\n")
    fork_before = tree_state(fork)
    repo_before = tree_state(repo)
    make(repo, "claude", "codex", TARGET=str(fork))
    for name in skill_names(repo):
        assert (fork / ".claude" / "skills" / name).resolve() == (repo / "skills" / name).resolve()
        assert (fork / ".agents" / "skills" / name).resolve() == (repo / "skills" / name).resolve()
    assert not os.path.lexists(fork / "CLAUDE.md")
    assert (fork / "AGENTS.md").read_text() == "the fork's own agents file\n"
    assert tree_state(repo) == repo_before
    make(repo, "clean-ai", TARGET=str(fork))
    assert tree_state(fork) == fork_before


def test_make_claude_refuses_a_colliding_skill_and_changes_nothing(repo):
    name = skill_names(repo)[0]
    write(repo / ".claude" / "skills" / name / "SKILL.md", "someone else's skill\n")
    before = tree_state(repo)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS", "TARGET")}
    result = subprocess.run(
        ["make", "--no-print-directory", "claude", f"PYTHON={sys.executable}"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert f".claude/skills/{name}" in result.stderr and "--skip-existing" in result.stderr
    assert tree_state(repo) == before
