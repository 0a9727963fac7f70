r"""Record a sampling loop you cannot edit: every call of its denoiser becomes a checkpoint.

Research samplers do not take ``_checkpoints``, and a reference's code is left alone. :func:`record_loop` puts
a forward hook on the denoiser (nothing is patched or wrapped) and writes, in the
:func:`paritykit.save_checkpoints` format:

* ``preloop``: the first call's inputs, plus ``timesteps`` (or ``sigmas``) — the value of the timestep
  argument at every call, in order;
* ``step_{i}``: the inputs of call ``i`` by argument name (``sample``, ``timestep``, ``encoder_hidden_states``
  …; positional arguments are named from the forward's signature, else ``arg{k}``) and its ``output``;
* ``final``: the loop's result, when it is handed to :meth:`Recording.final` (no denoiser call sees it, and
  the step check needs it to verify the last update: the final sigma, the order of the last step).

Both sides recorded this way feed ``paritykit compare``, ``paritykit steps --key output`` and
``paritykit schedule`` directly. :func:`record_calls` is the in-memory recorder underneath: every call's
arguments and output, kept as copies, for code that replays them (``paritykit triage``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError

# argument names read as the timestep (or the sigma) of a call, most specific first
TIMESTEP_NAMES = (
    "timestep",
    "timesteps",
    "t",
    "time",
    "sigma",
    "sigmas",
    "noise_level",
    "diffusion_step",
    "diffusion_steps",
    "time_step",
    "noise_labels",
)


def batch_of(value: Any) -> Any:
    r"""The batch an argument holds: a tensor itself; a list or tuple of per-sample tensors of one shape
    stacked (research code passes ``x`` as a list of samples); ``None`` for anything else."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(v, torch.Tensor) for v in value)
        and len({(tuple(v.shape), v.dtype) for v in value}) == 1
    ):
        return torch.stack(list(value))
    return None


def in_form_of(template: Any, batch: Any) -> Any:
    r"""``batch`` given the form of ``template``: a list of per-sample tensors when ``template`` is one (each
    in its dtype), else a tensor in ``template``'s dtype."""
    import torch

    if isinstance(template, (list, tuple)) and template and isinstance(template[0], torch.Tensor):
        return type(template)(b.to(t.dtype) for b, t in zip(batch.unbind(0), template))
    return batch.to(template.dtype) if isinstance(template, torch.Tensor) else batch


def tensor_leaves(value: Any, prefix: str) -> tuple[dict[str, Any], list[str]]:
    r"""Every tensor and number inside an argument, at any depth, by dotted path (``x.0``, ``added.text``),
    and the paths of what is neither (an object that cannot be recorded), each with its type."""
    import torch

    found: dict[str, Any] = {}
    skipped: list[str] = []
    if isinstance(value, torch.Tensor) or (
        isinstance(value, (int, float, str)) and not isinstance(value, bool)
    ):
        found[prefix] = value
    elif isinstance(value, bool) or value is None:
        pass  # a flag or an absent argument: nothing to record, nothing lost
    elif isinstance(value, dict):
        for key, item in value.items():
            more, left = tensor_leaves(item, f"{prefix}.{key}")
            found.update(more)
            skipped += left
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            more, left = tensor_leaves(item, f"{prefix}.{index}")
            found.update(more)
            skipped += left
    else:
        skipped.append(f"{prefix} ({type(value).__name__})")
    return found, skipped


def output_tensor(output: Any) -> Any:
    r"""The tensor a denoiser's output holds: itself, ``.sample``, a list of per-sample tensors stacked, the
    first of a tuple, or a dict's first."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "sample") and isinstance(output.sample, torch.Tensor):
        return output.sample
    if isinstance(output, list) and batch_of(output) is not None:  # per-sample results (a tuple: (sample,))
        return batch_of(output)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, dict):
        return next((v for v in output.values() if isinstance(v, torch.Tensor)), None)
    return None


def named_inputs(forward: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    r"""A call's arguments by parameter name (positional ones named from ``forward``'s signature, else
    ``arg{k}``)."""
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
        named = dict(bound.arguments)
        for name, param in inspect.signature(forward).parameters.items():
            if param.kind == param.VAR_KEYWORD and name in named:
                named.update(named.pop(name))
            elif param.kind == param.VAR_POSITIONAL and name in named:
                named.update({f"arg{len(named) + k}": v for k, v in enumerate(named.pop(name))})
        return named
    except TypeError:
        return {**{f"arg{k}": v for k, v in enumerate(args)}, **kwargs}


def scalar_value(value: Any) -> float | None:
    r"""A number argument, or a tensor's first element, as a float; ``None`` for anything else."""
    import torch

    if isinstance(value, torch.Tensor) and value.numel() >= 1:
        return float(value.reshape(-1)[0])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def timestep_argument(named: dict[str, Any]) -> tuple[str, str, float] | None:
    r"""``(argument name, "timesteps" | "sigmas", value)`` of a call: by its arguments' names, else its second
    argument when that is a number or a tensor of at most one value per sample."""
    import torch

    # a timestep is one number per sample at most: a (1, 320) time embedding named ``time`` is no timestep
    first = next((v for v in named.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    batch = first.shape[0] if first is not None else 1

    def per_sample(value: Any) -> bool:
        return not isinstance(value, torch.Tensor) or value.numel() <= max(batch, 1)

    for name in TIMESTEP_NAMES:
        if name in named and (value := scalar_value(named[name])) is not None and per_sample(named[name]):
            return name, ("sigmas" if name.startswith("sigma") else "timesteps"), value
    names = list(named)
    if (
        len(names) > 1 and (value := scalar_value(named[names[1]])) is not None
    ):  # (sample, t, ...) by position
        second = named[names[1]]
        if not isinstance(second, torch.Tensor) or second.numel() <= named[names[0]].shape[0]:
            return names[1], "timesteps", value
    return None


def timestep_of(named: dict[str, Any]) -> tuple[str, float] | None:
    r"""``("timesteps" | "sigmas", value)`` of a call (:func:`timestep_argument` without the name)."""
    found = timestep_argument(named)
    return found[1:] if found is not None else None


class Recording(dict):
    r"""The checkpoints :func:`record_loop` is filling, by name; :meth:`final` adds the loop's result."""

    def final(self, latents: Any) -> Any:
        r"""Keep the loop's result (the latents after its last update) as checkpoint ``final``; returns it."""
        import torch

        from paritykit.tracing.checkpoints import Checkpoint

        if not isinstance(latents, torch.Tensor):
            raise ParityKitError(
                f"record_loop final: expected the final latents tensor, got {type(latents).__name__}"
            )
        self["final"] = Checkpoint(data={"latents": latents.detach().clone()})
        return latents


def kept(value: Any) -> Any:
    r"""A copy of ``value`` safe from later in-place changes: tensors detached and cloned, containers
    rebuilt."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return (
            type(value)(kept(v) for v in value) if type(value) in (tuple, list) else [kept(v) for v in value]
        )
    if isinstance(value, dict):
        items = {k: kept(v) for k, v in value.items()}
        try:
            return type(value)(**items) if type(value) is not dict else items
        except TypeError:  # a mapping class that takes no keywords
            return items
    return value


@dataclass
class Call:
    r"""One recorded call of a module: its arguments (``args``, ``kwargs``, and ``named`` by parameter name)
    and its output, all copies taken when the call happened."""

    args: tuple
    kwargs: dict
    named: dict[str, Any]
    output: Any


@contextlib.contextmanager
def record_calls(module: Any, on_call: Callable[[int, Call], None] | None = None) -> Iterator[list[Call]]:
    r"""Record every call of ``module`` (a ``torch.nn.Module``) inside the ``with`` block, in memory.

    A forward hook, nothing patched: each call's arguments and output are copied as it returns, so a loop that
    updates its latents in place does not change what was recorded. ``on_call(index, call)`` runs after each.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ParityKitError(f"expected a torch.nn.Module to record, got {type(module).__name__}")
    calls: list[Call] = []

    def hook(mod: Any, args: tuple, kwargs: dict, output: Any) -> None:
        args, kwargs = kept(args), kept(kwargs)
        calls.append(Call(args, kwargs, named_inputs(mod.forward, args, kwargs), kept(output)))
        if on_call is not None:
            on_call(len(calls) - 1, calls[-1])

    handle = module.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def step_checkpoint(call: Call) -> Any:
    r"""One recorded call as a checkpoint: every tensor and number among its arguments, at any depth, by name
    (``x.0``, ``x.1`` for a list; ``added.text_embeds`` for a dict), a list of per-sample tensors also
    stacked under its own name, and its ``output``. What cannot be recorded is named under ``unrecorded``."""
    from paritykit.tracing.checkpoints import Checkpoint

    data: dict[str, Any] = {}
    unrecorded: list[str] = []
    for name, value in call.named.items():
        found, skipped = tensor_leaves(value, name)
        data.update(found)
        unrecorded += skipped
        batch = batch_of(value)
        if batch is not None and name not in data:
            data[name] = batch
    if unrecorded:
        data["unrecorded"] = ", ".join(unrecorded)
    result = output_tensor(call.output)
    if result is not None:
        data["output"] = result
    return Checkpoint(data=data)


def loop_checkpoints(calls: list[Call], final: Any = None) -> dict[str, Any]:
    r"""A recorded loop as :func:`paritykit.save_checkpoints` writes it (``preloop``, ``step_{i}``,
    ``final``)."""
    import torch

    from paritykit.tracing.checkpoints import Checkpoint

    steps = {f"step_{index}": step_checkpoint(call) for index, call in enumerate(calls)}
    seen: list[tuple[str, float]] = []
    for call in calls:
        found = timestep_of(call.named)
        if found is not None:
            seen.append(found)
    first = {k: v for k, v in steps["step_0"].data.items() if k != "output"} if calls else {}
    # the marker tells `paritykit schedule` the list is one value per call (no final sigma)
    preloop = {**first, "recorded_calls": len(calls)}
    kinds = {kind for kind, _ in seen}
    if len(kinds) == 1:
        preloop[kinds.pop()] = torch.tensor([v for _, v in seen], dtype=torch.float64)
    result = {"preloop": Checkpoint(data=preloop), **steps}
    if final is not None:
        result["final"] = final
    return result


@contextlib.contextmanager
def record_loop(denoiser: Any, out: str | Path, *, side: str | None = None) -> Iterator[Recording]:
    r"""Record every call of ``denoiser`` (a ``torch.nn.Module``) inside the ``with`` block, then save.

    Args:
        denoiser: the module the loop calls once per step (a UNet, a transformer, a k-diffusion wrapper).
        out: the checkpoint folder to write when the block ends (created; files of the same names are
            overwritten, others left alone).
        side: ``"reference"`` or ``"port"``, recorded so that pairing two folders of one side is refused.

    Yields:
        A dict for :class:`paritykit.Checkpoint` s, filled when the block ends; its ``final(latents)`` keeps
        the loop's result too.

    Example::

        with paritykit.record_loop(model.unet, out="ref_run") as rec:
            rec.final(reference_sample(model, prompt, steps=10))
    """
    from paritykit.tracing.checkpoints import save_checkpoints

    rec = Recording()
    with record_calls(
        denoiser, lambda index, call: rec.__setitem__(f"step_{index}", step_checkpoint(call))
    ) as calls:
        yield rec
    checkpoints = loop_checkpoints(calls, rec.get("final"))
    rec.update(checkpoints)
    save_checkpoints(out, checkpoints, side=side)
