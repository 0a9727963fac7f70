r"""What a repair is: one candidate edit of the port (``Edit``), the simple constants a fitted number is snapped
to, and the verified result as a hint (``RepairHint``) whose JSON carries the edit and its residual."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.report import format_value
from paritykit.compare.diagnose import Hint

# the grammar's tiers, cheapest first; ``uses`` edits parameters that hold the reference's own values (the
# weights are right, so what such an edit shows is how the port's forward uses them)
TIERS = ("parameters", "inputs", "outputs", "settings", "uses")


@dataclass
class Edit:
    r"""One candidate change of the port at a site.

    Args:
        tier: ``parameters``, ``inputs``, ``outputs`` or ``settings``.
        kind: what the edit does (``permute-chunks``, ``rescale``, ``swap``, ``setting`` …).
        target: what it changes, as a porter names it (``attn.to_k.weight``, ``input hidden_states``).
        parameters: the edit's numbers (chunk order, dim, factor, setting value), JSON-ready.
        words: one sentence saying what to change in the port.
        cost: order inside the tier (smaller is tried first and counts as the smaller edit).
        apply: ``apply(work) -> module`` builds the edited port module from the site's working copy ``work``
            (restored by ``undo``); ``None`` for edits that act on the outputs alone.
        undo: put the working copy back after a trial.
        on_outputs: ``on_outputs(leaves) -> leaves`` for output edits: the port's replayed outputs, edited.
        controls: for an edit with a fitted factor, the same edit with the factor moved (see the engine).
    """

    tier: str
    kind: str
    target: str
    parameters: dict[str, Any]
    words: str
    cost: int = 0
    apply: Callable[[Any], Any] | None = field(default=None, repr=False)
    undo: Callable[[], None] | None = field(default=None, repr=False)
    on_outputs: Callable[[list], list] | None = field(default=None, repr=False)
    # for a fitted factor: the same edit with the factor moved by half again either way; an edit whose
    # controls verify too proves nothing (the module is nearly invariant to it: a norm to its input's scale)
    controls: Callable[[], list[Edit]] | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "kind": self.kind,
            "target": self.target,
            "parameters": dict(self.parameters),
        }


@dataclass
class RepairHint(Hint):
    r"""A verified edit from the repair search: a :class:`~paritykit.compare.diagnose.Hint` with ``id``
    ``repair``, whose JSON adds ``edit`` (tier, kind, target, parameters) and ``residual`` (max_abs before
    and after the edit, on the culprit's replay)."""

    edit: dict[str, Any] = field(default_factory=dict)
    residual: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "edit": dict(self.edit), "residual": dict(self.residual)}


# ------------------------------------------------------------------------------------------- constants

_NAMED = (
    (1000.0, "1000"),
    (1e-3, "1/1000"),
    (2.0, "2"),
    (0.5, "1/2"),
    (math.pi, "π"),
    (2 * math.pi, "2π"),
    (1 / math.pi, "1/π"),
    (1 / (2 * math.pi), "1/(2π)"),
    (0.18215, "0.18215 (SD VAE scaling factor)"),
    (1 / 0.18215, "1/0.18215 (SD VAE scaling factor)"),
    (0.13025, "0.13025 (SDXL VAE scaling factor)"),
    (1 / 0.13025, "1/0.13025 (SDXL VAE scaling factor)"),
    (0.3611, "0.3611 (Flux VAE scaling factor)"),
    (1 / 0.3611, "1/0.3611 (Flux VAE scaling factor)"),
    (1.5305, "1.5305 (SD3 VAE scaling factor)"),
    (1 / 1.5305, "1/1.5305 (SD3 VAE scaling factor)"),
    (10.0, "10"),
    (0.1, "1/10"),
    (100.0, "100"),
    (0.01, "1/100"),
    (-1.0, "-1"),
    (-2.0, "-2"),
    (1.0, "1"),
    (0.0, "0"),
)


def simple_constants(sizes: Sequence[int] = ()) -> list[tuple[float, str]]:
    r"""The constants a fitted number is snapped to: powers of ten, 2 and 1/2, π and 2π, the VAE scaling
    factors, and √d, 1/√d, d, 1/d for every size ``d`` of the tensors at the site."""
    out = list(_NAMED)
    for d in sorted({int(s) for s in sizes if int(s) > 1}):
        out += [(math.sqrt(d), f"√{d}"), (1 / math.sqrt(d), f"1/√{d}"), (float(d), str(d)), (1 / d, f"1/{d}")]
    return out


def snapped(value: float, sizes: Sequence[int] = (), rel: float = 0.05) -> list[tuple[float, str]]:
    r"""Simple constants within ``rel`` (relative) of ``value``, nearest first."""
    if not math.isfinite(value):
        return []
    near = [
        (c, name)
        for c, name in simple_constants(sizes)
        if (c == 0 and abs(value) < 1e-6) or (c != 0 and abs(value - c) <= rel * abs(c))
    ]
    return sorted(near, key=lambda cn: abs(value - cn[0]))


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
    r"""Reorderings of ``count`` equal chunks: every permutation up to 4 chunks, swaps of two beyond (never the
    identity)."""
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
