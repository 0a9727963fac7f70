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
``paritykit schedule`` directly.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError

# argument names read as the timestep (or the sigma) of a call, most specific first
TIMESTEP_NAMES = ("timestep", "timesteps", "t", "time", "sigma", "sigmas", "noise_level")


def _output_tensor(output: Any) -> Any:
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "sample") and isinstance(output.sample, torch.Tensor):
        return output.sample
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    if isinstance(output, dict):
        return next((v for v in output.values() if isinstance(v, torch.Tensor)), None)
    return None


def _named_inputs(forward: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
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


def _scalar(value: Any) -> float | None:
    import torch

    if isinstance(value, torch.Tensor) and value.numel() >= 1:
        return float(value.reshape(-1)[0])
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _timestep_of(named: dict[str, Any]) -> tuple[str, float] | None:
    for name in TIMESTEP_NAMES:
        if name in named and (value := _scalar(named[name])) is not None:
            return ("sigmas" if name.startswith("sigma") else "timesteps"), value
    values = list(named.values())
    if len(values) > 1 and (value := _scalar(values[1])) is not None:  # (sample, t, ...) by position
        import torch

        second = values[1]
        if not isinstance(second, torch.Tensor) or second.numel() <= values[0].shape[0]:
            return "timesteps", value
    return None


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


@contextlib.contextmanager
def record_loop(denoiser: Any, out: str | Path, *, side: str | None = None) -> Iterator[Recording]:
    r"""Record every call of ``denoiser`` (a ``torch.nn.Module``) inside the ``with`` block, then save.

    Args:
        denoiser: the module the loop calls once per step (a UNet, a transformer, a k-diffusion wrapper).
        out: the checkpoint folder to write when the block ends (created; files of the same names are
            overwritten, others left alone).
        side: ``"reference"`` or ``"port"``, recorded so that pairing two folders of one side is refused.

    Yields:
        The dict of :class:`paritykit.Checkpoint` being filled (``preloop`` is added when the block ends); its
        ``final(latents)`` keeps the loop's result too.

    Example::

        with paritykit.record_loop(model.unet, out="ref_run") as rec:
            rec.final(reference_sample(model, prompt, steps=10))
    """
    import torch

    from paritykit.tracing.checkpoints import Checkpoint, save_checkpoints

    if not isinstance(denoiser, torch.nn.Module):
        raise ParityKitError(f"record_loop: expected a torch.nn.Module, got {type(denoiser).__name__}")
    calls = Recording()
    count = itertools.count()  # denoiser calls so far (calls may also hold "final")
    seen: list[tuple[str, float]] = []
    first: dict[str, Any] = {}

    def keep(value: Any) -> Any:
        return value.detach().clone() if isinstance(value, torch.Tensor) else value

    def hook(module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        named = _named_inputs(module.forward, args, kwargs)
        data = {k: keep(v) for k, v in named.items() if isinstance(v, (torch.Tensor, int, float, str))}
        result = _output_tensor(output)
        if result is not None:
            data["output"] = keep(result)
        index = next(count)
        if index == 0:
            first.update({k: v for k, v in data.items() if k != "output"})
        calls[f"step_{index}"] = Checkpoint(data=data)
        found = _timestep_of(named)
        if found is not None:
            seen.append(found)

    handle = denoiser.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()
    # the marker tells `paritykit schedule` the list is one value per call (no final sigma)
    preloop = {**first, "recorded_calls": next(count)}  # the next index is the number of calls made
    kinds = {kind for kind, _ in seen}
    if len(kinds) == 1:
        preloop[kinds.pop()] = torch.tensor([v for _, v in seen], dtype=torch.float64)
    save_checkpoints(out, {"preloop": Checkpoint(data=preloop), **calls}, side=side)
