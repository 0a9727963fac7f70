r"""Reading the two sides of a conversion: state dicts, safetensors files (memory-mapped), or models."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
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


class _Pages:
    r"""The memory-mapped checkpoint files this process reads, and how many of their bytes it read since
    their pages were last given back.

    A mapped page that was read stays resident (and counts towards the process's resident memory) until
    memory runs short. The matcher reads every tensor once to fingerprint it and then the few it compares, so
    it reports what it reads (:meth:`read`); past :data:`BUDGET` bytes, every mapping's pages are dropped
    (``MADV_DONTNEED``). A later read faults them back in from the page cache, so this costs page faults, not
    disk reads, and resident memory stays near the budget whatever the checkpoint's size.
    """

    BUDGET = 256 << 20

    def __init__(self) -> None:
        import weakref

        self.maps: weakref.WeakSet = weakref.WeakSet()
        self.since = 0
        self._lock = threading.Lock()  # the matcher reads on several threads

    def read(self, nbytes: int) -> None:
        with self._lock:
            self.since += nbytes
            if self.since > self.BUDGET:
                self._release()

    def release(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        import mmap

        for mm in list(self.maps):
            try:
                mm.madvise(mmap.MADV_DONTNEED)
            except (ValueError, OSError, AttributeError):  # closed, or a platform without madvise
                pass
        self.since = 0


PAGES = _Pages()


def _map_safetensors(path: Path) -> dict[str, Any] | None:
    r"""Safetensors tensors as views of privately memory-mapped files, or ``None`` to use the full loader.

    Pages are read when hashing reaches them; :data:`PAGES` gives them back as the matcher moves on, so
    checkpoints larger than RAM stream through in bounded resident memory. The mapping is private
    (copy-on-write): nothing written to a tensor reaches the file. The header is validated first (byte ranges
    against the file size); anything unusual (an unaligned offset, an unknown dtype) falls back to
    :func:`paritykit.base.io.load_state_dict`.
    """
    import mmap

    import torch

    from paritykit.forensics.safetensors_header import read_safetensors_header

    try:
        header = read_safetensors_header(path)
        maps: dict[Path, Any] = {}
        out = {}
        for name, info in header.tensors.items():
            dtype = getattr(torch, info.dtype, None)
            if not isinstance(dtype, torch.dtype) or info.start % info.itemsize:
                return None
            if info.file not in maps:
                with open(info.file, "rb") as f:
                    maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                PAGES.maps.add(maps[info.file])
            if info.numel == 0:
                out[name] = torch.empty(info.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(maps[info.file], dtype=dtype, count=info.numel, offset=info.start)
            out[name] = flat.reshape(info.shape)
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


def in_threads(fn, items: list, sizes: list[int] | None = None) -> Iterable:
    r"""``fn`` over ``items`` in order, on up to four threads: the hashing and comparing are numpy and torch
    reductions that release the GIL, so the cores read the checkpoint side by side. Given each item's
    ``sizes`` (bytes), the items are cut into one contiguous run per thread of about equal bytes: each thread
    streams a region of the files of its own, rather than taking turns over the same pages."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    workers = min(4, os.cpu_count() or 1)
    if workers == 1 or len(items) < 2:
        return map(fn, items)
    if sizes is None:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(fn, items))
    total, cuts, run = sum(sizes), [0], 0
    for i, size in enumerate(sizes):
        run += size
        if run >= total * len(cuts) / workers and len(cuts) < workers:
            cuts.append(i + 1)
    cuts.append(len(items))
    runs = [items[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]
    with ThreadPoolExecutor(len(runs)) as pool:
        return [r for done in pool.map(lambda run: [fn(i) for i in run], runs) for r in done]


@contextlib.contextmanager
def without_cycle_collection() -> Iterator[None]:
    r"""Python's cycle collector paused inside the block, restored after. The matching makes hundreds of
    thousands of small objects that reference counting frees; a full collection in a process that has
    imported torch and diffusers scans every object they made (0.09 s, a tenth of a 1 GB map) and finds
    nothing to free."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
