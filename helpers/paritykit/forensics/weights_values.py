r"""The values half of ``weights diff``: tensor pairs streamed in chunks from their files (or taken from
memory), their bytes compared first, and every statistic of a changed pair (L2, L1, cosine, max-abs)
accumulated in one pass over cache-sized chunks, on one worker thread per core. Peak anonymous memory is a
few chunk buffers per worker, whatever the file size."""

from __future__ import annotations

import importlib
import math
import os
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError
from paritykit.forensics.safetensors_header import TensorInfo

# elements per statistics pass: large enough that the per-call cost of the numpy passes (decode, three dots,
# subtract, abs, sum, max) and the GIL hand-offs between them stay small against their work, small enough that
# a changed tensor's bytes are not read twice in full. Measured in-process on the SD-size benchmark pair, two
# workers: 2^15 0.69 s, 2^16 0.44 s, 2^17 0.31 s, 2^18 0.27 s, 2^19 0.25 s (twice the buffers), 2^20 0.28 s.
DISTANCE_CHUNK_ELEMENTS = 1 << 18
# raw bytes read per chunk and side: the widest element (complex128) times the chunk
RAW_CHUNK_BYTES = DISTANCE_CHUNK_ELEMENTS * 16

_WIDE_DTYPES = {"float64", "int64", "int32", "uint32", "uint64"}


# ---------------------------------------------------------------------------------- value comparison
class _Worker:
    r"""One worker's read buffers and statistics buffers, reused for every tensor pair so memory stays flat.

    Bytes are copied from the page cache with ``preadv`` into one chunk-sized buffer per side, which the
    decode then reads from cache. (Memory-mapping the files instead measured no faster here, and a mapped page
    past the end of a file truncated under us would be a SIGBUS rather than an error.)"""

    def __init__(self, fds: dict[Path, int]):
        self.fds = fds
        self._raw = {side: bytearray(RAW_CHUNK_BYTES) for side in ("a", "b")}
        # what each side's buffer holds now: a changed tensor's first differing chunk, read to compare its
        # bytes, is then decoded from the buffer instead of read again
        self._holds: dict[str, tuple[Path, int, int]] = {}
        self._work: dict[str, Any] = {}

    def work(self, dtype: Any, slot: str) -> Any:
        found = self._work.get((slot, dtype))  # keyed by the dtype object itself: called twice per chunk
        if found is None or len(found) < DISTANCE_CHUNK_ELEMENTS:
            import numpy as np

            found = self._work[(slot, dtype)] = np.empty(DISTANCE_CHUNK_ELEMENTS, dtype=dtype)
        return found

    def read(self, info: TensorInfo, start: int, length: int, side: str) -> memoryview:
        r"""Bytes ``[start, start + length)`` of ``info``'s tensor, in side ``side``'s buffer."""
        raw = self._raw[side]
        if len(raw) < length:
            raw = self._raw[side] = bytearray(length)
        view = memoryview(raw)[:length]
        where = (info.file, info.start + start, length)
        if self._holds.get(side) == where:
            return view
        self._holds[side] = where
        fd = self.fds[info.file]
        done = 0
        while done < length:
            got = os.preadv(fd, [view[done:]], info.start + start + done)
            if got <= 0:
                raise ParityKitError(f"{info.file}: unexpected end of file reading {info.name!r}")
            done += got
        return view


def _first_difference(a: Any, b: Any, worker: _Worker) -> int | None:
    r"""The element index of the first statistics chunk whose bytes differ, or ``None`` when every byte is
    equal.

    Read in the statistics' own chunk size, so a changed tensor (whose first chunk usually differs) costs one
    chunk's re-read, not a second pass over the whole tensor. The bytes are compared by ``memcmp`` (a prefix
    test of A's buffer against B's view: no copy, and no numpy, so an identical pair never imports it)."""
    itemsize = a.info.itemsize
    step = DISTANCE_CHUNK_ELEMENTS * itemsize
    total = a.info.nbytes
    for start in range(0, total, step):
        length = min(step, total - start)
        view_a = worker.read(a.info, start, length, "a")
        view_b = worker.read(b.info, start, length, "b")
        if not view_a.obj.startswith(view_b):  # view_a is the first `length` bytes of its buffer
            return start // itemsize
    return None


def _same_tensor_bytes(a: Any, b: Any) -> bool:
    ta = a.tensor.detach().reshape(-1).contiguous()
    tb = b.tensor.detach().reshape(-1).contiguous()
    if ta.dtype.is_floating_point or ta.dtype.is_complex:
        import torch

        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ta.element_size()]
        return bool(torch.equal(ta.view(width), tb.view(width)))
    return bool(ta.equal(tb))


_NUMPY_DTYPES = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint64": "uint64",
    "uint32": "uint32",
    "uint16": "uint16",
    "uint8": "uint8",
    "bool": "bool",
}


def _decode(entry: Any, start: int, count: int, out: Any, worker: _Worker, side: str) -> Any:
    r"""Elements ``[start, start + count)`` of ``entry`` as ``out[:count]`` (float32 or float64)."""
    import numpy as np

    target = out[:count]
    if entry.tensor is not None:
        import torch

        piece = entry.tensor.detach().reshape(-1)[start : start + count]
        work = torch.float64 if target.dtype == np.float64 else torch.float32
        np.copyto(target, piece.to(work).numpy())
        return target
    info = entry.info
    view = worker.read(info, start * info.itemsize, count * info.itemsize, side)
    if entry.dtype == "bfloat16" and target.dtype == np.float32:
        # bfloat16 is the top half of a float32: widen by shifting the bits, no torch needed. A widening copy
        # and then the shift in place: faster than numpy's casting shift
        bits = target.view(np.uint32)
        np.copyto(bits, np.frombuffer(view, np.uint16))
        np.left_shift(bits, 16, out=bits)
    elif entry.dtype == "float16" and target.dtype == np.float32:
        _half_to_float(np.frombuffer(view, np.uint16), target)
    elif entry.dtype in _NUMPY_DTYPES:
        np.copyto(target, np.frombuffer(view, _NUMPY_DTYPES[entry.dtype]), casting="unsafe")
    else:  # bfloat16 into float64, float8 variants
        import torch

        values = torch.frombuffer(bytearray(view), dtype=getattr(torch, entry.dtype))
        np.copyto(target, values.to(torch.float64).numpy(), casting="unsafe")
    return target


_HALF_SCALE = 2.0**112  # float16's exponent bias (15) lifted to float32's (127)
# float32 bits to keep after the sign-extended shift: the sign and bits 0-27 (exponent and mantissa in place)
_HALF_KEEP = -0x70000001  # 0x8FFFFFFF as an int32


def _half_to_float(half_bits: Any, out: Any) -> Any:
    r"""float16 bits into float32 ``out`` in four passes, a widening copy and three in place (numpy's own cast
    is about seven times slower), bit-exact on every finite value. Sign-extending the 16 bits to int32 and
    shifting them left by 13 puts the exponent and mantissa in float32 position and the sign in bit 31; bits
    28-30 then hold copies of the sign, which the mask clears. The float32 so formed is the value times 2^-112
    (denormals and zero included), so one multiply rescales it. An infinity or NaN (exponent 31) comes out
    finite, at 65536 or more in magnitude:
    :func:`_decode_with_norm` catches that from the chunk's square norm, which the statistics need anyway."""
    import numpy as np

    bits = out.view(np.int32)
    # the sign-extending copy and the shift as two passes: numpy's casting shift is slower than both together
    np.copyto(bits, half_bits.view(np.int16))
    np.left_shift(bits, 13, out=bits)
    np.bitwise_and(bits, np.int32(_HALF_KEEP), out=bits)
    np.multiply(out, np.float32(_HALF_SCALE), out=out)
    return out


# A float16 infinity or NaN decoded by the bit trick is >= 2^16, its square >= 2^32; a float32 sum of squares
# holding one is above half of that whatever its rounding. Finite chunks this large take the exact path too.
_HALF_SUSPECT_NORM = 2.0**31


def _decode_with_norm(entry: Any, start: int, count: int, out: Any, worker: _Worker, side: str):
    r""":func:`_decode` and the chunk's square norm; a float16 chunk whose norm could hide an infinity or a
    NaN is decoded again by numpy's exact cast."""
    import numpy as np

    values = _decode(entry, start, count, out, worker, side)
    norm = float(np.dot(values, values))
    if entry.dtype == "float16" and entry.info is not None and not norm < _HALF_SUSPECT_NORM:
        view = worker.read(entry.info, start * 2, count * 2, side)
        np.copyto(values, np.frombuffer(view, np.float16), casting="unsafe")
        norm = float(np.dot(values, values))
    return values, norm


def _distances(a: Any, b: Any, worker: _Worker, equal_before: int = 0) -> dict[str, float]:
    r"""Every statistic of the pair in one pass of cache-sized chunks. Elements before ``equal_before`` are
    known to be byte-identical: there only A is decoded, and its square norm is also the dot product and B's.
    """
    import numpy as np

    wide = a.dtype in _WIDE_DTYPES or b.dtype in _WIDE_DTYPES
    work = np.float64 if wide else np.float32
    buf_a, buf_b = worker.work(work, "a"), worker.work(work, "b")
    dot = norm_a = norm_b = sq = l1 = max_abs = 0.0
    total = a.numel
    with np.errstate(all="ignore"):
        for start in range(0, equal_before, DISTANCE_CHUNK_ELEMENTS):
            count = min(DISTANCE_CHUNK_ELEMENTS, equal_before - start)
            _, same = _decode_with_norm(a, start, count, buf_a, worker, "a")
            dot, norm_a, norm_b = dot + same, norm_a + same, norm_b + same
        for start in range(equal_before, total, DISTANCE_CHUNK_ELEMENTS):
            count = min(DISTANCE_CHUNK_ELEMENTS, total - start)
            xa, chunk_a = _decode_with_norm(a, start, count, buf_a, worker, "a")
            xb, chunk_b = _decode_with_norm(b, start, count, buf_b, worker, "b")
            # B's values are not needed again: the difference overwrites them, and two chunk buffers stay in
            # cache
            d = np.subtract(xa, xb, out=xb)
            chunk_sq = float(np.dot(d, d))
            # |a - b|^2 = |a|^2 + |b|^2 - 2 a.b: the dot product from the three sums, one pass fewer. Its
            # error is float32's relative to |a|^2 + |b|^2, as a BLAS dot's own is; cosine is held to a
            # float64 reference.
            dot += (chunk_a + chunk_b - chunk_sq) / 2
            norm_a += chunk_a
            norm_b += chunk_b
            sq += chunk_sq
            np.abs(d, out=d)
            l1 += float(np.einsum("i->", d))  # a SIMD sum: twice as fast as d.sum()
            peak = float(d.max()) if count else 0.0
            max_abs = peak if math.isnan(peak) else max(max_abs, peak)
    denom = math.sqrt(norm_a * norm_b)
    cosine = dot / denom if denom > 0 else (1.0 if norm_a == norm_b else 0.0)
    return {
        "l2": math.sqrt(sq) if sq >= 0 else math.nan,
        "l1": l1,
        "cosine": cosine,
        "max_abs": max_abs,
        "dot": dot,
        "norm_a": norm_a,
        "norm_b": norm_b,
        "sq": sq,
    }


def _scan(a: Any, b: Any, worker: _Worker) -> int | None:
    r"""``None`` when the pair's bytes are identical, else the element from which its values must be measured:
    the first differing chunk's, or 0 when the bytes cannot be compared (dtypes differ)."""
    if a.dtype == b.dtype:
        if a.info is not None and b.info is not None:
            return _first_difference(a, b, worker)
        if a.tensor is not None and b.tensor is not None and _same_tensor_bytes(a, b):
            return None
    return 0


def _measure(a: Any, b: Any, worker: _Worker, equal_before: int) -> dict[str, float] | None:
    r"""The distances of a pair whose bytes differ, or ``None`` when every value is still equal."""
    if a.numel == 0:
        return None if a.dtype == b.dtype else _distances(a, b, worker)
    values = _distances(a, b, worker, equal_before)
    # bytes may differ while every value is equal (0.0 vs -0.0): identical, unless the dtypes differ
    if values["sq"] == 0 and not math.isnan(values["l1"]) and a.dtype == b.dtype:
        return None
    return values


def _progress_bar(total: int, progress: bool | None):
    enabled = sys.stderr.isatty() if progress is None else progress
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="param", unit_scale=True, desc="comparing", file=sys.stderr, leave=False)


def compare_all(
    pairs: list[tuple[str, Any, Any]], *, progress: bool | None, workers: int | None
) -> list[dict[str, float] | None]:
    r"""Each pair's distances, or ``None`` for an identical pair, in the order given.

    Worker threads take the pairs in order and compare their bytes first, which needs no numpy. While numpy is
    imported (on a thread of its own: about as long as scanning the identical half of an SD checkpoint pair),
    this thread alone scans, so that the import keeps the other core; a pair whose bytes differ is put aside
    meanwhile. Once numpy is in, every worker runs, and a differing pair is measured at once, from the buffers
    that scanned it. The pairs put aside are measured when no pair is left to scan."""
    files = {e.info.file for _, ea, eb in pairs for e in (ea, eb) if e.info is not None}
    fds: dict[Path, int] = {}
    results: list[dict[str, float] | None] = [None] * len(pairs)
    bar = _progress_bar(sum(max(ea.numel, 1) for _, ea, _ in pairs), progress)
    lock = threading.Lock()
    numpy_in = threading.Event()
    to_scan: deque[int] = deque(range(len(pairs)))
    put_aside: deque[tuple[int, int]] = deque()
    failed: list[BaseException] = []

    def take(queue: deque) -> Any:
        with lock:
            return queue.popleft() if queue and not failed else None

    def measure(index: int, equal_before: int, worker: _Worker) -> None:
        results[index] = _measure(pairs[index][1], pairs[index][2], worker, equal_before)

    def drain(wait_for_numpy: bool = False) -> None:
        if wait_for_numpy:
            numpy_in.wait()
        worker = _Worker(fds)
        try:
            while (index := take(to_scan)) is not None:
                start = _scan(pairs[index][1], pairs[index][2], worker)
                if start is not None and numpy_in.is_set():
                    measure(index, start, worker)
                elif start is not None:
                    with lock:
                        put_aside.append((index, start))
                    continue
                _advance(bar, lock, pairs[index][1].numel)
            while (item := take(put_aside)) is not None:
                measure(*item, worker)
                _advance(bar, lock, pairs[item[0]][1].numel)
        except BaseException as error:  # an unreadable file: every worker stops, the caller gets the error
            with lock:
                failed.append(error)

    def import_numpy() -> None:
        try:
            importlib.import_module("numpy")
        finally:  # a failed import is raised again by the first measurement, not waited on forever
            numpy_in.set()

    importer = None
    if "numpy" in sys.modules or not any(ea.info is not None for _, ea, _ in pairs):
        numpy_in.set()  # already in, or no pair is read from a file: no scan to overlap the import with
    else:
        importer = threading.Thread(target=import_numpy, daemon=True)
        importer.start()
    try:
        for path in files:
            fds[path] = os.open(path, os.O_RDONLY)
        count = max(1, min(workers or _usable_cores(), len(pairs)))
        threads = [threading.Thread(target=drain, args=(True,), daemon=True) for _ in range(count - 1)]
        for thread in threads:
            thread.start()
        drain()  # this thread is a worker too
        for thread in threads:
            thread.join()
        if failed:
            raise failed[0]
        return results
    finally:
        for fd in fds.values():
            os.close(fd)
        if bar is not None:
            bar.close()
        if importer is not None:
            importer.join()  # never left importing while the interpreter shuts down


def _advance(bar: Any, lock: threading.Lock, numel: int) -> None:
    if bar is not None:
        with lock:
            bar.update(max(numel, 1))


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
