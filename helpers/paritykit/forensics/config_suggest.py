r"""Propose ``--map`` renames for a config diff from what the two sides show: shared key tails, equal values,
similar names.

Only pairs the evidence singles out are proposed: a prefix whose removal lines up at least two keys, a value
that occurs once on each side under names that are not unrelated, or an equal value under clearly similar
names. Anything tied is left out rather than guessed. Each proposal is a ready ``--map 'REGEX=REPL'``
argument, meant to be appended after the user's own.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Values too common to identify a key by (flags, zero, one, nothing).
_TRIVIAL = (None, True, False, 0, 1, "", [])
_MIN_SIMILARITY = 0.5
# A value held by one key on each side still needs names that are not unrelated: tried on SD v1's YAML against
# its diffusers UNet, unique values alone paired image_size (32) with norm_num_groups (32).
_MIN_UNIQUE_SIMILARITY = 0.35


@dataclass
class MapSuggestion:
    r"""One proposed rename rule and the evidence for it."""

    pattern: str
    replacement: str
    pairs: list[tuple[str, str]] = field(default_factory=list)
    evidence: str = ""

    @property
    def argument(self) -> str:
        return "--map " + shlex.quote(f"{self.pattern}={self.replacement}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "map": f"{self.pattern}={self.replacement}",
            "argument": self.argument,
            "pairs": [list(pair) for pair in self.pairs],
            "evidence": self.evidence,
        }


def suggest_map(
    only_a: Mapping[str, Any], only_b: Mapping[str, Any], equal: Callable[[Any, Any], bool]
) -> list[MapSuggestion]:
    r"""Rename rules that would line up A's unmatched keys with B's.

    Args:
        only_a: A's keys (already renamed by the user's rules) that B lacks, with their values.
        only_b: B's keys that A lacks, with their values (defaults included: a rename target is often one).
        equal: the value comparison of the diff (:func:`paritykit.forensics.configs.values_equal`).

    Returns:
        Suggestions in the order they should be applied: a prefix strip first, then single-key renames.
    """
    suggestions: list[MapSuggestion] = []
    remaining_a = dict(only_a)
    prefix = _shared_prefix(remaining_a, only_b, equal)
    if prefix is not None:
        strip, lined_up = prefix
        suggestions.append(
            MapSuggestion(
                pattern="^" + re.escape(strip),
                replacement="",
                pairs=[(strip + key, key) for key in lined_up],
                evidence=f"{len(lined_up)} keys line up once '{strip}' is removed",
            )
        )
        # the rule strips the prefix from every key, so later renames must name the stripped keys
        remaining_a = {
            key.removeprefix(strip): value
            for key, value in remaining_a.items()
            if key.removeprefix(strip) not in only_b
        }
    remaining_b = {
        key: value for key, value in only_b.items() if key not in {b for _, b in _pairs(suggestions)}
    }
    suggestions.extend(_renames(remaining_a, remaining_b, equal))
    return suggestions


def _pairs(suggestions: list[MapSuggestion]) -> list[tuple[str, str]]:
    return [pair for suggestion in suggestions for pair in suggestion.pairs]


def _shared_prefix(
    only_a: Mapping[str, Any], only_b: Mapping[str, Any], equal: Callable[[Any, Any], bool]
) -> tuple[str, list[str]] | None:
    r"""The dotted prefix whose removal lines up the most A keys with B keys (equal values first); ``None``
    when fewer than two line up or two prefixes tie."""
    scores: dict[str, list[int]] = {}
    for key, value in only_a.items():
        parts = key.split(".")
        for depth in range(1, len(parts)):
            tail = ".".join(parts[depth:])
            if tail in only_b:
                score = scores.setdefault(".".join(parts[:depth]) + ".", [0, 0])
                score[0] += equal(value, only_b[tail])
                score[1] += 1
    ranked = sorted(scores.items(), key=lambda item: item[1], reverse=True)
    if not ranked or ranked[0][1][1] < 2 or (len(ranked) > 1 and ranked[1][1] == ranked[0][1]):
        return None
    best = ranked[0][0]
    return best, sorted(
        key[len(best) :] for key in only_a if key.startswith(best) and key[len(best) :] in only_b
    )


def _tokens(name: str) -> set[str]:
    return {token.removesuffix("s") for token in re.split(r"[._]", name.lower()) if token}


def name_similarity(a: str, b: str) -> float:
    r"""How alike two key names look (their last dotted parts): the better of a character match and token
    overlap, from 0 to 1."""
    leaf_a, leaf_b = a.rsplit(".", 1)[-1].lower(), b.rsplit(".", 1)[-1].lower()
    ratio = difflib.SequenceMatcher(None, leaf_a, leaf_b).ratio()
    ta, tb = _tokens(leaf_a), _tokens(leaf_b)
    jaccard = len(ta & tb) / len(ta | tb) if ta | tb else 0.0
    return max(ratio, jaccard)


def _trivial(value: Any) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value in (0, 1):
        return True  # 0.0 and 1.0 are as common as 0 and 1
    return any(type(value) is type(t) and value == t for t in _TRIVIAL)


def _count(values: list[Any], value: Any, equal: Callable[[Any, Any], bool]) -> int:
    return sum(1 for other in values if equal(other, value))


def _renames(
    only_a: Mapping[str, Any], only_b: Mapping[str, Any], equal: Callable[[Any, Any], bool]
) -> list[MapSuggestion]:
    values_a, values_b = list(only_a.values()), list(only_b.values())
    scored: list[tuple[float, str, str, str]] = []
    for key_a, value_a in only_a.items():
        for key_b, value_b in only_b.items():
            if not equal(value_a, value_b):
                continue
            similarity = name_similarity(key_a, key_b)
            unique = (
                not _trivial(value_a)
                and _count(values_a, value_a, equal) == 1
                and _count(values_b, value_b, equal) == 1
            )
            shown = json.dumps(value_a, default=str)
            if unique and similarity >= _MIN_UNIQUE_SIMILARITY:
                scored.append((1 + similarity, key_a, key_b, f"the only keys holding {shown}"))
            elif similarity >= _MIN_SIMILARITY:
                scored.append((similarity, key_a, key_b, f"both {shown}, similar names"))
    return [
        MapSuggestion(
            pattern="^" + re.escape(key_a) + "$",
            replacement=key_b.replace("\\", "\\\\"),
            pairs=[(key_a, key_b)],
            evidence=evidence,
        )
        for key_a, key_b, evidence in _one_to_one(scored)
    ]


def _one_to_one(scored: list[tuple[float, str, str, str]]) -> list[tuple[str, str, str]]:
    r"""Greedy best-first pairing; a pair tied with another pair for the same key is dropped, not guessed."""
    chosen: list[tuple[str, str, str]] = []
    used_a: set[str] = set()
    used_b: set[str] = set()
    for score, key_a, key_b, evidence in sorted(scored, key=lambda s: (-s[0], s[1], s[2])):
        if key_a in used_a or key_b in used_b:
            continue
        rivals = [
            s
            for s in scored
            if s[0] == score
            and (s[1] == key_a) != (s[2] == key_b)
            and s[1] not in used_a
            and s[2] not in used_b
        ]
        used_a.add(key_a)
        used_b.add(key_b)
        if not rivals:
            chosen.append((key_a, key_b, evidence))
    return sorted(chosen)
