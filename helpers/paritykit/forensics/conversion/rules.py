r"""Rule building: exact name mappings collapsed into few regex rules (prefix strips, numbered templates,
merged suffixes)."""

from __future__ import annotations

import functools
import json
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from paritykit.forensics.conversion.names import (
    DIGITS,
    module_of_tensor,
    name_numbers,
    name_skeleton,
)
from paritykit.forensics.conversion.results import (
    ConversionRule,
    MappingEntry,
)


def _template_escape(text: str) -> str:
    return text.replace("\\", "\\\\")


def _sig(entry: MappingEntry) -> str:
    return json.dumps([entry.op, entry.args], sort_keys=True)


def _literal_rule(entry: MappingEntry) -> ConversionRule:
    return ConversionRule(
        re.escape(entry.sources[0]),
        [_template_escape(s) for s in entry.sources],
        _template_escape(entry.target),
        entry.op,
        entry.args,
        1,
    )


def _group_rules(entries: list[MappingEntry]) -> list[ConversionRule]:
    r"""Rules for entries sharing name skeletons and op: numbers that vary together become ``(\d+)``."""
    first = [name_numbers(e.sources[0]) for e in entries]
    derived_names = [[*e.sources[1:], e.target] for e in entries]
    derived = [[name_numbers(n) for n in names] for names in derived_names]
    n_first = len(first[0])
    src_cols = [tuple(f[i] for f in first) for i in range(n_first)]

    split_src: list[int] = []
    split_derived: list[tuple[int, int]] = []
    spec: dict[tuple[int, int], tuple[str, Any]] = {}
    referenced: set[int] = set()
    for j in range(len(derived[0])):
        for p in range(len(derived[0][j])):
            col = tuple(d[j][p] for d in derived)
            refs = [i for i in range(n_first) if src_cols[i] == col]
            if len(set(col)) == 1 and (not refs or len(set(src_cols[refs[0]])) == 1):
                spec[(j, p)] = ("lit", col[0])
            elif refs:
                i = p if p in refs else refs[0]
                spec[(j, p)] = ("ref", i)
                referenced.add(i)
            else:
                split_derived.append((j, p))
    for i in range(n_first):
        if i not in referenced and len(set(src_cols[i])) > 1:
            split_src.append(i)
    if split_src or split_derived:
        groups: dict[tuple, list[MappingEntry]] = defaultdict(list)
        for k, e in enumerate(entries):
            groups[
                tuple(first[k][i] for i in split_src) + tuple(derived[k][j][p] for j, p in split_derived)
            ].append(e)
        if len(groups) == 1:  # cannot split further: spell every entry out
            return [_literal_rule(e) for e in entries]
        return [r for g in groups.values() for r in _group_rules(g)]

    group_of = {i: g + 1 for g, i in enumerate(sorted(referenced))}
    texts = DIGITS.split(entries[0].sources[0])
    pattern = re.escape(texts[0])
    for i in range(n_first):
        pattern += r"(\d+)" if i in referenced else re.escape(src_cols[i][0])
        pattern += re.escape(texts[i + 1])

    def template(name: str, j: int) -> str:
        pieces = DIGITS.split(name)
        out = _template_escape(pieces[0])
        for p in range(len(pieces) - 1):
            kind, value = spec[(j, p)]
            if kind == "lit":
                out += value
            else:
                nxt = pieces[p + 1]
                out += f"\\g<{group_of[value]}>" if nxt[:1].isdigit() else f"\\{group_of[value]}"
            out += _template_escape(pieces[p + 1])
        return out

    templates = [template(n, j) for j, n in enumerate(derived_names[0])]
    sources = [_first_template(entries[0].sources[0], src_cols, referenced, group_of), *templates[:-1]]
    return [ConversionRule(pattern, sources, templates[-1], entries[0].op, entries[0].args, len(entries))]


def _first_template(name: str, src_cols, referenced, group_of) -> str:
    """The first source written as a template (for display and for the ``sources`` list)."""
    pieces = DIGITS.split(name)
    out = _template_escape(pieces[0])
    for i in range(len(pieces) - 1):
        if i in referenced:
            out += f"\\g<{group_of[i]}>" if pieces[i + 1][:1].isdigit() else f"\\{group_of[i]}"
        else:
            out += src_cols[i][0]
        out += _template_escape(pieces[i + 1])
    return out


def collapse_rules(mapping: list[MappingEntry], source_keys: Iterable[str]) -> list[ConversionRule]:
    r"""Collapse a mapping into regex rules over layer indices, verified against the source key names.

    Entries whose names share a skeleton (digits blanked) and whose op and args are equal form one rule;
    numbers that vary together between source and target become ``(\d+)`` captures and back-references.
    The rules are then applied to every source name: a rule that would produce a target the mapping does
    not contain (or builds it differently) is replaced by one literal rule per entry.
    """
    keys = list(source_keys)
    prefix_rules, mapping = _prefix_rules(mapping, keys)
    groups: dict[tuple, list[MappingEntry]] = defaultdict(list)
    for e in mapping:
        groups[(tuple(name_skeleton(s) for s in e.sources), name_skeleton(e.target), _sig(e))].append(e)
    rules: list[ConversionRule] = []
    origin: list[list[MappingEntry]] = []
    for entries in groups.values():
        for rule in _group_rules(entries):
            rules.append(rule)
            origin.append(entries)
    expected = {e.target: (tuple(e.sources), _sig(e)) for e in mapping}
    keys = list(source_keys)
    for _ in range(3):
        bad = _bad_rules(rules, expected, keys)
        if not bad:
            break
        fixed: list[ConversionRule] = []
        for k, rule in enumerate(rules):
            if k not in bad:
                fixed.append(rule)
                continue
            regex = re.compile(rule.pattern)
            fixed += [
                _literal_rule(e)
                for e in origin[k]
                if regex.fullmatch(e.sources[0]) and expand_rule(regex, e.sources[0], rule.target) == e.target
            ]
        rules = fixed
        origin = _origins(rules, mapping)
    # rules read in target order: the first target each rule builds
    origin = _origins(rules, mapping)
    position = {e.target: i for i, e in enumerate(mapping)}
    first = {
        id(r): min((position[e.target] for e in o), default=len(position)) for r, o in zip(rules, origin)
    }
    rules.sort(key=lambda r: first[id(r)])
    return prefix_rules + _merge_suffixes(rules)


def _prefix_rules(
    mapping: list[MappingEntry], keys: list[str]
) -> tuple[list[ConversionRule], list[MappingEntry]]:
    r"""One rule for a pure prefix strip (or swap): every source key under ``P`` maps, unchanged, to the
    same name under ``Q`` (``model.diffusion_model.x -> x``); the entries it covers leave the mapping."""
    groups: dict[tuple, list[MappingEntry]] = defaultdict(list)
    for e in mapping:
        if len(e.sources) != 1 or e.op not in ("identity", "cast"):
            continue
        source, target = e.sources[0], e.target
        tail = os.path.commonprefix([source[::-1], target[::-1]])[::-1]
        tail = tail[tail.find(".") + 1 :] if not (tail == source or tail == target) else tail
        p, q = source[: len(source) - len(tail)], target[: len(target) - len(tail)]
        if tail and (p or q) and (not p or p.endswith(".")) and (not q or q.endswith(".")):
            groups[(p, q, _sig(e))].append(e)
    rules, covered = [], set()
    for (p, q, _), entries in groups.items():
        under = [k for k in keys if k.startswith(p)]
        modules = {module_of_tensor(x.target) for x in entries}
        # a strip spanning several modules, with no layer number in it (those are the index rules' job)
        if len(modules) < 2 or DIGITS.search(p + q) or len(under) != len(entries):
            continue
        e = entries[0]
        rules.append(
            ConversionRule(
                re.escape(p) + "(.+)",
                [_template_escape(p) + "\\1"],
                _template_escape(q) + "\\1",
                e.op,
                e.args,
                len(entries),
            )
        )
        covered.update(id(x) for x in entries)
    return rules, [e for e in mapping if id(e) not in covered]


_LAST = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _merge_suffixes(rules: list[ConversionRule]) -> list[ConversionRule]:
    r"""Merge rules that differ only in a last name component kept as is (``weight``/``bias``) into one.

    ``…\.qkv\.weight -> ….to_q.weight`` and ``…\.qkv\.bias -> ….to_q.bias`` (same op and args) become
    ``…\.qkv\.(weight|bias) -> ….to_q.``. The merged pattern matches exactly the union of what the
    verified rules matched, so it needs no new check.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k, r in enumerate(rules):
        last = r.target.rsplit(".", 1)[-1]
        if (
            len(r.sources) != 1
            or "." not in r.target
            or not _LAST.fullmatch(last)
            or not r.pattern.endswith("\\." + last)
            or not r.sources[0].endswith("." + last)
        ):
            continue
        key = (
            r.pattern[: -len(last)],
            r.sources[0][: -len(last)],
            r.target[: -len(last)],
            r.op,
            json.dumps(r.args, sort_keys=True),
        )
        groups[key].append(k)
    merged: dict[int, ConversionRule] = {}
    dropped: set[int] = set()
    for (pattern, source, target, _, _), members in groups.items():
        if len(members) < 2:
            continue
        lasts = [rules[k].target.rsplit(".", 1)[-1] for k in members]
        group = re.compile(pattern).groups + 1
        ref = f"\\{group}"
        first = rules[members[0]]
        merged[members[0]] = ConversionRule(
            pattern + "(" + "|".join(lasts) + ")",
            [source + ref],
            target + ref,
            first.op,
            first.args,
            sum(rules[k].count for k in members),
        )
        dropped.update(members[1:])
    return [merged.get(k, r) for k, r in enumerate(rules) if k not in dropped]


_TEMPLATE_PART = re.compile(r"\\g<(\d+)>|\\(\d+)|\\(\\)")


@functools.lru_cache(maxsize=4096)
def _template_parts(template: str) -> tuple[str | int, ...]:
    parts: list[str | int] = []
    pos = 0
    for m in _TEMPLATE_PART.finditer(template):
        parts.append(template[pos : m.start()])
        parts.append(int(m.group(1) or m.group(2)) if m.group(3) is None else "\\")
        pos = m.end()
    parts.append(template[pos:])
    return tuple(parts)


def _fill(match: re.Match[str], template: str) -> str:
    """``match.expand(template)`` for the templates rules use, without re-parsing the template every call."""
    return "".join(p if isinstance(p, str) else match.group(p) for p in _template_parts(template))


def expand_rule(regex: re.Pattern[str], key: str, template: str) -> str | None:
    m = regex.fullmatch(key)
    return _fill(m, template) if m else None


def _origins(rules: list[ConversionRule], mapping: list[MappingEntry]) -> list[list[MappingEntry]]:
    by_first: dict[str, list[MappingEntry]] = defaultdict(list)
    for e in mapping:
        by_first[name_skeleton(e.sources[0])].append(e)
    out = []
    for r in rules:
        regex = re.compile(r.pattern)
        skel = name_skeleton(_unescape_pattern(r.pattern))
        out.append(
            [e for e in by_first.get(skel, []) if expand_rule(regex, e.sources[0], r.target) == e.target]
        )
    return out


def _unescape_pattern(pattern: str) -> str:
    return re.sub(r"\\(.)", r"\1", pattern.replace(r"(\d+)", "0"))


def _bad_rules(rules: list[ConversionRule], expected: dict, keys: list[str]) -> set[int]:
    by_skel: dict[str, list[int]] = defaultdict(list)
    for k, r in enumerate(rules):
        by_skel[name_skeleton(_unescape_pattern(r.pattern))].append(k)
    regexes = [re.compile(r.pattern) for r in rules]  # once per rule: re's own cache holds 512 patterns
    ops = [json.dumps([r.op, r.args], sort_keys=True) for r in rules]
    bad: set[int] = set()
    for key in keys:
        for k in by_skel.get(name_skeleton(key), ()):
            r = rules[k]
            m = regexes[k].fullmatch(key)
            if m is None:
                continue
            names = (key, *(_fill(m, s) for s in r.sources[1:]))
            if expected.get(_fill(m, r.target)) != (names, ops[k]):
                bad.add(k)
    return bad
