r"""Fitting a diffusers scheduler's config to a reference loop (``--fit``): search its own config keys,
validate every candidate at several step counts."""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.minimize import golden_section
from paritykit.base.quiet import quiet_diffusers
from paritykit.base.report import format_number
from paritykit.schedule.families import Family, family_of, lists_close, sigma_family
from paritykit.schedule.fit_inputs import (
    as_flow,
    checked_base,
    load_base,
    safe_lists,
    steps_of_calls,
    timesteps_only,
    try_candidate,
)
from paritykit.schedule.fit_result import Candidate, FitResult
from paritykit.schedule.load import (
    KINDS,
    OTHER_COUNTS,
    TIMESTEP_ATOL,
    Schedule,
    load_schedule,
    load_sized,
    per_step,
)
from paritykit.schedule.schedulers import (
    DEFAULT_CALL,
    Call,
    accepted_keys,
    calls_for,
    config_changes,
    lists_of,
    make_scheduler,
    resolve_scheduler,
    same_config_value,
)
from paritykit.schedule.step_check import run_step_check

# --- the search space: known keys, each with its bounded set of values
# -----------------------------------------
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
    if "interpolation_type" in keys and ref.sigmas:
        # "linear" reads each step's sigma off the trained table at its timestep (as k-diffusion's samplers
        # do); "log_linear" spaces the sigmas evenly in log between the table's two ends. It changes the
        # sigmas only: a reference of timesteps alone cannot tell the two apart
        values = dict.fromkeys([now("interpolation_type"), "linear", "log_linear"])
        axes.append([{"interpolation_type": v} for v in values])
    if "final_sigmas_type" in keys:
        axes.append([{"final_sigmas_type": v} for v in ("zero", "sigma_min")])
    if "beta_schedule" in keys and base.get("trained_betas") is None:
        # a name that means another schedule in the reference's code base (CompVis "linear" is diffusers'
        # "scaled_linear")
        named = ("linear", "scaled_linear", "squaredcos_cap_v2")
        axes.append([{"beta_schedule": v} for v in dict.fromkeys([now("beta_schedule"), *named])])
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
    if "sampling_eps" in keys and ref.timesteps and 0.0 < ref.timesteps[-1] < 1.0:
        # a continuous-time schedule from 1 down to the SDE's epsilon (score_sde's VE and VP samplers): the
        # reference's last timestep, as recorded and rounded to two significant digits
        last = ref.timesteps[-1]
        axes.append(
            [{"sampling_eps": v} for v in dict.fromkeys([now("sampling_eps"), float(f"{last:.2g}"), last])]
        )
    if "use_dynamic_shifting" in keys and (fitted is not None or now("use_dynamic_shifting")):
        # dynamic shifting reads `mu` from the call: exp(mu) (or mu, "linear") is the shift at this image size
        kinds = ("exponential", "linear") if "time_shift_type" in keys else (None,)
        dynamic = [{"use_dynamic_shifting": True, **({"time_shift_type": t} if t else {})} for t in kinds]
        axes.append([{"use_dynamic_shifting": False}, *(dynamic if fitted is not None else [])])
    return axes


def _mu(config: dict[str, Any], ref: Schedule | None) -> float | None:
    r"""The ``mu`` a dynamically shifting config needs to reproduce ``ref``: ``log(shift)`` (exponential time
    shift) or the shift itself (linear), from the shift fitted to the reference's sigmas; ``None`` otherwise.
    """
    if not config.get("use_dynamic_shifting") or ref is None or not ref.sigmas:
        return None
    shift = _flow_shift(tuple(ref.sigmas))
    if shift is None:
        return None
    return shift if config.get("time_shift_type") == "linear" else math.log(shift)


def _port_call(
    cls: type, base: dict[str, Any], port: Any, calls: list[Call], seq_len: int | None
) -> tuple[Call | None, float | None]:
    r"""The plain ``set_timesteps`` call (and ``mu``) with which ``base`` reproduces the port's own recorded
    schedule: how the port's pipeline calls its scheduler. A dynamically shifting config needs ``seq_len``:
    the call is the one whose ``mu`` is the config's rule at that size (several calls reproduce one count).
    ``(None, None)`` when none does, or no port, or the call cannot be told."""
    if port is None:
        return None, None
    try:
        recorded, _ = per_step(load_schedule(port))
    except ParityKitError:
        return None, None
    train_steps = int(base.get("num_train_timesteps", 1000))
    if "shift" in accepted_keys(cls) and timesteps_only(recorded, train_steps):
        recorded, _ = as_flow(recorded, train_steps)
    n = recorded.steps
    rule = mu_rule(base, seq_len) if base.get("use_dynamic_shifting") else None
    if base.get("use_dynamic_shifting") and rule is None:
        return None, None
    for call in (c for c in calls if c.rank < 3):
        mu = _search_mu(cls, base, recorded, n, call)
        if rule is not None and (mu is None or abs(mu - rule) > 1e-3):
            continue
        if try_candidate(cls, base, recorded, n, call, rule if rule is not None else mu).ok:
            return call, rule if rule is not None else mu
    return None, None


def mu_rule(config: dict[str, Any], seq_len: int | None) -> float | None:
    r"""The ``mu`` a flow pipeline computes from a scheduler config at ``seq_len`` latent tokens: linear from
    ``base_shift`` at ``base_image_seq_len`` to ``max_shift`` at ``max_image_seq_len``; ``None`` without a
    size or those keys."""
    keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
    if seq_len is None or any(config.get(k) is None for k in keys):
        return None
    b_len, m_len, b_shift, m_shift = (float(config[k]) for k in keys)
    if m_len == b_len:
        return None
    return b_shift + (m_shift - b_shift) * (seq_len - b_len) / (m_len - b_len)


def _search_mu(cls: type, config: dict[str, Any], ref: Schedule | None, n: int, call: Call) -> float | None:
    r"""The ``mu`` whose ``set_timesteps`` lists come closest to ``ref``'s, searched directly (golden
    section over -3..6). The scheduler applies its own time-shift type and terminal stretch, so a reference
    read as another shifted grid still gets the ``mu`` that reproduces it; ``None`` when none comes near."""
    if not config.get("use_dynamic_shifting") or ref is None or not (ref.sigmas or ref.timesteps):
        return None

    def distance(mu: float) -> float:
        return try_candidate(cls, config, ref, n, call, mu).distance

    mu, found = golden_section(distance, -3.0, 6.0, 60)
    return mu if math.isfinite(found) else None


@functools.lru_cache(maxsize=256)
def _flow_shift(sigmas: tuple[float, ...]) -> float | None:
    fam = sigma_family(sigmas)
    return fam.params["shift"] if fam is not None and fam.name.startswith("flow") else None


def _validation_counts(steps: int, train_steps: int) -> list[int]:
    others = [c for c in OTHER_COUNTS if c != steps][:3]
    if all(train_steps % c == 0 for c in others):
        others.append(next(c for c in range(7, 100) if train_steps % c and c != steps))
    return [steps, *others]


def _flow_timesteps(families: dict[str, Any], ref: Schedule, train_steps: int) -> None:
    r"""Timesteps that are a flow schedule's sigmas times ``num_train_timesteps`` follow the sigmas' closed
    form, not a spacing of their own: a linear flow grid read as "leading spacing + offset" would make every
    count but the recorded one depart."""
    sigmas = families.get("sigmas")
    if sigmas is None or not sigmas.name.startswith("flow") or not ref.timesteps or not ref.sigmas:
        return
    if not lists_close(
        ref.timesteps, [v * train_steps for v in ref.sigmas[: len(ref.timesteps)]], "timesteps"
    ):
        return

    def generate(n: int, of: Callable[[int], list[float]] = sigmas.generate) -> list[float]:
        return [v * train_steps for v in of(n)[:n]]

    families["timesteps"] = Family("the flow sigmas", {"times": train_steps}, generate=generate)


def _reference_at(
    ref: Schedule, n: int, families: dict[str, Callable[[int], list[float]]], size: int | None = None
) -> Schedule | None:
    if ref.generator is not None:
        return ref.generator(n, size) if ref.sized else ref.generator(n)
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


# the search builds thousands of schedulers: diffusers is quieted once for all of them
@quiet_diffusers()
def fit_scheduler(
    cls: Any,
    reference: Any,
    steps: int | None = None,
    base_config: dict[str, Any] | str | Path | None = None,
    step_check: Any = None,
    image_seq_len: Sequence[int] | None = None,
    explain: bool = True,
    port: Any = None,
    seq_len: int | None = None,
) -> FitResult:
    r"""Search ``cls``'s config and its ``set_timesteps`` call for what reproduces ``reference``.

    Config keys the class accepts are searched, each over a small set of values (``timestep_spacing``,
    ``steps_offset``, Karras / exponential / beta sigmas, ``final_sigmas_type``, ``rescale_betas_zero_snr``,
    ``shift`` / ``flow_shift`` with the shift fitted from the reference, ``sigma_min`` / ``sigma_max``,
    ``use_dynamic_shifting`` with ``mu`` fitted from the reference). Calls: ``set_timesteps(n)``; for flow
    classes ``sigmas=np.linspace(1, 1/n, n)`` (what diffusers' flow pipelines pass); as a last resort the
    reference's own lists (``sigmas=`` / ``timesteps=``). A candidate that matches at ``steps`` is checked at
    three or more other counts (some not dividing ``num_train_timesteps``) and, for a size-dependent
    reference, at every size: the reference there comes from a SPEC's ``ref_schedule(n)`` / ``ref_schedule(n,
    image_seq_len)``, or from the closed form the reference's list follows. Every fit states its residual.

    Args:
        cls: a diffusers scheduler class or its name.
        reference: anything :func:`load_schedule` reads, or ``{image_seq_len: source}``: recordings at two or
            more image sizes (:func:`load_sized`).
        steps: the step count (default: the reference's).
        base_config: the port's scheduler config (dict or JSON file); changes are reported relative to it. A
            key no diffusers scheduler accepts, or a value ``cls`` refuses, raises :class:`ParityKitError`.
        step_check: also verify ``step()``: a SPEC ``.py`` with ``ref_step(x, eps, t, t_prev)``, or a
            checkpoint folder with the reference's per-step latents and model output (a ``record_loop`` folder
            checks every step of a multistep or second-order sampler); ``True`` uses the reference SPEC.
        image_seq_len: the image sizes (latent tokens) a size-dependent SPEC is fitted at (two or more).
        explain: when nothing fits, name the nearest candidate's differences and try the sibling classes.
        port: the port's own recorded schedule (anything :func:`load_schedule` reads). The ``set_timesteps``
            call (and ``mu``) that reproduces it with the base config is how the port's pipeline calls its
            scheduler: a fix keeps that call, and the two ``mu`` are stated side by side.
        seq_len: the run's image size in latent tokens. With ``port`` and a dynamically shifting base config,
            the call whose ``mu`` is the config's own rule at this size (``base_shift`` to ``max_shift`` over
            ``base_image_seq_len`` to ``max_image_seq_len``) is the port's: several calls reproduce one step
            count, the rule tells them apart.

    Returns:
        A :class:`FitResult`; ``line`` is the ready fix, e.g.
        ``DDIMScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")``, and ``call_line``
        the ``set_timesteps`` call when the fix needs one.
    """
    cls = resolve_scheduler(cls)
    keys = accepted_keys(cls)
    base = checked_base(cls, keys, load_base(base_config), base_config)
    train_steps = int(base.get("num_train_timesteps", keys.get("num_train_timesteps") or 1000))
    sized_recordings = (
        isinstance(reference, Mapping) and reference and all(isinstance(k, int) for k in reference)
    )
    ref = load_sized(reference) if sized_recordings else load_schedule(reference)
    ref, repeats = per_step(ref) if ref.generator is None else (ref, 1)
    flow_note = None
    if "shift" in keys and timesteps_only(ref, train_steps):
        ref, flow_note = as_flow(ref, train_steps)
    sizes = _sizes(ref, image_seq_len)
    calls_n = steps_of_calls(cls, base, ref)
    if steps is None:
        if ref.generator is not None and not ref.recorded_sizes:
            raise ParityKitError(f"{ref.source}: give --steps N (a SPEC's schedule depends on the count)")
        steps = calls_n or ref.steps
    if steps < 2:
        raise ParityKitError(f"--steps {steps}: need at least 2 steps")
    ref_n = ref if steps == calls_n else _reference_at(ref, steps, {}, sizes[0])
    if ref_n is None or (ref_n.steps != steps and steps != calls_n):
        raise ParityKitError(f"{ref.source}: holds {ref.steps} steps, not --steps {steps}")
    families = {
        kind: fam for kind in KINDS if (fam := family_of(kind, ref_n.get(kind), train_steps)) is not None
    }
    _flow_timesteps(families, ref_n, train_steps)
    notes = [flow_note] if flow_note else []
    if repeats > 1:
        notes.append(
            f"the reference recorded each value {repeats} times in a row (a denoiser call per guidance half):"
            " read once per step"
        )
    if ref.generator is None and not families:
        notes.append(
            "the recorded values matched none of the closed forms tried on them (VP betas and spacing,"
            " Karras, exponential, shifted flow, in the units recorded): configs are checked at its own count"
            " only"
        )
    counts = _validation_counts(steps, train_steps) if (ref.generator or families) else [steps]
    if ref.recorded_sizes:
        counts = [steps]
        notes.append("recordings at image sizes: configs are checked at their own count only")

    base_lists = safe_lists(cls, base, steps)
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
    configs = []
    for combo in itertools.product(*_axes(keys, base, ref_n, offsets)):
        config = {k: v for part in combo for k, v in part.items()}
        configs.append((config, config_changes(config, keys, base)))
    calls = calls_for(cls, keys, ref_n)
    port_call, port_mu = _port_call(cls, base, port, calls, seq_len)
    if port_call is not None:
        calls = [c for c in calls if c.name == port_call.name or c.rank >= 3]
        said = f" with mu {format_number(port_mu, 4)}" if port_mu is not None else ""
        how = port_call.text.partition("  #")[0] or "set_timesteps(n)"
        notes.append(
            f"the port's own run is reproduced by its config and {how}{said}: the fit keeps that call"
        )
    seen: dict[str, Candidate] = {}
    matched_here: list[Candidate] = []
    # the reference's own lists are the last resort: tried only when no config fits with a plainer call
    for group in ([c for c in calls if c.rank < 3], [c for c in calls if c.rank >= 3]):
        for call in group:
            for config, changes in configs:
                if call.rank >= 3 and not set(changes) <= _GIVEN_KEYS:
                    continue  # a list passed as given ignores the spacing keys; the sigma-type keys remap it
                tag = json.dumps([changes, call.name], sort_keys=True, default=str)
                if tag in seen:
                    continue
                cand = seen[tag] = Candidate(dict(changes), call)
                full = {**base, **config}
                mu = _search_mu(cls, full, ref_n, steps, call) if call.rank < 3 else _mu(full, ref_n)
                if full.get("use_dynamic_shifting") and mu is None:
                    continue
                match = try_candidate(cls, full, ref_n, steps, call, mu)
                cand.distance = match.distance
                if match.ok:
                    cand.counts_matched.append(steps)
                    cand.absorb(match)
                    if mu is not None:
                        cand.mu[sizes[0]] = mu
                    matched_here.append(cand)
        if matched_here:
            break
    fits, rejected = [], []
    variants = [
        dict(zip(families, gens))
        for gens in itertools.product(*([f.generate, *f.alternatives] for f in families.values()))
    ]
    for cand in sorted(matched_here, key=lambda c: (c.call.rank, bool(c.mu), len(c.changes))):
        if cand.call.rank >= 3:
            # the reference's own list passed in: at another count it would be that count's list, matched by
            # construction; only the recorded count says anything
            fits.append(cand)
            continue
        first = dict(cand.residual)
        for variant in variants or [{}]:  # the candidate must follow one reading of REF at every count
            cand.counts_matched, cand.failures, cand.residual = [steps], {}, dict(first)
            _validate(cand, cls, base, ref, counts, sizes, variant)
            if not cand.failures:
                break
        (rejected if cand.failures else fits).append(cand)
    if ref.generator is None and not ref.recorded_sizes:
        # one recording decides only its own count: a candidate exact there that leaves the closed form read
        # from it elsewhere still reproduces everything measured. With no fit that follows the form (the
        # port's own call kept), it is the fit, said to be checked at the recorded count only
        for cand in [c for c in rejected if c.exact and all(isinstance(k, int) for k in c.failures)]:
            cand.departs = dict(cand.failures)
            if not fits:
                cand.failures = {}
                rejected.remove(cand)
                fits.append(cand)
    fits = _minimal(fits)
    result = FitResult(
        cls.__name__,
        steps,
        counts,
        ref.source,
        {k: f.describe() for k, f in families.items()},
        fits,
        rejected[:10],
        len(seen),
        notes=notes,
        sizes=[s for s in sizes if s is not None],
        recorded_counts=ref.generator is not None,
        port_given=port is not None,
    )
    needed = next(iter(fits[0].mu.values()), None) if fits else None
    if port_mu is not None and needed is not None and seq_len is not None and abs(needed - port_mu) > 1e-6:
        b_len, m_len = base.get("base_image_seq_len"), base.get("max_image_seq_len")
        b_shift, m_shift = base.get("base_shift"), base.get("max_shift")
        result.notes.append(
            f"mu: the reference's schedule needs {format_number(needed, 5)} at image_seq_len {seq_len}; the"
            f" port's config gives {format_number(port_mu, 5)} there (base_shift {b_shift} + (max_shift"
            f" {m_shift} - base_shift) * ({seq_len} - base_image_seq_len {b_len}) / (max_image_seq_len"
            f" {m_len} - base_image_seq_len)): those four keys set it"
        )
    if fits and fits[0].mu and len(fits[0].mu) >= 2:
        _mu_as_function_of_size(result, cls, keys, base, ref, counts)
    if step_check is not None and step_check is not False:
        run_step_check(result, cls, base, keys, ref, ref_n, steps, step_check, train_steps)
    if not result.fits and explain:
        _explain_no_fit(
            result, cls, base, ref, ref_n, steps, train_steps, list(seen.values()), step_check, variants
        )
    return result


def _sizes(ref: Schedule, image_seq_len: Sequence[int] | None) -> list[int | None]:
    if ref.recorded_sizes:
        if image_seq_len and set(image_seq_len) != set(ref.recorded_sizes):
            raise ParityKitError(
                f"--image-seq-len: the recordings are at {', '.join(map(str, ref.recorded_sizes))}"
            )
        return list(ref.recorded_sizes)
    if not ref.sized:
        if image_seq_len:
            raise ParityKitError(
                f"--image-seq-len: {ref.source} does not depend on the image size (a SPEC's "
                "ref_schedule(n, image_seq_len) does)"
            )
        return [None]
    sizes = list(dict.fromkeys(int(v) for v in image_seq_len or ()))
    if len(sizes) < 2 or min(sizes) < 1:
        raise ParityKitError(
            f"--image-seq-len: {ref.source} depends on the image size; give two or more sizes (e.g. 256,4096)"
        )
    return sizes


def _validate(
    cand: Candidate, cls: type, base: dict, ref: Schedule, counts: list[int], sizes: list, variant: dict
) -> None:
    r"""Check ``cand`` at every count and size besides the first, recording matches, failures and
    residuals."""
    config = {**base, **cand.changes}
    for size in sizes:
        mu = cand.mu.get(size)
        if config.get("use_dynamic_shifting") and size not in cand.mu:
            mu = _search_mu(cls, config, _reference_at(ref, counts[0], variant, size), counts[0], cand.call)
            if mu is None:
                cand.failures[f"seq {size}"] = "no flow shift fitted at this size"
                continue
            cand.mu[size] = mu
        for n in counts:
            if n == counts[0] and size == sizes[0]:
                continue
            match = try_candidate(cls, config, _reference_at(ref, n, variant, size), n, cand.call, mu)
            label: Any = n if size == sizes[0] else f"{n} @ seq {size}"
            if match.ok:
                cand.absorb(match)
                if size == sizes[0]:
                    cand.counts_matched.append(n)
            else:
                cand.failures[label] = match.why


def _mu_as_function_of_size(
    result: FitResult, cls: type, keys: dict, base: dict, ref: Schedule, counts: list[int]
) -> None:
    r"""``mu`` fitted per size, read as diffusers' line ``calculate_shift`` (``base_shift`` at
    ``base_image_seq_len``, ``max_shift`` at ``max_image_seq_len``), and checked by building the scheduler
    from those config values at every size and count, and at a size between the ones given."""
    best = result.fits[0]
    (l1, m1), (l2, m2) = sorted(best.mu.items())[0], sorted(best.mu.items())[-1]
    slope = (m2 - m1) / (l2 - l1)
    config = {**keys, **base, **best.changes}
    lo, hi = int(config.get("base_image_seq_len") or 256), int(config.get("max_image_seq_len") or 4096)
    base_shift, max_shift = m1 + slope * (lo - l1), m1 + slope * (hi - l1)
    off = [(size, mu) for size, mu in best.mu.items() if abs(m1 + slope * (size - l1) - mu) > 1e-6]
    if off:
        result.notes.append(
            "mu is not linear in image_seq_len over the sizes checked ("
            + ", ".join(f"{format_number(mu, 6)} at {s}" for s, mu in sorted(best.mu.items()))
            + "): pass it per size"
        )
        return
    changes = {"base_shift": round(base_shift, 6), "max_shift": round(max_shift, 6)}
    changes = {k: v for k, v in changes.items() if k in keys and abs(float(config.get(k) or 0) - v) > 1e-6}
    best.changes.update(changes)
    middle = (l1 + l2) // 2
    checked = {**best.mu}
    if _reference_at(ref, counts[0], {}, middle) is None:
        if len(checked) == 2:
            result.notes.append(
                "mu is a line through the two sizes given; it is not checked between them "
                f"(record a third size, e.g. {middle}, to check it)"
            )
    elif middle not in checked:
        mu = m1 + slope * (middle - l1)
        for n in counts:
            match = try_candidate(
                cls, {**base, **best.changes}, _reference_at(ref, n, {}, middle), n, best.call, mu
            )
            if not match.ok:
                best.failures[f"{n} @ seq {middle}"] = match.why
            else:
                best.absorb(match)
        checked[middle] = mu
    if best.failures:
        result.notes.append(
            f"mu read as a line in image_seq_len fails between the sizes given: {best.failures}"
        )
        result.rejected.insert(0, result.fits.pop(0))
        return
    result.sizes = sorted({*result.sizes, *(s for s in checked if s is not None)})
    result.mu_rule = (
        "calculate_shift(image_seq_len, scheduler.config.base_image_seq_len, "
        "scheduler.config.max_image_seq_len, scheduler.config.base_shift, scheduler.config.max_shift)"
    )
    result.notes.append(
        f"mu = {format_number(slope, 6)} * image_seq_len + {format_number(m1 - slope * l1, 6)} (base_shift "
        f"{format_number(base_shift, 6)} at {lo}, max_shift {format_number(max_shift, 6)} at {hi}); "
        "calculate_shift is diffusers.pipelines.flux.pipeline_flux.calculate_shift"
    )


_GIVEN_KEYS = {
    "shift",
    "flow_shift",
    "final_sigmas_type",
    "use_flow_sigmas",
    "use_dynamic_shifting",
    "time_shift_type",
}


# classes tried when the requested one cannot reproduce the reference, by what the reference holds
_SIBLINGS = {
    "flow": ("FlowMatchEulerDiscreteScheduler", "FlowMatchHeunDiscreteScheduler"),
    "sigmas": (
        "EulerDiscreteScheduler",
        "HeunDiscreteScheduler",
        "LMSDiscreteScheduler",
        "KDPM2DiscreteScheduler",
        "DPMSolverMultistepScheduler",
        "UniPCMultistepScheduler",
        "DEISMultistepScheduler",
    ),
    "timesteps": (
        "DDIMScheduler",
        "DDPMScheduler",
        "PNDMScheduler",
        "EulerDiscreteScheduler",
        "DPMSolverMultistepScheduler",
    ),
}


def _explain_no_fit(
    result: FitResult,
    cls: type,
    base: dict,
    ref: Schedule,
    ref_n: Schedule,
    steps: int,
    train_steps: int,
    tried: list[Candidate],
    step_check: Any,
    variants: list[dict],
) -> None:
    r"""Nothing fits: the nearest candidate (a rejected fit first, else the smallest worst relative error at
    ``steps``), each difference that remains between its lists and the reference's, and the sibling classes
    whose own fit reproduces the reference (each found by a full fit, not assumed)."""
    from paritykit.schedule.compare import compare_schedules

    # a candidate is near only within 100% of the reference's values; a pasted list (the reference's own
    # values given to set_timesteps) is no config: how far it lands measures the units, not a near miss
    finite = [c for c in tried if math.isfinite(c.distance) and c.distance <= 1.0 and c.call.rank < 3]
    near = (
        result.rejected[0]
        if result.rejected
        else min(finite, key=lambda c: (c.distance, c.call.rank, len(c.changes)), default=None)
    )
    if near is not None:
        result.nearest = near
        config = {**base, **near.changes}
        try:
            got = lists_of(cls, config, steps, near.call, ref_n, _mu(config, ref_n))
        except Exception:  # noqa: BLE001 - a nearest that crashes has no lists to compare
            got = None
        if near.step_check is not None and not near.step_check.matched:
            result.differences.append(near.step_check.explanation)
        elif near.failures:
            result.differences += [f"at {n}: {w}" for n, w in near.failures.items()]
        elif got is not None:
            sides = {k: v for k in KINDS if (v := ref_n.get(k)) is not None and k in got}
            mine = Schedule(ref_n.source, **sides, integer=ref_n.integer, per_call=ref_n.per_call)
            port = {k: got[k] for k in sides}
            cmp = compare_schedules(mine, port, num_train_timesteps=train_steps)
            result.differences += [
                f"[{h.id}] {h.message} (A: the reference, B: {cls.__name__})" for h in cmp.hints
            ]
            result.differences += _interpolation(ref_n, got, cls, config)
    if near is None:
        return
    group = "timesteps" if not ref_n.sigmas else "sigmas"
    fam = family_of("sigmas", ref_n.sigmas, train_steps) if ref_n.sigmas else None
    if fam is not None and fam.name.startswith("flow"):
        group = "flow"
    for name in _SIBLINGS[group]:
        if name != cls.__name__:
            found = _sibling(name, near, base, ref, ref_n, steps, result, step_check, train_steps, variants)
            if found:
                result.elsewhere.append(found)


def _sibling(
    name: str,
    near: Candidate,
    base: dict,
    ref: Schedule,
    ref_n: Schedule,
    steps: int,
    result: FitResult,
    step_check: Any,
    train_steps: int,
    variants: list[dict],
) -> str | None:
    r"""The nearest candidate's config (the keys ``name`` accepts) in another class, validated like a fit: at
    every count and size, and by the step check when the request had one. A line saying it reproduces the
    reference, or ``None``."""
    try:
        other = resolve_scheduler(name)
        keys = accepted_keys(other)
    except ParityKitError:
        return None
    changes = {k: v for k, v in near.changes.items() if k in keys}
    config = {**{k: v for k, v in base.items() if k in keys}, **changes}
    call = near.call if near.call in calls_for(other, keys, ref_n) else DEFAULT_CALL
    sizes = result.sizes or [None]
    mu = _mu(config, ref_n)
    match = try_candidate(other, config, ref_n, steps, call, mu)
    if not match.ok:
        return None
    cand = Candidate(
        config_changes(config, keys, {}), call, [steps], mu={sizes[0]: mu} if mu is not None else {}
    )
    cand.absorb(match)
    for variant in variants or [{}]:
        cand.counts_matched, cand.failures = [steps], {}
        _validate(cand, other, {}, ref, result.counts, sizes, variant)
        if not cand.failures:
            break
    if cand.failures or cand.call.rank >= 3:  # any class that takes a list of timesteps takes the reference's
        return None
    cand.changes = {k: v for k, v in changes.items() if not same_config_value(keys.get(k), v)}
    probe = FitResult(name, steps, result.counts, result.reference, {}, [cand], [], 1)
    if step_check is not None and step_check is not False:
        run_step_check(
            probe,
            other,
            {k: v for k, v in base.items() if k in keys},
            keys,
            ref,
            ref_n,
            steps,
            step_check,
            train_steps,
        )
        if not probe.fits:
            return None
    checked = " (its step is not checked)" if cand.step_check is None and probe.step_checked else ""
    call_text = f"; {probe.call_line}" if probe.call_line else ""
    return f"{name} reproduces it: {probe.line}{call_text} — {cand.residual_text()}{checked}"


def _interpolation(ref: Schedule, got: dict[str, list[float]], cls: type, config: dict) -> list[str]:
    r"""Timesteps agree, sigmas do not: say which interpolation of the training sigmas at those timesteps each
    side follows (linear in sigma, as diffusers' ``np.interp``, or linear in log sigma, as k-diffusion's
    ``t_to_sigma``), when one of them does."""
    import numpy as np

    if not (ref.timesteps and ref.sigmas and got.get("timesteps") and got.get("sigmas")):
        return []
    n = min(len(ref.timesteps), len(got["timesteps"]))
    if not lists_close(ref.timesteps[:n], got["timesteps"][:n], "timesteps"):
        return []
    ac = getattr(make_scheduler(cls, config), "alphas_cumprod", None)
    if ac is None:
        return []
    train = ((1 - ac.double()) / ac.double()).sqrt().numpy()
    t = np.asarray(ref.timesteps[:n], dtype=np.float64)
    linear = np.interp(t, np.arange(len(train)), train)
    loglinear = np.exp(np.interp(t, np.arange(len(train)), np.log(train)))
    names = {
        "linear in sigma (np.interp)": linear,
        "linear in log sigma (k-diffusion's t_to_sigma)": loglinear,
    }

    def which(values: list[float]) -> str | None:
        return next((k for k, v in names.items() if lists_close(values[:n], list(v), "sigmas")), None)

    a, b = which(ref.sigmas), which(got["sigmas"])
    if a is None or b is None or a == b:
        return []
    return [
        "[interpolation] the timesteps agree but the sigmas at them do not: the reference interpolates the "
        f"training sigmas {a}, {cls.__name__} {b} (they differ where a timestep is fractional)"
    ]


def _minimal(fits: list[Candidate]) -> list[Candidate]:
    r"""Drop a fit whose changes include another fit's changes: the extra keys change nothing here."""
    kept = []
    for c in fits:
        items = set(map(str, c.changes.items()))
        if not any(
            o is not c and o.call == c.call and set(map(str, o.changes.items())) < items for o in fits
        ):
            kept.append(c)
    return kept
