r"""Arguments of two calls paired by their captured values, across signatures.

A research block takes ``(x, e, seq_lens, grid_sizes, freqs, context, context_lens)``, the diffusers block
``(hidden_states, encoder_hidden_states, temb, rotary_emb)``: names, order and shapes say little, the values
say which is which. Each port argument is paired with the reference argument that, carried through one
:class:`Relation`, gives the port's captured value: the same tensor; another dtype; a dim permutation; the
same values in another shape (flatten/unflatten); one value per sample spread over tokens (broadcast); a
constant factor (timesteps in [0, 1] against [0, 1000]); per-sample tensors of a list stacked into a batch,
padded to a common length; the cos or sin of a rotary table, complex or of real angles (pairs interleaved or
halves). A replay carries the reference's value through the same relation into the port's signature. A port
argument no relation reaches is the port's own (kept from the port's capture, and named).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paritykit.bisection.leaves import dim_orders

Leaves = list[tuple[str, Any]]
# constants a timestep-like argument (one value per sample, or a scalar) may be scaled by between the two
# sides, with their names: [0, 1] against [0, 1000]. Nothing else is paired up to a factor: an activation
# that is another's negative or double is a difference, not the same argument.
ROUND_FACTORS = ((1000.0, "1000"), (0.001, "1/1000"))


@dataclass(frozen=True)
class Relation:
    r"""How one port argument is computed from reference arguments: ``sources`` are indices of reference
    leaves, ``words`` says how (``"= x"``, ``"= t × 1000"``, ``"cos of freqs (complex, pairs interleaved)"``),
    ``kind`` names the relation for tables (``exact``, ``dtype``, ``layout``, ``reshape``, ``broadcast``,
    ``scale``, ``stack``, ``rotary``), and ``convert`` maps the sources' tensors to the port's form."""

    sources: tuple[int, ...]
    kind: str
    words: str
    convert: Callable[..., Any]
    # other reference leaves that give the same port value by as plain a relation (equal arguments, zeros):
    # the pairing then says nothing about which is which beyond this call
    ties: int = 0

    def __call__(self, leaves: Leaves) -> Any:
        return self.convert(*(leaves[i][1] for i in self.sources))


def _shapes_to(tensor: Any, shape: tuple) -> list[tuple[str, str, Callable[[Any], Any]]]:
    r"""Ways to give ``tensor`` the shape ``shape``: (kind, words, function), the plainest first."""
    out: list[tuple[str, str, Callable[[Any], Any]]] = []
    have = tuple(tensor.shape)
    if have == shape:
        out.append(("exact", "", lambda t: t))
    for order in dim_orders(have, shape):
        out.append(("layout", f"dims permuted {order}", lambda t, o=order: t.permute(o)))
    numel = math.prod(shape)
    if tensor.numel() == numel and have != shape:
        out.append(("reshape", f"reshaped {list(have)} -> {list(shape)}", lambda t: t.reshape(shape)))
    elif tensor.numel() and numel % tensor.numel() == 0 and numel != tensor.numel():
        # one value per sample spread over more positions: left-aligned (``[B]`` -> ``[B, L]``) or
        # right-aligned (numpy's rule)
        for aligned, view in (
            ("per sample", have + (1,) * (len(shape) - len(have))),
            ("broadcast", (1,) * (len(shape) - len(have)) + have),
        ):
            if len(view) == len(shape) and all(v in (1, s) for v, s in zip(view, shape)):
                out.append(
                    (
                        "broadcast",
                        f"{aligned}: {list(have)} -> {list(shape)}",
                        lambda t, v=view: t.reshape(v).expand(shape),
                    )
                )
    return out


def _rotary_parts(tensor: Any) -> list[tuple[str, Callable[[Any], Any]]]:
    r"""A complex rotary table's real-valued forms a port may take: cos or sin, each of its frequencies
    repeated for the pair it rotates (interleaved) or the table written twice (halves)."""
    import torch

    parts = []
    for name, part in (("cos", torch.real), ("sin", torch.imag)):
        parts.append((f"{name} (pairs interleaved)", lambda t, p=part: p(t).repeat_interleave(2, dim=-1)))
        parts.append((f"{name} (halves)", lambda t, p=part: torch.cat([p(t), p(t)], dim=-1)))
    return parts


def _angle_table(source: Any, target: Any) -> bool:
    r"""Whether ``target`` may be the cos or sin of a real table of rotary angles ``source``: both real
    floating tables of two or more dims, the target's last width the source's or twice it, its values within
    [-1, 1] (a cheap look before any cos is taken)."""
    if source.is_complex() or not source.is_floating_point() or not target.is_floating_point():
        return False
    if (
        source.dim() < 2
        or target.dim() < 2
        or target.shape[-1] not in (source.shape[-1], 2 * source.shape[-1])
    ):
        return False
    return bool(target.numel()) and float(target.detach().abs().max()) <= 1.0 + 1e-6


def _angle_parts(source: Any, target: Any) -> list[tuple[str, Callable[[Any], Any]]]:
    r"""A real rotary angle table's cos and sin, as they are or (a table of one angle per pair) with each
    angle repeated for its pair (interleaved) or the table written twice (halves)."""
    import torch

    parts = []
    for name, fn in (("cos", torch.cos), ("sin", torch.sin)):
        if target.shape[-1] == source.shape[-1]:
            parts.append((name, lambda t, f=fn: f(t)))
        else:
            parts.append((f"{name} (pairs interleaved)", lambda t, f=fn: f(t).repeat_interleave(2, dim=-1)))
            parts.append((f"{name} (halves)", lambda t, f=fn: torch.cat([f(t), f(t)], dim=-1)))
    return parts


def _factor(value: Any, reference: Any) -> tuple[float, str] | None:
    r"""The round constant ``c`` with ``value ≈ c · reference``, if any (least squares, then snapped)."""
    import torch

    r = reference.detach().to("cpu", torch.float64).reshape(-1)
    v = value.detach().to("cpu", torch.float64).reshape(-1)
    den = float(r @ r)
    if den == 0:
        return None
    fitted = float(v @ r) / den
    for constant, words in ROUND_FACTORS:
        if abs(fitted - constant) <= 1e-3 * abs(constant):
            return constant, words
    return None


def pair_by_value(
    ref: Leaves,
    port: Leaves,
    close: Callable[[Any, Any], bool],
) -> dict[int, Relation]:
    r"""Each port leaf whose captured value some reference leaf gives through a :class:`Relation`, by its
    index; the plainest relation wins (the same tensor before a permutation, a permutation before a factor).
    ``close(a, b)`` says whether two same-shape tensors agree (the comparison's tolerance). Port leaves
    left out are the port's own."""
    import dataclasses

    found: dict[int, Relation] = {}
    for j, (_, target) in enumerate(port):
        shape = tuple(target.shape)
        candidates = [
            relation
            for i, (path, source) in enumerate(ref)
            if (relation := _relate(i, path, source, target, shape, close)) is not None
        ]
        if not candidates:
            stacked = _stacked(ref, target, shape, close)
            candidates = [stacked] if stacked is not None else []
        if candidates:
            best = min(candidates, key=_rank)
            ties = sum(_rank(c) == _rank(best) for c in candidates) - 1
            found[j] = dataclasses.replace(best, ties=ties) if ties else best
    return found


_RANK = ("exact", "dtype", "layout", "reshape", "broadcast", "stack", "rotary", "scale")


def _rank(relation: Relation) -> int:
    return _RANK.index(relation.kind)


def _relate(
    i: int, path: str, source: Any, target: Any, shape: tuple, close: Callable[[Any, Any], bool]
) -> Relation | None:
    import torch

    forms: list[tuple[str, str, Callable[[Any], Any]]] = []
    if source.is_complex() != target.is_complex():
        if target.is_complex():
            return None
        forms = [("rotary", f"{words} of {path} (complex)", fn) for words, fn in _rotary_parts(source)]
    else:
        forms = [("exact", path, lambda t: t)]
        if _angle_table(source, target):
            forms += [
                ("rotary", f"{words} of {path} (angles)", fn) for words, fn in _angle_parts(source, target)
            ]
    if target.is_complex():
        close = _complex_close
    for kind, words, fn in forms:
        try:
            value = fn(source)
        except RuntimeError:
            continue
        for shape_kind, shape_words, reshape in _shapes_to(value, shape):
            moved = reshape(value)
            cast = moved.to(target.dtype) if target.dtype != moved.dtype else moved
            described = ", ".join(w for w in (words, shape_words) if w)
            chosen = kind if kind == "rotary" else shape_kind
            if target.is_complex():
                if close(cast, target):
                    if chosen == "exact" and moved.dtype != target.dtype:
                        chosen, described = "dtype", f"{described} ({_dtype(moved)} -> {_dtype(target)})"
                    return _make(i, chosen, described, fn, reshape, target.dtype)
                continue
            if not target.is_floating_point() or not cast.is_floating_point():
                # integers and masks pair only with their own dtype (a length of 16 cast to bool is True)
                if moved.dtype == target.dtype and torch.equal(moved, target):
                    return _make(i, chosen, described, fn, reshape, target.dtype)
                continue
            if close(cast, target):
                if chosen == "exact" and moved.dtype != target.dtype:
                    chosen, described = "dtype", f"{described} ({_dtype(moved)} -> {_dtype(target)})"
                return _make(i, chosen, described, fn, reshape, target.dtype)
            if kind == "rotary" or source.dim() > 1 or target.is_complex():
                continue  # only a timestep-like argument is paired up to a factor
            factor = _factor(target, cast)
            if factor is not None and close(cast * factor[0], target):
                return _make(i, "scale", f"{described} × {factor[1]}", fn, reshape, target.dtype, factor[0])
    return None


def _complex_close(a: Any, b: Any) -> bool:
    r"""Two complex tables agree to 1e-4 relative error (a rotary table in complex64 against complex128)."""
    import torch

    a64, b64 = a.detach().to("cpu", torch.complex128), b.detach().to("cpu", torch.complex128)
    den = float(torch.linalg.vector_norm(a64))
    diff = float(torch.linalg.vector_norm(a64 - b64))
    return diff <= 1e-4 * den if den else diff == 0


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _make(
    i: int,
    kind: str,
    words: str,
    form: Callable[[Any], Any],
    reshape: Callable[[Any], Any],
    dtype: Any,
    factor: float = 1.0,
) -> Relation:
    def convert(t: Any) -> Any:
        value = reshape(form(t))
        value = value * factor if factor != 1.0 else value
        return value.to(dtype).contiguous()

    return Relation((i,), kind, words, convert)


def _stacked(ref: Leaves, target: Any, shape: tuple, close: Callable[[Any, Any], bool]) -> Relation | None:
    r"""A port batch ``[B, …]`` that is the reference's list of B per-sample tensors stacked (each padded
    with zeros to the longest along its first dim when their lengths differ)."""
    import torch

    if len(shape) < 2:
        return None
    groups: dict[str, list[int]] = {}
    for i, (path, tensor) in enumerate(ref):
        head, _, last = path.rpartition(".")
        if head and last.isdigit() and not tensor.is_complex():
            groups.setdefault(head, []).append(i)
    for head, members in groups.items():
        if len(members) != shape[0]:
            continue
        tensors = [ref[i][1] for i in members]
        if any(t.dim() != len(shape) - 1 or tuple(t.shape[1:]) != shape[2:] for t in tensors):
            continue
        if any(t.shape[0] > shape[1] for t in tensors):
            continue

        def convert(*parts: Any, length: int = shape[1], dtype: Any = target.dtype) -> Any:
            padded = [
                torch.nn.functional.pad(p, (0, 0) * (p.dim() - 1) + (0, length - p.shape[0])) for p in parts
            ]
            return torch.stack(padded).to(dtype).contiguous()

        value = convert(*tensors)
        if close(value, target):
            lengths = sorted({t.shape[0] for t in tensors})
            pad = f", padded to {shape[1]}" if lengths != [shape[1]] else ""
            return Relation(tuple(members), "stack", f"the list {head} stacked{pad}", convert)
    return None


def unexplained(ref: Leaves, port: Leaves, relations: dict[int, Relation]) -> tuple[list[int], list[int]]:
    r"""The floating-point port leaves no relation reaches that an unused floating-point (or complex)
    reference leaf could stand for (its shape can be given theirs): when there are any, the two calls'
    inputs differ, so neither may be taken for the port's own. Returns (port indices, reference indices)."""
    used = {i for r in relations.values() for i in r.sources}
    spare = [i for i, (_, t) in enumerate(ref) if i not in used and (t.is_floating_point() or t.is_complex())]
    port_left, ref_left = [], set()
    for j, (_, target) in enumerate(port):
        if j in relations or not (target.is_floating_point() or target.is_complex()):
            continue
        for i in spare:
            source = ref[i][1]
            if source.is_complex() and not target.is_complex():
                forms = [fn(source) for _, fn in _rotary_parts(source)]
            else:
                forms = [source]
            if any(_shapes_to(form, tuple(target.shape)) for form in forms):
                if j not in port_left:
                    port_left.append(j)
                ref_left.add(i)
    return port_left, sorted(ref_left)


def argument_name(module: Any, path: str) -> str:
    r"""A captured input path in the words of ``module``'s ``forward`` signature: ``args.3.0`` ->
    ``rotary_emb.0``, ``kwargs.temb`` -> ``temb``; the path itself when the signature cannot say."""
    import inspect
    import re

    if path.startswith("kwargs."):
        return path.removeprefix("kwargs.")
    found = re.fullmatch(r"args\.(\d+)(.*)", path)
    if found is None or module is None:
        return path
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return path
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    index = int(found[1])
    return positional[index].name + found[2] if index < len(positional) else path


def named_inputs(module: Any, record: Any) -> list[tuple[str, Any]]:
    r"""A call's captured input leaves, each path said in ``module``'s ``forward`` words
    (:func:`argument_name`)."""
    return [(argument_name(module, path), t) for path, t in record.inputs.items()]


def input_leaf_name(module: Any, path: str) -> str:
    r"""An input leaf's path as :func:`~paritykit.bisection.leaves.flatten_tensors` names it under the prefix
    ``input`` (``input.0.<position>…`` for a positional argument, ``input.1.<keyword>…``) in the words of
    ``module``'s ``forward``: ``input.0.1`` -> ``timestep``, ``input.1.temb`` -> ``temb``; a position the
    signature cannot name stays a number (``0``)."""
    kind, _, rest = path.removeprefix("input.").partition(".")
    named = argument_name(module, f"{'args' if kind == '0' else 'kwargs'}.{rest}")
    return named.removeprefix("args.")


def renamed(words: str, paths: list[str], name: Callable[[str], str]) -> str:
    r"""``words`` with each of ``paths`` and their parents (``args.3`` of ``args.3.0``: a list named whole),
    each whole and not inside a longer path, replaced by ``name(path)``."""
    import re

    every = {".".join(p.split(".")[:k]) for p in paths for k in range(2, p.count(".") + 2)}
    for path in sorted(every, key=len, reverse=True):
        words = re.sub(rf"(?<![\w.]){re.escape(path)}(?![\w.])", name(path), words)
    return words
