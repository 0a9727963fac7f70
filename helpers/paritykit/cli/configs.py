"""``paritykit config-diff A B``: a thin shell over :func:`paritykit.forensics.configs.config_diff`."""

from __future__ import annotations

import click

from paritykit.cli._common import emit, json_option, limit_option, map_option, note_same_path


@click.command("config-diff")
@click.argument("a")
@click.argument("b")
@click.option(
    "--ignore",
    "ignore",
    multiple=True,
    metavar="GLOB",
    help=(
        "Skip keys matching GLOB (dotted key or its last part, either side's name, before or after --map); "
        "repeatable."
    ),
)
@map_option
@click.option(
    "--ldm/--no-ldm",
    default=None,
    help=(
        "Read A, an original LDM YAML (model.params.unet_config / first_stage_config), as the diffusers"
        " config diffusers' single-file helpers derive from it. Default: when A is such a YAML and B is not."
    ),
)
@click.option(
    "--reference-keys", is_flag=True, help="Compare only the keys A has (after --map); list B's others."
)
@click.option(
    "--compare-defaults",
    is_flag=True,
    help="Count B-only keys at B's class default (otherwise listed as 'default, not compared').",
)
@click.option(
    "--with-defaults",
    is_flag=True,
    help="Fill in each side's class defaults for keys its file never wrote, marked '(default)'.",
)
@click.option(
    "--class",
    "class_name",
    metavar="NAME",
    help="B's class (e.g. DDIMScheduler, or module.Class) when its config has no _class_name.",
)
@click.option("--suggest-map", "suggest", is_flag=True, help="Propose --map renames for the unmatched keys.")
@json_option
@limit_option
def config_diff(
    a: str,
    b: str,
    ignore: tuple[str, ...],
    maps: tuple[str, ...],
    ldm: bool | None,
    reference_keys: bool,
    compare_defaults: bool,
    with_defaults: bool,
    class_name: str | None,
    suggest: bool,
    as_json: bool,
    limit: int,
) -> None:
    """Diff two configs key by key: config.json, model or pipeline folder, .safetensors metadata, YAML.

    \b
    Examples:
      paritykit config-diff ref/v1-inference.yaml port/unet
      paritykit config-diff ref/config.yaml port/unet --map '^model\\.params\\.=' --reference-keys
      paritykit config-diff ref/scheduler.json port/scheduler --with-defaults
      paritykit config-diff ref_pipeline/ port_pipeline/ --ignore _diffusers_version --ignore _name_or_path
    """
    from paritykit.base.naming import parse_map_options
    from paritykit.forensics.configs import config_diff as run

    report = run(
        a,
        b,
        ignore=ignore,
        rules=parse_map_options(maps),
        ldm=ldm,
        reference_keys=reference_keys,
        compare_defaults=compare_defaults,
        with_defaults=with_defaults,
        class_name=class_name,
        suggest=suggest,
    )
    note_same_path(a, b)
    emit(report, as_json=as_json, limit=limit)
