r"""The grammar of candidate edits at a site, one generator per tier, each yielding its edits in cost order
(:data:`~paritykit.bisection.repair.edits.COSTS`): the engine stops trying dearer edits once one verifies.

* **parameters** — swap two same-shape parameters of sibling modules (with their biases), transpose a
  square weight, negate, flip a kernel's spatial dims, reorder equal chunks of a weight along dim 0 or 1 (its
  bias with it along dim 0), exp / log / reciprocal of a parameter, rescale by a fitted scalar;
* **inputs** — swap two same-shape inputs, swap two equal-size dims, swap the halves along dim 1 or the last
  dim (a concatenated input), rescale by a fitted or simple constant;
* **outputs** — reorder equal chunks along a dim (sin/cos halves), rescale by a fitted scalar, and
  ``a * output + b * input`` (a residual added with the wrong sign or twice);
* **settings** — :mod:`paritykit.bisection.repair.settings`;
* **uses** — the parameter edits again, of parameters that hold the reference's values.

Every edit acts on the site's working copy and undoes itself; none is reported unless the engine verifies it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

from paritykit.base.minimize import least_squares
from paritykit.base.report import format_value
from paritykit.bisection.leaves import flatten_tensors, rebuild_leaves, torch_equal
from paritykit.bisection.relations import input_leaf_name
from paritykit.bisection.repair.edits import (
    Edit,
    OutputEdit,
    ParameterEdit,
    Tier,
    WrapEdit,
    chunk_counts,
    chunk_orders,
    cost_of,
    inverse,
    order_words,
    reorder,
    set_parameters,
    simple_constants,
    snapped,
)
from paritykit.bisection.repair.site import Site, call_leaves

Tensors = dict[str, Any]

# --------------------------------------------------------------------------------------------- parameters


def _bias_of(params: Tensors, name: str) -> str | None:
    owner, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return None
    bias = f"{owner}.bias" if owner else "bias"
    return bias if bias in params else None


def _swapped(params: Tensors, pairs: list[tuple[str, str]]) -> Callable[[], Tensors]:
    return lambda: {x: params[y] for p in pairs for x, y in (p, p[::-1])}


def _swaps(site: Site, params: Tensors) -> Iterator[Edit]:
    r"""Two sibling parameters of one shape swapped (to_k <-> to_v), with their biases. Every parameter takes
    part: an alignment by values pairs a crossed ``to_k`` with the reference's ``v_proj``, so being faithful
    to an aligned module says nothing here."""
    for a, b in itertools.combinations(sorted(params), 2):
        (oa, _, la), (ob, _, lb) = a.rpartition("."), b.rpartition(".")
        if la != lb or la == "bias" or oa.rpartition(".")[0] != ob.rpartition(".")[0]:
            continue
        if params[a].shape != params[b].shape or torch_equal(params[a], params[b]):
            continue
        ba, bb = _bias_of(params, a), _bias_of(params, b)
        pairs = [(a, b)] + ([(ba, bb)] if ba and bb and params[ba].shape == params[bb].shape else [])
        yield ParameterEdit(
            tier="parameters",
            kind="swap-parameters",
            target=f"{site.path(oa)} <-> {site.path(ob)}",
            parameters={"parameters": [list(p) for p in pairs]},
            words=(
                f"{site.path(oa)} and {site.path(ob)}: swap their"
                f" weights{' and biases' if len(pairs) > 1 else ''} (each holds the other's: fix the"
                f" conversion of {oa} and {ob})"
            ),
            cost=cost_of("parameters", "swap-parameters"),
            values=_swapped(params, pairs),
        )


def parameter_edits(site: Site, work: Any) -> Iterator[Edit]:
    r"""Edits of the parameters that hold no reference tensor value for value (a conversion changed them),
    and swaps of sibling parameters; cheapest first."""
    params = {n: p.detach() for n, p in work.named_parameters() if p.is_floating_point()}
    yield from _swaps(site, params)
    free = {n: p for n, p in params.items() if n not in site.faithful and n not in site.held}
    yield from _edits_of(site, work, params, free, "parameters")


def use_edits(site: Site, work: Any) -> Iterator[Edit]:
    r"""The same edits of the parameters that do hold the reference's values: the weights are right, so a
    verified edit says how the port's forward uses the parameter differently."""
    params = {n: p.detach() for n, p in work.named_parameters() if p.is_floating_point()}
    held = {n: p for n, p in params.items() if n in site.faithful or n in site.held}
    yield from _edits_of(site, work, params, held, "uses")


def _said(site: Site, tier: Tier, name: str, change: str, conversion: str) -> str:
    r"""The sentence for a parameter edit: a conversion to fix, or (tier ``uses``) a use of right values."""
    if tier != "uses":
        return f"{site.path(name)}: {change} ({conversion})"
    source = site.held.get(name, "the aligned reference module's")
    # same values, used otherwise: where to change it (the conversion, or a forward of the port's own) is the
    # user's call; round 17's stock Linear held a research (in, out) matrix that the conversion must transpose
    reshaped = ", shape [" in source
    held = "the reference's values in their order" if reshaped else "exactly the reference's values"
    return (
        f"{site.path(name)} holds {held} ({source}), yet the port matches only after this edit: {change}; the"
        " port uses these values otherwise than the reference: load them so in the conversion, or change how"
        " its forward uses them"
    )


class _ParameterEdits:
    r"""The parameter edits of one tier (``parameters`` or ``uses``) over the chosen parameters."""

    def __init__(self, site: Site, tier: Tier, params: Tensors):
        self.site, self.tier, self.params = site, tier, params

    def edit(
        self,
        kind: str,
        name: str,
        values: Callable[[], Tensors],
        change: str,
        conversion: str,
        chunks: int = 0,
        remake: Callable[[float], Edit] | None = None,
        **parameters: Any,
    ) -> Edit:
        return ParameterEdit(
            tier=self.tier,
            kind=kind,
            target=self.site.path(name),
            parameters=parameters,
            words=_said(self.site, self.tier, name, change, conversion),
            cost=cost_of(self.tier, kind, chunks),
            values=values,
            remake=remake,
        )

    def transpose(self, name: str, p: Any) -> Edit:
        return self.edit(
            "transpose",
            name,
            lambda: {name: p.transpose(0, 1).contiguous()},
            "transpose it (dims 0 and 1)",
            "the conversion transposed it, or should have",
        )

    def negate(self, name: str, p: Any) -> Edit:
        return self.edit("negate", name, lambda: {name: -p}, "negate it", "its sign is flipped")

    def flip(self, name: str, p: Any, dims: tuple[int, ...]) -> Edit:
        return self.edit(
            "flip",
            name,
            lambda: {name: p.flip(dims)},
            f"flip it along dim{'s' if len(dims) > 1 else ''} {', '.join(map(str, dims))}",
            "the port's kernel holds its taps in the reverse order",
            dims=list(dims),
        )

    def permute(self, name: str, p: Any, dim: int, count: int, order: tuple[int, ...]) -> Edit:
        bias = _bias_of(self.params, name)
        with_bias = dim == 0 and bias is not None and self.params[bias].shape[0] == p.shape[0]

        def values() -> Tensors:
            out = {name: reorder(p, dim, count, order)}
            if with_bias:
                out[bias] = reorder(self.params[bias], 0, count, order)
            return out

        what = "its weight and bias" if with_bias else "it"
        return self.edit(
            "permute-chunks",
            name,
            values,
            f"{order_words(count, order)} of {what} along dim {dim}",
            "the conversion put the chunks in another order",
            chunks=count,
            dim=dim,
            count=count,
            order=list(order),
            bias=bool(with_bias),
        )

    def elementwise(self, kind: str, name: str, p: Any) -> Edit:
        fn, change, conversion = {
            "exp": (
                lambda: p.exp(),
                "replace it by exp() of it",
                "the checkpoint stores its logarithm: load exp() of it",
            ),
            "log": (
                lambda: p.log(),
                "replace it by log() of it",
                "the port expects its logarithm: load log() of it",
            ),
            "reciprocal": (
                lambda: p.reciprocal(),
                "replace it by 1/it",
                "the checkpoint stores the inverse: load 1/it",
            ),
        }[kind]
        return self.edit(kind, name, lambda: {name: fn()}, change, conversion)

    def rescale(self, name: str, factor: float, label: str) -> Edit:
        bias = _bias_of(self.params, name)
        names = [name] + ([bias] if bias is not None else [])
        target = name.rpartition(".")[0] if bias is not None else name
        what = "its weight and bias" if bias is not None else "it"
        return self.edit(
            "rescale",
            target,
            lambda: {n: self.params[n] * factor for n in names},
            f"multiply {what} by {label}",
            f"load {what} multiplied by {label}",
            remake=lambda f: self.rescale(name, f, ""),
            factor=factor,
        )


def _edits_of(site: Site, work: Any, params: Tensors, chosen: Tensors, tier: Tier) -> Iterator[Edit]:
    import torch

    edits = _ParameterEdits(site, tier, params)
    for name, p in chosen.items():
        if p.ndim >= 2 and p.shape[0] == p.shape[1]:
            yield edits.transpose(name, p)
        yield edits.negate(name, p)
    for name, p in chosen.items():
        for dims in _spatial_flips(p):
            yield edits.flip(name, p, dims)
    # chunk reorders, fewest chunks first (their cost grows with the count)
    reorders = [
        (count, name, p, dim)
        for name, p in chosen.items()
        for dim in range(min(p.ndim, 2))
        for count in chunk_counts(p.shape[dim])
    ]
    for count, name, p, dim in sorted(reorders, key=lambda r: r[0]):
        for order in chunk_orders(count):
            yield edits.permute(name, p, dim, count, order)
    for name, p in chosen.items():
        if p.numel() < 1:
            continue
        yield edits.elementwise("exp", name, p)
        if bool((p > 0).all()):
            yield edits.elementwise("log", name, p)
        if bool((p != 0).all()):
            yield edits.elementwise("reciprocal", name, p)
    for name in chosen:
        bias = _bias_of(params, name)
        names = [name] + ([bias] if bias is not None else [])
        saved = set_parameters(work, {n: torch.zeros_like(params[n]) for n in names})
        try:
            zero = call_leaves(work, site.inputs())
        finally:
            set_parameters(work, saved)
        for scale, label in _fitted_scales(site, zero):
            yield edits.rescale(name, scale, label)


def _spatial_flips(p: Any) -> list[tuple[int, ...]]:
    if p.ndim < 3:
        return []
    spatial = [d for d in range(2, p.ndim) if p.shape[d] > 1]
    out = [tuple(spatial)] if spatial else []
    if len(spatial) > 1:
        out += [(d,) for d in spatial]
    return out


def _fitted_scales(site: Site, zero: list | None) -> list[tuple[float, str]]:
    r"""Scalars ``s`` with ``wanted ≈ zero + s * (got - zero)`` on the first differing leaf (least squares),
    snapped candidates first, then the fitted value itself."""
    failing = site.failing()
    if zero is None or not failing:
        return []
    i, j = failing[0]
    got, zero = site.as_wanted(site.got), site.as_wanted(zero)
    w = site.wanted[i][1].double().flatten()
    g = got[j][1].double().flatten()
    z = zero[j][1].double().flatten() if j < len(zero) and zero[j][1].shape == got[j][1].shape else None
    if z is None:
        return []
    d = g - z
    den = float(d @ d)
    if den == 0 or not math.isfinite(den):
        return []
    s = float((w - z) @ d) / den
    return _with_snaps(s, site.sizes)


def _with_snaps(value: float, sizes: tuple[int, ...]) -> list[tuple[float, str]]:
    if not math.isfinite(value) or abs(value - 1.0) < 1e-9:
        return []
    near = [(c, name) for c, name in snapped(value, sizes) if c != 1.0]
    return [*near, (value, format_value(value))]


# ------------------------------------------------------------------------------------------------- inputs


def _input_edit(
    site: Site,
    kind: str,
    target: str,
    change: Callable[[Tensors], Tensors],
    words: str,
    remake: Callable[[float], Edit] | None = None,
    **parameters: Any,
) -> Edit:
    r"""An edit of the site's inputs: ``change(leaves)`` maps ``{path: tensor}`` to the replaced ones."""

    def before(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves = dict(flatten_tensors((args, kwargs), "input"))
        new_args, new_kwargs = rebuild_leaves((args, kwargs), change(leaves), "input")
        return tuple(new_args), dict(new_kwargs)

    return WrapEdit(
        tier="inputs",
        kind=kind,
        target=f"{site.path()} {target}",
        parameters=parameters,
        words=words,
        cost=cost_of("inputs", kind),
        before=before,
        remake=remake,
    )


def _input_names(leaves: list[tuple[str, Any]], module: Any = None) -> dict[str, str]:
    r"""How a porter names each input leaf: ``input hidden_states`` for a keyword, and for a position the
    name its ``forward`` gives it (``input 0`` when the signature does not say)."""
    names = {path: input_leaf_name(module, path) for path, _ in leaves}
    # an argument named `input` (torch's Conv and Linear) is said once
    return {path: "input" if name == "input" else f"input {name}" for path, name in names.items()}


def _swap_inputs(pa: str, pb: str) -> Callable[[Tensors], Tensors]:
    return lambda lv: {pa: lv[pb], pb: lv[pa]}


def _transposed_input(path: str, a: int, b: int) -> Callable[[Tensors], Tensors]:
    return lambda lv: {path: lv[path].transpose(a, b)}


def _halves_swapped(path: str, dim: int) -> Callable[[Tensors], Tensors]:
    return lambda lv: {path: reorder(lv[path], dim, 2, (1, 0))}


def _scaled_input(path: str, factor: float) -> Callable[[Tensors], Tensors]:
    return lambda lv: {path: lv[path] * factor}


def input_edits(site: Site, work: Any) -> Iterator[Edit]:
    r"""Input edits, cheapest first: swaps of two inputs, of two dims, of two halves, then rescales."""
    leaves = [(p, t) for p, t in flatten_tensors(site.inputs(), "input") if t.is_floating_point()]
    names = _input_names(leaves, site.module)
    for (pa, ta), (pb, tb) in itertools.combinations(leaves, 2):
        if ta.shape == tb.shape and not bool((ta == tb).all()):
            yield _input_edit(
                site,
                "swap-inputs",
                f"{names[pa]} <-> {names[pb]}",
                _swap_inputs(pa, pb),
                f"{site.path()}: its {names[pa]} and {names[pb]} are swapped (pass each where the other"
                " goes)",
                inputs=[names[pa], names[pb]],
            )
    for path, t in leaves:
        for a, b in itertools.combinations(range(1, t.ndim), 2):
            if t.shape[a] == t.shape[b] and t.shape[a] > 1:
                yield _input_edit(
                    site,
                    "swap-dims",
                    names[path],
                    _transposed_input(path, a, b),
                    f"{site.path()}: its {names[path]} comes with dims {a} and {b} swapped (transpose it)",
                    dims=[a, b],
                )
    for path, t in leaves:
        for dim in sorted({1, t.ndim - 1}):
            if t.ndim > dim >= 1 and t.shape[dim] % 2 == 0 and t.shape[dim] > 1:
                yield _input_edit(
                    site,
                    "swap-halves",
                    names[path],
                    _halves_swapped(path, dim),
                    f"{site.path()}: its {names[path]} is concatenated the other way round along dim {dim} "
                    "(swap its two halves)",
                    dim=dim,
                )
    for path, _ in leaves:
        yield from _rescaled_input(site, work, path, names[path])


# an input named as a time: a factor of 1000 on it is a timestep given in other units
_TIMESTEP_NAME = re.compile(r"(^|_)(t|timesteps?|time|sigmas?|temb_t)$|timestep")


def _rescaled_input(site: Site, work: Any, path: str, name: str) -> Iterator[Edit]:
    r"""The input times a constant: a least-squares fit (exact for a module affine in it) snapped to a simple
    constant, then the simple constants themselves (for a module that is not: a timestep into sinusoids)."""
    zero = call_leaves(
        _input_edit(site, "rescale", name, _scaled_input(path, 0.0), "").apply(work), site.inputs()
    )
    plain = [(c, n) for c, n in simple_constants(site.sizes) if c not in (0.0, 1.0)]

    leaf = dict(flatten_tensors(site.inputs(), "input")).get(path)
    timestep_like = _TIMESTEP_NAME.search(name) is not None or (leaf is not None and leaf.ndim <= 1)

    def scaled(factor: float, label: str) -> Edit:
        words = (
            f"{site.path()}: with its {name} multiplied by {label} it matches the reference (a factor"
            f" {inverse(label, factor)} on it, or on what it meets inside the module, is the difference)"
        )
        if timestep_like and factor in (1000.0, 0.001):
            port_units = "t / 1000 (in [0, 1])" if factor == 1000.0 else "t × 1000 (in [0, 1000])"
            words = (
                f"{site.path()}: its {name} is a timestep in other units: the port computes with"
                f" {port_units} where the reference computes with t; multiplied by {label} it matches (fix"
                " where the port rescales it, or make both sides agree on the units)"
            )
        return _input_edit(
            site,
            "rescale",
            name,
            _scaled_input(path, factor),
            words,
            remake=lambda f: scaled(f, ""),
            factor=factor,
        )

    tried: set[float] = set()
    for scale, label in [*_fitted_scales(site, zero), *plain]:
        if scale not in tried:
            tried.add(scale)
            yield scaled(scale, label)


# ------------------------------------------------------------------------------------------------ outputs


def _output_edit(
    site: Site,
    kind: str,
    j: int,
    change: Callable[[Any, Tensors], Any],
    words: str,
    inputs: Tensors,
    chunks: int = 0,
    remake: Callable[[float], Edit] | None = None,
    **parameters: Any,
) -> Edit:
    r"""An edit of output leaf ``j``: ``change(tensor, inputs)`` gives the edited tensor (``inputs``: the
    site's input leaves by path, for the local check)."""
    return OutputEdit(
        tier="outputs",
        kind=kind,
        target=f"{site.path()} {site.got[j][0]}",
        parameters=parameters,
        words=words,
        cost=cost_of("outputs", kind, chunks),
        leaf=j,
        change=change,
        site_inputs=inputs,
        remake=remake,
    )


def _chunks_reordered(dim: int, count: int, order: tuple[int, ...]) -> Callable[[Any, Tensors], Any]:
    return lambda t, _: reorder(t, dim, count, order)


def _output_scaled(factor: float) -> Callable[[Any, Tensors], Any]:
    return lambda t, _: t * factor


def _input_added(a: float, b: float, path: str) -> Callable[[Any, Tensors], Any]:
    # the input where the output is: both on the model's device in a forward, the replayed output on the CPU
    return lambda t, lv: a * t + b * lv[path].to(t.device)


def output_edits(site: Site, work: Any) -> Iterator[Edit]:
    r"""Output edits on each differing output leaf, cheapest first: chunk reorders (fewest chunks first),
    rescales, then an input added back with a small coefficient."""
    import torch

    every = flatten_tensors(site.inputs(), "input")
    seen = dict(every)
    inputs = [(p, t) for p, t in every if t.is_floating_point()]
    names = _input_names(inputs, site.module)
    failing = [
        (i, j)
        for i, j in site.failing()
        if sorted(site.wanted[i][1].shape) == sorted(site.got[j][1].shape)
        and site.got[j][1].is_floating_point()
    ]
    reorders = [
        (count, j, dim)
        for _, j in failing
        for dim in range(1, site.got[j][1].ndim)
        for count in chunk_counts(site.got[j][1].shape[dim])
    ]
    for count, j, dim in sorted(reorders, key=lambda r: r[0]):
        got, path = site.got[j][1], site.got[j][0]
        for order in chunk_orders(count):
            halves = count == 2 and dim == got.ndim - 1
            words = (
                f"{site.path()}: swap the two halves of its {path} along the last dim (e.g. cos/sin or"
                " sin/cos order)"
                if halves
                else f"{site.path()}: {order_words(count, order)} of its {path} along dim {dim}"
            )
            yield _output_edit(
                site,
                "permute-chunks",
                j,
                _chunks_reordered(dim, count, order),
                words,
                seen,
                chunks=count,
                dim=dim,
                count=count,
                order=list(order),
            )
    for i, j in failing:
        w, g = site.wanted[i][1].double().flatten(), site.as_wanted(site.got)[j][1].double().flatten()
        den = float(g @ g)
        if den > 0:
            for scale, label in _with_snaps(float(w @ g) / den, site.sizes):
                yield _scaled_output(site, j, scale, label, seen)
    for i, j in failing:
        w, g = site.wanted[i][1].double().flatten(), site.as_wanted(site.got)[j][1].double().flatten()
        for in_path, x in inputs:
            if x.shape != site.got[j][1].shape:
                continue
            for a, b, label in _affine_fits(w, g, x.double().flatten().to(w.device), torch):
                yield _output_edit(
                    site,
                    "input-residual",
                    j,
                    _input_added(a, b, in_path),
                    _residual_words(site, site.got[j][0], names[in_path], a, b, label),
                    seen,
                    output_factor=a,
                    input_factor=b,
                    input=names[in_path],
                )


def _scaled_output(site: Site, j: int, factor: float, label: str, seen: Tensors) -> Edit:
    path = site.got[j][0]
    return _output_edit(
        site,
        "rescale",
        j,
        _output_scaled(factor),
        f"{site.path()}: its {path} is the reference's multiplied by {inverse(label, factor)}: multiply it by"
        f" {label}",
        seen,
        remake=lambda f: _scaled_output(site, j, f, "", seen),
        factor=factor,
    )


# the coefficients a residual edit may take: a residual's sign or count is wrong, never a fitted mixture
RESIDUAL_COEFFICIENTS = (1.0, -1.0, 2.0, -2.0, 0.5)


def _affine_fits(w: Any, g: Any, x: Any, torch: Any) -> list[tuple[float, float, str]]:
    r"""``(a, b)`` with ``w ≈ a * g + b * x`` (least squares), when both snap to small coefficients (``a``
    never
    0: the port's own output must stay in the answer). A fitted free mixture is not offered: two free numbers
    re-mix almost any linear module into the reference."""
    design = torch.stack([g, x], dim=1)
    try:
        sol = least_squares(design, w)
    except RuntimeError:
        return []
    a, b = float(sol[0]), float(sol[1])
    if not (math.isfinite(a) and math.isfinite(b)):
        return []
    near_a = [c for c in RESIDUAL_COEFFICIENTS if abs(a - c) <= 0.05 * abs(c)]
    near_b = [c for c in RESIDUAL_COEFFICIENTS if abs(b - c) <= 0.05 * abs(c)]
    return [(sa, sb, f"{format_value(sa)}, {format_value(sb)}") for sa in near_a for sb in near_b]


def _residual_words(site: Site, path: str, input_name: str, a: float, b: float, label: str) -> str:
    if abs(a + 1) < 1e-9 and abs(b - 2) < 1e-9:
        return (
            f"{site.path()}: its residual enters with the wrong sign: it returns {input_name} - f where the "
            f"reference returns {input_name} + f (reference {path} = 2 x {input_name} - port {path})"
        )
    if abs(a - 1) < 1e-9 and abs(b + 1) < 1e-9:
        return (
            f"{site.path()}: {input_name} is added to its {path} once too often (reference {path} = port "
            f"{path} - {input_name})"
        )
    if abs(a - 1) < 1e-9 and abs(b - 1) < 1e-9:
        return f"{site.path()}: its residual is missing: the reference adds {input_name} to {path}"
    return (
        f"{site.path()}: reference {path} = {format_value(a)} x port {path} + {format_value(b)} x"
        f" {input_name} (fitted: {label})"
    )
