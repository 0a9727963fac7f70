r"""Fitting a diffusers scheduler's config to a reference loop (``--fit``): search its own config keys,
validate every candidate at several step counts."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, render_table
from paritykit.schedule.families import family_of, sigma_family
from paritykit.schedule.load import (
    KINDS,
    OTHER_COUNTS,
    TIMESTEP_ATOL,
    Schedule,
    load_schedule,
)
from paritykit.schedule.schedulers import (
    _changes,
    _format_value,
    _make,
    _matches,
    _scheduler_lists,
    accepted_keys,
    all_scheduler_keys,
    ready_line,
    resolve_scheduler,
)
from paritykit.schedule.step_check import StepCheck, _run_step_check


@dataclass
class Candidate:
    r"""A config change (relative to the base config) and how it fared."""

    changes: dict[str, Any]
    counts_matched: list[int] = field(default_factory=list)
    failures: dict[int, str] = field(default_factory=dict)
    step_check: StepCheck | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "changes": self.changes,
            "counts_matched": self.counts_matched,
            "failures": {str(k): v for k, v in self.failures.items()},
            "step_check": self.step_check.to_dict() if self.step_check else None,
        }


@dataclass
class FitResult:
    r"""What ``paritykit schedule REF --fit CLASS`` reports.

    ``fits`` hold the configs whose lists match at every count checked (and whose step matches, when checked);
    ``rejected`` the ones that matched at the requested count but not at another, or whose step differs.
    ``exit_code`` 0 when a fit was found, else 1.
    """

    scheduler: str
    steps: int
    counts: list[int]
    reference: str
    reference_families: dict[str, str]
    fits: list[Candidate]
    rejected: list[Candidate]
    searched: int
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    step_checked: bool = False
    environment: dict[str, Any] = field(default_factory=environment_stamp)

    @property
    def exit_code(self) -> int:
        return 0 if self.fits else 1

    @property
    def line(self) -> str | None:
        return ready_line(self.scheduler, self.fits[0].changes) if self.fits else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "steps": self.steps,
            "counts": self.counts,
            "reference": self.reference,
            "reference_families": self.reference_families,
            "fit": self.line,
            "fits": [c.to_dict() for c in self.fits],
            "rejected": [c.to_dict() for c in self.rejected],
            "searched": self.searched,
            "warnings": self.warnings,
            "notes": self.notes,
            "step_checked": self.step_checked,
            "environment": self.environment,
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        lines = [f"reference: {self.reference} ({self.steps} steps)"]
        lines += [f"  {k}: {v}" for k, v in self.reference_families.items()]
        lines.append(
            f"searched {self.searched} configs of {self.scheduler}; step counts checked: "
            + ", ".join(map(str, self.counts))
        )
        rows = []
        for c in [*self.fits, *self.rejected]:
            status = "fits" if c in self.fits else "rejected"
            why = "; ".join(f"at {n}: {w}" for n, w in c.failures.items())
            if c.step_check is not None and not c.step_check.matched:
                why = "; ".join(filter(None, [why, c.step_check.explanation]))
            rows.append(
                [
                    status,
                    ", ".join(f"{k}={_format_value(v)}" for k, v in c.changes.items()) or "(base)",
                    ",".join(map(str, c.counts_matched)),
                    why,
                ]
            )
        if rows:
            lines.append(render_table(["", "config change", "matches at", "why not"], rows, limit=limit))
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        if self.line:
            lines.append(f"fix: {self.line}")
        else:
            lines.append(f"no config of {self.scheduler} reproduces the reference")
        return "\n".join(lines)


# --- the search space: known keys, each with its bounded set of values -----------------------------------------
_SIGMA_TYPE_KEYS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


def _axes(keys: dict[str, Any], base: dict[str, Any], ref: Schedule, offsets: set[float]) -> list[list[dict]]:
    r"""Each axis is a list of alternative partial configs; a candidate takes one entry per axis."""

    def now(key: str) -> Any:
        return base.get(key, keys.get(key))

    axes: list[list[dict]] = []
    if "timestep_spacing" in keys:
        axes.append([{"timestep_spacing": v} for v in ("leading", "trailing", "linspace")])
    if "steps_offset" in keys:
        values = sorted({int(now("steps_offset") or 0), 0, 1, *(int(o) for o in offsets if o == int(o))})
        axes.append([{"steps_offset": v} for v in values])
    types = [k for k in _SIGMA_TYPE_KEYS if k in keys]
    if types:
        axes.append([{k: False for k in types}] + [{k: k == t for k in types} for t in types])
    if "final_sigmas_type" in keys:
        axes.append([{"final_sigmas_type": v} for v in ("zero", "sigma_min")])
    if "rescale_betas_zero_snr" in keys:
        axes.append([{"rescale_betas_zero_snr": v} for v in (False, True)])
    fam = sigma_family(ref.sigmas) if ref.sigmas else None
    fitted = fam.params.get("shift") if fam is not None and fam.name.startswith("flow") else None
    for key in ("shift", "flow_shift"):
        if key in keys:
            axes.append([{key: v} for v in dict.fromkeys([now(key), 1.0, *([fitted] if fitted else [])])])
    if "use_flow_sigmas" in keys and fitted is not None:
        axes.append([{"use_flow_sigmas": v} for v in (False, True)])
    if ref.sigmas and fam is not None and fam.name in ("Karras", "exponential"):
        for key, value in (("sigma_min", fam.params["sigma_min"]), ("sigma_max", fam.params["sigma_max"])):
            if key in keys:
                axes.append([{key: v} for v in dict.fromkeys([now(key), value])])
    if now("use_dynamic_shifting"):
        axes.append([{"use_dynamic_shifting": False}])  # set_timesteps would need `mu` from the pipeline
    return axes


def _validation_counts(steps: int, train_steps: int) -> list[int]:
    others = [c for c in OTHER_COUNTS if c != steps][:3]
    if all(train_steps % c == 0 for c in others):
        others.append(next(c for c in range(7, 100) if train_steps % c and c != steps))
    return [steps, *others]


def _reference_at(
    ref: Schedule, n: int, families: dict[str, Callable[[int], list[float]]]
) -> Schedule | None:
    if ref.generator is not None:
        return ref.generator(n)
    if n == ref.steps:
        return ref
    if not families:
        return None
    out = Schedule(ref.source)
    for kind, generate in families.items():
        values = generate(n)
        if kind == "timesteps":
            out.timesteps = values
        else:
            out.sigmas = values
    return out


def fit_scheduler(
    cls: Any,
    reference: Any,
    steps: int | None = None,
    base_config: dict[str, Any] | str | Path | None = None,
    step_check: Any = None,
) -> FitResult:
    r"""Search ``cls``'s config for the settings whose ``set_timesteps`` reproduces ``reference``.

    Only keys the class accepts are searched, each over a small set of values (``timestep_spacing``,
    ``steps_offset``, Karras / exponential / beta sigmas, ``final_sigmas_type``, ``rescale_betas_zero_snr``,
    ``shift`` / ``flow_shift`` with the shift fitted from the reference, ``sigma_min`` / ``sigma_max``). A
    config that matches at ``steps`` is then checked at three or more other counts (some not dividing
    ``num_train_timesteps``): the reference at those counts comes from a SPEC's ``ref_schedule(n)``, or from the
    closed form the reference's list follows (spacing, Karras, exponential, shifted flow matching).

    Args:
        cls: a diffusers scheduler class or its name.
        reference: anything :func:`load_schedule` reads.
        steps: the step count (default: the reference's).
        base_config: the port's scheduler config (dict or JSON file); changes are reported relative to it.
        step_check: also verify ``step()``: a SPEC ``.py`` with ``ref_step(x, eps, t, t_prev)``, or a checkpoint
            folder with the reference's per-step latents and model output; ``True`` uses the reference SPEC.

    Returns:
        A :class:`FitResult`; ``line`` is the ready fix, e.g.
        ``DDIMScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")``.
    """
    cls = resolve_scheduler(cls)
    keys = accepted_keys(cls)
    base = _checked_base(cls, keys, _load_base(base_config), base_config)
    train_steps = int(base.get("num_train_timesteps", keys.get("num_train_timesteps") or 1000))
    ref = load_schedule(reference)
    if steps is None:
        if ref.generator is not None:
            raise ParityKitError(f"{ref.source}: give --steps N (a SPEC's schedule depends on the count)")
        steps = ref.steps
    if steps < 2:
        raise ParityKitError(f"--steps {steps}: need at least 2 steps")
    ref_n = _reference_at(ref, steps, {})
    if ref_n is None or ref_n.steps != steps:
        raise ParityKitError(f"{ref.source}: holds {ref.steps} steps, not --steps {steps}")
    families = {
        kind: fam for kind in KINDS if (fam := family_of(kind, ref_n.get(kind), train_steps)) is not None
    }
    notes = []
    if ref.generator is None and not families:
        notes.append("the reference follows no known closed form: configs are checked at its own count only")
    counts = _validation_counts(steps, train_steps) if (ref.generator or families) else [steps]

    base_lists = _safe_lists(cls, base, steps)
    if base_lists is not None and not any(ref_n.get(k) is not None and k in base_lists for k in KINDS):
        raise ParityKitError(
            f"{ref.source}: holds only {', '.join(k for k in KINDS if ref_n.get(k) is not None)}, which "
            f"{cls.__name__} does not expose; nothing to compare"
        )
    offsets = set()
    if base_lists and ref_n.timesteps and len(base_lists["timesteps"]) == steps:
        d = [r - p for r, p in zip(ref_n.timesteps, base_lists["timesteps"])]
        if max(d) - min(d) <= TIMESTEP_ATOL:
            offsets.add(round(d[0]))
    axes = _axes(keys, base, ref_n, offsets)
    seen: dict[str, Candidate] = {}
    matched_here: list[Candidate] = []
    for combo in itertools.product(*axes):
        config = {k: v for part in combo for k, v in part.items()}
        changes = _changes(config, keys, base)
        tag = json.dumps(changes, sort_keys=True, default=str)
        if tag in seen:
            continue
        cand = seen[tag] = Candidate(changes)
        ok, why = _try(cls, {**base, **config}, ref_n, steps)
        if ok:
            cand.counts_matched.append(steps)
            matched_here.append(cand)
    fits, rejected = [], []
    variants = [
        dict(zip(families, gens))
        for gens in itertools.product(*([f.generate, *f.alternatives] for f in families.values()))
    ]
    for cand in sorted(matched_here, key=lambda c: len(c.changes)):
        for variant in variants or [{}]:  # the candidate must follow one reading of REF at every count
            cand.counts_matched, cand.failures = [steps], {}
            for n in counts[1:]:
                ok, why = _try(cls, {**base, **cand.changes}, _reference_at(ref, n, variant), n)
                if ok:
                    cand.counts_matched.append(n)
                else:
                    cand.failures[n] = why
            if not cand.failures:
                break
        (rejected if cand.failures else fits).append(cand)
    fits = _minimal(fits)
    result = FitResult(
        cls.__name__, steps, counts, ref.source,
        {k: f.describe() for k, f in families.items()}, fits, rejected[:10], len(seen), notes=notes,
    )  # fmt: skip
    if step_check is not None and step_check is not False:
        _run_step_check(result, cls, base, keys, ref, ref_n, steps, step_check, train_steps)
    return result


def _load_base(base_config: Any) -> dict[str, Any]:
    if base_config is None:
        return {}
    if isinstance(base_config, dict):
        return dict(base_config)
    from paritykit.forensics.config_files import load_config

    loaded = load_config(base_config)
    return dict(loaded if isinstance(loaded, dict) else getattr(loaded, "config", loaded))


def _checked_base(cls: type, keys: dict[str, Any], config: dict[str, Any], source: Any) -> dict[str, Any]:
    r"""The port's config reduced to the keys ``cls`` accepts. A key no diffusers scheduler accepts, or a value
    that ``cls`` refuses, is bad input (naming the key); keys of other scheduler classes are dropped."""
    what = "--config" + (f" {source}" if isinstance(source, (str, Path)) else "")
    unknown = [k for k in config if k not in keys and not k.startswith("_") and k not in all_scheduler_keys()]
    if unknown:
        raise ParityKitError(f"{what}: unknown key {unknown[0]!r} (no diffusers scheduler accepts it)")
    base = {k: v for k, v in config.items() if k in keys}
    problem = _refusal(cls, base)
    if problem is None:
        return base
    for key in base:  # the one key whose value, set back to the class's default, makes the config work
        if keys.get(key) != base[key] and _refusal(cls, {k: v for k, v in base.items() if k != key}) is None:
            raise ParityKitError(f"{what}: {key}={_format_value(base[key])} is refused by {cls.__name__}: {problem}")
    raise ParityKitError(f"{what}: refused by {cls.__name__}: {problem}")


def _refusal(cls: type, config: dict[str, Any]) -> str | None:
    r"""Why ``cls`` cannot be built from ``config`` and set to a few steps, or ``None`` when it can."""
    import inspect

    try:
        scheduler = _make(cls, config)
        call = {"mu": 0.0} if config.get("use_dynamic_shifting") else {}
        if "mu" in call and "mu" not in inspect.signature(scheduler.set_timesteps).parameters:
            call = {}
        _scheduler_lists(scheduler, 10, **call)
    except Exception as exc:  # diffusers raises ValueError, NotImplementedError, RuntimeError, KeyError here
        return (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    return None


def _safe_lists(cls: type, config: dict[str, Any], n: int) -> dict[str, list[float]] | None:
    try:
        return _scheduler_lists(_make(cls, config), n)
    except Exception:
        return None


def _try(cls: type, config: dict[str, Any], ref: Schedule | None, n: int) -> tuple[bool, str]:
    if ref is None:
        return False, "reference unknown at this count"
    try:
        got = _scheduler_lists(_make(cls, config), n)
    except Exception as exc:  # a config that crashes at some count is exactly what must never be proposed
        return False, f"raises {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
    return _matches(ref, got)


def _minimal(fits: list[Candidate]) -> list[Candidate]:
    r"""Drop a fit whose changes include another fit's changes: the extra keys change nothing here."""
    kept = []
    for c in fits:
        items = set(map(str, c.changes.items()))
        if not any(o is not c and set(map(str, o.changes.items())) < items for o in fits):
            kept.append(c)
    return kept
