r"""Installing the skill pack into agent folders: one relative link per skill, a manifest of what was made, a
user's file never replaced (planned first, then carried out)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.files import atomic_write_text
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, render_table
from paritykit.pack.skills import find_skills, is_within, pack_dir

MANIFEST_NAME = ".paritykit-manifest.json"


BACKUP_FOLDER = "paritykit-backups"


AGENTS = ("claude", "codex", "cursor", "gemini", "copilot", "opencode")


# Where each agent looks for skills (field notes, "Where each agent looks"). Project scope is relative to the
# repository, user scope (--global) to HOME. Claude Code reads only `.claude/skills`; the other five read
# `.agents/skills` in a project. In user scope Cursor reads `~/.cursor/skills` but not `~/.agents/skills`.
PROJECT_FOLDERS: dict[str, str] = {
    "claude": ".claude/skills",
    "codex": ".agents/skills",
    "cursor": ".agents/skills",
    "gemini": ".agents/skills",
    "copilot": ".agents/skills",
    "opencode": ".agents/skills",
}


USER_FOLDERS: dict[str, str] = {
    "claude": ".claude/skills",
    "codex": ".agents/skills",
    "cursor": ".cursor/skills",
    "gemini": ".agents/skills",
    "copilot": ".agents/skills",
    "opencode": ".agents/skills",
}


# The instruction file each agent reads at a repository root; linked to `.ai/AGENTS.md` only in paritykit's
# own checkout, never in another repository.
INSTRUCTION_FILES: dict[str, str] = {
    "claude": "CLAUDE.md",
    "codex": "AGENTS.md",
    "cursor": "AGENTS.md",
    "gemini": "GEMINI.md",
    "copilot": "AGENTS.md",
    "opencode": "AGENTS.md",
}


INSTRUCTIONS_SOURCE = ".ai/AGENTS.md"


_HASH_IGNORED = {"__pycache__", ".DS_Store"}


@dataclass
class Action:
    action: (
        str  # linked, copied, unchanged, adopted, replaced, backed-up, skipped, removed, kept, restored, ...
    )
    path: str
    detail: str = ""


@dataclass
class InstallReport:
    r"""What ``install``/``uninstall`` did (or, with ``dry_run``, would do), one row per entry."""

    command: str
    scope: str
    base: str
    agents: list[str]
    folders: list[str]
    dry_run: bool
    actions: list[Action] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    exit_code: int = 0

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for action in self.actions:
            counts[action.action] = counts.get(action.action, 0) + 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "scope": self.scope,
            "base": self.base,
            "agents": self.agents,
            "folders": self.folders,
            "dry_run": self.dry_run,
            "actions": [vars(a) for a in self.actions],
            "counts": self.counts(),
            "warnings": self.warnings,
            "notes": self.notes,
            "environment": environment_stamp(),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        dry = " --dry-run (nothing written)" if self.dry_run else ""
        head = (
            f"paritykit skills {self.command}{dry} for {', '.join(self.agents)} ({self.scope} scope,"
            f" {self.base})"
        )
        counts = ", ".join(f"{n} {name}" for name, n in self.counts().items()) or "nothing to do"
        summary = ("dry run, nothing written: " if self.dry_run else "") + counts
        rows = [(a.action, a.path, a.detail) for a in self.actions]
        lines = [head]
        lines.append(
            render_table(("action", "path", "detail"), rows, limit=limit, summary=summary)
            if rows
            else summary
        )
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def detect_agents(environ: Mapping[str, str] | None = None) -> list[str]:
    r"""The agents whose environment variables are set (Claude Code, Codex); claude and codex when none is."""
    env = os.environ if environ is None else environ
    found = []
    if any(v and (k == "CLAUDECODE" or k.startswith("CLAUDE_CODE")) for k, v in env.items()):
        found.append("claude")
    if any(v and k.startswith("CODEX_") for k, v in env.items()):
        found.append("codex")
    return found or ["claude", "codex"]


def resolve_agents(selected: Iterable[str] | None, *, default: Sequence[str]) -> list[str]:
    r"""Normalise ``--agent`` values (repeatable, comma-separated, ``all``) to known agent names."""
    names = [n.strip().lower() for item in selected or () for n in item.split(",") if n.strip()]
    if not names:
        return list(default)
    unknown = [n for n in names if n != "all" and n not in AGENTS]
    if unknown:
        raise ParityKitError(f"--agent {unknown[0]!r} is not one of: {', '.join(AGENTS)}, all")
    if "all" in names:
        return list(AGENTS)
    return list(dict.fromkeys(names))


def install(
    agents: Iterable[str] | None = None,
    *,
    target: str | os.PathLike | None = None,
    user_scope: bool = False,
    copy: bool = False,
    force: bool = False,
    skip_existing: bool = False,
    dry_run: bool = False,
    pack: str | os.PathLike | None = None,
    home: str | os.PathLike | None = None,
) -> InstallReport:
    r"""Install every skill of the pack where the given agents look for skills.

    Args:
        agents: agent names or ``"all"``; default: the agent named by the environment, else claude and codex.
        target: repository to install into (project scope); default: the git root above the working directory.
        user_scope: install into the user's folders under ``home`` instead (``--global``).
        copy: copy the skill folders instead of linking them (also the fallback when a link cannot be made).
        force: replace same-name skills that are not ours, moving each aside to ``paritykit-backups/``.
        skip_existing: leave same-name skills that are not ours alone and install the rest.
        dry_run: report what would happen, write nothing.
        pack: skills folder to install (default: this installation's pack).
        home: the user's home folder for ``user_scope`` (default: ``Path.home()``).

    Returns:
        An ``InstallReport``. Raises ``ParityKitError`` (nothing written) on a conflict or a symlinked skills
        folder.
    """
    if force and skip_existing:
        raise ParityKitError("--force and --skip-existing exclude each other; pick one")
    ctx = _Context.make(resolve_agents(agents, default=detect_agents()), target, user_scope, pack, home)
    report = ctx.report("install", dry_run)
    skills = find_skills(ctx.pack)
    if not skills:
        raise ParityKitError(f"{ctx.pack}: the pack has no skills to install")

    plans = [
        _plan_install(ctx, folder, agents_here, skills, copy, force, skip_existing)
        for folder, agents_here in ctx.folders.items()
    ]
    refusals = [p.refusal for p in plans if p.refusal]
    conflicts = [c for p in plans for c in p.conflicts]
    if (refusals or conflicts) and not dry_run:
        raise ParityKitError(_refusal_message(refusals, conflicts, ctx))
    for plan in plans:
        plan.run(report, dry_run)
    if refusals or conflicts:
        # A dry run shows the whole plan, conflicts included, and fails the way the real install would.
        report.warnings.append(_refusal_message(refusals, conflicts, ctx, "the install would stop here"))
        report.exit_code = 1
    if not ctx.this_checkout and not user_scope:
        report.notes.append(
            "instruction files (CLAUDE.md, AGENTS.md) are left alone outside paritykit's own checkout"
        )
    report.notes += _install_advice(ctx, report, copy)
    return report


def _install_advice(ctx: _Context, report: InstallReport, copy: bool) -> list[str]:
    r"""What to know about what was made: keeping it out of ``git status``, and links versus copies."""
    notes = []
    made = {a.action for a in report.actions} & {"linked", "copied", "adopted", "unchanged", "replaced"}
    if not made:
        return notes
    exclude = ctx.base / ".git" / "info" / "exclude"
    if not ctx.user_scope and (ctx.base / ".git").is_dir():
        listed = exclude.read_text(errors="replace").splitlines() if exclude.is_file() else []
        missing = [f"/{f.rstrip('/')}/" for f in report.folders if f"/{f.rstrip('/')}/" not in listed]
        if missing:
            notes.append(
                f"to keep them out of `git status` without touching .gitignore, add {' and '.join(missing)}"
                " to .git/info/exclude (local to this clone, never committed)"
            )
    if not copy:
        notes.append(
            f"the links point into {ctx.pack}: if that clone or virtual environment moves or is deleted they "
            "break; install with --copy for standalone copies (install again to update them)"
        )
    return notes


def uninstall(
    agents: Iterable[str] | None = None,
    *,
    target: str | os.PathLike | None = None,
    user_scope: bool = False,
    dry_run: bool = False,
    pack: str | os.PathLike | None = None,
    home: str | os.PathLike | None = None,
) -> InstallReport:
    r"""Remove what ``install`` made, and only that.

    Entries listed in a manifest are removed while they are still as they were made (a link with the same
    target, a copy with the same content hash); an edited copy is kept with a warning. Links into the pack
    that have no manifest entry (made by an older ``make claude``) are removed too. A folder moved aside by
    ``--force`` is put back. Empty folders the install created are removed. Arguments as for ``install``;
    default agents: all."""
    ctx = _Context.make(resolve_agents(agents, default=AGENTS), target, user_scope, pack, home)
    report = ctx.report("uninstall", dry_run)
    for folder, agents_here in ctx.folders.items():
        _plan_uninstall(ctx, folder, agents_here).run(report, dry_run)
    return report


@dataclass
class _Context:
    agents: list[str]
    base: Path
    user_scope: bool
    pack: Path
    folders: dict[Path, list[str]]  # agent skills folder -> agents that read it
    this_checkout: bool  # installing into paritykit's own repository: instruction files may be linked

    @classmethod
    def make(cls, agents, target, user_scope, pack, home) -> _Context:
        if target is not None and user_scope:
            raise ParityKitError("--target and --global exclude each other; pick one")
        pack = Path(os.path.realpath(pack if pack is not None else pack_dir()))
        if user_scope:
            base = Path(home) if home is not None else Path.home()
        elif target is not None:
            base = Path(target)
            if not base.is_dir():
                raise ParityKitError(f"--target {target}: no such folder")
        else:
            base = _repository_root(Path.cwd())
        base = Path(os.path.realpath(base))
        table = USER_FOLDERS if user_scope else PROJECT_FOLDERS
        folders: dict[Path, list[str]] = {}
        for agent in agents:
            folders.setdefault(base / table[agent], []).append(agent)
        this_checkout = not user_scope and base == pack.parent and (base / INSTRUCTIONS_SOURCE).is_file()
        return cls(agents, base, user_scope, pack, folders, this_checkout)

    def report(self, command: str, dry_run: bool) -> InstallReport:
        return InstallReport(
            command=command,
            scope="user" if self.user_scope else "project",
            base=str(self.base),
            agents=self.agents,
            folders=[self.show(f) for f in self.folders],
            dry_run=dry_run,
        )

    def show(self, path: Path | str) -> str:
        rel = os.path.relpath(path, self.base)
        return os.path.join("~", rel) if self.user_scope else rel

    def points_into_pack(self, link: Path) -> bool:
        r"""Whether a symlink leads into the pack (checked on its text too, so a dangling one counts)."""
        lexical = os.path.normpath(os.path.join(os.path.realpath(link.parent), os.readlink(link)))
        return is_within(lexical, str(self.pack)) or is_within(os.path.realpath(link), str(self.pack))


def _repository_root(start: Path) -> Path:
    for folder in (start, *start.parents):
        if (folder / ".git").exists():
            return folder
    return start


def _refusal_message(
    refusals: list[str],
    conflicts: list[str],
    ctx: _Context,
    lead: str = "refusing to install, nothing was changed",
) -> str:
    parts = list(refusals)
    if conflicts:
        parts.append(
            f"{', '.join(conflicts)} already exist{'s' if len(conflicts) == 1 else ''} and"
            f" {'is' if len(conflicts) == 1 else 'are'} not paritykit's; rerun with --skip-existing to"
            f" install the other skills, or --force to replace {'it' if len(conflicts) == 1 else 'them'}"
            f" (moved aside to {BACKUP_FOLDER}/, never deleted)"
        )
    return f"{lead}: " + "; ".join(parts)


def _tree_hash(path: Path) -> str:
    r"""A content hash of a folder: names, file bytes and symlink targets (caches ignored)."""
    digest = hashlib.sha256()
    for directory, subdirs, files in os.walk(path):
        subdirs[:] = sorted(d for d in subdirs if d not in _HASH_IGNORED)
        rel_dir = os.path.relpath(directory, path)
        digest.update(f"D {rel_dir}\n".encode())
        for name in sorted(f for f in files if f not in _HASH_IGNORED):
            full = os.path.join(directory, name)
            rel = os.path.join(rel_dir, name)
            if os.path.islink(full):
                digest.update(f"L {rel} {os.readlink(full)}\n".encode())
            else:
                with open(full, "rb") as handle:
                    digest.update(f"F {rel} {hashlib.sha256(handle.read()).hexdigest()}\n".encode())
        for name in subdirs:  # symlinked folders are not walked; record where they point
            full = os.path.join(directory, name)
            if os.path.islink(full):
                digest.update(f"L {os.path.join(rel_dir, name)} {os.readlink(full)}\n".encode())
    return "sha256:" + digest.hexdigest()


def _describe(path: Path) -> str:
    if path.is_symlink():
        return f"a symlink to {os.readlink(path)}"
    return "a folder" if path.is_dir() else "a file"


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST_NAME
    if not path.is_file() or folder.is_symlink():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
            raise ValueError("no 'entries' list")
        return data
    except (OSError, ValueError) as exc:
        raise ParityKitError(f"{path}: unreadable paritykit manifest ({exc}); fix or delete it") from exc


def _write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    path = folder / MANIFEST_NAME
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return  # idempotent: an unchanged manifest is not rewritten
    atomic_write_text(path, text)


def _entry_is_intact(path: Path, entry: Mapping[str, Any]) -> bool:
    r"""Whether a manifest entry is still exactly as paritykit made it."""
    if entry.get("kind") == "link":
        return path.is_symlink() and os.readlink(path) == entry.get("target")
    if entry.get("kind") == "copy":
        return path.is_dir() and not path.is_symlink() and _tree_hash(path) == entry.get("hash")
    return False


def _remove_ours(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path)


def _backup_path(folder: Path, name: str) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    candidate = folder.parent / BACKUP_FOLDER / f"{name}-{stamp}"
    n = 1
    while os.path.lexists(candidate):
        candidate = folder.parent / BACKUP_FOLDER / f"{name}-{stamp}-{n}"
        n += 1
    return candidate


@dataclass
class _Plan:
    r"""Everything one agent skills folder needs, decided before anything is written."""

    ctx: _Context
    folder: Path
    manifest: dict[str, Any]
    entries: dict[str, dict[str, Any]]
    steps: list[tuple[Action, Callable[[], None] | None]] = field(default_factory=list)
    create: list[Path] = field(default_factory=list)  # folders to make first, outermost first
    conflicts: list[str] = field(default_factory=list)
    refusal: str | None = None
    warnings: list[str] = field(default_factory=list)
    remove_manifest: bool = False
    prune: list[Path] = field(
        default_factory=list
    )  # folders to remove at the end when empty, innermost first

    def step(self, action: str, path: Path, detail: str = "", run: Callable[[], None] | None = None) -> None:
        self.steps.append((Action(action, self.ctx.show(path), detail), run))

    def run(self, report: InstallReport, dry_run: bool) -> None:
        report.actions.extend(action for action, _ in self.steps)
        if dry_run:
            report.warnings.extend(self.warnings)
            return
        if any(run is not None for _, run in self.steps) or self.entries:
            for folder in self.create:
                folder.mkdir(exist_ok=True)
        for _, run in self.steps:
            if run is not None:
                run()
        manifest_path = self.folder / MANIFEST_NAME
        if self.entries and not self.remove_manifest:
            self.manifest["entries"] = [self.entries[k] for k in sorted(self.entries)]
            _write_manifest(self.folder, self.manifest)
        elif manifest_path.is_file() and not self.folder.is_symlink():
            manifest_path.unlink()
        for folder in self.prune:
            try:
                folder.rmdir()
            except OSError:
                pass  # not empty (the user's files are there), or already gone
        # Warnings last: running a step may add one (a link that fell back to a copy).
        report.warnings.extend(self.warnings)


def _folder_chain(ctx: _Context, folder: Path) -> list[Path]:
    r"""The folders from just below the base down to the agent skills folder."""
    rel = folder.relative_to(ctx.base)
    return [ctx.base.joinpath(*rel.parts[: i + 1]) for i in range(len(rel.parts))]


def _folder_refusal(ctx: _Context, folder: Path) -> str | None:
    chain = _folder_chain(ctx, folder)
    # In user scope a symlinked ~/.config is a common dotfiles set-up; only the skills folder itself matters.
    checked = chain if not ctx.user_scope else chain[-1:]
    for part in checked:
        if part.is_symlink():
            return (
                f"{ctx.show(part)} is a symlink (to {os.readlink(part)}), and writing through it would change"
                " the files it points to; replace it with a real folder, or install elsewhere (--target,"
                " --global)"
            )
        if os.path.lexists(part) and not part.is_dir():
            return f"{ctx.show(part)} is a file where a folder is needed"
    return None


def _plan_install(
    ctx: _Context,
    folder: Path,
    agents_here: list[str],
    skills: list[Path],
    copy: bool,
    force: bool,
    skip: bool,
) -> _Plan:
    refusal = _folder_refusal(ctx, folder)
    old = None if refusal else _read_manifest(folder)
    manifest = dict(old or {"tool": "paritykit", "schema_version": 1, "entries": []})
    manifest["pack"] = str(ctx.pack)
    entries = {e["path"]: dict(e) for e in manifest.get("entries", []) if isinstance(e, dict) and "path" in e}
    plan = _Plan(ctx, folder, manifest, entries, refusal=refusal)
    if refusal:
        return plan
    chain = _folder_chain(ctx, folder)
    plan.create = [p for p in chain if not p.exists()]
    if plan.create:
        # Recorded so uninstall removes only the empty folders that the install made.
        created = {os.path.relpath(p, folder) for p in plan.create} | set(manifest.get("created", []))
        manifest["created"] = sorted(created, key=len)
    real_folder = os.path.realpath(folder)

    for source in skills:
        name = source.name
        dest = folder / name
        entry = entries.get(name)
        link_target = os.path.relpath(source, real_folder)
        state = _classify(ctx, dest, entry, source)
        if state == "current-link" and not copy:
            current = os.readlink(dest)
            if entry is None or entry.get("kind") != "link" or entry.get("target") != current:
                entries[name] = {**(entry or {}), "path": name, "kind": "link", "target": current}
                entries[name].pop("hash", None)
                plan.step("adopted", dest, f"existing link -> {current} recorded as paritykit's")
            else:
                plan.step("unchanged", dest, f"-> {current}")
            continue
        if state == "current-copy" and copy and entry and entry.get("hash") == _tree_hash(source):
            plan.step("unchanged", dest, "copy up to date")
            continue
        if state in ("foreign", "edited-copy"):
            what = "a copy paritykit made, edited since" if state == "edited-copy" else _describe(dest)
            if skip:
                plan.step("skipped", dest, f"not paritykit's ({what}); --skip-existing")
                entries.pop(name, None)
                continue
            if not force:
                plan.conflicts.append(f"{ctx.show(dest)} ({what})")
                plan.step("conflict", dest, f"not paritykit's ({what}); --skip-existing or --force")
                continue
            backup = _backup_path(folder, name)
            plan.step("backed-up", dest, f"moved to {ctx.show(backup)}", _mover(dest, backup))
            entries.pop(name, None)
            plan.step(*_creation(plan, source, dest, name, link_target, copy, backup=backup))
            continue
        if state in ("current-link", "stale-link", "current-copy"):
            plan.step("replaced", dest, "paritykit's previous entry", _remover(dest))
            backup_rel = (entry or {}).get("backup")
            plan.step(
                *_creation(
                    plan,
                    source,
                    dest,
                    name,
                    link_target,
                    copy,
                    backup=folder / backup_rel if backup_rel else None,
                )
            )
            continue
        plan.step(*_creation(plan, source, dest, name, link_target, copy))

    # Entries for skills that left the pack (renamed or removed): sweep them while they are intact.
    pack_names = {s.name for s in skills}
    for path, entry in list(entries.items()):
        if entry.get("role") == "instructions" or path in pack_names:
            continue
        dest = folder / path
        if _entry_is_intact(dest, entry):
            plan.step("removed", dest, "no longer in the pack", _remover(dest))
        elif os.path.lexists(dest):
            plan.warnings.append(f"{ctx.show(dest)} left the pack but was changed since install; kept")
        del entries[path]

    if ctx.this_checkout:
        for filename in dict.fromkeys(INSTRUCTION_FILES[a] for a in agents_here):
            _plan_instruction_link(plan, filename)
    return plan


def _classify(ctx: _Context, dest: Path, entry: Mapping[str, Any] | None, source: Path) -> str:
    r"""What is at ``dest`` now: absent, current-link, stale-link, current-copy, edited-copy or foreign."""
    if not os.path.lexists(dest):
        return "absent"
    if dest.is_symlink():
        ours = (entry is not None and _entry_is_intact(dest, entry)) or ctx.points_into_pack(dest)
        if not ours:
            return "foreign"
        return "current-link" if os.path.realpath(dest) == os.path.realpath(source) else "stale-link"
    if entry is not None and entry.get("kind") == "copy" and dest.is_dir():
        return "current-copy" if _entry_is_intact(dest, entry) else "edited-copy"
    return "foreign"


def _creation(
    plan: _Plan, source: Path, dest: Path, name: str, link_target: str, copy: bool, backup: Path | None = None
):
    r"""The (action, path, detail, run) of making one skill entry; the manifest entry is recorded by
    ``run``."""

    def run() -> None:
        entry: dict[str, Any] = {"path": name}
        if backup is not None:
            entry["backup"] = os.path.relpath(backup, plan.folder)
        if not copy:
            try:
                os.symlink(link_target, dest, target_is_directory=True)
                entry.update(kind="link", target=link_target)
                plan.entries[name] = entry
                return
            except (OSError, NotImplementedError) as exc:
                # Windows without symlink privilege, some network file systems: a copy still works.
                plan.warnings.append(f"could not link {plan.ctx.show(dest)} ({exc}); copied it instead")
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns(*_HASH_IGNORED))
        entry.update(kind="copy", hash=_tree_hash(dest))
        plan.entries[name] = entry

    if copy:
        return "copied", dest, f"from {source}", run
    return "linked", dest, f"-> {link_target}", run


def _remover(path: Path) -> Callable[[], None]:
    return lambda: _remove_ours(path)


def _mover(source: Path, dest: Path) -> Callable[[], None]:
    def run() -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(source, dest)

    return run


def _plan_instruction_link(plan: _Plan, filename: str) -> None:
    ctx = plan.ctx
    dest = ctx.base / filename
    key = os.path.relpath(dest, plan.folder)
    entry = plan.entries.get(key)
    source = ctx.base / INSTRUCTIONS_SOURCE
    if not os.path.lexists(dest):

        def run() -> None:
            try:
                os.symlink(INSTRUCTIONS_SOURCE, dest)
            except OSError as exc:
                plan.warnings.append(
                    f"could not link {filename} -> {INSTRUCTIONS_SOURCE} ({exc}); skipped it"
                )
                return
            plan.entries[key] = {
                "path": key,
                "kind": "link",
                "target": INSTRUCTIONS_SOURCE,
                "role": "instructions",
            }

        plan.step("linked", dest, f"-> {INSTRUCTIONS_SOURCE}", run)
    elif dest.is_symlink() and os.path.realpath(dest) == os.path.realpath(source):
        if entry is None:
            # Only paritykit's own checkout gets here, where these links are generated (and git-ignored).
            plan.entries[key] = {
                "path": key,
                "kind": "link",
                "target": os.readlink(dest),
                "role": "instructions",
            }
            plan.step("adopted", dest, f"existing link -> {os.readlink(dest)} recorded as paritykit's")
        else:
            plan.step("unchanged", dest, f"-> {os.readlink(dest)}")
    else:
        plan.entries.pop(key, None)
        plan.warnings.append(
            f"{filename} exists ({_describe(dest)}) and is not a link to {INSTRUCTIONS_SOURCE}; left"
            " untouched"
        )


def _plan_uninstall(ctx: _Context, folder: Path, agents_here: list[str]) -> _Plan:
    plan = _Plan(ctx, folder, {}, {})
    if folder.is_symlink():
        # An older installer's link of the whole skills folder into the pack is ours; anything else is not.
        if ctx.points_into_pack(folder):
            plan.step(
                "removed", folder, f"link of the whole folder -> {os.readlink(folder)}", _remover(folder)
            )
        else:
            plan.warnings.append(
                f"{ctx.show(folder)} is a symlink that paritykit did not make; left untouched"
            )
        return plan
    refusal = _folder_refusal(ctx, folder)
    if refusal or not folder.is_dir():
        if refusal and os.path.lexists(folder):
            plan.warnings.append(f"{ctx.show(folder)} skipped: {refusal}")
        _plan_legacy_instruction_removal(plan, agents_here)
        return plan
    manifest = _read_manifest(folder)
    entries = {
        e["path"]: e for e in (manifest or {}).get("entries", []) if isinstance(e, dict) and "path" in e
    }
    backups: set[Path] = set()
    for path, entry in sorted(entries.items()):
        dest = folder / path
        backup = folder / entry["backup"] if entry.get("backup") else None
        ours = _entry_is_intact(dest, entry) or (
            entry.get("kind") == "link" and dest.is_symlink() and ctx.points_into_pack(dest)
        )
        if ours:
            detail = f"-> {os.readlink(dest)}" if dest.is_symlink() else "unchanged copy"
            plan.step("removed", dest, detail, _remover(dest))
        elif os.path.lexists(dest):
            change = (
                "edited since paritykit copied it" if entry.get("kind") == "copy" else "changed since install"
            )
            plan.step("kept", dest, change)
            plan.warnings.append(
                f"{ctx.show(dest)} was {change}; kept it (delete it yourself if it is not needed)"
            )
        if backup is None or not os.path.lexists(backup):
            continue
        if ours or not os.path.lexists(dest):
            # The user's own folder that --force moved aside goes back where it was.
            plan.step("restored", dest, f"from {ctx.show(backup)}", _mover(backup, dest))
            backups.add(backup.parent)
        else:
            plan.warnings.append(f"the folder --force moved aside is still at {ctx.show(backup)}")
    # Links into the pack that no manifest lists: made by `make claude` before the installer existed.
    for child in sorted(folder.iterdir()):
        if child.name not in entries and child.is_symlink() and ctx.points_into_pack(child):
            plan.step("removed", child, f"-> {os.readlink(child)} (no manifest entry)", _remover(child))
    if manifest is None:
        _plan_legacy_instruction_removal(plan, agents_here)
    plan.remove_manifest = manifest is not None
    if manifest is not None:
        plan.step("removed", folder / MANIFEST_NAME, "manifest", None)
        created = {Path(os.path.normpath(folder / rel)) for rel in manifest.get("created", [])}
        plan.prune = [*sorted(backups), *sorted(created, key=lambda p: -len(p.parts))]
    return plan


def _plan_legacy_instruction_removal(plan: _Plan, agents_here: list[str]) -> None:
    r"""Instruction links to `.ai/AGENTS.md` in paritykit's own checkout that no manifest lists (older
    Makefile)."""
    ctx = plan.ctx
    if not ctx.this_checkout:
        return
    source = os.path.realpath(ctx.base / INSTRUCTIONS_SOURCE)
    for filename in dict.fromkeys(INSTRUCTION_FILES[a] for a in agents_here):
        dest = ctx.base / filename
        shown = {a.path for a, _ in plan.steps}
        if dest.is_symlink() and os.path.realpath(dest) == source and ctx.show(dest) not in shown:
            plan.step("removed", dest, f"-> {os.readlink(dest)} (no manifest entry)", _remover(dest))
