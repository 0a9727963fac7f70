r"""Pair the modules of a reference and a port that name them differently.

``blocks.0.attn.qkv`` in a research repository is ``transformer_blocks.0.attn1.to_q/k/v`` in diffusers. The
alignment is built in five passes, each working only on what the earlier ones left unaligned:

1. ``names``: identical dotted names (with the same class or the same output shape);
2. ``map``: ``--map``/``NAME_MAP`` rules applied to reference names (:mod:`paritykit.base.naming`);
3. ``weights``: a module corresponds to another when their parameters map onto each other by value
   (:func:`paritykit.forensics.conversion.matching.infer_conversion_map`); containers pair when the parameters
   under them do, and a fused tensor split into several gives a 1:N correspondence (``group``). When several
   modules hold the same parameters (a wrapper around a layer), the deepest pair first: an embedding table
   pairs with the port's table, never with a block that holds the table and adds positions in its own forward;
   a module paired through the tensors it holds itself (a null key/value) is never paired with a port block
   that also holds tensors made from another reference module (the feed-forward next to that attention);
4. ``order``: parameterless modules (activations, dropout, pooling, positional tables) between two aligned
   neighbours, by execution order and class, so a GELU variant or a rotary table is named itself
   (``confidence="medium"``);
5. ``order`` with ``confidence="low"``: what is left, by execution order and output shape.

A pair by weights whose parameters carry no information (constant tensors such as fresh all-ones norms, or
values that several modules share) is ``low`` confidence too. Port modules whose parameters the reference
keeps in a module it does not pair with them (positions added inline by the reference's top level, in an
``embeddings`` block by the port) are listed in ``split_work`` instead of being paired with unequal work.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from paritykit.base.naming import apply_rules, compile_rules
from paritykit.base.report import DEFAULT_LIMIT, render_table
from paritykit.bisection.align_order import OrderPairing, call_distance
from paritykit.bisection.align_sides import Side, replayed_distance, side_of
from paritykit.forensics.conversion.fingerprints import informative

if TYPE_CHECKING:
    from paritykit.tracing.trace import Trace

HOW = ("names", "map", "layer order", "weights", "order")


# high: names or exact weights; medium: a conversion map's evidence; low: execution order and output shape
# only
Confidence = Literal["high", "medium", "low"]


@dataclass
class AlignedPair:
    r"""One correspondence. ``group`` marks a part of a 1:N or N:1 correspondence (fused <-> split tensors),
    which cannot be compared call by call."""

    reference: str
    port: str
    how: str
    confidence: Confidence = "high"
    group: bool = False
    # set when the port's parameters are a row permutation of the reference's (shift/scale halves swapped,
    # reordered heads): the two outputs then differ by that permutation by design, so they are not compared
    layout: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {
            "reference": self.reference,
            "port": self.port,
            "how": self.how,
            "confidence": self.confidence,
            "group": self.group,
        }
        if self.layout:
            out["layout"] = self.layout
        return out


@dataclass
class Alignment:
    r"""The module correspondence of two models; one object, two faces (``to_dict`` and ``render``)."""

    pairs: list[AlignedPair] = field(default_factory=list)
    unaligned_reference: list[str] = field(default_factory=list)
    unaligned_port: list[str] = field(default_factory=list)
    split_work: list[SplitWork] = field(default_factory=list)
    # groups of layers the port holds in another order than the reference
    # (paritykit.forensics.conversion.layer_order); their modules are aligned by that order, not by name
    layer_orders: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._index()

    def _index(self) -> None:
        self._ref = {p.reference: p for p in self.pairs if not p.group}
        self._port = {p.port: p for p in self.pairs if not p.group}

    def port_of(self, reference: str) -> str | None:
        """The port module aligned one-to-one with a reference module."""
        pair = self._ref.get(reference)
        return pair.port if pair else None

    def reference_of(self, port: str) -> str | None:
        pair = self._port.get(port)
        return pair.reference if pair else None

    def pair_of(self, reference: str) -> AlignedPair | None:
        return self._ref.get(reference)

    @property
    def one_to_one(self) -> list[AlignedPair]:
        return [p for p in self.pairs if not p.group]

    def inside(self, reference: str, port: str) -> list[tuple[str, str]]:
        r"""The one-to-one pairs below the modules ``reference`` and ``port``, as names relative to them."""
        ref_prefix, port_prefix = (reference + "." if reference else ""), (port + "." if port else "")
        return [
            (p.reference[len(ref_prefix) :], p.port[len(port_prefix) :])
            for p in self.one_to_one
            if p.reference.startswith(ref_prefix)
            and p.port.startswith(port_prefix)
            and p.reference != reference
        ]

    @property
    def exit_code(self) -> int:
        return 0 if not (self.unaligned_reference or self.unaligned_port) else 1

    def to_dict(self) -> dict[str, Any]:
        # every pass counted, one this list does not know included: the parts add up to the whole
        hows = [*HOW, *sorted({p.how for p in self.pairs} - set(HOW))]
        counts = {how: sum(1 for p in self.pairs if p.how == how) for how in hows}
        return {
            "aligned": len(self.pairs),
            "by": counts,
            "pairs": [p.to_dict() for p in self.pairs],
            "unaligned_reference": list(self.unaligned_reference),
            "unaligned_port": list(self.unaligned_port),
            "split_work": [s.to_dict() for s in self.split_work],
        }

    def summary(self) -> str:
        """One line: how many modules were aligned, by which pass, and how many were not."""
        by = ", ".join(f"{n} by {how}" for how, n in self.to_dict()["by"].items() if n)
        return (
            f"{len(self.pairs)} aligned ({by}); unaligned: {len(self.unaligned_reference)} reference, "
            f"{len(self.unaligned_port)} port"
        )

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        rows = [
            [
                _shown(p.reference),
                _shown(p.port),
                p.how + ("" if p.confidence == "high" else f" ({p.confidence})"),
            ]
            for p in self.pairs
        ]
        lines = [render_table(["reference", "port", "how"], rows, limit=limit, summary=self.summary())]
        for side, names in (("reference", self.unaligned_reference), ("port", self.unaligned_port)):
            if names:
                shown = names if not limit else names[:limit]
                more = f" … {len(names) - len(shown)} more" if len(names) > len(shown) else ""
                lines.append(f"unaligned {side}: {', '.join(shown)}{more}")
        lines += [s.render() for s in self.split_work]
        return "\n".join(lines)


@dataclass
class SplitWork:
    r"""A port module doing work the reference does elsewhere: its parameters are held directly by
    ``reference`` (a module the port module is not paired with), so the two sides split the computation
    differently and the port module has no reference counterpart to be compared with."""

    port: str
    reference: str
    parameters: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"port": self.port, "reference": self.reference, "parameters": list(self.parameters)}

    def render(self) -> str:
        return (
            f"split differently: port {_shown(self.port)} holds the reference's {_shown(self.reference)} "
            f"parameters {', '.join(self.parameters[:4])}, used inline in that module's forward; the port "
            "module has no reference counterpart and is not compared one-to-one"
        )


def _shown(name: str) -> str:
    return name if name else "(top level)"


# ------------------------------------------------------------------------------------------------- passes


class _Builder(OrderPairing):
    def __init__(self, ref: Side, port: Side):
        self.ref = ref
        self.port_modules: dict[
            str, Any
        ] = {}  # the port model's modules, when it is at hand (chains replayed)
        self.port = port
        self.pairs: list[AlignedPair] = []
        self.ref_done: set[str] = set()
        self.port_done: set[str] = set()
        self.cmap: Any = None
        # port tensor -> the reference tensors it is made of, from the weights pass (empty without weights)
        self.sources_of: dict[str, list[str]] = {}
        self.layer_orders: list[Any] = []

    def add(self, r: str, p: str, how: str, confidence: Confidence = "high", group: bool = False) -> None:
        self.pairs.append(AlignedPair(r, p, how, confidence, group))
        self.ref_done.add(r)
        self.port_done.add(p)

    def nests(self, r: str, p: str) -> bool:
        r"""Whether pairing ``r`` with ``p`` keeps the pairs already made below either inside the other: a
        port block holding the time embedder (paired with the reference's ``t_embedder``) is no pair for the
        reference's text embedder, whatever tensors the two have left unpaired."""
        if not r or not p:
            return True
        r_prefix, p_prefix = r + ".", p + "."
        for q in self.pairs:
            if q.group:
                continue
            if q.port.startswith(p_prefix) != q.reference.startswith(r_prefix):
                return False
        return True

    def free_ref(self) -> list[str]:
        return [n for n in self.ref.order if n not in self.ref_done]

    def free_port(self) -> list[str]:
        return [n for n in self.port.order if n not in self.port_done]

    def compatible(self, r: str, p: str, own_params: bool = True) -> bool:
        same_type = self.ref.types.get(r) == self.port.types.get(p)
        rs, ps = self.ref.out_shapes.get(r), self.port.out_shapes.get(p)
        same_shape = rs is not None and rs == ps
        if not own_params:
            return same_type or same_shape
        rp = sorted(map(tuple, self.ref.params.get(r, {}).values()))
        pp = sorted(map(tuple, self.port.params.get(p, {}).values()))
        return (same_type or same_shape) and rp == pp

    # 1 + 2 ------------------------------------------------------------------------------------------
    def by_layer_order(self) -> None:
        r"""Layers the port holds in another order than the reference (block 10's tensors in block 2) pair by
        the tensors they hold, before any name: the reference's ``blocks.10`` and everything under it with the
        port's ``blocks.2``, where the names under them agree (the rest is left to the weights)."""
        from paritykit.forensics.conversion.layer_order import key_pairs, layer_orders, with_calls

        try:
            ref_keys = self.ref.keys(layers_only=True)
            port_keys = self.port.keys(layers_only=True) if ref_keys else None
            orders = layer_orders(key_pairs(ref_keys, port_keys)) if ref_keys and port_keys else []
        except Exception:  # weights that cannot be read here (a missing shard): names decide
            orders = []
        # every layer group whose layers hold other indices is aligned by the tensors (a renumbering too: by
        # name it would pair each layer with its neighbour's); the report names those called in another order
        self.layer_orders = [o for o in orders if not o.identity]
        if self.ref.first_calls and self.port.first_calls:  # both traced: the order each side called them
            self.layer_orders = [with_calls(o, self.ref.order, self.port.order) for o in self.layer_orders]
        port_free = set(self.free_port())
        for r in self.free_ref():
            for order in self.layer_orders:
                p = order.target_name(r)
                if p is not None and p in port_free and self.compatible(r, p):
                    self.add(r, p, "layer order")
                    port_free.discard(p)

    def _reordered(self, name: str) -> bool:
        return any(
            o.target_name(name) is not None or o.source_name(name) is not None for o in self.layer_orders
        )

    def by_names(self, rules: Sequence[tuple[str, str]]) -> None:
        # the user's --map rules first: a rule that renames a module overrides its same-name partner
        if rules:
            compiled = compile_rules(rules)
            port_free = set(self.free_port())
            for r in self.free_ref():
                p = apply_rules(r, compiled)
                if p != r and p in port_free and self.compatible(r, p):
                    self.add(r, p, "map")
                    port_free.discard(p)
        port_free = set(self.free_port())
        for r in self.free_ref():
            if self._reordered(r):
                continue  # the same name holds another layer
            # the two top levels always correspond: they are the two models being compared
            if r in port_free and (r == "" or self.compatible(r, r)):
                self.add(r, r, "names")
                port_free.discard(r)

    # 3 ----------------------------------------------------------------------------------------------
    def by_weights(self) -> None:
        if not self.ref.state_dict or not self.port.state_dict:
            self.by_weight_keys()
            return
        ref_sd = _restrict(self.ref.state_dict, self.free_ref())
        port_sd = _restrict(self.port.state_dict, self.free_port())
        if not ref_sd or not port_sd:
            return
        from paritykit.forensics.conversion.modules import match_modules

        # Only what is still unaligned takes part: value matching is the expensive pass.
        cmap, ref_sd, port_sd = _infer(ref_sd, port_sd)
        self.cmap = cmap
        ambiguous = {a.target for a in cmap.ambiguous}
        identifying = {t for t in sources_of_all(cmap) if t not in ambiguous and informative(port_sd.get(t))}
        sources_of = {e.target: list(e.sources) for e in cmap.mapping if e.target not in ambiguous}
        self.sources_of = sources_of
        port_keys = list(port_sd)
        first_new = len(self.pairs)
        self.pair_by_sources(sources_of, identifying, list(ref_sd), port_keys)
        layout = _output_layouts(cmap.mapping)
        for pair in self.pairs[first_new:]:
            pair.layout = layout.get(pair.port, "")

        # Fused <-> split (1:N) and leaves whose evidence is only ambiguous (constant initialisations).
        modules = match_modules(ref_sd, port_sd, conversion_map=cmap)
        ref_free, port_free = set(self.free_ref()), set(self.free_port())
        split: dict[str, list[str]] = defaultdict(list)
        for p, refs in modules.items():
            if p not in port_free:
                continue
            refs = [r for r in refs if r in ref_free]
            if len(refs) == 1:
                split[refs[0]].append(p)
            elif len(refs) > 1:
                for r in refs:
                    # a many-to-one guess from constants alone is no correspondence at all
                    if self._evidence(r, p, port_keys, identifying) == "high":
                        self.add(r, p, "weights", group=True)
        ref_keys = list(ref_sd)
        for r, ports in split.items():
            if r in self.ref_done:
                continue
            # a port module paired through the tensors it holds itself must hold nothing made from
            # another reference module: a block that keeps the reference attention's null key next to its own
            # feed-forward does more work than that attention
            mine = _under(r, ref_keys)
            ports = [p for p in ports if _made_only_from(_under(p, port_keys), mine, sources_of)]
            if len(ports) == 1:
                if self._parents_agree(r, ports[0]) and self.nests(r, ports[0]):
                    self.add(r, ports[0], "weights", self._evidence(r, ports[0], port_keys, identifying))
            else:
                for p in ports:
                    if self._evidence(r, p, port_keys, identifying) == "high":
                        self.add(r, p, "weights", group=True)

    def unpair_other_extents(self) -> None:
        r"""Drop the pairs made by names whose two modules, by the weights pass, hold different extents of
        work: every tensor the one holds is made from the other's, while some of the other's are held outside
        it (research ``patches_self_attn`` holding its norm, time modulation and output norm, against
        diffusers' ``Attention`` of the same name with those in sibling modules). Replayed on the reference's
        inputs such a pair differs by the work only one of them holds. Two modules that hold each other's
        tensors in part (neither within the other) stay a pair: a conversion slip there is theirs."""
        if not self.sources_of:
            return
        kept = []
        for q in self.pairs:
            if q.how == "names" and q.reference and not q.group and self._other_extent(q.reference, q.port):
                self.ref_done.discard(q.reference)
                self.port_done.discard(q.port)
                continue
            kept.append(q)
        self.pairs = kept

    def _other_extent(self, r: str, p: str) -> bool:
        r_prefix, p_prefix = r + ".", p + "."
        inside_p = [t for t in self.sources_of if t.startswith(p_prefix)]
        from_r = [t for t, s in self.sources_of.items() if any(x.startswith(r_prefix) for x in s)]
        if not inside_p or not from_r:
            return False
        p_from_r = all(all(x.startswith(r_prefix) for x in self.sources_of[t]) for t in inside_p)
        r_in_p = all(t.startswith(p_prefix) for t in from_r)
        return p_from_r != r_in_p

    def by_weight_keys(self) -> None:
        r"""Modules paired by the hashes of the tensors under them, where a side has its trace folder's
        fingerprints in place of weights: a tensor pairs with the one tensor of the other side that has its
        shape, dtype and hash. Weights converted in any other way (transposed, fused, split) pair nothing
        here; names and order decide for them."""
        ref_keys, port_keys = self.ref.keys(), self.port.keys()
        if not ref_keys or not port_keys:
            return
        from paritykit.forensics.conversion.layer_order import key_pairs

        ref_keys = _restrict(ref_keys, self.free_ref())
        port_keys = _restrict(port_keys, self.free_port())

        sources_of = {t: [s] for s, t in key_pairs(ref_keys, port_keys, layers_only=False)}
        self.pair_by_sources(sources_of, set(sources_of), list(ref_keys), list(port_keys))

    def pair_by_sources(
        self,
        sources_of: dict[str, list[str]],
        identifying: set[str],
        ref_keys: list[str],
        port_keys: list[str],
    ) -> None:
        r"""Containers and leaves alike: a module pairs with another when the parameters under them map
        onto each other exactly (``sources_of``: port tensor -> the reference tensors it is made of); ``high``
        confidence where an ``identifying`` (value-unique, non-constant) tensor is among them."""
        ref_sig: dict[frozenset, list[str]] = defaultdict(list)
        image_of: dict[str, frozenset] = {}
        port_by_set: dict[frozenset, list[str]] = defaultdict(list)
        targets_of: dict[str, set[str]] = defaultdict(set)
        for t, sources in sources_of.items():
            for s in sources:
                targets_of[s].add(t)
        for r in self.free_ref():
            under = _under(r, ref_keys)
            image = frozenset(t for s in under for t in targets_of.get(s, ()))
            if not image:
                continue
            if any(not set(sources_of[t]) <= under for t in image):
                continue
            image_of[r] = image
            ref_sig[image].append(r)
        for p in self.free_port():
            mapped = frozenset(t for t in _under(p, port_keys) if t in sources_of)
            if mapped:
                port_by_set[mapped].append(p)
        for image, refs in ref_sig.items():
            ports = port_by_set.get(image)
            if not ports:
                continue
            # Wrapper chains (a Sequential holding one Linear, diffusers' GELU holding its proj) share one
            # set: pair innermost first, each with the first compatible partner (same class or output shape),
            # so a layer never pairs with a block that holds it and does more (an embedding table and the
            # ``embeddings`` block that also adds positions): the block is left over.
            ports = sorted(ports, key=_depth, reverse=True)
            confidence = "high" if image & identifying else "low"
            refs = sorted(refs, key=_depth, reverse=True)
            if len(refs) > 1 or len(ports) > 1:
                # a chain whose members hold one set (a residual unit and the Sequential inside it that omits
                # the skip): a pair whose captured outputs agree where every other member's do not is paired
                # by that measurement first
                for p in list(ports):
                    fits = [r for r in refs if self.compatible(r, p, own_params=False) and self.nests(r, p)]
                    r = self._agreeing(p, fits)
                    if r is not None:
                        self.add(r, p, "weights", confidence)
                        ports.remove(p)
                        refs.remove(r)
            for r in refs:
                for p in ports:
                    if self.compatible(r, p, own_params=False) and self.nests(r, p):
                        self.add(r, p, "weights", confidence)
                        ports.remove(p)
                        break

    def _agreeing(self, p: str, refs: list[str]) -> str | None:
        r"""The one of ``refs`` whose first call's output agrees with ``p``'s (relative error at most
        :data:`CHAIN_AGREE`) while every other's is :data:`CHAIN_GAIN` times further off; ``None`` when no
        call is at hand or the outputs do not single one out."""
        if len(refs) < 2:
            return None
        port_call = self.port.first_calls.get(p)
        distances = sorted(
            (call_distance(self.ref.first_calls.get(r), port_call, "outputs", math.inf), r) for r in refs
        )
        (best, r), (second, _) = distances[0], distances[1]
        if best <= CHAIN_AGREE and second >= CHAIN_GAIN * max(best, 1e-12):
            return r
        if distances[0][0] == distances[1][0]:
            # members with one output (a Sequential and its last layer: round 29's space-to-depth Rearrange
            # and 1x1 conv, folded by the port into one strided conv): the member fed what the port module is
            # fed, so that the pair can be replayed
            fed = sorted(
                (call_distance(self.ref.first_calls.get(r), port_call, "inputs", math.inf), r) for r in refs
            )
            (best, r), (second, _) = fed[0], fed[1]
            if best <= CHAIN_AGREE and second >= CHAIN_GAIN * max(best, 1e-12):
                return r
        # the captured outputs cannot tell (the inputs already differ upstream): the port module run on each
        # member's own captured inputs can
        module = self.port_modules.get(p)
        distances = sorted((replayed_distance(module, self.ref.first_calls.get(r)), r) for r in refs)
        (best, r), (second, _) = distances[0], distances[1]
        if best <= CHAIN_AGREE and second >= CHAIN_GAIN * max(best, 1e-12):
            return r
        # a slip inside keeps the port module from agreeing with any member: the structure decides. A member
        # that returns its input plus another member's output is a residual wrapper of it; the port module
        # pairs with the wrapper when it too returns its input plus one of its own calls' outputs
        wrappers = [w for w in refs if self.ref.residual_child(w) in refs]
        if len(wrappers) == 1 and self.port.residual_child(p) is not None:
            return wrappers[0]
        return None

    def _evidence(self, ref: str, port: str, port_keys: list[str], identifying: set[str]) -> Confidence:
        """``high`` when a value-unique, non-constant parameter under ``port`` comes from one under
        ``ref``."""
        prefix = ref + "." if ref else ""
        sources = {e.target: e.sources for e in self.cmap.mapping}
        backed = [
            t
            for t in _under(port, port_keys) & identifying
            if any(s.startswith(prefix) for s in sources.get(t, ()))
        ]
        return "high" if backed else "low"

    def split_work(self) -> list[SplitWork]:
        """Unaligned port modules whose own parameters equal tensors the reference holds directly in a module
        paired with something else (the top level adding positions inline, say)."""
        ref_sd, port_sd = self.ref.state_dict or {}, self.port.state_dict or {}
        by_shape: dict[tuple, list[str]] = defaultdict(list)
        for key, value in ref_sd.items():
            if informative(value):
                by_shape[tuple(value.shape)].append(key)
        paired = {(q.reference, q.port) for q in self.pairs}
        out = []
        for p in self.free_port():
            sources = []
            for local in self.port.params.get(p, {}):
                tensor = port_sd.get(f"{p}.{local}" if p else local)
                if not informative(tensor):
                    continue
                sources += [
                    k for k in by_shape.get(tuple(tensor.shape), []) if _same_tensor(ref_sd[k], tensor)
                ]
            owners = {k.rsplit(".", 1)[0] if "." in k else "" for k in sources}
            if len(owners) != 1:
                continue
            owner = owners.pop()
            if owner in self.ref_done and (owner, p) not in paired:
                out.append(SplitWork(p, owner, sorted(k.rsplit(".", 1)[-1] for k in sources)))
        return out

    def _parents_agree(self, r: str, p: str) -> bool:
        """An alignment from ambiguous evidence is kept only when the nearest aligned ancestors correspond."""
        lookup = {q.reference: q.port for q in self.pairs if not q.group}
        ra = _ancestors(r)
        pa = set(_ancestors(p))
        for a in ra:
            if a in lookup:
                return lookup[a] in pa
        return True


_ROW_OPS = ("swap_halves", "permute_rows")


# a wrapper chain's member is paired by its output when that output agrees within CHAIN_AGREE (relative) and
# every other member's is CHAIN_GAIN times further off
CHAIN_AGREE = 1e-3
CHAIN_GAIN = 100.0


def sources_of_all(cmap: Any) -> set[str]:
    return {e.target for e in cmap.mapping}


def _same_tensor(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.device == b.device and bool((a == b).all())


def _output_layouts(mapping: Sequence[Any]) -> dict[str, str]:
    """Port modules whose parameters are the reference's with output rows reordered (dim 0 of a weight)."""
    out: dict[str, str] = {}
    for entry in mapping:
        steps = [{"op": entry.op, **entry.args}, *entry.args.get("then", [])]
        for step in steps:
            if step.get("op") in _ROW_OPS and step.get("dim") == 0:
                module = entry.target.rsplit(".", 1)[0] if "." in entry.target else ""
                out[module] = step["op"]
    return out


def _restrict(state_dict: Mapping[str, Any], modules: list[str]) -> Mapping[str, Any]:
    """The entries of ``state_dict`` under any of ``modules`` (all of them when the top level is among them);
    a lazy mapping (offloaded weights) stays lazy: nothing is read here."""
    if "" in modules:
        return state_dict
    prefixes = tuple(m + "." for m in modules)
    if not isinstance(state_dict, dict):
        from paritykit.forensics.conversion.bounded import Subset

        return Subset(state_dict, [k for k in state_dict if k.startswith(prefixes)])
    return {k: v for k, v in state_dict.items() if k.startswith(prefixes)}


def _infer(ref_sd: Mapping[str, Any], port_sd: Mapping[str, Any]) -> tuple[Any, dict, dict]:
    """The conversion map of the two sides and the dicts it was inferred from. Weights read on access
    (offloaded) are compacted first, so unique equal pairs never sit in memory together
    (:mod:`paritykit.forensics.conversion.bounded`)."""
    from paritykit.forensics.conversion.matching import infer_conversion_map

    if isinstance(ref_sd, dict) and isinstance(port_sd, dict):
        return infer_conversion_map(ref_sd, port_sd), ref_sd, port_sd
    from paritykit.forensics.conversion.bounded import compact_pair, restore_for

    src, tgt, stood_in = compact_pair(ref_sd, port_sd)
    cmap = infer_conversion_map(src, tgt)
    if restore_for(cmap, ref_sd, port_sd, src, tgt, stood_in):
        cmap = infer_conversion_map(src, tgt)
    return cmap, src, tgt


def _made_only_from(targets: set[str], sources: set[str], sources_of: Mapping[str, Sequence[str]]) -> bool:
    r"""Every tensor of ``targets`` whose sources are known is made from tensors of ``sources`` only."""
    return all(set(sources_of[t]) <= sources for t in targets if t in sources_of)


def _under(module: str, keys: list[str]) -> set[str]:
    if not module:
        return set(keys)
    prefix = module + "."
    return {k for k in keys if k.startswith(prefix)}


def _depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1


def _ancestors(name: str) -> list[str]:
    """Enclosing module names, nearest first, ending with the top level ``""``."""
    out = []
    while name:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        out.append(name)
    return out


def align_modules(
    reference: Any,
    port: Any,
    ref_trace: Trace | None = None,
    port_trace: Trace | None = None,
    *,
    rules: Sequence[tuple[str, str]] = (),
    use_weights: bool = True,
) -> Alignment:
    r"""Pair the modules of ``reference`` and ``port``.

    Args:
        reference: the reference ``nn.Module`` (or ``None`` when only its trace is at hand; its weights are
            then read from the trace folder when present).
        port: the port ``nn.Module`` (or ``None``).
        ref_trace: a :class:`paritykit.tracing.trace.Trace` of the reference; only executed modules are
            aligned and execution order comes from it. Without traces every named module takes part, in
            definition order.
        port_trace: the same for the port.
        rules: ``[(regex, repl), …]`` renaming reference names into the port's naming (pass 2).
        use_weights: run pass 3 (value matching of parameters).

    Returns:
        An :class:`Alignment`: ``pairs`` (each with ``how`` = ``names``/``map``/``weights``/``order`` and a
        ``confidence``), ``unaligned_reference`` and ``unaligned_port`` in execution order.
    """
    ref_side = side_of(reference, ref_trace)
    port_side = side_of(port, port_trace)
    builder = _Builder(ref_side, port_side)
    builder.port_modules = dict(port.named_modules()) if port is not None else {}
    if use_weights:
        builder.by_layer_order()
    builder.by_names(rules)
    if use_weights:
        builder.by_weights()
        builder.unpair_other_extents()
    builder.by_order()
    ref_pos, port_pos = ref_side.position, port_side.position
    pairs = sorted(
        builder.pairs, key=lambda q: (ref_pos.get(q.reference, 1 << 30), port_pos.get(q.port, 1 << 30))
    )
    return Alignment(
        pairs=pairs,
        unaligned_reference=builder.free_ref(),
        unaligned_port=builder.free_port(),
        split_work=builder.split_work(),
        layer_orders=builder.layer_orders,
    )
