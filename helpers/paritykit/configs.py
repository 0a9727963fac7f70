r"""Diff two model or pipeline configs key by key, whatever they are stored in.

Sources: a ``config.json`` (or any JSON object file), a diffusers model folder, a pipeline folder (``model_index.json``
plus each component's config, compared component by component), the metadata of a ``.safetensors`` header, an
original LDM-style YAML file, a plain dict, or a live model's ``.config``. Nested keys are flattened to dotted paths
and values compared type-aware: ``1 == 1.0`` and ``[1, 2] == (1, 2)``, but ``"1" != 1`` and ``True != 1``.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.errors import ParityKitError
from paritykit.naming import Rule, natural_key, rename_all
from paritykit.report import DEFAULT_LIMIT, environment_stamp, render_table

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
        source: a JSON file, a YAML file (``.yaml``/``.yml``), a ``.safetensors`` file (its ``config`` metadata
            entry when that holds a JSON object, else the whole metadata), a diffusers model folder
            (``config.json``), a pipeline folder (``model_index.json``: each component becomes a nested dict), a
            mapping, or a live model/pipeline whose ``.config`` is a mapping.

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
    from paritykit.safetensors_header import read_safetensors_header

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


def _ignored(key: str, patterns: Sequence[str]) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(leaf, p) for p in patterns)


@dataclass
class ConfigDifference:
    key: str
    a: Any
    b: Any

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "a": self.a, "b": self.b}


@dataclass
class ConfigDiff:
    r"""Result of :func:`config_diff`: one object, rendered as a table or as JSON.

    Keys are dotted paths in B's naming (``--map`` rules rename A's keys before matching).
    """

    a: str
    b: str
    differences: list[ConfigDifference] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    same: int = 0
    ignored: int = 0
    renamed: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 1 if self.differences or self.only_a or self.only_b else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "differences": [d.to_dict() for d in self.differences],
            "only_a": list(self.only_a),
            "only_b": list(self.only_b),
            "same": self.same,
            "ignored": self.ignored,
            "renamed": dict(self.renamed),
            "environment": environment_stamp(),
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        lines = [f"A: {self.a}", f"B: {self.b}", ""]
        if not self.exit_code:
            lines.append(
                f"configs match: {self.same} keys equal"
                + (f", {self.ignored} ignored" if self.ignored else "")
            )
            return "\n".join(lines)
        rows = [(d.key, _short(d.a), _short(d.b)) for d in self.differences]
        if rows:
            lines.append(render_table(["key", "A", "B"], rows, limit=limit))
            lines.append("")
        for label, keys in (("only in A", self.only_a), ("only in B", self.only_b)):
            if keys:
                shown = keys if not limit else keys[:limit]
                more = f" … {len(keys) - len(shown)} more" if len(keys) > len(shown) else ""
                lines.append(f"{label} ({len(keys)}): " + ", ".join(shown) + more)
        lines.append(
            f"{len(self.differences)} differ, {len(self.only_a)} only in A, {len(self.only_b)} only in B, "
            f"{self.same} equal" + (f", {self.ignored} ignored" if self.ignored else "")
        )
        return "\n".join(lines)


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _label(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    if isinstance(source, Mapping):
        return "<dict>"
    return f"<{type(source).__name__}.config>"


def config_diff(a: Any, b: Any, *, ignore: Iterable[str] = (), rules: Sequence[Rule] = ()) -> ConfigDiff:
    r"""Compare two configs key by key.

    Args:
        a: reference config (path, dict or object with ``.config``; see :func:`load_config`).
        b: config to check against it.
        ignore: glob patterns matched against the dotted key or its last part (``_diffusers_version``,
            ``*._name_or_path``); checked on A's original and renamed keys and on B's keys.
        rules: ``(regex, repl)`` renaming rules applied in order to A's dotted keys (see
            :func:`paritykit.naming.parse_map_options`).

    Returns:
        A :class:`ConfigDiff`; ``exit_code`` is 0 when every remaining key matches.
    """
    patterns = list(ignore)
    flat_a = flatten(load_config(a))
    flat_b = flatten(load_config(b))
    renamed = rename_all(flat_a, rules) if rules else {k: k for k in flat_a}
    result = ConfigDiff(a=_label(a), b=_label(b))
    result.renamed = {old: new for old, new in renamed.items() if old != new}

    mapped_a: dict[str, Any] = {}
    for old, new in renamed.items():
        if _ignored(old, patterns) or _ignored(new, patterns):
            result.ignored += 1
        else:
            mapped_a[new] = flat_a[old]
    kept_b = {}
    for key, value in flat_b.items():
        if _ignored(key, patterns):
            result.ignored += 1
        else:
            kept_b[key] = value

    for key in sorted(mapped_a.keys() | kept_b.keys(), key=natural_key):
        if key not in kept_b:
            result.only_a.append(key)
        elif key not in mapped_a:
            result.only_b.append(key)
        elif values_equal(mapped_a[key], kept_b[key]):
            result.same += 1
        else:
            result.differences.append(ConfigDifference(key, mapped_a[key], kept_b[key]))
    return result
