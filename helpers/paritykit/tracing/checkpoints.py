r"""Pipeline checkpoints: save, stop at, or inject the tensors flowing through a diffusion pipeline.

A pipeline under test takes ``_checkpoints: dict[str, Checkpoint] | None`` and calls :func:`maybe_checkpoint`
at stage boundaries (``text_encoding``, ``preloop``, ``after_step_{i}``, ``post_loop``)::

    latents = maybe_checkpoint(_checkpoints, "preloop", latents=latents, timesteps=timesteps)["latents"]

With no checkpoint registered under a name the call returns the tensors untouched, so a pipeline with
checkpoints enabled computes exactly what it computes without them. :func:`save_checkpoints` and
:func:`load_checkpoints` carry checkpoints across processes, so a reference and its port can run in separate
environments (research repositories often pin an old torch).
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paritykit.base.errors import ParityKitError
from paritykit.base.files import MANIFEST_NAME
from paritykit.base.io import CHECKPOINT_SCHEMA, read_manifest

if TYPE_CHECKING:
    import torch

MANIFEST_FORMAT = "paritykit-checkpoints"
_SAVE_ORDER = itertools.count()
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass
class Checkpoint:
    r"""What a pipeline does at one named point.

    Args:
        save: store detached clones of the tensors passed at this point in ``data``.
        stop: raise :class:`PipelineStop` here (after saving, when ``save`` is set too).
        load: replace the pipeline's tensors by the ones in ``data`` (cast to the pipeline's dtype and
            device).
        data: the saved or to-be-injected values, by keyword name.
    """

    save: bool = False
    stop: bool = False
    load: bool = False
    data: dict[str, Any] = field(default_factory=dict)
    # when this checkpoint last saved, so save_checkpoints can write execution order
    saved_at: int | None = field(default=None, init=False, repr=False, compare=False)
    # whether a pipeline called maybe_checkpoint with this name, so a misspelt name is reported, not empty
    reached: bool = field(default=False, init=False, repr=False, compare=False)


class CheckpointNotReached(UserWarning):
    r"""A checkpoint given to :func:`run_until_stop` that the pipeline never called ``maybe_checkpoint``
    for."""


class PipelineStop(Exception):
    r"""Raised by :func:`maybe_checkpoint` at a checkpoint with ``stop=True``; ``name`` says which one."""

    def __init__(self, name: str):
        super().__init__(f"pipeline stopped at checkpoint {name!r}")
        self.name = name


def _inject(stored: Any, local: Any) -> Any:
    import torch

    if isinstance(stored, torch.Tensor):
        if isinstance(local, torch.Tensor):
            # copy=True: the pipeline may update the tensor in place; the checkpoint must stay as loaded
            return stored.to(device=local.device, dtype=local.dtype, copy=True)
        return stored.clone()
    return stored


def maybe_checkpoint(
    checkpoints: Mapping[str, Checkpoint] | None, name: str, **tensors: Any
) -> dict[str, Any]:
    r"""Save, inject or stop at the checkpoint ``name``; return the values the pipeline should go on with.

    Args:
        checkpoints: the pipeline's ``_checkpoints`` argument; ``None`` or a dict without ``name`` is a no-op.
        name: this point's name, e.g. ``"preloop"`` or ``f"after_step_{i}"``.
        tensors: the pipeline's values at this point by name; non-tensor values (``None``, ints) pass through.

    Returns:
        A new dict: the given values, where ``load`` is set replaced by ``data``'s (tensors cast to the dtype
        and device of the local tensor they replace; keys only in ``data`` are added). ``save`` stores what is
        returned, as detached clones of tensors.

    Raises:
        PipelineStop: when the checkpoint has ``stop=True`` (after saving).
        ParityKitError: ``load`` is set but ``data`` shares no key with the values given here.
    """
    import torch

    checkpoint = None if checkpoints is None else checkpoints.get(name)
    if checkpoint is None:
        return dict(tensors)
    checkpoint.reached = True
    values = dict(tensors)
    if checkpoint.load:
        if not checkpoint.data:
            raise ParityKitError(
                f"checkpoint {name!r} has load=True but no data (fill .data or use load_checkpoints)"
            )
        if tensors and not set(checkpoint.data) & set(tensors):
            raise ParityKitError(
                f"checkpoint {name!r}: none of its keys ({', '.join(checkpoint.data)}) match the values"
                f" passed here ({', '.join(tensors)})"
            )
        for key, stored in checkpoint.data.items():
            values[key] = _inject(stored, tensors.get(key))
    if checkpoint.save:
        checkpoint.data = {
            key: value.detach().clone() if isinstance(value, torch.Tensor) else value
            for key, value in values.items()
        }
        checkpoint.saved_at = next(_SAVE_ORDER)
    if checkpoint.stop:
        raise PipelineStop(name)
    return values


_STAGE_NAMES = ("text_encoding", "preloop", "after_step_0", "after_step_1", "post_loop")


def run_until_stop(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    r"""Call ``fn(*args, **kwargs)``; return its result, or ``None`` when a checkpoint stopped it.

    Checkpoints passed as ``_checkpoints=`` that the run never reached are reported after it with a
    :class:`CheckpointNotReached` warning (a misspelt ``"prelop"`` would otherwise leave its ``data`` silently
    empty), with the closest name the run did reach and, when it stopped early, where it stopped.
    """
    checkpoints = kwargs.get("_checkpoints")
    watched = dict(checkpoints) if isinstance(checkpoints, Mapping) else {}
    for checkpoint in watched.values():
        if isinstance(checkpoint, Checkpoint):
            checkpoint.reached = False
    stopped_at = None
    try:
        return fn(*args, **kwargs)
    except PipelineStop as stop:
        stopped_at = stop.name
        return None
    finally:
        _report_unreached(watched, stopped_at)


def _report_unreached(checkpoints: Mapping[str, Any], stopped_at: str | None) -> None:
    missed = [n for n, c in checkpoints.items() if isinstance(c, Checkpoint) and not c.reached]
    if not missed:
        return
    reached = [n for n, c in checkpoints.items() if isinstance(c, Checkpoint) and c.reached]
    known = list(dict.fromkeys([*reached, *_STAGE_NAMES]))
    parts = []
    for name in missed:
        close = difflib.get_close_matches(name, [k for k in known if k != name], n=1, cutoff=0.75)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    where = (
        f"; the run stopped at {stopped_at!r} first, so later names are expected to be missing"
        if stopped_at
        else ""
    )
    warnings.warn(
        f"checkpoint(s) never reached: {', '.join(parts)}: the pipeline never called maybe_checkpoint with "
        f"these names, so their data stays empty{where}",
        CheckpointNotReached,
        stacklevel=3,
    )


def seeded_noise(
    shape: tuple[int, ...] | list[int],
    seed: int,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    r"""Standard normal noise drawn on the CPU in float32 from ``seed``, then cast and moved.

    The same values on every device and for every dtype (up to the cast), so reference and port can start from
    identical latents even when one runs on CUDA and the other on CPU.
    """
    import torch

    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    noise = torch.randn(tuple(shape), generator=generator, dtype=torch.float32, device="cpu")
    return noise.to(device=device, dtype=dtype or torch.float32)


# ------------------------------------------------------------------------------------------------------------
# On disk: one <name>.safetensors per checkpoint plus a paritykit.json manifest.


def _json_value(value: Any) -> tuple[bool, Any]:
    try:
        return True, json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return False, None


def save_checkpoints(
    directory: str | Path, checkpoints: Mapping[str, Checkpoint], *, side: str | None = None
) -> Path:
    r"""Write every checkpoint that holds data to ``directory``, in execution order.

    Each checkpoint's tensors go to ``<name>.safetensors`` (on CPU, contiguous); ``paritykit.json`` records
    the order, every key (tensor or not) in its original order, the non-tensor values that JSON can hold
    (non-finite floats under ``nonfinite``), the keys it could not (``skipped``), and the environment
    (paritykit, torch, diffusers versions). Existing files of the same names are overwritten; other files are
    left alone.

    ``side`` (``"reference"`` or ``"port"``) is recorded in the manifest, so commands that pair two folders
    refuse two runs of one side, or the two given in the wrong order.

    Returns:
        The manifest's path.
    """
    import torch

    if side not in (None, "reference", "port"):
        raise ParityKitError(f"side={side!r}: expected 'reference' or 'port'")
    from safetensors.torch import save_file

    from paritykit.base.report import environment_stamp

    directory = Path(directory)
    with_data = [(name, ckpt) for name, ckpt in checkpoints.items() if ckpt.data]
    order = sorted(
        range(len(with_data)),
        key=lambda i: (with_data[i][1].saved_at is None, with_data[i][1].saved_at or 0, i),
    )
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for i in order:
        name, checkpoint = with_data[i]
        if not _SAFE_NAME.match(name):
            raise ParityKitError(f"checkpoint name {name!r}: use letters, digits, '_', '-' and '.' only")
        tensors: dict[str, torch.Tensor] = {}
        keys, values, skipped, nonfinite = [], {}, {}, {}
        for key, value in checkpoint.data.items():
            keys.append(key)
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().to("cpu").contiguous().clone()
                continue
            if isinstance(value, float) and not math.isfinite(value):
                nonfinite[key] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
                continue
            ok, as_json = _json_value(value)
            if ok:
                values[key] = as_json
            else:
                skipped[key] = type(value).__name__
        file = f"{name}.safetensors"
        try:
            save_file(tensors, directory / file, metadata={"checkpoint": name})
        except Exception as exc:
            raise ParityKitError(f"{directory / file}: cannot write checkpoint {name!r} ({exc})") from None
        entries.append(
            {
                "name": name,
                "file": file,
                "keys": keys,
                "tensors": {
                    k: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for k, t in tensors.items()
                },
                "values": values,
                "nonfinite": nonfinite,
                "skipped": skipped,
            }
        )
    manifest = {
        "schema_version": CHECKPOINT_SCHEMA,
        "format": MANIFEST_FORMAT,
        "order": [entry["name"] for entry in entries],
        "checkpoints": entries,
        "environment": environment_stamp(),
        **({"side": side} if side else {}),
    }
    manifest_path = directory / MANIFEST_NAME
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest_path


def load_checkpoints(directory: str | Path) -> dict[str, Checkpoint]:
    r"""Read a folder written by :func:`save_checkpoints`.

    Returns:
        ``{name: Checkpoint(data=...)}`` in execution order, with tensors and JSON values back under their
        keys in the order they were saved; ``save``, ``stop`` and ``load`` are all ``False`` (set ``load`` on
        the ones to inject).
    """
    from paritykit.base.io import read_safetensors

    directory = Path(directory)
    if not directory.is_dir():
        raise ParityKitError(f"{directory}: no such checkpoint folder")
    checkpoints: dict[str, Checkpoint] = {}
    for entry in read_manifest(directory)["checkpoints"]:
        try:
            name, file = entry["name"], entry["file"]
        except (KeyError, TypeError):
            raise ParityKitError(
                f"{directory / MANIFEST_NAME}: malformed checkpoint entry {entry!r}"
            ) from None
        tensors = read_safetensors(directory / file)
        values = dict(entry.get("values", {}))
        values.update({key: float(text) for key, text in entry.get("nonfinite", {}).items()})
        keys = entry.get("keys") or [*tensors, *values]
        data = {
            key: tensors[key] if key in tensors else values[key]
            for key in keys
            if key in tensors or key in values
        }
        checkpoints[name] = Checkpoint(data=data)
    return checkpoints
