"""`paritykit skills`: list, show, validate, install and uninstall the agent skill pack (torch-free)."""

from __future__ import annotations

import click

from paritykit.cli._common import emit, json_option, limit_option

AGENT_CHOICES = "claude, codex, cursor, gemini, copilot, opencode, all"


def _agent_option(verb: str):
    return click.option(
        "--agent",
        "agents",
        multiple=True,
        metavar="AGENT",
        help=f"Agent to {verb} for (repeatable or comma-separated): {AGENT_CHOICES}.",
    )


_global_option = click.option(
    "--global",
    "user_scope",
    is_flag=True,
    help="Use the user-scope folders under HOME instead of a repository.",
)
_install_target_option = click.option(
    "--target",
    type=click.Path(file_okay=False),
    help=(
        "Repository to install into (default: the git root above the current folder). Only paritykit's own "
        "checkout gets CLAUDE.md/AGENTS.md links to .ai/AGENTS.md; another repository's are never touched."
    ),
)
_uninstall_target_option = click.option(
    "--target",
    type=click.Path(file_okay=False),
    help="Repository to uninstall from (default: the git root above the current folder).",
)
_dry_run_option = click.option("--dry-run", is_flag=True, help="Show what would change; write nothing.")


@click.group()
def skills() -> None:
    """List, show, validate and install the agent skill pack.

    \b
    Install makes one relative symlink per skill folder where each agent looks:
      claude                                 .claude/skills/<skill>
      codex, cursor, gemini, copilot,        .agents/skills/<skill>
      opencode
    With --global: ~/.claude/skills (claude), ~/.cursor/skills (cursor), ~/.agents/skills (the others).
    A manifest (.paritykit-manifest.json) records what was made; uninstall removes only that.
    """


@skills.command("list")
@json_option
@limit_option
def list_command(as_json: bool, limit: int) -> None:
    """Each skill of the pack with its one-line description."""
    from paritykit.pack.skills import list_skills

    emit(list_skills(), as_json=as_json, limit=limit)


@skills.command("show")
@click.argument("name")
def show_command(name: str) -> None:
    """Print one skill's SKILL.md (for agents without skill support)."""
    from paritykit.pack.skills import show_skill

    click.echo(show_skill(name), nl=False)


@skills.command("validate", short_help="Check skills against the agentskills.io rules.")
@click.argument("paths", nargs=-1, type=click.Path())
@json_option
@limit_option
def validate_command(paths: tuple[str, ...], as_json: bool, limit: int) -> None:
    """Check skills against the agentskills.io rules (default: the pack).

    PATHS may be skill folders, SKILL.md files or folders of skills. Exit 0 when every skill passes, 1 when a
    rule is broken, 2 when a path does not exist.
    """
    from paritykit.pack.skill_check import validate

    emit(validate(list(paths) or None), as_json=as_json, limit=limit)


@skills.command("install", short_help="Link (or copy) every skill where the agents look.")
@_agent_option("install")
@_global_option
@_install_target_option
@click.option(
    "--copy",
    is_flag=True,
    help=(
        "Copy the skill folders instead of linking them: better when the pack's folder (a clone, a venv) may "
        "move or be deleted, which breaks links; copies are updated by installing again."
    ),
)
@click.option(
    "--force",
    is_flag=True,
    help=(
        "Replace a same-name skill that is not paritykit's; it is moved to paritykit-backups/, never deleted."
    ),
)
@click.option(
    "--skip-existing", is_flag=True, help="Leave same-name skills that are not paritykit's; install the rest."
)
@_dry_run_option
@json_option
@limit_option
def install_command(
    agents: tuple[str, ...],
    user_scope: bool,
    target: str | None,
    copy: bool,
    force: bool,
    skip_existing: bool,
    dry_run: bool,
    as_json: bool,
    limit: int,
) -> None:
    """Install the pack for coding agents, never overwriting a user's skill.

    Without --agent: the agent named by the environment (Claude Code, Codex), else claude and codex.
    Everything is checked before anything is written: a same-name skill that is not paritykit's, or a skills
    folder that is itself a symlink, stops the install with exit 2 and nothing changed (with --dry-run: the
    plan is shown with its conflicts, exit 1)."""
    from paritykit.pack.installer import install

    report = install(
        agents,
        target=target,
        user_scope=user_scope,
        copy=copy,
        force=force,
        skip_existing=skip_existing,
        dry_run=dry_run,
    )
    emit(report, as_json=as_json, limit=limit)


@skills.command("uninstall", short_help="Remove what install made, and only that.")
@_agent_option("uninstall")
@_global_option
@_uninstall_target_option
@_dry_run_option
@json_option
@limit_option
def uninstall_command(
    agents: tuple[str, ...], user_scope: bool, target: str | None, dry_run: bool, as_json: bool, limit: int
) -> None:
    """Remove what install made, and only that (default: every agent's folder).

    Links and unchanged copies recorded in the manifest are removed, as are links into the pack left by an
    older `make claude`; an edited copy is kept with a warning; a folder moved aside by --force is put back.
    """
    from paritykit.pack.installer import uninstall

    emit(
        uninstall(agents, target=target, user_scope=user_scope, dry_run=dry_run), as_json=as_json, limit=limit
    )
