r"""Where a module's work ends, for bisect's searcher: a culprit whose difference the port takes back
before the next call, that agrees in the runs on other inputs, whose output is the input of a later call
on the reference's side, or whose output a later port call computes is no culprit. A mixin of
:class:`paritykit.bisection.searcher.Searcher`, which holds the traces they read."""

from __future__ import annotations

from typing import Any

from paritykit.base.inputs import is_tensor
from paritykit.base.report import format_number
from paritykit.bisection.call_pairing import Leaves
from paritykit.tracing.trace import Record


class Boundaries:
    r"""The boundary checks of :class:`~paritykit.bisection.searcher.Searcher`."""

    def boundary(self, ref_record: Record, ref_out: Leaves, port_out: Leaves) -> str:
        r"""Why a pair whose outputs differ makes no difference itself, measured: the port module ends where
        the reference's next call begins (:meth:`done_after`), or its output is the reference's plus a
        constant the call above takes back (:meth:`_offset_absorbed`); empty otherwise."""
        return (
            self.done_after(ref_record, port_out)
            or self._agrees_in_runs(ref_record, ref_out)
            or self._taken_back_before_next(ref_record, ref_out)
            or self._offset_absorbed(ref_record, ref_out, port_out)
            or self._computed_later(ref_record, ref_out)
        )

    def _computed_later(self, ref_record: Record, ref_out: Leaves) -> str:
        r"""Whether the port computes this call's output later: a port call that starts after its own
        counterpart's, outside it, returns exactly the reference's output here (the research's time MLP ends
        in a SiLU the port applies inside each adaptive norm). The work the reference does at the end of this
        call the port does after it; the boundaries differ, not the values. A note saying so, with the
        measurement; empty otherwise."""
        own = self.port_record(ref_record)
        if own is None or len(ref_out) != 1:
            return ""
        after = False
        for record in self.port_trace:
            if record is own:
                after = True
                continue
            if not after or record.name.startswith(own.name + ".") or not record.outputs:
                continue
            for path, value in record.outputs.items():
                if not is_tensor(value) or value.shape != ref_out[0][1].shape:
                    continue
                paired = self.compare_paired(ref_out, [(path, value)], f"{record.name}:{path}")
                if paired is not None and paired.worst.passed:
                    return (
                        f"the port computes this output later: its {record.module}'s output equals it"
                        f" (max_abs {format_number(paired.worst.max_abs or 0.0)}), so the work the reference"
                        f" does at the end of this call the port does after {own.module}; the pair's"
                        " boundaries differ, not its values"
                    )
        return ""

    def _agrees_in_runs(self, ref_record: Record, ref_out: Leaves) -> str:
        r"""Whether the pair's outputs agree in the runs although its inputs there do not: the port feeds
        this module something else and gets the reference's output back (a port that folds the research's
        1/sqrt(L) on a sum of skips into its projection's weights, and sums without it). Replayed on the
        reference's inputs it differs, but the run never gives it those. A note saying so, with the
        measurement; empty otherwise."""
        own = self.port_record(ref_record)
        if own is None or self.inputs_agree(ref_record, own):
            return ""
        paired = self.compare_paired(ref_out, list(own.outputs.items()), ref_record.name)
        if paired is None:
            return ""
        difference = paired.worst.max_abs or 0.0
        measured = f"max_abs {format_number(difference)}"
        if not paired.worst.passed:
            # beyond the tolerance but within the reference module's own rounding error there: agreeing too
            floor, noise = self._replay_floor(ref_record, ref_out, difference)
            if not noise:
                return ""
            measured += f", within the reference's own rounding error there, {format_number(floor)}"
        return (
            f"in the runs this pair's outputs agree ({measured}) although its inputs differ: the port feeds"
            " this module other inputs and gets the reference's output back, so it differs only when fed the"
            " reference's inputs; not a difference the run makes"
        )

    def done_after(self, ref_record: Record, port_out: Leaves) -> str:
        r"""Whether the port module's output is what the reference holds a step later, so the two modules end
        at different places and no difference is made here: the input of the reference call that starts
        next in the same parent (a position table the research adds in the parent's forward after its patch
        embedding, the port inside its patch-embedding module); or, for the parent's last call, the parent's
        output where the parent takes the same input (a residual wrapper adding its input after the call,
        which the port's block adds itself). A note saying so, with the measurement; empty otherwise."""
        if len(port_out) != 1 or ref_record.parent is None or ref_record.parent not in self.ref_trace:
            return ""
        parent = self.ref_trace[ref_record.parent]
        after = self._next_sibling(ref_record)
        if after is not None:
            # the first later call in the parent that takes it: the research may call another module
            # between (smalldiffusion's DiT embeds sigma between its patch embedding and its blocks)
            found = None
            for later in self._later_siblings(ref_record):
                found = self._equal_leaf(later.inputs, port_out, later.name)
                if found is not None:
                    after = later
                    break
            if found is not None:
                path, max_abs = found
                return (
                    f"ends where the reference's {after.module} begins: the port's output equals that call's"
                    f" input {path} (max_abs {format_number(max_abs)}), so the work the reference's"
                    f" {parent.module or '(top level)'} does between the two calls the port does inside this"
                    " module; the pair's boundaries differ, not its values"
                )
            return ""
        if parent.parent is None or not self._same_first_input(parent, ref_record):
            return ""
        found = self._equal_leaf(parent.outputs, port_out, parent.name)
        if found is None:
            return ""
        path, max_abs = found
        return (
            f"ends where the reference's {parent.module} ends: the port's output equals that call's output"
            f" (max_abs {format_number(max_abs)}), and {parent.module} takes the same input, so the work it"
            " does after this call (a residual added, say) the port does inside this module; the pair's"
            " boundaries differ, not its values"
        )

    def _taken_back_before_next(self, ref_record: Record, ref_out: Leaves) -> str:
        r"""Whether the port undoes its module's difference before it is used: the reference feeds this call's
        output straight into the call that starts next in the same parent, and the port call aligned with
        that one received exactly the reference's input in the runs (a port whose time projection returns
        the reference's value divided by sqrt(2) and multiplies by sqrt(2) before its MLP). A note saying so,
        with both measurements; empty otherwise."""
        after = self._next_sibling(ref_record)
        if after is None or len(ref_out) != 1:
            return ""
        fed = self._equal_leaf(after.inputs, ref_out, after.name)
        port_after = self.port_record(after)
        own = self.port_record(ref_record)
        if fed is None or own is None:
            return ""
        path, _ = fed
        if port_after is None:
            # the next call has no aligned port call (round 36, Lumiere: the port folded the research's
            # weight normalisation into its time MLP): the first port call after this one, outside it,
            # whose captured input is exactly the reference's value
            port_after = self._first_fed(own, ref_out)
            if port_after is None:
                return ""
        elif (
            not self.inputs_agree(after, port_after)
            and self._equal_leaf(port_after.inputs, ref_out, port_after.name) is None
        ):
            return ""
        said = (
            f"the reference passes this output on as {after.module}'s input {path}, and the port's"
            f" {port_after.module} received that same input in the runs"
        )
        paired = self.compare_paired(ref_out, list(own.outputs.items()), ref_record.name)
        if paired is not None and paired.worst.passed:
            return ""  # on disagreeing inputs that is _agrees_in_runs'; on agreeing ones, no boundary
        return f"{said}: what differs here the port takes back between the two calls, not one it passes on"

    def _offset_absorbed(self, ref_record: Record, ref_out: Leaves, port_out: Leaves) -> str:
        r"""Whether the port's output is the reference's plus a constant the inputs do not change (the same
        for every sample and position, one value per channel at most: a bias moved across the boundary, as
        a port reading ``1 + scale`` where the research reads ``gamma``) that the nearest aligned call above
        takes back: that call passes on identical inputs. A note saying so; empty otherwise."""
        if len(ref_out) != 1 or len(port_out) != 1:
            return ""
        a, b = ref_out[0][1], port_out[0][1]
        if not (is_tensor(a) and is_tensor(b)) or a.shape != b.shape or not a.is_floating_point():
            return ""
        if a.dim() < 2:
            return ""
        d = (b - a).double()

        def constant_but(k: int) -> bool:  # d takes one value per index of axis k, whatever the inputs
            mean = d.mean([i for i in range(d.dim()) if i != k], keepdim=True).expand_as(d)
            return bool(self.compare(d, mean, "offset").passed)

        axis = next((k for k in range(d.dim()) if constant_but(k)), None)
        if axis is None or ref_record.parent is None:
            return ""
        above = self.confident_ancestor(ref_record)
        if above.parent is None or self.test(above).status != "pass":
            return ""
        size = format_number(float(d.abs().max()))
        return (
            f"its output is the reference's plus a constant the inputs do not change (up to {size}, one value"
            f" per index of axis {axis}), and {above.module}, the aligned call above it, passes on identical"
            " inputs: a bias moved across the boundary and taken back there, not a difference"
        )

    def _first_fed(self, own: Record, ref_out: Leaves) -> Record | None:
        r"""The first port call after ``own`` (outside it) that begins before anything else could change the
        value, and whose captured input equals ``ref_out``'s one tensor at the tolerance."""
        after = False
        for record in self.port_trace:
            if record is own:
                after = True
                continue
            if not after or record.name.startswith(own.name + "."):
                continue
            if self._equal_leaf(record.inputs, ref_out, record.name) is not None:
                return record
            if any(is_tensor(v) for v in record.inputs.values()):
                return None  # the next call the port makes is fed something else: no taking back measured
        return None

    def _next_sibling(self, record: Record) -> Record | None:
        r"""The reference call that starts next under ``record``'s parent (calls inside ``record`` have
        another parent); ``None`` for the parent's last call."""
        return next(iter(self._later_siblings(record)), None)

    def _later_siblings(self, record: Record) -> list[Record]:
        r"""The reference calls under ``record``'s parent that start after it, in order."""
        if self._children is None:
            self._children = {}
            for r in sorted(self.ref_trace.records, key=lambda r: r.order):
                self._children.setdefault(r.parent, []).append(r)
        calls = self._children.get(record.parent, [])
        return [r for r in calls if r.order > record.order]

    def _equal_leaf(self, leaves: dict[str, Any], port_out: Leaves, name: str) -> tuple[str, float] | None:
        r"""The first of ``leaves`` the one port leaf equals at the tolerance (up to a dim permutation)."""
        for path, value in leaves.items():
            if not is_tensor(value):
                continue
            paired = self.compare_paired([(path, value)], port_out, f"{name}:{path}")
            if paired is not None and paired.worst.passed:
                return path, paired.worst.max_abs or 0.0
        return None

    @staticmethod
    def _same_first_input(a: Record, b: Record) -> bool:
        import torch

        first_a = next((v for v in a.inputs.values() if is_tensor(v)), None)
        first_b = next((v for v in b.inputs.values() if is_tensor(v)), None)
        return (
            first_a is not None
            and first_b is not None
            and first_a.shape == first_b.shape
            and torch.equal(first_a, first_b)
        )
