r"""``SPEC.py`` files: what ``paritykit bisect SPEC.py`` and ``paritykit trace SPEC.py`` run.

A spec builds both sides (``build_reference``, ``build_port``), makes their inputs (``make_inputs``, optional
``port_inputs``) and may pick the compared output (``select_output``), rename modules (``NAME_MAP``) and set
``TOLERANCE``. Every call into it is guarded by :func:`call_user`, so a user's exception is one line plus the
user's own frames, never paritykit's. The search itself lives in :mod:`paritykit.search`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from paritykit.errors import ParityKitError
from paritykit.report import DEFAULT_LIMIT, environment_stamp
from paritykit.search import BisectReport, _split_inputs, _to_device, bisect_traces, run_and_search

SPEC_FUNCTIONS = ("build_reference", "build_port", "make_inputs", "port_inputs", "select_output")


@dataclass
class Spec:
    r"""A loaded ``SPEC.py``: its builders and options, every call into it guarded by :func:`call_user`."""

    path: Any
    module: Any

    def has(self, name: str) -> bool:
        return callable(getattr(self.module, name, None))

    def call(self, name: str, *args: Any) -> Any:
        if not self.has(name):
            raise ParityKitError(f"{self.path}: defines no {name}(); see `paritykit bisect --help`")
        return call_user(getattr(self.module, name), *args, what=f"{name}() in {self.path.name}", spec=self)

    @property
    def name_map(self) -> list[tuple[str, str]]:
        rules = getattr(self.module, "NAME_MAP", None) or []
        try:
            return [(str(a), str(b)) for a, b in rules]
        except (TypeError, ValueError):
            raise ParityKitError(
                f"{self.path}: NAME_MAP must be a list of (regex, replacement) pairs"
            ) from None

    @property
    def tolerance(self) -> dict[str, float]:
        tol = getattr(self.module, "TOLERANCE", None) or {}
        if not isinstance(tol, dict) or set(tol) - {"atol", "rtol"}:
            raise ParityKitError(f"{self.path}: TOLERANCE must be a dict with 'atol' and/or 'rtol'")
        return {k: float(v) for k, v in tol.items()}

    def inputs(self, side: str, device: Any = None) -> tuple[tuple, dict]:
        args, kwargs = _split_spec_inputs(self.call("make_inputs"), self.path, "make_inputs()")
        if side == "port" and self.has("port_inputs"):
            args, kwargs = _split_spec_inputs(
                self.call("port_inputs", args, kwargs), self.path, "port_inputs()"
            )
        if device is not None:
            args, kwargs = _to_device((args, kwargs), device)
        return args, kwargs

    def build(self, side: str, device: Any = None) -> Any:
        model = self.call(f"build_{side}")
        if not hasattr(model, "named_modules") or not callable(model):
            raise ParityKitError(
                f"{self.path}: build_{side}() returned {type(model).__name__}, not a torch module"
            )
        if device is not None:
            model = model.to(device)
        return model.eval()

    def select(self) -> Callable | None:
        if not self.has("select_output"):
            return None
        fn = self.module.select_output
        return lambda side, output: call_user(
            fn, side, output, what=f"select_output() in {self.path.name}", spec=self
        )


def _split_spec_inputs(value: Any, path: Any, what: str) -> tuple[tuple, dict]:
    try:
        return _split_inputs(value)
    except ParityKitError:
        raise ParityKitError(f"{path}: {what} must return (args, kwargs) or a kwargs dict") from None


def _user_frames(exc: BaseException, spec: Spec | None) -> str:
    """The traceback of ``exc`` trimmed to the frames in the spec's folder (the user's own files)."""
    import traceback
    from pathlib import Path

    frames = traceback.extract_tb(exc.__traceback__)
    if spec is not None:
        folder = Path(spec.path).resolve().parent
        mine = [
            f
            for f in frames
            if not f.filename.startswith("<") and Path(f.filename).resolve().is_relative_to(folder)
        ]
    else:
        mine = []
    # With a spec, only its folder's frames are the user's (a SyntaxError has none: its own lines name the file).
    kept = mine if spec is not None else frames[-3:]
    lines = ["Traceback (your code, most recent call last):\n", *traceback.format_list(kept)] if kept else []
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines)


def call_user(fn: Callable, *args: Any, what: str, spec: Spec | None = None) -> Any:
    r"""Call user code; any exception becomes a :class:`paritykit.errors.UserCodeError` naming ``what`` and
    carrying the traceback trimmed to the user's frames."""
    from paritykit.errors import UserCodeError

    try:
        return fn(*args)
    except (ParityKitError, KeyboardInterrupt):
        raise
    except Exception as exc:
        raise UserCodeError(
            f"{what} raised {type(exc).__name__}: {exc}", detail=_user_frames(exc, spec)
        ) from exc


def load_spec(path: Any) -> Spec:
    r"""Import ``SPEC.py`` with its own folder on ``sys.path`` (so it may import sibling files)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise ParityKitError(f"SPEC {str(path)!r}: no such file")
    if path.suffix != ".py":
        raise ParityKitError(f"SPEC {str(path)!r}: expected a .py file")
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = f"_paritykit_spec_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    spec = Spec(path, module)
    sys.modules[name] = module
    call_user(module_spec.loader.exec_module, module, what=f"importing {path.name}", spec=spec)
    return spec


def _side_of(model: Any, reference: Any) -> str:
    return "reference" if model is reference else "port"


def _run_forward(spec: Spec, model: Any, side: str, args: tuple, kwargs: dict) -> Any:
    return call_user(lambda: model(*args, **kwargs), what=f"the {side} model's forward", spec=spec)


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
) -> BisectReport:
    r"""What ``paritykit bisect`` runs: a spec (both sides built here), or two trace folders (plus an optional
    spec whose builders make replay possible). ``levels`` as in :func:`bisect`; ``zoom`` names the reference
    block two trace folders were taken inside (``paritykit trace --inside BLOCK``)."""
    import torch

    from paritykit.trace import Trace

    spec = load_spec(spec_path) if spec_path is not None else None
    tol = spec.tolerance if spec is not None else {}
    atol = atol if atol is not None else tol.get("atol")
    rtol = rtol if rtol is not None else tol.get("rtol")
    rules = [*(spec.name_map if spec is not None else []), *rules]
    environment = environment_stamp(device=device or "cpu", spec=str(spec_path) if spec_path else None)
    select = spec.select() if spec is not None else None
    search = dict(
        rules=rules,
        select_output=select,
        atol=atol,
        rtol=rtol,
        ops=ops,
        environment=environment,
        allow_masked=allow_masked,
    )
    with torch.no_grad():
        if traces is not None:
            ref_trace, port_trace = Trace.load(traces[0]), Trace.load(traces[1])
            from paritykit.trace import check_request

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
            ref_args, ref_kwargs = spec.inputs("reference", device)
            port_args, port_kwargs = spec.inputs("port", device)
            return run_and_search(
                reference,
                port,
                (ref_args, ref_kwargs),
                (port_args, port_kwargs),
                run=lambda m, a, k: _run_forward(spec, m, _side_of(m, reference), a, k),
                levels=levels,
                all_culprits=all_culprits,
                **search,
            )
        report = bisect_traces(
            ref_trace,
            port_trace,
            reference=reference,
            port=port,
            all_culprits=all_culprits,
            **search,
        )
    from paritykit.zoom import next_trace_commands

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
            f"traced the {self.side}: {self.calls} calls of {self.modules} modules, {self.tensors} tensors and "
            f"{self.weights} weights written to {self.directory}"
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


def _other_side_trace(out: Any, side: str, spec: Any) -> str | None:
    r"""A folder beside ``out`` holding a trace of the other side of the same spec (by file name), if any."""
    import json
    from pathlib import Path

    from paritykit.trace import MANIFEST

    out = Path(out)
    for folder in sorted(p for p in out.resolve().parent.iterdir() if p.is_dir() and p != out.resolve()):
        try:
            about = json.loads((folder / MANIFEST).read_text()).get("about") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if about.get("side") == _other_side(side) and Path(str(about.get("spec"))).name == Path(spec).name:
            return str(out.parent / folder.name)
    return None


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
    manifest, and the model's weights so the other environment can align by value). ``levels="blocks"``
    records the top-level blocks only; ``inside=BLOCK`` records that block and one level inside it
    (:func:`paritykit.zoom.trace_patterns`)."""
    from pathlib import Path

    import torch

    from paritykit.trace import MANIFEST, WEIGHTS_FILE, capture

    if side not in ("reference", "port"):
        raise ParityKitError(f"--side {side!r}: expected 'reference' or 'port'")
    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MANIFEST).is_file())):
        raise ParityKitError(f"--out {str(out)!r}: exists and is not an empty folder or an earlier trace")
    spec = load_spec(spec_path)
    model = spec.build(side, device)
    args, kwargs = spec.inputs(side, device)
    from paritykit.zoom import trace_about, trace_patterns, write_fingerprints

    patterns = trace_patterns(model, levels, inside)
    about = trace_about(side, spec_path, out, device, levels, inside)
    with torch.no_grad():
        with capture(model, modules=patterns, to_dir=out, about=about) as trace:
            _run_forward(spec, model, side, args, kwargs)
    from paritykit.trace import write_weights

    # one tensor at a time; offloaded weights are read from their offload, not their meta placeholders
    n_weights = write_weights(model, out / WEIGHTS_FILE)
    write_fingerprints(model, out)
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
        other=_other_side_trace(out, side, spec_path),
    )
