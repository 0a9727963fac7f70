r"""The settings tier of the repair search: every readable setting of the site's module and its submodules
changed one at a time, cheapest first: a plain attribute the forward reads (:class:`AttributeEdit`), then a
constructor argument or ``config`` key with the module rebuilt and its weights reloaded
(:class:`ReplaceEdit`).
A module is varied only when a rebuild from the values read back reproduces it exactly."""

from __future__ import annotations

import copy
import functools
import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

from paritykit.base.report import format_value
from paritykit.bisection.evidence.culprit import NOT_SETTINGS
from paritykit.bisection.module_fit import constructor_values, literal_options, placed_like, rebuild
from paritykit.bisection.repair.edits import AttributeEdit, Edit, ReplaceEdit, cost_of
from paritykit.bisection.repair.site import Site, call_leaves

# numbers tried for a numeric setting, relative to its value
FACTORS = (2.0, 0.5, -1.0, 10.0, 0.1, 2**0.5, 2**-0.5)
# string settings whose other values are known by name: diffusers' activation_fn, transformers' hidden_act
ACTIVATIONS = ("gelu", "gelu-approximate", "geglu", "geglu-approximate", "silu", "swiglu", "relu", "mish")
HF_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "quick_gelu", "silu", "relu")
# a setting named like an activation: ``act_fn``, ``activation_fn``, ``hidden_act``, ``act`` (not ``factor``)
ACTIVATION_NAME = re.compile(r"(^|_)(act|activation)(_|$)")
# other string settings whose values are known
KNOWN_STRINGS = {
    "approximate": ("none", "tanh"),
    "padding_mode": ("zeros", "reflect", "replicate", "circular"),
    "mode": ("nearest", "nearest-exact", "linear", "bilinear", "bicubic"),
    "interpolation_mode": ("nearest", "nearest-exact", "linear", "bilinear", "bicubic"),
}
# keys of a transformers config that describe the checkpoint, not the computation
HF_NOT_SETTINGS = ("transformers_version", "architectures", "torch_dtype")

Variant = tuple[dict[str, Any], Callable[[], Any], str]


def setting_edits(site: Site, work: Any) -> Iterator[Edit]:
    r"""Every attribute edit of the module and its submodules, then every one-setting rebuild, then each
    string setting of the enclosing diffusers model tried over its values (the model rebuilt, its weights
    reloaded, and the module taken from it)."""
    modules = list(work.named_modules())
    for sub, module in modules:
        yield from _attribute_edits(site, sub, module)
    for sub, module in modules:
        variants = _variants(module)
        identity = next(variants, None)
        if identity is None or not _same_in_place(site, work, sub, identity[1]):
            continue
        for change, rebuilt, words in variants:
            yield _setting_edit(site, sub, change, rebuilt, words)
    yield from _ancestor_edits(site, work)


def _ancestor_edits(site: Site, work: Any) -> Iterator[Edit]:
    r"""The string settings of the model enclosing the site (``activation_fn``, a norm type, …): a module
    without a config of its own (a ``FeedForward``) is built from its model's, so that model is rebuilt with
    each other value and the site's module taken from it."""
    if site.ancestor is None or getattr(work, "config", None) is not None:
        return
    model, path, inner = site.ancestor
    config = getattr(model, "config", None)
    if not isinstance(config, dict) or not hasattr(type(model), "from_config"):
        return
    config = dict(config)

    def part(change: dict) -> Any:
        rebuilt = _from_config(model, {**config, **change})
        try:
            return rebuilt.get_submodule(inner) if rebuilt is not None else None
        except AttributeError:
            return None

    identity = functools.partial(part, {})
    if not _same_in_place(site, work, "", identity):
        return
    where = path or "(top level)"
    for key, value in config.items():
        if key.startswith("_") or not isinstance(value, str):
            continue
        for new in _values_for(model, key, value):
            target = f"{where} config {key}"
            yield ReplaceEdit(
                tier="settings",
                kind="model-setting",
                target=target,
                parameters={"key": key, "value": new, "was": value},
                words=(
                    f"{where}: {type(model).__name__}({key}={format_value(new)}) (now {format_value(value)});"
                    f" {site.path()} is built from it"
                ),
                cost=cost_of("settings", "setting"),
                sub="",
                build=functools.partial(part, {key: new}),
            )


def _attribute_edits(site: Site, sub: str, module: Any) -> Iterator[Edit]:
    r"""One plain attribute of the module set to another value, on the working copy (the forward reads it)."""
    for attr, value in list(vars(module).items()):
        if attr.startswith("_") or attr in NOT_SETTINGS or not isinstance(value, (bool, int, float, str)):
            continue
        for new in _values_for(module, attr, value):
            target = site.path(f"{sub}.{attr}" if sub else attr)
            yield AttributeEdit(
                tier="settings",
                kind="attribute",
                target=target,
                parameters={"value": new, "was": value},
                words=f"{target} = {format_value(new)} (now {format_value(value)})",
                cost=cost_of("settings", "attribute"),
                sub=sub,
                attr=attr,
                new=new,
                old=value,
            )


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
    return ReplaceEdit(
        tier="settings",
        kind="setting",
        target=target,
        parameters={k: list(v) if isinstance(v, tuple) else v for k, v in change.items()},
        words=f"{shown} ({words})",
        cost=cost_of("settings", "setting"),
        sub=sub,
        build=rebuilt,
    )


def _string_options(module: Any, name: str, value: str) -> list[str]:
    options = literal_options(module, name) or list(KNOWN_STRINGS.get(name, ()))
    if not options and ACTIVATION_NAME.search(name.lower()):
        options = list(HF_ACTIVATIONS if "_" in value or "hidden_act" in name else ACTIVATIONS)
    return [o for o in options if o != value]


def _values_for(module: Any, name: str, value: Any) -> list[Any]:
    r"""The other values tried for setting ``name`` of ``module``: a boolean flipped, a string's known
    alternatives, a number scaled by :data:`FACTORS` (and every power of ten for an epsilon-like float), a
    short tuple's other orders."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, str):
        return _string_options(module, name, value)
    if isinstance(value, (int, float)):
        out = [float(f"{value * f:.6g}") for f in FACTORS] + [0, 1]
        if isinstance(value, float) and 0 < value < 1:
            # a small positive float is usually an epsilon: every power of ten it could have been written as
            out += [10.0**-k for k in range(1, 13)]
        if isinstance(value, int):
            # an integer above 1 is a count or a size: 0 is no port's slip, and a 0 head count or head
            # dimension divides by zero inside torch's C++ (the process dies, no exception to catch)
            out = [int(v) for v in out if float(v).is_integer() and (v != 0 or value <= 1)]
        return [v for v in dict.fromkeys(out) if v != value]
    if isinstance(value, (tuple, list)) and 1 < len(value) <= 4 and len(set(map(repr, value))) == len(value):
        return [type(value)(p) for p in itertools.permutations(value) if list(p) != list(value)]
    return []


def _variants(module: Any) -> Iterator[Variant]:
    r"""``(change, build, words)`` for each one-setting change of ``module`` that can be rebuilt faithfully,
    the identity (no change) first."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(type(module), "from_config") and isinstance(config, dict):
        yield from _config_variants(module, dict(config), "diffusers config")
        return
    if config is not None and hasattr(config, "to_dict"):
        yield from _hf_variants(module, config)
        return
    read = constructor_values(module, tuples=True)
    if read is None:
        return
    values, readable = read
    identity = functools.partial(rebuild, module, values)
    if not readable or not _reproduces(module, identity):
        return
    yield {}, identity, "identity"
    for name in readable:
        for value in _values_for(module, name, values[name]):
            yield (
                {name: value},
                functools.partial(rebuild, module, {**values, name: value}),
                "constructor argument",
            )


def _from_config(module: Any, config: dict) -> Any:
    try:
        new = type(module).from_config(config)
    except Exception:
        return None
    return _reload(module, new)


def _config_variants(module: Any, config: dict, words: str) -> Iterator[Variant]:
    identity = functools.partial(_from_config, module, config)
    if not _reproduces(module, identity):
        return
    yield {}, identity, "identity"
    for key, value in config.items():
        if key.startswith("_"):
            continue
        for new in _values_for(module, key, value):
            yield {key: new}, functools.partial(_from_config, module, {**config, key: new}), words


def _from_hf_config(module: Any, config: Any, change: dict) -> Any:
    cfg = copy.deepcopy(config)
    for k, v in change.items():
        setattr(cfg, k, v)
    try:
        new = type(module)(cfg)
    except Exception:
        return None
    return _reload(module, new)


def _hf_variants(module: Any, config: Any) -> Iterator[Variant]:
    identity = functools.partial(_from_hf_config, module, config, {})
    if not _reproduces(module, identity):
        return
    yield {}, identity, "identity"
    for key, value in sorted(config.to_dict().items()):
        if key.startswith("_") or key in HF_NOT_SETTINGS:
            continue
        for new in _values_for(module, key, value):
            yield (
                {key: new},
                functools.partial(_from_hf_config, module, config, {key: new}),
                "transformers config",
            )


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
