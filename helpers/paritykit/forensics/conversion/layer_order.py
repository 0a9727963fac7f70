r"""Layer provenance: which source layer each target layer holds.

A port that loads a research checkpoint's per-block shards in text order (``0, 1, 10, 11, …, 2, …``) puts
block 10's tensors in block 2: every tensor is exact, every rule looks plausible, and the model computes its
blocks in another order. Within a group of layers built alike (``blocks.0``, ``blocks.1``, … with the same
tensor names under each), the index map target → source is read off the tensors each layer holds. A map
that keeps the order is a renumbering (LDM's ``input_blocks`` into diffusers' ``down_blocks``, an offset):
not a finding. A map that does not is said before anything else, with the text-sorting it usually comes from.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# the first numbered component of a name: ``(group).(index)(.rest)``
_LAYER = re.compile(r"^(?P<group>(?:.*?\.)??[^.\d][^.]*)\.(?P<index>\d+)(?P<rest>\..+)?$")
# at least this many layers make a group whose order can be read
MIN_LAYERS = 3
SHOWN = 4


@dataclass(frozen=True)
class LayerOrder:
    r"""One group of layers: the target's layer ``i`` holds the source's layer ``index_map[i]``."""

    source_group: str
    target_group: str
    index_map: dict[int, int]
    # from two traces: whether the target calls the layers it holds in another order than the source calls
    # them (None: not known; a reversed store the code iterates reversed is consistent)
    calls_differ: bool | None = None

    @property
    def monotone(self) -> bool:
        r"""Whether the map keeps the order, or reverses it whole (a renumbering, as LDM's decoder ``up.3`` ->
        diffusers' ``up_blocks.0``: the code iterates one of them reversed), not a reordering."""
        sources = [self.index_map[i] for i in sorted(self.index_map)]
        pairs = list(zip(sources, sources[1:]))
        return all(a < b for a, b in pairs) or all(a > b for a, b in pairs)

    @property
    def identity(self) -> bool:
        return all(i == j for i, j in self.index_map.items())

    @property
    def text_sorted(self) -> bool:
        r"""Whether the source indices in target order are the source indices sorted as text."""
        sources = [self.index_map[i] for i in sorted(self.index_map)]
        return sources == sorted(sources, key=str) and sources != sorted(sources)

    def moved(self) -> list[tuple[int, int]]:
        return [(i, j) for i, j in sorted(self.index_map.items()) if i != j]

    def words(self, target: str = "port", source: str = "reference") -> str:
        moved = self.moved()
        shown = ", ".join(f"{i} ← {j}" for i, j in moved[:SHOWN]) + (", …" if len(moved) > SHOWN else "")
        mine, theirs = self.target_group.rsplit(".", 1)[-1], self.source_group.rsplit(".", 1)[-1]
        line = (
            f"the {target}'s {self.target_group} are the {source}'s {self.source_group} in another order"
            f" ({target} {mine} ← {source} {theirs}): {shown}"
        )
        if self.text_sorted:
            line += "; the indices were sorted as text (0, 1, 10, 11, …, 2): load the shards in numeric order"
        return line

    def source_name(self, target_name: str) -> str | None:
        r"""A target name under this group with its index put back to the source's (``None`` outside)."""
        found = _LAYER.match(target_name)
        if found is None or found["group"] != self.target_group:
            return None
        index = self.index_map.get(int(found["index"]))
        return None if index is None else f"{self.source_group}.{index}{found['rest'] or ''}"

    def target_name(self, source_name: str) -> str | None:
        r"""A source name under this group with its index put to the target layer that holds it."""
        found = _LAYER.match(source_name)
        if found is None or found["group"] != self.source_group:
            return None
        inverse = {j: i for i, j in self.index_map.items()}
        index = inverse.get(int(found["index"]))
        return None if index is None else f"{self.target_group}.{index}{found['rest'] or ''}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "source_group": self.source_group,
            "target_group": self.target_group,
            "index_map": {str(i): j for i, j in sorted(self.index_map.items())},
            "monotone": self.monotone,
            "text_sorted": self.text_sorted,
        }


def layer_orders(pairs: Iterable[tuple[str, str]]) -> list[LayerOrder]:
    r"""The groups of layers built alike whose target layers hold source layers, from (source name, target
    name) pairs of tensors known to hold the same values. A group counts when each target layer takes its
    tensors from one source layer (a majority), no two target layers from the same one, the layers hold the
    same tensor names, and there are at least :data:`MIN_LAYERS`."""
    votes: dict[tuple[str, str], dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
    rests: dict[tuple[str, str], dict[int, set[str]]] = defaultdict(lambda: defaultdict(set))
    for source, target in pairs:
        s, t = _LAYER.match(source), _LAYER.match(target)
        if s is None or t is None:
            continue
        key = (s["group"], t["group"])
        votes[key][int(t["index"])][int(s["index"])] += 1
        rests[key][int(t["index"])].add(t["rest"] or "")
    out = []
    for (source_group, target_group), by_target in votes.items():
        index_map = {i: counts.most_common(1)[0][0] for i, counts in by_target.items()}
        if len(index_map) < MIN_LAYERS or len(set(index_map.values())) != len(index_map):
            continue
        names = list(rests[(source_group, target_group)].values())
        if any(n != names[0] for n in names):
            continue  # not built alike
        out.append(LayerOrder(source_group, target_group, index_map))
    return out


def reordered(pairs: Iterable[tuple[str, str]]) -> list[LayerOrder]:
    r"""The groups of :func:`layer_orders` whose map does not keep the order (nor reverse it whole)."""
    return [order for order in layer_orders(pairs) if not order.monotone]


def with_calls(order: LayerOrder, source_calls: list[str], target_calls: list[str]) -> LayerOrder:
    r"""``order`` with :attr:`LayerOrder.calls_differ` read from the modules each side called, in call
    order: the source's layers against the source layers the target's layers hold, in the target's call
    order."""
    import dataclasses

    def indices(calls: list[str], group: str) -> list[int]:
        out: list[int] = []
        for name in calls:
            found = _LAYER.match(name)
            if found is not None and found["group"] == group and not found["rest"]:
                index = int(found["index"])
                if index not in out:
                    out.append(index)
        return out

    source = [j for j in indices(source_calls, order.source_group) if j in order.index_map.values()]
    held = [order.index_map[i] for i in indices(target_calls, order.target_group) if i in order.index_map]
    if not source or not held:
        return order
    return dataclasses.replace(order, calls_differ=source != held)


def value_keys(state: Mapping[str, Any], *, layers_only: bool = False) -> dict[str, tuple]:
    r"""``{name: (shape, dtype, position hash)}`` of the informative tensors of ``state`` (constants such as
    all-ones norms and weights on ``meta`` are left out): what :func:`key_pairs` matches, and what a trace
    folder records of its model's weights in place of a copy
    (:func:`paritykit.tracing.split_traces.weight_fingerprints`); ``layers_only``: the names under numbered
    layers only."""
    from paritykit.forensics.conversion.fingerprints import informative, position_hash

    out = {}
    for name in state:
        if layers_only and _LAYER.match(name) is None:
            continue
        tensor = state[name]
        if tensor.device.type == "meta" or not informative(tensor):
            continue
        out[name] = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), position_hash(tensor))
    return out


def key_pairs(
    source: Mapping[str, tuple], target: Mapping[str, tuple], *, layers_only: bool = True
) -> list[tuple[str, str]]:
    r"""(source, target) names whose :func:`value_keys` agree, where the key names one tensor on each side;
    ``layers_only``: among the names under numbered layers."""

    def unique(keys: Mapping[str, tuple]) -> dict[tuple, str]:
        seen: dict[tuple, list[str]] = defaultdict(list)
        for name, key in keys.items():
            if not layers_only or _LAYER.match(name) is not None:
                seen[key].append(name)
        return {key: names[0] for key, names in seen.items() if len(names) == 1}

    by_value = unique(source)
    return [(by_value[key], name) for key, name in unique(target).items() if key in by_value]
