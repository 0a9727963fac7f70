"""Options and output shared by the report commands, so every command spells them the same way."""

from __future__ import annotations

import sys
from typing import Any, Protocol

import click

from paritykit.base.report import DEFAULT_LIMIT, to_json, with_verdict


class Report(Protocol):
    """What a command's result object offers: one object, two faces."""

    exit_code: int

    def to_dict(self) -> dict[str, Any]: ...

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str: ...


json_option = click.option("--json", "as_json", is_flag=True, help="Print the full report as strict JSON.")
limit_option = click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=DEFAULT_LIMIT,
    show_default=True,
    help="Rows shown in the table (0 = all); --json is always complete.",
)
map_option = click.option(
    "--map",
    "maps",
    multiple=True,
    metavar="'REGEX=REPL'",
    help="Rename the FIRST argument's names into the second's naming (repeatable, applied in order).",
)


def require_paths(*named: tuple[str, Any]) -> None:
    r"""One line naming the first ``(argument, path)`` whose path does not exist, said before any heavy
    import (a missing file is reported in a fraction of a second, not after torch loads)."""
    import os

    from paritykit.base.errors import ParityKitError

    for name, path in named:
        if path is not None and not os.path.exists(path):
            raise ParityKitError(f"{name} {str(path)!r}: no such file or folder")


def note_same_path(a: Any, b: Any) -> None:
    r"""Say (on stderr, so JSON stays clean) when a two-path command was given one path twice: everything
    then agrees by construction, which is no evidence about a port."""
    import os

    try:
        same = os.path.samefile(a, b)
    except (OSError, TypeError, ValueError):
        return
    if same:
        click.echo(
            f"note: {a} and {b} are the same path: it is compared with itself, so agreement here is no"
            " evidence about a port",
            err=True,
        )


# the lines of a report's first screen that --json repeats as "answer"
SUMMARY_LINES = 10


def emit(report: Report, *, as_json: bool, limit: int | None = DEFAULT_LIMIT) -> None:
    """Print a report as a table or JSON, then exit with its code (0 same, 1 differ).

    Every JSON report carries ``verdict`` and ``passed`` (from the exit code), added here so that no command,
    old or new, can leave them out."""
    if as_json:
        payload = with_verdict(report.to_dict(), report.exit_code)
        # the answer first in JSON too: the first screen's lines as "answer", right after verdict and passed
        summary = [line for line in report.render(limit=None).splitlines()[:SUMMARY_LINES] if line.strip()]
        head = {key: payload.pop(key) for key in ("verdict", "passed") if key in payload}
        click.echo(to_json({**head, "answer": summary, **payload}))
    else:
        click.echo(report.render(limit=limit or None))
    sys.exit(report.exit_code)
