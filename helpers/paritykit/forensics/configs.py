r"""Diff two model or pipeline configs key by key, whatever they are stored in.

Sources: a ``config.json`` (or any JSON object file), a diffusers model folder, a pipeline folder
(``model_index.json`` plus each component's config, compared component by component), the metadata of a
``.safetensors`` header, an original LDM-style YAML file, a plain dict, or a live model's ``.config``. Nested
keys are flattened to dotted paths and values compared type-aware: ``1 == 1.0`` and ``[1, 2] == (1, 2)``, but
``"1" != 1`` and ``True != 1``."""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.naming import Rule, natural_key, rename_all
from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, render_table
from paritykit.forensics.config_defaults import flat_defaults
from paritykit.forensics.config_files import flatten, load_config, values_equal
from paritykit.forensics.config_ldm import LdmDerivation, derive_from_ldm, is_ldm_config
from paritykit.forensics.config_suggest import MapSuggestion, suggest_map


def _ignored(key: str, patterns: Sequence[str]) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(leaf, p) for p in patterns)


# Why a key was left out of the comparison. None of these set exit 1; each is listed so nothing is hidden.
REFERENCE_ONLY = "reference only, not compared"
DEFAULT = "default, not compared"
BOOKKEEPING = "bookkeeping, not compared"
NOT_IN_REFERENCE = "not in the reference, not compared"
NO_COUNTERPART = "no counterpart derived from the YAML, not compared"
REASONS = (REFERENCE_ONLY, NO_COUNTERPART, DEFAULT, NOT_IN_REFERENCE, BOOKKEEPING)


@dataclass
class ConfigDifference:
    key: str
    a: Any
    b: Any
    a_default: bool = False
    b_default: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "a": self.a,
            "b": self.b,
            "a_default": self.a_default,
            "b_default": self.b_default,
        }


@dataclass
class Uncompared:
    r"""A key left out of the comparison, with the side it is on and why (one of :data:`REASONS`)."""

    key: str
    side: str
    reason: str
    value: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "side": self.side, "reason": self.reason, "value": self.value}


@dataclass
class ConfigDiff:
    r"""Result of :func:`config_diff`: one object, rendered as a table or as JSON.

    Keys are dotted paths in B's naming (``--map`` rules rename A's keys before matching). Only
    ``differences``, ``only_a`` and ``only_b`` make the exit code 1; ``not_compared`` lists every key left out
    and why."""

    a: str
    b: str
    differences: list[ConfigDifference] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    equal: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)
    not_compared: list[Uncompared] = field(default_factory=list)
    filled_defaults: dict[str, list[str]] = field(default_factory=lambda: {"a": [], "b": []})
    derived_with: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    suggestions: list[MapSuggestion] = field(default_factory=list)
    # text-only folding of wholly unread YAML subtrees into ``prefix.*`` (JSON lists every key)
    reference_only_summary: list[str] = field(default_factory=list)
    # keys only A has for which B's class has a default: what --with-defaults would compare
    only_a_with_b_default: list[str] = field(default_factory=list)

    @property
    def same(self) -> int:
        return len(self.equal)

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
            "equal": list(self.equal),
            "ignored": list(self.ignored),
            "renamed": dict(self.renamed),
            "not_compared": [u.to_dict() for u in self.not_compared],
            "filled_defaults": {side: list(keys) for side, keys in self.filled_defaults.items()},
            "derived_with": dict(self.derived_with),
            "notes": list(self.notes),
            "suggested_map": [s.to_dict() for s in self.suggestions],
            "only_a_with_b_default": list(self.only_a_with_b_default),
            "environment": environment_stamp(),
        }

    def _answer(self) -> str:
        r"""The verdict first: the configs match, or how many keys differ and the first of them."""
        if not self.exit_code:
            return "verdict: configs match"
        counts = f"{len(self.differences)} differ, {len(self.only_a)} only in A, {len(self.only_b)} only in B"
        return f"verdict: differ ({counts}); first: {_first_words(self)}"

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        lines = [self._answer(), f"A: {self.a}", f"B: {self.b}"]
        for prefix, helper in self.derived_with.items():
            where = f" (compared with B's {prefix})" if prefix else ""
            lines.append(f"A read as diffusers config by diffusers' {helper}{where}")
        lines.extend(f"note: {note}" for note in self.notes)
        lines.append("")
        rows = [
            (d.key, _short(d.a) + _mark(d.a_default), _short(d.b) + _mark(d.b_default))
            for d in self.differences
        ]
        if rows:
            lines.append(render_table(["key", "A", "B"], rows, limit=limit))
            lines.append("")
        groups = [("only in A", self.only_a), ("only in B", self.only_b)]
        for reason in REASONS:
            keys = [u.key for u in self.not_compared if u.reason == reason]
            if reason == REFERENCE_ONLY and self.reference_only_summary:
                keys = self.reference_only_summary
            groups.append((reason, keys))
        for label, keys in groups:
            if keys:
                lines.append(_key_list(label, keys, limit))
        if self.only_a_with_b_default:
            lines.append(
                f"hint: B's class has a default for {len(self.only_a_with_b_default)} of the keys only in A; "
                "--with-defaults compares them with it"
            )
        if self.suggestions:
            lines.append("suggested --map (append after your own; check each):")
            lines.extend(f"  {s.argument}   # {s.evidence}" for s in self.suggestions)
        counts = [f"{self.same} equal"]
        if self.ignored:
            counts.append(f"{len(self.ignored)} ignored")
        if self.not_compared:
            counts.append(f"{len(self.not_compared)} not compared")
        if self.exit_code:
            summary = (
                f"{len(self.differences)} differ, {len(self.only_a)} only in A, {len(self.only_b)} only"
                " in B, " + ", ".join(counts)
            )
        else:
            summary = "configs match: " + ", ".join(counts)
        lines.append(summary)
        return "\n".join(lines)


def _first_words(report: ConfigDiff) -> str:
    if report.differences:
        d = report.differences[0]
        return f"{d.key}: A {_short(d.a)}, B {_short(d.b)}"
    side, keys = ("A", report.only_a) if report.only_a else ("B", report.only_b)
    return f"{keys[0]} only in {side}"


def _mark(is_default: bool) -> str:
    return " (default)" if is_default else ""


def _key_list(label: str, keys: list[str], limit: int | None) -> str:
    shown = keys if not limit else keys[:limit]
    more = f" … {len(keys) - len(shown)} more" if len(keys) > len(shown) else ""
    return f"{label} ({len(keys)}): " + ", ".join(shown) + more


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _label(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return str(source)
    if isinstance(source, Mapping):
        return "<dict>"
    return f"<{type(source).__name__}.config>"


@dataclass
class _Side:
    r"""One side's flat config, the keys filled from class defaults, and the class defaults themselves."""

    values: dict[str, Any]
    defaults: dict[str, Any] = field(default_factory=dict)
    filled: list[str] = field(default_factory=list)

    def fill(self) -> None:
        for key, value in self.defaults.items():
            if key not in self.values:
                self.values[key] = value
                self.filled.append(key)

    def at_default(self, key: str) -> bool:
        return key in self.defaults and values_equal(self.values[key], self.defaults[key])


def config_diff(
    a: Any,
    b: Any,
    *,
    ignore: Iterable[str] = (),
    rules: Sequence[Rule] = (),
    ldm: bool | None = None,
    reference_keys: bool = False,
    compare_defaults: bool = False,
    with_defaults: bool = False,
    class_name: str | None = None,
    suggest: bool = False,
) -> ConfigDiff:
    r"""Compare two configs key by key.

    Args:
        a: reference config (path, dict or object with ``.config``; see :func:`load_config`).
        b: config to check against it (the port).
        ignore: glob patterns matched against the dotted key or its last part (``_diffusers_version``,
            ``*._name_or_path``), on either side's name, before and after ``rules``; an ignored key is dropped
            from both sides.
        rules: ``(regex, repl)`` renaming rules applied in order to A's dotted keys (see
            :func:`paritykit.base.naming.parse_map_options`).
        ldm: read A, an original LDM YAML, as the diffusers config(s) diffusers' single-file helpers derive
            from it (:mod:`paritykit.forensics.config_ldm`). ``None`` (default): do so when A is such a YAML
            and B is not.
        reference_keys: compare only keys A has (after ``rules``); B's other keys are listed, not compared.
        compare_defaults: count B-only keys that hold B's class default as differences (by default they are
            listed as "default, not compared": a port's untouched default is not a claim about the reference).
        with_defaults: fill in each side's class defaults for keys its file never wrote, marked as defaults.
        class_name: B's class (``DDIMScheduler``) when its config has no ``_class_name``, or to override it.
        suggest: propose ``--map`` renames for the keys left unmatched
            (:mod:`paritykit.forensics.config_suggest`).

    Returns:
        A :class:`ConfigDiff`; ``exit_code`` is 0 when every compared key matches.
    """
    patterns = list(ignore)
    result = ConfigDiff(a=_label(a), b=_label(b))
    side_a, side_b, derivation = _load_sides(a, b, result, ldm, with_defaults, compare_defaults, class_name)

    renamed = rename_all(side_a.values, rules) if rules else {k: k for k in side_a.values}
    result.renamed = {old: new for old, new in renamed.items() if old != new}
    dropped = {new for old, new in renamed.items() if _ignored(old, patterns) or _ignored(new, patterns)}
    dropped |= {key for key in side_b.values if _ignored(key, patterns)}
    result.ignored = sorted(dropped, key=natural_key)
    mapped_a = {new: side_a.values[old] for old, new in renamed.items() if new not in dropped}
    filled_a = {renamed[old] for old in side_a.filled}
    kept_b = {key: value for key, value in side_b.values.items() if key not in dropped}

    if derivation is not None:
        unread = [key for key in derivation.reference_only if not _ignored(key, patterns)]
        yaml_values = flatten(derivation.source)
        result.not_compared += [Uncompared(key, "a", REFERENCE_ONLY, yaml_values[key]) for key in unread]
        result.reference_only_summary = derivation.reference_only_summary(unread)

    unmatched_b: dict[str, Any] = {}
    for key in sorted(mapped_a.keys() | kept_b.keys(), key=natural_key):
        if key in mapped_a and key in kept_b:
            _compare_key(result, key, mapped_a[key], kept_b[key], key in filled_a, key in side_b.filled)
        elif key in mapped_a:
            reason = BOOKKEEPING if _bookkeeping(key) else DEFAULT if key in filled_a else None
            _one_sided(result, key, "a", mapped_a[key], reason)
        else:
            reason = _b_only_reason(key, side_b, derivation, reference_keys, compare_defaults)
            _one_sided(result, key, "b", kept_b[key], reason)
            if reason in (None, DEFAULT, NOT_IN_REFERENCE):
                unmatched_b[key] = kept_b[key]
    if not with_defaults:
        result.only_a_with_b_default = [key for key in result.only_a if key in side_b.defaults]
    if suggest:
        result.suggestions = suggest_map({k: mapped_a[k] for k in result.only_a}, unmatched_b, values_equal)
    return result


def _load_sides(
    a: Any,
    b: Any,
    result: ConfigDiff,
    ldm: bool | None,
    with_defaults: bool,
    compare_defaults: bool,
    class_name: str | None,
) -> tuple[_Side, _Side, LdmDerivation | None]:
    r"""Both configs flattened, A derived from an LDM YAML when asked or detected, class defaults looked up
    (and filled in with ``with_defaults``); records what it did on ``result``."""
    config_a, config_b = load_config(a), load_config(b)
    derivation = None
    if ldm or (ldm is None and is_ldm_config(config_a) and not is_ldm_config(config_b)):
        derivation = derive_from_ldm(
            config_a, config_b, label=result.a, class_name=class_name, target_label=result.b
        )
        config_a = derivation.config
        result.derived_with = dict(derivation.parts)
        result.notes = list(derivation.notes)

    side_a = _Side(flatten(config_a))
    side_b = _Side(flatten(config_b))
    # A derived config has no class of its own: filling it would put words in the YAML's mouth
    if with_defaults and derivation is None:
        side_a.defaults = flat_defaults(config_a)
    if with_defaults or not compare_defaults or class_name:
        side_b.defaults = flat_defaults(config_b, class_name, strict=bool(class_name))
    if with_defaults:
        side_a.fill()
        side_b.fill()
    result.filled_defaults = {
        "a": sorted(side_a.filled, key=natural_key),
        "b": sorted(side_b.filled, key=natural_key),
    }
    return side_a, side_b, derivation


def _compare_key(result: ConfigDiff, key: str, a: Any, b: Any, a_default: bool, b_default: bool) -> None:
    if values_equal(a, b):
        result.equal.append(key)
    else:
        result.differences.append(ConfigDifference(key, a, b, a_default, b_default))


def _one_sided(result: ConfigDiff, key: str, side: str, value: Any, reason: str | None) -> None:
    if reason is not None:
        result.not_compared.append(Uncompared(key, side, reason, value))
    else:
        (result.only_a if side == "a" else result.only_b).append(key)


def _bookkeeping(key: str) -> bool:
    # diffusers' own entries (_class_name, _diffusers_version, _name_or_path …) describe the file, not the
    # model
    return key.rsplit(".", 1)[-1].startswith("_")


def _b_only_reason(
    key: str, side_b: _Side, derivation: LdmDerivation | None, reference_keys: bool, compare_defaults: bool
) -> str | None:
    if derivation is not None:
        if key in derivation.underived:
            return NO_COUNTERPART
        if "" not in derivation.parts and not any(
            key.startswith(prefix + ".") for prefix in derivation.parts
        ):
            return NO_COUNTERPART
    if _bookkeeping(key):
        return BOOKKEEPING
    if not compare_defaults and side_b.at_default(key):
        return DEFAULT
    if reference_keys:
        return NOT_IN_REFERENCE
    return None
