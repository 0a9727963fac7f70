r"""diffusers schedulers by class name: building one from a config, the keys it accepts, its timestep/sigma
lists, and the paste-ready line that builds it."""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.quiet import quiet_diffusers
from paritykit.schedule.compare import first_list_difference
from paritykit.schedule.families import lists_close
from paritykit.schedule.load import (
    KINDS,
    Schedule,
    dedupe,
)


# ============================================================================================================
# fitting a scheduler config
# ============================================================================================================
def resolve_scheduler(cls: Any) -> type:
    r"""A diffusers scheduler class from itself, its name (``"DDIMScheduler"``), or ``module:Class`` for a
    port's own scheduler class importable from the current folder (``port.scheduling:MyScheduler``)."""
    if isinstance(cls, type):
        return cls
    if ":" in str(cls):
        return _importable_scheduler(str(cls))
    import diffusers

    try:
        found = getattr(diffusers, str(cls), None)
    except (ImportError, AttributeError):
        found = None
    if isinstance(found, type) and "dummy" in found.__module__:
        raise ParityKitError(
            f"--fit {cls}: diffusers needs an optional package for it (scipy: pip install scipy)"
        )
    if not isinstance(found, type) or not hasattr(found, "set_timesteps"):
        raise ParityKitError(f"--fit {cls!r}: not a diffusers scheduler class (e.g. DDIMScheduler)")
    return found


def _importable_scheduler(name: str) -> type:
    import importlib
    import os
    import sys

    module, _, attr = name.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found = getattr(importlib.import_module(module), attr, None)
    except Exception as exc:  # noqa: BLE001 - any import failure is the argument's trouble
        raise ParityKitError(
            f"--fit {name!r}: cannot import {module} ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(found, type) or not hasattr(found, "set_timesteps"):
        raise ParityKitError(f"--fit {name!r}: {module} has no scheduler class {attr!r}")
    return found


def fit_name(cls: type) -> str | None:
    r"""What ``--fit`` takes for ``cls``: its diffusers name, ``module:Class`` when its module is a file
    under the current folder (a port's own subclass), else ``None`` (a class no command can name)."""
    import os
    import sys

    import diffusers

    if getattr(diffusers, cls.__name__, None) is cls:
        return cls.__name__
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    if not file or cls.__module__ == "__main__":
        return None
    relative = os.path.relpath(os.path.splitext(os.path.abspath(file))[0], os.getcwd())
    if relative.replace(os.sep, ".").removesuffix(".__init__") != cls.__module__:
        return None
    return f"{cls.__module__}:{cls.__qualname__}"


def accepted_keys(cls: type) -> dict[str, Any]:
    r"""The config keys ``cls.__init__`` accepts, with their defaults."""
    params = inspect.signature(cls.__init__).parameters
    keys = {n: p.default for n, p in params.items() if n != "self" and p.kind == p.POSITIONAL_OR_KEYWORD}
    if not keys:
        raise ParityKitError(
            f"{cls.__name__}: cannot read its config keys (diffusers may need an optional package for it, "
            "e.g. scipy for LMSDiscreteScheduler)"
        )
    return keys


def all_scheduler_keys() -> frozenset[str]:
    r"""Every config key some diffusers scheduler class accepts (read from their signatures once)."""
    global _ALL_KEYS
    if _ALL_KEYS is None:
        import diffusers

        found: set[str] = set()
        for name in dir(diffusers):
            if not name.endswith("Scheduler"):
                continue
            try:
                cls = getattr(diffusers, name)
                found |= set(inspect.signature(cls.__init__).parameters)
            except Exception:  # a class that needs an optional package: its keys are unknown, not an error
                continue
        _ALL_KEYS = frozenset(found - {"self", "kwargs", "args"})
    return _ALL_KEYS


_ALL_KEYS: frozenset[str] | None = None


def scheduler_lists(scheduler: Any, n: int | None, **call: Any) -> dict[str, list[float]]:
    import warnings

    with warnings.catch_warnings(), quiet_diffusers():
        warnings.simplefilter("ignore")
        scheduler.set_timesteps(n, **call)
    out = {"timesteps": [float(v) for v in scheduler.timesteps.double().tolist()]}
    sigmas = getattr(scheduler, "sigmas", None)
    if sigmas is not None and hasattr(sigmas, "tolist"):
        out["sigmas"] = [float(v) for v in sigmas.double().tolist()]
    return out


def make_scheduler(cls: type, config: dict[str, Any]) -> Any:
    r"""A fresh ``cls(**config)``: a copy of one built before with the same config where there is one (a
    search builds each config at several step counts, and some constructors take most of a second:
    KDPM2's computes its 1000 training timesteps one at a time)."""
    import copy

    key = (cls, repr(sorted(config.items())))
    built = _BUILT.pop(key, None)
    if built is None:
        # keys are filtered to those __init__ accepts, so the constructor is enough (from_config re-reads
        # the signature for every key: 10x slower over a search)
        with quiet_diffusers():
            built = cls(**config)
    _BUILT[key] = built  # the newest last: the oldest goes first
    while len(_BUILT) > 64:
        del _BUILT[next(iter(_BUILT))]
    return copy.deepcopy(built)


# (class, config) -> a scheduler as its constructor left it, never handed out
_BUILT: dict[tuple, Any] = {}


@dataclass(frozen=True)
class Call:
    r"""How ``set_timesteps`` is called besides the step count.

    ``name``: ``default`` (``set_timesteps(n)``), ``sigmas-linspace`` (``sigmas=np.linspace(1, 1/n, n)``, what
    diffusers' flow pipelines pass), ``sigmas-given`` / ``sigmas-given-final`` (the reference's own sigmas,
    without / with the final one), ``timesteps-given``. ``rank`` orders fits: a plainer call first.
    """

    name: str
    text: str
    rank: int

    def kwargs(self, n: int, ref: Schedule | None, mu: float | None) -> tuple[int | None, dict[str, Any]]:
        r"""The step-count argument and keyword arguments of this call at ``n`` steps (``ref``: the reference
        at ``n``, for the calls that pass its lists; ``mu``: passed when given)."""
        import numpy as np

        kwargs: dict[str, Any] = {} if mu is None else {"mu": float(mu)}
        if self.name == "default":
            return n, kwargs
        if self.name == "sigmas-linspace":
            return None, {**kwargs, "sigmas": np.linspace(1.0, 1 / n, n)}
        if ref is None:
            raise ValueError("the reference is unknown at this count")
        if self.name == "timesteps-given":
            return None, {**kwargs, "timesteps": list(ref.timesteps or [])}
        sigmas = list(ref.sigmas or [])
        if self.name == "sigmas-given":
            while sigmas and sigmas[-1] == 0:
                sigmas.pop()
        return None, {**kwargs, "sigmas": sigmas}


DEFAULT_CALL = Call("default", "set_timesteps(n)", 0)
_CALLS = (
    Call("sigmas-linspace", "set_timesteps(sigmas=np.linspace(1.0, 1 / n, n))", 1),
    Call("sigmas-given", "set_timesteps(sigmas=REF_SIGMAS)  # the reference's sigmas without the final 0", 3),
    Call(
        "sigmas-given-final",
        "set_timesteps(sigmas=REF_SIGMAS)  # the reference's sigmas, final one included",
        3,
    ),
    Call("timesteps-given", "set_timesteps(timesteps=REF_TIMESTEPS)  # the reference's own timesteps", 3),
)


def calls_for(cls: type, keys: dict[str, Any], ref: Schedule) -> list[Call]:
    r"""The ``set_timesteps`` calls ``cls`` accepts that could reproduce ``ref``: the default one, the flow
    pipelines' linspace sigmas (flow classes, which shift what they are given), and the reference's own lists.
    """
    params = inspect.signature(cls.set_timesteps).parameters
    calls = [DEFAULT_CALL]
    for call in _CALLS:
        if call.name == "sigmas-linspace" and not ("sigmas" in params and "shift" in keys and ref.sigmas):
            continue
        if call.name.startswith("sigmas-given") and not ("sigmas" in params and ref.sigmas):
            continue
        if call.name == "timesteps-given" and not ("timesteps" in params and ref.timesteps):
            continue
        calls.append(call)
    return calls


def lists_of(
    cls: type,
    config: dict[str, Any],
    n: int,
    call: Call = DEFAULT_CALL,
    ref: Schedule | None = None,
    mu: float | None = None,
) -> dict[str, list[float]]:
    r"""The timestep and sigma lists ``cls(**config)`` sets for ``n`` steps under ``call``."""
    steps, kwargs = call.kwargs(n, ref, mu)
    return scheduler_lists(make_scheduler(cls, config), steps, **kwargs)


def set_with(
    scheduler: Any, n: int, call: Call = DEFAULT_CALL, ref: Schedule | None = None, mu: float | None = None
) -> None:
    r"""``scheduler.set_timesteps`` under ``call`` (the step check runs the fitted call, not the default)."""
    steps, kwargs = call.kwargs(n, ref, mu)
    scheduler_lists(scheduler, steps, **kwargs)


@dataclass
class Match:
    r"""How a scheduler's lists compare with the reference's: ``ok`` within tolerance, ``why`` not, the
    ``residual`` per kind as ``(max_abs, max_rel)``, and ``distance``, the worst relative error (a count
    mismatch counts 1 + the count difference), to rank near misses."""

    ok: bool
    why: str
    residual: dict[str, tuple[float, float]] = field(default_factory=dict)
    distance: float = math.inf


def _aligned(ref: Schedule, got: dict[str, list[float]], kind: str) -> tuple[list[float], list[float]] | None:
    want = ref.get(kind)
    if want is None or kind not in got:
        return None
    have = got[kind]
    if len(have) != len(want) and (len(dedupe(have)) != len(have) or len(dedupe(want)) != len(want)):
        # one model call per list entry vs per step, or a denoiser called twice per step (guidance halves)
        have, want = dedupe(have), dedupe(want)
    if kind == "sigmas" and len(have) == len(want) + 1:
        have = have[: len(want)]  # a recorded loop sees no final sigma
    return have, want


def schedule_matches(ref: Schedule, got: dict[str, list[float]]) -> Match:
    match = Match(True, "", {}, 0.0)
    for kind in KINDS:
        pair = _aligned(ref, got, kind)
        if pair is None:
            continue
        have, want = pair
        if len(have) != len(want):
            match.distance = max(match.distance, 1.0 + abs(len(have) - len(want)))
        else:
            errors = [abs(h - w) for h, w in zip(have, want)]
            rel = [e / max(abs(w), 1.0 if kind == "timesteps" else 1e-6) for e, w in zip(errors, want)]
            match.residual[kind] = (max(errors, default=0.0), max(rel, default=0.0))
            match.distance = max(match.distance, match.residual[kind][1])
        if match.ok and not lists_close(have, want, kind):
            match.ok, match.why = False, f"{kind} differ from step {first_list_difference(have, want, kind)}"
    if not match.residual and match.ok and match.distance == 0.0:
        return Match(False, "nothing comparable")
    return match


def python_literal(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def ready_line(cls_name: str, changes: dict[str, Any]) -> str:
    args = "".join(f", {k}={python_literal(v)}" for k, v in changes.items())
    return f"{cls_name}.from_config(pipe.scheduler.config{args})"


def config_changes(candidate: dict[str, Any], keys: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in candidate.items() if not same_config_value(base.get(k, keys.get(k)), v)}


def same_config_value(a: Any, b: Any) -> bool:
    r"""Whether two config values are one: element by element for arrays and lists (a port's numpy
    ``trained_betas``, round 36: ``!=`` on two arrays is no truth value), ``==`` otherwise."""
    import numpy as np

    if isinstance(a, (np.ndarray, list, tuple)) or isinstance(b, (np.ndarray, list, tuple)):
        try:
            return bool(np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object)))
        except Exception:
            return False
    try:
        return bool(a == b)
    except Exception:
        return False
