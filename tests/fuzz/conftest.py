"""The fuzz suite's profiles and statistics.

``bounded`` (the default, part of ``make test``): a few examples per command, well under a minute in all.
``long`` (``PARITYKIT_FUZZ=long``, ``make fuzz``): many more. With ``PARITYKIT_FUZZ_STATS=FILE`` the session
writes, per command, the inputs tried, how they ended (exit 0 / 1 / 2) and the failures.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

from hypothesis import HealthCheck, settings

settings.register_profile(
    "bounded", max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
settings.register_profile("long", max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("PARITYKIT_FUZZ", "bounded"))

# command -> Counter of outcomes ("exit 0", "exit 1", "exit 2", "failure")
STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


def pytest_sessionfinish(session, exitstatus):
    target = os.environ.get("PARITYKIT_FUZZ_STATS")
    if not target or not STATS:
        return
    profile = os.environ.get("PARITYKIT_FUZZ", "bounded")
    lines = [
        f"paritykit fuzz suite (tests/fuzz), profile {profile}: inputs tried per command and how they ended",
        "",
    ]
    lines.append(
        f"{'command':28s} {'inputs':>7s} {'exit 0':>7s} {'exit 1':>7s} {'exit 2':>7s} {'failures':>9s}"
    )
    total = collections.Counter()
    for command in sorted(STATS):
        c = STATS[command]
        tried = sum(v for k, v in c.items() if k.startswith("exit") or k == "failure")
        total.update(c)
        total["tried"] += tried
        lines.append(
            f"{command:28s} {tried:7d} {c['exit 0']:7d} {c['exit 1']:7d} {c['exit 2']:7d} {c['failure']:9d}"
        )
    lines.append(f"{'all':28s} {total['tried']:7d} {total['exit 0']:7d} {total['exit 1']:7d} {total['exit 2']:7d} "
                 f"{total['failure']:9d}")  # fmt: skip
    lines.append("")
    lines.append(f"pytest exit status: {int(exitstatus)}")
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    Path(target).write_text("\n".join(lines) + "\n")
