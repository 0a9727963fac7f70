r"""The defaults a diffusers class assumes for config keys, read from its ``__init__`` signature.

A diffusers model or scheduler stores its config as the arguments of ``__init__``; a key a config file never
wrote takes the signature's default. This module finds the class (``_class_name`` in the config, a pipeline
component's class, or a name the user gives) and returns those defaults, so a config diff can show assumed
values and tell a port's untouched defaults apart from choices.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from paritykit.base.errors import ParityKitError

_NO_DEFAULT = inspect.Parameter.empty


def resolve_class(name: str, *, option: str = "--class") -> type:
    r"""Find a config class by name.

    Args:
        name: a diffusers class name (``DDIMScheduler``) or a dotted import path (``my_pkg.models.MyUNet``,
            ``my_pkg.models:MyUNet``).
        option: how the name was given, for the error message.

    Returns:
        The class. Raises :class:`ParityKitError` (one line naming ``option``) when it cannot be found.
    """
    module_name, _, attr = name.replace(":", ".").rpartition(".")
    try:
        if module_name:
            found = getattr(importlib.import_module(module_name), attr, None)
        else:
            import diffusers

            found = getattr(diffusers, attr, None)
    except Exception as exc:  # importing user code can fail any way; the user still gets one line
        raise ParityKitError(f"{option} {name}: cannot import it ({type(exc).__name__}: {exc})") from None
    if not isinstance(found, type):
        raise ParityKitError(f"{option} {name}: not a diffusers class (nor an importable module.Class)")
    return found


def init_defaults(cls: type) -> dict[str, Any]:
    r"""The keyword defaults of ``cls.__init__`` that a JSON config could hold (others are left out).

    Args:
        cls: a class whose config keys are its ``__init__`` arguments (every diffusers ``ConfigMixin``).

    Returns:
        ``{argument: default}``; tuples become lists so they compare and print like a saved config.
    """
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return {}
    defaults = {}
    for parameter in parameters:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.name == "self":
            continue
        if parameter.default is not _NO_DEFAULT and _json_like(parameter.default):
            defaults[parameter.name] = _as_config_value(parameter.default)
    return defaults


def _json_like(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_like(item) for item in value)
    # a non-empty dict default would flatten into sub-keys a saved config spells differently: leave it out
    return isinstance(value, Mapping) and not value


def _as_config_value(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_as_config_value(item) for item in value]
    return dict(value) if isinstance(value, Mapping) else value


def config_class_names(config: Mapping[str, Any], override: str | None = None) -> dict[str, str]:
    r"""Which class each part of a (nested) config belongs to, as ``{dotted prefix: class name}``.

    The top level (prefix ``""``) is ``override`` or the config's ``_class_name``; in a pipeline config each
    diffusers component (``["diffusers", "DDIMScheduler"]`` in ``model_index.json``, read as ``_library`` and
    ``_class``) gets its own prefix. Components from other libraries are left out: their configs are not
    ``__init__`` arguments."""
    classes: dict[str, str] = {}
    top = override or config.get("_class_name")
    if isinstance(top, str) and top:
        classes[""] = top
    for name, value in config.items():
        if not isinstance(value, Mapping):
            continue
        library = value.get("_library", "diffusers")
        component = value.get("_class_name") or value.get("_class")
        if isinstance(component, str) and component and library == "diffusers":
            classes[name] = component
    return classes


def flat_defaults(
    config: Mapping[str, Any], override: str | None = None, *, strict: bool = False
) -> dict[str, Any]:
    r"""Class defaults for every part of ``config``, keyed by dotted path like
    :func:`paritykit.forensics.configs.flatten`.

    Args:
        config: a loaded (nested) config.
        override: a class name to use for the top level instead of ``_class_name`` (``--class``).
        strict: raise when a class cannot be found (the user named it); otherwise such a part has no defaults.

    Returns:
        ``{"timestep_spacing": "leading", …}`` or, for a pipeline, ``{"scheduler.timestep_spacing": …}``.
    """
    defaults: dict[str, Any] = {}
    for prefix, name in config_class_names(config, override).items():
        try:
            cls = resolve_class(name)
        except ParityKitError:
            if strict and prefix == "" and override:
                raise
            continue
        for key, value in init_defaults(cls).items():
            defaults[f"{prefix}.{key}" if prefix else key] = value
    return defaults
