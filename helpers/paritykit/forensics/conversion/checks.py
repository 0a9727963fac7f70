r"""Warnings on exact mappings that still look wrong: fused chunks in an order the names contradict, a layer
converted unlike its siblings."""

from __future__ import annotations

import re
from collections import defaultdict

from paritykit.forensics.conversion.names import layer_key, name_relation
from paritykit.forensics.conversion.results import (
    ConversionWarning,
    MappingEntry,
    describe_op,
)

_ROLE_ORDER = {"q": 0, "k": 1, "v": 2}


_ROLE_WORDS = {"q": "q", "query": "q", "k": "k", "key": "k", "v": "v", "value": "v"}


def _role(name: str) -> str | None:
    r"""``q``/``k``/``v`` when the module holding ``name`` is named for one (``to_q``, ``k_proj``,
    ``value``)."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else parts[-1]
    roles = {_ROLE_WORDS[w] for w in re.split(r"[^a-z]+", module.lower()) if w in _ROLE_WORDS}
    return roles.pop() if len(roles) == 1 else None


def conversion_warnings(
    mapping: list[MappingEntry], shapes: dict[str, tuple] | None = None
) -> list[ConversionWarning]:
    r"""Exact mappings that contradict the names or the other layers.

    * A fused tensor split so that the chunk order contradicts the target names (chunk 0 -> ``k_proj``,
      chunk 1 -> ``q_proj``); the usual orders are q, k, v and k, v. Concatenations are read the same way.
    * A tensor built differently in some layers than in the others (``norm1`` from ``norm2`` in one block,
      shift/scale swapped in one block only).
    """
    out: list[ConversionWarning] = []
    out += layer_order_warnings(mapping)
    out += _fused_order_warnings(mapping)
    out += _layer_warnings(mapping)
    named = {w.target for w in out}
    out += [w for w in _lone_transpose_warnings(mapping, shapes or {}) if w.target not in named]
    return out


# a transposed weight is alone when the model copies at least this many other weights as they are
LONE_AMONG = 3


def _transposes(e: MappingEntry) -> bool:
    steps = [e.op, *(s.get("op") for s in e.args.get("then", []))]
    return "transpose" in steps


def _lone_transpose_warnings(
    mapping: list[MappingEntry], shapes: dict[str, tuple]
) -> list[ConversionWarning]:
    r"""A weight built as a transpose where every other weight is copied as it is: a square Linear stored
    transposed loads without a shape error and computes ``x @ W`` in place of ``x @ W.T``. A conversion that
    transposes its weights does so for many (GPT-2's Conv1D); one alone is a slip."""
    weights = [e for e in mapping if e.target.endswith("weight") and len(e.sources) == 1]
    # only a square matrix loads either way round; another shape stored transposed would not load at all
    square = [e for e in weights if len(shapes.get(e.target, ())) == 2 and len(set(shapes[e.target])) == 1]
    transposed = [e for e in square if _transposes(e)]
    copied = [e for e in weights if e.op == "identity" and not e.args.get("then")]
    if len(transposed) != 1 or len(copied) < LONE_AMONG:
        return []
    (e,) = transposed
    return [
        ConversionWarning(
            e.target,
            f"built as {describe_op(e.op, e.args)} of {e.sources[0]}, while the {len(copied)} other weights"
            " are copied as they are: a Linear stored transposed loads without error and computes x @ W in"
            " place of x @ W.T",
        )
    ]


def layer_order_warnings(mapping: list[MappingEntry]) -> list[ConversionWarning]:
    r"""Groups of layers built alike whose target layers hold the source's in another order (not a
    renumbering that keeps it): block 10's tensors in block 2 when shards were loaded in text order."""
    from paritykit.forensics.conversion.layer_order import reordered

    pairs = [(e.sources[0], e.target) for e in mapping if len(e.sources) == 1 and e.evidence == "values"]
    return [ConversionWarning(f"{o.target_group}.*", o.words("target", "source")) for o in reordered(pairs)]


def _fused_order_warnings(mapping: list[MappingEntry]) -> list[ConversionWarning]:
    out = []
    pieces: dict[tuple, list[tuple[int, str, MappingEntry]]] = defaultdict(list)
    for e in mapping:
        if e.op == "chunk" and len(e.sources) == 1 and _role(e.target):
            pieces[(e.sources[0], e.args["dim"])].append((e.args["start"], _role(e.target), e))
        if e.op == "concat":
            roles = [_role(s) for s in e.sources]
            known = [r for r in roles if r]
            if len(known) >= 2 and known != sorted(known, key=_ROLE_ORDER.get):
                order = ", ".join(f"{s} ({r})" for s, r in zip(e.sources, roles) if r)
                out.append(
                    ConversionWarning(
                        e.target, f"concatenated in the order {order}; the usual orders are q, k, v and k, v"
                    )
                )
    for (source, _dim), items in pieces.items():
        items.sort(key=lambda x: x[0])
        roles = [r for _, r, _ in items]
        if len(roles) < 2 or roles == sorted(roles, key=_ROLE_ORDER.get):
            continue
        order = ", ".join(
            f"{describe_op(e.op, e.args).split(' + ')[0]} -> {e.target.rsplit('.', 2)[-2]}"
            for _, _, e in items
        )
        for _, _, e in items:
            out.append(
                ConversionWarning(
                    e.target,
                    f"{source} is split as {order}: the chunk order contradicts the target names "
                    "(usual orders q, k, v and k, v); check the split",
                )
            )
    return out


def _layer_warnings(mapping: list[MappingEntry]) -> list[ConversionWarning]:
    groups: dict[tuple, list[MappingEntry]] = defaultdict(list)
    for e in mapping:
        groups[layer_key(e.target)].append(e)
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        relations = [name_relation(e, e.target) for e in members]
        counts: dict[tuple, int] = defaultdict(int)
        for r in relations:
            counts[r] += 1
        if len(counts) < 2:
            continue
        usual = max(counts, key=lambda r: (counts[r], -relations.index(r)))
        model = members[relations.index(usual)]
        for e, r in zip(members, relations):
            if r == usual:
                continue
            what = describe_op(e.op, e.args) or "a copy"
            usual_what = describe_op(model.op, model.args) or "a copy"
            swapped = ("swap_halves" in what) != ("swap_halves" in usual_what)
            hint = " (shift/scale order differs between blocks)" if swapped else ""
            out.append(
                ConversionWarning(
                    e.target,
                    f"built as {what} of {', '.join(e.sources)}, but {counts[usual]} other layer(s) build it"
                    f" as {usual_what} of their own tensor ({', '.join(model.sources)} ->"
                    f" {model.target}){hint}: the mapping is inconsistent across layer indices",
                )
            )
    return out
