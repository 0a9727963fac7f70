"""Skill truth: every snippet and command quoted in the skill pack is real.

Python blocks compile; `paritykit …` lines in shell blocks parse against the real CLI (flags included);
`from paritykit import X` names real public symbols; relative links resolve. A stale skill fails here.
"""

from __future__ import annotations

import ast
import re
import shlex
import textwrap
from pathlib import Path

import click
import paritykit
import pytest
from paritykit.cli import cli

SKILLS = Path(__file__).resolve().parents[1] / "skills"
README = SKILLS.parent / "README.md"
DOCS = sorted(SKILLS.glob("*/SKILL.md")) + sorted(SKILLS.glob("*/references/*.md")) + [README]
# a fence at any indent (a code block inside a list item counts too)
FENCE = re.compile(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)#\s]+)(?:#[^)]*)?\)")


def blocks(path: Path, languages: set[str]) -> list[str]:
    return [body for lang, body in FENCE.findall(path.read_text()) if lang in languages]


def doc_id(path: Path) -> str:
    return str(path.relative_to(SKILLS.parent))


def paritykit_commands(path: Path) -> list[list[str]]:
    commands = []
    for body in blocks(path, {"bash", "sh", "shell", "console"}):
        joined = re.sub(r"\\\n\s*", " ", body)
        for line in joined.splitlines():
            line = line.strip().removeprefix("$ ").strip()
            if line.startswith("paritykit "):
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def parse_command_line(argv: list[str]) -> click.Command:
    """Parse argv the way `paritykit` would, down to the leaf command, without running it."""
    ctx = cli.make_context("paritykit", list(argv), resilient_parsing=False)
    command: click.Command = cli
    while isinstance(command, click.Group):
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest:
            break
        name, sub, rest = command.resolve_command(ctx, rest)
        ctx = sub.make_context(name, rest, parent=ctx)
        command = sub
    return command


def test_the_pack_has_the_four_skills():
    names = {p.parent.name for p in SKILLS.glob("*/SKILL.md")}
    assert {"model-integration", "parity-testing", "checkpoint-forensics", "training-parity"} <= names


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_python_blocks_compile(path):
    for body in blocks(path, {"python", "py"}):
        compile(textwrap.dedent(body), f"{path}:python-block", "exec")


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_paritykit_imports_are_public(path):
    for body in blocks(path, {"python", "py"}):
        tree = ast.parse(textwrap.dedent(body))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "paritykit":
                for alias in node.names:
                    if node.module == "paritykit":
                        assert alias.name in paritykit.__all__, f"{path}: {alias.name} is not public"
                        assert getattr(paritykit, alias.name) is not None
                    else:
                        module = __import__(node.module, fromlist=[alias.name])
                        assert hasattr(module, alias.name), f"{path}: {node.module}.{alias.name} missing"


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_paritykit_command_lines_parse(path):
    for argv in paritykit_commands(path):
        try:
            parse_command_line(argv)
        except click.ClickException as exc:
            pytest.fail(f"{path}: `paritykit {shlex.join(argv)}` does not parse: {exc.format_message()}")


@pytest.mark.parametrize("path", DOCS, ids=doc_id)
def test_relative_links_resolve(path):
    for target in LINK.findall(path.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (path.parent / target).resolve().exists(), f"{path}: broken link {target}"


def test_the_checker_catches_a_stale_command(tmp_path):
    stale = tmp_path / "SKILL.md"
    stale.write_text("```bash\nparitykit compare a b --no-such-flag\n```\n")
    (argv,) = paritykit_commands(stale)
    with pytest.raises(click.ClickException):
        parse_command_line(argv)


def test_installing_for_claude_makes_every_skill_visible_where_claude_code_looks(tmp_path):
    from paritykit.pack.installer import install
    from paritykit.pack.skill_check import validate

    fork = tmp_path / "diffusers"
    (fork / ".git").mkdir(parents=True)
    (fork / ".ai" / "skills" / "model-integration").mkdir(
        parents=True
    )  # a fork's own tracked skills stay put
    report = install(agents=["claude"], target=fork)
    assert report.exit_code == 0
    for skill in SKILLS.glob("*/SKILL.md"):
        seen = fork / ".claude" / "skills" / skill.parent.name / "SKILL.md"
        assert seen.read_text() == skill.read_text()
    assert validate([fork / ".claude" / "skills" / p.parent.name for p in SKILLS.glob("*/SKILL.md")]).valid
    assert not (fork / "CLAUDE.md").exists()


def _spec_block(first_line: str) -> str:
    path = SKILLS / "parity-testing" / "SKILL.md"
    (found,) = [body for body in blocks(path, {"python"}) if body.startswith(first_line)]
    return found


def test_the_bisect_example_reaches_the_gelu_it_shows(tmp_path):
    from paritykit.bisection.spec import bisect_spec

    spec = tmp_path / "spec.py"
    spec.write_text(_spec_block("# spec.py\n"))
    report = bisect_spec(spec)
    assert report.verdict == "diverge" and (report.culprit.reference, report.culprit.port) == ("1", "1")
    assert any(h.verified and h.fix == "1.approximate = 'none'" for h in report.culprit.hints), (
        report.render()
    )
    assert "fix (verified): 1.approximate = 'none'" in report.render()


def test_the_spec_pattern_for_lists_and_extra_arguments_runs_and_matches(tmp_path):
    from paritykit.bisection.spec import bisect_spec

    spec = tmp_path / "spec_lists.py"
    spec.write_text(_spec_block("# spec_lists.py"))
    report = bisect_spec(spec)
    assert report.verdict == "match", report.render()
    shifted = tmp_path / "spec_lists_shifted.py"
    shifted.write_text(
        spec.read_text().replace('"timestep": t,', '"timestep": t * 1.5,')  # the port fed another timestep
    )
    assert bisect_spec(shifted).verdict == "diverge"


def test_skills_are_sized_for_agents():
    # an agent reads a skill's first screen; the long material sits in references/ the skill links to
    for skill in SKILLS.glob("*/SKILL.md"):
        assert len(skill.read_text().splitlines()) <= 200, skill
    first = (SKILLS / "parity-testing" / "SKILL.md").read_text().split("## SPEC patterns")[0]
    assert "## The loop: triage → bisect → schedule" in first and "paritykit triage" in first
