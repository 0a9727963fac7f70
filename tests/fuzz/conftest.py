"""The fuzz suite's profiles and statistics.

Every command meets every kind of damage (a test per pair). ``bounded`` (the default, part of ``make test``):
two inputs per pair, under half a minute in all. ``long`` (``PARITYKIT_FUZZ=long``, ``make fuzz``): 60 per
pair. With ``PARITYKIT_FUZZ_STATS=FILE`` the session writes, per command and per kind of damage, the inputs
tried, how they ended (exit 0 / 1 / 2) and the failures."""

from __future__ import annotations

import collections
import os
from pathlib import Path

from hypothesis import HealthCheck, settings

settings.register_profile(
    "bounded", max_examples=2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
settings.register_profile("long", max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("PARITYKIT_FUZZ", "bounded"))

# command -> Counter of outcomes ("exit 0", "exit 1", "exit 2", "other exit", "failure"); the same per kind
STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
KIND_STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def pytest_sessionfinish(session, exitstatus):
    target = os.environ.get("PARITYKIT_FUZZ_STATS")
    if not target or not STATS:
        return
    profile = os.environ.get("PARITYKIT_FUZZ", "bounded")
    lines = [f"paritykit fuzz suite (tests/fuzz), profile {profile}: inputs tried and how they ended", ""]
    lines += _table("command", STATS)
    lines += ["", "the same inputs by kind of damage or mix-up:", ""]
    lines += _table("kind", KIND_STATS)
    lines += ["", f"pytest exit status: {int(exitstatus)}"]
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text("\n".join(lines) + "\n")


def _table(label: str, stats: dict[str, collections.Counter]) -> list[str]:
    columns = ("exit 0", "exit 1", "exit 2", "failure")
    lines = [f"{label:18s} {'inputs':>7s} " + " ".join(f"{c:>8s}" for c in columns)]
    total: collections.Counter = collections.Counter()
    for name in [*sorted(stats), "all"]:
        c = total if name == "all" else stats[name]
        if name != "all":
            total.update(c)
        tried = c["exit 0"] + c["exit 1"] + c["exit 2"] + c["other exit"]
        lines.append(f"{name:18s} {tried:7d} " + " ".join(f"{c[k]:8d}" for k in columns))
    return lines
