"""`paritykit triage`: two sampling pipelines in, the cause out."""

from __future__ import annotations

import click

from paritykit.cli._common import emit, json_option, limit_option


@click.command(
    help=(
        "Run a reference sampling pipeline and its port from one seed, record every denoiser (and decoder)"
        " call, and name where the port first parts from the reference: the initial noise, the schedule, the"
        " conditioning, a denoiser module (bisected on that call's inputs), the sampler's update, the"
        " decoder's input scaling, the decoder (bisected), or the post-processing; each with its evidence, a"
        " verified fix when one is found, and the paritykit command that reproduces it alone.\n\nSPEC.py"
        " defines run_reference() and run_port() (each runs its side end to end and returns the result as a"
        " tensor), reference_denoiser() and port_denoiser() (the modules those runs call each step), and"
        " optionally reference_vae() / port_vae() (the decoder modules), port_scheduler() (for the schedule"
        " fit), TOLERANCE and SEED. `paritykit new triage-spec NAME` writes one.\n\nWith --all every place is"
        " checked on its own, the port's modules fed the reference's values at that point, so independent"
        " bugs are all named in one run.\n\nExit 0 match, 1 differ, 2 on bad input."
    )
)
@click.argument("spec", metavar="SPEC.py")
@click.option("--all", "all_causes", is_flag=True, help="Name every independent cause, not only the first.")
@click.option(
    "--out",
    default="triage-out",
    show_default=True,
    help="Folder for both sides' recordings and the files the reproduce commands read.",
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="torch's seed before each side runs (default: SPEC's SEED, else 0).",
)
@json_option
@limit_option
def triage(spec, all_causes, out, seed, as_json, limit) -> None:
    from paritykit.triage import triage_spec

    emit(triage_spec(spec, all_causes=all_causes, out=out, seed=seed), as_json=as_json, limit=limit)
