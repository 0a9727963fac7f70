r"""The step check (``--step-check``): one scheduler step on recorded inputs, compared with the reference
loop's own update."""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.minimize import least_squares
from paritykit.base.report import format_number
from paritykit.schedule.load import (
    Schedule,
    load_schedule,
)
from paritykit.schedule.schedulers import (
    DEFAULT_CALL,
    Call,
    config_changes,
    make_scheduler,
    python_literal,
    set_with,
)


@dataclass
class StepCheck:
    r"""One ``step()`` of the scheduler against the reference's update, given the same model output."""

    matched: bool
    steps_checked: int
    first_failing_step: int | None = None
    max_abs: float | None = None
    quantity: str | None = None
    reference_value: float | None = None
    scheduler_value: float | None = None
    explanation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# --- step check
# --------------------------------------------------------------------------------------------------
def _ddim_like(cls: type, keys: dict[str, Any]) -> bool:
    return "set_alpha_to_one" in keys


def _reference_updates(ref: Schedule, ref_n: Schedule, steps: int, source: Any, shape=(1, 4, 8, 8)):
    r"""Yield ``(i, x, eps, x_next)`` of the reference loop: from a SPEC's ``ref_step`` on seeded random
    tensors, or from a pipeline's checkpoint folder (``preloop``/``after_step_{i}`` latents + model output).
    A ``record_loop`` folder is stepped in lockstep instead (:func:`_check_calls`)."""
    import torch

    from paritykit.base.usercode import call_user

    spec = ref.spec
    if source is not True and isinstance(source, (str, Path)) and Path(source).suffix == ".py":
        spec = load_schedule(source).spec
    if spec is not None:
        if not hasattr(spec.module, "ref_step"):
            raise ParityKitError(f"SPEC {spec.path}: define ref_step(x, eps, t, t_prev) for --step-check")
        values = ref_n.timesteps if ref_n.timesteps is not None else ref_n.sigmas
        gen = torch.Generator().manual_seed(0)
        for i in range(steps):
            x = torch.randn(shape, generator=gen, dtype=torch.float64)
            eps = torch.randn(shape, generator=gen, dtype=torch.float64)
            t_prev = values[i + 1] if i + 1 < len(values) else None
            out = call_user(
                spec.module.ref_step,
                x.clone(),
                eps.clone(),
                values[i],
                t_prev,
                what=f"ref_step at step {i}",
                spec=spec,
            )
            yield i, x.float(), eps.float(), torch.as_tensor(out).float()
        return
    if source is True or not Path(source).is_dir():
        raise ParityKitError(
            "--step-check: give a SPEC .py with ref_step, or the reference's checkpoint folder"
        )
    from paritykit.tracing.checkpoints import load_checkpoints

    ck = load_checkpoints(source)
    outputs = ("noise_pred", "model_output", "output", "eps")

    def pick(data: dict, names: Sequence[str]) -> Any:
        return next((data[n] for n in names if n in data), None)

    if "after_step_0" in ck:
        x = pick(ck.get("preloop", {}).data if "preloop" in ck else {}, ("latents", "sample"))
        for i in range(steps):
            data = ck.get(f"after_step_{i}")
            if data is None or x is None:
                return
            eps, nxt = pick(data.data, outputs), pick(data.data, ("latents", "sample"))
            if eps is None or nxt is None:
                raise ParityKitError(
                    f"{source}: after_step_{i} needs the latents and the model output ({', '.join(outputs)})"
                )
            yield i, x.float(), eps.float(), nxt.float()
            x = nxt
        return


def _implied(kind: str, x, eps, nxt, alpha_t: float | None) -> tuple[float, float]:
    r"""The one number an update depends on — the previous alpha (DDIM-like) or the coefficient of the model
    output (sigma_next - sigma in an Euler step on a velocity) — and the
    share of the update that reading leaves unexplained (large: the update is not of that form at all)."""
    import torch

    if kind == "previous alpha":
        x0 = (x - (1 - alpha_t) ** 0.5 * eps) / alpha_t**0.5
        basis = torch.stack([x0.reshape(-1), eps.reshape(-1)], 1).double()
        target = nxt.reshape(-1).double()
        if not (bool(torch.isfinite(basis).all()) and bool(torch.isfinite(target).all())):
            return (
                math.nan,
                math.inf,
            )  # a non-finite recorded tensor: no reading, the update "differs in form"
        coef = least_squares(basis, target)
        resid = float((basis @ coef - target).norm() / target.norm().clamp_min(1e-30))
        p, q = (float(v) for v in coef.reshape(-1))
        resid = max(resid, abs(p * p + q * q - 1))  # sqrt(a)² + sqrt(1 - a)² must be 1
        return p * p, resid
    d = eps.reshape(-1).double()
    step = (nxt - x).reshape(-1).double()
    dt = float((step @ d) / (d @ d))
    return dt, float((step - dt * d).norm() / step.norm().clamp_min(1e-30))


def _check_one(
    cls: type,
    config: dict[str, Any],
    steps: int,
    updates: list,
    keys: dict,
    call: Call = DEFAULT_CALL,
    ref: Schedule | None = None,
    mu: float | None = None,
) -> StepCheck:
    scheduler = make_scheduler(cls, config)
    set_with(scheduler, steps, call, ref, mu)
    alpha_based = getattr(scheduler, "sigmas", None) is None and hasattr(scheduler, "alphas_cumprod")
    checked = 0
    for i, x, eps, nxt in updates:
        t = scheduler.timesteps[i]
        kwargs = {"eta": 0.0} if "eta" in inspect.signature(scheduler.step).parameters else {}
        if hasattr(scheduler, "scale_model_input") and not alpha_based:
            scheduler.scale_model_input(x, t)  # marks the input as scaled; the step itself reads x as given
        out = scheduler.step(eps, t, x, return_dict=False, **kwargs)[0]
        checked += 1
        err = float((out - nxt).abs().max())
        if not err <= 1e-4 * max(1.0, float(nxt.abs().max())):
            return _mismatch(cls, scheduler, i, t, err, x, eps, nxt, out, checked)
    return StepCheck(True, checked)


# keys that change the update but not the lists, each with the bounded values tried and the quantity it sets
_STEP_AXES: dict[str, tuple[tuple[Any, ...], str]] = {
    "lower_order_final": ((True, False), "the order used at the last steps"),
    "euler_at_final": ((False, True), "the order used at the last step"),
    "final_sigmas_type": (
        ("zero", "sigma_min"),
        "the final sigma (the last update goes to 0 or to sigma_min)",
    ),
    "solver_order": ((1, 2, 3), "how many previous model outputs the update keeps (its order)"),
    "solver_type": (("midpoint", "heun", "bh1", "bh2"), "the second-order formula"),
    "algorithm_type": (("dpmsolver++", "dpmsolver"), "whether the solver steps in x0 or in the model output"),
    "predict_x0": ((True, False), "whether the update is written in x0"),
    "set_alpha_to_one": ((False, True), "the final alpha"),
    "clip_sample": ((False, True), "x0 clipping"),
    "prediction_type": (
        ("epsilon", "v_prediction", "sample"),
        "what the model output is read as (the noise, the velocity or the clean sample)",
    ),
}
_STOCHASTIC = ("sde-dpmsolver", "sde-dpmsolver++")


def _step_variants(cls: type, keys: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]]:
    r"""Partial configs over :data:`_STEP_AXES` that differ from ``base`` in at most two keys, fewest
    first."""
    now = {k: base.get(k, keys[k]) for k in _STEP_AXES if k in keys}
    singles = [{k: v} for k in now for v in _STEP_AXES[k][0] if v != now[k]]
    pairs = [{**a, **b} for a, b in itertools.combinations(singles, 2) if a.keys() != b.keys()]
    return [{}, *singles, *pairs]


@dataclass
class Recorded:
    r"""A ``record_loop`` folder: each call's ``(denoiser input, model output)`` and the loop's result
    (``final``, when the loop handed it to ``Recording.final``)."""

    calls: list[tuple[Any, Any]]
    final: Any = None


def _recorded_calls(source: Any) -> Recorded | str | None:
    r"""A ``record_loop`` folder's calls; ``None`` when ``source`` is not one, a sentence when its calls
    cannot drive the step (a guidance batch, a sigma-taking wrapper)."""
    if source is True or not isinstance(source, (str, Path)) or not Path(source).is_dir():
        return None
    from paritykit.tracing.checkpoints import load_checkpoints

    ck = load_checkpoints(source)
    if "step_0" not in ck or "after_step_0" in ck:
        return None
    if "preloop" in ck and "sigmas" in ck["preloop"].data:
        return (
            "the recorded denoiser takes sigma (a k-diffusion-style wrapper, whose output is its own x0"
            " estimate): record the network inside it, whose input the scheduler scales and whose output"
            " step() reads"
        )
    calls = []
    while f"step_{len(calls)}" in ck:
        i, data = len(calls), ck[f"step_{len(calls)}"].data
        sample = next((data[k] for k in _SAMPLE_NAMES if k in data), None)
        if sample is None or "output" not in data:
            return f"step_{i} holds no denoiser input ({', '.join(_SAMPLE_NAMES)}) or no output"
        half = sample.shape[0] // 2
        if half and sample.shape[0] == 2 * half and bool((sample[:half] == sample[half:]).all()):
            return (
                "the recorded calls batch the latents twice (classifier-free guidance), so the guided output "
                "step() used is not in the folder: record the loop with guidance off"
            )
        output = data["output"]
        if not _steppable(tuple(sample.shape), tuple(output.shape)):
            # round 30: a weighted objective's network returns noise, x0 and their weights; the loop mixes
            # them into what step() reads, which no recorded call holds
            return (
                f"the denoiser's output {tuple(output.shape)} is not shaped like its latents"
                f" {tuple(sample.shape)}: the loop turns it into what step() reads, which the recorded calls"
                " do not hold"
            )
        calls.append((sample.float(), output.float()))
    final = ck["final"].data.get("latents") if "final" in ck else None
    return Recorded(calls, None if final is None else final.float())


_SAMPLE_NAMES = ("sample", "hidden_states", "x", "latents", "input", "arg0")


def _steppable(sample: tuple[int, ...], output: tuple[int, ...]) -> bool:
    r"""Whether ``step()`` can read a model output of shape ``output`` for latents of shape ``sample``: the
    same shape, or twice the channels (a learned variance the scheduler splits off)."""
    if output == sample:
        return True
    return (
        len(output) == len(sample) > 1
        and output[0] == sample[0]
        and output[2:] == sample[2:]
        and (output[1] == 2 * sample[1])
    )


def lockstep(scheduler: Any, source: Any) -> StepCheck | str:
    r"""The scheduler object as it is (its own config, one ``set_timesteps(n)`` for the n recorded calls)
    stepped in lockstep with a ``record_loop`` folder: each ``step()`` fed the reference's model output at
    the reference's latents. A sentence instead when the folder's calls cannot drive the step."""
    recorded = _recorded_calls(source)
    if recorded is None:
        return f"{source} is not a record_loop folder"
    if isinstance(recorded, str):
        return recorded
    try:
        return _check_calls(type(scheduler), dict(scheduler.config), len(recorded.calls), recorded)
    except Exception as exc:  # a scheduler that cannot run these steps: said, not raised
        return f"{type(scheduler).__name__}.step() failed on the recorded calls ({type(exc).__name__}: {exc})"


def _check_calls(
    cls: type,
    config: dict[str, Any],
    steps: int,
    recorded: Recorded,
    call: Call = DEFAULT_CALL,
    ref: Schedule | None = None,
    mu: float | None = None,
) -> StepCheck:
    r"""Step ``cls`` in lockstep with a recorded loop: before call ``j`` the scheduler's input scaling is
    undone to read the loop's state, the previous ``step()`` must have produced it, and ``step()`` is fed call
    ``j``'s own model output, so a multistep solver's history is the reference's. The last update is checked
    against the loop's ``final`` result when the folder has it."""
    import torch

    calls = recorded.calls
    scheduler = make_scheduler(cls, config)
    set_with(scheduler, steps, call, ref, mu)
    timesteps = scheduler.timesteps
    if len(timesteps) != len(calls):
        return StepCheck(
            False,
            0,
            explanation=(
                f"the folder holds {len(calls)} denoiser calls, {cls.__name__} "
                f"makes {len(timesteps)} at {steps} steps"
            ),
        )
    kwargs = {"eta": 0.0} if "eta" in inspect.signature(scheduler.step).parameters else {}
    expected = previous = None
    for j, (t, (sample, output)) in enumerate(zip(timesteps, calls)):
        x = sample
        if hasattr(scheduler, "scale_model_input"):
            x = sample / scheduler.scale_model_input(torch.ones_like(sample), t)
        if expected is not None:
            err = float((expected - x).abs().max())
            if not err <= 1e-4 * max(1.0, float(x.abs().max())):
                return _mismatch(cls, scheduler, j - 1, timesteps[j - 1], err, *previous, x, expected, j - 1)
        previous = (x, output)
        expected = scheduler.step(output, t, x, return_dict=False, **kwargs)[0]
    if recorded.final is None:
        return StepCheck(True, len(calls) - 1)
    err = float((expected - recorded.final).abs().max())
    if not err <= 1e-4 * max(1.0, float(recorded.final.abs().max())):
        j = len(calls) - 1
        return _mismatch(cls, scheduler, j, timesteps[j], err, *previous, recorded.final, expected, j)
    return StepCheck(True, len(calls))


def _mismatch(
    cls: type, scheduler: Any, i: int, t: Any, err: float, x, eps, nxt, out, checked: int
) -> StepCheck:
    r"""The failing update ``i``, read as one number when one number accounts for it (else the share no one
    number accounts for, and a lead)."""
    alpha_based = getattr(scheduler, "sigmas", None) is None and hasattr(scheduler, "alphas_cumprod")
    # what is read off the updates, named as measured: a flow step's coefficient of the model output is
    # sigma_next - sigma only where the output is the velocity the step integrates (round 17: a research loop
    # turning an x1 prediction into a cosine path's velocity scales it by pi/2 on the same sigmas)
    quantity = "previous alpha" if alpha_based else "coefficient of the model output"
    alpha_t = float(scheduler.alphas_cumprod[int(t)]) if alpha_based else None
    if eps.shape != x.shape:  # a learned variance in the second half of the channels: step() reads the first
        eps = eps[:, : x.shape[1]]
    ref_v, ref_r = _implied(quantity, x, eps, nxt, alpha_t)
    port_v, port_r = _implied(quantity, x, eps, out, alpha_t)
    head = (
        f"the lists match, the update at step {i} (t={format_number(float(t))}) does not (max_abs"
        f" {format_number(err)})"
    )
    if max(ref_r, port_r) > 1e-3:
        # one number cannot account for it: say so instead of naming a quantity that is not the cause
        return StepCheck(
            False,
            checked,
            i,
            err,
            None,
            None,
            None,
            f"{head}; no one {quantity} read from the updates accounts for both (unexplained share"
            f" {format_number(max(ref_r, port_r))}); lead: the step rules (solver, x0 clipping,"
            " prediction_type) or the noise levels behind them (betas, sigmas) differ",
        )
    where = ""
    if alpha_based:
        ac = scheduler.alphas_cumprod.double()

        def at(v: float) -> str:
            if abs(v - 1) < 1e-4:
                return "1 (final alpha)"
            j = int((ac - v).abs().argmin())
            return f"ᾱ[t={j}]" if abs(float(ac[j]) - v) <= 1e-3 * v else "no training timestep"

        where = f" — reference ≈ {at(ref_v)}, {cls.__name__} ≈ {at(port_v)}"
    return StepCheck(
        False,
        checked,
        i,
        err,
        quantity,
        ref_v,
        port_v,
        f"{head}: {quantity} {format_number(ref_v)} (reference) vs {format_number(port_v)} "
        f"({cls.__name__}){where}",
    )


def run_step_check(result: Any, cls, base, keys, ref, ref_n, steps, source, train_steps) -> None:
    result.step_checked = True
    calls = _recorded_calls(source)
    name = cls.__name__
    if isinstance(calls, str):
        result.notes.append(f"--step-check: not checked: {calls}")
        return
    stochastic = (
        "Ancestral" in name or "SDE" in name or str(base.get("algorithm_type", "")).startswith(_STOCHASTIC)
    )
    if stochastic:
        result.notes.append(
            f"--step-check: {name} is not checked: its step draws fresh noise, which no "
            "recording holds; schedule only"
        )
        return
    if calls is None and name.startswith(("Heun", "KDPM2")):
        result.notes.append(
            f"--step-check: {name} makes two denoiser calls per step; check it against a "
            "record_loop folder of every call, not one update per step"
        )
        return
    if _ddim_like(cls, keys) and train_steps % steps:
        result.warnings.append(
            f"{name} steps back by the fixed stride {train_steps}//{steps} = {train_steps // steps} "
            f"(num_train_timesteps {train_steps} is not a multiple of {steps}): its previous timestep is not "
            "the next entry of its own list"
        )
    if calls is not None:
        n = len(calls.calls)
        if n < 2 and calls.final is None:
            result.notes.append("--step-check: the folder records fewer than two calls: no update to check")
            return

        def check(config: dict, cand: Any) -> StepCheck:
            mu = next(iter(cand.mu.values()), None)
            try:
                return _check_calls(cls, config, steps, calls, cand.call, ref_n, mu)
            except (RuntimeError, ValueError, IndexError) as exc:  # a step that cannot take these outputs
                return StepCheck(
                    False,
                    0,
                    explanation=f"{name}.step() failed on the recorded calls ({type(exc).__name__}: {exc})",
                )

        if calls.final is None:
            result.notes.append(
                f"--step-check: {n - 1} of {n} updates checked in lockstep with the recorded loop; the last"
                " one (where the final sigma and the last step's order act) needs the loop's result: `with"
                " record_loop(...) as rec: rec.final(sampler(...))`"
            )
    else:
        updates = list(_reference_updates(ref, ref_n, steps, source))
        if not updates:
            result.notes.append("--step-check: no reference update found to check against")
            return

        def check(config: dict, cand: Any) -> StepCheck:
            mu = next(iter(cand.mu.values()), None)
            return _check_one(cls, config, steps, updates, keys, cand.call, ref_n, mu)

    variants = _step_variants(cls, keys, base)
    good, bad = [], []
    for cand in result.fits:
        first, fixes = None, []
        for more in variants:
            if fixes and len(more) > len(fixes[0][0]):
                break  # every fix with the fewest changes is known
            try:
                with (
                    warnings.catch_warnings()
                ):  # deprecated values (algorithm_type="dpmsolver") are still tried
                    warnings.simplefilter("ignore", FutureWarning)
                    found = check({**base, **cand.changes, **more}, cand)
            except Exception:  # a value this class refuses (solver_type="bh1" on DPM-Solver): not a candidate
                if not more:
                    raise
                continue
            first = first or found
            if found.matched:
                fixes.append((config_changes(more, keys, base), found))
        if fixes:
            changed, found = fixes[0]
            cand.changes.update(changed)
            if changed:
                found.quantity = "; ".join(_STEP_AXES[k][1] for k in changed)
                found.explanation = _fixed_by(first, [c for c, _ in fixes])
        else:
            found = first
            tried = [k for k in _STEP_AXES if k in keys]
            if tried:
                found.explanation += (
                    f"; no value of {', '.join(tried)} (up to two changed at once) reproduces "
                    "every update: none of them, alone or in pairs, is the cause"
                )
        cand.step_check = found
        (good if found.matched else bad).append(cand)
    result.fits = good
    result.rejected = bad + result.rejected


def _fixed_by(first: StepCheck, fixes: list[dict[str, Any]]) -> str:
    r"""Each fix replay verified, and the quantity it sets. More than one fix: the recording cannot tell them
    apart, and the sentence says so instead of choosing."""

    def text(changed: dict[str, Any]) -> str:
        what = ", ".join(f"{k}={python_literal(v)}" for k, v in changed.items())
        return f"{what} ({'; '.join(_STEP_AXES[k][1] for k in changed)})"

    at = f"at step {first.first_failing_step}" if first.first_failing_step is not None else "as fitted"
    head = f"the update differs {at} with the config as fitted"
    if len(fixes) == 1:
        return f"{head}; {text(fixes[0])} reproduces every checked update"
    return (
        f"{head}; each of {' / '.join(text(f) for f in fixes)} reproduces every checked update (this "
        "recording cannot tell them apart; the first is proposed)"
    )
