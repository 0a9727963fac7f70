r"""The skill pack: find it, validate it, and install it for coding agents without ever losing a user's file.

Torch-free, and apart from ``validate`` (which needs PyYAML) it uses only the standard library, so the
Makefile can run the installer from a bare checkout.

Installing makes one symlink per skill folder (``.claude/skills/<skill> -> ../../skills/<skill>``) or, with
``copy=True`` or where a symlink cannot be made, a copy. Every entry made is recorded in a manifest
(``.paritykit-manifest.json``) inside the agent's skills folder; uninstall removes only entries that are still
as they were made. Conflicts are checked before anything is written, so a refused install changes nothing.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, render_table

SKILL_FILE = "SKILL.md"


# ------------------------------------------------------------------------------------------------------------
# Discovery
# ------------------------------------------------------------------------------------------------------------


def pack_dir() -> Path:
    """The folder holding the pack's skills (inside the wheel, or ``skills/`` of a checkout)."""
    from paritykit.base.data import data_dir

    return data_dir("skills")


def find_skills(root: str | os.PathLike | None = None) -> list[Path]:
    r"""Skill folders directly under ``root`` (default: the pack): sub-folders holding a ``SKILL.md``, by
    name."""
    root = pack_dir() if root is None else Path(root)
    if not root.is_dir():
        raise ParityKitError(f"{root}: not a folder of skills")
    return sorted(p for p in root.iterdir() if not p.name.startswith(".") and has_skill_file(p))


def has_skill_file(folder: Path) -> bool:
    # Compare exact names: on a case-insensitive file system `skill.md` would pass an `is_file` check.
    try:
        return folder.is_dir() and SKILL_FILE in os.listdir(folder)
    except OSError:
        return False


def split_frontmatter(text: str) -> tuple[str, str, int]:
    r"""Split ``SKILL.md`` text into (frontmatter, body, line number where the body starts).

    Raises ValueError with a readable reason when the file does not start with a closed ``---`` block.
    """
    lines = text.lstrip("\ufeff").splitlines(keepends=True)
    if not lines or lines[0].strip() != "---":
        raise ValueError("SKILL.md must start with a '---' line opening the YAML frontmatter")
    for i in range(1, len(lines)):
        if lines[i].strip() == "---":
            return "".join(lines[1:i]), "".join(lines[i + 1 :]), i + 2
    raise ValueError("the frontmatter opened by '---' on line 1 is never closed by a second '---' line")


def _frontmatter(folder: Path) -> dict[str, Any]:
    import yaml

    _, text = read_skill_file(folder)
    data = yaml.safe_load(split_frontmatter(text)[0])
    if not isinstance(data, dict):
        raise ValueError("the frontmatter is not a YAML mapping")
    return data


def read_skill_file(folder: Path) -> tuple[Path, str]:
    path = folder / SKILL_FILE
    return path, path.read_text(encoding="utf-8")


@dataclass
class SkillInfo:
    name: str
    description: str
    path: str


@dataclass
class SkillList:
    r"""What ``paritykit skills list`` prints: each skill's folder name and one-line description."""

    pack: str
    skills: list[SkillInfo]
    exit_code: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "pack": self.pack,
            "skills": [vars(s) for s in self.skills],
            "environment": environment_stamp(),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        # Descriptions are long by design (agents match on them): wrap them so the table fits 120 columns.
        name_width = max([len("skill"), *(len(s.name) for s in self.skills)])
        width = max(TABLE_WIDTH - name_width - 2, 40)
        rows = []
        for info in self.skills:
            lines = textwrap.wrap(info.description, width) or [""]
            rows += [(info.name, lines[0]), *(("", line) for line in lines[1:])]
        shown = rows if not limit else rows[: _rows_for(limit, rows)]
        table = render_table(("skill", "description"), shown, limit=None)
        more = len(self.skills) - sum(1 for name, _ in shown if name)
        tail = [f"… {more} more (raise --limit, or use --json for everything)"] if more else []
        return "\n".join([table, *tail, f"{len(self.skills)} skill(s) in {self.pack}"])


TABLE_WIDTH = 120  # the widest a table may print: a terminal split in two, an agent's tool output


def _rows_for(limit: int, rows: list[tuple[str, str]]) -> int:
    r"""How many wrapped rows hold the first ``limit`` skills (their continuation lines included)."""
    starts = [i for i, (name, _) in enumerate(rows) if name]
    return starts[limit] if limit < len(starts) else len(rows)


def list_skills(root: str | os.PathLike | None = None) -> SkillList:
    r"""Name and one-line description of every skill in ``root`` (default: the pack)."""
    root = pack_dir() if root is None else Path(root)
    infos = []
    for folder in find_skills(root):
        try:
            description = str(_frontmatter(folder).get("description", "")).strip()
        except Exception as exc:  # a broken skill still gets listed, with the reason
            description = (
                f"(unreadable frontmatter: {str(exc).splitlines()[0]}; run `paritykit skills validate`)"
            )
        infos.append(SkillInfo(folder.name, " ".join(description.split()), str(folder)))
    return SkillList(str(root), infos)


def show_skill(name: str, root: str | os.PathLike | None = None) -> str:
    r"""The full text of one skill's ``SKILL.md`` (for agents without skill support)."""
    folders = {p.name: p for p in find_skills(root)}
    if name not in folders:
        raise ParityKitError(f"unknown skill {name!r}; available: {', '.join(folders) or 'none'}")
    return read_skill_file(folders[name])[1]


# ------------------------------------------------------------------------------------------------------------
# Validation (agentskills.io rules)
# ------------------------------------------------------------------------------------------------------------


def is_within(path: str, root: str) -> bool:
    path, root = os.path.normcase(path), os.path.normcase(root)
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
