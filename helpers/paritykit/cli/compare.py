"""`paritykit compare`: two tensor files, folders or checkpoint folders, pair by pair."""

from __future__ import annotations

import click

from paritykit.cli._common import emit, json_option, limit_option, map_option, note_same_path, require_paths


@click.command()
@click.argument("a", metavar="A")
@click.argument("b", metavar="B")
@click.option(
    "--atol", type=float, default=None, help="Absolute tolerance (default: per dtype, torch.testing's table)."
)
@click.option(
    "--rtol", type=float, default=None, help="Relative tolerance, measured against B (default: per dtype)."
)
@map_option
@click.option(
    "--only", metavar="GLOB", default=None, help="Compare only names matching this glob (after --map)."
)
@click.option(
    "--broadcast", is_flag=True, help="Tile a side whose shape differs only by a repeated batch dimension."
)
@json_option
@limit_option
def compare(a, b, atol, rtol, maps, only, broadcast, as_json, limit) -> None:
    """Compare tensors of A (reference) and B (port): a file, a folder, or a save_checkpoints folder each.

    \b
    Pairs go by name in A's order (execution order for checkpoint folders, else natural sort); a pass means
    |a-b| <= atol + rtol*|b| everywhere. Prints a table, then the first divergence and its likely causes.
    Exit 0 all pass, 1 any fail / shape mismatch / one-sided name, 2 bad input.
    """
    require_paths(("A", a), ("B", b))
    from paritykit.compare.sets import compare_paths

    report = compare_paths(a, b, atol=atol, rtol=rtol, maps=maps, only=only, broadcast=broadcast)
    note_same_path(a, b)
    emit(report, as_json=as_json, limit=limit)
