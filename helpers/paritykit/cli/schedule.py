"""`paritykit schedule`: compare two sampling schedules, or fit a diffusers scheduler config to a
reference."""

from __future__ import annotations

import re
from pathlib import Path

import click

from paritykit.base.errors import ParityKitError
from paritykit.cli._common import emit, json_option, limit_option, require_paths


@click.command(
    help=(
        "Compare two sampling schedules, or find the scheduler config that reproduces one.\n\nREF and PORT"
        " are each a checkpoint folder (its preloop checkpoint's timesteps/sigmas, e.g. written by"
        " paritykit.record_loop), a tensor file (.safetensors, .pt, .npy; keys timesteps/sigmas), or a .json"
        " list or object. Diagnoses: a constant offset (steps_offset), the spacing each side follows (leading"
        " / trailing / linspace), a different count (an extra final step, a final sigma 0), Karras /"
        " exponential / shifted flow-matching sigmas (with the fitted shift and where its range ends: a shift"
        " applied twice), whole vs fractional timesteps, reversed order.\n\nWith --fit CLASS (no PORT):"
        " search the keys CLASS accepts for configs whose set_timesteps reproduces REF at --steps and at"
        " three or more other counts (some not dividing num_train_timesteps), and print the fix as a ready"
        " from_config line. REF may also be a SPEC .py defining ref_schedule(n) (a list of timesteps, or a"
        " dict with timesteps and/or sigmas) and ref_step(x, eps, t, t_prev) (t: a timestep, or a sigma when"
        " the schedule has sigmas only; t_prev is None at the last step); ref_schedule(n, image_seq_len) for"
        " a schedule that depends on the image size (with --image-seq-len), or SIZE=PATH,SIZE=PATH: the"
        " reference recorded at two or more image sizes. The search covers the set_timesteps call too"
        " (sigmas=np.linspace(1, 1/n, n), mu= with use_dynamic_shifting, the reference's own lists), every"
        " fit states its residual, and with no fit the nearest candidate's remaining differences and the"
        " other classes that reproduce REF are named. --step-check also verifies step() against the"
        " reference's update (SPEC's ref_step, or --step-check FOLDER: the reference's preloop /"
        " after_step_<i> latents and model output, or a record_loop folder).\n\nExit 0 same / fit found, 1"
        " differ / no fit, 2 on bad input."
    )
)
@click.argument("ref")
@click.argument("port", required=False)
@click.option(
    "--fit", "fit_class", metavar="SchedulerClass", help="Fit this diffusers scheduler class to REF."
)
@click.option("--config", "config", metavar="JSON", help="The port's scheduler config (with --fit).")
@click.option("--steps", type=click.IntRange(min=2), help="Step count for --fit (default: REF's).")
@click.option(
    "--step-check",
    "step_check",
    is_flag=False,
    flag_value="SPEC",
    default=None,
    metavar="[FOLDER]",
    help="With --fit: verify step() too (REF's ref_step, or a reference checkpoint folder).",
)
@click.option(
    "--image-seq-len",
    "image_seq_len",
    metavar="L1,L2",
    help=(
        "With --fit and a SPEC whose ref_schedule(n, image_seq_len) depends on the image size: the sizes"
        " (latent tokens) to fit at; mu is then reported as a function of the size."
    ),
)
@click.option(
    "--port-run",
    "port_run",
    metavar="FOLDER",
    help=(
        "With --fit: the port's own recorded run; the set_timesteps call (and mu) that reproduces it with"
        " --config is how the port's pipeline calls its scheduler, and the fit keeps that call."
    ),
)
@click.option(
    "--seq-len",
    "seq_len",
    type=click.IntRange(min=1),
    help="With --fit --port-run and a dynamically shifting --config: the run's image size in latent tokens.",
)
@click.option(
    "--num-train-timesteps",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Training schedule length, for recognising the spacing.",
)
@json_option
@limit_option
def schedule(
    ref,
    port,
    fit_class,
    config,
    steps,
    step_check,
    image_seq_len,
    port_run,
    seq_len,
    num_train_timesteps,
    as_json,
    limit,
):
    sized = not Path(ref).exists() and re.fullmatch(r"\d+=[^,]+(,\d+=[^,]+)*", ref)
    require_paths(
        *((("REF", ref),) if not sized else (("REF", path.split("=", 1)[1]) for path in ref.split(","))),
        ("PORT", port),
        ("--config", config),
        ("--port-run", port_run),
    )
    from paritykit.schedule.compare import compare_schedules
    from paritykit.schedule.fit import fit_scheduler

    if fit_class:
        if port:
            raise ParityKitError("give REF and PORT to compare, or REF with --fit, not both")
        check = True if step_check == "SPEC" else step_check
        sizes = _sizes(image_seq_len) if image_seq_len else None
        result = fit_scheduler(
            fit_class,
            _recordings(ref),
            steps=steps,
            base_config=config,
            step_check=check,
            image_seq_len=sizes,
            port=port_run,
            seq_len=seq_len,
        )
    else:
        if not port:
            raise ParityKitError("PORT: missing (or use --fit SchedulerClass)")
        for name, value in (
            ("--config", config),
            ("--steps", steps),
            ("--step-check", step_check),
            ("--image-seq-len", image_seq_len),
            ("--port-run", port_run),
            ("--seq-len", seq_len),
        ):
            if value is not None:
                raise ParityKitError(f"{name}: only with --fit")
        result = compare_schedules(ref, port, num_train_timesteps=num_train_timesteps)
    emit(result, as_json=as_json, limit=limit)


def _recordings(ref: str) -> str | dict[int, str]:
    r"""``SIZE=PATH,SIZE=PATH`` (a reference recorded at several image sizes) as ``{size: path}``; any other
    REF, or an existing path that merely looks like one, as given."""
    from pathlib import Path

    if Path(ref).exists() or not re.fullmatch(r"\d+=[^,]+(,\d+=[^,]+)*", ref):
        return ref
    pairs = [part.split("=", 1) for part in ref.split(",")]
    if len({size for size, _ in pairs}) != len(pairs):
        raise ParityKitError(f"REF {ref!r}: a size is given twice")
    return {int(size): path for size, path in pairs}


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ParityKitError(
            f"--image-seq-len {text!r}: expected whole numbers separated by commas"
        ) from None
    if any(v < 1 for v in sizes):
        raise ParityKitError(f"--image-seq-len {text!r}: sizes are positive token counts")
    return sizes
