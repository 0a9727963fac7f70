r"""``paritykit triage SPEC.py``: both pipelines run end to end from one seed, every denoiser (and decoder)
call recorded, then compared call by call, first difference first.

The order: the SPEC loaded and both sides run (:mod:`~paritykit.triage.sides`), the recordings written
(:func:`~paritykit.triage.reproduce.write_recordings`), the places walked
(:class:`~paritykit.triage.walk.Triage`),
then the files each finding's reproduce command reads (:func:`~paritykit.triage.reproduce.write_files`).
"""

from __future__ import annotations

from typing import Any

from paritykit.base.usercode import load_spec
from paritykit.triage.pairs import Tolerance
from paritykit.triage.report import TriageReport
from paritykit.triage.reproduce import DEFAULT_OUT, Commands, checked_out, write_files, write_recordings
from paritykit.triage.sides import check_required, run_side
from paritykit.triage.walk import Triage

# Tensors of two whole pipelines (a float64 research loop against a float32 port) drift apart by float
# rounding, amplified through later layers: 2e-5 relative at a decoder's input after five DDIM steps of a
# correct port. Planted bugs differ by 1e-3 and more. A SPEC's TOLERANCE replaces these.
PIPELINE_TOLERANCE = {"atol": 1e-5, "rtol": 1e-4}


def triage_spec(
    spec_path: Any, *, all_causes: bool = False, out: Any = DEFAULT_OUT, seed: int | None = None
) -> TriageReport:
    r"""Run both sides of ``spec_path`` under recording and find where the port parts from the reference.

    Args:
        spec_path: the triage SPEC (``paritykit new triage-spec`` writes one).
        all_causes: go on past the first cause: each place is then checked on its own, the port's modules fed
            the reference's values at that point, so independent bugs are all named.
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
    tol = Tolerance(**{**PIPELINE_TOLERANCE, **spec.tolerance})
    ref = run_side(spec, "reference", seed)
    port = run_side(spec, "port", seed)
    folders = write_recordings(out_dir, spec.path, ref, port) if out_dir is not None else None
    report = Triage(spec, tol, ref, port, Commands(spec.path, spec.tolerance, folders), all_causes).report()
    write_files(report.findings)
    return report
