"""``paritykit config-diff A B``: a thin shell over :func:`paritykit.configs.config_diff`."""

from __future__ import annotations

import click

from paritykit.cli._common import emit, json_option, limit_option, map_option


@click.command("config-diff")
@click.argument("a")
@click.argument("b")
@click.option(
    "--ignore",
    "ignore",
    multiple=True,
    metavar="GLOB",
    help="Skip keys matching GLOB (dotted key or its last part, e.g. _diffusers_version); repeatable.",
)
@map_option
@json_option
@limit_option
def config_diff(
    a: str, b: str, ignore: tuple[str, ...], maps: tuple[str, ...], as_json: bool, limit: int
) -> None:
    """Diff two configs key by key: config.json, model or pipeline folder, .safetensors metadata, YAML.

    \b
    Examples:
      paritykit config-diff ref/v1-inference.yaml port/unet --map '^model\\.params\\.unet_config\\.params\\.='
      paritykit config-diff ref_pipeline/ port_pipeline/ --ignore _diffusers_version --ignore _name_or_path
    """
    from paritykit.configs import config_diff as run
    from paritykit.naming import parse_map_options

    report = run(a, b, ignore=ignore, rules=parse_map_options(maps))
    emit(report, as_json=as_json, limit=limit)
