r"""Which port call pairs with a reference call, and how its input leaves feed the port call's: the pairing
half of :class:`~paritykit.bisection.searcher.Searcher` (a mixin: it reads the searcher's traces, alignment,
comparison and caches)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paritykit.base.inputs import is_tensor
from paritykit.bisection.leaves import pair_inputs, pair_layouts, pair_with_extras
from paritykit.bisection.relations import Relation, argument_name, pair_by_value, renamed, unexplained
from paritykit.compare.tensors import relative_error
from paritykit.tracing.trace import Record

if TYPE_CHECKING:
    from paritykit.bisection.align import Alignment
    from paritykit.tracing.trace import Trace

# a call's tensors as (path, tensor), in the order capture flattened them
Leaves = list[tuple[str, Any]]

# a call whose inputs differ from those of the port call in its place of the order is paired by value with one
# of this many port calls nearest in order
MAX_CALL_CANDIDATES = 64
# two arguments this close in relative error are taken for one quantity when pairing by value
IDENTIFY = 1e-4


@dataclass(frozen=True)
class InputPairing:
    r"""How a reference call's input leaves feed a port call's: ``pairs`` of (reference index, port index),
    ``ref_leaves`` as paired (repeats taken once, possibly in the port's layout), and the port leaves with no
    reference counterpart (``extra``: their indices), which keep the port's own captured values."""

    ref_leaves: Leaves
    port_leaves: Leaves
    pairs: list[tuple[int, int]]
    extra: list[int]
    # port leaves paired by value across signatures (:mod:`paritykit.bisection.relations`), by port index:
    # how each is computed from reference leaves
    relations: dict[int, Relation] = field(default_factory=dict)
    # set when the relations were read at an earlier call of the same two classes (this call's inputs
    # differ, so its values cannot say which argument is which): that call's name
    learned_from: str = ""

    @property
    def own_paths(self) -> list[str]:
        r"""The paths of the port inputs with no reference counterpart."""
        return [self.port_leaves[j][0] for j in self.extra]

    def reference_value(self, i: int, j: int) -> Any:
        r"""The reference's value for port leaf ``j`` (paired with reference leaf ``i``), in the port's
        form."""
        relation = self.relations.get(j)
        return relation(self.ref_leaves) if relation is not None else self.ref_leaves[i][1]

    def rows(self, ref_module: Any = None, port_module: Any = None) -> list[tuple[str, str, str]]:
        r"""The interface as (port argument, reference argument, relation) rows, every port input once, named
        from the modules' ``forward`` signatures when given."""
        ref_paths = [path for path, _ in self.ref_leaves]

        def ref_name(path: str) -> str:
            return argument_name(ref_module, path)

        by_port = {j: i for i, j in self.pairs}
        out = []
        for j, (path, tensor) in enumerate(self.port_leaves):
            mine = argument_name(port_module, path)
            relation = self.relations.get(j)
            if relation is not None:
                sources = ", ".join(ref_name(self.ref_leaves[i][0]) for i in relation.sources)
                out.append(
                    (mine, sources, f"{relation.kind}: {renamed(relation.words, ref_paths, ref_name)}")
                )
            elif j in by_port:
                other = self.ref_leaves[by_port[j]][1]
                how = "same" if tuple(other.shape) == tuple(tensor.shape) else "dims permuted"
                out.append(
                    (
                        mine,
                        ref_name(self.ref_leaves[by_port[j]][0]),
                        f"{how} (paired by path, order or shape)",
                    )
                )
            else:
                out.append(
                    (mine, "", "the port's own: no reference argument gives it (taken from the port's run)")
                )
        return out

    def describe(self, ref_module: Any = None, port_module: Any = None) -> str:
        r"""How the arguments were paired by value, for a test's note (empty when paired by path, order or
        shape), each argument named from its module's ``forward`` signature when the module is given."""
        if not self.relations:
            return ""
        ref_paths = [path for path, _ in self.ref_leaves]

        def port_name(path: str) -> str:
            return argument_name(port_module, path)

        def ref_name(path: str) -> str:
            return argument_name(ref_module, path)

        said = [
            f"{port_name(self.port_leaves[j][0])} = {renamed(r.words, ref_paths, ref_name)}"
            for j, r in sorted(self.relations.items())
        ]
        own = [
            f"{port_name(path)}: taken from the port's own run (no reference argument paired with it)"
            for path in self.own_paths
        ]
        how = f"as by value at {self.learned_from}" if self.learned_from else "by value"
        return f"arguments paired {how}: " + "; ".join(said + own)


@dataclass(frozen=True)
class UnpairedInputs:
    r"""Port inputs no reference argument gives by value (indices into the port call's input leaves), the
    reference arguments left over that could stand for them, the words naming both, and whether any other
    argument of the call did pair by value."""

    port: list[int]
    reference: list[int]
    words: str
    any_paired: bool


class CallPairing:
    r"""The pairing methods of a searcher: which port call a reference call meets, whether their inputs agree,
    and how the reference's input leaves feed the port call. The searcher sets ``ref_trace``,
    ``port_trace``, ``alignment``, ``ref_modules``, ``port_modules``, ``compare`` and the caches
    ``_call_pairs``, ``_port_calls`` and ``_templates``."""

    ref_trace: Trace
    port_trace: Trace
    alignment: Alignment
    ref_modules: dict[str, Any]
    port_modules: dict[str, Any]
    _call_pairs: dict[str, Record | None]
    _port_calls: dict[str, list[Record]]
    _templates: dict[tuple, tuple[str, dict[int, Relation]]]

    compare: Callable[..., Any]  # the searcher's tolerance-aware comparison of two tensors

    # pairing ---------------------------------------------------------------------------------------
    def port_record(self, ref_record: Record) -> Record | None:
        r"""The port call paired with a reference call: of the aligned port module's calls, the one in the
        same place of the order when its inputs agree; else the nearest in order whose inputs agree (a shared
        module called twice where the reference has two, frame chunks processed with a cache, one guidance
        batch split in two); else the one in the same place. ``None`` when the module is unaligned."""
        if ref_record.name in self._call_pairs:
            return self._call_pairs[ref_record.name]
        pair = self.alignment.pair_of(ref_record.module)
        found = None if pair is None or pair.layout else self._pair_call(ref_record, pair.port)
        self._call_pairs[ref_record.name] = found
        return found

    def _pair_call(self, ref_record: Record, port_module: str) -> Record | None:
        calls = self._port_calls.get(port_module)
        if calls is None:
            calls = self._port_calls[port_module] = self.port_trace.calls(port_module)
        by_order = calls[ref_record.call] if ref_record.call < len(calls) else None
        repeated = len(calls) > 1 or ref_record.call > 0 or f"{ref_record.module}#1" in self.ref_trace
        if not repeated or (by_order is not None and self.inputs_agree(ref_record, by_order)):
            return by_order
        nearest = sorted(calls, key=lambda c: abs(c.call - ref_record.call))[:MAX_CALL_CANDIDATES]
        for candidate in nearest:
            if candidate is not by_order and self.inputs_agree(ref_record, candidate):
                return candidate
        # the same place of the order is kept only inside the call that holds its counterpart: a module the
        # port shares (one activation called after two convolutions) has its calls in other parent calls
        return by_order if by_order is not None and self._inside_counterpart(ref_record, by_order) else None

    def _inside_counterpart(self, ref_record: Record, port_record: Record) -> bool:
        r"""Whether ``port_record`` runs inside the port call paired with ``ref_record``'s nearest paired
        ancestor call; with no ancestor below the top level paired, only when it has none (a call inside a
        reference subtree the port never ran, such as a second guidance pass, has no counterpart)."""
        parent = ref_record.parent
        while parent is not None and parent in self.ref_trace:
            record = self.ref_trace[parent]
            if record.parent is None:
                return parent == ref_record.parent
            counterpart = self.port_record(record)
            if counterpart is not None:
                name = port_record.parent
                while name is not None and name != counterpart.name and name in self.port_trace:
                    name = self.port_trace[name].parent
                return name == counterpart.name
            parent = record.parent
        return True

    def inputs_agree(self, ref_record: Record, port_record: Record) -> bool:
        r"""Whether every reference input paired with a port input agrees with it within tolerance (at least
        one pair)."""
        try:
            pairing = self.pair_call_inputs(ref_record, port_record)
        except Exception:  # a trace folder with a missing shard: no value to pair by
            return False
        if pairing is None or not pairing.pairs:
            return False
        if port_record.replayable and reference_settings(ref_record, port_record.call_inputs()[1]):
            return False  # a flag both calls name is set otherwise (drop_text=True against False)
        for i, j in pairing.pairs:
            a, b = pairing.reference_value(i, j), pairing.port_leaves[j][1]
            if a.shape != b.shape or not self.compare(a, b.to(a.dtype), "input").passed:
                return False
        return True

    def pair_call_inputs(self, ref_record: Record, port_record: Record) -> InputPairing | None:
        """How the reference call's input leaves feed the port call's: by path, order or shape, then up to a
        dim permutation, then with port inputs the reference has no counterpart for (rotary cos/sin passed as
        ``image_rotary_emb``) kept from the port's own capture. ``None`` when they cannot be paired."""
        if not ref_record.replayable or not port_record.replayable:
            return None
        ref_leaves = list(ref_record.inputs.items())
        port_leaves = list(port_record.inputs.items())
        if not port_leaves:
            return None
        ref_leaves, pairs = pair_inputs(ref_leaves, port_leaves)
        extra: list[int] = []
        if pairs is None and len(ref_leaves) == len(port_leaves):
            # the reference's tensors in the port's layout (``[B, H, L, D]`` in, ``[B, L, H, D]`` taken)
            found = pair_layouts(port_leaves, ref_leaves)
            if found is not None and found[2]:
                ref_leaves = [(path, tensor.contiguous()) for path, tensor in found[1]]
                pairs = [(i, j) for j, i in found[0]]
        if pairs is None:
            pairs, extra = pair_with_extras(ref_leaves, port_leaves)
        if pairs is None:
            # the reference's call runs k of the port's batches at once (guidance passes packed into one
            # batch): its inputs feed the port's module whole, paired as the port's batch-for-batch
            k = _batch_multiple(ref_leaves, port_leaves)
            tiled = [(p, t.repeat(k, *[1] * (t.dim() - 1)) if t.dim() else t) for p, t in port_leaves]
            found, batched = pair_inputs(ref_leaves, tiled) if k else (ref_leaves, None)
            if batched is not None:
                return InputPairing(found, port_leaves, batched, [])
        if pairs is None:
            return self.pair_inputs_by_value(ref_record, port_record)
        return InputPairing(ref_leaves, port_leaves, pairs, extra)

    def same_quantity(self, a: Any, b: Any) -> bool:
        r"""Whether two same-shape tensors hold one quantity: equal within tolerance, or apart by at most
        :data:`IDENTIFY` relative error (float noise upstream; a replay feeds the reference's value
        anyway)."""
        return self.compare(a, b, "input").passed or relative_error(b, a) <= IDENTIFY

    def pair_inputs_by_value(self, ref_record: Record, port_record: Record) -> InputPairing | None:
        r"""The two calls' inputs paired by captured value across signatures
        (:func:`~paritykit.bisection.relations.pair_by_value`); ``None`` unless at least one floating-point
        port input is reached."""
        ref_leaves = list(ref_record.inputs.items())
        port_leaves = list(port_record.inputs.items())
        signature = _signature(ref_record, ref_leaves, port_record, port_leaves)
        relations = pair_by_value(ref_leaves, port_leaves, self.same_quantity)
        learned = ""
        if (
            not any(port_leaves[j][1].is_floating_point() for j in relations)
            or (unexplained(ref_leaves, port_leaves, relations)[0])
        ):
            # an input differs, so its value names no counterpart (and is no "own" input: see inputs_differ);
            # calls of the same two classes with the same arguments pair as an earlier call paired by value
            template = self._templates.get(signature)
            if template is None:
                return None
            learned, relations = template
        elif signature not in self._templates and not any(r.ties for r in relations.values()):
            # a call where two reference arguments were equal cannot say which is which for later calls
            self._templates[signature] = (ref_record.name, relations)
        pairs = [(r.sources[0], j) for j, r in relations.items()]
        extra = [j for j in range(len(port_leaves)) if j not in relations]
        return InputPairing(ref_leaves, port_leaves, pairs, extra, relations, learned)

    def inputs_differ(self, ref_record: Record, port_record: Record) -> str:
        r"""Why two calls' inputs cannot be paired by value, naming the port inputs no reference argument
        gives and the reference arguments left over; empty when that is not the reason."""
        if not ref_record.replayable or not port_record.replayable:
            return ""
        unpaired = self.unpaired_inputs(ref_record, port_record)
        return f"inputs differ: {unpaired.words}" if unpaired is not None else ""

    def unpaired_inputs(self, ref_record: Record, port_record: Record) -> UnpairedInputs | None:
        r"""The port inputs of a call pair that no reference argument gives by value, while an unused
        reference argument could stand for them (:func:`~paritykit.bisection.relations.unexplained`), named
        from the two modules' signatures; ``None`` when there are none."""
        ref_leaves = list(ref_record.inputs.items())
        port_leaves = list(port_record.inputs.items())
        relations = pair_by_value(ref_leaves, port_leaves, self.same_quantity)
        port_left, ref_left = unexplained(ref_leaves, port_leaves, relations)
        if not port_left:
            return None
        port_module = self.port_modules.get(port_record.module)
        ref_module = self.ref_modules.get(ref_record.module)
        port_names = ", ".join(argument_name(port_module, port_leaves[j][0]) for j in port_left)
        ref_names = ", ".join(argument_name(ref_module, ref_leaves[i][0]) for i in ref_left)
        words = (
            f"port {port_names} equal no reference argument by value (reference {ref_names} left unpaired)"
        )
        return UnpairedInputs(port_left, ref_left, words, bool(relations))


def _signature(ref_record: Record, ref_leaves: Leaves, port_record: Record, port_leaves: Leaves) -> tuple:
    def shapes(leaves: Leaves) -> tuple:
        return tuple((path, tuple(t.shape), t.dtype) for path, t in leaves)

    return ref_record.type, port_record.type, shapes(ref_leaves), shapes(port_leaves)


def unpaired_shapes(ref_record: Record, port_record: Record) -> str:
    """Why two calls' outputs cannot be compared, with both sides' shapes (a shape mismatch, usually)."""

    def shapes(record: Record) -> str:
        return ", ".join(str(list(t.shape)) for t in record.outputs.values()) or "no tensor"

    return (
        f"outputs not paired (by path, order, shape or value): reference {shapes(ref_record)} vs port"
        f" {shapes(port_record)}"
    )


_PLAIN = (bool, int, float, str, type(None))


def reference_settings(ref_record: Record, port_kwargs: dict[str, Any]) -> dict[str, Any]:
    r"""The reference call's plain (non-tensor) keyword arguments whose name the port's call also uses with
    another value: a replay sets them as the reference did, so its inputs are identical in those too."""
    if not ref_record.replayable:
        return {}
    _, ref_kwargs = ref_record.call_inputs()
    return {
        k: v
        for k, v in ref_kwargs.items()
        if k in port_kwargs
        and isinstance(v, _PLAIN)
        and isinstance(port_kwargs[k], _PLAIN)
        and v != port_kwargs[k]
    }


def _batch_multiple(ref_leaves: Leaves, port_leaves: Leaves) -> int:
    r"""``k`` > 1 when the first floating-point input of each call has the same shape but for its batch,
    the reference's ``k`` times the port's; 0 otherwise."""
    first = [
        next((t for _, t in leaves if is_tensor(t) and t.is_floating_point() and t.dim() > 0), None)
        for leaves in (ref_leaves, port_leaves)
    ]
    a, b = first
    if a is None or b is None or a.shape[1:] != b.shape[1:] or b.shape[0] == 0 or a.shape[0] % b.shape[0]:
        return 0
    k = a.shape[0] // b.shape[0]
    return k if k > 1 else 0
