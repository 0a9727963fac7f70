r"""Reading configs from any file a port meets (config.json, model_index.json folders, YAML, safetensors
metadata), flattened to dotted keys."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paritykit.base.errors import ParityKitError

# Per-component config files of a diffusers pipeline folder, in the order they are looked for.
COMPONENT_CONFIG_FILES = (
    "config.json",
    "scheduler_config.json",
    "preprocessor_config.json",
    "tokenizer_config.json",
)


def load_config(source: Any) -> dict[str, Any]:
    r"""Read a config from a path, a dict, or an object with a ``.config`` attribute.

    Args:
        source: a JSON file, a YAML file (``.yaml``/``.yml``), a ``.safetensors`` file (its ``config``
            metadata entry when that holds a JSON object, else the whole metadata), a diffusers model folder
            (``config.json``), a pipeline folder (``model_index.json``: each component becomes a nested dict),
            a mapping, or a live model/pipeline whose ``.config`` is a mapping.

    Returns:
        A plain (nested) dict.
    """
    if isinstance(source, Mapping):
        return _plain(source)
    if isinstance(source, (str, os.PathLike)):
        return _load_path(Path(source))
    config = getattr(source, "config", None)
    if config is not None:
        if hasattr(config, "to_dict") and not isinstance(config, Mapping):
            config = config.to_dict()
        if isinstance(config, Mapping):
            return _plain(config)
    raise ParityKitError(
        f"cannot read a config from {type(source).__name__}: expected a path, a dict or a model"
    )


def _plain(mapping: Mapping) -> dict[str, Any]:
    return {str(k): _plain(v) if isinstance(v, Mapping) else v for k, v in mapping.items()}


def _load_path(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ParityKitError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / "model_index.json").is_file():
            return _load_pipeline(path)
        if (path / "config.json").is_file():
            return _read_json(path / "config.json")
        for name in COMPONENT_CONFIG_FILES[1:]:
            if (path / name).is_file():
                return _read_json(path / name)
        raise ParityKitError(f"{path}: folder has neither model_index.json nor config.json")
    if path.name == "model_index.json":
        return _load_pipeline(path.parent)
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return _read_yaml(path)
    if suffix == ".safetensors":
        return _read_safetensors_metadata(path)
    return _read_json(path)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ParityKitError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ParityKitError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        value = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ParityKitError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(value, dict):
        raise ParityKitError(f"{path}: expected a YAML mapping, found {type(value).__name__}")
    return _plain(value)


def _read_safetensors_metadata(path: Path) -> dict[str, Any]:
    from paritykit.forensics.safetensors_header import read_safetensors_header

    metadata = read_safetensors_header(path).metadata
    if not metadata:
        raise ParityKitError(f"{path}: safetensors header has no __metadata__ to compare")
    if "config" in metadata:
        try:
            config = json.loads(metadata["config"])
        except json.JSONDecodeError:
            config = None
        if isinstance(config, dict):
            return config
    return dict(metadata)


def _load_pipeline(folder: Path) -> dict[str, Any]:
    index = _read_json(folder / "model_index.json")
    pipeline: dict[str, Any] = {}
    for name, value in index.items():
        is_component = isinstance(value, list) and len(value) == 2 and not name.startswith("_")
        if not is_component:
            pipeline[name] = value
            continue
        library, class_name = value
        component: dict[str, Any] = {"_library": library, "_class": class_name}
        sub = folder / name
        for filename in COMPONENT_CONFIG_FILES:
            if (sub / filename).is_file():
                component.update(_read_json(sub / filename))
                break
        pipeline[name] = component if class_name is not None else None
    return pipeline


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    r"""Nested mappings to ``{"a.b.c": leaf}``; lists stay leaves (compared element-wise)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, path))
        else:
            flat[path] = value
    return flat


def values_equal(a: Any, b: Any) -> bool:
    r"""Type-aware equality: numbers by value (``1 == 1.0``, NaN equals NaN), sequences element-wise whatever
    their container (list or tuple), but a string never equals a number and a bool never equals an int."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if type(a) is not type(b) and not (isinstance(a, str) and isinstance(b, str)):
        return False
    return a == b
