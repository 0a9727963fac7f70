r"""Reading the two sides of a conversion: state dicts, safetensors files (memory-mapped), or models."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load_path(path: Path) -> Mapping[str, Any]:
    from paritykit.base.io import shard_set

    shards = path.is_dir() and shard_set(path) is not None
    if shards or (path.is_file() and path.name.endswith((".safetensors", ".safetensors.index.json"))):
        mapped = _map_safetensors(path)
        if mapped is not None:
            return mapped
    from paritykit.base.io import load_state_dict

    return load_state_dict(path)


def _map_safetensors(path: Path) -> dict[str, Any] | None:
    r"""Safetensors tensors as views of privately memory-mapped files, or ``None`` to use the full loader.

    Pages are read when hashing reaches them and stay reclaimable file cache, so checkpoints larger than RAM
    stream through the fingerprint pass. The header is validated first (byte ranges against the file size);
    anything unusual (an unaligned offset, an unknown dtype) falls back to
    :func:`paritykit.base.io.load_state_dict`.
    """
    import torch

    from paritykit.forensics.safetensors_header import read_safetensors_header

    try:
        header = read_safetensors_header(path)
        storages: dict[Path, Any] = {}
        out = {}
        for name, info in header.tensors.items():
            dtype = getattr(torch, info.dtype, None)
            if not isinstance(dtype, torch.dtype) or info.start % info.itemsize:
                return None
            if info.file not in storages:
                size = info.file.stat().st_size
                storages[info.file] = torch.UntypedStorage.from_file(
                    str(info.file), shared=False, nbytes=size
                )
            view = torch.empty(0, dtype=dtype)
            out[name] = view.set_(storages[info.file], info.start // info.itemsize, info.shape)
        return out
    except Exception:
        return None  # the full loader reports the problem with its own one-line error


def as_state_dict(obj: Any, label: str) -> tuple[dict[str, Any], str]:
    import torch

    if isinstance(obj, (str, os.PathLike)):
        path = Path(obj)
        if not path.exists():
            raise ParityKitError(f"{label} {str(path)!r}: no such file or directory")
        tensors, name = _load_path(path), str(path)
    elif isinstance(obj, Mapping):
        tensors, name = obj, label
    elif hasattr(obj, "state_dict"):
        tensors, name = obj.state_dict(), type(obj).__name__
    else:
        raise ParityKitError(
            f"{label}: expected a path, a dict of tensors or a module, got {type(obj).__name__}"
        )
    out = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ParityKitError(f"{label}: {key!r} is a {type(value).__name__}, not a tensor")
        out[str(key)] = value.detach()
    if not out:
        raise ParityKitError(f"{label} {name!r} holds no tensors")
    return out, name
