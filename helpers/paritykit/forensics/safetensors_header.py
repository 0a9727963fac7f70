r"""Read what a ``.safetensors`` file holds without loading a single tensor, and without importing torch.

A safetensors file starts with an 8-byte little-endian header length ``N``, then ``N`` bytes of JSON mapping
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of the
header), plus an optional ``"__metadata__"`` object of string values. Key, shape and dtype differences between
two multi-gigabyte checkpoints therefore cost two small reads; values can later be streamed from the byte
ranges."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from paritykit.base.errors import ParityKitError

# The reference implementation refuses headers above 100 MB; a larger length means a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype code -> (readable name used in reports, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}


@dataclass(frozen=True)
class TensorInfo:
    r"""Where one tensor lives: its file and absolute byte range ``[start, end)``, plus dtype and shape.

    ``dtype`` is the readable name (``float16``, ``bfloat16`` …); ``code`` the safetensors spelling (``F16``).
    """

    name: str
    code: str
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int

    @property
    def dtype(self) -> str:
        return DTYPES[self.code][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.code][1]

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class SafetensorsHeader:
    r"""The parsed header of one file, or the merged headers of a sharded set.

    Attributes:
        path: the file (or the ``*.index.json`` of a sharded set).
        tensors: name -> :class:`TensorInfo`, in file order.
        metadata: the ``__metadata__`` strings (merged over shards; an index's own ``metadata`` is included).
        files: every data file involved.
    """

    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    r"""Parse and validate a ``.safetensors`` header, or a sharded ``*.safetensors.index.json`` set.

    Every tensor's byte range is checked against the file size and its dtype/shape, so a truncated download is
    reported here (as :class:`ParityKitError` naming the file) instead of as garbage values later.

    Args:
        path: a ``.safetensors`` file, a ``*.index.json`` whose ``weight_map`` names safetensors shards, or a
            folder of shards without an index (:func:`paritykit.base.io.shard_set`).

    Returns:
        A :class:`SafetensorsHeader`.
    """
    path = Path(path)
    if not path.exists():
        raise ParityKitError(f"{path}: no such file")
    if path.is_dir():
        from paritykit.base.io import shard_set

        shards = shard_set(path)
        if shards is None:
            raise ParityKitError(f"{path}: is a folder, expected a .safetensors file or a *.index.json")
        return _merged(path, [_read_single(shard) for shard in shards])
    if path.name.endswith(".index.json"):
        return _read_index(path)
    return _read_single(path)


def _read_single(path: Path) -> SafetensorsHeader:
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ParityKitError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        length = int.from_bytes(prefix, "little")
        if length > MAX_HEADER_BYTES or length > size - 8:
            raise ParityKitError(
                f"{path}: not a valid safetensors file (header length {length} bytes, file is {size} bytes); "
                "truncated download or a different format?"
            )
        raw = handle.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ParityKitError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ParityKitError(f"{path}: safetensors header is not a JSON object")

    data_start = 8 + length
    data_size = size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ParityKitError(f"{path}: __metadata__ is not a JSON object")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(path, name, entry, data_start, data_size)
    ordered = dict(sorted(tensors.items(), key=lambda item: item[1].start))
    return SafetensorsHeader(path=path, tensors=ordered, metadata=dict(metadata), files=[path])


def _tensor_info(path: Path, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise ParityKitError(f"{path}: header entry {name!r} lacks dtype/shape/data_offsets")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in DTYPES:
        raise ParityKitError(f"{path}: tensor {name!r} has unsupported dtype {code!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ParityKitError(f"{path}: tensor {name!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ParityKitError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * DTYPES[code][1]
    if end - begin != expected:
        raise ParityKitError(
            f"{path}: tensor {name!r} spans {end - begin} bytes but {code}{shape} needs {expected}"
        )
    if end > data_size:
        raise ParityKitError(
            f"{path}: truncated file: tensor {name!r} ends at byte {data_start + end}, "
            f"file has {data_start + data_size}"
        )
    return TensorInfo(name, code, tuple(shape), path, data_start + begin, data_start + end)


def _merged(folder: Path, shards: list[SafetensorsHeader]) -> SafetensorsHeader:
    r"""The headers of a folder's shards as one (their tensor names are disjoint: :func:`shard_set`)."""
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for shard in shards:
        tensors.update(shard.tensors)
        metadata.update(shard.metadata)
    return SafetensorsHeader(path=folder, tensors=tensors, metadata=metadata, files=[s.path for s in shards])


def _read_index(path: Path) -> SafetensorsHeader:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ParityKitError(f"{path}: sharded index is not valid JSON ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ParityKitError(f"{path}: sharded index has no 'weight_map'")
    shard_names = list(dict.fromkeys(weight_map.values()))
    not_safetensors = [s for s in shard_names if not str(s).endswith(".safetensors")]
    if not_safetensors:
        raise ParityKitError(f"{path}: shard {not_safetensors[0]!r} is not a .safetensors file")
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    if isinstance(index.get("metadata"), dict):
        metadata.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in index["metadata"].items()})
    files = []
    for shard_name in shard_names:
        shard_path = path.parent / shard_name
        if not shard_path.exists():
            raise ParityKitError(f"{path}: shard {shard_name!r} is missing")
        shard = _read_single(shard_path)
        files.append(shard_path)
        metadata.update(shard.metadata)
        for name, info in shard.tensors.items():
            if weight_map.get(name) != shard_name:
                raise ParityKitError(
                    f"{path}: tensor {name!r} is in {shard_name!r} but the index says otherwise"
                )
            tensors[name] = info
    missing = [name for name in weight_map if name not in tensors]
    if missing:
        raise ParityKitError(
            f"{path}: {len(missing)} indexed tensor(s) not found in the shards, e.g. {missing[0]!r}"
        )
    return SafetensorsHeader(path=path, tensors=tensors, metadata=metadata, files=files)
