"""`paritykit steps` and `paritykit images`: per-step error curves and side-by-side visual checks."""

from __future__ import annotations

import click

from paritykit.cli._common import emit, json_option, limit_option, note_same_path, require_paths

# the thresholds live in paritykit.compare.steps; quoted here without importing torch or matplotlib
_GROWTH_HELP = (
    "Growth: log(max_abs) is fitted against the step. bounded: the fitted error grows < 2x over the run, or "
    "< 1.25x over its last half. exponential: >= 1.1x per step with R^2 >= 0.9, fitting at least as well as "
    "a power law in the step. polynomial: any other growth (error ~ step^p, exponent p reported). All-zero "
    "errors are bounded; fewer than 3 non-zero steps give unknown."
)


@click.command(
    help=(
        "Per-step error curve of two denoising runs.\n\nA and B are checkpoint folders written by"
        " paritykit.save_checkpoints with after_step_<i> checkpoints (reference first). Each step's KEY"
        f" tensor is compared: max_abs, mean_abs, cosine.\n\n{_GROWTH_HELP}\n\nWith --sigmas (a .json list,"
        " .txt numbers, .npy or a tensor file; step i uses sigma[i]) the table adds 1/sigma and"
        " max_abs*sigma: when the latter is bounded, the growth is 1/sigma amplification of an early"
        " difference.\n\nExit 0 when the last step is within tolerance, 1 when not, 2 on bad input."
    )
)
@click.argument("a")
@click.argument("b")
@click.option("--key", default="latents", show_default=True, help="Tensor of each checkpoint to compare.")
@click.option("--sigmas", metavar="FILE", help="The sigma of each step (.json, .txt, .npy or a tensor file).")
@click.option(
    "--plot",
    "plot_path",
    metavar="OUT.png",
    type=click.Path(dir_okay=False),
    help="Write the curve (log y) as a PNG.",
)
@click.option("--atol", type=float, help="Absolute tolerance (default: from the dtypes).")
@click.option("--rtol", type=float, help="Relative tolerance (default: from the dtypes).")
@json_option
@limit_option
def steps(a, b, key, sigmas, plot_path, atol, rtol, as_json, limit):
    require_paths(("A", a), ("B", b))
    from paritykit.compare.steps import step_curve

    curve = step_curve(a, b, key=key, sigmas=sigmas, atol=atol, rtol=rtol, plot=plot_path)
    emit(curve, as_json=as_json, limit=limit)


@click.command(
    help=(
        "Side-by-side images with a diff heatmap and PSNR.\n\nA (reference) and B (port) are image files"
        " (.png, .jpg, ...; an animated GIF is a video) or tensor files (.pt, .safetensors, .npy, ...)"
        " holding an image H×W×C / C×H×W or a video F×H×W×C / F×C×H×W. Float values are read as [-1, 1] when"
        " negative values occur, else [0, 1] ([0, 255] above 1.1); override with --range-a/--range-b. Videos"
        " are measured per frame; the verdict uses the worst frame.\n\nExit 0 when PSNR >= --psnr-min, 1"
        " below it or on different shapes, 2 on bad input."
    )
)
@click.argument("a")
@click.argument("b")
@click.option(
    "--out",
    "out",
    metavar="DIFF.png",
    type=click.Path(dir_okay=False),
    help="Write reference | port | amplified diff heatmap (PNG).",
)
@click.option("--psnr-min", type=float, default=40.0, show_default=True, help="Pass threshold in dB.")
@click.option(
    "--range-a",
    type=click.Choice(["auto", "0..1", "-1..1", "0..255"]),
    default="auto",
    show_default=True,
    help="Value range of A's float pixels.",
)
@click.option(
    "--range-b",
    type=click.Choice(["auto", "0..1", "-1..1", "0..255"]),
    default="auto",
    show_default=True,
    help="Value range of B's float pixels.",
)
@json_option
@limit_option
def images(a, b, out, psnr_min, range_a, range_b, as_json, limit):
    require_paths(("A", a), ("B", b))
    from paritykit.compare.images import compare_images

    result = compare_images(a, b, psnr_min=psnr_min, out=out, value_range=(range_a, range_b))
    note_same_path(a, b)
    emit(result, as_json=as_json, limit=limit)
