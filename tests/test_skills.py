"""`paritykit skills`: validation rules, and install/uninstall that never lose a user's file (real temp
dirs)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from paritykit.base.errors import ParityKitError
from paritykit.pack.installer import AGENTS, MANIFEST_NAME, detect_agents, install, uninstall
from paritykit.pack.skill_check import validate
from paritykit.pack.skills import find_skills, list_skills, pack_dir, show_skill

from tests.conftest import REPO, run_cli

PACK_NAMES = [p.name for p in find_skills()]


def tree_state(root: Path) -> dict[str, tuple]:
    r"""Every file, folder and symlink under ``root`` with its bytes' hash or link target (links not
    followed)."""
    state: dict[str, tuple] = {}
    for directory, subdirs, files in os.walk(root):
        for name in subdirs + files:
            full = Path(directory) / name
            rel = str(full.relative_to(root))
            if full.is_symlink():
                state[rel] = ("link", os.readlink(full))
            elif full.is_dir():
                state[rel] = ("dir",)
            else:
                state[rel] = ("file", hashlib.sha256(full.read_bytes()).hexdigest())
    return state


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def checkout(tmp_path) -> Path:
    r"""A paritykit-like checkout: a copy of the real pack (whatever skills exist) plus `.ai/AGENTS.md`."""
    root = tmp_path / "paritykit"
    shutil.copytree(pack_dir(), root / "skills", ignore=shutil.ignore_patterns("__pycache__"))
    write(root / ".ai" / "AGENTS.md", "# guidelines\n")
    return root


@pytest.fixture
def pack(checkout) -> Path:
    return checkout / "skills"


@pytest.fixture
def other(tmp_path) -> Path:
    r"""Another repository (a diffusers fork) with the user's own skill and instruction files."""
    root = tmp_path / "fork"
    write(
        root / ".claude" / "skills" / "mine" / "SKILL.md", "---\nname: mine\ndescription: Mine.\n---\nbody\n"
    )
    write(
        root / ".agents" / "skills" / "theirs" / "SKILL.md", "---\nname: theirs\ndescription: Theirs.\n---\n"
    )
    write(root / "CLAUDE.md", "my claude notes\n")
    write(root / "AGENTS.md", "my agents notes\n")
    return root


# --- discovery
# -----------------------------------------------------------------------------------------------


def test_pack_has_skills_and_list_names_each_with_a_description():
    assert PACK_NAMES, "the pack has no skills"
    listing = list_skills()
    assert [s.name for s in listing.skills] == PACK_NAMES
    assert all(s.description and not s.description.startswith("(unreadable") for s in listing.skills)
    assert all(name in listing.render(limit=0) for name in PACK_NAMES)


def test_show_prints_the_skill_file_and_refuses_unknown_names():
    name = PACK_NAMES[0]
    assert show_skill(name) == (pack_dir() / name / "SKILL.md").read_text(encoding="utf-8")
    with pytest.raises(ParityKitError, match="no-such-skill"):
        show_skill("no-such-skill")


def test_cli_list_json_and_show():
    result = run_cli("skills", "list", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["schema_version"] == 1
    assert [s["name"] for s in payload["skills"]] == PACK_NAMES
    shown = run_cli("skills", "show", PACK_NAMES[0])
    assert shown.returncode == 0 and shown.stdout.startswith("---")
    missing = run_cli("skills", "show", "no-such-skill")
    assert missing.returncode == 2
    assert len(missing.stderr.strip().splitlines()) == 1 and "no-such-skill" in missing.stderr


# --- validation
# ------------------------------------------------------------------------------------------------


def test_pack_passes_validate():
    report = validate()
    assert report.exit_code == 0, report.render(limit=0)
    assert {s.name for s in report.skills} == set(PACK_NAMES)


def _agentskills() -> str:
    candidate = Path(sys.executable).parent / "agentskills"
    found = str(candidate) if candidate.exists() else shutil.which("agentskills")
    assert found, "the pinned skills-ref validator (command `agentskills`) is missing; install the dev extra"
    return found


@pytest.mark.parametrize("name", PACK_NAMES)
def test_pack_passes_the_skills_ref_validator(name):
    result = subprocess.run(
        [_agentskills(), "validate", str(pack_dir() / name)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


GOOD = """\
---
name: {name}
description: Use when checking that the validator accepts a well-formed skill.
license: Apache-2.0
compatibility: Any agent that reads Agent Skills.
metadata:
  author: paritykit
allowed-tools: Bash Read
---

# A good skill

See [the details](references/details.md), [a section](#a-good-skill), [a site](https://example.com) and
![a picture](assets/pic.png "title").

```markdown
[not a link](inside/a/fence.md)
```
Inline `[code](nowhere.md)` is not a link either.

[ref]: references/details.md
"""


def make_skill(root: Path, name: str = "good-skill", text: str | None = None) -> Path:
    folder = root / name
    write(folder / "SKILL.md", (GOOD if text is None else text).format(name=name))
    write(folder / "references" / "details.md", "Back to [the skill](../SKILL.md).\n")
    write(folder / "assets" / "pic.png", "png")
    return folder


def good_with(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


# (rule, folder name, SKILL.md text or None for no SKILL.md, also rejected by skills-ref)
BROKEN = [
    ("skill-md-missing", "good-skill", None, True),
    ("frontmatter-missing", "good-skill", "# no frontmatter\n", True),
    ("frontmatter-missing", "good-skill", "---\nname: {name}\ndescription: Never closed.\n", True),
    (
        "frontmatter-yaml",
        "good-skill",
        good_with("description: Use when", "description: Use when: a colon"),
        True,
    ),
    (
        "frontmatter-fields",
        "good-skill",
        good_with("license:", "disable-model-invocation: true\nlicense:"),
        True,
    ),
    ("frontmatter-yaml", "good-skill", good_with("license:", "name: {name}\nlicense:"), True),
    ("name-missing", "good-skill", good_with("name: {name}\n", ""), True),
    ("name-format", "Bad-Skill", None, True),
    ("name-format", "-bad-skill", None, True),
    ("name-format", "bad-skill-", None, True),
    ("name-format", "bad--skill", None, True),
    ("name-format", "bad_skill", None, True),
    ("name-length", "a" * 65, None, True),
    ("name-folder", "good-skill", good_with("name: {name}", "name: other-name"), True),
    ("description-missing", "good-skill", good_with("description: Use when", "summary: Use when"), True),
    (
        "description-length",
        "good-skill",
        good_with(
            "description: Use when checking that the validator accepts a well-formed skill.",
            'description: ""',
        ),
        True,
    ),
    (
        "description-length",
        "good-skill",
        good_with(
            "description: Use when checking that the validator accepts a well-formed skill.",
            f"description: {'x' * 1025}",
        ),
        True,
    ),
    ("description-format", "good-skill", good_with("well-formed skill.", "well-formed <skill>."), False),
    (
        "compatibility-length",
        "good-skill",
        good_with("compatibility: Any agent that reads Agent Skills.", f"compatibility: {'c' * 501}"),
        True,
    ),
    ("metadata-format", "good-skill", good_with("author: paritykit", "author: [a, b]"), False),
    ("body-length", "good-skill", GOOD + "line\n" * 500, False),
    ("link-missing", "good-skill", GOOD + "\nSee [gone](references/gone.md).\n", False),
    ("link-outside", "good-skill", GOOD + "\nSee [sibling](../sibling/SKILL.md).\n", False),
    ("link-absolute", "good-skill", GOOD + "\nSee [abs](/etc/hosts).\n", False),
]


def test_a_good_skill_passes_both_validators(tmp_path):
    folder = make_skill(tmp_path)
    make_skill(tmp_path, "sibling")
    report = validate([folder])
    assert report.exit_code == 0, report.render()
    assert subprocess.run([_agentskills(), "validate", str(folder)], capture_output=True).returncode == 0


@pytest.mark.parametrize(
    ("rule", "folder_name", "text", "skills_ref_rejects"),
    BROKEN,
    ids=[f"{b[0]}-{i}" for i, b in enumerate(BROKEN)],
)
def test_each_rule_is_enforced(tmp_path, rule, folder_name, text, skills_ref_rejects):
    make_skill(tmp_path, "sibling")  # a real file outside the skill, for the link-outside case
    folder = make_skill(tmp_path, folder_name, text)
    if rule == "skill-md-missing":
        (folder / "SKILL.md").unlink()
    report = validate([folder])
    rules = [p.rule for p in report.skills[0].problems]
    assert report.exit_code == 1
    assert rule in rules, report.render()
    if rule.startswith("link"):
        assert rules == [rule]  # the good skill's own links (fences, code, anchors, URLs) raise nothing
    if skills_ref_rejects:
        result = subprocess.run([_agentskills(), "validate", str(folder)], capture_output=True, text=True)
        assert result.returncode != 0, f"skills-ref accepted what we reject as {rule}"


def test_links_in_reference_files_are_checked_too(tmp_path):
    folder = make_skill(tmp_path)
    write(
        folder / "references" / "more.md",
        "Text.\n\nSee [missing](missing.md) and [up](../../elsewhere.md).\n",
    )
    problems = {(p.rule, p.file, p.line) for p in validate([folder]).skills[0].problems}
    assert problems == {("link-missing", "references/more.md", 3), ("link-outside", "references/more.md", 3)}


def test_validate_accepts_a_folder_of_skills_and_a_skill_md(tmp_path):
    make_skill(tmp_path, "one")
    make_skill(tmp_path, "two")
    assert [s.name for s in validate([tmp_path]).skills] == ["one", "two"]
    assert [s.name for s in validate([tmp_path / "two" / "SKILL.md"]).skills] == ["two"]


def test_cli_validate_exit_codes(tmp_path):
    good = make_skill(tmp_path, "good-skill")
    bad = make_skill(tmp_path, "bad-skill", good_with("name: {name}", "name: wrong"))
    assert run_cli("skills", "validate", good).returncode == 0
    result = run_cli("skills", "validate", good, bad, "--json")
    assert result.returncode == 1
    payload = json.loads(result.stdout)
    assert payload["valid"] is False
    assert [p["rule"] for s in payload["skills"] for p in s["problems"]] == ["name-folder"]
    missing = run_cli("skills", "validate", tmp_path / "nope")
    assert missing.returncode == 2 and "nope" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


# --- install / uninstall -----------------------------------------------------------------------------------


def assert_linked(folder: Path, pack: Path):
    assert folder.is_dir() and not folder.is_symlink()
    for name in PACK_NAMES:
        link = folder / name
        assert link.is_symlink(), link
        assert not os.path.isabs(os.readlink(link)), "links are relative"
        assert link.resolve() == (pack / name).resolve()
        assert not (link / "SKILL.md").is_symlink()


def test_install_links_each_skill_and_uninstall_restores_the_target_byte_for_byte(other, pack):
    before = tree_state(other)
    report = install(["all"], target=other, pack=pack)
    assert report.exit_code == 0
    assert_linked(other / ".claude" / "skills", pack)
    assert_linked(other / ".agents" / "skills", pack)
    # A user's skills and instruction files are untouched; another repo never gets instruction links.
    for rel in (".claude/skills/mine/SKILL.md", ".agents/skills/theirs/SKILL.md", "CLAUDE.md", "AGENTS.md"):
        assert tree_state(other)[rel] == before[rel]
    manifest = json.loads((other / ".claude" / "skills" / MANIFEST_NAME).read_text())
    assert {e["path"]: e["kind"] for e in manifest["entries"]} == {n: "link" for n in PACK_NAMES}

    after = tree_state(other)
    again = install(["all"], target=other, pack=pack)
    assert {a.action for a in again.actions} == {"unchanged"}
    assert tree_state(other) == after  # idempotent, manifest included

    uninstall(["all"], target=other, pack=pack)
    assert tree_state(other) == before


def test_round_trip_on_an_empty_repository_removes_the_folders_it_made(tmp_path, pack):
    target = tmp_path / "empty"
    target.mkdir()
    install(["claude", "codex"], target=target, pack=pack)
    assert (target / ".claude" / "skills").is_dir()
    uninstall(target=target, pack=pack)
    assert tree_state(target) == {}


def test_other_repository_never_gets_instruction_files(tmp_path, pack):
    target = tmp_path / "bare"
    target.mkdir()
    report = install(["all"], target=target, pack=pack)
    assert not any(os.path.lexists(target / f) for f in ("CLAUDE.md", "AGENTS.md", "GEMINI.md"))
    assert any("left alone" in n for n in report.notes)


def test_own_checkout_links_instruction_files_unless_a_real_one_exists(checkout, pack):
    write(checkout / "AGENTS.md", "a real file\n")
    before = tree_state(checkout)
    report = install(["claude", "codex"], target=checkout, pack=pack)
    assert os.readlink(checkout / "CLAUDE.md") == ".ai/AGENTS.md"
    assert (checkout / "AGENTS.md").read_text() == "a real file\n"
    assert any("AGENTS.md exists" in w for w in report.warnings)
    uninstall(target=checkout, pack=pack)
    assert tree_state(checkout) == before


def test_colliding_skill_is_refused_and_nothing_changes(other, pack):
    name = PACK_NAMES[0]
    write(other / ".claude" / "skills" / name / "SKILL.md", "diffusers' own skill\n")
    before = tree_state(other)
    with pytest.raises(ParityKitError) as info:
        install(["all"], target=other, pack=pack)
    message = str(info.value)
    assert f".claude/skills/{name}" in message and "--skip-existing" in message and "--force" in message
    assert tree_state(other) == before


def test_skip_existing_installs_the_rest(other, pack):
    name = PACK_NAMES[0]
    write(other / ".claude" / "skills" / name / "SKILL.md", "diffusers' own skill\n")
    before = tree_state(other)
    report = install(["claude"], target=other, pack=pack, skip_existing=True)
    assert [a.path for a in report.actions if a.action == "skipped"] == [f".claude/skills/{name}"]
    assert (other / ".claude" / "skills" / name / "SKILL.md").read_text() == "diffusers' own skill\n"
    assert all((other / ".claude" / "skills" / n).is_symlink() for n in PACK_NAMES[1:])
    uninstall(["claude"], target=other, pack=pack)
    assert tree_state(other) == before


def test_force_moves_the_users_skill_to_a_named_backup_and_uninstall_puts_it_back(other, pack):
    name = PACK_NAMES[0]
    write(other / ".claude" / "skills" / name / "SKILL.md", "diffusers' own skill\n")
    before = tree_state(other)
    install(["claude"], target=other, pack=pack, force=True)
    assert (other / ".claude" / "skills" / name).is_symlink()
    backups = list((other / ".claude" / "paritykit-backups").iterdir())
    assert len(backups) == 1 and backups[0].name.startswith(f"{name}-")
    assert (backups[0] / "SKILL.md").read_text() == "diffusers' own skill\n"
    uninstall(["claude"], target=other, pack=pack)
    assert tree_state(other) == before


def test_force_and_skip_existing_exclude_each_other(other, pack):
    with pytest.raises(ParityKitError, match="exclude"):
        install(["claude"], target=other, pack=pack, force=True, skip_existing=True)


@pytest.mark.parametrize("linked", [".claude/skills", ".claude"])
def test_symlinked_agent_folder_is_refused(tmp_path, pack, linked):
    target = tmp_path / "fork"
    write(target / ".ai" / "skills" / "tracked" / "SKILL.md", "tracked file\n")
    link = target / linked
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(
        os.path.relpath(target / ".ai" / ("skills" if linked.endswith("skills") else ""), link.parent), link
    )
    before = tree_state(target)
    with pytest.raises(ParityKitError, match="symlink"):
        install(["claude"], target=target, pack=pack)
    with pytest.raises(ParityKitError, match="symlink"):
        install(["claude"], target=target, pack=pack, force=True)
    assert tree_state(target) == before
    uninstall(target=target, pack=pack)  # never writes through it either
    assert tree_state(target) == before


def test_copy_then_user_edit_is_kept_on_uninstall(other, pack):
    before = tree_state(other)
    report = install(["claude"], target=other, pack=pack, copy=True)
    assert {a.action for a in report.actions} == {"copied"}
    folder = other / ".claude" / "skills"
    assert all((folder / n).is_dir() and not (folder / n).is_symlink() for n in PACK_NAMES)
    assert install(["claude"], target=other, pack=pack, copy=True).counts() == {"unchanged": len(PACK_NAMES)}
    edited = folder / PACK_NAMES[0] / "SKILL.md"
    edited.write_text(edited.read_text() + "\nmy own note\n")
    result = uninstall(["claude"], target=other, pack=pack)
    assert edited.read_text().endswith("my own note\n")
    assert any(PACK_NAMES[0] in w and "kept" in w for w in result.warnings)
    assert not (folder / MANIFEST_NAME).exists()
    assert all(not os.path.lexists(folder / n) for n in PACK_NAMES[1:])
    # The edited copy is now the user's: a new install refuses to replace it.
    with pytest.raises(ParityKitError, match=PACK_NAMES[0]):
        install(["claude"], target=other, pack=pack)
    shutil.rmtree(folder / PACK_NAMES[0])
    assert tree_state(other) == before


def test_copy_round_trip_and_switch_to_links(other, pack):
    before = tree_state(other)
    install(["codex"], target=other, pack=pack, copy=True)
    report = install(["codex"], target=other, pack=pack)  # our unchanged copies become links
    assert report.counts() == {"replaced": len(PACK_NAMES), "linked": len(PACK_NAMES)}
    assert_linked(other / ".agents" / "skills", pack)
    uninstall(["codex"], target=other, pack=pack)
    assert tree_state(other) == before


def test_symlink_failure_falls_back_to_a_copy(other, pack, monkeypatch):
    def no_symlinks(*args, **kwargs):
        raise OSError("symbolic links are not available here")

    monkeypatch.setattr(os, "symlink", no_symlinks)  # what Windows without the privilege does
    report = install(["claude"], target=other, pack=pack)
    folder = other / ".claude" / "skills"
    assert all((folder / n).is_dir() and not (folder / n).is_symlink() for n in PACK_NAMES)
    assert any("copied it instead" in w for w in report.warnings)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert {e["kind"] for e in manifest["entries"]} == {"copy"}


def test_dry_run_writes_nothing(other, pack):
    before = tree_state(other)
    report = install(["all"], target=other, pack=pack, dry_run=True)
    assert report.dry_run and report.counts() == {"linked": 2 * len(PACK_NAMES)}
    assert tree_state(other) == before
    install(["all"], target=other, pack=pack)
    after = tree_state(other)
    assert uninstall(target=other, pack=pack, dry_run=True).counts()["removed"] >= 2 * len(PACK_NAMES)
    assert tree_state(other) == after


def test_links_made_by_an_older_makefile_are_recognised(checkout, pack):
    before = tree_state(checkout)
    skills_dir = checkout / ".claude" / "skills"
    skills_dir.mkdir(parents=True)
    for name in PACK_NAMES:
        os.symlink(f"../../skills/{name}", skills_dir / name)
    os.symlink(".ai/AGENTS.md", checkout / "CLAUDE.md")
    (checkout / ".agents").mkdir()
    os.symlink("../skills", checkout / ".agents" / "skills")  # diffusers-style link of the whole folder
    report = uninstall(target=checkout, pack=pack)
    assert report.counts()["removed"] == len(PACK_NAMES) + 2
    assert not os.path.lexists(checkout / ".agents" / "skills") and not os.path.lexists(
        checkout / "CLAUDE.md"
    )
    for folder in (skills_dir, checkout / ".claude", checkout / ".agents"):
        folder.rmdir()  # empty: only the links went
    assert tree_state(checkout) == before


def test_skills_that_leave_the_pack_are_swept(tmp_path, pack):
    target = tmp_path / "repo"
    target.mkdir()
    extra = make_skill(pack.parent / "skills", "retired-skill")
    install(["claude"], target=target, pack=pack)
    assert (target / ".claude" / "skills" / "retired-skill").is_symlink()
    shutil.rmtree(extra)
    report = install(["claude"], target=target, pack=pack)
    assert [a.path for a in report.actions if a.action == "removed"] == [".claude/skills/retired-skill"]
    assert not os.path.lexists(target / ".claude" / "skills" / "retired-skill")


def test_agent_detection_from_the_environment():
    assert detect_agents({"CLAUDECODE": "1"}) == ["claude"]
    assert detect_agents({"CLAUDE_CODE_ENTRYPOINT": "cli"}) == ["claude"]
    assert detect_agents({"CODEX_SANDBOX": "seatbelt"}) == ["codex"]
    assert detect_agents({"CLAUDECODE": "1", "CODEX_SANDBOX": "x"}) == ["claude", "codex"]
    assert detect_agents({"PATH": "/bin"}) == ["claude", "codex"]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLAUDE", "CODEX_"))}
    env.update(extra)
    return env


def test_cli_install_detects_the_agent_and_refuses_collisions_in_one_line(tmp_path):
    target = tmp_path / "repo"
    target.mkdir()
    env = _clean_env(CLAUDECODE="1")
    result = subprocess.run(
        [sys.executable, "-m", "paritykit", "skills", "install", "--target", str(target), "--json"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(REPO / "helpers")},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["agents"] == ["claude"]
    assert (target / ".claude" / "skills").is_dir() and not (target / ".agents").exists()

    write(target / ".agents" / "skills" / PACK_NAMES[0] / "SKILL.md", "not ours\n")
    refused = run_cli("skills", "install", "--agent", "codex", "--target", target)
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("paritykit: error: refusing")
    as_json = run_cli("skills", "install", "--agent", "codex", "--target", target, "--json")
    assert as_json.returncode == 2 and "--skip-existing" in json.loads(as_json.stdout)["error"]
    bad_agent = run_cli("skills", "install", "--agent", "vim", "--target", target)
    assert bad_agent.returncode == 2 and "vim" in bad_agent.stderr


def test_cli_global_uses_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    write(home / ".claude" / "skills" / "mine" / "SKILL.md", "mine\n")
    before = tree_state(home)
    env = {"HOME": str(home)}
    result = run_cli("skills", "install", "--global", "--agent", "all", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    for folder in (".claude/skills", ".agents/skills", ".cursor/skills"):
        for name in PACK_NAMES:
            assert (home / folder / name).resolve() == (pack_dir() / name).resolve()
    assert not (tmp_path / ".claude").exists()
    assert run_cli("skills", "uninstall", "--global", cwd=tmp_path, env=env).returncode == 0
    assert tree_state(home) == before


def test_every_agent_has_project_and_user_folders():
    from paritykit.pack.installer import INSTRUCTION_FILES, PROJECT_FOLDERS, USER_FOLDERS

    assert set(PROJECT_FOLDERS) == set(USER_FOLDERS) == set(INSTRUCTION_FILES) == set(AGENTS)
    assert PROJECT_FOLDERS["claude"] == ".claude/skills"  # Claude Code does not read .agents/skills
    assert PROJECT_FOLDERS["codex"] == ".agents/skills"


def test_skills_commands_never_import_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from paritykit.cli import cli
        for args in (["skills", "list"], ["skills", "validate"], ["skills", "show", {PACK_NAMES[0]!r}],
                     ["skills", "install", "--agent", "all", "--target", {str(tmp_path)!r}],
                     ["skills", "uninstall", "--target", {str(tmp_path)!r}]):
            try:
                cli.main(args)
            except SystemExit:
                pass
        print("HEAVY=" + ",".join(m for m in ("torch", "diffusers", "numpy") if m in sys.modules))
        """)
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO / "helpers"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.stdout.strip().splitlines()[-1] == "HEAVY=", result.stdout + result.stderr


# --- plugin manifests
# ----------------------------------------------------------------------------------------


def _listed_skills(root: Path, declared) -> set[str]:
    r"""Skill names a manifest's ``skills`` field covers: a folder of skills, or a list of skill folders."""
    if isinstance(declared, str):
        return {p.name for p in find_skills(root / declared)}
    return {(root / path).resolve().name for path in declared if (root / path / "SKILL.md").is_file()}


def test_plugin_manifests_parse_and_list_every_skill():
    from paritykit import __version__

    claude = json.loads((REPO / ".claude-plugin" / "plugin.json").read_text())
    market = json.loads((REPO / ".claude-plugin" / "marketplace.json").read_text())
    codex = json.loads((REPO / ".codex-plugin" / "plugin.json").read_text())
    names = set(PACK_NAMES)
    assert claude["name"] == codex["name"] == "paritykit"
    assert claude["version"] == codex["version"] == __version__
    # Claude Code reads a plugin's ./skills/ folder when plugin.json names no other.
    assert _listed_skills(REPO, claude.get("skills", "./skills/")) == names
    (entry,) = [p for p in market["plugins"] if p["name"] == "paritykit"]
    assert entry["version"] == __version__ and market["owner"]["name"]
    assert _listed_skills(REPO / entry["source"], entry["skills"]) == names, (
        "list every skill in marketplace.json"
    )
    assert _listed_skills(REPO, codex["skills"]) == names


def test_bad_inputs_are_one_line_errors_naming_the_culprit(tmp_path, pack, other):
    with pytest.raises(ParityKitError, match="nowhere"):
        install(["claude"], target=tmp_path / "nowhere", pack=pack)
    with pytest.raises(ParityKitError, match="exclude"):
        install(["claude"], target=other, user_scope=True, pack=pack)
    with pytest.raises(ParityKitError, match="'vim'"):
        install(["claude,vim"], target=other, pack=pack)
    write(other / ".agents" / "skills" / MANIFEST_NAME, "{not json")
    before = tree_state(other)
    with pytest.raises(ParityKitError, match=MANIFEST_NAME):
        install(["codex"], target=other, pack=pack)
    assert tree_state(other) == before
    blocked = tmp_path / "blocked"
    write(blocked / ".claude" / "skills", "a file where a folder belongs\n")
    with pytest.raises(ParityKitError, match="is a file"):
        install(["claude"], target=blocked, pack=pack)


def test_an_edited_copy_is_not_overwritten_by_a_reinstall(other, pack):
    install(["claude"], target=other, pack=pack, copy=True)
    edited = other / ".claude" / "skills" / PACK_NAMES[-1] / "SKILL.md"
    edited.write_text("my rewrite\n")
    before = tree_state(other)
    with pytest.raises(ParityKitError, match="edited since"):
        install(["claude"], target=other, pack=pack, copy=True)
    assert tree_state(other) == before
    install(["claude"], target=other, pack=pack, copy=True, force=True)
    (backup,) = (other / ".claude" / "paritykit-backups").iterdir()
    assert (backup / "SKILL.md").read_text() == "my rewrite\n"


# --- what the reports say
# ------------------------------------------------------------------------------------


def test_dry_run_with_a_conflict_shows_the_plan_with_the_conflict_and_exits_1(other, pack):
    name = PACK_NAMES[0]
    write(other / ".claude" / "skills" / name / "SKILL.md", "diffusers' own skill\n")
    before = tree_state(other)
    report = install(["claude"], target=other, pack=pack, dry_run=True)
    assert report.exit_code == 1 and tree_state(other) == before
    rows = {a.path: a.action for a in report.actions}
    assert rows[f".claude/skills/{name}"] == "conflict"
    assert sum(action == "linked" for action in rows.values()) == len(PACK_NAMES) - 1  # the rest of the plan
    assert any("--skip-existing" in w and "--force" in w for w in report.warnings)
    run = run_cli("skills", "install", "--agent", "claude", "--target", other, "--dry-run")
    assert run.returncode == 1 and "conflict" in run.stdout and run.stderr == "", run.stdout + run.stderr
    assert tree_state(other) == before


def test_uninstall_help_speaks_of_uninstalling():
    text = run_cli("skills", "uninstall", "--help").stdout
    assert "Agent to uninstall for" in text and "Repository to uninstall from" in text
    assert "to install" not in text and "install into" not in text, text


def test_skills_list_fits_120_columns_and_keeps_every_word():
    listing = list_skills()
    text = listing.render(limit=0)
    assert max(len(line) for line in text.splitlines() if not line.endswith(listing.pack)) <= 120, text
    words = text.split()
    for info in listing.skills:
        assert " ".join(info.description.split()) in " ".join(words), info.name
    two = listing.render(limit=2)
    assert f"… {len(listing.skills) - 2} more" in two and listing.skills[2].name not in two


def test_install_says_how_to_keep_links_out_of_git_status_and_when_to_copy(other, pack):
    (other / ".git" / "info").mkdir(parents=True)
    report = install(["claude"], target=other, pack=pack)
    notes = "\n".join(report.notes)
    assert ".git/info/exclude" in notes and "/.claude/skills/" in notes, notes
    assert "--copy" in notes and "moves" in notes, notes
    # once excluded (and for copies) the advice is not repeated
    (other / ".git" / "info" / "exclude").write_text("/.claude/skills/\n")
    copied = "\n".join(install(["claude"], target=other, pack=pack, copy=True).notes)
    assert ".git/info/exclude" not in copied and "--copy" not in copied, copied


def test_no_git_no_exclude_advice(other, pack):
    notes = "\n".join(install(["claude"], target=other, pack=pack).notes)
    assert ".git/info/exclude" not in notes
