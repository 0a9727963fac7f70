r"""Rotary embedding tables read back into their parameters, from the values alone.

A rotary table holds, for each position ``n`` and frequency ``k``, the angle ``n · s · θ^(-k/m)`` (``m``
frequencies per band, position scale ``s``, base ``θ``), as complex numbers (``cis``) or as cos and sin with
each frequency on two channels, either as two halves (``rotate_half``, GPT-NeoX) or as interleaved pairs
(GPT-J). Multi-axis tables (video DiTs) concatenate one band of frequencies per position axis.

:func:`read_rotary` recovers, from a table whose first axis is the position ``0 … N-1``, the channel layout,
each band's channels, θ and position scale, each checked by regenerating the table to float tolerance;
:func:`rotary_difference` names what differs between two tables ("band 0 owns frequencies 0–3 in the port,
0–7 in the reference", "θ 10000 against 1e+06").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.report import format_number

# a table is read back when its regeneration agrees to this, relative to 1 (cos and sin are in [-1, 1])
AGREES = 1e-4


@dataclass
class Band:
    r"""One run of frequencies ``k = 0 … m-1`` with ``ω_k = scale · θ^(-k/m)``: ``first``/``last`` are the
    frequency indices it covers."""

    first: int
    last: int
    theta: float
    scale: float

    @property
    def size(self) -> int:
        return self.last - self.first + 1


@dataclass
class RotaryForm:
    r"""What a rotary table is: its layout (``complex``, ``halves``, ``interleaved``), its bands."""

    layout: str
    bands: list[Band] = field(default_factory=list)
    # max |regenerated − read| over the table, as unit complex numbers (set by read_rotary)
    error: float = 0.0

    def channels(self, band: Band) -> str:
        r"""The channels of a band in the table's own layout."""
        if self.layout == "interleaved":
            return f"channels {2 * band.first}–{2 * band.last + 1}"
        if self.layout == "halves":
            return f"channels {band.first}–{band.last} and their copies in the second half"
        return f"entries {band.first}–{band.last}"

    def describe(self) -> str:
        parts = [
            f"band {i}: {self.channels(b)}, θ {format_number(b.theta)},"
            f" position scale {format_number(b.scale)}"
            for i, b in enumerate(self.bands)
        ]
        return f"rotary table ({self.layout} layout; " + "; ".join(parts) + ")"


def _angles(table: Any) -> tuple[str, Any] | None:
    r"""``(layout, angles (N, K))`` of a table: complex (N, …, K), or cos/sin stacked (2, N, D), or a real
    (N, D) cos table with an even width."""
    import torch

    t = table.detach().cpu()
    if t.is_complex():
        t = t.reshape(t.shape[0], -1).to(torch.complex128)
        if float((t.abs() - 1).abs().max()) > AGREES:
            return None  # a rotation has magnitude 1
        return "complex", torch.angle(t)
    if not t.is_floating_point():
        return None
    if t.dim() == 3 and t.shape[0] == 2:
        cos, sin = t[0].double(), t[1].double()
    else:
        return None
    width = cos.shape[-1]
    if width % 2 or float((cos * cos + sin * sin - 1).abs().max()) > AGREES:
        return None
    halves = torch.allclose(cos[:, : width // 2], cos[:, width // 2 :], atol=1e-6)
    pairs = torch.allclose(cos[:, 0::2], cos[:, 1::2], atol=1e-6)
    if halves and not pairs:
        return "halves", torch.atan2(sin[:, : width // 2], cos[:, : width // 2])
    if pairs and not halves:
        return "interleaved", torch.atan2(sin[:, 0::2], cos[:, 0::2])
    return None


def read_rotary(table: Any) -> RotaryForm | None:
    r"""The rotary form of ``table`` (positions ``0 … N-1`` on its first axis), or None when it is not one:
    every band's θ and scale are fitted from the frequencies, and the table regenerated from them must
    agree."""
    import torch

    found = _angles(table)
    if found is None:
        return None
    layout, angles = found
    positions = angles.shape[0]
    if positions < 3 or angles.shape[1] < 2:
        return None
    if float(angles[0].abs().max()) > 1e-5:
        return None  # position 0 has angle 0 in every rotary table
    # each frequency: the slope of its unwrapped angle over positions (a frequency above π per step aliases:
    # read from the first step, where no wrap has happened yet when it is below π)
    unwrapped = torch.from_numpy(_unwrap(angles.numpy()))
    steps = torch.arange(positions, dtype=torch.float64)
    omega = (unwrapped * steps[:, None]).sum(0) / (steps * steps).sum()
    if not bool((omega > 0).all()):
        return None
    bands, start = [], 0
    for k in range(1, len(omega) + 1):
        if k == len(omega) or omega[k] >= omega[k - 1]:
            bands.append((start, k - 1))
            start = k
    form = RotaryForm(layout)
    for first, last in bands:
        m = last - first + 1
        logs = torch.log(omega[first : last + 1])
        if m == 1:
            form.bands.append(Band(first, last, float("nan"), float(omega[first])))
            continue
        idx = torch.arange(m, dtype=torch.float64)
        slope = float(((idx - idx.mean()) * (logs - logs.mean())).sum() / ((idx - idx.mean()) ** 2).sum())
        scale = float(torch.exp(logs.mean() - slope * idx.mean()))
        form.bands.append(Band(first, last, _snap_theta(math.exp(-slope * m)), _snap_scale(scale)))
    regenerated = _regenerate(form, positions)
    form.error = float((torch.exp(1j * regenerated) - torch.exp(1j * angles)).abs().max())
    return form if form.error <= AGREES * 10 else None


def _unwrap(values: Any) -> Any:
    import numpy as np

    return np.unwrap(values, axis=0)


def _snap_theta(theta: float) -> float:
    r"""θ as written in code: a power of ten or a round number when it is one to 1e-4."""
    for candidate in (round(theta), float(f"{theta:.3g}")):
        if candidate and abs(candidate - theta) <= 1e-4 * theta:
            return float(candidate)
    return theta


def _snap_scale(scale: float) -> float:
    for candidate in (1.0, 0.5, 2.0, round(scale, 4)):
        if abs(candidate - scale) <= 1e-5 * max(scale, 1e-12):
            return candidate
    return scale


def _regenerate(form: RotaryForm, positions: int) -> Any:
    import torch

    columns = []
    for band in form.bands:
        k = torch.arange(band.size, dtype=torch.float64)
        if band.size == 1:
            omega = torch.tensor([band.scale], dtype=torch.float64)
        else:
            omega = band.scale * band.theta ** (-k / band.size)
        columns.append(omega)
    omega = torch.cat(columns)
    return torch.arange(positions, dtype=torch.float64)[:, None] * omega[None]


def rotary_difference(reference: RotaryForm, port: RotaryForm) -> list[str]:
    r"""What differs between two rotary forms, in words (empty when they agree)."""
    out = []
    # a complex table multiplies interleaved pairs (view_as_complex of (…, n, 2)): the same layout
    pairs = {"complex", "interleaved"}
    if reference.layout != port.layout and not {reference.layout, port.layout} <= pairs:
        out.append(f"layout: {reference.layout} in the reference, {port.layout} in the port")
    if len(reference.bands) != len(port.bands):
        out.append(f"{len(reference.bands)} frequency bands in the reference, {len(port.bands)} in the port")
    for i, (a, b) in enumerate(zip(reference.bands, port.bands)):
        if (a.first, a.last) != (b.first, b.last):
            out.append(
                f"band {i} owns frequencies {b.first}–{b.last} in the port,"
                f" {a.first}–{a.last} in the reference"
            )
        if not _close(a.theta, b.theta):
            out.append(f"band {i}: θ {format_number(a.theta)} (reference) vs {format_number(b.theta)} (port)")
        if not _close(a.scale, b.scale):
            out.append(
                f"band {i}: position scale {format_number(a.scale)} (reference) vs {format_number(b.scale)}"
                " (port)"
            )
    return _merged(out, len(reference.bands))


@dataclass
class TablesDiffer:
    r"""Two sides' rotary tables compared: ``lead`` says what differs (empty when nothing does), ``forms``
    each side's form read back, ``residual`` the larger regeneration error of the two readings."""

    lead: str
    forms: str
    residual: float
    differs: list[str]


def compare_tables(
    reference: list[tuple[str, RotaryForm]], port: list[tuple[str, RotaryForm]], where: str = ""
) -> TablesDiffer | None:
    r"""The first table of each side (``(name, form)`` lists, as :func:`rotary_tables` and
    :func:`rotary_in_leaves` give) compared; None when either side holds none."""
    if not reference or not port:
        return None
    (ref_name, ref_form), (port_name, port_form) = reference[0], port[0]
    differs = rotary_difference(ref_form, port_form)
    lead = (
        f"the rotary tables{where} differ (reference {ref_name}, port {port_name}): {'; '.join(differs)}"
        if differs
        else ""
    )
    forms = f"reference {ref_name}: {ref_form.describe()}; port {port_name}: {port_form.describe()}"
    return TablesDiffer(lead, forms, max(ref_form.error, port_form.error), differs)


def _merged(lines: list[str], bands: int) -> list[str]:
    r"""``band i: X`` said once for every band when all of them differ the same way."""
    import re

    by_rest: dict[str, list[str]] = {}
    for line in lines:
        found = re.match(r"band (\d+): (.*)", line)
        if found:
            by_rest.setdefault(found[2], []).append(found[1])
    out = []
    for line in lines:
        found = re.match(r"band (\d+): (.*)", line)
        if not found:
            out.append(line)
        elif len(by_rest[found[2]]) == bands > 1:
            if found[1] == by_rest[found[2]][0]:
                out.append(f"{found[2]} in all {bands} bands")
        else:
            out.append(line)
    return out


def _close(a: float, b: float) -> bool:
    if math.isnan(a) and math.isnan(b):
        return True
    return abs(a - b) <= 1e-3 * max(abs(a), abs(b), 1e-12)


def rotary_tables(module: Any, limit: int = 8) -> list[tuple[str, RotaryForm]]:
    r"""The rotary tables a module and its submodules hold, read back: buffers and tensors kept as plain
    attributes, ``…cos``/``…sin`` pairs stacked, tuples of per-axis complex tables concatenated (research
    video DiTs keep one per axis). At most ``limit``, by name."""
    import torch

    found: list[tuple[str, RotaryForm]] = []
    for prefix, sub in module.named_modules():
        held: dict[str, Any] = dict(sub.named_buffers(recurse=False))
        for key, value in vars(sub).items():
            if key.startswith("_"):
                continue
            if isinstance(value, torch.Tensor):
                held[key] = value
            elif (
                isinstance(value, (tuple, list))
                and value
                and all(isinstance(v, torch.Tensor) and v.is_complex() for v in value)
            ):
                if len({v.shape[0] for v in value}) == 1:
                    held[key] = torch.cat([v.reshape(v.shape[0], -1) for v in value], dim=1)
        for key in list(held):
            if key.endswith("cos") and key[:-3] + "sin" in held:
                cos, sin = held.pop(key), held.pop(key[:-3] + "sin")
                if cos.shape == sin.shape:
                    held[key[:-3].rstrip("_") or "cos/sin"] = torch.stack([cos, sin])
        for key, value in held.items():
            if not isinstance(value, torch.Tensor) or value.dim() < 2:
                continue
            form = read_rotary(value)
            if form is not None:
                found.append((f"{prefix}.{key}" if prefix else key, form))
                if len(found) >= limit:
                    return found
    return found


def rotary_in_leaves(leaves: list[tuple[str, Any]], limit: int = 4) -> list[tuple[str, RotaryForm]]:
    r"""The rotary tables among a call's captured arguments (``(name, tensor)`` leaves): complex tables, and
    two neighbouring real leaves of one shape read as (cos, sin), as diffusers passes ``(cos, sin)`` tuples.
    Singleton axes are dropped first, so ``(1, N, 1, D)`` reads as ``(N, D)``. At most ``limit``."""
    import torch

    def squeezed(t: Any) -> Any:
        kept = [n for n in t.shape if n != 1]
        return t.reshape(kept) if kept else t

    tensors = [(k, squeezed(t)) for k, t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 2]
    found: list[tuple[str, RotaryForm]] = []
    i = 0
    while i < len(tensors) and len(found) < limit:
        key, t = tensors[i]
        form = read_rotary(t) if t.is_complex() and t.dim() >= 2 else None
        step = 1
        if form is None and t.is_floating_point() and i + 1 < len(tensors):
            other_key, other = tensors[i + 1]
            if other.is_floating_point() and other.shape == t.shape and t.dim() >= 2:
                form = read_rotary(torch.stack([t, other]))
                key, step = f"{key}, {other_key}", 2 if form is not None else 1
        if form is not None:
            found.append((key, form))
        i += step
    return found


def rotations_inside(
    module: Any, args: tuple, kwargs: dict, recent: int = 8, largest: int = 4_000_000
) -> list[RotaryForm]:
    r"""The rotary rotations ``module`` applies while it runs on ``(args, kwargs)``, read from its ops' values
    as they are computed (a ``TorchFunctionMode``): each op result that is a rotation of one of the
    ``recent`` earlier tensors of its shape (q or k before and after the rotary embedding), by
    :func:`rotary_from_rotation` with the positions on the second or third axis from the end; one per
    distinct form, in the order they were applied. Tensors over ``largest`` values are not read, and no more
    than ``recent`` are kept per shape."""
    import torch
    from torch.overrides import TorchFunctionMode

    from paritykit.bisection.leaves import flatten_tensors

    def usable(t: Any) -> bool:
        # positions on the second or third axis from the end, at least three of them
        return (
            isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.dim() >= 3
            and t.shape[-1] % 2 == 0
            and max(t.shape[-3:-1]) >= 3
            and t.numel() <= largest
        )

    earlier: dict[tuple[int, ...], list[Any]] = {}
    found: dict[str, RotaryForm] = {}

    def keep(tensor: Any) -> None:
        kept = earlier.setdefault(tuple(tensor.shape), [])
        kept.append(tensor.detach().clone())
        del kept[:-recent]

    def pair_lengths(t: Any) -> tuple[Any, Any]:
        t = t.float()
        half = t.shape[-1] // 2
        return t[..., 0::2] ** 2 + t[..., 1::2] ** 2, t[..., :half] ** 2 + t[..., half:] ** 2

    def read(after: Any) -> None:
        lengths = pair_lengths(after)
        for before in reversed(earlier.get(tuple(after.shape), [])):
            if torch.equal(before, after):
                continue
            # a rotation keeps every pair's length in one of the two pairings: a cheap test first
            if not any(
                torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(pair_lengths(before), lengths)
            ):
                continue
            form = rotary_from_rotation(before, after)
            if form is None and after.dim() >= 4:
                form = rotary_from_rotation(before.transpose(-2, -3), after.transpose(-2, -3))
            if form is not None:
                found.setdefault(form.describe(), form)
                return

    class Rotations(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for _, tensor in flatten_tensors((args, kwargs)):
                if usable(tensor):
                    keep(tensor)
            out = func(*args, **kwargs)
            for _, tensor in flatten_tensors(out):
                if usable(tensor):
                    read(tensor)
                    keep(tensor)
            return out

    with torch.no_grad(), Rotations():
        module(*args, **kwargs)
    return list(found.values())


def rotary_from_rotation(before: Any, after: Any) -> RotaryForm | None:
    r"""The rotary form applied to ``before`` (q or k, ``(…, positions, head_dim)``) to give ``after``: each
    channel pair's rotation angle per position, read for both pairings (interleaved pairs, halves), and the
    pairing whose rotations keep every pair's length and agree over batch and heads read back by
    :func:`read_rotary`. None when neither pairing is a rotation."""
    import torch

    b = before.detach().to("cpu", torch.float64)
    a = after.detach().to("cpu", torch.float64)
    if b.shape != a.shape or b.dim() < 2 or b.shape[-1] % 2:
        return None
    width = b.shape[-1]
    for layout, split in (
        ("interleaved", lambda t: (t[..., 0::2], t[..., 1::2])),
        ("halves", lambda t: (t[..., : width // 2], t[..., width // 2 :])),
    ):
        zb = torch.complex(*split(b))
        za = torch.complex(*split(a))
        ratio = za / zb
        if float((ratio.abs() - 1).abs().max()) > 1e-4:
            continue  # a rotation keeps each pair's length
        # one angle per (position, pair): the same over every batch entry and head
        table = ratio.reshape(-1, *ratio.shape[-2:])
        if float((table - table[:1]).abs().max()) > 1e-4:
            continue
        form = read_rotary(table[0])
        if form is not None:
            form.layout = layout
            return form
    return None
