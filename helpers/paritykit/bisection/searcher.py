r"""The tests of one pair of traces: replay each aligned call on the reference's inputs (else an error jump),
and walk down to the deepest failing call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paritykit.base.errors import first_line
from paritykit.base.inputs import is_tensor, to_device
from paritykit.base.report import format_number
from paritykit.bisection.align import Alignment
from paritykit.bisection.boundaries import Boundaries
from paritykit.bisection.call_pairing import (
    CallPairing,
    InputPairing,
    Leaves,
    reference_settings,
    unpaired_shapes,
)
from paritykit.bisection.floor import FloatFloor, far_above, fits_twice, module_floor, within
from paritykit.bisection.leaves import (
    in_layout,
    last_axis_order,
    layout_note,
    module_device,
    output_leaves,
    pair_inputs,
    pair_layouts,
    same_shape_orders,
)
from paritykit.bisection.relations import Relation
from paritykit.bisection.results import ModuleTest, Status
from paritykit.compare.tensors import relative_error
from paritykit.tracing.trace import Record, Trace, module_of

if TYPE_CHECKING:
    from paritykit.compare.tensors import TensorComparison

# both modules' output leaves on the reference's inputs: (reference, port)
Replayed = tuple[Leaves, Leaves]

JUMP_RATIO = 10.0
# calls with differing captured outputs a zoom tests for a masked divergence (each may capture a level)
MAX_MASKED_CHECKS = 32


@dataclass(frozen=True)
class PairedComparison:
    r"""Two leaf lists compared: the worst pair's comparison, and the dim order applied to each permuted
    port leaf, by path (empty when the layouts agree)."""

    worst: TensorComparison
    orders: dict[str, tuple[int, ...]]


class Searcher(Boundaries, CallPairing):
    r"""Tests the aligned calls of one pair of traces (each at most once) and walks down to the culprit.

    Both search strategies (:mod:`paritykit.bisection.strategy`) test calls only through a searcher: the full
    search has one over the whole capture, the zoom one per captured level. What a strategy may use:

    * :meth:`port_record` — the port call aligned with a reference call (``None`` when unaligned);
    * :meth:`frontier` — the nearest aligned calls below a call, looking through unaligned ones;
    * :meth:`test` — replay, else error jump: a :class:`~paritykit.bisection.results.ModuleTest`, cached in
      ``results``;
    * :meth:`descend` — the deepest failing call below a failing one;
    * :meth:`masking`, :meth:`outputs_disagree`, :meth:`differing_calls`, :meth:`masked_call` — for a
      matching output: is a failure hidden, and where;
    * :meth:`inherit` — take over a verdict a searcher one level up already reached.
    """

    def __init__(
        self,
        ref_trace: Trace,
        port_trace: Trace,
        alignment: Alignment,
        *,
        reference: Any = None,
        port: Any = None,
        atol: float | None,
        rtol: float | None,
        ratio: float,
    ):
        self.ref_trace = ref_trace
        self.port_trace = port_trace
        self.alignment = alignment
        self.ref_modules = dict(reference.named_modules()) if reference is not None else {}
        self.port_modules = dict(port.named_modules()) if port is not None else {}
        self.atol = atol
        self.rtol = rtol
        self.ratio = ratio
        self.results: dict[str, ModuleTest] = {}
        # failing pairs aligned on order and shape alone: leads the report lists, never the culprit
        self.candidates: list[ModuleTest] = []
        self.why_not_replayed: dict[str, str] = {}
        # the reference's calls by parent, in start order (built on first use)
        self._children: dict[str | None, list[Record]] | None = None
        # What the tests found out, by call name: written by the tests (replay, jump, and replayed_outputs
        # for a culprit whose passing replay was not kept) and by inherit, never by a comparison.
        # A failing replay's outputs, the port's in the reference's layout:
        self.replays: dict[str, Replayed] = {}
        # the dim order applied to each port leaf, by path, for calls whose leaves were compared up to a dim
        # permutation (the two sides lay a tensor out differently):
        self.layouts: dict[str, dict[str, tuple[int, ...]]] = {}
        # the dim order a replay read the reference's inputs in to feed the port (same shape, another layout)
        self.input_layouts: dict[str, tuple[int, ...]] = {}
        # plain keyword arguments a replay set as the reference's call set them, by reference call
        self.settings_taken: dict[str, dict[str, Any]] = {}
        self.children_of: dict[str | None, list[Record]] = {}
        # the float floor (paritykit.bisection.floor): None leaves it off; a FloatFloor measures failing
        # replays in float64 and, when its float64 traces are at hand, every captured call
        self.float_floor: FloatFloor | None = None
        self.select_output: Any = None  # the SPEC's select_output(side, output), when it gives one
        # reference call name -> the port call paired with it (:meth:`port_record`), and each port module's
        # calls in order
        self._call_pairs: dict[str, Record | None] = {}
        self._port_calls: dict[str, list[Record]] = {}
        # argument pairings read by value, by (classes, argument paths and shapes): a call whose inputs differ
        # pairs as an earlier call of the same two classes did
        self._templates: dict[tuple, tuple[str, dict[int, Relation]]] = {}
        for record in ref_trace.records:
            self.children_of.setdefault(record.parent, []).append(record)

    def frontier(self, record: Record) -> list[Record]:
        """The nearest aligned calls below ``record`` (unaligned calls in between are looked through)."""
        out = []
        for child in self.children_of.get(record.name, []):
            if self.port_record(child) is not None:
                out.append(child)
            else:
                out += self.frontier(child)
        return out

    # comparisons: pure, they return what they paired and record nothing ------------------------------
    def compare(self, a: Any, b: Any, name: str, diagnose: bool = False) -> TensorComparison:
        from paritykit.compare.tensors import compare_tensors

        return compare_tensors(a, b, atol=self.atol, rtol=self.rtol, name=name, diagnose=diagnose)

    def compare_paired(self, a: Leaves, b: Leaves, name: str) -> PairedComparison | None:
        """The worst comparison over paired leaves, up to a dim permutation of ``b``'s, with the dim order
        applied to each permuted ``b`` leaf; ``None`` when the leaves cannot be paired."""
        found = pair_layouts(a, b, same_shape=True)
        if found is None:
            return None
        pairs, b, orders = found
        worst = None
        for i, j in pairs:
            cmp = self.compare(a[i][1], b[j][1], f"{name}:{a[i][0]}")
            if worst is None or (worst.passed and not cmp.passed):
                worst = cmp
            elif not cmp.passed and not worst.passed and (cmp.max_abs or 0) > (worst.max_abs or 0):
                worst = cmp
        return PairedComparison(worst, orders)

    def compare_leaves(self, a: Leaves, b: Leaves, name: str) -> TensorComparison | None:
        """The worst comparison of :meth:`compare_paired` alone."""
        paired = self.compare_paired(a, b, name)
        return paired.worst if paired is not None else None

    def adapt_inputs(
        self,
        ref_record: Record,
        port_record: Record,
        device: Any = None,
        replace: dict[str, Any] | None = None,
        pairing: InputPairing | None = None,
    ) -> tuple[tuple, dict] | None:
        """The port call's own arguments with the reference's tensors put in place of its tensors (copies, so
        an in-place op in the port module cannot change the trace); the port's extra inputs stay its own, or
        ``replace[path]`` where given; ``pairing``, when given, is :meth:`pair_call_inputs`'s answer for these
        two calls. ``None`` when the inputs cannot be paired."""
        from paritykit.tracing.skeleton import unpack_call

        pairing = pairing or self.pair_call_inputs(ref_record, port_record)
        if pairing is None:
            return None
        port_keys = list(port_record.input_keys.values())
        swap = {}
        for j in pairing.extra:
            path, tensor = pairing.port_leaves[j]
            tensor = (replace or {}).get(path, tensor)
            swap[port_keys[j]] = tensor.to(device, copy=True) if device is not None else tensor.clone()
        for i, j in pairing.pairs:
            tensor = pairing.reference_value(i, j)
            own = pairing.port_leaves[j][1]
            if tensor.is_floating_point() and own.is_floating_point():
                tensor = tensor.to(own.dtype)
            swap[port_keys[j]] = tensor.to(device, copy=True) if device is not None else tensor.clone()
        if len(swap) != len(port_keys):
            return None
        args, kwargs = unpack_call(port_record.inputs_skeleton, lambda key: swap[key])
        return tuple(args), dict(kwargs)

    def own_input_paths(self, ref_record: Record, port_record: Record | None) -> list[str]:
        """The port call's input paths a replay takes from the port's own capture (the reference has no
        counterpart for them); empty when there are none or the port module is not at hand."""
        if port_record is None or port_record.module not in self.port_modules:
            return []
        pairing = self.pair_call_inputs(ref_record, port_record)
        return pairing.own_paths if pairing is not None else []

    # tests: what records ------------------------------------------------------------------------------
    def test(self, ref_record: Record) -> ModuleTest:
        if ref_record.name in self.results:
            return self.results[ref_record.name]
        port_record = self.port_record(ref_record)
        result = self.replay(ref_record, port_record)
        if result is None:
            result = self.jump(ref_record, port_record)
        self.results[ref_record.name] = result
        return result

    def run_replay(
        self, ref_record: Record, port_record: Record, pairing: InputPairing | None = None
    ) -> Replayed | str:
        """Outputs of both modules on the reference's captured inputs, or the reason replay is impossible."""
        port_module = self.port_modules.get(port_record.module)
        if port_module is None:
            return "no port model to replay on"
        if not ref_record.replayable:
            return "reference inputs not replayable"
        adapted = self.adapt_inputs(ref_record, port_record, module_device(port_module), pairing=pairing)
        if adapted is None:
            return self.inputs_differ(ref_record, port_record) or (
                "signatures differ (inputs cannot be paired by path, order, shape or value)"
            )
        settings = reference_settings(ref_record, adapted[1])
        if settings:  # a flag both calls name (drop_text=True against False) set as the reference set it
            adapted = (adapted[0], {**adapted[1], **settings})
            self.settings_taken[ref_record.name] = settings
        ref_module = self.ref_modules.get(ref_record.module)
        if ref_module is not None:
            args, kwargs = ref_record.call_inputs()
            device = module_device(ref_module)
            args = tuple(a.to(device, copy=True) if is_tensor(a) else a for a in args)
            kwargs = {k: v.to(device, copy=True) if is_tensor(v) else v for k, v in kwargs.items()}
            try:
                ref_out = output_leaves(ref_module(*args, **kwargs))
            except Exception as exc:  # e.g. state its parent sets up before calling it
                return f"reference call failed on its own captured inputs ({first_line(exc)})"
            # A reference call that does not reproduce its own captured output (randomness, hidden state)
            # cannot be replayed meaningfully.
            check = self.compare_leaves(list(ref_record.outputs.items()), ref_out, ref_record.name)
            if check is None or not check.passed:
                return "the reference call does not reproduce its captured output"
        else:
            ref_out = list(ref_record.outputs.items())
        try:
            port_out = output_leaves(port_module(*adapted[0], **adapted[1]))
        except Exception as exc:  # the port's own signature rejects the reference's inputs
            return f"port call failed on reference inputs ({first_line(exc)})"
        return ref_out, port_out

    def _replay_relaid(
        self, ref_record: Record, port_record: Record, pairing: InputPairing
    ) -> tuple[str, Leaves, Leaves, PairedComparison, tuple[int, ...]] | None:
        r"""A failed replay run again with the reference's inputs read with equal-sized dims exchanged (a
        channels-first ``[B, C, L]`` fed to a channels-last module whose ``[B, L, C]`` has the same shape):
        the note, outputs and comparison of the first order under which the outputs agree, or ``None``."""
        floats = [t for _, t in pairing.ref_leaves if is_tensor(t) and t.is_floating_point()]
        shape = tuple(floats[0].shape) if floats else ()
        for order in same_shape_orders(shape):
            leaves = [
                (path, t.permute(order).contiguous() if is_tensor(t) and tuple(t.shape) == shape else t)
                for path, t in pairing.ref_leaves
            ]
            found = self._passes_with(ref_record, port_record, pairing, leaves)
            if found is not None:
                note = (
                    f"passes with the reference's inputs of shape {list(shape)} read with dims permuted"
                    f" {tuple(order)} (the same shape in another layout)"
                )
                return (note, *found, tuple(order))
        return None

    def _replay_reordered(
        self, ref_record: Record, port_record: Record, pairing: InputPairing
    ) -> tuple[str, Leaves, Leaves, PairedComparison] | str | None:
        r"""A failed replay run again with each reference input whose port capture holds its values with the
        last axis in another order (conditioning features laid out otherwise, the weights converted to read
        them so) given in the port's order: the note, outputs and comparison when it then passes; a note
        with the difference left when it still fails; ``None`` when no input is so reordered."""
        leaves = list(pairing.ref_leaves)
        moved = []
        for i, j in pairing.pairs:
            path, value = leaves[i]
            order = last_axis_order(value, pairing.port_leaves[j][1])
            if order is not None:
                leaves[i] = (path, value[..., order])
                moved.append(f"{path} ({sum(k != o for k, o in enumerate(order))} of {len(order)} moved)")
        if not moved:
            return None
        said = (
            f"the port's own run feeds it the reference's {', '.join(moved)} with the last axis in another"
            " order"
        )
        found = self._passes_with(ref_record, port_record, pairing, leaves)
        if found is not None:
            return (f"passes fed so: {said}", *found)
        import dataclasses

        outcome = self.run_replay(ref_record, port_record, dataclasses.replace(pairing, ref_leaves=leaves))
        paired = (
            None if isinstance(outcome, str) else self.compare_paired(outcome[0], outcome[1], ref_record.name)
        )
        left = f" (max_abs {format_number(paired.worst.max_abs or 0.0)})" if paired is not None else ""
        return f"{said}; fed so, it still differs{left}"

    def _passes_with(
        self, ref_record: Record, port_record: Record, pairing: InputPairing, leaves: Leaves
    ) -> tuple[Leaves, Leaves, PairedComparison] | None:
        r"""The replay's outputs and comparison with the reference's input leaves replaced by ``leaves``, when
        the outputs then agree; ``None`` otherwise."""
        import dataclasses

        outcome = self.run_replay(ref_record, port_record, dataclasses.replace(pairing, ref_leaves=leaves))
        if isinstance(outcome, str):
            return None
        paired = self.compare_paired(outcome[0], outcome[1], ref_record.name)
        if paired is None or not paired.worst.passed:
            return None
        return outcome[0], outcome[1], paired

    def _replay_begun_earlier(
        self, ref_record: Record, port_record: Record, pairing: InputPairing
    ) -> tuple[str, Leaves, Leaves, PairedComparison] | None:
        r"""A failed replay run again where the port module begins earlier than its pair: an input of the
        reference call is the output of an earlier reference call of one tensor input (an activation the
        research applies to its time embedding before the norm, which the port's norm applies itself). Fed
        that earlier call's input in its place, the port module must give the reference's output: the note,
        outputs and comparison then, or ``None``."""
        earlier = [r for r in self.ref_trace.records if r.order < ref_record.order and len(r.outputs) == 1]
        for index, (path, value) in enumerate(pairing.ref_leaves):
            if not is_tensor(value):
                continue
            for record in earlier:
                made = next(iter(record.outputs.values()))
                tensors = [v for v in record.inputs.values() if is_tensor(v)]
                if len(tensors) != 1 or not is_tensor(made) or made.shape != value.shape:
                    continue
                if not self.compare(made, value, "input").passed:
                    continue
                leaves = list(pairing.ref_leaves)
                leaves[index] = (path, tensors[0])
                found = self._passes_with(ref_record, port_record, pairing, leaves)
                if found is not None:
                    paired = found[2]
                    note = (
                        f"begins where the reference's {record.module} begins: the reference's input {path}"
                        f" is that call's output; fed that call's input in its place, the port module gives"
                        f" the reference's output (max_abs {format_number(paired.worst.max_abs or 0.0)}),"
                        f" so it does {record.module}'s work itself; the pair's boundaries differ, not its"
                        " values"
                    )
                    return (note, *found)
        return None

    def replayed_outputs(self, ref_record: Record, port_record: Record | None) -> Replayed | None:
        r"""A replayed call's outputs (the port's in the reference's layout); a passing call's were not kept,
        so they are computed again here, once, for the culprit that needs them. ``None`` if it cannot be
        replayed."""
        kept = self.replays.get(ref_record.name)
        if kept is None and port_record is not None:
            outcome = self.run_replay(ref_record, port_record)
            if isinstance(outcome, str):
                return None
            ref_out, port_out = outcome
            kept = self.replays[ref_record.name] = (
                ref_out,
                in_layout(port_out, self.layouts.get(ref_record.name, {})),
            )
        return kept

    def replay(self, ref_record: Record, port_record: Record) -> ModuleTest | None:
        """Test a call by replaying the port module on the reference's inputs; records the layouts and (for a
        failing call) the outputs; ``None`` (with the reason kept) when it cannot run."""
        pairing = self.pair_call_inputs(ref_record, port_record)
        own = pairing.own_paths if pairing is not None else []
        outcome = self.run_replay(ref_record, port_record, pairing)
        if isinstance(outcome, str):
            self.why_not_replayed[ref_record.name] = outcome
            return None
        ref_out, port_out = outcome
        paired = self.compare_paired(ref_out, port_out, ref_record.name)
        if paired is None:
            self.why_not_replayed[ref_record.name] = "outputs not paired (by path, order, shape or value)"
            return None
        cmp, orders = paired.worst, paired.orders
        relaid = ""
        if not cmp.passed and pairing is not None:
            other = self._replay_relaid(ref_record, port_record, pairing)
            if other is not None:
                relaid, ref_out, port_out, paired, self.input_layouts[ref_record.name] = other
                cmp, orders = paired.worst, paired.orders
        reordered = ""
        if not cmp.passed and pairing is not None:
            other = self._replay_reordered(ref_record, port_record, pairing)
            if isinstance(other, str):
                reordered = other
            elif other is not None:
                relaid, ref_out, port_out, paired = other
                cmp, orders = paired.worst, paired.orders
        if not cmp.passed and pairing is not None:
            other = self._replay_begun_earlier(ref_record, port_record, pairing)
            if other is not None:
                relaid, ref_out, port_out, paired = other
                cmp, orders = paired.worst, paired.orders
        if orders:
            self.layouts[ref_record.name] = orders
        floor, noise = None, ""
        if not cmp.passed and self.float_floor is not None:
            floor, noise = self._replay_floor(ref_record, ref_out, cmp.max_abs)
        passed = cmp.passed or bool(noise)
        boundary = "" if passed else self.boundary(ref_record, ref_out, in_layout(port_out, orders))
        passed = passed or bool(boundary)
        if not passed:
            # the port's outputs kept in the reference's layout, for the evidence read at a culprit; a passing
            # call's are dropped (a deep model's passing blocks would otherwise hold a copy of every level)
            self.replays[ref_record.name] = (ref_out, in_layout(port_out, orders))
        own_note = (
            pairing.describe(
                self.ref_modules.get(ref_record.module), self.port_modules.get(port_record.module)
            )
            if pairing is not None and pairing.relations
            else (
                "port inputs the reference has no counterpart for taken from the port's own run:"
                f" {', '.join(own)}"
                if own
                else ""
            )
        )
        taken = self.settings_taken.get(ref_record.name)
        settings_note = (
            "non-tensor arguments of both calls set as the reference's call set them: "
            + ", ".join(f"{k}={v!r}" for k, v in taken.items())
            if taken
            else ""
        )
        return ModuleTest(
            ref_record.name,
            port_record.name,
            "replay",
            "pass" if passed else "fail",
            cmp.max_abs,
            cmp.cosine,
            comparison=cmp,
            note=join_notes(boundary, noise, relaid, reordered, own_note, settings_note, layout_note(orders)),
            floor=floor,
            arguments=(
                pairing.rows(
                    self.ref_modules.get(ref_record.module), self.port_modules.get(port_record.module)
                )
                if pairing is not None
                else []
            ),
        )

    def _replay_floor(
        self, ref_record: Record, ref_out: Leaves, difference: float | None
    ) -> tuple[float | None, str]:
        r"""The reference module's rounding error on the replayed inputs (the floor: the port's is never
        its excuse), and the note saying the difference is float noise when it is within
        :data:`~paritykit.bisection.floor.NOISE` times it."""
        ref_module = self.ref_modules.get(ref_record.module)
        if ref_module is None or not fits_twice(ref_module)[0]:
            return None, ""
        ref_inputs = to_device(ref_record.call_inputs(), module_device(ref_module))
        floor = module_floor(ref_module, *ref_inputs, ref_out)
        if floor is None or not within(difference, floor):
            return floor, ""
        dtype = next((str(t.dtype).removeprefix("torch.") for _, t in ref_out), "float32")
        return floor, (
            f"float noise: differs by {format_number(difference)}, the reference's {dtype} error there"
            f" {format_number(floor)}"
        )

    def jump(self, ref_record: Record, port_record: Record) -> ModuleTest:
        """Test a call from both sides' captured inputs and outputs: it fails when its inputs agree and its
        outputs do not, or when its output error exceeds :data:`JUMP_RATIO` times its input error."""
        note = self.why_not_replayed.get(ref_record.name, "")
        ref_outs = list(ref_record.outputs.items())
        paired = self.compare_paired(ref_outs, list(port_record.outputs.items()), ref_record.name)
        if paired is None:
            note = join_notes(note, unpaired_shapes(ref_record, port_record))
            return ModuleTest(ref_record.name, port_record.name, "jump", "untestable", note=note)
        out_cmp = paired.worst
        if paired.orders:
            self.layouts[ref_record.name] = paired.orders
        note = join_notes(note, layout_note(paired.orders))
        errors: tuple[float | None, float | None] = (None, None)
        if out_cmp.passed:
            status: Status = "pass"
        else:
            status, why, errors = self._jump_inputs(ref_record, port_record, ref_outs)
            note = join_notes(note, why)
        return ModuleTest(
            ref_record.name,
            port_record.name,
            "jump",
            status,
            out_cmp.max_abs,
            out_cmp.cosine,
            input_error=errors[0],
            output_error=errors[1],
            note=note,
            comparison=out_cmp,
        )

    def _jump_inputs(
        self, ref_record: Record, port_record: Record, ref_outs: Leaves
    ) -> tuple[Status, str, tuple[float | None, float | None]]:
        """A differing output's status from the captured inputs: its reason and (input, output) errors."""
        ref_in = list(ref_record.inputs.items())
        port_in = list(port_record.inputs.items())
        ref_in, pairs = pair_inputs(ref_in, port_in) if ref_in and port_in else (ref_in, None)
        if pairs is None and ref_in and port_in:
            found = pair_layouts(ref_in, port_in)
            if found is not None:
                pairs, port_in, _ = found
        if pairs is None:
            return "untestable", "inputs cannot be paired", (None, None)
        in_pass = all(self.compare(ref_in[i][1], port_in[j][1], "input").passed for i, j in pairs)
        in_err = max(relative_error(port_in[j][1], ref_in[i][1]) for i, j in pairs)
        out_pairs, port_outs, _ = pair_layouts(ref_outs, list(port_record.outputs.items()))
        out_err = max(relative_error(port_outs[j][1], ref_outs[i][1]) for i, j in out_pairs)
        errors = (in_err, out_err)
        if in_pass:
            return "fail", "inputs agree within tolerance, outputs do not", errors
        if in_err == 0 or out_err / in_err > self.ratio:
            why = (
                f"output error {format_number(out_err)} > {self.ratio:g} x input error"
                f" {format_number(in_err)}"
            )
            return "fail", why, errors
        return "pass", "error inherited from the inputs", errors

    def inherit(self, upper: Searcher, name: str) -> None:
        """Carry over what ``upper``, the searcher one level up, found testing call ``name`` (a zoom enters a
        block it has tested from the level above): its verdict, kept outputs, layouts and why it was not
        replayed."""
        for table in ("results", "replays", "layouts", "input_layouts", "why_not_replayed"):
            source = getattr(upper, table)
            if name in source:
                getattr(self, table)[name] = source[name]

    # search ----------------------------------------------------------------------------------------
    def descend(self, record: Record) -> tuple[Record, int]:
        """Deepest failing call under a failing ``record``; returns (call, number of aligned children
        passed)."""
        found, passed = self._failing_below(record)
        return found if found is not None else (record, passed)

    def _failing_below(self, record: Record) -> tuple[tuple[Record, int] | None, int]:
        # Untestable children (no aligned partner to replay) are looked through, not counted as passed; so are
        # failing pairs aligned on order and shape alone (low confidence): a lead, never the culprit.
        passed = 0
        for child in self.frontier(record):
            result = self.test(child)
            if result.status == "fail" and self.confident(child):
                return self.descend(child), passed
            if result.status == "fail" or result.status == "untestable":
                if result.status == "fail":
                    self.lead(child)
                found, _ = self._failing_below(child)
                if found is not None:
                    return found, passed
            else:
                passed += 1
        return None, passed

    def confident(self, record: Record, strict: bool = False) -> bool:
        r"""Whether ``record``'s pair may be named the culprit: aligned by names, a map or informative
        weights (not ``low`` confidence); unless ``strict``, also a low-confidence pair of one module class on
        both sides (two LayerNorms of fresh ones, in the same place). Two classes paired by order and shape
        alone (a block against a norm) never are, unless a verified fix confirms them by value."""
        pair = self.alignment.pair_of(record.module)
        if pair is None:
            return False
        if pair.confidence != "low":
            return True
        port_record = self.port_record(record)
        if strict or port_record is None or port_record.type != record.type:
            return False
        # paired by order: only where weights could not have paired them (a side without informative
        # parameters); two convolutions whose trained weights match nothing of each other are a guess (a
        # research Parallel's first branch against the port's conv that merged both branches)
        return pair.how != "order" or not (
            self._holds_informative(self.ref_modules.get(record.module))
            and self._holds_informative(self.port_modules.get(port_record.module))
        )

    @staticmethod
    def _holds_informative(module: Any) -> bool:
        from paritykit.forensics.conversion.fingerprints import informative

        if module is None:
            return False
        return any(informative(p.detach()) for p in module.parameters(recurse=False))

    def passed_below(self, record: Record) -> int:
        r"""How many of ``record``'s nearest aligned calls passed their tests."""
        return sum(1 for child in self.frontier(record) if self.test(child).status == "pass")

    def lead(self, record: Record) -> None:
        r"""Keep a failing low-confidence pair as a lead (once)."""
        result = self.test(record)
        if result not in self.candidates:
            self.candidates.append(result)

    def masking(self) -> bool:
        """Whether a failing test sits on a pair aligned with medium or high confidence, or differs far above
        its float floor whatever the confidence."""
        for test in self.results.values():
            pair = self.alignment.pair_of(module_of(test.reference))
            if test.status != "fail" or pair is None or not self.fed_alike(test.reference):
                continue
            if pair.confidence != "low" or (far_above(test.max_abs, test.floor) and self._trusted_low(test)):
                return True
        return False

    def fed_alike(self, name: str) -> bool:
        r"""Whether reference call ``name`` and its port call were fed the same inputs in the two runs
        (within tolerance). Only then is a failing replay a difference hidden in the run: a module fed
        otherwise by design (a decoder whose un-scaling the port's pipeline does before it, a guidance batch
        in the other order) fails a replay on inputs the port never gives it, while the run matches."""
        record = self.ref_trace[name] if name in self.ref_trace else None
        port_record = self.port_record(record) if record is not None else None
        return port_record is not None and self.inputs_agree(record, port_record)

    def _trusted_low(self, test: ModuleTest) -> bool:
        r"""Whether a low-confidence test's pair counts as evidence: its two calls of one module class, and
        not two modules whose informative weights the weights pass could not pair (:meth:`confident`)."""
        ref = self.ref_trace
        return test.reference in ref and self.confident(ref[test.reference])

    def captured_difference(self, record: Record) -> tuple[float | None, float | None] | None:
        r"""The captured outputs of aligned call ``record`` against its port call's: ``(max_abs, floor)``
        when they differ beyond tolerance and not by float noise (the floor is ``None`` when not measured);
        ``None`` when they agree or cannot be compared."""
        port_record = self.port_record(record)
        if port_record is None:
            return None
        paired = self.compare_paired(
            list(record.outputs.items()), list(port_record.outputs.items()), record.name
        )
        if paired is None or paired.worst.passed:
            return None
        if self.boundary(record, list(record.outputs.items()), list(port_record.outputs.items())):
            return None  # the two end at different places, or differ by what the call above takes back
        floor = None
        if self.float_floor is not None and self.float_floor.measured:
            floor = self.float_floor.of(record, port_record)
            if within(paired.worst.max_abs, floor):
                return None
        return paired.worst.max_abs, floor

    def outputs_disagree(self, record: Record) -> bool:
        """Whether the captured outputs of aligned call ``record`` differ beyond tolerance on the two sides,
        and not by float noise where the floor was measured."""
        return self.captured_difference(record) is not None

    def differing_calls(self) -> list[Record]:
        r"""Every aligned call (below the top level) whose captured outputs differ beyond tolerance, in
        completion order: a comparison of what capture holds each, no run. A pair aligned on order and output
        shape alone (low confidence) is no evidence when the final output matches, unless its difference is
        far above its measured float floor."""
        out = []
        for record in self.ref_trace.completion_order():
            pair = self.alignment.pair_of(record.module)
            if record.parent is None or pair is None:
                continue
            found = self.captured_difference(record)
            if found is None:
                continue
            if pair.confidence != "low" or (far_above(*found) and self.confident(record)):
                out.append(record)
        return out

    def masked_call(self) -> tuple[Record, int] | None:
        """With a matching output and passing top-level blocks, a module deeper down may still fail (its error
        shrunk by what follows, inside a passing parent). Every aligned call whose captured outputs differ
        while its captured inputs agree (:meth:`fed_alike`) is a candidate, deepest first; the first that also
        fails on identical inputs is the culprit."""
        for record in self.differing_calls():
            if not self.fed_alike(record.name):
                continue
            result = self.test(record)
            if result.status != "fail":
                continue
            if self.confident(record):
                return self.descend(record)
            self.lead(record)
            found, _ = self._failing_below(record)
            if found is not None:
                return found
            # the nearest confidently aligned call above the lead holds the difference, when it fails itself;
            # the top level, whose output matches here, never does
            above = self.confident_ancestor(record)
            if above.parent is not None and self.test(above).status == "fail":
                return above, self.passed_below(above)
        return None

    def confident_ancestor(self, record: Record) -> Record:
        r"""The nearest call above ``record`` aligned with more than low confidence, else the top-level
        call."""
        by_name = {r.name: r for r in self.ref_trace.records}
        parent = by_name.get(record.parent) if record.parent is not None else None
        while parent is not None and parent.parent is not None and not self.confident(parent, strict=True):
            parent = by_name.get(parent.parent)
        return parent if parent is not None else self.ref_trace.root


def join_notes(*notes: str) -> str:
    r"""The notes joined by "; ", each said once (a note the next one starts with is left out)."""
    kept = [n for n in notes if n]
    return "; ".join(n for i, n in enumerate(kept) if not any(m.startswith(n) for m in kept[i + 1 :]))
