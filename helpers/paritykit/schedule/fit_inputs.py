r"""What a fit starts from: the base config (a file or a dict) checked against the class's keys, the
reference's timesteps read as a flow schedule where the class is a flow one, the step count its recorded calls
imply, and one candidate tried (:func:`try_candidate`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.schedule.load import KINDS, Schedule
from paritykit.schedule.schedulers import (
    DEFAULT_CALL,
    Call,
    Match,
    all_scheduler_keys,
    lists_of,
    make_scheduler,
    python_literal,
    schedule_matches,
    scheduler_lists,
)


def load_base(base_config: Any) -> dict[str, Any]:
    if base_config is None:
        return {}
    if isinstance(base_config, dict):
        return dict(base_config)
    from paritykit.forensics.config_files import load_config

    loaded = load_config(base_config)
    return dict(loaded if isinstance(loaded, dict) else getattr(loaded, "config", loaded))


def checked_base(cls: type, keys: dict[str, Any], config: dict[str, Any], source: Any) -> dict[str, Any]:
    r"""The port's config reduced to the keys ``cls`` accepts. A key no diffusers scheduler accepts, or a
    value that ``cls`` refuses, is bad input (naming the key); keys of other scheduler classes are dropped."""
    what = "--config" + (f" {source}" if isinstance(source, (str, Path)) else "")
    unknown = [k for k in config if k not in keys and not k.startswith("_") and k not in all_scheduler_keys()]
    if unknown:
        raise ParityKitError(f"{what}: unknown key {unknown[0]!r} (no diffusers scheduler accepts it)")
    base = {k: v for k, v in config.items() if k in keys}
    problem = refusal(cls, base)
    if problem is None:
        return base
    for key in base:  # the one key whose value, set back to the class's default, makes the config work
        if keys.get(key) != base[key] and refusal(cls, {k: v for k, v in base.items() if k != key}) is None:
            raise ParityKitError(
                f"{what}: {key}={python_literal(base[key])} is refused by {cls.__name__}: {problem}"
            )
    raise ParityKitError(f"{what}: refused by {cls.__name__}: {problem}")


def refusal(cls: type, config: dict[str, Any]) -> str | None:
    r"""Why ``cls`` cannot be built from ``config`` and set to a few steps, or ``None`` when it can."""
    import inspect

    try:
        scheduler = make_scheduler(cls, config)
        call = {"mu": 0.0} if config.get("use_dynamic_shifting") else {}
        if "mu" in call and "mu" not in inspect.signature(scheduler.set_timesteps).parameters:
            call = {}
        scheduler_lists(scheduler, 10, **call)
    except Exception as exc:  # diffusers raises ValueError, NotImplementedError, RuntimeError, KeyError here
        return (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    return None


def timesteps_only(ref: Schedule, train_steps: int) -> bool:
    return (
        ref.sigmas is None
        and bool(ref.timesteps)
        and 0 <= min(ref.timesteps) <= max(ref.timesteps) <= train_steps
    )


def as_flow(ref: Schedule, train_steps: int) -> tuple[Schedule, str]:
    r"""A recording of a flow model's timesteps read as its sigmas, and the words saying how: ascending
    values are flow time (t = 1 − σ, denoising runs from t = 0), descending ones σ itself; in [0, 1] (a model
    called at t = σ) or in [0, ``train_steps``] (t = σ · train_steps)."""
    scale = 1.0 if max(ref.timesteps) <= 1 else float(train_steps)
    if ref.generator is None and len(ref.timesteps) > 1 and ref.timesteps[0] < ref.timesteps[-1]:
        flipped = [train_steps * (1 - t / scale) for t in ref.timesteps]
        return with_flow_sigmas(dataclasses.replace(ref, timesteps=flipped), train_steps), (
            "the reference records timesteps only, ascending: read as flow time t = 1 − σ (denoising from t ="
            f" 0){'' if scale == 1 else f', in units of {train_steps}'}"
        )
    if ref.generator is None and max(ref.timesteps) <= 1:
        scaled = dataclasses.replace(ref, timesteps=[t * train_steps for t in ref.timesteps])
        return with_flow_sigmas(scaled, train_steps), (
            "the reference records timesteps only, in [0, 1]: read as the flow-matching sigmas themselves (a"
            " flow model called at t = σ)"
        )
    return with_flow_sigmas(ref, train_steps), (
        f"the reference records timesteps only: read as flow-matching sigmas t / {train_steps} (a flow model"
        " is called at t = σ · num_train_timesteps)"
    )


def with_flow_sigmas(ref: Schedule, train_steps: int) -> Schedule:
    r"""``ref`` with ``sigmas = timesteps / train_steps`` beside its timesteps (at every count and size its
    generator gives), so a flow-matching fit reads the shift from a recording of the model's timestep."""
    out = dataclasses.replace(ref, sigmas=[t / train_steps for t in ref.timesteps])
    if ref.generator is not None:
        inner = ref.generator

        def generate(*args):
            found = inner(*args)
            return (
                with_flow_sigmas(found, train_steps)
                if found is not None and timesteps_only(found, train_steps)
                else found
            )

        out.generator = generate
    return out


def steps_of_calls(cls: type, base: dict[str, Any], ref: Schedule) -> int | None:
    r"""The step count of a ``record_loop`` reference for a class that calls the denoiser twice per step with
    distinct timesteps (KDPM2: ``2n - 1`` calls); ``None`` for any other reference or class."""
    if not ref.per_call or ref.generator is not None or ref.steps < 3 or ref.steps % 2 == 0:
        return None
    n = (ref.steps + 1) // 2
    lists = safe_lists(cls, base, n)
    kind = next((k for k in KINDS if ref.get(k) is not None and lists and k in lists), None)
    return n if kind is not None and len(lists[kind]) == ref.steps else None


def safe_lists(cls: type, config: dict[str, Any], n: int) -> dict[str, list[float]] | None:
    try:
        return lists_of(cls, config, n)
    except Exception:
        return None


def try_candidate(
    cls: type,
    config: dict[str, Any],
    ref: Schedule | None,
    n: int,
    call: Call = DEFAULT_CALL,
    mu: float | None = None,
) -> Match:
    if ref is None:
        return Match(False, "reference unknown at this count")
    try:
        got = lists_of(cls, config, n, call, ref, mu)
    except Exception as exc:  # a config that crashes at some count is exactly what must never be proposed
        return Match(
            False, f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
        )
    return schedule_matches(ref, got)


# the keys still searched when the reference's own lists are passed to set_timesteps
