r"""Pairing by execution order, bisect's last alignment passes: parameterless modules between aligned
neighbours by their inputs across runs and class, then what is left by order and output shape. A mixin of
the alignment's builder (:mod:`paritykit.bisection.align`)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paritykit.tracing.trace import Record

# classes that return their input unchanged in eval: never the counterpart of a module that computes
_IDENTITY_TYPES = frozenset(
    {"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout", "Identity"}
)

# a parameterless module pairs across runs only with a port module whose input is this close (relative error)
STREAM_ERROR = 0.1
# at most this many (reference, port) candidates are compared by their inputs across runs
MAX_STREAM_CANDIDATES = 4096


def call_distance(
    ref_call: Record | None, port_call: Record | None, what: str = "inputs", unknown: float = 0.0
) -> float:
    r"""Relative error between two calls' first floating-point ``inputs`` or ``outputs`` (up to a dim
    permutation): ``unknown`` when either call or leaf is not at hand (order decides then), ``inf`` when they
    cannot correspond.
    """
    from paritykit.bisection.leaves import pair_layouts
    from paritykit.compare.tensors import relative_error

    if ref_call is None or port_call is None:
        return unknown
    try:
        a = [(k, t) for k, t in getattr(ref_call, what).items() if t.is_floating_point()][:1]
        b = [(k, t) for k, t in getattr(port_call, what).items() if t.is_floating_point()][:1]
    except Exception:  # a trace folder with a missing shard: order decides
        return unknown
    if not a or not b:
        return unknown
    found = pair_layouts(a, b)
    if found is None:
        return math.inf
    error = relative_error(found[1][0][1], a[0][1])
    return error if math.isfinite(error) else 1e30


def _identity_like(type_name: str) -> bool:
    return type_name.rsplit(".", 1)[-1] in _IDENTITY_TYPES


class OrderPairing:
    r"""Pairing by execution order, bisect's last alignment passes: parameterless modules between aligned"""

    # 4 + 5 ------------------------------------------------------------------------------------------
    def by_order(self) -> None:
        for ref_run, port_run in self._runs():
            self._pair_parameterless(ref_run, port_run)
        self._pair_by_stream()
        for ref_run, port_run in self._runs():
            self._pair_by_shape(ref_run, port_run)

    def _pair_by_stream(self) -> None:
        r"""Parameterless modules the runs between anchors left alone (two streams run in different orders on
        the two sides put them in runs that do not face each other): each pairs with the port module of its
        class that reads clearly the same input, a mutual nearest, under corresponding aligned ancestors."""
        refs = [r for r in self.free_ref() if r and self.ref.parameterless(r)]
        ports = [p for p in self.free_port() if p and self.port.parameterless(p)]
        if len(refs) * len(ports) > MAX_STREAM_CANDIDATES:
            return  # each candidate compares two captured activations: left to the runs on huge remainders
        cost: dict[tuple[str, str], float] = {}
        for r in refs:
            for p in ports:
                if self.ref.types.get(r) == self.port.types.get(p) and self._parents_agree(r, p):
                    # inputs not at hand count as uncorrelated here: order alone never pairs across runs
                    cost[r, p] = self._stream_distance(r, p, unknown=1.0)
        for (r, p), error in sorted(cost.items(), key=lambda item: item[1]):
            if error >= STREAM_ERROR or r in self.ref_done or p in self.port_done:
                continue
            rivals = [e for (r2, p2), e in cost.items() if (r2 == r) != (p2 == p) and e < 2 * error + 1e-12]
            if not rivals:
                self.add(r, p, "order", "medium")

    def _runs(self) -> list[tuple[list[str], list[str]]]:
        """Stretches of unaligned modules between consecutive aligned anchors, on both sides."""
        anchors = {q.reference: q.port for q in self.pairs if not q.group}
        port_pos = self.port.position
        runs = []
        current: list[str] = []
        last_anchor: str | None = None
        for name in [*self.ref.order, None]:
            if name is not None and name not in anchors:
                if name not in self.ref_done:
                    current.append(name)
                continue
            if current:
                lo = port_pos.get(anchors[last_anchor], -1) if last_anchor is not None else -1
                hi = (
                    port_pos.get(anchors[name], len(self.port.order))
                    if name is not None
                    else len(self.port.order)
                )
                if lo < hi:
                    port_run = [p for p in self.port.order[lo + 1 : hi] if p not in self.port_done]
                    runs.append((current, port_run))
            current = []
            last_anchor = name
        return runs

    def _pair_parameterless(self, ref_run: list[str], port_run: list[str]) -> None:
        refs = [r for r in ref_run if r not in self.ref_done and self.ref.parameterless(r)]
        ports = [p for p in port_run if p not in self.port_done and self.port.parameterless(p)]
        by_type_r: dict[str, list[str]] = defaultdict(list)
        by_type_p: dict[str, list[str]] = defaultdict(list)
        for r in refs:
            by_type_r[self.ref.types.get(r, "")].append(r)
        for p in ports:
            by_type_p[self.port.types.get(p, "")].append(p)
        for type_name, rs in by_type_r.items():
            ps = by_type_p.get(type_name, [])
            if len(rs) == len(ps):
                for r, p in self._by_stream(rs, ps):
                    self.add(r, p, "order", "medium")
        refs = [r for r in refs if r not in self.ref_done]
        ports = [p for p in ports if p not in self.port_done]
        if len(refs) == 1 and len(ports) == 1 and self._same_work(refs[0], ports[0]):
            rs, ps = self.ref.out_shapes.get(refs[0]), self.port.out_shapes.get(ports[0])
            if rs is not None and rs == ps:
                self.add(refs[0], ports[0], "order", "medium")

    def _by_stream(self, refs: list[str], ports: list[str]) -> list[tuple[str, str]]:
        r"""Pair parameterless modules of one class, each with the port module that reads the same stream: the
        one whose captured input is closest to its own (up to a dim permutation), ties broken by execution
        order. A model of two streams (image and text tokens) may run them in either order, and its
        image-stream norm must never meet the text stream's. Modules whose outputs cannot correspond stay
        unpaired."""
        import itertools

        if len(refs) == 1:
            return [(refs[0], ports[0])] if math.isfinite(self._stream_distance(refs[0], ports[0])) else []
        cost = [[self._stream_distance(r, p) for p in ports] for r in refs]
        if len(refs) <= 6:
            # the cheapest one-to-one assignment; the in-order one wins ties
            best = min(
                itertools.permutations(range(len(ports))),
                key=lambda order: (
                    sum(cost[i][j] for i, j in enumerate(order)),
                    sum(abs(i - j) for i, j in enumerate(order)),
                ),
            )
        else:
            best = tuple(range(len(ports)))
        return [(refs[i], ports[j]) for i, j in enumerate(best) if math.isfinite(cost[i][j])]

    def _stream_distance(self, r: str, p: str, unknown: float = 0.0) -> float:
        r"""How far apart the inputs of ``r`` and ``p`` are (:func:`call_distance`); ``inf`` when their
        output shapes are no permutation of each other."""
        rs, ps = self.ref.out_shapes.get(r), self.port.out_shapes.get(p)
        if rs is not None and ps is not None and sorted(rs) != sorted(ps):
            return math.inf
        return call_distance(self.ref.first_calls.get(r), self.port.first_calls.get(p), unknown=unknown)

    def _same_work(self, r: str, p: str) -> bool:
        """Two modules of different classes may do the same work (GELU vs a diffusers activation class), but
        an identity in eval (Dropout, Identity) never does an activation's: the activation may sit inside a
        port module that also holds the preceding Linear (diffusers' ``GELU(dim_in, dim_out)``)."""
        return _identity_like(self.ref.types.get(r, "")) == _identity_like(self.port.types.get(p, ""))

    def _pair_by_shape(self, ref_run: list[str], port_run: list[str]) -> None:
        refs = [r for r in ref_run if r not in self.ref_done]
        ports = [p for p in port_run if p not in self.port_done]
        j = 0
        for r in refs:
            shape = self.ref.out_shapes.get(r)
            if shape is None:
                continue
            for k in range(j, len(ports)):
                if (
                    self.port.out_shapes.get(ports[k]) == shape
                    and self._alike(r, ports[k])
                    and self.nests(r, ports[k])
                    and not self._weights_elsewhere(r, ports[k])
                ):
                    self.add(r, ports[k], "order", confidence="low")
                    j = k + 1
                    break

    def _weights_elsewhere(self, r: str, p: str) -> bool:
        r"""Whether the weights pass places ``r``'s work outside ``p``: a port tensor under ``p`` is made from
        a reference tensor outside ``r``, or a tensor made from ``r``'s lies outside ``p`` (a research UNet
        whose tensors the port spreads over ``conv_in``, ``down_blocks`` and ``up_blocks`` is no pair for
        ``up_blocks.2``, whatever their output shapes)."""
        if not r or not p or not self.sources_of:
            return False
        r_prefix, p_prefix = r + ".", p + "."
        for target, sources in self.sources_of.items():
            inside_p = target.startswith(p_prefix)
            from_r = [s.startswith(r_prefix) for s in sources]
            if (inside_p and not all(from_r)) or (any(from_r) and not inside_p):
                return True
        return False

    def _alike(self, r: str, p: str) -> bool:
        """Same parameter shapes (a norm never pairs with a dropout that happens to return the same shape);
        or the same class where one side has no parameters (a GroupNorm built with ``affine=False`` against
        the reference's affine one: the same work, the missing scale and shift being the difference)."""
        if self.ref.parameterless(r) and self.port.parameterless(p):
            return self._same_work(r, p)
        same_type = self.ref.types.get(r) is not None and self.ref.types.get(r) == self.port.types.get(p)
        if same_type and (self.ref.parameterless(r) or self.port.parameterless(p)):
            return True
        return self.compatible(r, p)
