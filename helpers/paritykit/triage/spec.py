r"""``paritykit triage SPEC.py``: both pipelines run end to end from one seed, every denoiser (and decoder)
call recorded, then compared call by call, first difference first.

The order: the SPEC loaded and both sides run (:mod:`~paritykit.triage.sides`), the recordings written
(:func:`~paritykit.triage.reproduce.write_recordings`), the places walked
(:class:`~paritykit.triage.walk.Triage`),
then the files each finding's reproduce command reads (:func:`~paritykit.triage.reproduce.write_files`).
"""

from __future__ import annotations

from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.precision import exact_float32
from paritykit.base.usercode import load_spec
from paritykit.triage.pairs import Tolerance
from paritykit.triage.report import TriageReport
from paritykit.triage.reproduce import (
    DEFAULT_OUT,
    MARKER,
    Commands,
    checked_out,
    write_files,
    write_recordings,
)
from paritykit.triage.scripts import adopt_scheduler, script_summaries
from paritykit.triage.sides import check_required, leading_unpaired, run_side
from paritykit.triage.walk import Triage

# Tensors of two whole pipelines (a float64 research loop against a float32 port) drift apart by float
# rounding, amplified through later layers: 2e-5 relative at a decoder's input after five DDIM steps of a
# correct port. Planted bugs differ by 1e-3 and more. A SPEC's TOLERANCE replaces these.
PIPELINE_TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}


@exact_float32()
def triage_spec(
    spec_path: Any, *, all_causes: bool = False, out: Any = DEFAULT_OUT, seed: int | None = None
) -> TriageReport:
    r"""Run both sides of ``spec_path`` under recording and find where the port parts from the reference.

    Args:
        spec_path: the triage SPEC (``paritykit new triage-spec`` writes one).
        all_causes: go on past the first place that differs: each place is then checked on its own, the
            port's modules fed the reference's values at that point.
        out: folder for the recordings (``reference_calls/``, ``port_calls/``, the ``record_loop`` format) and
            the files the reproduce commands read; ``None`` writes nothing.
        seed: torch's global seed before each side runs (default: the SPEC's ``SEED``, else 0).

    Returns:
        A :class:`~paritykit.triage.report.TriageReport`; ``exit_code`` 0 match, 1 differ.
    """
    out_dir = checked_out(out)
    spec = load_spec(spec_path, command="triage")
    check_required(spec)
    seed = int(getattr(spec.module, "SEED", 0) if seed is None else seed)
    tol = Tolerance(**{**PIPELINE_TOLERANCE, **spec.tolerance}, atol_scaled="atol" not in spec.tolerance)
    if spec.has("port_scheduler"):  # checked before either side runs, not after minutes of recording
        scheduler = spec.call("port_scheduler")
        if not callable(getattr(scheduler, "set_timesteps", None)):
            raise ParityKitError(
                f"{spec.path}: port_scheduler() returned a {type(scheduler).__name__}, not a diffusers"
                " scheduler (expected an object with set_timesteps and step)"
            )
    ref = run_side(spec, "reference", seed)
    port = run_side(spec, "port", seed)
    adopt_scheduler(spec)
    counts = (len(ref.calls), len(port.calls))
    ref, port, unpaired = leading_unpaired(ref, port, tol)
    folders = write_recordings(out_dir, spec.path, ref, port) if out_dir is not None else None
    report = Triage(spec, tol, ref, port, Commands(spec.path, spec.tolerance, folders), all_causes).report()
    if unpaired:  # the counts as run, and which calls were left out of the pairing
        report.calls = counts
        report.grouping = "; ".join(w for w in (unpaired, report.grouping) if w)
    report.sides = script_summaries(spec)
    write_files(report.findings)
    return report


# the SPEC functions a triage run from callables names, with their options
CALLABLE_FUNCTIONS = (
    ("run_reference", "--run-reference"),
    ("run_port", "--run-port"),
    ("reference_denoiser", "--reference-denoiser"),
    ("port_denoiser", "--port-denoiser"),
    ("reference_vae", "--reference-vae"),
    ("port_vae", "--port-vae"),
    ("port_scheduler", "--port-scheduler"),
)


def spec_from_callables(out: Any, **targets: str | None) -> Any:
    r"""A triage SPEC file written into ``out`` from ``MODULE:CALLABLE`` names (``run_reference=...`` and
    the rest of :data:`CALLABLE_FUNCTIONS`), each SPEC function calling its callable; the folder this runs
    in is put on the SPEC's ``sys.path``. Returns its path: the run's reproduce commands read it, and it can
    be kept."""
    import os
    from pathlib import Path

    from paritykit.base.usercode import callable_from

    missing = [option for name, option in CALLABLE_FUNCTIONS[:4] if not targets.get(name)]
    if missing:
        raise ParityKitError(f"without a SPEC, give {', '.join(missing)} (MODULE:CALLABLE)")
    out_dir = checked_out(out)
    if out_dir is None:
        raise ParityKitError("without a SPEC, triage needs --out to write the SPEC it runs")
    root = Path(os.path.relpath(Path.cwd(), out_dir.resolve())).as_posix()
    lines = [
        '"""Triage SPEC written by `paritykit triage` from the callables it was given; keep or edit it."""',
        "",
        "import sys",
        "from pathlib import Path",
        "",
        "# the folder triage ran in: the modules named below import from there",
        f"sys.path.insert(0, str((Path(__file__).resolve().parent / {root!r}).resolve()))",
    ]
    for name, option in CALLABLE_FUNCTIONS:
        target = targets.get(name)
        if not target:
            continue
        callable_from(option, target)  # a wrong name is one line now, not an error inside the run
        module, _, attr = target.partition(":")
        lines += [
            "",
            "",
            f"def {name}():",
            f"    from {module} import {attr} as _callable",
            "",
            "    return _callable()",
        ]
    return _write_spec(out_dir, "\n".join(lines) + "\n", "these callables")


def spec_from_scripts(out: Any, reference: str, port: str) -> Any:
    r"""A triage SPEC file written into ``out`` that runs two scripts as ``python SCRIPT`` would, from the
    folder this runs in (:mod:`~paritykit.triage.scripts`). Returns its path."""
    import os
    from pathlib import Path

    from paritykit.triage.scripts import check_script, spec_text

    check_script(reference, "--reference-script")
    check_script(port, "--port-script")
    out_dir = checked_out(out)
    if out_dir is None:
        raise ParityKitError("with scripts, triage needs --out to write the SPEC it runs")
    root = Path(os.path.relpath(Path.cwd(), out_dir.resolve())).as_posix()
    return _write_spec(out_dir, spec_text(reference, port, root), "these scripts")


def _write_spec(out_dir: Any, text: str, made_from: str) -> Any:
    from paritykit.base.files import atomic_write_text

    path = out_dir / "triage_spec.py"
    written = out_dir / SPEC_HASH  # the hash of the SPEC triage last wrote here: unedited, it is triage's own
    if path.exists() and path.read_text() != text:
        ours = written.is_file() and written.read_text().strip() == _sha256(path.read_text())
        if not ours:
            raise ParityKitError(
                f"{path} exists and differs from the SPEC {made_from} make (kept or edited?): run it with"
                f" `paritykit triage {path}`, or give another --out"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MARKER).write_text("{}\n")  # the folder is triage's, so the run may write into it
    atomic_write_text(path, text)
    written.write_text(_sha256(text) + "\n")
    return path


SPEC_HASH = "triage_spec.sha256"


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()
