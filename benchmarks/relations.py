"""Benchmark split: bug classes no catalogue detector names, explained from the values (issue: value
relations). Written after the relation engine (paritykit.bisection.value_relations); the pairs are in
tests/relation_pairs.py (research-style references, ports with one planted bug in their code, no setting that
names it), plus a timestep given in other units (tests/bisect_pairs.py) and a schedule shifted with another μ
(Flux's get_schedule, tests/reference_loops.py).

Per case, from the report as printed:
* place: the culprit is the port module the bug is in (for the schedule: the list compared);
* cause: the first stated cause (the first `fix (verified)`, `relation:` or `hint 1:` line of the culprit; for
  the schedule, its first hint) holds one of the case's true causes in words;
* verified: that line is verified by replay (a relation undone at the culprit in a run of the whole port, or
  a repair edit replayed); a schedule is not replayed ("-");
* false hints: `relation:` lines that state anything but a true cause, and any stated cause on a correct port.
Goals: cause verified >= 90 %, 0 false hints.

    python benchmarks/relations.py  # writes benchmarks/results/relations.txt (also run by `make bench`)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "helpers"))

from paritykit.bisection.entry import bisect  # noqa: E402
from paritykit.schedule.compare import compare_schedules  # noqa: E402

from tests import reference_loops  # noqa: E402
from tests.bisect_pairs import time_pair  # noqa: E402
from tests.relation_pairs import CASES, CLEAN  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "relations.txt"
STATED = ("  fix (verified):", "  relation:", "  hint 1:")


def timestep_units():
    reference, port, inputs = time_pair("units")
    return reference, port, inputs, "", ["a timestep in other units"]


def _stated(text: str) -> list[str]:
    lines = text.splitlines()
    return [line for line in lines if line.startswith(STATED)]


def score_bisect(name: str, build) -> dict:
    reference, port, inputs, culprit, causes = build()
    started = time.perf_counter()
    report = bisect(reference, port, inputs)
    seconds = time.perf_counter() - started
    stated = _stated(report.render())
    if culprit is None:  # a correct port: nothing may be claimed
        ok = report.verdict == "match" and not stated
        return {
            "name": name,
            "place": ok,
            "cause": None,
            "verified": None,
            "false": len(stated),
            "s": seconds,
        }
    first = stated[0] if stated else ""
    true = any(c in first for c in causes)
    verified = true and (first.startswith("  fix (verified):") or "(verified by replay" in first)
    false = [line for line in stated if line.startswith("  relation:") and not any(c in line for c in causes)]
    place = report.culprit is not None and report.culprit.port == culprit
    return {
        "name": name,
        "place": place,
        "cause": true,
        "verified": verified,
        "false": len(false),
        "first": first.strip()[:300],
        "s": seconds,
    }


def score_schedule() -> dict:
    a = {"sigmas": reference_loops.flux_sigmas(20, 4096)}  # mu 1.15 at 4096 tokens
    b = {"sigmas": reference_loops.flux_sigmas(20, 256)}  # mu 0.5: the port read the size wrong
    cmp = compare_schedules(a, b)
    first = cmp.hints[0].message if cmp.hints else ""
    return {
        "name": "schedule-other-mu",
        "place": bool(cmp.hints) and cmp.hints[0].kind == "sigmas",
        "cause": "differs in shift" in first,
        "verified": None,
        "false": 0,
        "first": first[:300],
        "s": 0.0,
    }


def main() -> int:
    torch.set_num_threads(1)
    rows = [score_bisect(name, build) for name, build in {**CASES, "timestep-units": timestep_units}.items()]
    rows.append(score_schedule())
    clean = [score_bisect(name, build) for name, build in CLEAN.items()]
    bugs = len(rows)
    tally = {k: sum(1 for r in rows if r[k]) for k in ("place", "cause", "verified")}
    false = sum(r["false"] for r in rows + clean)
    clean_ok = sum(1 for r in clean if r["place"])
    lines = [
        f"value-relations split: {bugs} bug cases of classes no catalogue detector names, {len(clean)}"
        " correct ports; 1 torch thread",
        "",
        "| split | place | cause in the first stated line | verified | false hints |",
        "|---|---|---|---|---|",
        f"| value relations | {tally['place']}/{bugs} | {tally['cause']}/{bugs} | {tally['verified']}/{bugs}"
        f" ({100 * tally['verified'] // bugs} %) | {false} |",
        f"correct ports with nothing claimed: {clean_ok}/{len(clean)}",
        "",
    ]
    for r in rows + clean:
        mark = lambda v: "-" if v is None else ("yes" if v else "NO")  # noqa: E731
        lines.append(
            f"{r['name']:28s} place {mark(r['place']):3s} cause {mark(r['cause']):3s} verified"
            f" {mark(r['verified']):3s} false {r['false']}; {r['s']:.2f} s"
        )
        if r.get("first"):
            lines.append(f"{'':28s} {r['first']}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
