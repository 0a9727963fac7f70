r"""From a located call to a culprit finding: its tests, hints and verified fixes (evidence, remix, module
fits, inline-reference hints), and the first output that differs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from paritykit.base.inputs import copy_inputs, is_tensor, to_device
from paritykit.bisection.align import Alignment
from paritykit.bisection.floor import FloatFloor, within
from paritykit.bisection.leaves import flatten_tensors, in_layout, module_device, output_leaves, pair_layouts
from paritykit.bisection.mix_fits import culprit_hints
from paritykit.bisection.ops import op_divergence
from paritykit.bisection.repair.culprit_sites import RepairOptions, repair_hints
from paritykit.bisection.results import ModuleFinding, ModuleTest, shown_name
from paritykit.bisection.searcher import Searcher, join_notes
from paritykit.tracing.trace import call_name

if TYPE_CHECKING:
    from paritykit.tracing.trace import Record, Trace


def first_divergence(
    ref_trace: Trace,
    port_trace: Trace,
    alignment: Alignment,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    confidence: Sequence[str] = ("high", "medium", "low"),
    port_record: Callable[[Record], Record | None] | None = None,
    floor: FloatFloor | None = None,
    layouts: dict[str, dict[str, tuple[int, ...]]] | None = None,
    done_after: Callable[[Record, Any], str] | None = None,
) -> ModuleFinding | None:
    r"""The first aligned call, in completion order, whose *captured* outputs differ between the two traces.

    This is where the error first becomes visible, not necessarily where it is made (it may come in with the
    inputs); :func:`bisect` finds the latter. Only pairs aligned with one of ``confidence`` take part.
    ``port_record`` pairs a reference call with its port call (a searcher's, by input value); default: the
    aligned module's call in the same place of the order. With a measured ``floor``, a call whose outputs
    differ by float noise only is passed over. ``layouts`` (a searcher's, by reference call): the dim orders
    its replays measured for a call's port outputs, applied before comparing. ``done_after(record,
    port_leaves)`` (a searcher's): a non-empty note where the port's outputs are what the reference holds at
    its next call, a pair whose boundaries differ: passed over.
    """
    from paritykit.compare.tensors import compare_tensors

    for record in ref_trace.completion_order():
        pair = alignment.pair_of(record.module)
        if pair is None or pair.layout or pair.confidence not in confidence:
            continue
        if port_record is not None:
            other = port_record(record)
        else:
            name = call_name(pair.port, record.call)
            other = port_trace[name] if name in port_trace else None
        if other is None:
            continue
        port_call = other.name
        a = list(record.outputs.items())
        b_leaves = in_layout(list(other.outputs.items()), (layouts or {}).get(record.name, {}))
        found = pair_layouts(a, b_leaves, same_shape=True)
        if found is None:
            continue
        pairs, b, _ = found
        for i, j in pairs:
            cmp = compare_tensors(a[i][1], b[j][1], atol=atol, rtol=rtol, name=record.name)
            if not cmp.passed and floor is not None and within(cmp.max_abs, floor.of(record, other)):
                continue
            if not cmp.passed and done_after is not None and done_after(record, b_leaves):
                break
            if not cmp.passed:
                from paritykit.bisection.value_relations import relate

                return ModuleFinding(
                    record.name,
                    port_call,
                    pair.how,
                    "output",
                    cmp.max_abs,
                    cmp.cosine,
                    hints=list(cmp.hints),
                    confidence=pair.confidence,
                    # how the captured outputs relate there (not replayed: the error may come with the inputs)
                    relations=relate(a[i][1], b[j][1]),
                )
    return None


def culprit_finding(
    searcher: Searcher,
    call: Record,
    children_passed: int,
    output: Any,
    ops: bool = False,
    repair: RepairOptions | None = None,
) -> ModuleFinding:
    r"""The finding at a located call: its test, the catalogue's hints (unless ``repair.catalogue`` is off)
    and the repair search's verified edits (unless ``repair.enabled`` is off), and the first differing op
    (``ops``)."""
    repair = repair if repair is not None else RepairOptions()
    alignment = searcher.alignment
    port_call = searcher.port_record(call)
    pair = alignment.pair_of(call.module)
    untested = _untested_inside(alignment, call.module)

    def explained(result: ModuleTest | None) -> list:
        """The catalogue's hints (unless switched off), then the repair search's verified edits."""
        hints = (
            _catalogue_hints(searcher, call, port_call, children_passed, result, output)
            if repair.catalogue
            else []
        )
        at = port_call if port_call is not None or call.parent is not None else searcher.port_trace.root
        found = repair_hints(searcher, call, at, hints, repair, inline=children_passed > 0)
        for h in found:  # a repair's verified edit measured on the whole port too
            site_edit = getattr(h, "site_edit", None)
            if h.verified and site_edit is not None and "model_max_abs_after" not in h.evidence:
                try:
                    after, before = whole_output_with(searcher, *site_edit)
                except Exception:
                    continue
                h.evidence["model_max_abs_after"], h.evidence["model_max_abs_before"] = after, before
        return found

    if call.parent is None:
        # Nothing below the top level fails: the top level's own forward differs.
        return ModuleFinding(
            call.name,
            port_call.name if port_call else "",
            pair.how if pair else "names",
            "output",
            output.max_abs,
            output.cosine,
            inline=children_passed > 0,
            children_passed=children_passed,
            hints=explained(None),
            note=untested,
            uncompared=bool(untested),
            ops_note=(
                "--ops: not traced: the culprit is the top level, found from the final output (ops are traced"
                " in a module replayed on the reference's inputs)"
                if ops
                else ""
            ),
        )
    result = searcher.results[call.name]
    op, ops_note = None, ""
    if ops and result.test != "replay":
        ops_note = (
            "--ops: not traced: the culprit was found from capture, not replayed ("
            + (searcher.why_not_replayed.get(call.name) or "no replay")
            + ")"
        )
    elif ops:
        ref_module = searcher.ref_modules.get(call.module)
        port_module = searcher.port_modules.get(port_call.module)
        adapted = searcher.adapt_inputs(call, port_call, module_device(port_module))
        if ref_module is None or adapted is None:
            ops_note = "--ops: not traced: the reference model is not at hand to replay (give SPEC.py)"
        else:
            op = op_divergence(
                ref_module, port_module, call.call_inputs(), adapted, atol=searcher.atol, rtol=searcher.rtol
            )
            if op is None:
                ops_note = (
                    "--ops: no port op differs while its inputs agree: the difference is made by ops whose"
                    " inputs already differ in layout or value from every reference op's, or by the"
                    " module's submodules (see the table)"
                )
    return ModuleFinding(
        call.name,
        port_call.name,
        pair.how,
        result.test,
        result.max_abs,
        result.cosine,
        inline=children_passed > 0,
        children_passed=children_passed,
        hints=explained(result),
        confidence=pair.confidence,
        note=join_notes(result.note, untested),
        uncompared=bool(untested),
        op=op,
        ops_note=ops_note,
    )


def _catalogue_hints(
    searcher: Searcher,
    call: Record,
    port_call: Record | None,
    children_passed: int,
    result: ModuleTest | None,
    output: Any,
) -> list:
    """The catalogue's hints at a culprit: evidence and tensor signatures at the call, then the inline
    reference's and (for a replayed call below the top) the extra inputs' producers; ``result`` is ``None`` at
    the top level, whose final ``output`` comparison stands in for a module test."""
    before = result.max_abs if result is not None else output.max_abs
    at_call = _hints_at(searcher, call, port_call, result, output if result is None else None)
    hints = _with_inline(searcher, call, port_call, children_passed, before, at_call)
    return hints if result is None else _with_extra_inputs(searcher, call, port_call, before, hints)


def _with_extra_inputs(
    searcher: Searcher, call: Record, port_call: Record | None, before: float | None, hints: list
) -> list:
    """At a culprit replayed with some port inputs taken from the port's own run (the reference computes them
    inside the module), the port modules producing them and a verified constructor fit of those
    (:func:`paritykit.bisection.extra_inputs.extra_input_hints`); a verified fix goes first."""
    if not searcher.own_input_paths(call, port_call) or any(h.verified for h in hints):
        return hints
    from paritykit.bisection.extra_inputs import extra_input_hints

    extra = extra_input_hints(searcher, call, port_call, before)
    verified = [h for h in extra if h.verified]
    if not verified:
        return [*hints, *extra]
    # the difference is traced to the port module the fit changed: "the forward code differs" no longer stands
    rest = [h for h in extra if not h.verified]
    return [*verified, *(h for h in hints if h.id != "no-signature"), *rest]


def _with_inline(
    searcher: Searcher,
    call: Record,
    port_call: Record | None,
    children_passed: int,
    before: float | None,
    hints: list,
) -> list:
    """At an inline culprit, the evidence of the first differing child input goes first
    (:func:`paritykit.bisection.module_fit.inline_reference_hints`); a "forward code differs" hint then no
    longer stands, since the difference was traced to a port module the reference has no counterpart for."""
    if children_passed == 0 or port_call is None:
        return hints
    if any(h.verified for h in hints):
        return hints  # a fix verified at the culprit (paritykit.bisection.evidence) explains all of it
    from paritykit.bisection.module_fit import inline_reference_hints

    extra = inline_reference_hints(searcher, call, port_call, before)
    if not extra:
        return hints
    seen = {h.id for h in extra}
    if not seen & {"inline-reference", "module-fit"}:
        # only where the difference shows (inside the culprit's own forward): the causes found so far lead
        return [*hints, *(h for h in extra if h.id not in {g.id for g in hints})]
    # "the forward code differs" no longer stands once the difference is traced to a port module; a cause
    # named at the culprit (an activation refitted inside it) leads an unverified locating hint
    causes = [h for h in hints if h.id != "no-signature" and h.id not in seen]
    return [*(h for h in extra if h.verified), *causes, *(h for h in extra if not h.verified)]


def _untested_inside(alignment: Alignment, module: str) -> str:
    """Name the correspondences under ``module`` that replay cannot check one-to-one (they may hide the
    bug)."""
    prefix = module + "." if module else ""
    groups = sorted({p.reference for p in alignment.pairs if p.group and p.reference.startswith(prefix)})
    layouts = [p for p in alignment.pairs if p.layout and p.reference.startswith(prefix)]
    notes = []
    if groups:
        notes.append(f"fused<->split parameters not replayed one-to-one: {', '.join(groups[:4])}")
    if layouts:
        shown = ", ".join(f"{p.reference} ({p.layout})" for p in layouts[:4])
        notes.append(f"outputs reordered by the weight conversion, not compared: {shown}")
    return "; ".join(notes)


def _hints_at(
    searcher: Searcher, call: Record, port_call: Record | None, result: ModuleTest | None, output: Any
) -> list:
    """Evidence at the culprit (:func:`paritykit.bisection.evidence.collect.culprit_evidence`: configuration,
    activation, fitted constants, weight slices, each fix verified on a copy of the port), with the
    input-aware and tensor-level hints on its first differing output pair (its inputs and its children's
    outputs as mixing candidates)."""
    from paritykit.bisection.evidence.collect import culprit_evidence
    from paritykit.compare.diagnose import diagnose

    kept = (
        searcher.replayed_outputs(call, port_call) if result is not None and result.test == "replay" else None
    )
    replayed = kept is not None
    if replayed:
        ref_leaves, port_leaves = kept
    else:
        ref_leaves = list(call.outputs.items())
        port_leaves = list(port_call.outputs.items()) if port_call is not None else []
    pairs, port_leaves, _ = pair_layouts(ref_leaves, port_leaves, same_shape=True) or ([], port_leaves, {})
    worst = next(
        (
            (i, j)
            for i, j in pairs
            if not searcher.compare(ref_leaves[i][1], port_leaves[j][1], call.name).passed
        ),
        None,
    )
    if worst is None:
        return []
    i, j = worst
    a, b = ref_leaves[i][1], port_leaves[j][1]
    candidates = list(call.inputs.items())
    for child in searcher.frontier(call):
        child_out = child.output
        if child_out is not None:
            candidates.append((f"{child.name} output", child_out))
    tensor_hints = culprit_hints(a, b, candidates, diagnose(a, b))
    context = _culprit_context(searcher, call, port_call, ref_leaves, (i, j), replayed)
    return culprit_evidence(context, tensor_hints)


def _culprit_context(
    searcher: Searcher,
    call: Record,
    port_call: Record | None,
    ref_leaves: list,
    leaf: tuple[int, int],
    replayed: bool,
) -> Any:
    """The culprit as :mod:`paritykit.bisection.evidence` sees it: modules, outputs, and ways to re-run either
    side."""
    from paritykit.bisection.evidence.culprit import Culprit

    i, j = leaf
    ref_module = searcher.ref_modules.get(call.module)
    port_module = searcher.port_modules.get(port_call.module) if port_call is not None else None
    ref_out = ref_leaves[i][1]
    port_out = searcher.replays[call.name][1][j][1] if replayed else list(port_call.outputs.items())[j][1]

    def ref_inputs() -> tuple[tuple, dict] | None:
        if ref_module is None or not call.replayable:
            return None
        return copy_inputs(to_device(call.call_inputs(), module_device(ref_module)))

    def port_inputs() -> tuple[tuple, dict] | None:
        if port_module is None or port_call is None:
            return None
        return searcher.adapt_inputs(call, port_call, module_device(port_module))

    def leaf_of(fn: Callable, inputs: tuple[tuple, dict] | None, index: int) -> Any:
        if inputs is None:
            raise ValueError("the call cannot be re-run")
        return output_leaves(fn(*inputs[0], **inputs[1]))[index][1]

    def check(fn: Callable) -> tuple[bool, float]:
        inputs = port_inputs()
        if inputs is None:
            raise ValueError("the port call cannot be re-run")
        cmp = searcher.compare_leaves(ref_leaves, output_leaves(fn(*inputs[0], **inputs[1])), call.name)
        return (cmp is not None and cmp.passed), (cmp.max_abs if cmp is not None else math.inf)

    def run_check(fn: Callable) -> tuple[bool, float]:
        r"""``fn`` on the port's own captured inputs of this call, against the reference's captured outputs:
        whether an edit verified on the reference's inputs also fixes the port's run."""
        args, kwargs = copy_inputs(to_device(port_call.call_inputs(), module_device(port_module)))
        cmp = searcher.compare_leaves(ref_leaves, output_leaves(fn(*args, **kwargs)), call.name)
        return (cmp is not None and cmp.passed), (cmp.max_abs if cmp is not None else math.inf)

    # a port fed other inputs in its run than the reference's: a fix verified on those is tried on its own
    fed_otherwise = (
        port_module is not None
        and port_call is not None
        and port_call.replayable
        and not searcher.inputs_agree(call, port_call)
    )
    subpairs = searcher.alignment.inside(call.module, port_call.module if port_call is not None else "")
    matched = {
        pair
        for pair in subpairs
        if _matched_replayed(searcher, ".".join(p for p in (call.module, pair[0]) if p))
    }
    unpaired = {
        pair for pair in subpairs if _unpaired(searcher, ".".join(p for p in (call.module, pair[0]) if p))
    }

    def model_check(make: Callable) -> tuple[float, float]:
        if port_call is None:
            raise ValueError("no port call")
        return whole_output_with(searcher, port_call.module, make)

    # fits and verification compare against the replayed outputs: only a replay fed both sides the same inputs
    can_run = replayed
    return Culprit(
        reference_name=call.module,
        port_name=port_call.module if port_call is not None else "",
        reference=ref_module,
        port=port_module,
        reference_output=ref_out,
        port_output=port_out,
        run_reference=(
            (lambda fn: leaf_of(fn, ref_inputs(), i)) if ref_module is not None and can_run else None
        ),
        run_port=(lambda fn: leaf_of(fn, port_inputs(), j)) if port_module is not None and can_run else None,
        check=check if port_module is not None and can_run else None,
        run_check=run_check if fed_otherwise and can_run else None,
        subpairs=subpairs,
        matched_subpairs=matched,
        unpaired_subpairs=unpaired,
        reference_inputs=ref_inputs() if can_run else None,
        port_model=searcher.port_modules.get(""),
        reference_model=searcher.ref_modules.get(""),
        model_check=model_check if port_module is not None and can_run else None,
        own_inputs=_own_inputs(searcher, call, port_call, port_module),
    )


def _matched_replayed(searcher: Searcher, module: str) -> bool:
    r"""Whether every captured call of the reference ``module`` was replayed and matched within the tolerance
    on identical inputs (a pass by a note, outputs that agree only in the runs, is no match here)."""
    calls = searcher.ref_trace.calls(module)
    tests = [searcher.results.get(record.name) for record in calls]
    return bool(tests) and all(
        t is not None and t.test == "replay" and t.comparison is not None and t.comparison.passed
        for t in tests
    )


def _unpaired(searcher: Searcher, module: str) -> bool:
    r"""Whether no captured call of the reference ``module`` had inputs its aligned port call could take."""
    tests = [searcher.results.get(record.name) for record in searcher.ref_trace.calls(module)]
    return bool(tests) and all(t is not None and t.status == "untestable" for t in tests)


def place_relations(
    searcher: Searcher,
    call: Record,
    pair: tuple[Any, Any] | None = None,
    verify: tuple[Any, Callable | None] | None = None,
) -> list[Any]:
    r"""How the port's tensor relates to the reference's at a located call
    (:mod:`paritykit.bisection.value_relations`): its first differing output leaf as replayed on the
    reference's inputs (or ``pair``, the two final outputs at the top level). A missing-term fit may use the
    call's input tensors, its children's outputs and their products with a modulation vector among its inputs.

    ``verify=(reference final output, select_output)``: each relation is undone at the call in a run of the
    whole port (a forward hook), and ``verified`` says whether the port's final output then matches.
    """
    import torch

    from paritykit.bisection.value_relations import relate

    leaf = 0
    if pair is None:
        replayed = searcher.replays.get(call.name)
        if replayed is None:
            return []
        ref_leaves, port_leaves = replayed
        found = next(
            (
                (k, (r, p))
                for k, ((_, r), (_, p)) in enumerate(zip(ref_leaves, port_leaves))
                if is_tensor(r) and is_tensor(p) and (r.shape != p.shape or not torch.equal(r, p))
            ),
            None,
        )
        if found is None:
            return []
        leaf, pair = found
    terms = _place_terms(searcher, call)
    relations = relate(pair[0], pair[1], terms)
    if verify is not None and call.parent is not None and not searcher.layouts.get(call.name):
        for relation in relations:
            relation.verified = _undone_matches(searcher, call, relation, leaf, terms, *verify)
    return relations


def untestable_relations(searcher: Searcher, call: Record, shown: int = 4) -> list[Any]:
    r"""How the captured outputs of the located call's untestable aligned children relate (their outputs pair
    in no order or layout, so no test compared them): each relation stated with its residual, not verified
    (no replay reaches them one-to-one). A child whose pairing the weight conversion explains (a reordered
    layout) is left out: its values differ by construction, not by a bug."""
    from paritykit.bisection.value_relations import relate

    found: list[Any] = []
    for child in searcher.frontier(call):
        result = searcher.results.get(child.name)
        port_child = searcher.port_record(child)
        pair = searcher.alignment.pair_of(child.module)
        if result is None or result.status != "untestable" or port_child is None:
            continue
        if pair is None or pair.layout:
            continue
        rotary = _rotary_arguments(searcher, child, port_child)
        if rotary is not None:
            found.append(rotary)
        ref_leaves = [(k, t) for k, t in child.outputs.items() if is_tensor(t)]
        port_leaves = [(k, t) for k, t in port_child.outputs.items() if is_tensor(t)]
        for (_, r), (_, p) in list(zip(ref_leaves, port_leaves))[:shown]:
            relations = relate(r, p)
            if relations:
                for relation in relations:
                    relation.words = (
                        f"at {shown_name(child.name)} <-> {shown_name(port_child.name)} (untestable, captured"
                        f" outputs): {relation.words}"
                    )
                    relation.undo = None
                found += relations
                break
        if len(found) >= shown:
            break
    return found[:shown]


def rotation_relations(searcher: Searcher, call: Record) -> list[Any]:
    r"""At a replayed culprit: the rotary rotations each side applies inside it (q and k before and after,
    read from the ops' values on the reference's inputs, :func:`paritykit.bisection.rotary.rotations_inside`)
    and what differs between them, as a relation; empty when either side applies none or they agree."""
    from paritykit.bisection.rotary import rotary_difference, rotations_inside
    from paritykit.bisection.value_relations import Relation

    port_call = searcher.port_record(call)
    ref_module = searcher.ref_modules.get(call.module)
    port_module = searcher.port_modules.get(port_call.module) if port_call is not None else None
    result = searcher.results.get(call.name)
    if ref_module is None or port_module is None or result is None or result.test != "replay":
        return []
    adapted = searcher.adapt_inputs(call, port_call, module_device(port_module))
    if adapted is None:
        return []
    try:
        ref_forms = rotations_inside(ref_module, *call.call_inputs())
        port_forms = rotations_inside(port_module, *adapted)
    except Exception:  # an op the logger cannot follow: nothing read, nothing said
        return []
    if not ref_forms or not port_forms:
        return []
    reference, port = ref_forms[0], port_forms[0]
    differs = rotary_difference(reference, port)
    if not differs:
        return []
    words = (
        f"the rotary rotations applied inside {shown_name(call.name)} differ: {'; '.join(differs)}; read from"
        f" q and k before and after rotation: reference {reference.describe()}, port {port.describe()}"
    )
    return [Relation("rotary", words, max(reference.error, port.error), {"differs": differs})]


def _rotary_arguments(searcher: Searcher, child: Record, port_child: Record) -> Any:
    r"""A relation naming how the rotary tables passed to an untestable call differ (θ, bands, layout,
    position scale), each side's table read back from its captured values; None when either side passes
    none or they agree."""
    from paritykit.bisection.module_fit import passed_tables
    from paritykit.bisection.value_relations import Relation

    compared = passed_tables(searcher, child, port_child)
    if compared is None or not compared.lead:
        return None
    words = f"{compared.lead}; read from their values: {compared.forms}"
    return Relation("rotary", words, compared.residual, {"differs": compared.differs})


def _place_terms(searcher: Searcher, call: Record) -> dict[str, Any]:
    r"""The tensors captured at a call, by name: its inputs (named by its forward's arguments), its children's
    outputs (``child <name>``), and each child output times each much smaller input it broadcasts with (a
    modulation gate), at most ``MAX_TERMS`` in all."""
    import torch

    from paritykit.bisection.relations import input_leaf_name
    from paritykit.bisection.value_relations import MAX_TERMS

    module = searcher.ref_modules.get(call.module)
    try:
        leaves = flatten_tensors(call.call_inputs(), "input")
    except Exception:  # a call captured without inputs: no terms from them
        leaves = []
    inputs = {input_leaf_name(module, path): t for path, t in leaves if t.is_floating_point()}
    children: dict[str, Any] = {}
    for record in searcher.ref_trace.records:
        if record.parent == call.name and record.replayable:
            outs = [t for _, t in flatten_tensors(record.output_value()) if t.is_floating_point()]
            if outs:
                children[f"{record.name.removeprefix(call.name + '.') or record.name}"] = outs[0]
    terms = {**inputs, **children}
    for child, out in children.items():
        for name, gate in inputs.items():
            # a modulation vector is small next to the output it gates (one value per channel or sample)
            if gate.numel() * 4 <= out.numel() and len(terms) < MAX_TERMS:
                try:
                    terms[f"{name}·{child}"] = torch.broadcast_to(gate, out.shape) * out
                except RuntimeError:
                    continue
    return terms


def _undone_matches(
    searcher: Searcher,
    call: Record,
    relation: Any,
    leaf: int,
    terms: dict[str, Any],
    ref_final: Any,
    select_output: Callable | None,
) -> bool | None:
    r"""Run the port with ``relation`` undone on the culprit's output leaf ``leaf``; whether its final output
    then matches the reference's (None: it cannot be run: no undo, no port model, an output it cannot
    edit)."""
    import torch

    if relation.undo is None:
        return None

    def hook(_module: Any, _args: Any, _kwargs: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor) and leaf == 0:
            return relation.undo(output, terms)
        if isinstance(output, (tuple, list)) and leaf < len(output) and is_tensor(output[leaf]):
            edited = list(output)
            edited[leaf] = relation.undo(output[leaf], terms)
            return type(output)(edited) if isinstance(output, tuple) else edited
        raise _CannotEdit

    return _port_matches_with(searcher, call, hook, ref_final, select_output)


def _port_matches_with(
    searcher: Searcher, call: Record, hook: Callable, ref_final: Any, select_output: Callable | None
) -> bool | None:
    r"""Run the whole port on its captured inputs with ``hook`` (a forward hook taking kwargs) replacing the
    culprit's port module's output; whether the final output then matches the reference's. None when there
    is nothing to run (no port model, no culprit module, no replayable inputs) or the hook cannot edit that
    output; False when the edited output does not fit the rest of the port."""
    import torch

    from paritykit.bisection.leaves import final_output
    from paritykit.compare.tensors import compare_tensors

    port_call = searcher.port_record(call)
    port = searcher.port_modules.get("")
    module = searcher.port_modules.get(port_call.module) if port_call is not None else None
    root = searcher.port_trace.root
    if port is None or module is None or root is None or not root.replayable:
        return None
    args, kwargs = to_device(root.call_inputs(), module_device(port))
    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            output = port(*args, **kwargs)
    except _CannotEdit:
        return None
    except Exception:  # the edited output does not fit the rest of the port, or the hook cannot run
        return False
    finally:
        handle.remove()
    got = final_output("port", output, select_output)
    return bool(compare_tensors(ref_final, got, atol=searcher.atol, rtol=searcher.rtol).passed)


class _CannotEdit(Exception):
    pass


def transplant_hint(
    searcher: Searcher, call: Record, ref_final: Any, select_output: Callable | None
) -> Any | None:
    r"""At a replayed culprit whose settings and weights explain nothing: a copy of the aligned reference
    module (its own weights, which the port's hold as aligned) put in the port module's place, called on the
    port's own inputs, in a run of the whole port. When the port's output then matches, the module's own
    computation is the cause: said with the first op whose result differs while its inputs agree (the two
    sides' ops traced on the reference's inputs). None when the transplant cannot run or does not match."""
    import copy

    from paritykit.compare.diagnose import Hint

    port_call = searcher.port_record(call)
    ref_module = searcher.ref_modules.get(call.module)
    module = searcher.port_modules.get(port_call.module) if port_call is not None else None
    if ref_module is None or module is None or call.parent is None or not port_call.module:
        return None  # nothing to transplant, or the top level's own forward: nothing to transplant into
    if not _same_parameters(ref_module, module):
        return None  # the donor brings weights the port lacks: a match would not say the code differs
    donor = copy.deepcopy(ref_module).to(module_device(module))

    def hook(_module: Any, args: tuple, kwargs: dict, _output: Any) -> Any:
        return donor(*args, **kwargs)

    # the reference module not taking the port's inputs (False) is no transplant to claim, like a mismatch
    if not _port_matches_with(searcher, call, hook, ref_final, select_output):
        return None
    ops = ""
    adapted = searcher.adapt_inputs(call, port_call, module_device(module))
    if adapted is not None:
        try:
            op = op_divergence(
                ref_module, module, call.call_inputs(), adapted, atol=searcher.atol, rtol=searcher.rtol
            )
        except Exception:  # an op the logger cannot follow: the transplant still stands
            op = None
        if op is not None:
            ops = (
                f"; the first port op whose result the reference never computes (its inputs agree):"
                f" {op.port_op}({op.port_args})"
            )
            if op.reference_op:
                ops += f" (the reference's nearest: {op.reference_op}({op.reference_args}))"
    donor_name, port_name = shown_name(call.module), shown_name(port_call.module)
    words = (
        f"transplant: a copy of the reference's {type(ref_module).__name__} ({donor_name}) in place of the"
        f" port's {type(module).__name__} ({port_name}), on the port's own inputs, makes the port's output"
        f" match: the cause is that module's own computation{ops}"
    )
    return Hint("transplant", words, {"module": port_call.module}, score=0.99, verified=True)


def _same_parameters(reference: Any, port: Any) -> bool:
    r"""Both modules hold the same parameters, value for value (names may differ): a transplant that then
    matches shows that the code differs, not the weights or which parameters exist."""
    import torch

    ref = [p.detach() for p in reference.parameters()]
    mine = [p.detach() for p in port.parameters()]
    if len(ref) != len(mine):
        return False
    left = list(ref)
    for p in mine:
        k = next(
            (i for i, r in enumerate(left) if r.shape == p.shape and torch.equal(r.cpu(), p.cpu())), None
        )
        if k is None:
            return False
        left.pop(k)
    return True


def whole_output_with(searcher: Searcher, name: str, make: Callable) -> tuple[float, float]:
    r"""The whole port run again on its captured inputs with its module ``name`` replaced by ``make()``
    (swapped in and put back), its output against the reference's: max_abs after, and as captured."""
    import torch

    from paritykit.bisection.leaves import final_output

    port, port_root, ref_root = (
        searcher.port_modules.get(""),
        searcher.port_trace.root,
        searcher.ref_trace.root,
    )
    if port is None or port_root is None or not port_root.replayable:
        raise ValueError("the whole port cannot be re-run")
    select = searcher.select_output
    ref_final = final_output("reference", ref_root.output_value(), select)
    before = final_output("port", port_root.output_value(), select)
    args, kwargs = copy_inputs(to_device(port_root.call_inputs(), module_device(port)))
    fixed = make()
    if not name:
        with torch.no_grad():
            out = fixed(*args, **kwargs)
    else:
        parent_name, _, attr = name.rpartition(".")
        parent = port.get_submodule(parent_name) if parent_name else port
        original = parent._modules[attr]
        parent._modules[attr] = fixed
        try:
            with torch.no_grad():
                out = port(*args, **kwargs)
        finally:
            parent._modules[attr] = original
    after = final_output("port", out, select)
    if after.shape != ref_final.shape or before.shape != ref_final.shape:
        raise ValueError("outputs of other shapes")

    def gap(t: Any) -> float:
        return float((t.detach().double().cpu() - ref_final.detach().double().cpu()).abs().max())

    return gap(after), gap(before)


def _own_inputs(searcher: Searcher, call: Record, port_call: Record | None, port_module: Any) -> list[str]:
    r"""The port call's inputs no reference input pairs with (by path, order, shape or value), named from
    the port module's signature: a replay feeds them the port's own captured values."""
    from paritykit.bisection.relations import argument_name

    if port_call is None:
        return []
    try:
        pairing = searcher.pair_call_inputs(call, port_call)
    except Exception:  # inputs that cannot be paired are said elsewhere (the table's note)
        return []
    if pairing is None:
        return []
    return [argument_name(port_module, path) for path in pairing.own_paths]
