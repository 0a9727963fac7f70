"""Shared pieces of every report: strict JSON, the environment stamp, bounded tables."""

from __future__ import annotations

import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from typing import Any

SCHEMA_VERSION = 1
DEFAULT_LIMIT = 40


def _package_version(name: str) -> str | None:
    r"""An installed distribution's version, from its ``NAME-VERSION.dist-info`` folder on ``sys.path`` (the
    wheel spec's own name for it); ``importlib.metadata`` only when there is none, since importing it costs
    every command about 20 ms at start-up (it brings in the email parser)."""
    import sys

    prefix = name.replace("-", "_") + "-"
    for entry in sys.path:
        try:
            found = [n for n in os.listdir(entry or ".") if n.startswith(prefix) and n.endswith(".dist-info")]
        except OSError:
            continue
        if len(found) == 1:
            return found[0][len(prefix) : -len(".dist-info")]
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment_stamp(**extra: Any) -> dict[str, Any]:
    r"""Versions that matter when two numbers disagree; read from package metadata so torch is not imported.

    Args:
        extra: fields such as ``device="cpu"`` or ``dtype="float32"`` that the command knows.
    """
    from paritykit._version import __version__

    stamp: dict[str, Any] = {
        "paritykit": __version__,
        "python": platform.python_version(),
        "torch": _package_version("torch"),
        "diffusers": _package_version("diffusers"),
    }
    stamp.update({k: v for k, v in extra.items() if v is not None})
    return stamp


def _finite_copy(value: Any, path: str, flags: dict[str, str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        flags[path] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return None
    if isinstance(value, dict):
        return {k: _finite_copy(v, f"{path}.{k}" if path else str(k), flags) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_copy(v, f"{path}.{i}" if path else str(i), flags) for i, v in enumerate(value)]
    return value


def to_json(payload: dict[str, Any], *, indent: int | None = 2) -> str:
    r"""Serialise a report as strict JSON.

    Adds ``"schema_version": 1`` when missing. Non-finite floats become ``null`` and are listed in a top-level
    ``"nonfinite"`` object mapping their dotted path to ``"nan"``, ``"inf"`` or ``"-inf"``, so no ``NaN``
    ever reaches a JSON parser."""
    flags: dict[str, str] = {}
    body = _finite_copy(dict(payload), "", flags)
    out = {"schema_version": SCHEMA_VERSION}
    out.update(body)
    if flags:
        out["nonfinite"] = flags
    return json.dumps(out, indent=indent, allow_nan=False, default=str)


def with_verdict(payload: dict[str, Any], exit_code: int) -> dict[str, Any]:
    r"""``payload`` led by the fields every JSON report shares: ``"verdict"`` and ``"passed"``.

    ``passed`` is the exit code's answer (0 is a pass), so an agent reads one boolean whatever the command.
    A report that names its own verdict (``"match"`` / ``"diverge"``) keeps it; any other gets ``"pass"`` or
    ``"fail"``.

    Args:
        payload: the report's ``to_dict()``.
        exit_code: the code the command exits with (0 same / done, 1 differ).

    Returns:
        A new dict with ``verdict`` and ``passed`` first, then the report's own fields.
    """
    verdict = payload.get("verdict")
    if not isinstance(verdict, str) or not verdict:
        verdict = "pass" if exit_code == 0 else "fail"
    rest = {key: value for key, value in payload.items() if key not in ("verdict", "passed")}
    return {"verdict": verdict, "passed": exit_code == 0, **rest}


def format_number(value: Any, digits: int = 3, exponent_digits: int | None = None) -> str:
    r"""A measured quantity (an error, a cosine, a ratio) as a report shows it: ``1.23e-05``, ``0.999``,
    ``nan``, ``-`` for ``None``; the one formatter of metrics in the package.

    Args:
        value: the number (``None``, ints and non-numbers are shown as they are).
        digits: significant digits in scientific form are ``digits``; plain form between 1e-3 and 1e4 shows
            one more.
        exponent_digits: digits after the point in scientific form (default ``digits - 1``).

    Returns:
        The text.
    """
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if 1e-3 <= abs(value) < 1e4:
        return f"{value:.{digits + 1}g}"
    return f"{value:.{digits - 1 if exponent_digits is None else exponent_digits}e}"


def format_cosine(value: Any) -> str:
    r"""A cosine similarity with as many digits as it takes to differ from 1 when it is not 1 (a table row
    with max_abs 1.46 never shows cosine ``1``): ``0.9813892``, ``0.99999994``, ``1 - 2.0e-14``; ``1`` only
    when exact."""
    if not isinstance(value, float) or not math.isfinite(value) or value == 1.0:
        return format_number(value)
    gap = 1.0 - value
    if gap < 1e-10:
        return f"1 - {gap:.1e}"
    digits = max(7, math.ceil(-math.log10(gap)) + 2) if gap < 0.1 else 4
    return f"{value:.{digits}f}".rstrip("0").rstrip(".")


def format_value(value: Any) -> str:
    r"""A setting's value as a porter writes it in code: a float to six significant digits (``1e-06``,
    ``0.176777``), anything else as its ``repr`` (``'gelu'``, ``True``, ``(1, 0)``)."""
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


def render_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    limit: int | None = DEFAULT_LIMIT,
    summary: str | None = None,
) -> str:
    r"""A plain-text table bounded to ``limit`` rows, so an agent's context is never flooded.

    Rows past the limit are replaced by one ``… N more`` line; ``summary`` (if given) ends the table.
    ``limit=None`` or ``0`` shows every row."""
    rows = [[format_number(c) if not isinstance(c, str) else c for c in row] for row in rows]
    shown = rows if not limit else rows[:limit]
    widths = [len(h) for h in headers]
    for row in shown:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in shown]
    if len(rows) > len(shown):
        lines.append(f"… {len(rows) - len(shown)} more (raise --limit, or use --json for everything)")
    if summary:
        lines.append(summary)
    return "\n".join(lines)


def clamp_words(other: str, lo: float, hi: float, cut: list[int]) -> str:
    r"""A clamp named by the bounds that cut values: ``clamp(x, lo, hi)`` where both did, ``max(x, lo)`` or
    ``min(x, hi)`` where one did (a bound at the data's own extreme that cut nothing is no bound), and
    ``max(x, 0) (a ReLU)`` for a floor at zero."""
    if cut[0] and cut[1]:
        return f"clamp({other}, {format_number(lo)}, {format_number(hi)})"
    if cut[1]:
        return f"min({other}, {format_number(hi)})"
    return f"max({other}, 0) (a ReLU)" if lo == 0 else f"max({other}, {format_number(lo)})"
