r"""What a repair is: one candidate edit of the port (``Edit``), the simple constants a fitted number is
snapped to, and the verified result as a hint (``RepairHint``) whose JSON carries the edit and its
residual."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from paritykit.base.report import format_value
from paritykit.bisection.constants import NAMED as _NAMED
from paritykit.bisection.constants import simple_constants, snapped  # noqa: F401 (the grammar's)
from paritykit.compare.diagnose import Hint

# the grammar's tiers, cheapest first; ``uses`` edits parameters that hold the reference's own values (the
# weights are right, so what such an edit shows is how the port's forward uses them)
Tier = Literal["parameters", "inputs", "outputs", "settings", "uses"]
TIERS: tuple[Tier, ...] = get_args(Tier)

# The search order inside a tier: smaller is tried first and counts as the smaller edit. The engine tries a
# tier's edits in this order and, once one verifies, only edits as cheap. A kind marked "+ chunks" adds the
# chunk count (two chunks swapped is a smaller edit than eight reordered). ``uses`` edits cost what the same
# edit of ``parameters`` costs.
COSTS: dict[tuple[Tier, str], int] = {
    ("parameters", "swap-parameters"): 0,
    ("parameters", "transpose"): 1,
    ("parameters", "negate"): 1,
    ("parameters", "flip"): 2,
    ("parameters", "permute-chunks"): 3,  # + chunks
    ("parameters", "exp"): 12,
    ("parameters", "log"): 12,
    ("parameters", "reciprocal"): 12,
    ("parameters", "rescale"): 14,
    ("inputs", "swap-inputs"): 0,
    ("inputs", "swap-dims"): 1,
    ("inputs", "swap-halves"): 2,
    ("inputs", "rescale"): 10,
    ("outputs", "permute-chunks"): 0,  # + chunks
    ("outputs", "rescale"): 10,
    ("outputs", "input-residual"): 11,
    ("settings", "attribute"): 19,
    ("settings", "setting"): 20,
}

# A fitted factor is checked against the same edit with the factor moved by this much either way: an edit
# whose controls verify too proves nothing (the module is nearly invariant to it: a norm to its input's
# scale).
CONTROL_FACTOR = 1.5


def cost_of(tier: Tier, kind: str, chunks: int = 0) -> int:
    r"""An edit's place in the search order (:data:`COSTS`)."""
    return COSTS["parameters" if tier == "uses" else tier, kind] + chunks


@dataclass(kw_only=True)
class Edit:
    r"""One candidate change of the port at a site; a subclass says how it changes the site's working copy.

    Args:
        tier: one of :data:`TIERS`.
        kind: what the edit does (``permute-chunks``, ``rescale``, ``swap-inputs``, ``setting`` …).
        target: what it changes, as a porter names it (``attn.to_k.weight``, ``block input hidden_states``).
        parameters: the edit's numbers (chunk order, dim, factor, setting value), JSON-ready.
        words: one sentence saying what to change in the port.
        cost: its place in the search order (:func:`cost_of`).
        remake: for an edit with a fitted ``factor``: the same edit with another factor, which
            :meth:`controls` builds.
    """

    tier: Tier
    kind: str
    target: str
    parameters: dict[str, Any]
    words: str
    cost: int
    remake: Callable[[float], Edit] | None = field(default=None, repr=False)

    def apply(self, work: Any) -> Any:
        r"""The edited port module built from the site's working copy ``work`` (put back by :meth:`undo`)."""
        return work

    def undo(self) -> None:
        r"""Put the working copy back after a trial (edits that wrap it change nothing to undo)."""

    def on_outputs(self, leaves: list) -> list | None:
        r"""For an edit of the outputs alone: the port's replayed output leaves, edited; ``None``
        otherwise."""
        return None

    def controls(self) -> list[Edit]:
        r"""The same edit with its fitted factor moved by :data:`CONTROL_FACTOR` either way (none without
        one)."""
        if self.remake is None:
            return []
        factor = self.parameters["factor"]
        return [self.remake(factor * CONTROL_FACTOR), self.remake(factor / CONTROL_FACTOR)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "kind": self.kind,
            "target": self.target,
            "parameters": dict(self.parameters),
        }


@dataclass(kw_only=True)
class ParameterEdit(Edit):
    r"""New values for parameters of the working copy: ``values()`` gives them by name (relative to the site's
    module), computed when the edit is tried."""

    values: Callable[[], dict[str, Any]] = field(repr=False)
    saved: tuple[Any, dict[str, Any]] | None = field(default=None, repr=False)

    def apply(self, work: Any) -> Any:
        self.saved = (work, set_parameters(work, self.values()))
        return work

    def undo(self) -> None:
        if self.saved is not None:
            work, data = self.saved
            set_parameters(work, data)
            self.saved = None


def set_parameters(work: Any, values: dict[str, Any]) -> dict[str, Any]:
    r"""Put ``values`` (name -> tensor) into ``work``'s parameters, in their dtype and device; returns the
    data they held, for putting back."""
    saved = {}
    for name, value in values.items():
        param = work.get_parameter(name)
        saved[name] = param.data
        param.data = value.to(dtype=param.dtype, device=param.device)
    return saved


@dataclass(kw_only=True)
class WrapEdit(Edit):
    r"""The working copy seen through an edit of its inputs (``before(args, kwargs) -> (args, kwargs)``)
    and/or its output (``after(output) -> output``); nothing in it changes."""

    before: Callable[[tuple, dict], tuple[tuple, dict]] | None = field(default=None, repr=False)
    after: Callable[[Any], Any] | None = field(default=None, repr=False)

    def apply(self, work: Any) -> Any:
        return wrapped(work, self.before, self.after)


@dataclass(kw_only=True)
class OutputEdit(Edit):
    r"""Output leaf ``leaf`` of the site changed by ``change(tensor, inputs)`` (``inputs``: the call's input
    leaves by path, for an edit that adds an input back); also applied to the replayed outputs directly."""

    leaf: int
    change: Callable[[Any, dict], Any] = field(repr=False)
    site_inputs: dict[str, Any] = field(default_factory=dict, repr=False)

    def on_outputs(self, leaves: list) -> list:
        return self.edited(leaves, self.site_inputs)

    def edited(self, leaves: list, inputs: dict[str, Any]) -> list:
        return [(p, self.change(t, inputs) if k == self.leaf else t) for k, (p, t) in enumerate(leaves)]

    def apply(self, work: Any) -> Any:
        from paritykit.bisection.leaves import flatten_tensors, rebuild_leaves

        seen: dict[str, Any] = {}

        def before(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            seen.update(flatten_tensors((args, kwargs), "input"))
            return args, kwargs

        def after(out: Any) -> Any:
            return rebuild_leaves(out, dict(self.edited(flatten_tensors(out), seen)), "output")

        return wrapped(work, before, after)


@dataclass(kw_only=True)
class ReplaceEdit(Edit):
    r"""The submodule ``sub`` of the working copy (``""``: the whole module) replaced by ``build()``, a
    rebuild with one setting changed; ``build`` returns ``None`` when the class rejects the setting."""

    sub: str
    build: Callable[[], Any] = field(repr=False)
    replaced: tuple[Any, str, Any] | None = field(default=None, repr=False)

    def apply(self, work: Any) -> Any:
        new = self.build()
        if new is None:
            raise ValueError("the class rejects this setting")
        if not self.sub:
            return new
        parent_name, _, leaf = self.sub.rpartition(".")
        parent = work.get_submodule(parent_name) if parent_name else work
        self.replaced = (parent, leaf, getattr(parent, leaf))
        setattr(parent, leaf, new)
        return work

    def undo(self) -> None:
        if self.replaced is not None:
            parent, leaf, old = self.replaced
            setattr(parent, leaf, old)
            self.replaced = None


@dataclass(kw_only=True)
class AttributeEdit(Edit):
    r"""A plain attribute ``attr`` of the submodule ``sub`` of the working copy set to ``new`` (its forward
    reads it); :meth:`undo` puts ``old`` back."""

    sub: str
    attr: str
    new: Any
    old: Any
    owner: Any = field(default=None, repr=False)

    def apply(self, work: Any) -> Any:
        self.owner = work.get_submodule(self.sub) if self.sub else work
        setattr(self.owner, self.attr, self.new)
        return work

    def undo(self) -> None:
        if self.owner is not None:
            setattr(self.owner, self.attr, self.old)
            self.owner = None


def wrapped(inner: Any, before: Callable | None = None, after: Callable | None = None) -> Any:
    r"""``inner`` seen through an input edit (``before(args, kwargs)``) and/or an output edit
    (``after(out)``)."""
    from torch import nn

    class Edited(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                args, kwargs = before(args, kwargs)
            out = self.inner(*args, **kwargs)
            return after(out) if after is not None else out

    return Edited()


@dataclass
class RepairHint(Hint):
    r"""A verified edit from the repair search: a :class:`~paritykit.compare.diagnose.Hint` with ``id``
    ``repair``, whose JSON adds ``edit`` (tier, kind, target, parameters) and ``residual`` (max_abs before
    and after the edit, on the culprit's replay)."""

    edit: dict[str, Any] = field(default_factory=dict)
    residual: dict[str, float] = field(default_factory=dict)
    # ``(port module name, make)``: the site and a fresh edited copy of it, to run the whole port with
    site_edit: tuple[str, Callable[[], Any]] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "edit": dict(self.edit), "residual": dict(self.residual)}


# ------------------------------------------------------------------------------------------- constants


def inverse(label: str, value: float) -> str:
    r"""The label of ``1/value`` given ``value``'s label (``1/2`` <-> ``2``, a fitted number recomputed)."""
    if value == 0:
        return "∞"
    if label.startswith("1/"):
        rest = label[2:]
        return rest[1:-1] if rest.startswith("(") and rest.endswith(")") else rest
    named = label in {name for _, name in _NAMED} or label.startswith("√") or label.isdigit()
    if not named:
        return format_value(1 / value)
    return f"1/{label}" if " " not in label else f"1/({label})"


# ------------------------------------------------------------------------------------------ orderings

MAX_CHUNKS = 8


def chunk_orders(count: int) -> Iterator[tuple[int, ...]]:
    r"""Reorderings of ``count`` equal chunks: every permutation up to 4 chunks, swaps of two beyond (never
    the identity)."""
    identity = tuple(range(count))
    if count <= 4:
        for order in itertools.permutations(identity):
            if order != identity:
                yield order
        return
    for a, b in itertools.combinations(identity, 2):
        order = list(identity)
        order[a], order[b] = b, a
        yield tuple(order)


def chunk_counts(size: int) -> list[int]:
    r"""Chunk counts from 2 to :data:`MAX_CHUNKS` that split ``size`` evenly."""
    return [k for k in range(2, MAX_CHUNKS + 1) if size % k == 0 and size >= k]


def reorder(tensor: Any, dim: int, count: int, order: Sequence[int]) -> Any:
    r"""``tensor`` with its ``count`` equal chunks along ``dim`` put in ``order`` (chunk ``order[i]`` goes to
    place ``i``)."""
    import torch

    parts = tensor.chunk(count, dim=dim)
    return torch.cat([parts[i] for i in order], dim=dim)


def order_words(count: int, order: Sequence[int]) -> str:
    r"""``swap chunks 0 and 1`` for a swap, else ``put its 3 chunks in the order (1, 2, 0)``."""
    moved = [i for i, o in enumerate(order) if i != o]
    if len(moved) == 2:
        return f"swap chunks {moved[0]} and {moved[1]} (of {count})"
    return f"put the {count} equal chunks in the order ({', '.join(map(str, order))})"
