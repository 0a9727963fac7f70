r"""Validating a skill against the Agent Skills spec: front matter fields and limits, name format, and every
relative link resolving inside the pack."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from paritykit.base.errors import ParityKitError
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, render_table
from paritykit.pack.skills import (
    SKILL_FILE,
    find_skills,
    has_skill_file,
    is_within,
    pack_dir,
    read_skill_file,
    split_frontmatter,
)

ALLOWED_FIELDS = ("name", "description", "license", "compatibility", "metadata", "allowed-tools")


NAME_MAX = 64


DESCRIPTION_MAX = 1024


COMPATIBILITY_MAX = 500


BODY_MAX_LINES = 500


_NAME_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


@dataclass
class Problem:
    rule: str
    message: str
    file: str = SKILL_FILE
    line: int | None = None

    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file


@dataclass
class SkillCheck:
    name: str
    path: str
    problems: list[Problem] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems


@dataclass
class ValidationReport:
    r"""Result of ``validate``: every skill checked, with one ``Problem`` per broken rule. Exit 1 if any."""

    skills: list[SkillCheck]

    @property
    def valid(self) -> bool:
        return all(s.valid for s in self.skills)

    @property
    def exit_code(self) -> int:
        return 0 if self.valid else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "skills": [
                {"name": s.name, "path": s.path, "valid": s.valid, "problems": [vars(p) for p in s.problems]}
                for s in self.skills
            ],
            "environment": environment_stamp(),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        bad = [s for s in self.skills if not s.valid]
        summary = f"{len(self.skills) - len(bad)} of {len(self.skills)} skill(s) valid"
        if not bad:
            return "\n".join([*(f"ok  {s.name}  ({s.path})" for s in self.skills), summary])
        rows = [(s.name, p.rule, p.where(), p.message) for s in bad for p in s.problems]
        return render_table(("skill", "rule", "where", "problem"), rows, limit=limit, summary=summary)


def validate(paths: Sequence[str | os.PathLike] | None = None) -> ValidationReport:
    r"""Check skills against the agentskills.io rules.

    Args:
        paths: skill folders, ``SKILL.md`` files, or folders of skills; default the pack.

    Returns:
        A ``ValidationReport`` (exit code 0 when every skill passes, 1 otherwise).
    """
    folders: list[Path] = []
    for raw in paths or [pack_dir()]:
        path = Path(raw)
        if not os.path.lexists(path):
            raise ParityKitError(f"{path}: no such file or folder")
        if path.is_file():
            if path.name.lower() != SKILL_FILE.lower():
                raise ParityKitError(f"{path}: expected a skill folder, its SKILL.md, or a folder of skills")
            folders.append(path.parent)
        elif has_skill_file(path) or not find_skills(path):
            folders.append(path)  # a skill folder, or a would-be one that lacks SKILL.md
        else:
            folders.extend(find_skills(path))
    return ValidationReport([check_skill(folder) for folder in folders])


def check_skill(folder: str | os.PathLike) -> SkillCheck:
    r"""Every agentskills.io rule for one skill folder; see ``validate``."""
    folder = Path(folder)
    # The folder name the agent sees, even when the folder is a link into the pack.
    folder_name = Path(os.path.abspath(folder)).name
    check = SkillCheck(folder_name, str(folder))
    problems = check.problems
    if not has_skill_file(folder):
        names = os.listdir(folder) if folder.is_dir() else []
        near = [n for n in names if n.lower() == SKILL_FILE.lower()]
        hint = f" (found {near[0]!r}; the name must be exactly SKILL.md)" if near else ""
        problems.append(Problem("skill-md-missing", f"no SKILL.md in {folder}{hint}"))
        return check
    try:
        _, text = read_skill_file(folder)
    except UnicodeDecodeError as exc:
        problems.append(Problem("encoding", f"SKILL.md is not UTF-8 text ({exc.reason})"))
        return check
    try:
        frontmatter_text, body, body_line = split_frontmatter(text)
    except ValueError as exc:
        problems.append(Problem("frontmatter-missing", str(exc), line=1))
        return check
    problems.extend(_check_frontmatter(frontmatter_text, folder_name))
    body_lines = len(body.splitlines())
    if body_lines > BODY_MAX_LINES:
        problems.append(
            Problem(
                "body-length",
                f"the body has {body_lines} lines (limit {BODY_MAX_LINES}); move detail into references/*.md",
                line=body_line + BODY_MAX_LINES,
            )
        )
    problems.extend(_check_links(folder))
    return check


def _strict_yaml_load(text: str) -> Any:
    r"""``yaml.safe_load`` that refuses duplicate keys (PyYAML keeps the last; skills-ref's strictyaml
    refuses)."""
    import yaml

    class _Loader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return loader.construct_mapping(node)

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _check_frontmatter(text: str, folder_name: str) -> list[Problem]:
    import yaml

    try:
        data = _strict_yaml_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        return [
            Problem(
                "frontmatter-yaml",
                f"the frontmatter is not valid YAML ({reason}); quote a value that contains ': '",
                line=mark.line + 2 if mark else None,
            )
        ]
    if not isinstance(data, dict):
        return [Problem("frontmatter-yaml", "the frontmatter must be a YAML mapping of field: value")]

    problems: list[Problem] = []
    unknown = [str(k) for k in data if k not in ALLOWED_FIELDS]
    if unknown:
        problems.append(
            Problem(
                "frontmatter-fields",
                f"unknown frontmatter field(s) {', '.join(unknown)}; allowed: {', '.join(ALLOWED_FIELDS)}",
            )
        )

    name = data.get("name")
    if name is None:
        problems.append(Problem("name-missing", "the frontmatter has no 'name'"))
    elif not isinstance(name, str):
        problems.append(Problem("name-format", f"'name' must be a string, not {type(name).__name__}"))
    else:
        if not 1 <= len(name) <= NAME_MAX:
            problems.append(
                Problem("name-length", f"'name' has {len(name)} characters (1-{NAME_MAX} allowed)")
            )
        if name and not _NAME_RE.match(name):
            problems.append(Problem("name-format", f"'name' {name!r} {_name_format_reason(name)}"))
        if name != folder_name:
            problems.append(
                Problem("name-folder", f"'name' {name!r} differs from its folder name {folder_name!r}")
            )

    description = data.get("description")
    if description is None:
        problems.append(Problem("description-missing", "the frontmatter has no 'description'"))
    elif not isinstance(description, str):
        problems.append(
            Problem("description-format", f"'description' must be a string, not {type(description).__name__}")
        )
    else:
        if not description.strip() or len(description) > DESCRIPTION_MAX:
            problems.append(
                Problem(
                    "description-length",
                    f"'description' has {len(description.strip())} characters (1-{DESCRIPTION_MAX} allowed)",
                )
            )
        if "<" in description or ">" in description:
            problems.append(Problem("description-format", "'description' must not contain '<' or '>'"))

    for key in ("license", "allowed-tools", "compatibility"):
        if key in data and not isinstance(data[key], str):
            problems.append(Problem(f"{key}-format", f"'{key}' must be a string"))
    compatibility = data.get("compatibility")
    if isinstance(compatibility, str) and len(compatibility) > COMPATIBILITY_MAX:
        problems.append(
            Problem(
                "compatibility-length",
                f"'compatibility' has {len(compatibility)} characters (at most {COMPATIBILITY_MAX})",
            )
        )
    if "metadata" in data:
        metadata = data["metadata"]
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            problems.append(
                Problem("metadata-format", "'metadata' must map strings to strings (quote the values)")
            )
    return problems


def _name_format_reason(name: str) -> str:
    if name.startswith("-") or name.endswith("-"):
        return "must not start or end with '-'"
    if "--" in name:
        return "must not contain '--'"
    return "may contain only lowercase letters a-z, digits and single hyphens"


_FENCE_RE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")


_CODE_SPAN_RE = re.compile(r"(`+).*?\1")


_INLINE_LINK_RE = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)


_REFERENCE_DEF_RE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")


_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _markdown_links(text: str) -> Iterable[tuple[int, str]]:
    r"""(line number, target) of every inline link, image and reference definition outside code."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE_RE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence):
                fence = None
            continue
        if fence is not None:
            continue
        line = _CODE_SPAN_RE.sub("", line)
        for found in _INLINE_LINK_RE.finditer(line):
            yield number, found.group(1)
        found = _REFERENCE_DEF_RE.match(line)
        if found:
            yield number, found.group(1)


def _check_links(folder: Path) -> list[Problem]:
    root = os.path.realpath(folder)
    problems = []
    for directory, subdirs, files in os.walk(folder):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        for name in sorted(f for f in files if f.lower().endswith(".md")):
            path = Path(directory) / name
            rel = os.path.relpath(path, folder)
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                problems.append(Problem("encoding", f"cannot read {rel} as UTF-8 ({exc})", file=rel))
                continue
            for line, raw in _markdown_links(text):
                target = raw[1:-1] if raw.startswith("<") and raw.endswith(">") else raw
                if not target or target.startswith("#") or _SCHEME_RE.match(target):
                    continue  # an anchor in the same file, or a URL
                target = unquote(target.split("#", 1)[0].split("?", 1)[0])
                if not target:
                    continue
                if target.startswith(("/", "~", "\\")):
                    problems.append(
                        Problem(
                            "link-absolute",
                            f"link {raw!r} is absolute; use a path relative to the skill",
                            rel,
                            line,
                        )
                    )
                    continue
                resolved = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), target))
                inside_lexically = is_within(resolved, os.path.abspath(folder))
                if not inside_lexically or not is_within(os.path.realpath(resolved), root):
                    problems.append(
                        Problem(
                            "link-outside",
                            f"link {raw!r} leaves the skill folder; agents may not load it",
                            rel,
                            line,
                        )
                    )
                elif not os.path.exists(resolved):
                    problems.append(
                        Problem(
                            "link-missing", f"link {raw!r} points at a file that does not exist", rel, line
                        )
                    )
    return problems
