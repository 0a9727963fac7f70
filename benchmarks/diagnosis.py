"""Benchmark: how well `paritykit bisect` diagnoses real ports it did not write (the tests/gallery catalogue).

Every case of tests/gallery/catalogue.py - a bug planted in a port of an independently written PyPI / torch
implementation, or in its weight conversion, or a clean port that differs by float noise only - runs in both
weight variants (distinct trained-like values, fresh init) through paritykit.bisect (with --all for the
multi-bug cases) and, for conversion bugs, paritykit.infer_conversion_map. The answer is scored against the
case's ground truth. Goals (issue 15): culprit 100 %, true first hint >= 90 %, false hints 0, false alarms 0,
verified fix >= 80 % of the cases that have one. Issue 22 adds the held-out split (bug classes planted after
the repair search was written) and a repair-only run of both splits (the catalogue's detectors off); goals:
verified fix >= 90 % on the held-out split, 0 false hints. Issue 36 adds research ports
(benchmarks/research_ports.py: Wan's DiT and causal VAE from DiffSynth-Studio against diffusers' classes):
blocks tested one-to-one, and false alarms on correct ports at float noise (goal 0).

    python benchmarks/diagnosis.py  # writes benchmarks/results/diagnosis.txt (also run by `make bench`)
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.research_ports import section as research_section  # noqa: E402
from tests.gallery.base import VARIANTS  # noqa: E402
from tests.gallery.catalogue import CASES, HELD_OUT  # noqa: E402
from tests.gallery.run import Outcome, run_case  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "diagnosis.txt"


def _pair(p: tuple[str, str] | None) -> str:
    if not p:
        return "-"
    return f"{p[0] or '(top)'} <-> {p[1] or '(top)'}"


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def _row(o: Outcome) -> str:
    expected = _pair(o.expected[0]) if o.expected else "match"
    found = _pair(o.found[0]) if o.found else o.verdict
    if len(o.expected) > 1 or len(o.found) > 1:
        found += f" (+{len(o.found) - 1} more, all named: {_yes(o.all_ok)})"
    first = (o.first_hint or "-").split("]")[0].lstrip("[")
    return (
        f"{o.case:25s} {o.variant:8s} {_yes(o.culprit_ok):3s}  expected {expected}\n"
        f"{'':35s}found    {found}\n"
        f"{'':35s}first hint {first} (true: {_yes(o.first_hint_true)}); false hints: "
        f"{', '.join(o.false_hints) or 'none'}; fix verified: {_yes(o.fix_verified)}"
        + (f"; weights map: {o.conversion} (slip shown: {_yes(o.conversion_ok)})" if o.conversion else "")
        + f"; {o.seconds:.2f} s"
    )


def _rate(hits: int, n: int) -> str:
    return f"{hits}/{n} ({100 * hits / n:.0f} %)" if n else "0/0"


def totals(outcomes: list[Outcome]) -> dict[str, str]:
    bugs = [o for o in outcomes if o.expected]
    clean = [o for o in outcomes if not o.expected]
    with_fix = [o for o in bugs if o.fix_verified is not None]
    multi = [o for o in bugs if len(o.expected) > 1]
    conv = [o for o in outcomes if o.conversion_ok is not None]
    return {
        "culprit accuracy": _rate(sum(o.culprit_ok for o in bugs), len(bugs)),
        "true first hint": _rate(sum(bool(o.first_hint_true) for o in bugs), len(bugs)),
        "runs with a false hint": _rate(sum(bool(o.false_hints) for o in outcomes), len(outcomes)),
        "verified fix (cases that have one)": _rate(
            sum(bool(o.fix_verified) for o in with_fix), len(with_fix)
        ),
        "false alarms on clean ports": _rate(sum(o.false_alarm for o in clean), len(clean)),
        "--all names every culprit": _rate(sum(bool(o.all_ok) for o in multi), len(multi)),
        "weights map shows the conversion slip": _rate(sum(bool(o.conversion_ok) for o in conv), len(conv)),
    }


def _columns(
    named: list[Outcome], held: list[Outcome], named_r: list[Outcome], held_r: list[Outcome]
) -> list[str]:
    r"""The README table: culprit, true first hint, verified fix, runs with a false hint, per split and
    mode."""

    def row(label: str, outs: list[Outcome]) -> str:
        t = totals(outs)
        keys = (
            "culprit accuracy",
            "true first hint",
            "verified fix (cases that have one)",
            "runs with a false hint",
        )
        return f"| {label} | " + " | ".join(t[k] for k in keys) + " |"

    return [
        "| split (mode) | culprit | true first hint | verified fix | runs with a false hint |",
        "|---|---|---|---|---|",
        row("named (catalogue + repair)", named),
        row("held-out (catalogue + repair)", held),
        row("named (repair only)", named_r),
        row("held-out (repair only)", held_r),
    ]


def main() -> None:
    torch.set_num_threads(1)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    runs: dict[tuple[str, bool], list[Outcome]] = {}
    for catalogue in (True, False):
        for split in ("named", "held-out"):
            cases = CASES if split == "named" else HELD_OUT
            outs = runs.setdefault((split, catalogue), [])
            for case in cases:
                for variant in VARIANTS:
                    outs.append(run_case(case, variant, catalogue=catalogue))
                    print(("" if catalogue else "[repair only] ") + _row(outs[-1]), flush=True)
    research_lines, research_totals = research_section()
    print("\n".join(research_lines), flush=True)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    n_bug = sum(1 for c in CASES if not c.clean)
    table = _columns(
        runs["named", True], runs["held-out", True], runs["named", False], runs["held-out", False]
    )
    lines = [
        (
            f"paritykit diagnosis benchmark: the real-ports gallery (tests/gallery), {len(CASES)} named cases"
            f" ({n_bug} planted bugs, {len(CASES) - n_bug} clean ports) and {len(HELD_OUT)} held-out bug"
            f" classes planted after the repair search was written, x {len(VARIANTS)} weight variants"
            f" ({', '.join(VARIANTS)}); each run with the catalogue's detectors and the repair search, then"
            f" with the repair search alone; 1 torch thread, {platform.machine()}, torch {torch.__version__}"
        ),
        (
            "A fresh-init run of a bug that fresh weights make a no-op (affine off with ones/zeros, a zero"
            " bias added twice) or leave below float tolerance at the output (CLIP eps 1e-5 vs 1e-6) counts"
            " as clean; it may also come out masked where a captured pair inside exceeds tolerance, if the"
            " module named claims no cause."
        ),
        (
            "False hint: any hint on a clean port, a cause other than the true one, 'no known signature ..."
            " the forward"
        ),
        (
            "code differs' where the cause is a weight slip or a config value, a repair whose edit is not the"
            " planted fix,"
        ),
        (
            "or a fix verified at a module that is not a culprit. Verified fix: a hint with verified=true at"
            " a true"
        ),
        "culprit, of a true kind (a repair: its edit is one of the case's true edits).",
        "",
        *table,
        "",
        "totals, named split (catalogue + repair)",
    ]
    lines += [f"  {k:40s} {v}" for k, v in totals(runs["named", True]).items()]
    lines += [f"  {k:40s} {v}" for k, v in research_totals.items()]
    lines += [f"  {'time (all four runs)':40s} wall {wall:.1f} s, CPU {cpu:.1f} s", ""]
    for (split, catalogue), outs in runs.items():
        lines.append(f"-- {split} split, {'catalogue + repair' if catalogue else 'repair only'}")
        lines += [_row(o) for o in outs]
        lines.append("")
    lines += [*research_lines, ""]
    lines += ["load average during the run: " + ", ".join(f"{x:.1f}" for x in os.getloadavg())]
    OUT.write_text("\n".join(lines) + "\n")
    print(f"\nwrote {OUT.relative_to(REPO)}")
    print("\n".join(table))


if __name__ == "__main__":
    main()
