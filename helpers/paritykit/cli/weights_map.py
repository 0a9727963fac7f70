"""``paritykit weights map``: infer the conversion between two checkpoints from tensor values."""

from __future__ import annotations

from pathlib import Path

import click

from paritykit.base.errors import ParityKitError
from paritykit.cli._common import emit, json_option, limit_option, note_same_path, require_paths


@click.command("map")
@click.argument("source", type=click.Path(path_type=Path))
@click.argument("target", type=click.Path(path_type=Path))
@json_option
@click.option(
    "--emit-rules",
    "emit_rules_path",
    type=click.Path(dir_okay=False, path_type=Path),
    metavar="OUT.py",
    help="Write the inferred rules as a Python module with convert(state_dict) -> state_dict.",
)
@click.option("--force", is_flag=True, help="Let --emit-rules overwrite an existing file.")
@click.option(
    "--allow-ambiguous",
    is_flag=True,
    help=(
        "Accept sources guessed by names (equal values, nothing in the structure to choose): exit 0, "
        "and --emit-rules writes them with a GUESSED comment."
    ),
)
@limit_option
def weights_map(
    source: Path,
    target: Path,
    as_json: bool,
    emit_rules_path: Path | None,
    force: bool,
    allow_ambiguous: bool,
    limit: int,
) -> None:
    """Explain every TARGET tensor from SOURCE tensors by value; print the rules.

    SOURCE is the research checkpoint, TARGET the converted (e.g. diffusers)
    weights: .safetensors (or a sharded index), .pt/.pth/.bin/.ckpt, .npz, or
    a folder holding one.

    \b
    Ops found: identity, cast, transpose, permute, reshape, chunk (fused QKV),
    concat, swap_halves (shift/scale order), permute_rows (interleaved heads,
    rotary layouts). When several sources hold the same values (fresh init,
    EMA copies), structure decides: a sibling built the same way, the module
    the neighbours come from, live over EMA, the pattern of other layers.
    What structure cannot settle is AMBIGUOUS (every candidate in --json;
    the chosen one is a guess by names). Warnings: a fused split whose order
    contradicts the names (chunk 0 -> k_proj), a layer built differently.

    \b
    Exit codes: 0 every target explained, none guessed, no warning;
    1 unexplained, ambiguous (unless --allow-ambiguous) or a warning;
    2 bad input (also --emit-rules on an ambiguous map without the flag).
    """
    if force and emit_rules_path is None:
        raise ParityKitError("--force only applies together with --emit-rules OUT.py")
    if emit_rules_path is not None and emit_rules_path.exists() and not force:
        # refuse before the (possibly long) inference; emit_rules checks again before writing
        raise ParityKitError(
            f"--emit-rules {str(emit_rules_path)!r} already exists; pass --force to overwrite it"
        )

    require_paths(("SOURCE", source), ("TARGET", target))
    from paritykit.forensics.conversion.emit import emit_rules
    from paritykit.forensics.conversion.matching import infer_conversion_map

    report = infer_conversion_map(source, target, allow_ambiguous=allow_ambiguous)
    if emit_rules_path is not None:
        emit_rules(report, emit_rules_path, force=force)
    note_same_path(source, target)
    emit(report, as_json=as_json, limit=limit)
