r"""The two sides of a triage: the SPEC's modules, each side run once from one seed with every denoiser (and
decoder) call recorded, and the run's result as one tensor.

The SPEC defines ``run_reference()`` and ``run_port()`` (each runs its side's sampling end to end and returns
the result), ``reference_denoiser()`` and ``port_denoiser()`` (the modules those runs call once per step), and
optionally ``reference_vae()`` / ``port_vae()`` (the decoder modules), ``port_scheduler()`` (the port's
scheduler object, for the schedule fit), ``TOLERANCE`` and ``SEED``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Literal

from paritykit.base.errors import ParityKitError
from paritykit.base.usercode import Spec
from paritykit.tracing.recording import Call

Side = Literal["reference", "port"]
REQUIRED = ("run_reference", "run_port", "reference_denoiser", "port_denoiser")


@dataclass
class SideRun:
    r"""One side's run: its denoiser and decoder modules, their recorded calls, and the run's result."""

    side: Side
    denoiser: Any
    vae: Any
    calls: list[Call]
    decoder_calls: list[Call]
    result: Any
    seed: int | None = None  # torch's global seed before the run


def check_required(spec: Spec) -> None:
    r"""One line naming every function the SPEC lacks."""
    missing = [name for name in REQUIRED if not spec.has(name)]
    if missing:
        raise ParityKitError(
            f"{spec.path}: defines no {', '.join(f'{m}()' for m in missing)}; see `paritykit triage --help`"
        )


def spec_module(spec: Spec, name: str) -> Any:
    r"""``name()`` of the SPEC, which must return a ``torch.nn.Module``."""
    import torch

    module = spec.call(name)
    if not isinstance(module, torch.nn.Module):
        raise ParityKitError(f"{spec.path}: {name}() returned {type(module).__name__}, not a torch.nn.Module")
    return module


def run_side(spec: Spec, side: Side, seed: int) -> SideRun:
    r"""Seed torch, run ``run_{side}()`` with every call of the side's denoiser (and decoder) recorded; a
    SPEC written for scripts (``{side}_script()``) runs the script, which finds and records its denoiser
    (:mod:`~paritykit.triage.scripts`)."""
    import torch

    from paritykit.tracing.recording import record_calls

    if spec.has(f"{side}_script"):
        torch.manual_seed(seed)
        with torch.no_grad():
            run = spec.call(f"{side}_script")
        return SideRun(
            side, run.denoiser, None, run.calls, [], result_tensor(run.result, str(run.script), spec), seed
        )
    denoiser = spec_module(spec, f"{side}_denoiser")
    vae = spec_module(spec, f"{side}_vae") if spec.has(f"{side}_vae") else None
    torch.manual_seed(seed)
    with torch.no_grad(), record_calls(denoiser) as calls, contextlib.ExitStack() as stack:
        decoder_calls = stack.enter_context(record_calls(vae)) if vae is not None else []
        result = spec.call(f"run_{side}")
    if not calls:
        raise ParityKitError(
            f"{spec.path}: no call of {side}_denoiser()'s module was recorded during run_{side}() (calls are"
            " recorded by its forward hooks: one through .forward() directly, or on another copy of the"
            " module, is not seen)"
        )
    result = result_tensor(result, f"run_{side}()", spec)
    return SideRun(side, denoiser, vae, calls, decoder_calls, result, seed)


def result_tensor(value: Any, what: str, spec: Spec) -> Any:
    r"""A run's result as one tensor: a pipeline output's ``images`` / ``sample`` / ``latents``, the first
    item of a ``return_dict=False`` tuple, a list of images or tensors stacked, a numpy array as is."""
    import numpy as np
    import torch

    for attr in ("images", "sample", "latents"):
        if hasattr(value, attr) and not isinstance(value, torch.Tensor):
            value = getattr(value, attr)
    if isinstance(value, tuple) and value:
        value = value[0]
    try:
        if isinstance(value, list) and value:
            value = [v if isinstance(v, torch.Tensor) else torch.as_tensor(np.array(v)) for v in value]
            value = torch.stack(value)
        return torch.as_tensor(value if isinstance(value, torch.Tensor) else np.array(value)).detach()
    except (TypeError, ValueError, RuntimeError):
        raise ParityKitError(
            f"{spec.path}: {what} returned {type(value).__name__}, which is not a tensor, array or list of"
            " images"
        ) from None


def leading_unpaired(ref: SideRun, port: SideRun, tol: Any) -> tuple[SideRun, SideRun, str]:
    r"""Where one side makes ``d`` more denoiser calls and no grouping pairs them, the ``k ≤ d`` first calls
    of that side that pair with none of the other's: the one ``k`` at which its call ``k`` gets the latents
    the other side's first call gets (within ``tol``, same shape), where its call 0 does not (a prefix or
    warm-up call before the loop). Returns both runs with those calls left out and the words saying so, or
    the runs as they are and ``""``."""
    import dataclasses

    import torch

    from paritykit.triage.roles import latents, roles_of

    longer, shorter = (ref, port) if len(ref.calls) > len(port.calls) else (port, ref)
    extra = len(longer.calls) - len(shorter.calls)
    if not extra or not shorter.calls:
        return ref, port, ""
    first = latents(shorter.calls[0], roles_of(shorter.calls[0]))

    def agrees(call: Any) -> bool:
        mine = latents(call, roles_of(call))
        if not isinstance(mine, torch.Tensor) or not isinstance(first, torch.Tensor):
            return False
        if mine.shape != first.shape:
            return False
        return bool(torch.allclose(mine.double(), first.double(), atol=tol.atol or 0.0, rtol=tol.rtol or 0.0))

    if agrees(longer.calls[0]):
        return ref, port, ""
    found = [k for k in range(1, extra + 1) if agrees(longer.calls[k])]
    if len(found) != 1:
        return ref, port, ""
    k, n, m = found[0], len(longer.calls), len(shorter.calls)
    other = "port" if longer.side == "reference" else "reference"
    first_calls = "first call" if k == 1 else f"first {k} calls"
    words = (
        f"the {longer.side}'s {first_calls} (of {n}) pair{'s' if k == 1 else ''} with no {other} call: its"
        f" calls {k}-{n - 1} are compared with the {other}'s 0-{m - 1} (the {other}'s first call gets the"
        f" latents its call {k} gets, not those of its call 0)"
    )
    trimmed = dataclasses.replace(longer, calls=longer.calls[k:])
    return (trimmed, shorter, words) if longer is ref else (shorter, trimmed, words)
