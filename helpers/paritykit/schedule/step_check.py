r"""The step check (``--step-check``): one scheduler step on recorded inputs, compared with the reference
loop's own update."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.base.report import format_number
from paritykit.schedule.load import (
    Schedule,
    load_schedule,
)
from paritykit.schedule.schedulers import DEFAULT_CALL, Call, _changes, _make, set_with


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


# --- step check --------------------------------------------------------------------------------------------------
def _ddim_like(cls: type, keys: dict[str, Any]) -> bool:
    return "set_alpha_to_one" in keys


def _reference_updates(ref: Schedule, ref_n: Schedule, steps: int, source: Any, shape=(1, 4, 8, 8)):
    r"""Yield ``(i, x, eps, x_next)`` of the reference loop: from a SPEC's ``ref_step`` on seeded random
    tensors, or from a checkpoint folder (``preloop``/``after_step_{i}`` latents + model output, or a
    ``record_loop`` folder's ``step_{i}`` sample/output)."""
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
            out = call_user(spec.module.ref_step, x.clone(), eps.clone(), values[i], t_prev,
                            what=f"ref_step at step {i}", spec=spec)  # fmt: skip
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
                raise ParityKitError(f"{source}: after_step_{i} needs the latents and the model output "
                                     f"({', '.join(outputs)})")  # fmt: skip
            yield i, x.float(), eps.float(), nxt.float()
            x = nxt
        return
    for i in range(steps - 1):
        a, b = ck.get(f"step_{i}"), ck.get(f"step_{i + 1}")
        if a is None or b is None:
            return
        yield i, a.data["sample"].float(), a.data["output"].float(), b.data["sample"].float()


def _implied(kind: str, x, eps, nxt, alpha_t: float | None) -> tuple[float, float]:
    r"""The one number an update depends on — the previous alpha (DDIM-like) or sigma_next - sigma — and the
    share of the update that reading leaves unexplained (large: the update is not of that form at all)."""
    import torch

    if kind == "previous alpha":
        x0 = (x - (1 - alpha_t) ** 0.5 * eps) / alpha_t**0.5
        basis = torch.stack([x0.reshape(-1), eps.reshape(-1)], 1).double()
        target = nxt.reshape(-1, 1).double()
        coef = torch.linalg.lstsq(basis, target).solution
        resid = float((basis @ coef - target).norm() / target.norm().clamp_min(1e-30))
        p, q = (float(v) for v in coef.reshape(-1))
        resid = max(resid, abs(p * p + q * q - 1))  # sqrt(a)² + sqrt(1 - a)² must be 1
        return p * p, resid
    d = eps.reshape(-1).double()
    step = (nxt - x).reshape(-1).double()
    dt = float((step @ d) / (d @ d))
    return dt, float((step - dt * d).norm() / step.norm().clamp_min(1e-30))


def _check_one(cls: type, config: dict[str, Any], steps: int, updates: list, keys: dict, call: Call = DEFAULT_CALL,
               ref: Schedule | None = None, mu: float | None = None) -> StepCheck:  # fmt: skip
    scheduler = _make(cls, config)
    set_with(scheduler, steps, call, ref, mu)
    alpha_based = getattr(scheduler, "sigmas", None) is None and hasattr(scheduler, "alphas_cumprod")
    quantity = "previous alpha" if alpha_based else "sigma_next - sigma"
    checked = 0
    for i, x, eps, nxt in updates:
        t = scheduler.timesteps[i]
        kwargs = {"eta": 0.0} if "eta" in inspect.signature(scheduler.step).parameters else {}
        if hasattr(scheduler, "scale_model_input") and not alpha_based:
            scheduler.scale_model_input(x, t)  # marks the input as scaled; the step itself reads x as given
        out = scheduler.step(eps, t, x, return_dict=False, **kwargs)[0]
        checked += 1
        err = float((out - nxt).abs().max())
        if err <= 1e-4 * max(1.0, float(nxt.abs().max())):
            continue
        alpha_t = float(scheduler.alphas_cumprod[int(t)]) if alpha_based else None
        ref_v, ref_r = _implied(quantity, x, eps, nxt, alpha_t)
        port_v, port_r = _implied(quantity, x, eps, out, alpha_t)
        head = f"the lists match, the update at step {i} (t={format_number(float(t))}) does not (max_abs {format_number(err)})"
        if max(ref_r, port_r) > 1e-3:
            # one number cannot account for it: say so instead of naming a quantity that is not the cause
            return StepCheck(False, checked, i, err, None, None, None,
                             f"{head}; the two updates differ in form, not by one {quantity} (unexplained "
                             f"share {format_number(max(ref_r, port_r))}): compare the step rules themselves "
                             "(solver, x0 clipping, prediction_type)")  # fmt: skip
        where = ""
        if alpha_based:
            ac = scheduler.alphas_cumprod.double()

            def at(v: float, ac=ac) -> str:
                if abs(v - 1) < 1e-4:
                    return "1 (final alpha)"
                j = int((ac - v).abs().argmin())
                return f"ᾱ[t={j}]" if abs(float(ac[j]) - v) <= 1e-3 * v else "no training timestep"

            where = f" — reference ≈ {at(ref_v)}, {cls.__name__} ≈ {at(port_v)}"
        return StepCheck(
            False, checked, i, err, quantity, ref_v, port_v,
            f"{head}: {quantity} {format_number(ref_v)} (reference) vs {format_number(port_v)} "
            f"({cls.__name__}){where}",
        )  # fmt: skip
    return StepCheck(True, checked)


def _recorded_inputs_are_scaled(cls: type, base: dict[str, Any], steps: int, source: Any) -> bool:
    import torch

    if source is True or not isinstance(source, (str, Path)) or not Path(source).is_dir():
        return False
    from paritykit.base.io import read_manifest

    names = {entry.get("name") for entry in read_manifest(Path(source))["checkpoints"]}
    if "step_0" not in names or "after_step_0" in names:
        return False
    scheduler = _make(cls, base)
    if not hasattr(scheduler, "scale_model_input"):
        return False
    scheduler.set_timesteps(steps)
    x = torch.ones(1, 1, 2, 2)
    return not torch.equal(scheduler.scale_model_input(x, scheduler.timesteps[0]), x)


def _run_step_check(result: Any, cls, base, keys, ref, ref_n, steps, source, train_steps) -> None:
    result.step_checked = True
    if "Ancestral" in cls.__name__ or cls.__name__.startswith(("Heun", "KDPM2")):
        result.notes.append(f"--step-check: {cls.__name__} is not checked (a stochastic or two-call step); "
                            "schedule only")  # fmt: skip
        return
    if _ddim_like(cls, keys) and train_steps % steps:
        result.warnings.append(
            f"{cls.__name__} steps back by the fixed stride {train_steps}//{steps} = {train_steps // steps} "
            f"(num_train_timesteps {train_steps} is not a multiple of {steps}): its previous timestep is not "
            "the next entry of its own list"
        )
    if _recorded_inputs_are_scaled(cls, base, steps, source):
        result.notes.append(
            f"--step-check: {cls.__name__} scales the denoiser's input (scale_model_input), so a record_loop "
            "folder holds scaled samples, not the loop's latents; check with a SPEC's ref_step or the pipeline's "
            "after_step_<i> checkpoints instead"
        )
        return
    updates = list(_reference_updates(ref, ref_n, steps, source))
    if not updates:
        result.notes.append("--step-check: no reference update found to check against")
        return
    # keys that change the update but not the lists, each with its bounded values
    step_axes = [[{k: v} for v in (False, True)] for k in ("set_alpha_to_one", "clip_sample") if k in keys]
    extra = [{k: v for part in combo for k, v in part.items()} for combo in itertools.product(*step_axes)]
    extra.sort(key=lambda more: len(_changes(more, keys, base)))
    good, bad = [], []
    for cand in result.fits:
        checks = []
        for more in extra:
            config = {**base, **cand.changes, **more}
            mu = next(iter(cand.mu.values()), None)
            check = _check_one(cls, config, steps, updates, keys, cand.call, ref_n, mu)
            checks.append((more, check))
            if check.matched:
                break
        more, check = next(((m, c) for m, c in checks if c.matched), checks[0])
        cand.changes.update(_changes(more, keys, base))
        cand.step_check = check
        (good if check.matched else bad).append(cand)
    result.fits = good
    result.rejected = bad + result.rejected
    if bad and not good:
        first = bad[0].step_check
        result.notes.append(
            f"no config of {cls.__name__} reproduces the reference's step: {first.explanation}"
        )
