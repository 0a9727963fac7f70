r"""Two recorded calls compared input by input (latents, timestep, conditioning) and output by output, under
triage's tolerance; the relative error shown per call."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.report import format_cosine, format_number
from paritykit.tracing.recording import Call, batch_of, output_tensor
from paritykit.triage.roles import Roles, argument, latents, output, pair_conditioning, timestep


@dataclass
class Tolerance:
    atol: float | None = None
    rtol: float | None = None
    # the atol is the default, set for values of order 1: held to each reference tensor's scale
    atol_scaled: bool = False


def compare(a: Any, b: Any, tol: Tolerance, name: str) -> Any:
    r"""``b`` against ``a`` under ``tol``; without a SPEC ``atol``, the default ``atol`` is held to the
    reference's scale (× its RMS where that exceeds 1): values in the tens carry float rounding in the tens
    of ulps, and an element near zero among them is no O(1) value (round 32, AudioLDM's latents of RMS 47:
    a fixed port was "update at call 3: the latents after step 3 differ", max_abs 5.4e-05 of values to
    160)."""
    from paritykit.compare import compare_tensors

    atol = tol.atol
    if (
        tol.atol_scaled
        and atol is not None
        and getattr(a, "is_floating_point", lambda: False)()
        and a.numel()
    ):
        scale = float(a.detach().double().pow(2).mean().sqrt())
        atol *= max(1.0, scale) if math.isfinite(scale) else 1.0
    return compare_tensors(a, b, atol=atol, rtol=tol.rtol, name=name)


def rel(a: Any, b: Any) -> float | None:
    r"""``|b - a| / |a|`` (:func:`~paritykit.compare.tensors.relative_error`, the reference ``a`` as the
    denominator), through a view where the shapes differ by size-1 dims alone
    (:func:`~paritykit.bisection.leaves.viewed_as`), or ``None`` when they differ otherwise: a curve cell
    left empty."""
    if a is None or b is None:
        return None
    from paritykit.bisection.leaves import viewed_as
    from paritykit.compare.tensors import relative_error

    b = viewed_as(b, a)[0]
    if tuple(a.shape) != tuple(b.shape):
        return None

    return relative_error(b, a)


def same_timestep(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


@dataclass(frozen=True)
class TimestepUnits:
    r"""How one schedule's timestep reads on the port's side: ``port = scale · reference + offset``, or with
    ``curve`` ``"log"`` ``port = scale · ln(reference) + offset`` (EDM's c_noise = ln(σ)/4 against σ) and
    ``"exp"`` ``port = exp((reference - offset) / scale)`` (its inverse)."""

    scale: float = 1.0
    offset: float = 0.0
    words: str = ""
    # the largest timestep each side gives in these units (1 or 1000); 0: either
    ref_top: float = 0.0
    port_top: float = 0.0
    curve: str = ""

    def __call__(self, t: float) -> float:
        if self.curve == "log":
            return self.scale * math.log(t) + self.offset if t > 0 else math.nan
        if self.curve == "exp":
            power = (t - self.offset) / self.scale
            return math.exp(power) if power < 700 else math.inf  # a timestep of 1000 is no c_noise
        return t * self.scale + self.offset

    def fits_ranges(self, t_ref: list[float | None], t_port: list[float | None]) -> bool:
        r"""Whether the values each side gives lie in the range these units say: a reference said to count
        to 1000 gives some value above 1, one said to count to 1 none above it (a reference at 1.0 and a port
        at 0.999 are no "t in [0, 1000] against 1 - t/1000")."""
        for top, values in ((self.ref_top, t_ref), (self.port_top, t_port)):
            if top and within_unit(values) != (top == 1.0):
                return False
        return True


def within_unit(values: list[float | None]) -> bool:
    r"""Whether every timestep given lies within [-1, 1] (a side counting to 1, not to 1000)."""
    return max((abs(v) for v in values if v is not None), default=0.0) <= 1.0 + 1e-6


@dataclass
class CallComparison:
    r"""Call ``index`` of both sides, input by input: ``latents`` and each conditioning pair as tensor
    comparisons (``None`` when a side lacks it or the shapes differ), the timesteps as numbers, the output."""

    index: int
    latents: Any
    latents_note: str | None
    t_reference: float | None
    t_port: float | None
    timestep_kinds: tuple[str | None, str | None]
    conditioning: list[tuple[str, str, Any]]
    output: Any
    # how the reference's timestep reads on the port's side, when the two give one schedule in other units
    # (:func:`timestep_units`)
    t_units: TimestepUnits = field(default_factory=TimestepUnits)
    # conditioning arguments no argument of the other side pairs with: a length that differs (measured on
    # the part both have), and the arguments of one side only
    unpaired: list[str] = field(default_factory=list)
    one_sided: list[str] = field(default_factory=list)

    @property
    def latents_match(self) -> bool:
        return self.latents is not None and self.latents.passed

    @property
    def timestep_match(self) -> bool:
        scaled = None if self.t_reference is None else self.t_units(self.t_reference)
        # a noise level against a log-noise-level timestep (EDM's c_noise) is one value read two ways; one
        # number fed on both sides is one input whatever each side's argument is read as (round 38, Protenix's
        # t_hat_noise_level, read by position as a timestep, against the port's sigma)
        kinds = self.timestep_kinds[0] == self.timestep_kinds[1] or bool(self.t_units.curve)
        if not kinds and same_timestep(self.t_reference, self.t_port):
            return True
        return kinds and same_timestep(scaled, self.t_port)

    @property
    def conditioning_match(self) -> bool:
        r"""Every paired conditioning input agrees, and no two differ in length (a padding that differs is
        a difference, not something to skip)."""
        return all(c.passed for _, _, c in self.conditioning) and not self.unpaired

    @property
    def inputs_agree(self) -> bool:
        r"""Latents and conditioning agree, and the timestep too where both sides pass one the walk reads (a
        timestep one side does not pass is not compared, and is no difference)."""
        unread = self.t_reference is None or self.t_port is None
        return self.latents_match and self.conditioning_match and (self.timestep_match or unread)

    def differing_inputs(self) -> list[str]:
        r"""What keeps :attr:`inputs_agree` false, each as measured."""
        out = []
        if self.latents is None:
            out.append(f"latents not compared ({self.latents_note or 'not found'})")
        elif not self.latents.passed:
            out.append(f"latents differ (max_abs {format_number(self.latents.max_abs)})")
        if self.t_reference is not None and self.t_port is not None and not self.timestep_match:
            out.append(f"timestep {format_number(self.t_reference)} against {format_number(self.t_port)}")
        out += [
            f"{r} / {p} differ (max_abs {format_number(c.max_abs)})"
            for r, p, c in self.conditioning
            if not c.passed
        ]
        out += self.unpaired
        return out

    @property
    def inputs_match(self) -> bool:
        return self.latents_match and self.timestep_match and self.conditioning_match

    @property
    def output_match(self) -> bool:
        return self.output is not None and self.output.passed


# units a timestep is given in on one side and the other
TIMESTEP_UNITS = (
    TimestepUnits(1000.0, 0.0, "the reference gives its timesteps in [0, 1], the port in [0, 1000]", 1, 1000),
    TimestepUnits(0.001, 0.0, "the reference gives its timesteps in [0, 1000], the port in [0, 1]", 1000, 1),
    TimestepUnits(-0.001, 1.0, "the reference gives t in [0, 1000], the port 1 - t/1000", 1000, 1),
    TimestepUnits(-1000.0, 1000.0, "the reference gives t in [0, 1], the port 1000·(1 - t)", 1, 1000),
    TimestepUnits(-1.0, 1.0, "the reference gives t in [0, 1], the port 1 - t", 1, 1),
    TimestepUnits(-1.0, 1000.0, "the reference gives t in [0, 1000], the port 1000 - t", 1000, 1000),
    # EDM's preconditioning: the network gets c_noise = ln(σ)/4 where a research loop passes σ (or back)
    TimestepUnits(0.25, 0.0, "the reference gives σ, the port c_noise = ln(σ)/4", curve="log"),
    TimestepUnits(0.25, 0.0, "the reference gives c_noise = ln(σ)/4, the port σ", curve="exp"),
)
SAME_UNITS = TimestepUnits()


def timestep_units(t_ref: list[float | None], t_port: list[float | None]) -> TimestepUnits:
    r"""How every call's timesteps are one schedule in other units (×1000, ×1/1000, or counted the other
    way: 1 − t/1000, 1000 − t, at every call, same count); :data:`SAME_UNITS` otherwise."""
    if not t_ref or len(t_ref) != len(t_port) or None in t_ref or None in t_port:
        return SAME_UNITS
    for units in TIMESTEP_UNITS:
        if (
            all(same_timestep(units(r), p) for r, p in zip(t_ref, t_port))
            and len(set(t_ref)) > 1
            and units.fits_ranges(t_ref, t_port)
        ):
            return units
    return SAME_UNITS


def leading_units(t_ref: list[float | None], t_port: list[float | None]) -> tuple[TimestepUnits, int]:
    r"""When no one unit map holds at every call (the schedules differ): the map under which the longest run
    of first calls agrees, and that length, where it is one map alone and the timesteps as given agree at no
    first call (the reference at 1000 where the port is at 1.0, then a schedule that differs);
    ``(SAME_UNITS, 0)`` otherwise."""

    def prefix(units: TimestepUnits) -> int:
        n = 0
        for r, p in zip(t_ref, t_port):
            if r is None or p is None or not same_timestep(units(r), p):
                break
            n += 1
        return n

    if prefix(SAME_UNITS):
        return SAME_UNITS, 0
    runs = [(prefix(u), u) for u in TIMESTEP_UNITS if u.fits_ranges(t_ref, t_port)]
    if not runs:
        return SAME_UNITS, 0
    best = max(n for n, _ in runs)
    winners = [u for n, u in runs if n == best]
    return (winners[0], best) if best and len(winners) == 1 else (SAME_UNITS, 0)


def compare_call(
    index: int,
    ref: Call,
    rr: Roles,
    port: Call,
    pr: Roles,
    tol: Tolerance,
    t_units: TimestepUnits | None = None,
) -> CallComparison:
    xr, xp = latents(ref, rr), latents(port, pr)
    note = None
    lat = None
    if xr is None or xp is None:
        note = "a side has no latents argument"
    elif tuple(xr.shape) != tuple(xp.shape):
        note = f"latents shapes differ: reference {tuple(xr.shape)}, port {tuple(xp.shape)}"
    else:
        lat = compare(xr, xp, tol, f"call {index} latents")
    conditioning = [
        (r, p, compare(argument(ref, r), argument(port, p), tol, f"call {index} {r} / {p}"))
        for r, p in pair_conditioning(ref, rr, port, pr)
    ]
    paired = {r for r, _, _ in conditioning}, {p for _, p, _ in conditioning}
    unpaired, one_sided = unpaired_conditioning(
        [(r, argument(ref, r)) for r in rr.conditioning if r not in paired[0]],
        [(p, argument(port, p)) for p in pr.conditioning if p not in paired[1]],
        tol,
    )
    er, ep = output(ref), output(port)
    out = (
        compare(er, ep, tol, f"call {index} output")
        if er is not None and ep is not None and er.shape == ep.shape
        else None
    )
    return CallComparison(
        index,
        lat,
        note,
        timestep(ref, rr),
        timestep(port, pr),
        (rr.timestep_kind, pr.timestep_kind),
        conditioning,
        out,
        t_units or SAME_UNITS,
        unpaired,
        one_sided,
    )


def unpaired_conditioning(
    ref: list[tuple[str, Any]], port: list[tuple[str, Any]], tol: Tolerance
) -> tuple[list[str], list[str]]:
    r"""The conditioning arguments left unpaired, measured: ``(differences, alone)``. A reference argument
    and a port one of its rank that differ along one axis only (a padded or truncated sequence) are compared
    on the part both have: a difference, where that part agrees or the two have one name (two of other
    names that agree nowhere are not known to be one input). Each other one is said alone, with its shape (a
    mask or a length passed by one side only is no difference by itself)."""
    differences, used, compared = [], set(), set()
    for r, a in ref:
        for p, b in port:
            axes = [i for i in range(a.dim()) if a.shape[i] != b.shape[i]] if a.dim() == b.dim() else []
            # a sequence that differs in length: never the batch axis (a guidance batch of two is no padding)
            if p in used or len(axes) != 1 or axes[0] == 0 or a.dim() < 2:
                continue
            axis, n = axes[0], min(a.shape[axes[0]], b.shape[axes[0]])
            longer, extra = ("reference", a) if a.shape[axis] > n else ("port", b)
            more = extra.shape[axis] - n
            # padding at the end (the first n agree) or at the start (the last n agree: left padding)
            head = compare(a.narrow(axis, 0, n), b.narrow(axis, 0, n).to(a.dtype), tol, f"{r} / {p}")
            a_tail, b_tail = (a.narrow(axis, a.shape[axis] - n, n), b.narrow(axis, b.shape[axis] - n, n))
            tail = compare(a_tail, b_tail.to(a.dtype), tol, f"{r} / {p}")
            at_start = tail.passed and not head.passed
            common = tail if at_start else head
            if not common.passed and r != p:
                continue  # two inputs of other names agreeing nowhere: nothing says they are one input
            used.add(p)
            rest = extra.narrow(axis, 0, more) if at_start else extra.narrow(axis, n, more)
            agree = "agree" if common.passed else f"differ (max_abs {format_number(common.max_abs)})"
            padding = (
                "all zero"
                if bool((rest == 0).all())
                else f"not zero (max |value| {format_number(float(rest.double().abs().max()))})"
            )
            which, where = ("last", "first") if at_start else ("first", "other")
            differences.append(
                f"reference {r} {tuple(a.shape)} and port {p} {tuple(b.shape)} differ in length along axis"
                f" {axis}: the {which} {n} there {agree}; the {longer}'s {where} {more} are {padding}"
            )
            compared.add(r)
            break
    alone = [f"reference {r} {tuple(a.shape)}" for r, a in ref if r not in compared]
    alone += [f"port {p} {tuple(b.shape)}" for p, b in port if p not in used]
    return differences, alone


def comparison_evidence(comparison: Any) -> list[str]:
    r"""A tensor comparison's numbers and its diagnoses, one line each."""
    lines = [
        f"max_abs {format_number(comparison.max_abs)}, cosine {format_cosine(comparison.cosine)}, "
        f"{_percent(comparison.mismatch_fraction)} of elements outside tolerance"
    ]
    lines += [hint.render() for hint in comparison.hints[:3]]
    return lines


@dataclass
class Rearrangement:
    r"""The port's latents hold the reference's values rearranged (2×2 patches packed into tokens, channels
    last): an index map read from the first call's latents, exact, so every tensor of the port's latents shape
    can be read in the reference's layout and the other way round. ``index``: ``port.flatten()[index]`` is
    ``reference.flatten()``."""

    ref_shape: tuple[int, ...]
    port_shape: tuple[int, ...]
    index: Any

    @classmethod
    def read(cls, reference: Any, port: Any, same_shape: bool = False) -> Rearrangement | None:
        r"""The map between two tensors of one size holding the same values: a patch packing (spatial dims
        cut into patches, the patches' values along the last dim in some order, tokens in row order) checked
        element by element; else, when every value is distinct, the map the values alone give. ``None`` when
        no map reproduces the port's tensor, or the shapes are already equal (with ``same_shape``, when the
        map leaves every element in place)."""
        import torch

        if reference is None or port is None:
            return None
        if tuple(reference.shape) == tuple(port.shape) and (not same_shape or torch.equal(reference, port)):
            return None
        if reference.numel() != port.numel() or not reference.is_floating_point():
            return None
        a, b = reference.detach().reshape(-1), port.detach().reshape(-1).to(reference.dtype)
        for index in _packings(tuple(reference.shape), tuple(port.shape)):
            if torch.equal(a[index], b):
                inverse = torch.empty_like(index)
                inverse[index] = torch.arange(index.numel())
                return cls(tuple(reference.shape), tuple(port.shape), inverse)
        sorted_a, order_a = torch.sort(a)
        sorted_b, order_b = torch.sort(b)
        if not torch.equal(sorted_a, sorted_b) or bool((sorted_a[1:] == sorted_a[:-1]).any()):
            return None
        index = torch.empty_like(order_a)
        index[order_a] = order_b
        return cls(tuple(reference.shape), tuple(port.shape), index)

    def to_reference(self, tensor: Any) -> Any:
        r"""A tensor of the port's latents shape in the reference's layout; anything else as it is."""
        if tensor is None or tuple(tensor.shape) != self.port_shape:
            return tensor
        return tensor.reshape(-1)[self.index.to(tensor.device)].reshape(self.ref_shape)

    def to_port(self, tensor: Any) -> Any:
        r"""A tensor of the reference's latents shape in the port's layout; anything else as it is."""
        if tensor is None or tuple(tensor.shape) != self.ref_shape:
            return tensor
        out = tensor.new_empty(tensor.numel())
        out[self.index.to(tensor.device)] = tensor.reshape(-1)
        return out.reshape(self.port_shape)

    def moved(self) -> int:
        r"""How many elements the map moves."""
        import torch

        return int((self.index != torch.arange(self.index.numel())).sum())

    def words(self) -> str:
        return (
            f"the port's latents {self.port_shape} hold the reference's {self.ref_shape} values rearranged"
            " (an exact index map read from the first call's latents): every tensor of those shapes is"
            " compared in the reference's layout"
        )

    def view(self, call: Call, roles: Roles) -> Call:
        r"""``call`` with its latents argument and its output in the reference's layout, for comparing."""
        named = dict(call.named)
        if roles.latents in named and batch_of(named[roles.latents]) is not None:
            named[roles.latents] = self.to_reference(batch_of(named[roles.latents]))
        found = output_tensor(call.output)
        mapped = self.to_reference(found)
        return Call(call.args, call.kwargs, named, mapped if mapped is not found else call.output)


def conditioning_layouts(
    ref: Call, rr: Roles, port: Call, pr: Roles, tol: Tolerance
) -> dict[str, Rearrangement]:
    r"""The port's conditioning inputs that hold the reference's values rearranged, every element, at the
    first call (round 35, lerobot's diffusion policy: the port lays its observation features out step-major
    where the research interleaves them, and converts the weights to match): port name -> the map. An input
    that agrees as it is, or whose values no exact map reproduces, is not among them."""
    from paritykit.triage.roles import pair_conditioning

    found = {}
    for r, p in pair_conditioning(ref, rr, port, pr):
        a, b = argument(ref, r), argument(port, p)
        if compare(a, b, tol, r).passed:
            continue
        layout = Rearrangement.read(a, b, same_shape=True)
        if layout is not None:
            found[p] = layout
    return found


def view_conditioning(call: Call, layouts: dict[str, Rearrangement]) -> Call:
    r"""``call`` with each conditioning input ``layouts`` names read in the reference's layout."""
    named = dict(call.named)
    for name, layout in layouts.items():
        if batch_of(named.get(name)) is not None:
            named[name] = layout.to_reference(batch_of(named[name]))
    return Call(call.args, call.kwargs, named, call.output)


@dataclass
class BatchOrder:
    r"""The port stacks the rows of its denoiser's batch in another order than the reference (a guidance batch
    of (cond, uncond) against (uncond, cond)): ``order[i]`` is the port's row holding the reference's row
    ``i``. Read from the first call, where every paired conditioning tensor must match the reference's row for
    row under exactly one such order (and the latents agree under it too); every call's batch-major tensors
    are then compared in the reference's order. A port that stacks its batch otherwise and undoes it the
    same way computes the same result: a consistent order is no difference."""

    order: list[int]

    @classmethod
    def read(cls, ref: Call, rr: Roles, port: Call, pr: Roles) -> BatchOrder | None:
        import torch

        pairs = [(argument(ref, r), argument(port, p)) for r, p in pair_conditioning(ref, rr, port, pr)]
        pairs = [(a, b) for a, b in pairs if a.dim() >= 1 and a.shape == b.shape and a.shape[0] >= 2]
        if not pairs or len({a.shape[0] for a, _ in pairs}) != 1:
            return None
        n = pairs[0][0].shape[0]
        match = torch.ones(n, n, dtype=torch.bool)
        for a, b in pairs:
            a, b = a.detach().double(), b.detach().to(a.device).double()
            for i in range(n):
                for j in range(n):
                    match[i, j] &= bool(torch.allclose(a[i], b[j], rtol=1e-5, atol=1e-6))
        if not bool((match.sum(dim=1) == 1).all()) or not bool((match.sum(dim=0) == 1).all()):
            return None
        order = [int(match[i].nonzero()[0]) for i in range(n)]
        if order == list(range(n)):
            return None
        found = cls(order)
        xr, xp = latents(ref, rr), latents(port, pr)
        if xr is not None and xp is not None and tuple(xr.shape) == tuple(xp.shape) and xr.shape[0] == n:
            if not torch.allclose(
                xr.double(), found.to_reference(xp).double().to(xr.device), rtol=1e-5, atol=1e-6
            ):
                return None
        return found

    def to_reference(self, tensor: Any) -> Any:
        r"""A tensor whose first dim is the batch, its rows in the reference's order; anything else as it
        is."""
        import torch

        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] != len(self.order):
            return tensor
        return tensor[torch.tensor(self.order, device=tensor.device)]

    def words(self) -> str:
        return (
            f"the port stacks its denoiser's batch in another order (its rows {tuple(self.order)} hold the"
            " reference's rows in order, read from the first call's conditioning, exact): every call is"
            " compared in the reference's order"
        )

    def view(self, call: Call) -> Call:
        r"""``call`` with its batch-major arguments and its output in the reference's row order."""
        named = {
            k: self.to_reference(batch_of(v)) if batch_of(v) is not None else v for k, v in call.named.items()
        }
        found = output_tensor(call.output)
        mapped = self.to_reference(found)
        return Call(call.args, call.kwargs, named, mapped if mapped is not found else call.output)


def _plain(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str)) or value is None


def _one(values: set) -> str:
    return " or ".join(repr(v) for v in sorted(values, key=repr))


@dataclass
class CallGroups:
    r"""One side calls its denoiser ``k`` times per timestep (a guidance half per call) where the other calls
    it once on a batch ``k`` times as large: each run of ``k`` calls is compared as one call, its inputs kept
    once where the ``k`` calls agree and stacked along the batch otherwise, its outputs stacked in ``order``
    (read from the first step: the order of the blocks that matches the other side's output)."""

    side: str
    k: int
    order: list[int]
    # the tensor shapes of the other side's first call: an argument the k calls share is stacked k times
    # when the other side holds it stacked (latents repeated for each pass), else kept once
    other_shapes: set[tuple[int, ...]] = field(default_factory=set)
    # plain settings the k calls of a step pass with other values, in stacking order (null_cond_prob 0 and
    # 1: a call that swaps its conditioning for a null one inside), and the tensors the k calls pass alike,
    # stacked as repeats: what such a call does with them happens inside the denoiser
    settings_apart: dict[str, tuple] = field(default_factory=dict)
    repeated: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, ref: list[Call], port: list[Call], t_ref: list, t_port: list) -> CallGroups | None:
        import itertools

        from paritykit.triage.measures import per_step_calls

        if None in t_ref or None in t_port:
            return None
        found = per_step_calls(t_ref, t_port)
        if found is None or min(found) != 1:
            return None
        side, k = ("reference", found[0]) if found[0] > 1 else ("port", found[1])
        many, once = (ref, port) if side == "reference" else (port, ref)
        outs = [output_tensor(c.output) for c in many[:k]]
        whole = output_tensor(once[0].output)
        if whole is None or any(o is None or o.dim() == 0 for o in outs):
            return None
        if sum(o.shape[0] for o in outs) != whole.shape[0] or any(
            o.shape[1:] != whole.shape[1:] for o in outs
        ):
            return None  # the other side's batch does not hold the k calls' batches: no grouping
        best = min(
            itertools.permutations(range(k)),
            key=lambda order: rel(whole, _stack([outs[j] for j in order])) or 0.0,
        )
        shapes = {tuple(t.shape) for v in once[0].named.values() if (t := batch_of(v)) is not None}
        return cls(side, k, list(best), shapes)

    def merge(self, calls: list[Call]) -> list[Call]:
        return [self._merged(calls[i : i + self.k]) for i in range(0, len(calls) - self.k + 1, self.k)]

    def _merged(self, group: list[Call]) -> Call:
        import torch

        group = [group[j] for j in self.order]
        for key, value in group[0].named.items():
            if batch_of(value) is None and _plain(value):
                values = tuple(c.named.get(key) for c in group)
                if any(v != values[0] for v in values[1:]):
                    self.settings_apart.setdefault(key, values)
        named = {}
        for key, value in group[0].named.items():
            values = [batch_of(c.named.get(key)) for c in group]
            named[key] = value
            if any(v is None or v.dim() == 0 or v.shape[1:] != values[0].shape[1:] for v in values):
                continue
            stacked = (sum(v.shape[0] for v in values), *values[0].shape[1:])
            shared = all(torch.equal(values[0], v) for v in values[1:])
            repeated = stacked in self.other_shapes and tuple(values[0].shape) not in self.other_shapes
            if not shared or repeated:
                named[key] = torch.cat(values)
            if shared and repeated:
                self.repeated.add(key)
        outs = [output_tensor(c.output) for c in group]
        return Call(group[0].args, group[0].kwargs, named, _stack(outs))

    def flagged_rows(self, key: str, ref: Any, port: Any, tol: Tolerance) -> tuple[str, list[int]]:
        r"""Where the reference passes one tensor ``key`` alike to its ``k`` calls of a step and those calls
        differ in a plain setting: a note, and the rows that agree, when the port's rows agree with the
        blocks of the calls of one setting value and differ in the others' only (what those calls do with it
        happens inside the denoiser); ``("", [])`` otherwise."""
        if self.side != "reference" or key not in self.repeated or not self.settings_apart:
            return "", []
        if ref is None or port is None or ref.shape != port.shape or ref.shape[0] % self.k:
            return "", []
        size = ref.shape[0] // self.k
        agree = [
            bool(compare(ref[j * size : (j + 1) * size], port[j * size : (j + 1) * size], tol, key).passed)
            for j in range(self.k)
        ]
        if all(agree) or not any(agree):
            return "", []
        rows = [j * size + q for j in range(self.k) if agree[j] for q in range(size)]
        for setting, values in self.settings_apart.items():
            good = {values[j] for j in range(self.k) if agree[j]}
            bad = {values[j] for j in range(self.k) if not agree[j]}
            if not good & bad:
                return (
                    f"the reference passes the same {key} to its {self.k} calls per step, which differ in"
                    f" {setting} ({', '.join(map(repr, values))}); the port's rows agree with it in the block"
                    f" of {setting}={_one(good)} and not in that of {setting}={_one(bad)}: what the"
                    f" reference's call does with {key} there happens inside its denoiser (not compared)"
                ), rows
        return "", []

    def one_of(self, step: int, ref_calls: list[Call], port_call: Call) -> tuple[Call, Call] | None:
        r"""Where the reference is the side that calls ``k`` times (round 36, AudioSR: conditional then
        unconditional calls against the port's one call on the stacked batch): the reference's call that
        comes first in the stacking order, and the port's call cut to that call's block of rows (every tensor
        argument whose batch is the port's whole batch), so the two can be replayed as one call each."""
        if self.side != "reference" or (step + 1) * self.k > len(ref_calls):
            return None
        whole = output_tensor(port_call.output)
        if whole is None or whole.dim() == 0 or whole.shape[0] % self.k:
            return None
        size = whole.shape[0] // self.k
        rows = slice(0, size)  # stacking position 0 holds the reference's call order[0]
        ref_call = ref_calls[step * self.k + self.order[0]]

        def cut(value: Any) -> Any:  # tensors inside dicts too (SDXL's added_cond_kwargs)
            if isinstance(value, dict):
                return {k: cut(v) for k, v in value.items()}
            t = batch_of(value)
            return t[rows] if t is not None and t.dim() > 0 and t.shape[0] == whole.shape[0] else value

        return ref_call, Call(
            tuple(cut(v) for v in port_call.args),
            {k: cut(v) for k, v in port_call.kwargs.items()},
            {k: cut(v) for k, v in port_call.named.items()},
            whole[rows],
        )

    def first_of(self, step: int, port_calls: list[Call]) -> tuple[Call, tuple[int, int]] | None:
        r"""The port's first recorded call of ``step`` and the rows of the reference's batch it computes
        (its block in the stacking order), when the port is the side that calls ``k`` times."""
        if self.side != "port" or (step + 1) * self.k > len(port_calls):
            return None
        call = port_calls[step * self.k]
        found = output_tensor(call.output)
        if found is None or found.dim() == 0:
            return None
        size, block = found.shape[0], self.order.index(0)
        return call, (block * size, (block + 1) * size)

    def words(self) -> str:
        other = "port" if self.side == "reference" else "reference"
        return (
            f"the {self.side} calls its denoiser {self.k} times per timestep where the {other} calls it once"
            f" on a batch {self.k} times as large: each step's {self.k} calls are compared as one batch,"
            f" stacked in the order {tuple(self.order)} that the first step's outputs follow"
        )


def _stack(tensors: list[Any]) -> Any:
    import torch

    return torch.cat([t.to(tensors[0].dtype) for t in tensors])


def _packings(ref_shape: tuple[int, ...], port_shape: tuple[int, ...]) -> Any:
    r"""Index tensors ``i`` such that ``reference.flatten()[i]`` is the reference packed into
    ``port_shape``: ``(B, C, *spatial)`` against ``(B, tokens, features)``, each spatial dim cut into
    patches of 1, 2 or 4, the tokens in row order, the features the channel and patch axes in any order."""
    import itertools

    import torch

    if len(ref_shape) < 3 or len(port_shape) != 3 or ref_shape[0] != port_shape[0]:
        return
    batch, channels, spatial = ref_shape[0], ref_shape[1], ref_shape[2:]
    tokens, features = port_shape[1], port_shape[2]
    base = torch.arange(batch * channels * math.prod(spatial)).reshape(ref_shape)
    for patches in itertools.product((1, 2, 4), repeat=len(spatial)):
        if any(n % q for n, q in zip(spatial, patches)):
            continue
        grid = [n // q for n, q in zip(spatial, patches)]
        if math.prod(grid) != tokens or channels * math.prod(patches) != features:
            continue
        split = [batch, channels] + [x for n, q in zip(grid, patches) for x in (n, q)]
        cut = base.reshape(split)
        token_axes = [2 + 2 * k for k in range(len(spatial))]
        inner = [1] + [3 + 2 * k for k in range(len(spatial))]
        for order in itertools.permutations(inner):
            yield cut.permute(0, *token_axes, *order).reshape(-1)


def _percent(fraction: float | None) -> str:
    r"""A share as a percentage (``100%``, ``0.26%``), never a bare ``1`` that reads as one element."""
    if fraction is None:
        return "-"
    return f"{100 * fraction:.3g}%"
