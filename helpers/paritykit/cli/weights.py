"""``paritykit weights diff|map``: checkpoint forensics.

``diff`` lives here; ``map`` (conversion inference) lives in :mod:`paritykit.cli.weights_map`. Each
sub-command is imported only when it runs, so ``weights diff --keys-only`` never pays for what ``map``
imports."""

from __future__ import annotations

import importlib
import os

import click

from paritykit.cli._common import emit, json_option, limit_option, map_option, note_same_path, require_paths

# name -> (module:attribute, one-line help shown without importing the module)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "diff": (
        "paritykit.cli.weights:diff",
        "Diff two checkpoints tensor by tensor (streams; --keys-only reads headers).",
    ),
    "map": (
        "paritykit.cli.weights_map:weights_map",
        "Infer the key mapping that converts one checkpoint into another.",
    ),
}


class _LazyWeightsGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        module_name, attr = SUBCOMMANDS[name][0].split(":")
        return getattr(importlib.import_module(module_name), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, SUBCOMMANDS[name][1]) for name in self.list_commands(ctx)])


@click.group("weights", cls=_LazyWeightsGroup)
def weights() -> None:
    """Diff two checkpoints, or infer the conversion between them."""


@click.command("diff")
@click.argument("a")
@click.argument("b")
@click.option(
    "--keys-only", is_flag=True, help="Compare keys, shapes and dtypes from the headers only (no torch)."
)
@click.option(
    "--metric",
    type=click.Choice(["l2", "l1", "cosine", "max_abs"]),
    default="l2",
    show_default=True,
    help="Distance summed per group, sorted by and plotted (l2, cosine and max_abs are always recorded).",
)
@click.option(
    "--group-by",
    type=click.Choice(["component", "kind", "both"]),
    default="component",
    show_default=True,
    help=(
        "Group by component (vae, text_encoder, diffusion_model, ema …), by kind (attention, norm …) or both."
    ),
)
@map_option
@click.option(
    "--plot", type=click.Path(dir_okay=False), help="Write one histogram panel per group to this PNG."
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
@json_option
@limit_option
def diff(a, b, keys_only, metric, group_by, maps, plot, quiet, as_json, limit) -> None:
    """Diff checkpoints A and B: .safetensors, sharded index, model/pipeline folder, or a pickled
    .ckpt/.pt/.bin.

    \b
    Values stream one tensor pair at a time (raw bytes first, then distances in chunks), so memory stays
    near a few chunk buffers whatever the size. Exit 0 identical, 1 differ, 2 bad input.
    Example (a text encoder saved under another prefix):
      paritykit weights diff a.ckpt b.safetensors --map
      '^cond_stage_model\\.transformer\\.(?!text_model)=cond_stage_model.transformer.text_model.'
    """
    require_paths(("A", a), ("B", b))
    from paritykit.base.naming import parse_map_options
    from paritykit.forensics.weights import plot_weights_diff, weights_diff

    # one worker thread per core is the parallelism here: OpenBLAS's own threads (numpy's dot products) only
    # contend with them, for 12 % more CPU time on the benchmark pair. Set before numpy is first imported.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    report = weights_diff(
        a,
        b,
        rules=parse_map_options(maps),
        metric=metric,
        group_by=group_by,
        keys_only=keys_only,
        progress=False if quiet else None,
    )
    if plot:
        if keys_only:
            raise click.UsageError("--plot needs values; drop --keys-only")
        plot_weights_diff(report, plot)
    note_same_path(a, b)
    emit(report, as_json=as_json, limit=limit)
