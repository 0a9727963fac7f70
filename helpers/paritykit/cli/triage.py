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
        " checked on its own, the port's modules fed the reference's values at that point; it counts the"
        " places that differ, never causes. The verdict is the result's: a run whose result matches is a"
        " match, and what differs inside it is listed.\n\nExit 0 match, 1 differ, 2 on bad input."
    )
)
@click.argument("spec", metavar="[SPEC.py]", required=False)
@click.option(
    "--run-reference", metavar="MODULE:FUNCTION", help="No SPEC file: runs the reference, returns its result."
)
@click.option(
    "--run-port", metavar="MODULE:FUNCTION", help="No SPEC file: runs the port, returns its result."
)
@click.option(
    "--reference-denoiser", metavar="MODULE:FUNCTION", help="No SPEC file: returns the reference's denoiser."
)
@click.option("--port-denoiser", metavar="MODULE:FUNCTION", help="No SPEC file: returns the port's denoiser.")
@click.option(
    "--reference-vae", metavar="MODULE:FUNCTION", help="No SPEC file: returns the reference's decoder module."
)
@click.option(
    "--port-vae", metavar="MODULE:FUNCTION", help="No SPEC file: returns the port's decoder module."
)
@click.option(
    "--port-scheduler", metavar="MODULE:FUNCTION", help="No SPEC file: returns the port's scheduler object."
)
@click.option(
    "--reference-script",
    metavar="SCRIPT.py",
    help=(
        "No SPEC file: the reference's sampling script, run as `python SCRIPT` would from here; its denoiser"
        " is"
        " the module it calls more than once from outside any other module (the largest), its result the last"
        " tensor it saves."
    ),
)
@click.option(
    "--port-script", metavar="SCRIPT.py", help="No SPEC file: the port's script, read the same way."
)
@click.option(
    "--all",
    "all_causes",
    is_flag=True,
    help="Check every place on its own, not only up to the first that differs.",
)
@click.option(
    "--out",
    default="triage-out",
    show_default=True,
    help=(
        "Folder for both sides' recordings and the files the reproduce commands read (without a SPEC file,"
        " also the triage_spec.py the run writes from the callables)."
    ),
)
@click.option(
    "--seed",
    type=int,
    default=None,
    help="torch's seed before each side runs (default: SPEC's SEED, else 0).",
)
@json_option
@limit_option
def triage(spec, all_causes, out, seed, as_json, limit, reference_script, port_script, **callables) -> None:
    from paritykit.base.errors import ParityKitError

    given = {name: value for name, value in callables.items() if value}
    scripts = [s for s in (reference_script, port_script) if s]
    if sum(map(bool, (spec is not None, given, scripts))) > 1:
        raise ParityKitError(
            "give one of SPEC.py, the --run-…/--…-denoiser callables, or the two --…-script files"
        )
    if spec is None and not given and not scripts:
        raise click.UsageError(
            "give SPEC.py, or --reference-script and --port-script, or --run-reference, --run-port,"
            " --reference-denoiser, --port-denoiser"
        )
    if scripts and len(scripts) != 2:
        raise ParityKitError("give both --reference-script and --port-script")
    if scripts:  # a missing script is one line before torch is imported
        from paritykit.triage.scripts import check_script

        check_script(reference_script, "--reference-script")
        check_script(port_script, "--port-script")
    from paritykit.triage import triage_spec

    written = None
    if given:
        from paritykit.triage.spec import spec_from_callables

        spec = written = spec_from_callables(out, **given)
    if scripts:
        from paritykit.triage.spec import spec_from_scripts

        spec = written = spec_from_scripts(out, reference_script, port_script)
    report = triage_spec(spec, all_causes=all_causes, out=out, seed=seed)
    report.spec_written = str(written) if written is not None else ""
    emit(report, as_json=as_json, limit=limit)
