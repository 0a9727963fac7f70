r"""``SPEC.py`` files: what ``paritykit bisect SPEC.py`` and ``paritykit trace SPEC.py`` run.

A spec builds both sides (``build_reference``, ``build_port``), makes their inputs (``make_inputs``, optional
``port_inputs``) and may pick the compared output (``select_output``), rename modules (``NAME_MAP``) and set
``TOLERANCE``. Every call into it is guarded by :func:`call_user`, so a user's exception is one line plus the
user's own frames, never paritykit's. The search itself lives in :mod:`paritykit.bisection.entry`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.precision import exact_float32
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp
from paritykit.base.usercode import Spec, call_user, load_spec
from paritykit.bisection.entry import bisect_traces, capture_and_bisect
from paritykit.bisection.floor import FloatFloor, original_of
from paritykit.bisection.results import BisectReport


def _side_of(model: Any, reference: Any) -> str:
    return "reference" if original_of(model) is reference else "port"


def _run_forward(spec: Spec, model: Any, side: str, args: tuple, kwargs: dict) -> Any:
    return call_user(lambda: model(*args, **kwargs), what=f"the {side} model's forward", spec=spec)


@exact_float32()
def bisect_spec(
    spec_path: Any = None,
    *,
    traces: tuple[Any, Any] | None = None,
    rules: Sequence[tuple[str, str]] = (),
    atol: float | None = None,
    rtol: float | None = None,
    device: str | None = None,
    ops: bool = False,
    levels: str = "auto",
    zoom: str | None = None,
    allow_masked: bool = False,
    all_culprits: bool = False,
    repair: bool = True,
    repair_budget: int | None = None,
    float_floor: bool = True,
) -> BisectReport:
    r"""What ``paritykit bisect`` runs: a spec (both sides built here), or two trace folders (plus an optional
    spec whose builders make replay possible). ``levels``, ``repair`` and ``float_floor`` as in
    :func:`bisect` (two traces get no float64 run: their failing replays are measured); ``zoom`` names the
    reference block two trace folders were taken inside (``paritykit trace --inside BLOCK``)."""
    import torch

    from paritykit.tracing.trace import Trace

    if isinstance(spec_path, Spec):
        spec = spec_path
    else:
        spec = load_spec(spec_path) if spec_path is not None else None
    tol = spec.tolerance if spec is not None else {}
    atol = atol if atol is not None else tol.get("atol")
    rtol = rtol if rtol is not None else tol.get("rtol")
    rules = [*(spec.name_map if spec is not None else []), *rules]
    environment = environment_stamp(device=device or "cpu", spec=str(spec.path) if spec is not None else None)
    select = spec.select() if spec is not None else None
    search = dict(
        rules=rules,
        select_output=select,
        atol=atol,
        rtol=rtol,
        ops=ops,
        environment=environment,
        allow_masked=allow_masked,
        repair=repair,
        repair_budget=repair_budget,
    )
    with torch.no_grad():
        if traces is not None:
            ref_trace, port_trace = Trace.load(traces[0]), Trace.load(traces[1])
            from paritykit.tracing.split_traces import check_pair, check_request

            inputs = spec.input_fingerprint() if spec is not None and spec.has("make_inputs") else None
            check_pair(ref_trace, port_trace, inputs)
            check_request(ref_trace, port_trace, zoom)
            reference = (
                spec.build("reference", device) if spec is not None and spec.has("build_reference") else None
            )
            port = spec.build("port", device) if spec is not None and spec.has("build_port") else None
            environment["traces"] = [str(traces[0]), str(traces[1])]
        else:
            if spec is None:
                raise ParityKitError("give SPEC.py, or --traces REF_DIR PORT_DIR")
            reference, port = spec.build("reference", device), spec.build("port", device)
            ref_call, port_call = spec.input_pair(device)
            return capture_and_bisect(
                reference,
                port,
                ref_call,
                port_call,
                run=lambda m, a, k: _run_forward(spec, m, _side_of(m, reference), a, k),
                levels=levels,
                all_culprits=all_culprits,
                float_floor=float_floor,
                **search,
            )
        report = bisect_traces(
            ref_trace,
            port_trace,
            reference=reference,
            port=port,
            all_culprits=all_culprits,
            float_floor=FloatFloor(reason="two traces: no float64 run") if float_floor else None,
            **search,
        )
    from paritykit.bisection.zoom import next_trace_commands

    report.next_steps = next_trace_commands(report, ref_trace, port_trace)
    return report


@dataclass
class TraceSummary:
    r"""What ``paritykit trace`` wrote."""

    side: str
    directory: str
    calls: int
    modules: int
    tensors: int
    weights: int
    environment: dict[str, Any] = field(default_factory=dict)
    exit_code: int = 0
    spec: str = "SPEC.py"
    other: str | None = None  # a trace of the other side of the same spec, found beside this one

    def to_dict(self) -> dict[str, Any]:
        return {
            "side": self.side,
            "directory": self.directory,
            "calls": self.calls,
            "modules": self.modules,
            "tensors": self.tensors,
            "weights": self.weights,
            "other_side_trace": self.other,
            "next": self.next_command(),
            "environment": self.environment,
        }

    def next_command(self) -> str:
        r"""Both sides traced: the bisect to run; only this one: how to trace the other side first."""
        import shlex

        if self.other is not None:
            mine, theirs = self.directory, self.other
            ref, port = (mine, theirs) if self.side == "reference" else (theirs, mine)
            return shlex.join(["paritykit", "bisect", "--traces", ref, port, self.spec])
        other = "port" if self.side == "reference" else "reference"
        return shlex.join(["paritykit", "trace", self.spec, "--side", other, "--out", f"{other}_trace"])

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        head = (
            f"traced the {self.side}: {self.calls} calls of {self.modules} modules, {self.tensors} tensors"
            f" and {self.weights} weights written to {self.directory}"
        )
        if self.other is not None:
            found = f"the {_other_side(self.side)} is traced in {self.other}"
            return f"{head}\n{found}; next: {self.next_command()}"
        return (
            f"{head}\nnext: trace the {_other_side(self.side)} (in its own environment if need be): "
            f"{self.next_command()}\nthen `paritykit bisect --traces REF_DIR PORT_DIR {self.spec}`"
        )


def _other_side(side: str) -> str:
    return "port" if side == "reference" else "reference"


def _other_side_trace(out: Any, side: str, spec: Any, digest: str | None = None) -> str | None:
    r"""A folder beside ``out`` holding a trace of the other side of the same spec (by file name, and by
    content hash when both record one), if any."""
    import json
    from pathlib import Path

    from paritykit.tracing.trace import MANIFEST

    out = Path(out)
    for folder in sorted(p for p in out.resolve().parent.iterdir() if p.is_dir() and p != out.resolve()):
        try:
            about = json.loads((folder / MANIFEST).read_text()).get("about") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if about.get("side") == _other_side(side) and Path(str(about.get("spec"))).name == Path(spec).name:
            if digest is not None and about.get("spec_sha256") not in (None, digest):
                continue  # the same file name, another spec's content: not the other side
            return str(out.parent / folder.name)
    return None


@exact_float32()
def trace_spec(
    spec_path: Any,
    *,
    side: str,
    out: Any,
    device: str | None = None,
    levels: str = "full",
    inside: str | None = None,
) -> TraceSummary:
    r"""What ``paritykit trace`` runs: build one side from the spec, capture it into ``out`` (tensors,
    manifest, and fingerprints of the model's weights with their hashes, not a copy, so the other
    environment can align by value). ``levels="blocks"``
    records the top-level blocks only; ``inside=BLOCK`` records that block and one level inside it
    (:func:`paritykit.bisection.zoom.trace_patterns`)."""
    from pathlib import Path

    import torch

    from paritykit.tracing.trace import MANIFEST, WEIGHTS_FILE, capture

    if side not in ("reference", "port"):
        raise ParityKitError(f"--side {side!r}: expected 'reference' or 'port'")
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())):
        raise ParityKitError(f"--out {str(out)!r}: exists and is not an empty folder or an earlier trace")
    spec = load_spec(spec_path)
    model = spec.build(side, device)
    args, kwargs = spec.inputs(side, device)
    from paritykit.bisection.zoom import trace_about, trace_patterns, write_fingerprints

    patterns = trace_patterns(model, levels, inside)
    about = trace_about(side, spec_path, out, device, levels, inside, spec)
    with torch.no_grad():
        with capture(model, modules=patterns, to_dir=out, about=about) as trace:
            _run_forward(spec, model, side, args, kwargs)
    # the weights' fingerprints, never a copy of them (the checkpoint holds them already): one tensor at a
    # time, offloaded weights read from their offload, not their meta placeholders
    stale = out / WEIGHTS_FILE
    if stale.is_file():  # an earlier trace's copy would be read as this model's weights
        stale.unlink()
    n_weights = write_fingerprints(model, out)
    info = trace.summary()
    return TraceSummary(
        side,
        str(out),
        info["calls"],
        info["modules"],
        info["tensors"],
        n_weights,
        environment_stamp(device=device or "cpu", spec=str(spec_path)),
        spec=str(spec_path),
        other=_other_side_trace(out, side, spec_path, about.get("spec_sha256")),
    )
