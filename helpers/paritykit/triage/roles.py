r"""One denoiser call seen by role, and two sides' calls paired: which argument is the latents, which the
timestep, which the conditioning; and the port's call with the reference's values put in its place.

The two sides rarely name their arguments alike (``x, t, context`` in research code, ``sample, timestep,
encoder_hidden_states`` in diffusers), so roles come from names first, then from position and shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from paritykit.tracing.recording import (
    Call,
    batch_of,
    in_form_of,
    output_tensor,
    scalar_value,
    timestep_argument,
)

# argument names read as the latents a denoiser is given, most specific first
LATENT_NAMES = ("sample", "latents", "latent", "x", "x_t", "xt", "z", "z_t", "noisy", "hidden_states", "img")


@dataclass
class Roles:
    r"""A call's arguments by role: ``latents`` and ``timestep`` name an argument (``None`` when not found);
    ``conditioning`` lists the other tensor arguments in order."""

    latents: str | None
    timestep: str | None
    timestep_kind: str | None
    conditioning: list[str] = field(default_factory=list)


def roles_of(call: Call) -> Roles:
    r"""The call's arguments by role; a list of per-sample tensors counts as the batch it holds."""
    named = {k: batch_of(v) for k, v in call.named.items()}
    found = timestep_argument(call.named)
    t_name, t_kind = (found[0], found[1]) if found is not None else (None, None)
    tensors = [k for k, v in named.items() if v is not None and k != t_name]
    latents = _latents_name(tensors, named, output_tensor(call.output))
    conditioning = [k for k in tensors if k != latents]
    # tensors inside a dict argument (SDXL's added_cond_kwargs: text_embeds, time_ids) are conditioning too,
    # named by their path
    for key, value in call.named.items():
        if isinstance(value, dict):
            conditioning += [path for path, leaf in _dict_leaves(value, key) if leaf.dim() >= 1]
    return Roles(latents, t_name, t_kind, conditioning)


def _latents_name(tensors: list[str], named: dict[str, Any], out: Any) -> str | None:
    r"""The argument a denoiser predicts from: its output has the latents' shape (a noise, sample or velocity
    prediction), or their shape with more channels (a learned variance stacked on the prediction). Among the
    arguments of that shape a latents name decides; with none of that shape, a latents name, then the first
    tensor argument (denoisers take the latents first). The number of dimensions decides nothing: a prior's
    latents are ``(batch, dim)`` next to a ``(batch, tokens, dim)`` text encoding."""
    if out is not None and hasattr(out, "shape"):
        shape = tuple(out.shape)
        for fits in (lambda s: s == shape, lambda s: _more_channels(shape, s)):
            shaped = [k for k in tensors if fits(tuple(named[k].shape))]
            if shaped:
                return next((k for k in LATENT_NAMES if k in shaped), shaped[0])
    return next((k for k in LATENT_NAMES if k in tensors), tensors[0] if tensors else None)


def agreeing_latents(
    ref_calls: list[Call], ref_roles: list[Roles], port_calls: list[Call], port_roles: list[Roles]
) -> tuple[list[Roles], list[Roles]]:
    r"""Both sides' roles with one latents shape where only one side can give it (round 35, CSDI: the
    research network takes the stacked ``(B, 2, K, L)`` input and no argument of its output's shape, the
    port takes the same stack and a ``cond_mask`` of the output's shape, read as its latents): on the side
    that holds an argument of the other side's latents shape, that argument is its latents, at every call
    that has it. Where both sides or neither could change, the roles stay as read."""
    if not ref_calls or not port_calls:
        return ref_roles, port_roles
    ref_shape, port_shape = (
        _shape(latents(calls[0], roles[0]))
        for calls, roles in ((ref_calls, ref_roles), (port_calls, port_roles))
    )
    if ref_shape is None or port_shape is None or ref_shape == port_shape:
        return ref_roles, port_roles
    port_pick = _of_shape(port_calls[0], port_roles[0], ref_shape)
    ref_pick = _of_shape(ref_calls[0], ref_roles[0], port_shape)
    if (port_pick is None) == (ref_pick is None):
        return ref_roles, port_roles
    if port_pick is not None:
        return ref_roles, _repicked(port_calls, port_roles, port_pick, ref_shape)
    return _repicked(ref_calls, ref_roles, ref_pick, port_shape), port_roles


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if hasattr(value, "shape") else None


def _of_shape(call: Call, roles: Roles, shape: tuple[int, ...]) -> str | None:
    r"""The one conditioning argument of ``call`` of ``shape`` (a latents name first), if there is one."""
    shaped = [k for k in roles.conditioning if _shape(argument(call, k)) == shape]
    named = [k for k in LATENT_NAMES if k in shaped]
    if named:
        return named[0]
    return shaped[0] if len(shaped) == 1 else None


def _repicked(calls: list[Call], roles: list[Roles], name: str, shape: tuple[int, ...]) -> list[Roles]:
    out = []
    for call, r in zip(calls, roles):
        if name in r.conditioning and _shape(argument(call, name)) == shape:
            others = [k for k in r.conditioning if k != name]
            r = Roles(name, r.timestep, r.timestep_kind, ([r.latents] if r.latents else []) + others)
        out.append(r)
    return out


def _more_channels(shape: tuple[int, ...], of: tuple[int, ...]) -> bool:
    r"""Whether ``shape`` is ``of`` with a whole multiple of its channels (dim 1)."""
    same_rest = len(of) == len(shape) > 1 and of[0] == shape[0] and of[2:] == shape[2:]
    return same_rest and of[1] > 0 and shape[1] % of[1] == 0


def _dict_leaves(value: dict, prefix: str) -> list[tuple[str, Any]]:
    import torch

    out = []
    for key, item in value.items():
        path = f"{prefix}.{key}"
        if isinstance(item, torch.Tensor):
            out.append((path, item))
        elif isinstance(item, dict):
            out += _dict_leaves(item, path)
    return out


def argument(call: Call, name: str) -> Any:
    r"""An argument as the batch it holds (:func:`~paritykit.tracing.recording.batch_of`); a dotted name is a
    tensor inside a dict argument."""
    value = call.named.get(name)
    if value is None and "." in name:
        head, *rest = name.split(".")
        value = call.named.get(head)
        for key in rest:
            value = value.get(key) if isinstance(value, dict) else None
    return batch_of(value)


def latents(call: Call, roles: Roles) -> Any:
    return argument(call, roles.latents) if roles.latents else None


def timestep(call: Call, roles: Roles) -> float | None:
    return scalar_value(call.named[roles.timestep]) if roles.timestep else None


def output(call: Call) -> Any:
    return output_tensor(call.output)


def pair_conditioning(ref: Call, ref_roles: Roles, port: Call, port_roles: Roles) -> list[tuple[str, str]]:
    r"""Conditioning arguments paired by shape: first those of one shape whose names share a word and that
    hold the same values (round 38, Protenix: the research takes a trunk pair tensor it ignores and the
    ``pair_z`` it uses, of one shape; the port takes ``pair``), then the rest in order among equal shapes;
    unpaired ones are left out. Values alone pair nothing: a port passing the unconditional embedding where
    the reference passes the conditional one would then compare equal."""
    import re

    import torch

    def words(name: str) -> set[str]:
        return {w for w in re.split(r"[._]", name.lower()) if w}

    shapes = {k: tuple(argument(ref, k).shape) for k in ref_roles.conditioning}
    port_shapes = {k: tuple(argument(port, k).shape) for k in port_roles.conditioning}
    found: dict[str, str] = {}
    used: set[str] = set()
    for r in ref_roles.conditioning:
        a = argument(ref, r)
        hit = next(
            (
                p
                for p in port_roles.conditioning
                if p not in used
                and port_shapes[p] == shapes[r]
                and words(p) & words(r)
                and a.is_floating_point()
                and torch.equal(a, argument(port, p).to(a.dtype))
            ),
            None,
        )
        if hit is not None:
            found[r] = hit
            used.add(hit)
    for r in ref_roles.conditioning:
        if r in found:
            continue
        hit = next(
            (p for p in port_roles.conditioning if p not in used and port_shapes[p] == shapes[r]), None
        )
        if hit is not None:
            found[r] = hit
            used.add(hit)
    return [(r, found[r]) for r in ref_roles.conditioning if r in found]


def with_reference_values(
    ref: Call, ref_roles: Roles, port: Call, port_roles: Roles, **options: Any
) -> tuple[tuple, dict]:
    r"""The port's call with the reference's latents, conditioning and timestep in place of its own (the
    values :func:`reference_swap` gives, ``options`` as it takes them): what the port's module computes on
    the reference's inputs."""
    return with_values(port, reference_swap(ref, ref_roles, port, port_roles, **options))


def kept_own(ref: Call, ref_roles: Roles, port: Call, port_roles: Roles, **options: Any) -> list[str]:
    r"""The port's tensor arguments :func:`with_reference_values` leaves as the port's own: no reference
    input is paired with them (WaveGrad's noise level, read as no timestep), so the port's module is not
    fed the reference's inputs there."""
    import torch

    swapped = reference_swap(ref, ref_roles, port, port_roles, **options)
    return [n for n, v in port.named.items() if isinstance(v, torch.Tensor) and n not in swapped]


def reference_swap(
    ref: Call,
    ref_roles: Roles,
    port: Call,
    port_roles: Roles,
    timestep_too: bool = True,
    t_units: Callable[[float], float] | None = None,
    layout: Callable[[Any], Any] | None = None,
    laid_out: dict[str, Any] | None = None,
) -> dict[str, Any]:
    r"""The port's argument names :func:`with_reference_values` replaces, with the reference's values:
    latents (laid out another way by ``layout``: the reference's values into the port's packing),
    conditioning, and (when ``timestep_too`` and both sides give one) the timestep, converted to the port's
    units by ``t_units`` (``t * 1000`` when the reference gives it in [0, 1], ``1 - t / 1000`` for flow time
    counted the other way). A conditioning input the port holds rearranged (``laid_out``: its name -> a
    :class:`~paritykit.triage.pairs.Rearrangement`) is given the reference's values in the port's layout."""
    import torch

    swap: dict[str, Any] = {}
    if ref_roles.latents and port_roles.latents:
        mine, theirs = latents(port, port_roles), latents(ref, ref_roles)
        if layout is not None and tuple(mine.shape) != tuple(theirs.shape):
            theirs = layout(theirs)
        if tuple(mine.shape) == tuple(theirs.shape):
            swap[port_roles.latents] = in_form_of(port.named[port_roles.latents], theirs)
        elif times := repeated_batch(theirs, mine):  # guidance batched before the port's call
            grown = theirs.repeat(times, *([1] * (theirs.dim() - 1)))
            swap[port_roles.latents] = in_form_of(port.named[port_roles.latents], grown)
    for r, p in pair_conditioning(ref, ref_roles, port, port_roles):
        if p in port.named:  # a tensor inside a dict argument stays the port's own
            value = argument(ref, r)
            if laid_out and p in laid_out:
                value = laid_out[p].to_port(value)
            swap[p] = in_form_of(port.named[p], value)
    if timestep_too and ref_roles.timestep and port_roles.timestep:
        value = t_units(timestep(ref, ref_roles)) if t_units is not None else timestep(ref, ref_roles)
        mine = port.named[port_roles.timestep]
        swap[port_roles.timestep] = (
            torch.full_like(mine, value) if isinstance(mine, torch.Tensor) else type(mine)(value)
        )
    return swap


def repeated_batch(reference: Any, port: Any) -> int:
    r"""``k`` where ``port`` is ``reference`` repeated ``k`` > 1 times along the batch, every row exactly (a
    guidance batch made before the call on one side, inside the denoiser on the other); 0 otherwise."""
    import torch

    if (
        reference.dim() == 0
        or reference.dim() != port.dim()
        or tuple(reference.shape[1:]) != tuple(port.shape[1:])
    ):
        return 0
    if port.shape[0] <= reference.shape[0] or port.shape[0] % reference.shape[0]:
        return 0
    times = port.shape[0] // reference.shape[0]
    grown = reference.repeat(times, *([1] * (reference.dim() - 1))).to(port.dtype)
    return times if bool(torch.equal(port, grown)) else 0


def with_values(call: Call, swap: dict[str, Any]) -> tuple[tuple, dict]:
    r"""``call``'s arguments with those ``swap`` names replaced, each where the call passed it (by keyword or
    by position)."""
    args, kwargs, names = list(call.args), dict(call.kwargs), list(call.named)
    for name, value in swap.items():
        if name in kwargs:
            kwargs[name] = value
        elif name in names and names.index(name) < len(args):
            args[names.index(name)] = value
    return tuple(args), kwargs
