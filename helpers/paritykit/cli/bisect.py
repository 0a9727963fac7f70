"""`paritykit bisect` and `paritykit trace`: thin shells over :mod:`paritykit.bisection.entry`."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from paritykit.base.errors import ParityKitError
from paritykit.cli._common import emit, json_option, limit_option, map_option, require_paths

SPEC_HELP = """
\b
SPEC.py is imported with its own folder on sys.path and defines:
  build_reference()          -> the reference nn.Module
  build_port()               -> the port nn.Module
  make_inputs()              -> (args, kwargs) or a kwargs dict, fed to both
optionally:
  NAME_MAP = [(regex, repl)] -> rename reference module names into the port's
  port_inputs(args, kwargs)  -> (args, kwargs) adapted to the port's signature
  select_output(side, out)   -> the comparable tensor of each side ("reference"/"port")
  TOLERANCE = {"atol": ..., "rtol": ...}
Both models run in eval mode under torch.no_grad().
"""


def _check_device(device: str | None) -> None:
    """--device must name a device this torch can allocate on (not `cuda` on a CPU-only build, not `gpu`)."""
    if device is None:
        return
    import torch

    try:
        torch.empty(0, device=torch.device(device))
    except (RuntimeError, AssertionError) as exc:  # AssertionError: "Torch not compiled with CUDA enabled"
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ParityKitError(f"--device {device!r}: not usable here ({reason})") from None


@click.command(
    help="Name the first module where a port diverges from its reference, and why.\n"
    + SPEC_HELP
    + """
\b
Exit codes: 0 match, 1 diverge or masked (the final output matches but an
aligned module fails on identical inputs; 0 with --allow-masked), 2 bad spec or
arguments (an exception in SPEC code is shown with the traceback trimmed to
your files).
"""
)
@click.argument("spec", required=False, type=click.Path(dir_okay=False))
@click.argument("extra", nargs=-1, required=False, metavar="")
@click.option(
    "--traces",
    nargs=2,
    type=click.Path(file_okay=False),
    metavar="REF_DIR PORT_DIR",
    help="Compare two folders written by `paritykit trace` (give SPEC too to replay on the port model).",
)
@click.option(
    "--atol", type=float, default=None, help="Absolute tolerance (default: by dtype, or the spec's)."
)
@click.option(
    "--rtol", type=float, default=None, help="Relative tolerance (default: by dtype, or the spec's)."
)
@map_option
@click.option("--device", default=None, help="Device for both models and inputs, e.g. cpu or cuda.")
@click.option(
    "--ops",
    is_flag=True,
    help="Re-run the culprit on both sides under an op logger and name the first op whose result differs.",
)
@click.option(
    "--levels",
    type=click.Choice(["auto", "zoom", "full"]),
    default="auto",
    show_default=True,
    help=(
        "full: capture every module at once. zoom: capture the top-level blocks, then only inside the "
        "first failing block, one level at a time (memory of one level). auto: zoom when the reference's "
        "parameters take more than 1 GiB or accelerate keeps its weights offloaded (on meta)."
    ),
)
@click.option(
    "--zoom",
    "zoom",
    default=None,
    metavar="BLOCK",
    help="With --traces: the folders were traced with `paritykit trace … --inside BLOCK` (checked).",
)
@click.option(
    "--all",
    "all_culprits",
    is_flag=True,
    help=(
        "After each culprit, give it the reference's output in the port and search again: the culprits "
        "in execution order, each saying what was substituted when it was found, and whether the output "
        "then matches."
    ),
)
@click.option(
    "--allow-masked",
    is_flag=True,
    help="Exit 0 when the final output matches although an aligned module fails (verdict masked).",
)
@click.option(
    "--no-repair",
    "no_repair",
    is_flag=True,
    help=(
        "Skip the repair search (small edits of the port tried at each culprit and kept only when replay "
        "then matches the reference)."
    ),
)
@click.option(
    "--repair-budget",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help=(
        "Edits the repair search may try at each culprit (default: a count that grows with the culprit's "
        "size). Counted, not timed: the same inputs give the same report on any machine. At a top-level "
        "culprit each edit is a run of the whole port: a model too big for the default gets none unless N "
        "is given."
    ),
)
@click.option(
    "--float-floor/--no-float-floor",
    default=True,
    show_default=True,
    help=(
        "Run both sides once more in float64 (when the copies fit in memory) and on inputs moved by one "
        "rounding step: a difference within a few times the larger side's float32 error is float noise, "
        "not a divergence; one far above it is real even when hidden at the output."
    ),
)
@click.option(
    "--reference",
    "reference_fn",
    metavar="MODULE:CALLABLE",
    help="No SPEC file: the reference module is MODULE:CALLABLE() (with --port and --inputs).",
)
@click.option("--port", "port_fn", metavar="MODULE:CALLABLE", help="No SPEC file: the port module.")
@click.option(
    "--inputs",
    "inputs_fn",
    metavar="MODULE:CALLABLE",
    help="No SPEC file: what both run on, as make_inputs() returns it.",
)
@click.option(
    "--port-inputs",
    "port_inputs_fn",
    metavar="MODULE:CALLABLE",
    help="No SPEC file: port_inputs(args, kwargs) mapping the inputs to the port's signature.",
)
@click.option(
    "--select-output",
    "select_output_fn",
    metavar="MODULE:CALLABLE",
    help="No SPEC file: select_output(side, output) picking the compared tensor of each side's output.",
)
@click.option(
    "--interface-map",
    "interface_map",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=(
        "Write the two models' interfaces as Markdown tables: each replayed module pair's port arguments, "
        "the reference arguments that give them and how (same, dtype, layout, x1000, per sample, list "
        "stacked, cos/sin of a complex table, the port's own). Refuses an existing file."
    ),
)
@json_option
@limit_option
def bisect(
    spec,
    extra,
    traces,
    atol,
    rtol,
    maps,
    device,
    ops,
    levels,
    zoom,
    all_culprits,
    allow_masked,
    no_repair,
    repair_budget,
    float_floor,
    reference_fn,
    port_fn,
    inputs_fn,
    port_inputs_fn,
    select_output_fn,
    interface_map,
    as_json,
    limit,
):
    if extra:
        raise ParityKitError(
            f"bisect takes one SPEC.py that builds both sides, not {1 + len(extra)} paths: name the reference"
            " and the port with --reference/--port/--inputs MODULE:CALLABLE (or a SPEC from `paritykit new"
            " bisect-spec`), or give two trace folders after --traces"
        )
    require_paths(("SPEC", spec), *((("--traces", t) for t in traces) if traces else ()))
    from paritykit.base.naming import parse_map_options
    from paritykit.bisection.spec import bisect_spec

    callables = (reference_fn, port_fn, inputs_fn)
    keep = None
    if any(callables) or port_inputs_fn or select_output_fn:
        if traces:
            raise ParityKitError("--traces compares two trace folders: give them without --reference/--port")
        if spec is not None:
            raise ParityKitError("give SPEC.py or --reference/--port/--inputs, not both")
        if not all(callables):
            raise ParityKitError(
                "without a SPEC, give all three: --reference, --port and --inputs (MODULE:CALLABLE)"
            )
        from paritykit.base.usercode import spec_from_callables

        spec = spec_from_callables(reference_fn, port_fn, inputs_fn, port_inputs_fn, select_output_fn)
        keep = shlex.join(
            ["paritykit", "new", "bisect-spec", "NAME", "--reference", reference_fn, "--port", port_fn]
            + ["--inputs", inputs_fn]
            + (["--port-inputs", port_inputs_fn] if port_inputs_fn else [])
            + (["--select-output", select_output_fn] if select_output_fn else [])
        )
    if spec is None and not traces:
        raise click.UsageError("give SPEC.py, --reference/--port/--inputs, or --traces REF_DIR PORT_DIR")
    if interface_map is not None and interface_map.exists():
        raise ParityKitError(f"--interface-map {str(interface_map)!r}: exists; give a new file name")
    if interface_map is not None and not interface_map.resolve().parent.is_dir():
        raise ParityKitError(f"--interface-map {str(interface_map)!r}: its folder does not exist")
    _check_device(device)
    report = bisect_spec(
        spec,
        traces=tuple(traces) if traces else None,
        rules=parse_map_options(maps),
        atol=atol,
        rtol=rtol,
        device=device,
        ops=ops,
        levels=levels,
        zoom=zoom,
        all_culprits=all_culprits,
        allow_masked=allow_masked,
        repair=not no_repair,
        repair_budget=repair_budget,
        float_floor=float_floor,
    )
    if interface_map is not None:
        from paritykit.base.files import atomic_write_text

        try:
            atomic_write_text(interface_map, report.interface_map())
        except OSError as exc:
            raise ParityKitError(
                f"--interface-map {str(interface_map)!r}: cannot write ({exc.strerror})"
            ) from None
    report.spec_command = keep or ""
    emit(report, as_json=as_json, limit=limit)


@click.command(
    help="Capture one side's module inputs and outputs to a folder.\n"
    + SPEC_HELP
    + """
\b
The spec may define only the builder of the side traced, so each side can be traced
in its own environment; then run `paritykit bisect --traces REF_DIR PORT_DIR [SPEC.py]`.
"""
)
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--side", type=click.Choice(["reference", "port"]), required=True, help="Which model to trace.")
@click.option(
    "--out",
    "out",
    type=click.Path(),
    required=True,
    help="Folder for the trace (an earlier trace is replaced).",
)
@click.option("--device", default=None, help="Device for the model and inputs, e.g. cpu or cuda.")
@click.option(
    "--levels",
    type=click.Choice(["full", "blocks"]),
    default="full",
    show_default=True,
    help="blocks: record only the top level and its blocks (a ModuleList's items count as blocks).",
)
@click.option(
    "--inside",
    default=None,
    metavar="BLOCK",
    help="Record the top level, BLOCK and one level inside it (what `bisect --traces` asks for next).",
)
@json_option
def trace(spec, side, out, device, levels, inside, as_json):
    from paritykit.bisection.spec import trace_spec

    _check_device(device)
    emit(trace_spec(spec, side=side, out=out, device=device, levels=levels, inside=inside), as_json=as_json)
