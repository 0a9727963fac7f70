r"""Find the constructor setting of a configurable module that makes it produce a wanted tensor.

Research code often computes inline what a port delegates to a library module (a sinusoidal timestep
embedding, a positional add). When the port's module is configured differently from what the reference
computes (``flip_sin_to_cos``, a frequency shift, a scale), nothing is aligned with it, so bisect can only say
"this parent's own forward differs". :func:`fit_module` searches the module's constructor arguments, bounded
and read from its signature and its current attribute values, for a setting whose output on the captured
input reproduces the tensor the reference fed onward.

The search is honest by construction: the module is first rebuilt with its *current* values, and the search
goes on only when that rebuild reproduces the module's own output exactly (so the values read back are the
ones it was built with); each candidate changes one or two arguments and keeps the module's weights.
"""

from __future__ import annotations

import inspect
import itertools
import typing
from dataclasses import dataclass, field
from typing import Any

# a bounded search: at most this many candidate settings are built and run
MAX_TRIALS = 64
_SCALARS = (bool, int, float, str)


@dataclass
class ModuleFit:
    r"""A constructor setting that reproduces the wanted tensor.

    ``changes`` maps each argument to ``(current, fitted)``; ``before`` / ``after`` are the max abs errors of
    the current and the fitted module against the wanted tensor; ``trials`` counts the settings tried.
    """

    module_type: str
    changes: dict[str, tuple[Any, Any]]
    before: float
    after: float
    trials: int
    fitted: Any = field(default=None, repr=False)

    def fix(self, path: str) -> str:
        """One line: the attribute assignments (constructor arguments) that make the fix."""
        where = path or "(top level)"
        return "; ".join(f"{where}.{name} = {new!r}" for name, (_, new) in self.changes.items())

    def to_dict(self) -> dict[str, Any]:
        return {
            "module_type": self.module_type,
            "changes": {k: {"current": a, "fitted": b} for k, (a, b) in self.changes.items()},
            "before": self.before,
            "after": self.after,
            "trials": self.trials,
        }


def constructor_values(module: Any) -> tuple[dict[str, Any], list[str]] | None:
    r"""The module's constructor arguments with the values it holds now (attribute, else ``config`` entry,
    else the signature default), and the names whose values were read from the module (so may be varied).
    ``None`` when a required argument cannot be read or is not a plain scalar."""
    try:
        signature = inspect.signature(type(module).__init__)
    except (TypeError, ValueError):
        return None
    config = getattr(module, "config", None)
    values: dict[str, Any] = {}
    readable: list[str] = []
    for name, param in list(signature.parameters.items())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if hasattr(module, name) and _plain(getattr(module, name)):
            values[name] = getattr(module, name)
            readable.append(name)
        elif isinstance(config, dict) and name in config and _plain(config[name]):
            values[name] = config[name]
            readable.append(name)
        elif param.default is not inspect.Parameter.empty:
            values[name] = param.default
        else:
            return None
    return values, readable


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, _SCALARS)


def _literal_options(module: Any, name: str) -> list[str]:
    """The string values a ``Literal[...]`` annotation allows for ``name`` (empty when unannotated)."""
    try:
        hints = typing.get_type_hints(type(module).__init__)
    except Exception:  # unresolvable forward references: no annotation to read
        return []
    options: list[str] = []
    for arg in typing.get_args(hints.get(name)) or ((hints.get(name),) if hints.get(name) else ()):
        if typing.get_origin(arg) is typing.Literal:
            options += [a for a in typing.get_args(arg) if isinstance(a, str)]
    return options


def candidate_values(module: Any, name: str, value: Any) -> list[Any]:
    """A few alternative values for one argument: the other boolean, the other literals, simple numbers."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, str):
        return [o for o in _literal_options(module, name) if o != value]
    if isinstance(value, (int, float)):
        out = [0, 1, -value, 2 * value, value / 2] + ([1 / value] if value else [])
        if isinstance(value, int):
            out = [int(v) for v in out if float(v).is_integer()]
        return [v for v in dict.fromkeys(out) if v != value]
    return []


def _settings(module: Any, values: dict[str, Any], readable: list[str]) -> list[dict[str, Any]]:
    """One-argument changes first, then pairs of boolean changes; at most :data:`MAX_TRIALS`."""
    singles = [(n, v) for n in readable for v in candidate_values(module, n, values[n])]
    out = [{n: v} for n, v in singles]
    flags = [n for n in readable if isinstance(values[n], bool)]
    out += [{a: not values[a], b: not values[b]} for a, b in itertools.combinations(flags, 2)]
    return out[:MAX_TRIALS]


def _build(module: Any, kwargs: dict[str, Any]) -> Any:
    try:
        new = type(module)(**kwargs)
        new.load_state_dict(module.state_dict(), strict=True)
    except Exception:  # a setting the class rejects, or one that changes parameter shapes
        return None
    for tensor in (*module.parameters(), *module.buffers()):
        new = new.to(device=tensor.device, dtype=tensor.dtype if tensor.is_floating_point() else None)
        break
    return new.train(module.training)


def _first_tensor(value: Any) -> Any:
    from paritykit.bisect import flatten_tensors

    leaves = flatten_tensors(value)
    return leaves[0][1] if leaves else None


def _run(module: Any, call: tuple[tuple, dict]) -> Any:
    import torch

    args, kwargs = call
    try:
        with torch.no_grad():
            return _first_tensor(module(*args, **kwargs))
    except Exception:  # a candidate setting whose forward fails is no fit
        return None


def _error(a: Any, b: Any) -> float:
    if b is None or a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def fit_module(
    module: Any,
    call: tuple[tuple, dict],
    target: Any,
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> ModuleFit | None:
    r"""Search ``module``'s constructor arguments for a setting whose output on ``call`` matches ``target``.

    Args:
        module: a configured ``nn.Module`` (its weights are kept; only constructor arguments change).
        call: ``(args, kwargs)`` the module was called with.
        target: the tensor the module should have produced (what the reference fed onward).
        atol, rtol: tolerances of the match (default: by dtype).

    Returns:
        The :class:`ModuleFit` with the fewest changes that matches, or ``None`` (no readable configuration,
        the rebuild with current values does not reproduce the module, or no setting matches).
    """
    from paritykit.compare import compare_tensors

    read = constructor_values(module)
    if read is None:
        return None
    values, readable = read
    own = _run(module, call)
    if own is None or not own.is_floating_point():
        return None
    rebuilt = _build(module, values)
    if rebuilt is None or _error(own, _run(rebuilt, call)) != 0:
        return None
    before = _error(target, own)
    trials = 0
    for change in _settings(module, values, readable):
        trials += 1
        candidate = _build(module, {**values, **change})
        if candidate is None:
            continue
        out = _run(candidate, call)
        if out is None or out.shape != target.shape:
            continue
        if compare_tensors(target, out.to(target.dtype), atol=atol, rtol=rtol, diagnose=False).passed:
            return ModuleFit(
                type(module).__name__,
                {k: (values[k], v) for k, v in change.items()},
                before,
                _error(target, out),
                trials,
                fitted=candidate,
            )
    return None
