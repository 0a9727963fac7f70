r"""Bisect by levels ("zoom"): capture one level of blocks at a time, so memory follows depth, not size.

A full capture keeps the inputs and outputs of every module call of both models; at a real resolution that
is tens of gigabytes. The zoom keeps one level at a time:

1. both models run once, capturing only the top-level blocks (the children of the root; the items of a
   ``ModuleList``/``ModuleDict`` count as blocks themselves, since a list is never called);
2. the usual tests (:class:`~paritykit.bisection.searcher.Searcher`: replay, else error jump) run on those
   blocks and the first aligned block that fails is taken;
3. that block alone is run again on each side from the inputs its level captured (the reference block on the
   reference's captured inputs, the port block on the port's own captured inputs, exactly what a full capture
   would have recorded), capturing its own children only; then step 2 again, one level down.

It stops at a block with no children, or at a block whose children all pass (``inline``). Peak memory is the
outputs of one level plus the tensors of the one block being entered. The result is an ordinary
:class:`~paritykit.bisection.results.BisectReport`; its ``first_output_divergence`` is looked for among the
top-level blocks only, and ``tested`` lists what was tested on the way down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paritykit.base.errors import ParityKitError
from paritykit.base.inputs import to_device
from paritykit.bisection.align import AlignedPair, Alignment, align_modules
from paritykit.bisection.floor import FloatFloor
from paritykit.bisection.leaves import module_device, pair_leaves
from paritykit.bisection.repair.culprit_sites import RepairOptions
from paritykit.bisection.results import ModuleTest
from paritykit.bisection.searcher import MAX_MASKED_CHECKS, Searcher
from paritykit.bisection.strategy import Located, differing_in, run_strategy

if TYPE_CHECKING:
    from paritykit.bisection.searcher import Searcher
    from paritykit.tracing.trace import Record, Trace

# ``levels="auto"``: zoom when the reference's parameters take more bytes than this. A full capture keeps
# every module's output, and a model's activations grow with its width and depth as its weights do; under
# this size a full capture is small, and it pairs modules across hierarchies that differ (a research UNet's
# ``encoders`` list against diffusers' ``down_blocks``), which the zoom, one level at a time, cannot.
ZOOM_BYTES = 1 << 30
LEVELS = ("auto", "zoom", "full")


def use_zoom(levels: str, model: Any, zoom_bytes: int = ZOOM_BYTES) -> bool:
    r"""Whether ``levels`` (``auto``/``zoom``/``full``) means the zoom for ``model`` (``auto``: parameters
    of more than ``zoom_bytes`` bytes, :data:`ZOOM_BYTES` by default, or weights offloaded to ``meta`` by
    accelerate)."""
    if levels not in LEVELS:
        raise ParityKitError(f"--levels {levels!r}: expected one of {', '.join(LEVELS)}")
    if levels == "auto":
        return model is not None and (_parameter_bytes(model) > zoom_bytes or _offloaded(model))
    return levels == "zoom"


def _parameter_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _offloaded(model: Any) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def level_children(model: Any, name: str = "") -> list[str]:
    r"""The blocks one level below module ``name`` of ``model``: its children, with the items of a
    ``ModuleList``/``ModuleDict`` in place of the container (which is never called itself)."""
    import torch

    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    out: list[str] = []

    def walk(prefix: str, module: Any) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, containers):
                walk(full, child)
            else:
                out.append(full)

    walk(name, model.get_submodule(name) if name else model)
    return out


def level_patterns(model: Any, name: str = "") -> list[str]:
    r"""What :func:`paritykit.tracing.trace.capture` must hook to record block ``name`` and its level children
    (exact names, with glob characters escaped)."""
    import glob

    return [glob.escape(n) if n else n for n in (name, *level_children(model, name))]


# ---------------------------------------------------------------------------------------------- levels


@dataclass
class _Level:
    """One captured level: the searcher testing its calls, and the call at its top."""

    searcher: Searcher
    root: Any


class ZoomSearch:
    r"""The zoom strategy (:class:`~paritykit.bisection.strategy.SearchStrategy`): walks down level by level,
    each level's tests in its own :class:`~paritykit.bisection.searcher.Searcher`.

    Args:
        reference, port: the two models (their blocks are re-run alone when entered).
        ref_trace, port_trace: captures of the top level (:func:`capture_level`).
        rules, atol, rtol, ratio: as in :func:`paritykit.bisect`.
    """

    def __init__(
        self,
        reference: Any,
        port: Any,
        ref_trace: Trace,
        port_trace: Trace,
        *,
        rules: Sequence[tuple[str, str]],
        atol: float | None,
        rtol: float | None,
        ratio: float,
    ):
        self.float_floor: FloatFloor | None = None
        self.reference = reference
        self.port = port
        self.rules = rules
        self.options = {"atol": atol, "rtol": rtol, "ratio": ratio}
        self.levels: list[_Level] = []
        self.alignment = Alignment()
        self.unaligned: tuple[list[str], list[str]] = ([], [])
        self.first = self.level(ref_trace, port_trace, ref_trace.root)

    # the strategy ----------------------------------------------------------------------------------
    @property
    def top(self) -> Searcher:
        return self.first.searcher

    def locate(self) -> Located:
        found, passed = self.failing_below(self.first, self.first.root)
        level, call, passed = found if found is not None else (self.first, self.first.root, passed)
        return Located(level.searcher, call, passed)

    def masking(self) -> bool:
        return any(level.searcher.masking() for level in self.levels)

    def masked(self) -> Located | None:
        found = self.masked_below(self.first, self.first.root, [MAX_MASKED_CHECKS])
        return Located(found[0].searcher, found[1], found[2]) if found is not None else None

    def differing(self) -> Located | None:
        for level in self.levels:
            found = differing_in(level.searcher)
            if found is not None:
                return found
        return None

    def candidates(self) -> list[ModuleTest]:
        return [c for level in self.levels for c in level.searcher.candidates]

    def tested(self) -> list[ModuleTest]:
        seen: dict[str, ModuleTest] = {}
        for level in self.levels:
            for name, result in level.searcher.results.items():
                seen.setdefault(name, result)
        return list(seen.values())

    def final_alignment(self) -> Alignment:
        refs = {p.reference for p in self.alignment.pairs}
        ports = {p.port for p in self.alignment.pairs}
        return Alignment(
            pairs=list(self.alignment.pairs),
            unaligned_reference=[n for n in self.unaligned[0] if n not in refs],
            unaligned_port=[n for n in self.unaligned[1] if n not in ports],
            layer_orders=self.alignment.layer_orders,
        )

    def describe(self, environment: dict[str, Any]) -> dict[str, Any]:
        environment = dict(environment)
        environment["levels"] = "zoom"
        environment["entered"] = [level.root.name for level in self.levels[1:]]
        return environment

    # alignment -------------------------------------------------------------------------------------
    def merge(self, found: Alignment) -> Alignment:
        """The pairs known so far plus this level's new ones (an earlier level's pair is never replaced)."""
        refs = {p.reference for p in self.alignment.pairs}
        ports = {p.port for p in self.alignment.pairs}
        pairs: list[AlignedPair] = list(self.alignment.pairs)
        pairs += [p for p in found.pairs if p.reference not in refs and p.port not in ports]
        # the layer orders are read from the whole models' weights: the first level's hold for every level
        orders = self.alignment.layer_orders or found.layer_orders
        self.alignment = Alignment(pairs=pairs, layer_orders=orders)
        for names, new in zip(self.unaligned, (found.unaligned_reference, found.unaligned_port)):
            names += [n for n in new if n not in names]
        return self.alignment

    def level(self, ref_trace: Trace, port_trace: Trace, root: Any) -> _Level:
        found = align_modules(*_weights_for_alignment(self, ref_trace, port_trace), rules=self.rules)
        searcher = Searcher(
            ref_trace, port_trace, self.merge(found), reference=self.reference, port=self.port, **self.options
        )
        searcher.float_floor = self.float_floor
        level = _Level(searcher, root)
        self.levels.append(level)
        return level

    # entering a block ------------------------------------------------------------------------------
    def can_enter(self, level: _Level, call: Record) -> bool:
        port_call = level.searcher.port_record(call)
        return (
            port_call is not None
            and bool(level_children(self.reference, call.module))
            and bool(level_children(self.port, port_call.module))
            and call.replayable
            and port_call.replayable
        )

    def enter(self, level: _Level, call: Record) -> _Level:
        """Run block ``call`` alone on each side from its captured inputs, capturing one level inside it."""
        port_call = level.searcher.port_record(call)
        ref_trace = _rerun(self.reference, call)
        port_trace = _rerun(self.port, port_call)
        inner = self.level(ref_trace, port_trace, ref_trace[call.name])
        # The block itself was tested one level up: its verdict and replayed outputs carry over.
        inner.searcher.inherit(level.searcher, call.name)
        return inner

    # search (Searcher.descend, one level at a time) ------------------------------------------------
    def descend(self, level: _Level, call: Record) -> tuple[_Level, Any, int]:
        if not self.can_enter(level, call):
            return level, call, 0
        inner = self.enter(level, call)
        found, passed = self.failing_below(inner, inner.root)
        return found if found is not None else (inner, inner.root, passed)

    def failing_below(self, level: _Level, record: Record) -> tuple[tuple[_Level, Any, int] | None, int]:
        passed = 0
        for child in level.searcher.frontier(record):
            result = level.searcher.test(child)
            if result.status == "fail" and level.searcher.confident(child):
                return self.descend(level, child), passed
            if result.status == "fail" or result.status == "untestable":
                # a pair aligned on order alone is a lead, looked through like an untestable one
                if result.status == "fail":
                    level.searcher.lead(child)
                # look inside, as a full capture would: a failing call below counts, a pass proves nothing
                if self.can_enter(level, child):
                    inner = self.enter(level, child)
                    found, _ = self.failing_below(inner, inner.root)
                    if found is not None:
                        return found, passed
            else:
                passed += 1
        return None, passed

    def masked_below(
        self, level: _Level, record: Record, budget: list[int]
    ) -> tuple[_Level, Any, int] | None:
        """With a matching output: the first call failing on identical inputs below ``record``, looking only
        into calls whose captured outputs are not bit-identical and whose captured inputs agree (at most
        ``budget[0]`` of them tested)."""
        for child in level.searcher.frontier(record):
            if budget[0] <= 0:
                return None
            pair = level.searcher.alignment.pair_of(child.module)
            if pair is None or pair.confidence == "low" or not _not_bit_identical(level.searcher, child):
                continue
            if not level.searcher.fed_alike(child.name):  # fed otherwise by design: a replay proves nothing
                continue
            budget[0] -= 1
            if level.searcher.test(child).status == "fail":
                return self.descend(level, child)
            if self.can_enter(level, child):
                inner = self.enter(level, child)
                found = self.masked_below(inner, inner.root, budget)
                if found is not None:
                    return found
        return None


def _not_bit_identical(searcher: Searcher, call: Record) -> bool:
    import torch

    port_call = searcher.port_record(call)
    if port_call is None:
        return False
    a, b = list(call.outputs.items()), list(port_call.outputs.items())
    pairs = pair_leaves(a, b)
    return pairs is None or any(not torch.equal(a[i][1], b[j][1].to(a[i][1].dtype)) for i, j in pairs)


def _weights_for_alignment(
    zoom: ZoomSearch, ref_trace: Trace, port_trace: Trace
) -> tuple[Any, Any, Any, Any]:
    """``align_modules`` arguments; an offloaded model's weights are read through its accelerate hooks, one
    tensor per access (:class:`paritykit.tracing.split_traces.ModelWeights`), in place of its ``meta`` state
    dict."""
    from paritykit.tracing.split_traces import ModelWeights

    models = []
    for model, trace in ((zoom.reference, ref_trace), (zoom.port, port_trace)):
        weights = ModelWeights(model)
        if weights.offloaded:
            trace.weight_source = weights
            model = None
        models.append(model)
    return models[0], models[1], ref_trace, port_trace


def _rerun(model: Any, call: Record) -> Any:
    """Capture block ``call`` of ``model`` and its level children, run alone on the call's captured inputs;
    the block's record is renamed to ``call``'s name and place so the levels join up."""
    import torch

    from paritykit.tracing.trace import capture

    module = model.get_submodule(call.module)
    args, kwargs = to_device(call.call_inputs(), module_device(module))
    with torch.no_grad(), capture(model, modules=level_patterns(model, call.module)) as trace:
        module(*args, **kwargs)
    trace.graft(call)
    return trace


class NamespaceLevel(ParityKitError):
    r"""A level child was never called while its blocks were (research code calling a model's blocks from
    its pipeline): the two sides' levels cannot be paired one level at a time."""


def _capture_called(model: Any, name: str, call: Callable[[], Any]) -> Any:
    r"""Capture block ``name`` of ``model`` and its level children while ``call()`` runs. A child that was
    never called while modules inside it were raises :class:`NamespaceLevel` (the other side's level may be
    that child itself: levels would not pair); a child never called at all (an unused encoder) is just
    unused. Which modules ran is noted by pre-hooks that keep no tensor."""
    import glob

    import torch

    from paritykit.tracing.trace import capture

    children = level_children(model, name)
    patterns = [glob.escape(n) if n else n for n in (name, *children)]
    ran: set[str] = set()
    handles = [
        module.register_forward_pre_hook(lambda _m, _a, n=module_name: ran.add(n))
        for module_name, module in model.named_modules()
        if module_name
    ]
    try:
        with torch.no_grad(), capture(model, modules=patterns) as trace:
            call()
    finally:
        for handle in handles:
            handle.remove()
    uncalled = [c for c in children if c not in ran and any(n.startswith(c + ".") for n in ran)]
    if uncalled:
        raise NamespaceLevel(
            f"{', '.join(uncalled)} never called while the run went on: its blocks are called from outside it"
        )
    return trace


def capture_level(model: Any, args: tuple, kwargs: dict, *, run: Callable | None = None) -> Any:
    r"""Run ``model(*args, **kwargs)`` capturing only the top level and its level children; returns the trace.

    ``run(model, args, kwargs)`` replaces the plain call (the spec runner passes one that guards user code).
    """
    if run is not None:
        return _capture_called(model, "", lambda: run(model, args, kwargs))
    return _capture_called(model, "", lambda: model(*args, **kwargs))


def zoom_bisect(
    reference: Any,
    port: Any,
    ref_inputs: tuple[tuple, dict],
    port_inputs: tuple[tuple, dict],
    *,
    rules: Sequence[tuple[str, str]] = (),
    select_output: Callable[[str, Any], Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    ratio: float = 10.0,
    ops: bool = False,
    environment: dict[str, Any] | None = None,
    run: Callable | None = None,
    allow_masked: bool = False,
    repair: bool = True,
    repair_budget: int | None = None,
    catalogue: bool = True,
    float_floor: bool = True,
    started: float | None = None,
) -> Any:
    r""":func:`paritykit.bisect` by levels: same tests, same
    :class:`~paritykit.bisection.results.BisectReport`,
    peak memory of one level instead of every module.

    Args:
        reference, port: the two ``nn.Module`` (eval mode).
        ref_inputs, port_inputs: ``(args, kwargs)`` for each side.
        rules, select_output, atol, rtol, ratio, ops, environment, repair, catalogue: as in
            :func:`paritykit.bisect`.
        run: ``run(model, args, kwargs)`` in place of the plain top-level call.
        float_floor: measure failing replays in float64 (:mod:`paritykit.bisection.floor`); a zoom runs no
            whole float64 copy of the models (it is for models too large to capture whole).
        allow_masked: accept the ``masked`` verdict (a block failing on identical inputs while the final
            output matches). The zoom looks for it on the way down from the top-level blocks, then inside
            blocks whose captured outputs are not bit-identical (entered one level at a time, at most
            ``MAX_MASKED_CHECKS`` calls tested), where a full capture checks every differing call.

    Returns:
        A :class:`~paritykit.bisection.results.BisectReport`; its environment records ``levels: zoom`` and the
        blocks entered.
    """
    started = time.perf_counter() if started is None else started
    ref_trace = capture_level(reference, *ref_inputs, run=run)
    port_trace = capture_level(port, *port_inputs, run=run)
    zoom = ZoomSearch(reference, port, ref_trace, port_trace, rules=rules, atol=atol, rtol=rtol, ratio=ratio)
    if float_floor:
        zoom.float_floor = FloatFloor(reason="levels zoom: no whole float64 run")
    options = dict(atol=atol, rtol=rtol, ops=ops, environment=environment, allow_masked=allow_masked)
    explain = RepairOptions(enabled=repair, catalogue=catalogue, budget=repair_budget, started=started)
    return run_strategy(zoom, select_output=select_output, repair=explain, **options)


# ------------------------------------------------------------------------------------ two machines

TRACE_LEVELS = ("full", "blocks")


def trace_patterns(model: Any, levels: str = "full", inside: str | None = None) -> list[str] | None:
    r"""What ``paritykit trace`` hooks: everything (``full``), the top level and its blocks (``blocks``), or
    with ``inside=BLOCK`` the top level, that block and one level inside it (the blocks' outputs only are
    kept, whatever the model's size)."""
    if levels not in TRACE_LEVELS:
        raise ParityKitError(f"--levels {levels!r}: expected one of {', '.join(TRACE_LEVELS)}")
    if inside is not None:
        if inside not in dict(model.named_modules()):
            raise ParityKitError(f"--inside {inside!r}: the {type(model).__name__} model has no such module")
        return list(dict.fromkeys(["", *level_patterns(model, inside)]))
    return level_patterns(model, "") if levels == "blocks" else None


def trace_about(
    side: str, spec: Any, out: Any, device: str | None, levels: str, inside: str | None, loaded: Any = None
) -> dict[str, Any]:
    r"""What a trace folder says about itself (its manifest's ``about``): enough to write the next command,
    and to refuse a mix-up (side, the spec's content hash, the shapes and hash of its common inputs)."""
    from paritykit.base.report import environment_stamp

    identity = (
        {"spec_sha256": loaded.sha256, "inputs": loaded.input_fingerprint()} if loaded is not None else {}
    )
    return {
        "side": side,
        **identity,
        "spec": str(spec),
        "out": str(out),
        "device": device,
        "levels": "full" if levels == "full" and inside is None else "blocks",
        "inside": inside,
        "environment": environment_stamp(device=device or "cpu", spec=str(spec)),
    }


def write_fingerprints(model: Any, directory: Any) -> int:
    """``weights.json``: shape, dtype, sums and position hash of every weight
    (:func:`paritykit.tracing.split_traces.weight_fingerprints`), which a trace folder holds in place of a
    copy of the weights. Returns the number of tensors."""
    import json
    from pathlib import Path

    from paritykit.base.files import atomic_write_text
    from paritykit.forensics.conversion.layer_order import value_keys
    from paritykit.tracing.split_traces import weight_fingerprints
    from paritykit.tracing.trace import FINGERPRINTS_FILE

    def hasher(tensor: Any) -> int | None:
        keys = value_keys({"": tensor})
        return keys[""][2] if keys else None

    fingerprints = weight_fingerprints(model, hasher)
    atomic_write_text(Path(directory) / FINGERPRINTS_FILE, json.dumps(fingerprints, indent=1))
    return len(fingerprints)


def _children_in_table(modules: dict[str, Any], name: str) -> list[str]:
    prefix = name + "." if name else ""
    out = []
    for other, info in modules.items():
        rest = other[len(prefix) :] if other.startswith(prefix) and other != name else None
        if rest is None or "." in rest:
            continue
        if info.type in ("ModuleList", "ModuleDict"):
            out += _children_in_table(modules, other)
        else:
            out.append(other)
    return out


def next_trace_commands(report: Any, ref_trace: Trace, port_trace: Trace) -> list[str]:
    r"""When two traces hold a failing block's outputs but nothing inside it: the ``paritykit trace … --inside
    BLOCK`` command for each side (from what each folder says about itself) and the ``bisect`` to run next."""
    import shlex

    culprit = report.culprit
    if culprit is None or culprit.reference not in ref_trace or culprit.port not in port_trace:
        return []
    call = ref_trace[culprit.reference]
    if ref_trace.about.get("levels", "full") == "full" or any(r.parent == call.name for r in ref_trace):
        return []
    if not _children_in_table(ref_trace.modules, call.module):
        return []
    blocks = {"reference": call.module, "port": port_trace[culprit.port].module}
    outs, commands = [], []
    for side, trace in (("reference", ref_trace), ("port", port_trace)):
        about = trace.about
        base = str(about.get("out") or trace.directory).rstrip("/")
        base = base.rsplit("--inside-", 1)[0]
        out = f"{base}--inside-{blocks[side]}"
        outs.append(out)
        command = ["paritykit", "trace", about.get("spec", "SPEC.py"), "--side", side, "--out", out]
        command += ["--inside", blocks[side]]
        if about.get("device"):
            command += ["--device", about["device"]]
        commands.append(shlex.join(command))
    commands.append(shlex.join(["paritykit", "bisect", "--traces", *outs, "--zoom", call.module]))
    return commands
