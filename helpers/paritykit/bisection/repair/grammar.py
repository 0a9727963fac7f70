r"""The grammar of candidate edits at a site, one generator per tier, cheapest first.

* **parameters** — swap two same-shape parameters of sibling modules (with their biases), transpose a
  square weight, negate, flip a kernel's spatial dims, reorder equal chunks of a weight along dim 0 or 1 (its
  bias with it along dim 0), exp / log / reciprocal of a parameter, rescale by a fitted scalar;
* **inputs** — swap two same-shape inputs, swap two equal-size dims, swap the halves along dim 1 or the last
  dim (a concatenated input), rescale by a fitted or simple constant;
* **outputs** — reorder equal chunks along a dim (sin/cos halves), rescale by a fitted scalar, and
  ``a * output + b * input`` (a residual added with the wrong sign or twice);
* **settings** — every readable constructor argument of the module and its submodules (booleans, ``Literal``
  strings, numbers, tuple orders) and every key of a ``config`` the module was built from.

Every edit acts on the site's working copy and undoes itself; none is reported unless the engine verifies it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

from paritykit.base.report import format_value
from paritykit.bisection.evidence.culprit import NOT_SETTINGS
from paritykit.bisection.leaves import flatten_tensors, rebuild_leaves, torch_equal
from paritykit.bisection.module_fit import constructor_values, literal_options, placed_like, rebuild
from paritykit.bisection.repair.edits import (
    Edit,
    chunk_counts,
    chunk_orders,
    inverse,
    order_words,
    reorder,
    simple_constants,
    snapped,
)
from paritykit.bisection.repair.site import Site, call_leaves

# numbers tried for a numeric setting: relative to its value, and absolute
_FACTORS = (2.0, 0.5, -1.0, 10.0, 0.1, 2**0.5, 2**-0.5)


def _wrapped(inner: Any, before: Callable | None = None, after: Callable | None = None) -> Any:
    r"""``inner`` seen through an input edit (``before(args, kwargs)``) and/or an output edit (``after(out)``)."""
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


# --------------------------------------------------------------------------------------------- parameters


def _set_params(work: Any, values: dict[str, Any]) -> Callable[[], None]:
    r"""Put ``values`` (name -> tensor) into ``work``'s parameters; the returned function restores them."""
    saved = {}
    for name, value in values.items():
        param = work.get_parameter(name)
        saved[name] = param.data
        param.data = value.to(dtype=param.dtype, device=param.device)

    def undo() -> None:
        for name, data in saved.items():
            work.get_parameter(name).data = data

    return undo


def _param_edit(
    site: Site,
    kind: str,
    target: str,
    values: Callable[[Any], dict],
    words: str,
    cost: int,
    tier: str = "parameters",
    **parameters: Any,
) -> Edit:
    edit = Edit(tier, kind, site.path(target), parameters, words, cost)
    state: dict[str, Callable] = {}

    def apply(work: Any) -> Any:
        state["undo"] = _set_params(work, values(work))
        return work

    def undo() -> None:
        if "undo" in state:
            state.pop("undo")()

    edit.apply, edit.undo = apply, undo
    return edit


def _bias_of(params: dict[str, Any], name: str) -> str | None:
    owner, _, leaf = name.rpartition(".")
    if leaf != "weight":
        return None
    bias = f"{owner}.bias" if owner else "bias"
    return bias if bias in params else None


def _swaps(site: Site, params: dict[str, Any]) -> Iterator[Edit]:
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
        swap = _param_edit(
            site,
            "swap-parameters",
            oa,
            lambda w, pairs=pairs: {x: params[y] for p in pairs for x, y in (p, p[::-1])},
            f"{site.path(oa)} and {site.path(ob)}: swap their"
            f" weights{' and biases' if len(pairs) > 1 else ''} (each holds the other's: fix the conversion"
            f" of {oa} and {ob})",
            0,
            parameters=[list(p) for p in pairs],
        )
        swap.target = f"{site.path(oa)} <-> {site.path(ob)}"
        yield swap


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


def _said(site: Site, tier: str, name: str, change: str, conversion: str) -> str:
    r"""The sentence for a parameter edit: a conversion to fix, or (tier ``uses``) a use of right values."""
    if tier != "uses":
        return f"{site.path(name)}: {change} ({conversion})"
    source = site.held.get(name, "the aligned reference module's")
    return (
        f"{site.path(name)} holds exactly the reference's values ({source}), yet the port matches only after"
        f" this edit: {change}; its forward uses the parameter differently from the reference: fix that use,"
        " not the weights"
    )


def _edits_of(
    site: Site, work: Any, params: dict[str, Any], chosen: dict[str, Any], tier: str
) -> Iterator[Edit]:
    import torch

    def edit(
        kind: str, name: str, values: Callable, change: str, conversion: str, cost: int, **extra: Any
    ) -> Edit:
        return _param_edit(
            site, kind, name, values, _said(site, tier, name, change, conversion), cost, tier, **extra
        )

    for name, p in chosen.items():
        if p.ndim >= 2 and p.shape[0] == p.shape[1]:
            yield edit(
                "transpose",
                name,
                lambda w, n=name, p=p: {n: p.transpose(0, 1).contiguous()},
                "transpose it (dims 0 and 1)",
                "the conversion transposed it, or should have",
                1,
            )
        yield edit("negate", name, lambda w, n=name, p=p: {n: -p}, "negate it", "its sign is flipped", 1)
        for dims in _spatial_flips(p):
            yield edit(
                "flip",
                name,
                lambda w, n=name, p=p, d=dims: {n: p.flip(d)},
                f"flip it along dim{'s' if len(dims) > 1 else ''} {', '.join(map(str, dims))}",
                "its kernel is flipped: convolution vs correlation order",
                2,
                dims=list(dims),
            )
    for name, p in chosen.items():
        bias = _bias_of(params, name)
        for dim in range(min(p.ndim, 2)):
            for count in chunk_counts(p.shape[dim]):
                for order in chunk_orders(count):
                    values = {name: reorder(p, dim, count, order)}
                    with_bias = dim == 0 and bias is not None and params[bias].shape[0] == p.shape[0]
                    if with_bias:
                        values[bias] = reorder(params[bias], 0, count, order)
                    what = "its weight and bias" if with_bias else "it"
                    yield edit(
                        "permute-chunks",
                        name,
                        lambda w, v=values: v,
                        f"{order_words(count, order)} of {what} along dim {dim}",
                        "the conversion put the chunks in another order",
                        3 + count,
                        dim=dim,
                        count=count,
                        order=list(order),
                        bias=bool(with_bias),
                    )
    for name, p in chosen.items():
        if p.numel() < 1:
            continue
        yield edit(
            "exp",
            name,
            lambda w, n=name, p=p: {n: p.exp()},
            "replace it by exp() of it",
            "the checkpoint stores its logarithm: load exp() of it",
            12,
        )
        if bool((p > 0).all()):
            yield edit(
                "log",
                name,
                lambda w, n=name, p=p: {n: p.log()},
                "replace it by log() of it",
                "the port expects its logarithm: load log() of it",
                12,
            )
        if bool((p != 0).all()):
            yield edit(
                "reciprocal",
                name,
                lambda w, n=name, p=p: {n: p.reciprocal()},
                "replace it by 1/it",
                "the checkpoint stores the inverse: load 1/it",
                12,
            )
    for name in chosen:
        bias = _bias_of(params, name)
        names = [name] + ([bias] if bias is not None else [])
        undo = _set_params(work, {n: torch.zeros_like(params[n]) for n in names})
        try:
            zero = call_leaves(work, site.inputs())
        finally:
            undo()
        target = name.rpartition(".")[0] if bias is not None else name
        what = "its weight and bias" if bias is not None else "it"

        def scaled(
            factor: float, label: str, names: list = names, target: str = target, what: str = what
        ) -> Edit:
            return edit(
                "rescale",
                target,
                lambda w: {n: params[n] * factor for n in names},
                f"multiply {what} by {label}",
                f"load {what} multiplied by {label}",
                14,
                factor=factor,
            )

        for scale, label in _fitted_scales(site, zero):
            yield _controlled(
                scaled(scale, label), lambda s=scale, f=scaled: [f(s * 1.5, ""), f(s / 1.5, "")]
            )


def _controlled(edit: Edit, controls: Callable[[], list[Edit]]) -> Edit:
    edit.controls = controls
    return edit


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
    change: Callable[[dict], dict],
    words: str,
    cost: int,
    **parameters: Any,
) -> Edit:
    r"""An edit of the site's inputs: ``change(leaves)`` maps ``{path: tensor}`` to the replaced ones."""

    def before(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        leaves = dict(flatten_tensors((args, kwargs), "input"))
        new_args, new_kwargs = rebuild_leaves((args, kwargs), change(leaves), "input")
        return tuple(new_args), dict(new_kwargs)

    edit = Edit("inputs", kind, f"{site.path()} {target}", parameters, words, cost)
    edit.apply = lambda work: _wrapped(work, before=before)
    return edit


def _input_names(leaves: list[tuple[str, Any]]) -> dict[str, str]:
    r"""How a porter names each input leaf: ``input hidden_states`` for a keyword, ``input 0`` for a position."""
    # paths are input.0.<position> for positional arguments, input.1.<keyword> for keywords
    return {path: "input " + ".".join(path.split(".")[2:]) for path, _ in leaves}


def input_edits(site: Site, work: Any) -> Iterator[Edit]:
    r"""Input edits, cheapest first."""
    leaves = [(p, t) for p, t in flatten_tensors(site.inputs(), "input") if t.is_floating_point()]
    names = _input_names(leaves)
    for (pa, ta), (pb, tb) in itertools.combinations(leaves, 2):
        if ta.shape == tb.shape and not bool((ta == tb).all()):
            yield _input_edit(
                site,
                "swap-inputs",
                f"{names[pa]} <-> {names[pb]}",
                lambda lv, pa=pa, pb=pb: {pa: lv[pb], pb: lv[pa]},
                f"{site.path()}: its {names[pa]} and {names[pb]} are swapped (pass each where the other"
                " goes)",
                0,
                inputs=[names[pa], names[pb]],
            )
    for path, t in leaves:
        sizes = list(t.shape)
        for a, b in itertools.combinations(range(1, t.ndim), 2):
            if sizes[a] == sizes[b] and sizes[a] > 1:
                yield _input_edit(
                    site,
                    "swap-dims",
                    names[path],
                    lambda lv, p=path, a=a, b=b: {p: lv[p].transpose(a, b)},
                    f"{site.path()}: its {names[path]} comes with dims {a} and {b} swapped (transpose it)",
                    1,
                    dims=[a, b],
                )
        for dim in sorted({1, t.ndim - 1}):
            if t.ndim > dim >= 1 and sizes[dim] % 2 == 0 and sizes[dim] > 1:
                yield _input_edit(
                    site,
                    "swap-halves",
                    names[path],
                    lambda lv, p=path, d=dim: {p: reorder(lv[p], d, 2, (1, 0))},
                    f"{site.path()}: its {names[path]} is concatenated the other way round along dim {dim} "
                    "(swap its two halves)",
                    2,
                    dim=dim,
                )
    for path, t in leaves:
        yield from _rescaled_input(site, work, path, t, names[path])


def _rescaled_input(site: Site, work: Any, path: str, t: Any, name: str) -> Iterator[Edit]:
    r"""The input times a constant: a least-squares fit (exact for a module affine in it) snapped to a simple
    constant, then the simple constants themselves (for a module that is not: a timestep into sinusoids)."""
    zero_edit = _input_edit(site, "rescale", name, lambda lv: {path: lv[path] * 0}, "", 0)
    zero = call_leaves(zero_edit.apply(work), site.inputs())
    tried: set[float] = set()
    fitted = _fitted_scales(site, zero)
    plain = [(c, n) for c, n in simple_constants(site.sizes) if c not in (0.0, 1.0)]

    def scaled(factor: float, label: str) -> Edit:
        return _input_edit(
            site,
            "rescale",
            name,
            lambda lv: {path: lv[path] * factor},
            f"{site.path()}: its {name} is the reference's multiplied by {inverse(label, factor)}: multiply"
            f" it by {label} (fix where it is computed, or the scale the reference applies)",
            10,
            factor=factor,
        )

    for scale, label in [*fitted, *plain]:
        if scale in tried:
            continue
        tried.add(scale)
        yield _controlled(scaled(scale, label), lambda s=scale: [scaled(s * 1.5, ""), scaled(s / 1.5, "")])


# ------------------------------------------------------------------------------------------------ outputs


def _output_edit(
    site: Site,
    kind: str,
    j: int,
    change: Callable[[Any, dict], Any],
    words: str,
    cost: int,
    inputs: dict,
    **parameters: Any,
) -> Edit:
    r"""An edit of output leaf ``j``: ``change(tensor, inputs)`` gives the edited tensor (``inputs``: the site's
    input leaves by path, for the local check)."""
    path = site.got[j][0]

    def after_leaves(leaves: list, seen: dict) -> list:
        return [(p, change(t, seen) if k == j else t) for k, (p, t) in enumerate(leaves)]

    edit = Edit("outputs", kind, f"{site.path()} {path}", parameters, words, cost)
    edit.on_outputs = lambda leaves: after_leaves(leaves, inputs)

    def apply(work: Any) -> Any:
        seen: dict[str, Any] = {}

        def before(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            seen["inputs"] = dict(flatten_tensors((args, kwargs), "input"))
            return args, kwargs

        def after(out: Any) -> Any:
            leaves = flatten_tensors(out)
            edited = dict(after_leaves(leaves, seen.get("inputs", {})))
            return rebuild_leaves(out, edited, "output")

        return _wrapped(work, before=before, after=after)

    edit.apply = apply
    return edit


def output_edits(site: Site, work: Any) -> Iterator[Edit]:
    r"""Output edits on each differing output leaf, cheapest first."""
    import torch

    every = flatten_tensors(site.inputs(), "input")
    seen = dict(every)
    inputs = [(p, t) for p, t in every if t.is_floating_point()]
    names = _input_names(inputs)
    for i, j in site.failing():
        want, got = site.wanted[i][1], site.got[j][1]
        if sorted(want.shape) != sorted(got.shape) or not got.is_floating_point():
            continue
        path = site.got[j][0]
        for dim in range(1, got.ndim):
            for count in chunk_counts(got.shape[dim]):
                for order in chunk_orders(count):
                    halves = count == 2 and dim == got.ndim - 1
                    words = (
                        f"{site.path()}: swap the two halves of its {path} along the last dim (e.g. cos/sin"
                        " or sin/cos order)"
                        if halves
                        else f"{site.path()}: {order_words(count, order)} of its {path} along dim {dim}"
                    )
                    yield _output_edit(
                        site,
                        "permute-chunks",
                        j,
                        lambda t, _, d=dim, c=count, o=order: reorder(t, d, c, o),
                        words,
                        count,
                        seen,
                        dim=dim,
                        count=count,
                        order=list(order),
                    )
        w, g = want.double().flatten(), site.as_wanted(site.got)[j][1].double().flatten()
        den = float(g @ g)
        if den > 0:
            for scale, label in _with_snaps(float(w @ g) / den, site.sizes):

                def scaled(factor: float, label: str = label, j: int = j, path: str = path) -> Edit:
                    return _output_edit(
                        site,
                        "rescale",
                        j,
                        lambda t, _: t * factor,
                        f"{site.path()}: its {path} is the reference's multiplied by"
                        f" {inverse(label, factor)}: multiply it by {label}",
                        10,
                        seen,
                        factor=factor,
                    )

                yield _controlled(scaled(scale), lambda s=scale, f=scaled: [f(s * 1.5), f(s / 1.5)])
        for in_path, x in inputs:
            if x.shape != got.shape:
                continue
            for a, b, label in _affine_fits(w, g, x.double().flatten().to(w.device), site.sizes, torch):
                yield _output_edit(
                    site,
                    "input-residual",
                    j,
                    lambda t, lv, a=a, b=b, p=in_path: a * t + b * lv[p],
                    _residual_words(site, path, names[in_path], a, b, label),
                    11,
                    seen,
                    output_factor=a,
                    input_factor=b,
                    input=names[in_path],
                )


# the coefficients a residual edit may take: a residual's sign or count is wrong, never a fitted mixture
_RESIDUAL_COEFFICIENTS = (1.0, -1.0, 2.0, -2.0, 0.5)


def _affine_fits(
    w: Any, g: Any, x: Any, sizes: tuple[int, ...], torch: Any
) -> list[tuple[float, float, str]]:
    r"""``(a, b)`` with ``w ≈ a * g + b * x`` (least squares), when both snap to small coefficients (``a`` never
    0: the port's own output must stay in the answer). A fitted free mixture is not offered: two free numbers
    re-mix almost any linear module into the reference."""
    design = torch.stack([g, x], dim=1)
    try:
        sol = torch.linalg.lstsq(design, w.unsqueeze(1)).solution.flatten()
    except RuntimeError:
        return []
    a, b = float(sol[0]), float(sol[1])
    if not (math.isfinite(a) and math.isfinite(b)):
        return []
    near_a = [c for c in _RESIDUAL_COEFFICIENTS if abs(a - c) <= 0.05 * abs(c)]
    near_b = [c for c in _RESIDUAL_COEFFICIENTS if abs(b - c) <= 0.05 * abs(c)]
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
        f"{site.path()}: reference {path} = {format_value(a)} x port {path} + {format_value(b)} x {input_name} "
        f"(fitted: {label})"
    )


# ----------------------------------------------------------------------------------------------- settings


def setting_edits(site: Site, work: Any) -> Iterator[Edit]:
    r"""One constructor argument or ``config`` key changed, for the module and each of its submodules, the
    weights reloaded; the module is rebuilt from its current values first, and only a rebuild that
    reproduces it is varied."""
    for sub, module in list(work.named_modules()):
        yield from _attribute_edits(site, sub, module)
        variants = _variants(module)
        identity = next(variants, None)
        if identity is None or not _same_in_place(site, work, sub, identity[1]):
            continue
        for change, rebuilt, words in variants:
            yield _setting_edit(site, sub, change, rebuilt, words)


def _attribute_edits(site: Site, sub: str, module: Any) -> Iterator[Edit]:
    r"""One plain attribute of the module set to another value, on the working copy (the forward reads it)."""
    for attr, value in list(vars(module).items()):
        if attr.startswith("_") or attr in NOT_SETTINGS or not isinstance(value, (bool, int, float, str)):
            continue
        for new in _values_for(module, attr, value):
            target = site.path(f"{sub}.{attr}" if sub else attr)
            edit = Edit(
                "settings",
                "attribute",
                target,
                {"value": new, "was": value},
                f"{target} = {format_value(new)} (now {format_value(value)})",
                19,
            )

            edit.apply, edit.undo = _attribute_setter(sub, attr, new, value)
            yield edit


def _attribute_setter(
    sub: str, attr: str, new: Any, old: Any
) -> tuple[Callable[[Any], Any], Callable[[], None]]:
    r"""``apply(work)`` setting ``attr`` of the submodule ``sub`` of the working copy, and its ``undo``."""
    owners: list[Any] = []

    def apply(work: Any) -> Any:
        owners.append(work.get_submodule(sub) if sub else work)
        setattr(owners[-1], attr, new)
        return work

    def undo() -> None:
        while owners:
            setattr(owners.pop(), attr, old)

    return apply, undo


def _same_in_place(site: Site, work: Any, sub: str, rebuilt: Callable[[], Any]) -> bool:
    r"""Whether the module at ``sub``, rebuilt from the values read back, gives the site exactly its outputs
    (so a changed setting is the only change a variant makes)."""
    edit = _setting_edit(site, sub, {}, rebuilt, "")
    try:
        out = call_leaves(edit.apply(work), site.inputs())
    except ValueError:
        return False
    finally:
        edit.undo()
    return (
        out is not None
        and len(out) == len(site.got)
        and all(a.shape == b.shape and bool((a == b).all()) for (_, a), (_, b) in zip(out, site.got))
    )


def _setting_edit(site: Site, sub: str, change: dict, rebuilt: Callable[[], Any], words: str) -> Edit:
    target = site.path(sub)
    shown = "; ".join(f"{target}.{k} = {format_value(v)}" for k, v in change.items())
    edit = Edit(
        "settings", "setting", target, {k: _jsonable(v) for k, v in change.items()}, f"{shown} ({words})", 20
    )
    state: dict[str, Any] = {}

    def apply(work: Any) -> Any:
        new = rebuilt()
        if new is None:
            raise ValueError("the class rejects this setting")
        if not sub:
            return new
        parent_name, _, leaf = sub.rpartition(".")
        parent = work.get_submodule(parent_name) if parent_name else work
        state["undo"] = (parent, leaf, getattr(parent, leaf))
        setattr(parent, leaf, new)
        return work

    def undo() -> None:
        if "undo" in state:
            parent, leaf, old = state.pop("undo")
            setattr(parent, leaf, old)

    edit.apply, edit.undo = apply, undo
    return edit


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# string settings whose other values are known by name
_ACTIVATIONS = ("gelu", "gelu-approximate", "geglu", "geglu-approximate", "silu", "swiglu", "relu", "mish")
_HF_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu", "silu", "relu")


# other string settings whose values are known
_KNOWN_STRINGS = {
    "approximate": ("none", "tanh"),
    "padding_mode": ("zeros", "reflect", "replicate", "circular"),
    "mode": ("nearest", "nearest-exact", "linear", "bilinear", "bicubic"),
    "interpolation_mode": ("nearest", "nearest-exact", "linear", "bilinear", "bicubic"),
}


def _string_options(module: Any, name: str, value: str) -> list[str]:
    options = literal_options(module, name) or list(_KNOWN_STRINGS.get(name, ()))
    if not options and "act" in name.lower():
        options = list(_HF_ACTIVATIONS if "_" in value or "hidden_act" in name else _ACTIVATIONS)
    return [o for o in options if o != value]


def _values_for(module: Any, name: str, value: Any) -> list[Any]:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, str):
        return _string_options(module, name, value)
    if isinstance(value, (int, float)):
        out = [float(f"{value * f:.6g}") for f in _FACTORS] + [0, 1]
        if isinstance(value, float) and 0 < value < 1:
            # a small positive float is usually an epsilon: every power of ten it could have been written as
            out += [10.0**-k for k in range(1, 13)]
        if isinstance(value, int):
            out = [int(v) for v in out if float(v).is_integer()]
        return [v for v in dict.fromkeys(out) if v != value]
    if isinstance(value, (tuple, list)) and 1 < len(value) <= 4 and len(set(map(repr, value))) == len(value):
        return [type(value)(p) for p in itertools.permutations(value) if list(p) != list(value)]
    return []


def _variants(module: Any) -> Iterator[tuple[dict, Callable[[], Any], str]]:
    r"""``(change, build, words)`` for each one-setting change of ``module`` that can be rebuilt faithfully."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(type(module), "from_config") and isinstance(config, dict):
        yield from _config_variants(module, dict(config), "diffusers config")
        return
    if config is not None and hasattr(config, "to_dict") and hasattr(config, "__class__"):
        yield from _hf_variants(module, config)
        return
    read = constructor_values(module, tuples=True)
    if read is None:
        return
    values, readable = read
    if not readable or not _reproduces(module, lambda: rebuild(module, values)):
        return
    yield {}, (lambda: rebuild(module, values)), "identity"
    for name in readable:
        for value in _values_for(module, name, values[name]):
            yield (
                {name: value},
                (lambda v={**values, name: value}: rebuild(module, v)),
                "constructor argument",
            )


def _config_variants(module: Any, config: dict, words: str) -> Iterator[tuple[dict, Callable[[], Any], str]]:
    def build(cfg: dict) -> Any:
        try:
            new = type(module).from_config(cfg)
        except Exception:
            return None
        return _reload(module, new)

    if not _reproduces(module, lambda: build(config)):
        return
    yield {}, (lambda: build(config)), "identity"
    for key, value in config.items():
        if key.startswith("_"):
            continue
        for new in _values_for(module, key, value):
            yield {key: new}, (lambda c={**config, key: new}: build(c)), words


def _hf_variants(module: Any, config: Any) -> Iterator[tuple[dict, Callable[[], Any], str]]:
    import copy

    def build(change: dict) -> Any:
        cfg = copy.deepcopy(config)
        for k, v in change.items():
            setattr(cfg, k, v)
        try:
            new = type(module)(cfg)
        except Exception:
            return None
        return _reload(module, new)

    if not _reproduces(module, lambda: build({})):
        return
    yield {}, (lambda: build({})), "identity"
    for key, value in sorted(config.to_dict().items()):
        if key.startswith("_") or key in ("transformers_version", "architectures", "torch_dtype"):
            continue
        for new in _values_for(module, key, value):
            yield {key: new}, (lambda c={key: new}: build(c)), "transformers config"


def _reload(old: Any, new: Any) -> Any | None:
    r"""``new`` with ``old``'s weights; layers the setting adds or drops are allowed, shapes must agree."""
    state = old.state_dict()
    mine = new.state_dict()
    if any(k in mine and mine[k].shape != v.shape for k, v in state.items()):
        return None
    new.load_state_dict({k: v for k, v in state.items() if k in mine}, strict=False)
    return placed_like(old, new)


def _reproduces(module: Any, build: Callable[[], Any]) -> bool:
    r"""Whether a rebuild from the values read back has the same weights, buffers and module structure."""
    import torch

    new = build()
    if new is None or type(new) is not type(module):
        return False
    a, b = module.state_dict(), new.state_dict()
    if a.keys() != b.keys() or [type(m) for m in module.modules()] != [type(m) for m in new.modules()]:
        return False
    return all(a[k].shape == b[k].shape and torch.equal(a[k].cpu(), b[k].cpu()) for k in a)
