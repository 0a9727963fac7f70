r"""Safe tensor I/O: read tensors and state dicts from any file a port meets, never running code from it.

Formats: ``.safetensors`` (also sharded sets described by a ``*.index.json``), ``.npy``/``.npz`` and the
pickle family ``.pt``/``.pth``/``.bin``/``.ckpt``. Pickles go through :func:`safe_torch_load`: torch's
``weights_only`` loader first; when it refuses a pickle because of globals it does not know (Lightning and
OmegaConf training checkpoints are the usual case) a restricted unpickler retries, turning every unknown
global into an inert placeholder it reports, and refusing outright the globals that only an attack needs.

Torch is imported inside the functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paritykit.base.errors import ParityKitError, first_line
from paritykit.base.files import MANIFEST_NAME, require_file
from paritykit.base.naming import natural_key
from paritykit.base.pickles import StubbedGlobal, safe_torch_load

if TYPE_CHECKING:
    import torch

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
TENSOR_SUFFIXES = (".safetensors", ".npy", ".npz", *PICKLE_SUFFIXES)
INDEX_SUFFIX = ".index.json"
STATE_DICT_WRAPPERS = ("state_dict", "model", "module")

# File names diffusers and transformers give a component's weights, most preferred first.
_STANDARD_WEIGHT_NAMES = (
    "diffusion_pytorch_model.safetensors",
    "model.safetensors",
    "diffusion_pytorch_model.bin",
    "pytorch_model.bin",
)

# ------------------------------------------------------------------------------------------------------------
# Readers of one file. Each returns (tensors, is_container): a container names its tensors `stem/key`.


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    require_file(path)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as exc:
        raise ParityKitError(f"{path}: not a readable safetensors file ({first_line(exc)})") from None


def _numpy_to_tensor(array: Any, path: Path, key: str | None = None) -> torch.Tensor | None:
    import numpy
    import torch

    where = f"{path}" if key is None else f"{path}[{key}]"
    if array.dtype.kind not in "biufc":
        if key is None:
            raise ParityKitError(f"{where}: array of dtype {array.dtype} is not numeric")
        return None
    try:
        return torch.from_numpy(numpy.ascontiguousarray(array))
    except TypeError as exc:
        raise ParityKitError(f"{where}: cannot convert to a torch tensor ({exc})") from None


def _read_npy(path: Path) -> torch.Tensor:
    import numpy

    require_file(path)
    try:
        array = numpy.load(path, allow_pickle=False)
    except Exception as exc:
        raise ParityKitError(f"{path}: not a readable .npy file ({first_line(exc)})") from None
    return _numpy_to_tensor(array, path)


def _read_npz(path: Path) -> dict[str, torch.Tensor]:
    import numpy

    require_file(path)
    tensors: dict[str, torch.Tensor] = {}
    try:
        with numpy.load(path, allow_pickle=False) as archive:
            for key in archive.files:
                tensor = _numpy_to_tensor(archive[key], path, key)
                if tensor is not None:
                    tensors[key] = tensor
    except ParityKitError:
        raise
    except Exception as exc:
        raise ParityKitError(f"{path}: not a readable .npz file ({first_line(exc)})") from None
    return tensors


def _tensors_in(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    r"""Every tensor inside nested dicts/lists/tuples (and stubbed modules), named with dotted paths."""
    import numpy
    import torch

    def join(key: Any) -> str:
        return f"{prefix}.{key}" if prefix else str(key)

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, numpy.ndarray) and obj.dtype.kind in "biufc":
        yield prefix, torch.from_numpy(numpy.ascontiguousarray(obj))
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors_in(value, join(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors_in(value, join(i))
    elif isinstance(obj, StubbedGlobal) and isinstance(obj.state, Mapping) and "_parameters" in obj.state:
        # a whole pickled nn.Module whose class was stubbed: its parameters, buffers and children
        for part in ("_parameters", "_buffers"):
            for key, value in (obj.state.get(part) or {}).items():
                if isinstance(value, torch.Tensor):
                    yield join(key), value
        for key, child in (obj.state.get("_modules") or {}).items():
            yield from _tensors_in(child, join(key))


def _unwrap_state_dict(obj: Any) -> Any:
    while isinstance(obj, Mapping):
        inner = next(
            (obj[k] for k in STATE_DICT_WRAPPERS if isinstance(obj.get(k), (Mapping, StubbedGlobal))), None
        )
        if inner is None:
            return obj
        obj = inner
    return obj


def _read_pickle(path: Path) -> Any:
    return safe_torch_load(path).obj


# ------------------------------------------------------------------------------------------------------------
# Sharded sets


def _read_index(index: Path) -> dict[str, torch.Tensor]:
    require_file(index)
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except Exception as exc:
        raise ParityKitError(f"{index}: not a readable shard index ({first_line(exc)})") from None
    merged: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(weight_map.values()):
        shard_path = index.parent / shard
        if not shard_path.exists():
            raise ParityKitError(f"{index}: shard {shard_path} is missing")
        merged.update(_state_dict_from_file(shard_path))
    missing = [key for key in weight_map if key not in merged]
    if missing:
        raise ParityKitError(
            f"{index}: {len(missing)} keys listed but absent from their shards, e.g. {missing[0]!r}"
        )
    return {key: merged[key] for key in weight_map} | {k: v for k, v in merged.items() if k not in weight_map}


def _index_base(index: Path) -> str:
    r"""``diffusion_pytorch_model.safetensors.index.json`` -> ``diffusion_pytorch_model``."""
    base = index.name[: -len(INDEX_SUFFIX)]
    for suffix in TENSOR_SUFFIXES:
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def _shards_of(index: Path) -> set[Path]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except Exception as exc:
        raise ParityKitError(f"{index}: not a readable shard index ({first_line(exc)})") from None
    return {(index.parent / name).resolve() for name in weight_map.values()}


# ------------------------------------------------------------------------------------------------------------
# load_state_dict


def _state_dict_from_file(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():  # a set of shards without an index (shard_set)
        return {k: v for shard in shard_set(path) or [] for k, v in read_safetensors(shard).items()}
    name = path.name
    if name.endswith(INDEX_SUFFIX):
        return _read_index(path)
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return read_safetensors(path)
    if suffix == ".npy":
        raise ParityKitError(f"{path}: a .npy file holds one array, not a state dict")
    if suffix == ".npz":
        return _read_npz(path)
    if suffix in PICKLE_SUFFIXES:
        return _state_dict_from_pickle(path, _read_pickle(path))
    require_file(path)
    raise ParityKitError(f"{path}: unknown tensor file suffix (expected one of {', '.join(TENSOR_SUFFIXES)})")


def _state_dict_from_pickle(path: Path, obj: Any) -> dict[str, torch.Tensor]:
    obj = _unwrap_state_dict(obj)
    if not isinstance(obj, (Mapping, StubbedGlobal)):
        raise ParityKitError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    state = dict(_tensors_in(obj))
    if not state:
        raise ParityKitError(f"{path}: no tensors found in this checkpoint")
    return state


def _header_keys(path: Path) -> set[str]:
    r"""The tensor names a ``.safetensors`` file's header lists (its first bytes only)."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if length <= 0 or length > 100_000_000:
            raise ParityKitError(f"{path}: not a valid safetensors file (header length {length} bytes)")
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ParityKitError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    return {k for k in header if k != "__metadata__"}


def shard_set(folder: Path) -> list[Path] | None:
    r"""The ``.safetensors`` files of a folder that together hold one checkpoint without an index (research
    checkpoints saved block by block): two or more files whose tensor names are disjoint. ``None`` when the
    folder has an index, fewer than two files, or files that share names (variants of one checkpoint, such as
    an fp16 copy beside the full one)."""
    if not Path(folder).is_dir() or any(Path(folder).glob(f"*{INDEX_SUFFIX}")):
        return None
    files = sorted(Path(folder).glob("*.safetensors"), key=lambda p: natural_key(p.name))
    if len(files) < 2:
        return None
    seen: set[str] = set()
    for path in files:
        keys = _header_keys(path)
        if keys & seen:
            return None
        seen |= keys
    return files


def _weights_file_in(folder: Path) -> Path:
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if indexes:
        safetensor_indexes = [p for p in indexes if ".safetensors" in p.name]
        return (safetensor_indexes or indexes)[0]
    for standard in _STANDARD_WEIGHT_NAMES:
        if (folder / standard).is_file():
            return folder / standard
    candidates = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in TENSOR_SUFFIXES)
    preferred = [p for p in candidates if p.suffix == ".safetensors"] or candidates
    if len(preferred) == 1:
        return preferred[0]
    if shard_set(folder) is not None:
        return folder  # the shards together: read by _state_dict_from_file
    if not preferred:
        subfolders = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        hint = f"; pass a component folder such as {folder / subfolders[0]}" if subfolders else ""
        raise ParityKitError(f"{folder}: no weights file in this folder{hint}")
    names = ", ".join(p.name for p in preferred[:5])
    raise ParityKitError(f"{folder}: several weights files ({names}); pass one of them")


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    r"""Read one checkpoint as a flat ``{key: tensor}`` dict.

    Args:
        path: a ``.safetensors`` file, a shard index ``*.index.json``, a folder holding one (or a single
            weights file, e.g. a diffusers component folder, or shards without an index), a ``.npz``, or a
            pickle
            (``.pt``/``.pth``/``.bin``/``.ckpt``, read with :func:`safe_torch_load`).
            ``state_dict``/``model``/
            ``module`` wrappers are unwrapped and nested dicts flattened with dots.

    Raises:
        ParityKitError: naming the file, when it is missing, unreadable, of unknown type or holds no state
            dict.
    """
    path = Path(path)
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or directory")
    if path.is_dir():
        path = _weights_file_in(path)
    return _state_dict_from_file(path)


# ------------------------------------------------------------------------------------------------------------
# load_named_tensors: the one naming every comparison shares


def _is_model_folder(folder: Path) -> bool:
    r"""A component folder as diffusers/transformers save it: a config or a conventionally named weights
    file."""
    if (folder / MANIFEST_NAME).is_file():
        return False
    if any((folder / name).is_file() for name in _STANDARD_WEIGHT_NAMES) or any(
        folder.glob(f"*{INDEX_SUFFIX}")
    ):
        return True
    weights = (p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in TENSOR_SUFFIXES)
    return (folder / "config.json").is_file() and next(weights, None) is not None


def load_named_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    r"""Tensors named the way ``compare`` and ``weights diff`` both name them, so one ``--map`` fits both.

    A checkpoint file or a model folder gives its state dict's own keys, as :func:`load_state_dict` reads
    them: ``state_dict``/``model``/``module`` wrappers unwrapped, nested dicts joined with dots, no file-stem
    prefix. A pipeline folder (``model_index.json``) gives ``<component>.<key>``. A single-tensor file
    (``.npy``, a pickled tensor) is named by its stem. Anything else (a folder of outputs, a checkpoint folder
    from :func:`paritykit.tracing.checkpoints.save_checkpoints`) keeps :func:`load_tensors`' names.

    Args:
        path: a file or a folder.

    Returns:
        name -> tensor. Raises ``ParityKitError`` naming the path when it cannot be read.
    """
    import torch

    path = Path(path)
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or directory")
    if path.is_file() and path.name != MANIFEST_NAME:
        stem = _stem(Path(path.name))
        if path.suffix.lower() == ".npy":
            return {stem: _read_npy(path)}
        if path.suffix.lower() in PICKLE_SUFFIXES:
            obj = _read_pickle(path)
            return {stem: obj} if isinstance(obj, torch.Tensor) else _state_dict_from_pickle(path, obj)
        return _state_dict_from_file(path)
    if path.is_dir() and (path / "model_index.json").is_file():
        components = [sub for sub in sorted(path.iterdir()) if sub.is_dir() and _is_model_folder(sub)]
        if components:
            return {
                f"{sub.name}.{key}": value
                for sub in components
                for key, value in load_state_dict(sub).items()
            }
    if path.is_dir() and _is_model_folder(path):
        return load_state_dict(path)
    return load_tensors(path)


# ------------------------------------------------------------------------------------------------------------
# load_tensors


def _single_file_tensors(path: Path, stem: str) -> dict[str, torch.Tensor]:
    r"""Tensors of one file, named by the contract: ``stem`` for one tensor, ``stem/key`` for containers."""
    import torch

    suffix = path.suffix.lower()
    if path.name.endswith(INDEX_SUFFIX):
        return {f"{stem}/{k}": v for k, v in _read_index(path).items()}
    if suffix == ".npy":
        return {stem: _read_npy(path)}
    if suffix == ".safetensors":
        return {f"{stem}/{k}": v for k, v in read_safetensors(path).items()}
    if suffix == ".npz":
        return {f"{stem}/{k}": v for k, v in _read_npz(path).items()}
    if suffix in PICKLE_SUFFIXES:
        obj = _read_pickle(path)
        if isinstance(obj, torch.Tensor):
            return {stem: obj}
        tensors = {f"{stem}/{k}": v for k, v in _tensors_in(obj)}
        if not tensors:
            raise ParityKitError(f"{path}: no tensors found in this file (it holds a {type(obj).__name__})")
        return tensors
    require_file(path)
    raise ParityKitError(f"{path}: unknown tensor file suffix (expected one of {', '.join(TENSOR_SUFFIXES)})")


def _stem(relative: Path) -> str:
    name = relative.name
    if name.endswith(INDEX_SUFFIX):
        return (relative.parent / _index_base(relative)).as_posix()
    return relative.with_suffix("").as_posix()


def read_manifest(folder: Path) -> dict[str, Any]:
    r"""The ``paritykit.json`` manifest :func:`paritykit.tracing.checkpoints.save_checkpoints` wrote into
    ``folder``."""
    manifest_path = folder / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("checkpoints"), list):
            raise TypeError("no 'checkpoints' list")
    except FileNotFoundError:
        raise ParityKitError(
            f"{folder}: no {MANIFEST_NAME} here (not a folder written by save_checkpoints)"
        ) from None
    except Exception as exc:
        raise ParityKitError(
            f"{manifest_path}: not a readable paritykit manifest ({first_line(exc)})"
        ) from None
    version = manifest.get("schema_version", 1)
    if version != CHECKPOINT_SCHEMA:
        raise ParityKitError(
            f"{manifest_path}: checkpoint schema {version!r}, this paritykit reads {CHECKPOINT_SCHEMA} (save"
            " the run again with this version)"
        )
    return manifest


# the schema_version save_checkpoints writes and read_manifest accepts
CHECKPOINT_SCHEMA = 1


def _checkpoint_dir_tensors(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for entry in read_manifest(folder)["checkpoints"]:
        name = entry["name"]
        for key, value in read_safetensors(folder / entry["file"]).items():
            tensors[f"{prefix}{name}/{key}"] = value
    return tensors


def _walk(folder: Path) -> Iterator[Path]:
    for child in sorted(folder.iterdir(), key=lambda p: natural_key(p.name)):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            yield from _walk(child)
        elif child.is_file():
            yield child


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    r"""Every tensor under ``path``, by name, in a stable order.

    Names: a single-tensor file (``.npy``, a pickled tensor) is named by its path stem relative to the folder
    given (``sub/x.pt`` -> ``sub/x``); a multi-tensor container (``.safetensors``, ``.npz``, a pickled dict,
    a sharded set) by ``stem/key`` whatever its count; nested pickled dicts use dotted keys.

    Order: a checkpoint folder written by :func:`paritykit.tracing.checkpoints.save_checkpoints` (it has a
    ``paritykit.json``) gives ``<checkpoint>/<key>`` in execution order; anything else is sorted naturally
    (``after_step_2`` before ``after_step_10``). Folders are walked recursively; files with other suffixes
    (configs, images) are skipped there, while naming one directly is an error.
    """
    path = Path(path)
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or directory")
    if path.name == MANIFEST_NAME and path.is_file():
        path = (
            path.parent
        )  # the manifest stands for its checkpoint folder (save_checkpoints returns its path)
    if path.is_file():
        tensors = _single_file_tensors(path, _stem(Path(path.name)))
        return {name: tensors[name] for name in sorted(tensors, key=natural_key)}
    if (path / MANIFEST_NAME).is_file():
        return _checkpoint_dir_tensors(path)

    files = list(_walk(path))
    indexes = [f for f in files if f.name.endswith(INDEX_SUFFIX)]
    sharded = set().union(*(_shards_of(index) for index in indexes)) if indexes else set()
    manifests = {f.parent for f in files if f.name == MANIFEST_NAME}
    tensors: dict[str, torch.Tensor] = {}
    for folder in sorted(manifests):
        tensors.update(_checkpoint_dir_tensors(folder, prefix=folder.relative_to(path).as_posix() + "/"))
    for file in files:
        if file.parent in manifests or any(parent in manifests for parent in file.parents):
            continue
        is_index = file.name.endswith(INDEX_SUFFIX)
        if not is_index and (file.suffix.lower() not in TENSOR_SUFFIXES or file.resolve() in sharded):
            continue
        tensors.update(_single_file_tensors(file, _stem(file.relative_to(path))))
    return {name: tensors[name] for name in sorted(tensors, key=natural_key)}
