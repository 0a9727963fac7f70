r"""Name the module where a port parts from its reference, and say why.

Both models run once under :func:`paritykit.tracing.trace.capture`;
:func:`paritykit.bisection.align.align_modules` pairs their
modules. Then, from the top level down, every aligned module is tested:

* **replay** (primary): the reference module's captured inputs are fed to the aligned port module *and* to the
  reference module, and the two outputs are compared. A module that fails on identical inputs is itself wrong,
  whatever happened upstream. Arguments are matched by path, else by order and shape, so ``forward(x, c)``
  replays into ``forward(hidden_states, conditioning_embedding)``.
* **error jump** (fallback, when replay is impossible: no models, no matching signature, a non-reproducible
  reference call): the module is blamed when its inputs agree within tolerance but its outputs do not, or
  when its relative output error is more than ``ratio`` (10) times its relative input error.

The culprit is the deepest aligned call that fails while none of its aligned children does. When it has
aligned children and all of them pass, the divergence is in its own ``forward`` (``inline``). At the culprit,
input-aware hints come first: ``remix`` (each side's output fitted as a linear combination of the module's
tensor inputs and its children's outputs; different coefficients mean one knob may stand for two concepts)
and ``constant-scale``, then the core hints of :func:`paritykit.compare.diagnose.diagnose`.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from paritykit.base.errors import ParityKitError
from paritykit.base.inputs import copy_inputs, split_inputs, to_device
from paritykit.base.precision import exact_float32
from paritykit.base.report import format_number
from paritykit.bisection.align import Alignment, align_modules
from paritykit.bisection.findings import culprit_finding
from paritykit.bisection.floor import FloatFloor
from paritykit.bisection.floor import measure as measure_floor
from paritykit.bisection.leaves import (
    final_output,
    flatten_tensors,
    module_device,
    pair_leaves,
    replace_leaves,
    torch_equal,
)
from paritykit.bisection.repair.culprit_sites import RepairOptions
from paritykit.bisection.results import BisectReport, ModuleFinding, shown_name
from paritykit.bisection.searcher import JUMP_RATIO, Searcher, join_notes
from paritykit.bisection.strategy import FullSearch, run_strategy
from paritykit.tracing.trace import module_of

if TYPE_CHECKING:
    from paritykit.tracing.trace import Trace


def bisect_traces(
    ref_trace: Trace,
    port_trace: Trace,
    alignment: Alignment | None = None,
    *,
    reference: Any = None,
    port: Any = None,
    rules: Sequence[tuple[str, str]] = (),
    select_output: Callable[[str, Any], Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    ratio: float = JUMP_RATIO,
    ops: bool = False,
    environment: dict[str, Any] | None = None,
    allow_masked: bool = False,
    all_culprits: bool = False,
    repair: bool = True,
    repair_budget: int | None = None,
    catalogue: bool = True,
    float_floor: FloatFloor | None = None,
    started: float | None = None,
) -> BisectReport:
    r"""Find the culprit from two traces (e.g. written in two environments by ``paritykit trace``).

    With ``port`` (and ideally ``reference``) given, calls are replayed; without them every test is an error
    jump over the captured tensors. ``ops=True`` re-runs a replayed culprit under an op logger on both sides
    and names the first op whose result differs (:func:`op_divergence`).

    When the final output matches, the search still runs: an aligned module (medium or high confidence) that
    fails on identical inputs makes the verdict ``masked`` (exit 1 unless ``allow_masked``).
    ``all_culprits=True`` (needs ``port``) replaces each culprit's output in the port by the reference's and
    searches again, until the port's output matches or no further culprit is found (:func:`every_culprit`).
    ``repair=False`` skips the repair search at culprits (:mod:`paritykit.bisection.repair`);
    ``catalogue=False`` skips the catalogue's detectors (to measure the repair search alone).
    ``float_floor`` (:mod:`paritykit.bisection.floor`) makes differences at float-noise level no difference:
    failing replays are measured in float64, and with its float64 traces every captured call and the output.
    ``started`` (``time.perf_counter()`` when the capture began; default: now) sets the repair search's clock:
    without ``repair_budget`` it takes no longer than the bisect had run when it began.
    """
    started = time.perf_counter() if started is None else started
    if alignment is None:
        alignment = align_modules(reference, port, ref_trace, port_trace, rules=rules)
    ref_root, port_root = ref_trace.root, port_trace.root
    if ref_root is None or port_root is None:
        raise ParityKitError("both traces must include the top-level call (capture the whole model)")
    if atol is None and rtol is None:
        rtol, atol = _reference_tolerances(ref_root, port_root, select_output)
    searcher = Searcher(
        ref_trace, port_trace, alignment, reference=reference, port=port, atol=atol, rtol=rtol, ratio=ratio
    )
    searcher.float_floor = float_floor
    searcher.select_output = select_output
    explain = RepairOptions(enabled=repair, catalogue=catalogue, budget=repair_budget, started=started)
    options = dict(atol=atol, rtol=rtol, ops=ops, environment=environment, allow_masked=allow_masked)
    report = run_strategy(FullSearch(searcher), select_output=select_output, repair=explain, **options)
    if reference is not None and port is not None:
        from paritykit.bisection.evidence.settings import config_differences

        pairs = [(p.reference, p.port) for p in alignment.one_to_one]
        report.config_differences = config_differences(reference, port, pairs)
        for finding in report.culprits or [report.culprit]:
            if finding is not None:
                spread_of_settings(finding, report.config_differences, port, len(pairs))
    if all_culprits and report.culprit is not None:
        ref_final = final_output("reference", ref_root.output_value(), select_output)
        every_culprit(report, searcher, ref_final, select_output=select_output, ops=ops, repair=explain)
    return report


def _reference_tolerances(
    ref_root: Any, port_root: Any, select_output: Callable | None
) -> tuple[float | None, float | None]:
    r"""The default tolerances when the two sides compute in different precisions: the reference's dtype's
    (a port in bfloat16 against a float32 reference is held to float32's, so computing in lower precision is
    found, never excused); ``(None, None)`` (each pair's own dtypes) otherwise."""
    from paritykit.compare.tolerances import default_tolerances

    try:
        ref = final_output("reference", ref_root.output_value(), select_output)
        port = final_output("port", port_root.output_value(), select_output)
    except Exception:  # an output that cannot be read here is compared, and reported, later
        return None, None
    if not (ref.is_floating_point() and port.is_floating_point()) or ref.dtype == port.dtype:
        return None, None
    if _precision(port.dtype) >= _precision(ref.dtype):
        return None, None
    return default_tolerances(ref.dtype, ref.dtype)


def _precision(dtype: Any) -> int:
    r"""An order of floating-point precision: bfloat16 < float16 < float32 < float64 (bits, then mantissa)."""
    import torch

    info = torch.finfo(dtype)
    return info.bits * 1000 - int(info.eps * 1e6)  # bfloat16's eps (2^-7) is coarser than float16's (2^-10)


# ------------------------------------------------------------------------------------- every culprit (--all)

MAX_CULPRITS = 8


def _after_substitution(found: ModuleFinding, before: list[ModuleFinding]) -> None:
    r"""A culprit found with the earlier ones given the reference's outputs: said so in its note, and its
    setting hints about modules inside those culprits dropped (what they name is already substituted)."""
    done = [c.port for c in before if c.port]
    done_ref = [module_of(c.reference) for c in before if c.reference]

    def substituted(path: str, modules: list[str] = done) -> bool:
        return any(path == d or path.startswith(d + ".") for d in modules)

    def full(prefix: str, name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    kept = []
    for hint in found.hints:
        evidence = hint.evidence if isinstance(hint.evidence, dict) else {}
        differences = evidence.get("differences") or [evidence.get("difference")]
        about = [d.get("port", "") for d in differences if isinstance(d, dict)]
        if hint.id == "module-config" and about and all(substituted(path) for path in about):
            continue
        # a weights hint whose tensors all sit in modules already given the reference's outputs
        explained = [*(evidence.get(k) or {} for k in ("offsets", "exponentiated", "scaled", "gathered"))]
        port_names = [
            full(found.port, n)
            for n in [
                *(evidence.get("unmatched_port") or []),
                *(evidence.get("unmatched_buffers") or []),
                *(n for e in explained for n in e),
            ]
        ]
        ref_names = [full(module_of(found.reference), n) for n in evidence.get("unused_reference") or []]
        if (
            hint.id == "weights"
            and (port_names or ref_names)
            and all(substituted(n) for n in port_names)
            and all(substituted(n, done_ref) for n in ref_names)
        ):
            continue
        kept.append(hint)
    found.hints = kept
    names = ", ".join(shown_name(c.reference) for c in before)
    found.note = join_notes(f"measured with the reference's outputs in place of {names}", found.note)


def every_culprit(
    report: BisectReport,
    searcher: Searcher,
    ref_final: Any,
    *,
    select_output: Callable | None = None,
    ops: bool = False,
    repair: RepairOptions | None = None,
) -> None:
    r"""Extend ``report.culprits`` to every independent culprit, in execution order.

    Each culprit found so far is given the reference's behaviour in the port (a forward hook returning the
    reference call's captured output, adapted to the port's output structure); the port runs again on its
    captured inputs and the search restarts. It stops when the port's output matches
    (``report.output_after``), when no new culprit is found, or when a culprit cannot be substituted.
    """
    import torch

    from paritykit.compare.tensors import compare_tensors
    from paritykit.tracing.trace import capture

    port, port_root = searcher.port_modules.get(""), searcher.port_trace.root
    if port is None or port_root is None or not port_root.replayable:
        report.all_note = "--all: not searched further (needs the port model and its captured inputs)"
        return
    args, kwargs = to_device(port_root.call_inputs(), module_device(port))
    handles: list[Any] = []
    try:
        while len(report.culprits) < MAX_CULPRITS:
            last = report.culprits[-1]
            if not last.reference:
                report.all_note = "--all: stopped at the top level's own forward (nothing to substitute)"
                return
            handle = _substitute(searcher, module_of(last.reference))
            if handle is None:
                report.all_note = (
                    f"--all: stopped: the reference output of {shown_name(last.reference)} cannot be put in"
                    " place of the port's (outputs do not pair)"
                )
                return
            handles.append(handle)
            with torch.no_grad(), capture(port) as trace:
                port(*args, **kwargs)
            port_final = final_output("port", trace.root.output_value(), select_output)
            output = compare_tensors(
                ref_final, port_final, atol=searcher.atol, rtol=searcher.rtol, name="output"
            )
            report.output_after = output
            again = Searcher(
                searcher.ref_trace,
                trace,
                searcher.alignment,
                reference=None,
                port=None,
                atol=searcher.atol,
                rtol=searcher.rtol,
                ratio=searcher.ratio,
            )
            again.ref_modules, again.port_modules = searcher.ref_modules, searcher.port_modules
            again.select_output = searcher.select_output
            with torch.no_grad():
                call, passed = again.descend(searcher.ref_trace.root)
                if output.passed:
                    # a matching output still hides the next masked culprit, if any
                    hidden = (
                        (call, passed) if call.parent is not None and again.masking() else again.masked_call()
                    )
                    if hidden is None:
                        break
                    call, passed = hidden
                if call.name in {c.reference for c in report.culprits}:
                    break
                found = culprit_finding(again, call, passed, output, ops=ops, repair=repair)
                _after_substitution(found, report.culprits)
                report.culprits.append(found)
            report.tested += [t for t in again.results.values() if t.reference not in searcher.results]
    finally:
        for handle in handles:
            handle.remove()
    order = {r.name: i for i, r in enumerate(searcher.ref_trace.records)}
    report.culprits.sort(key=lambda c: order.get(c.reference, 1 << 30))
    after = report.output_after
    if after is not None:
        state = (
            "matches"
            if after.passed
            else f"still differs (max_abs {format_number(after.max_abs)})"
            if after.max_abs is not None
            else "is not compared: it has another shape than the reference's"
        )
        report.all_note = join_notes(
            report.all_note,
            f"with the {len(report.culprits)} culprit(s) given the reference's outputs, the port's output"
            f" {state}",
        )


def _substitute(searcher: Searcher, reference: str) -> Any:
    """Hook the aligned port module so it returns the reference's captured output for the call whose captured
    inputs are nearest its own (so replays of its parents see the substitution too)."""
    pair = searcher.alignment.pair_of(reference)
    module = searcher.port_modules.get(pair.port) if pair is not None else None
    calls = searcher.ref_trace.calls(reference)
    if module is None or not calls:
        return None

    def hook(mod: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        leaves = flatten_tensors((args, kwargs), "input")
        best = min(calls, key=lambda record: _distance(list(record.inputs.items()), leaves))
        replaced = replace_leaves(output, list(best.outputs.items()))
        return output if replaced is None else replaced

    probe = replace_leaves(searcher.port_trace[pair.port].output_value(), list(calls[0].outputs.items()))
    if probe is None:
        return None
    return module.register_forward_hook(hook, with_kwargs=True)


def _distance(ref_leaves: list, port_leaves: list) -> float:
    pairs = pair_leaves(ref_leaves, port_leaves)
    if not pairs:
        return math.inf
    total = 0.0
    for i, j in pairs:
        a, b = ref_leaves[i][1], port_leaves[j][1]
        if a.is_floating_point() and b.is_floating_point():
            total += float((a.double().cpu() - b.detach().double().cpu()).abs().max()) if a.numel() else 0.0
        elif not torch_equal(a, b):
            total += 1.0
    return total


@exact_float32()
def bisect(
    reference: Any,
    port: Any,
    inputs: Any,
    *,
    rules: Sequence[tuple[str, str]] = (),
    port_inputs: Callable[[tuple, dict], Any] | None = None,
    select_output: Callable[[str, Any], Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    ratio: float = JUMP_RATIO,
    ops: bool = False,
    environment: dict[str, Any] | None = None,
    levels: str = "auto",
    allow_masked: bool = False,
    all_culprits: bool = False,
    repair: bool = True,
    repair_budget: int | None = None,
    catalogue: bool = True,
    float_floor: bool = True,
) -> BisectReport:
    r"""Run both models on the same inputs and name the module where the port parts from the reference.

    Args:
        reference: the reference ``nn.Module`` (put it in eval mode first; dropout defeats replay).
        port: the port ``nn.Module``.
        inputs: ``(args, kwargs)`` or a kwargs dict, fed to both.
        rules: ``[(regex, repl), …]`` renaming reference module names into the port's naming.
        port_inputs: ``port_inputs(args, kwargs) -> (args, kwargs) | kwargs`` adapting the inputs to the port.
        select_output: ``select_output(side, output) -> Tensor`` picking the comparable tensor of each side
            (``side`` is ``"reference"`` or ``"port"``); default: the first tensor of the output.
        atol, rtol: tolerances (default: :func:`paritykit.compare.default_tolerances` of the dtypes).
        ratio: error-jump threshold (output error over input error) where replay is impossible.
        ops: also name the first op inside a replayed culprit whose result differs.
        allow_masked: accept the ``masked`` verdict (exit code 0).
        all_culprits: after each culprit, give it the reference's output in the port and search again, so
            ``culprits`` lists every independent one in execution order.
        repair: at each culprit, search the small edits of the port that make it match the reference and
            report the verified ones (``fix (verified)``); ``False`` is ``--no-repair``.
        repair_budget: the edits the repair search may try at one culprit (``--repair-budget N``); default: a
            count that grows with the culprit's size. Counted, not timed: the report is the same anywhere.
        catalogue: run the catalogue's detectors at each culprit (``False`` only to measure the repair
            search).
        float_floor: run both sides once more in float64 when float64 copies fit in memory, so a
            difference within a small multiple of the larger side's float32 error is float noise, not a
            divergence (:mod:`paritykit.bisection.floor`); ``False`` is ``--no-float-floor``.
        levels: ``full`` captures every module at once; ``zoom`` captures one level of blocks at a time
            (:mod:`paritykit.bisection.zoom`); ``auto`` zooms when the reference's parameters take more than
            1 GiB or are offloaded by accelerate.

    Returns:
        A :class:`BisectReport`: ``verdict`` (``match``/``diverge``/``masked``), ``culprit`` (and
        ``culprits``), ``first_output_divergence``, the alignment, every module tested, ``exit_code``.
    """
    made = split_inputs(inputs)
    args, kwargs = copy_inputs(made)
    if port_inputs is not None:
        from paritykit.base.errors import UserCodeError

        try:
            adapted = port_inputs(*copy_inputs(made))
        except Exception as exc:
            raise UserCodeError(f"port_inputs raised {type(exc).__name__}: {exc}") from exc
        port_args, port_kwargs = split_inputs(adapted)
    else:
        port_args, port_kwargs = copy_inputs(made)
    return capture_and_bisect(
        reference,
        port,
        (args, kwargs),
        (port_args, port_kwargs),
        rules=rules,
        select_output=select_output,
        atol=atol,
        rtol=rtol,
        ratio=ratio,
        ops=ops,
        environment=environment,
        levels=levels,
        allow_masked=allow_masked,
        all_culprits=all_culprits,
        repair=repair,
        repair_budget=repair_budget,
        catalogue=catalogue,
        float_floor=float_floor,
    )


def capture_and_bisect(
    reference: Any,
    port: Any,
    ref_call: tuple[tuple, dict],
    port_call: tuple[tuple, dict],
    *,
    run: Callable[[Any, tuple, dict], Any] | None = None,
    levels: str = "auto",
    all_culprits: bool = False,
    float_floor: bool = True,
    **search: Any,
) -> BisectReport:
    r"""Run both sides on their inputs under capture and search the two traces (by levels when ``levels``
    asks for it). ``run(model, args, kwargs)`` replaces the plain call (a spec guards user code with it);
    ``search`` holds :func:`bisect_traces`' options."""
    import torch

    from paritykit.bisection.zoom import NamespaceLevel, use_zoom, zoom_bisect
    from paritykit.tracing.trace import capture

    search.setdefault("started", time.perf_counter())

    # --all substitutes modules anywhere in the port and re-runs it whole: it needs every module captured
    if not all_culprits and use_zoom(levels, reference):
        try:
            return zoom_bisect(
                reference, port, ref_call, port_call, run=run, float_floor=float_floor, **search
            )
        except NamespaceLevel as exc:
            if levels == "zoom":
                raise ParityKitError(f"--levels zoom: {exc}; use --levels full") from None
            environment = dict(search.get("environment") or {})
            environment["levels"] = f"full (the zoom cannot pair levels: {exc})"
            search["environment"] = environment
    call = run or (lambda model, args, kwargs: model(*args, **kwargs))
    clean = (
        (copy_inputs(ref_call), copy_inputs(port_call)) if float_floor else None
    )  # before any in-place edit
    with torch.no_grad():
        with capture(reference) as ref_trace:
            call(reference, *ref_call)
        with capture(port) as port_trace:
            call(port, *port_call)
    floor = None
    if clean is not None:
        outputs = (ref_trace.root.output_value(), port_trace.root.output_value())
        floor = measure_floor(reference, port, *clean, run=run, outputs=outputs)
    return bisect_traces(
        ref_trace,
        port_trace,
        reference=reference,
        port=port,
        all_culprits=all_culprits,
        float_floor=floor,
        **search,
    )


def spread_of_settings(finding: Any, differences: list[Any], port: Any, pairs: int) -> None:
    r"""A culprit whose hint names a setting that differs: how many aligned module pairs of the whole models
    differ in that setting the same way (a model config key, not one module), and the port's config keys
    that hold the port's value under a name that contains the setting's (``norm_num_groups`` for
    ``num_groups``), said in the hint."""
    for hint in finding.hints:
        evidence = (hint.evidence or {}) if hint.id == "module-config" else {}
        found = evidence.get("difference") or next(iter(evidence.get("differences") or []), None)
        if not found or found.get("kind") not in ("attribute", "parameter"):
            continue
        # compared as to_dict writes them (tuples as lists)
        pick = operator.itemgetter("attr", "reference_value", "port_value", "kind")
        same = [d for d in differences if pick(d.to_dict()) == pick(found)]
        if len(same) < 2:
            continue
        # a parameter the port lacks: the attribute of the same module that differs too names the config key
        # (LayerNorm's elementwise_affine for its weight)
        setting = found
        if found["kind"] == "parameter":
            owner = ".".join(p for p in (finding.reference, found["reference"]) if p)
            setting = next(
                (d.to_dict() for d in differences if d.kind == "attribute" and d.reference == owner), found
            )
        config = getattr(port, "config", None)
        keys = [
            k
            for k, v in (dict(config) if isinstance(config, dict) else {}).items()
            if setting["attr"] in k and v == setting["port_value"]
        ]
        hint.message += (
            f"; the same setting differs the same way in {len(same)} aligned module pairs of the two models"
            " (every one compared)"
            + (f"; the port's config holds {', '.join(f'{k}={config[k]!r}' for k in keys)}" if keys else "")
        )
