r"""The culprit search: two strategies behind one interface, and the one function that turns either into a
report.

A strategy decides what is captured at a time and in which order aligned calls are tested; the tests
themselves are always a :class:`~paritykit.bisection.searcher.Searcher`'s (replay, else error jump). Two
strategies exist:

* :class:`FullSearch` (``--levels full``): every module captured at once on each side, one searcher;
* :class:`paritykit.bisection.zoom.ZoomSearch` (``--levels zoom``): one level of blocks captured at a time, a
  searcher per level, a block entered (re-run alone from its captured inputs) only when the search needs to
  look inside it. Peak memory is one level's instead of every module's.

:func:`run_strategy` runs a strategy and builds the :class:`~paritykit.bisection.results.BisectReport`, so the
verdict, the culprit finding and the first output divergence are one piece of code whichever strategy found
them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from paritykit.base.report import environment_stamp, format_number
from paritykit.bisection.align import Alignment
from paritykit.bisection.findings import (
    culprit_finding,
    first_divergence,
    place_relations,
    rotation_relations,
    transplant_hint,
    untestable_relations,
)
from paritykit.bisection.floor import FloatFloor, floor_state, max_difference, precision_line, within
from paritykit.bisection.leaves import final_output, viewed_as
from paritykit.bisection.repair.culprit_sites import RepairOptions
from paritykit.bisection.results import BisectReport, ModuleTest, Verdict
from paritykit.bisection.searcher import Searcher, join_notes
from paritykit.tracing.trace import module_of

if TYPE_CHECKING:
    from paritykit.tracing.trace import Record


# a replayed culprit whose outputs differ in the run this many times more than on identical inputs does not
# make the run's difference: most of it comes with its inputs
INHERITED_FACTOR = 10.0


@dataclass
class Located:
    r"""Where a strategy stopped: a reference call, the searcher that tested it, and how many of the call's
    aligned children passed (a call whose children all pass differs in its own ``forward``)."""

    searcher: Searcher
    call: Record
    children_passed: int
    # a call whose captured outputs differ although nothing fails on identical inputs (a masked verdict)
    through_inputs: bool = False
    # then the aligned call upstream whose output differs most on identical inputs, relative to its scale
    upstream: ModuleTest | None = None

    def note(self) -> str:
        if not self.through_inputs:
            return ""
        up = self.upstream
        where = ""
        if up is not None:
            pair = self.searcher.alignment.pair_of(module_of(up.reference))
            low = pair is not None and pair.confidence == "low"
            where = (
                f"; upstream, {up.reference} <-> {up.port} differs most on identical inputs relative to its"
                f" output (max_abs {format_number(up.max_abs)}; it"
                f" {'fails' if up.status == 'fail' else 'passes'}"
                f" there{', aligned with low confidence' if low else ''})"
            )
        return (
            "its captured outputs differ beyond tolerance, yet it passes on identical inputs: the difference"
            " reaches it with its inputs, built up from differences below tolerance upstream or made by code"
            " no aligned module covers (inline in a parent, or an unaligned module)" + where
        )


class SearchStrategy(Protocol):
    r"""How the culprit search walks two models. Implementations: :class:`FullSearch`,
    :class:`paritykit.bisection.zoom.ZoomSearch`."""

    @property
    def top(self) -> Searcher:
        """The searcher over the top-level traces: its root calls hold the final outputs."""
        ...

    def locate(self) -> Located:
        """The deepest failing aligned call below the top level; the top-level call itself (with the count of
        its aligned children that passed) when nothing below it fails."""
        ...

    def masking(self) -> bool:
        """Whether a failing test found so far sits on a pair aligned with medium or high confidence."""
        ...

    def masked(self) -> Located | None:
        """For a matching output: the first call failing on identical inputs among those whose captured
        outputs differ (its error shrunk by what follows), or ``None``."""
        ...

    def differing(self) -> Located | None:
        """For a matching output with no masked culprit: the first aligned call captured whose outputs still
        differ beyond tolerance (its error comes in with its inputs), or ``None``."""
        ...

    def tested(self) -> list[ModuleTest]:
        """Every module test run, once each."""
        ...

    def candidates(self) -> list[ModuleTest]:
        """Failing pairs aligned on order and shape alone: leads, never the culprit."""
        ...

    def final_alignment(self) -> Alignment:
        """The module pairs the search used, with the modules left unaligned on each side."""
        ...

    def describe(self, environment: dict[str, Any]) -> dict[str, Any]:
        """The report's environment, with what the strategy adds (levels entered)."""
        ...


class FullSearch:
    r"""Both models captured whole: one :class:`~paritykit.bisection.searcher.Searcher` over the two
    traces."""

    def __init__(self, searcher: Searcher):
        self.searcher = searcher

    @property
    def top(self) -> Searcher:
        return self.searcher

    def locate(self) -> Located:
        call, passed = self.searcher.descend(self.searcher.ref_trace.root)
        return Located(self.searcher, call, passed)

    def masking(self) -> bool:
        return self.searcher.masking()

    def masked(self) -> Located | None:
        found = self.searcher.masked_call()
        return Located(self.searcher, *found) if found is not None else None

    def differing(self) -> Located | None:
        return differing_in(self.searcher)

    def tested(self) -> list[ModuleTest]:
        return list(self.searcher.results.values())

    def candidates(self) -> list[ModuleTest]:
        return list(self.searcher.candidates)

    def final_alignment(self) -> Alignment:
        return self.searcher.alignment

    def describe(self, environment: dict[str, Any]) -> dict[str, Any]:
        return environment


def _crossed_slots(searcher: Searcher, call: Any) -> str:
    r"""Where the culprit is paired by its weights with a port module that the port calls on the other side
    of another weight-paired sibling than the reference calls its own (wavegrad's up-block convs converted
    into each other's slots): the pairs' calls cross, measured by the two runs' call order. A setting fix at
    one of them makes that module compute as the reference's does with those weights; the conversion is
    what put them there. Empty otherwise."""
    pair = searcher.alignment.pair_of(call.module)
    port_call = searcher.port_record(call) if pair is not None and pair.how == "weights" else None
    if port_call is None or call.parent is None:
        return ""
    for sibling in searcher.ref_trace.records:
        if sibling.parent != call.parent or sibling is call:
            continue
        other = searcher.alignment.pair_of(sibling.module)
        if (
            other is None
            or other.how != "weights"
            or type(searcher.ref_modules.get(sibling.module))
            is not type(searcher.ref_modules.get(call.module))
        ):
            continue
        theirs = searcher.port_record(sibling)
        if theirs is None or theirs.parent != port_call.parent:
            continue
        if (sibling.order < call.order) != (theirs.order < port_call.order):
            first, then = (theirs, port_call) if theirs.order < port_call.order else (port_call, theirs)
            return (
                f"its weights and those of {sibling.module} are called in crossed places: the reference calls"
                f" {sibling.module} {'before' if sibling.order < call.order else 'after'} it, the port calls"
                f" the modules holding their weights in the other order ({first.module}, then {then.module}):"
                " weights converted into each other's slot, or slots built otherwise; a setting fix here is"
                " for this module alone"
            )
    return ""


def _weak_pair_before(top: Searcher, record: Any) -> str:
    r"""An earlier call, in completion order, of a pair aligned by order and output shape alone whose
    captured outputs differ: not counted for the first module whose outputs differ, and said beside it
    (the transformer's first norm, built without the research's affine parameters, before its MLP)."""
    for earlier in top.ref_trace.completion_order():
        if earlier.name == record.name:
            return ""
        pair = top.alignment.pair_of(earlier.module)
        if earlier.parent is None or pair is None or pair.confidence != "low":
            continue
        found = top.captured_difference(earlier)
        if found is not None:
            return (
                f"before it, {earlier.module} <-> {pair.port}, paired by order and output shape only and so"
                f" not counted here, differs too (max_abs {format_number(found[0])})"
            )
    return ""


def differing_in(searcher: Searcher) -> Located | None:
    r"""The first aligned call of ``searcher`` whose captured outputs differ, as a located call (none passed),
    with the call upstream of it that differs most on identical inputs, relative to its output's scale (pairs
    of low confidence included: a lead, not a verdict)."""
    # a pair whose inputs cannot be paired computes from other inputs: with the output matching, its captured
    # outputs differing is no sign that anything differs (round 32: tortoise's relative-position module
    # returns the logits plus the bias, the port's the bias alone; "masked" on the fixed port)
    calls = [c for c in searcher.differing_calls() if searcher.test(c).status != "untestable"]
    if not calls:
        return None
    first = calls[0]
    if searcher.test(first).status == "fail":  # it differs on identical inputs too: no "through its inputs"
        return Located(searcher, first, searcher.passed_below(first))
    upstream, worst = None, 0.0
    for record in searcher.ref_trace.completion_order():
        if record is first:
            break
        if record.parent is None or searcher.port_record(record) is None:
            continue
        test = searcher.test(record)
        scale = max(
            (float(t.detach().abs().max()) for t in record.outputs.values() if t.numel()), default=0.0
        )
        if test.max_abs and scale > 0 and test.max_abs / scale > worst:
            upstream, worst = test, test.max_abs / scale
    return Located(searcher, first, 0, through_inputs=True, upstream=upstream)


def inherited(searcher: Searcher, record: Record) -> float | None:
    r"""The max_abs of a replayed call's captured outputs in the run when it is more than
    :data:`INHERITED_FACTOR` times what the call makes on identical inputs, else ``None``: the call is then a
    difference, not where the run's difference comes from."""
    if record.parent is None:  # the top level is compared at the final output, never replayed for this
        return None
    port_record = searcher.port_record(record)
    own = searcher.test(record)
    if own.test != "replay" or not own.max_abs or port_record is None:
        return None
    outputs = list(record.outputs.items()), list(port_record.outputs.items())
    paired = searcher.compare_paired(*outputs, record.name)
    in_run = paired.worst.max_abs if paired is not None else None
    return in_run if in_run is not None and in_run > INHERITED_FACTOR * own.max_abs else None


def run_strategy(
    strategy: SearchStrategy,
    *,
    select_output: Callable[[str, Any], Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    ops: bool = False,
    environment: dict[str, Any] | None = None,
    allow_masked: bool = False,
    repair: RepairOptions | None = None,
) -> BisectReport:
    r"""Run ``strategy`` and report: ``diverge`` with the culprit when the final outputs differ, ``masked``
    when they match but an aligned module fails on identical inputs, else ``match``.

    Args:
        strategy: a :class:`SearchStrategy` over the two sides.
        select_output: ``select_output(side, output)`` picks the compared tensor of each side's final output
            (default: its first tensor).
        atol, rtol: tolerances (default: per dtype).
        ops: name the first differing op inside a replayed culprit.
        environment: the report's environment stamp (default: this process's).
        allow_masked: accept the ``masked`` verdict (exit 0).
        repair: how the culprit is explained
            (:class:`~paritykit.bisection.repair.culprit_sites.RepairOptions`), budgeted in edits.
    """
    import torch

    from paritykit.compare.tensors import compare_tensors

    top = strategy.top
    ref_final = final_output("reference", top.ref_trace.root.output_value(), select_output)
    port_final = final_output("port", top.port_trace.root.output_value(), select_output)
    port_final, viewed = viewed_as(port_final, ref_final)
    output = compare_tensors(ref_final, port_final, atol=atol, rtol=rtol, name="output")
    floor = top.float_floor if top.float_floor is not None and top.float_floor.measured else None
    precision = ""
    if not output.passed and floor is not None:
        precision = output_noise(top, floor, output, (ref_final, port_final), select_output)
    agrees = output.passed or bool(precision)
    # A pair aligned on order and shape alone is never named where outputs first differ; with a matching
    # output, only pairs aligned on strong evidence are.
    trusted = ("high", "medium") if not agrees else ("high",)
    culprit = None
    verdict: Verdict = "match" if agrees else "diverge"
    with torch.no_grad():
        located = strategy.locate()
        if agrees:
            # the output matches, yet a module may fail on identical inputs, its error masked downstream
            below_top = located.call is not top.ref_trace.root
            located = located if below_top and strategy.masking() else strategy.masked()
            # no module fails on identical inputs, yet a captured output differs: still not a match
            located = located if located is not None else strategy.differing()
            verdict = "masked" if located is not None else verdict
        shapes_differ = output.status == "shape_mismatch"
        if shapes_differ and located is not None and located.call is top.ref_trace.root:
            located = None  # two outputs of other shapes: the top level's own forward is not what differs
        if located is not None and verdict != "match":
            repair = repair if repair is not None else RepairOptions()
            in_run = None if located.through_inputs else inherited(located.searcher, located.call)
            if located.through_inputs or in_run is not None:
                # nothing fails on its own inputs, or what fails there is not what makes the run differ: a
                # repair there cannot change the answer
                repair = dataclasses.replace(repair, enabled=False)
            culprit = culprit_finding(
                located.searcher, located.call, located.children_passed, output, ops=ops, repair=repair
            )
            below = located.call is not located.searcher.ref_trace.root
            if (
                below
                and not located.searcher.confident(located.call)
                and not any(h.verified for h in culprit.hints)
            ):
                # two classes paired by order and shape alone are a lead unless a verified fix confirms the
                # pair by value: the culprit is then the nearest confidently aligned call above it
                searcher = located.searcher
                searcher.lead(located.call)
                above = searcher.confident_ancestor(located.call)
                located = Located(searcher, above, searcher.passed_below(above), located.through_inputs)
                culprit = culprit_finding(
                    searcher, above, located.children_passed, output, ops=ops, repair=repair
                )
            culprit.note = join_notes(
                culprit.note, located.note(), _crossed_slots(located.searcher, located.call)
            )
            if not located.through_inputs:
                culprit.in_run = inherited(located.searcher, located.call)
            culprit.through_inputs = located.through_inputs
            at_top = culprit.test == "output"
            culprit.relations = place_relations(
                located.searcher,
                located.call,
                (ref_final, port_final) if at_top else None,
                verify=(ref_final, select_output),
            )
            if not any(h.verified for h in culprit.hints):  # a verified fix already says it; this costs a run
                culprit.relations += rotation_relations(located.searcher, located.call)
            culprit.relations += untestable_relations(located.searcher, located.call)
            first_hint = culprit.hints[0].id if culprit.hints else ""
            if first_hint in ("no-signature", "unknown") and not any(h.verified for h in culprit.hints):
                moved = transplant_hint(located.searcher, located.call, ref_final, select_output)
                if moved is not None:
                    for hint in culprit.hints:  # the transplant is a detector that matched
                        hint.message = hint.message.replace(
                            "no detector matched;", "no other detector matched;", 1
                        )
                    culprit.hints.insert(0, moved)
            _layer_order_hint(culprit, strategy.final_alignment())
    # after the search: the layouts its replays measured (same shape, another layout) read the captures
    first = first_divergence(
        top.ref_trace,
        top.port_trace,
        top.alignment,
        atol=atol,
        rtol=rtol,
        confidence=trusted,
        port_record=top.port_record,
        floor=floor,
        layouts=top.layouts,
        done_after=lambda record, port_leaves: top.boundary(
            record, list(record.outputs.items()), port_leaves
        ),
    )
    if first is not None and first.reference in top.ref_trace:
        record = top.ref_trace[first.reference]
        if top.port_record(record) is not None:
            test = top.test(record)
            if test.test == "replay" and test.status in ("pass", "fail"):
                own = "taken from the port's own run" in (test.note or "")
                first.replayed = (test.status, test.max_abs, own)
        first.before = _weak_pair_before(top, record)
    candidates = strategy.candidates()
    if verdict == "match":
        # a weak pair whose captured inputs already differ in a run that matches is no one computation: its
        # failure is no lead; one fed alike that fails holds a difference the output hides
        candidates = [c for c in candidates if top.fed_alike(c.reference)]
    stamp = environment if environment is not None else environment_stamp()
    shape_note = (
        batch_blocks(ref_final, port_final, atol, rtol) if output.status == "shape_mismatch" else viewed
    )
    return BisectReport(
        verdict=verdict,
        culprit=culprit,
        first_output_divergence=first,
        output=output,
        alignment=strategy.final_alignment(),
        tested=strategy.tested(),
        candidates=candidates,
        environment=strategy.describe(stamp),
        culprits=[culprit] if culprit is not None else [],
        allow_masked=allow_masked,
        precision=precision,
        float_floor=floor_state(top.float_floor),
        shape_note=shape_note,
    )


def batch_blocks(ref: Any, port: Any, atol: float | None, rtol: float | None) -> str:
    r"""Two outputs that differ in batch only, the larger a whole number of the smaller's batches: which
    blocks of the larger the smaller equals within tolerance (each compared), in words; else empty."""
    from paritykit.compare.tensors import compare_tensors

    if ref is None or port is None or ref.dim() == 0 or ref.shape[1:] != port.shape[1:]:
        return ""
    big, small, bigger = (ref, port, "reference") if ref.shape[0] > port.shape[0] else (port, ref, "port")
    size = small.shape[0]
    if size == 0 or big.shape[0] % size:
        return ""
    equal = [
        i
        for i in range(big.shape[0] // size)
        if compare_tensors(big[i * size : (i + 1) * size], small, atol=atol, rtol=rtol).passed
    ]
    other = "port" if bigger == "reference" else "reference"
    if not equal:
        return f"no block of {size} rows of the {bigger}'s output equals the {other}'s"
    rows = ", ".join(f"{i * size}:{(i + 1) * size}" for i in equal)
    return (
        f"the {other}'s output equals the {bigger}'s rows {rows} (each block of {size} rows compared): the"
        f" {bigger}'s call computes a larger batch"
    )


def _layer_order_hint(culprit: Any, alignment: Alignment) -> None:
    r"""A culprit holding layers the port calls in another order: that order is the cause, first, in place
    of a claim that the forward code differs (every layer matches the layer it holds)."""
    from paritykit.compare.diagnose import Hint

    prefix = f"{culprit.reference}." if culprit.reference else ""
    orders = [
        o
        for o in alignment.layer_orders
        if not o.monotone and o.calls_differ is not False and o.source_group.startswith(prefix)
    ]
    if not orders:
        return
    kept = [h for h in culprit.hints if h.id != "no-signature"]
    said = [Hint("layer-order", o.words(), o.to_dict(), score=1.0) for o in orders]
    culprit.hints = said + kept


def floor_of_final(
    run64: Any, moved: Any, final: Any, side: str, select_output: Callable | None
) -> float | None:
    r"""One side's float32 error at its compared output: the larger distance from the float64 run's and from
    the rounded-inputs run's."""
    errors = [
        max_difference(final, final_output(side, trace.root.output_value(), select_output))
        for trace in (run64, moved)
        if trace is not None
    ]
    errors = [e for e in errors if e is not None]
    return max(errors) if errors else None


def output_noise(
    top: Searcher,
    floor: FloatFloor,
    output: Any,
    finals: tuple[Any, Any],
    select_output: Callable | None,
) -> str:
    r"""When the final outputs differ by float noise only: the lines saying so, naming the first aligned
    call whose captured outputs differ and both sides' float32 error there; else empty."""
    errors = (
        floor_of_final(floor.ref64, floor.ref_moved, finals[0], "reference", select_output),
        floor_of_final(floor.port64, floor.port_moved, finals[1], "port", select_output),
    )
    if errors[0] is None or not within(output.max_abs, errors[0]):
        return ""
    dtype = str(finals[0].dtype).removeprefix("torch.")
    lines = [precision_line(output.max_abs, errors[0], "the output", errors, dtype)]
    for record in top.ref_trace.completion_order():
        port_record = top.port_record(record)
        if record.parent is None or port_record is None:
            continue
        paired = top.compare_paired(
            list(record.outputs.items()), list(port_record.outputs.items()), record.name
        )
        if paired is not None and not paired.worst.passed:
            at = floor.of(record, port_record)
            if at is not None:
                where = f"{record.name} <-> {port_record.name}"
                errors = floor.errors(record, port_record)
                line = precision_line(paired.worst.max_abs, at, where, errors, dtype)
                lines.append("  first difference: " + line.removeprefix("float noise: "))
            break
    return "\n".join(lines)
