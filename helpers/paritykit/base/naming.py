"""One spelling of renaming rules everywhere: ``--map 'REGEX=REPL'`` applied to the first argument's names."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from paritykit.base.errors import ParityKitError

Rule = tuple[str, str]


def parse_map_options(options: Iterable[str], *, option: str = "--map") -> list[Rule]:
    r"""Turn repeated ``REGEX=REPL`` strings into ``[(regex, repl), …]``.

    The split is at the last ``=`` (replacement strings rarely contain one). Invalid regexes raise
    :class:`ParityKitError` naming the option."""
    rules: list[Rule] = []
    for text in options:
        if "=" not in text:
            raise ParityKitError(f"{option} {text!r}: expected 'REGEX=REPL'")
        pattern, repl = text.rsplit("=", 1)
        rules.append((pattern, repl))
    compile_rules(rules, option=option)
    return rules


def compile_rules(rules: Sequence[Rule], *, option: str = "--map") -> list[tuple[re.Pattern[str], str]]:
    """Compile rules once, with a one-line error naming the bad pattern."""
    compiled = []
    for pattern, repl in rules:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise ParityKitError(f"{option} {pattern!r}: invalid regular expression ({exc})") from None
        _check_replacement(regex, repl, option)
        compiled.append((regex, repl))
    return compiled


def _check_replacement(regex: re.Pattern[str], repl: str, option: str) -> None:
    # A bad replacement (``\9``, ``\g<nope>``) only fails once a name matches, deep inside a command:
    # expand it now against an empty match with the same groups, so it is one line naming the option.
    names = {index: name for name, index in regex.groupindex.items()}
    groups = "".join(f"(?P<{names[i]}>)" if i in names else "()" for i in range(1, regex.groups + 1))
    try:
        re.compile(groups).match("").expand(repl)
    except (re.error, IndexError) as exc:
        raise ParityKitError(
            f"{option} '{regex.pattern}={repl}': invalid replacement ({exc}); "
            r"groups are \1 or \g<name>, a literal backslash is \\"
        ) from None


def apply_rules(name: str, rules: Sequence[Rule] | Sequence[tuple[re.Pattern[str], str]]) -> str:
    r"""Apply every rule in order (``re.sub``) to one name."""
    for pattern, repl in rules:
        regex = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern)
        name = regex.sub(repl, name)
    return name


def rename_all(names: Iterable[str], rules: Sequence[Rule]) -> dict[str, str]:
    r"""Map each original name to its renamed form; raises when two names collapse onto one."""
    compiled = compile_rules(rules)
    renamed: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        new = apply_rules(name, compiled)
        if new in seen and seen[new] != name:
            raise ParityKitError(f"--map sends both {seen[new]!r} and {name!r} to {new!r}")
        seen[new] = name
        renamed[name] = new
    return renamed


_NUM = re.compile(r"(\d+)")


def natural_key(name: str) -> list[object]:
    """Sort key that puts ``after_step_2`` before ``after_step_10``."""
    return [int(part) if part.isdigit() else part for part in _NUM.split(name)]
