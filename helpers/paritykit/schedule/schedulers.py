r"""diffusers schedulers by class name: building one from a config, the keys it accepts, its timestep/sigma
lists, and the paste-ready line that builds it."""

from __future__ import annotations

import inspect
import json
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.schedule.compare import _first_difference
from paritykit.schedule.families import _close
from paritykit.schedule.load import (
    KINDS,
    Schedule,
    _dedupe,
)


# ================================================================================================================
# fitting a scheduler config
# ================================================================================================================
def resolve_scheduler(cls: Any) -> type:
    r"""A diffusers scheduler class from itself or its name (``"DDIMScheduler"``)."""
    if isinstance(cls, type):
        return cls
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


def _scheduler_lists(scheduler: Any, n: int | None, **call: Any) -> dict[str, list[float]]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scheduler.set_timesteps(n, **call)
    out = {"timesteps": [float(v) for v in scheduler.timesteps.double().tolist()]}
    sigmas = getattr(scheduler, "sigmas", None)
    if sigmas is not None and hasattr(sigmas, "tolist"):
        out["sigmas"] = [float(v) for v in sigmas.double().tolist()]
    return out


def _make(cls: type, config: dict[str, Any]) -> Any:
    # keys are filtered to those __init__ accepts, so the constructor is enough (from_config re-reads the
    # signature for every key: 10x slower over a search)
    import logging

    logger = logging.getLogger("diffusers.configuration_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return cls(**config)
    finally:
        logger.setLevel(level)


def _matches(ref: Schedule, got: dict[str, list[float]]) -> tuple[bool, str]:
    compared = 0
    for kind in KINDS:
        want = ref.get(kind)
        if want is None or kind not in got:
            continue
        have = got[kind]
        if len(have) != len(want) and len(_dedupe(have)) != len(have):
            have, want = _dedupe(have), _dedupe(want)  # one model call per list entry vs per step
        if kind == "sigmas" and len(have) == len(want) + 1:
            have = have[: len(want)]  # a recorded loop sees no final sigma
        compared += 1
        if not _close(have, want, kind):
            first = _first_difference(have, want, kind)
            return False, f"{kind} differ from step {first}"
    return (compared > 0), "" if compared else "nothing comparable"


def _format_value(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def ready_line(cls_name: str, changes: dict[str, Any]) -> str:
    args = "".join(f", {k}={_format_value(v)}" for k, v in changes.items())
    return f"{cls_name}.from_config(pipe.scheduler.config{args})"


def _changes(candidate: dict[str, Any], keys: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in candidate.items() if base.get(k, keys.get(k)) != v}
