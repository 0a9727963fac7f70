"""Benchmark: is the answer on the first screen? Over the gallery (tests/gallery, every case, trained-like
weights) and the research ports (benchmarks/research_ports.py), `bisect`'s report is rendered as the CLI
prints it, and its first 10 lines are read the way an agent reads them:

* a bug case counts when the first 10 lines name a true culprit (reference and port module) and state a
  cause there (its first hint, a verified fix or the layer order; whether that cause is the true one is what
  benchmarks/diagnosis.py scores); it is measured over the runs whose whole report has both at all (goal:
  every one of those);
* a correct port counts when the first line says ``verdict: match``.

Also measured: the SPEC lines a user writes per gallery case with the scaffolds. `paritykit bisect
--reference MOD:FN --port MOD:FN --inputs MOD:FN [--port-inputs MOD:FN] [--select-output MOD:FN]` takes the
callables alone, and `paritykit new bisect-spec` writes the same SPEC as a file; the benchmark renders it for
every case with the functions that case's pair needs and checks it compiles unedited.

    python benchmarks/first_screen.py  # writes benchmarks/results/first_screen.txt (also run by `make bench`)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "helpers"))

from benchmarks.research_ports import CASES as RESEARCH  # noqa: E402
from tests.gallery.catalogue import CASES, HELD_OUT  # noqa: E402
from tests.gallery.run import build  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "first_screen.txt"
SCREEN = 10


def _said(lines: list[str], pairs: list[tuple[str, str]]) -> bool:
    shown = lambda name: name if name else "(top level)"  # noqa: E731
    said = [f"reference {shown(reference)}  <->  port {shown(port)}" for reference, port in pairs]
    return any(s in line for line in lines for s in said)


def _cause(lines: list[str]) -> bool:
    return any(line.lstrip().startswith(("hint 1:", "fix (verified):", "layer order:")) for line in lines)


def score(name: str, report, expected: list[tuple[str, str]] | None) -> tuple[str, bool | None, bool]:
    r"""(row, first screen right (None: the whole report lacks it too), whole report right)."""
    lines = report.render().splitlines()
    first = lines[:SCREEN]
    if expected is None:
        ok = first[0].startswith("verdict: match")
        return f"{name:30s} clean  first line: {first[0][:60]}", ok, ok
    whole = _said(lines, expected) and _cause(lines)
    screen = _said(first, expected) and _cause(first)
    where = "first screen" if screen else ("later" if whole else "not in the report")
    return f"{name:30s} bug    place and cause: {where}", (screen if whole else None), whole


def spec_lines_to_write(port_inputs: bool, select_output: bool) -> tuple[int, int]:
    r"""For one case: (lines a user writes in the scaffolded bisect SPEC before it runs, callables named).
    The case's SPEC needs ``port_inputs`` and ``select_output`` when its pair defines them; both are options
    of ``paritykit new bisect-spec`` (and of ``bisect`` itself), so the file is rendered with them and must
    compile as generated: 0 lines."""
    from paritykit.pack.scaffold import render

    options = {"reference": "m:ref", "port": "m:port", "inputs": "m:inputs"}
    if port_inputs:
        options["port_inputs"] = "m:to_port"
    if select_output:
        options["select_output"] = "m:select"
    (file,) = render("bisect-spec", "case", **options)
    compile(file.text, file.filename, "exec")
    return 0, len(options)


def main() -> None:
    torch.set_num_threads(1)
    import paritykit

    started = time.perf_counter()
    scored: list[tuple] = []
    written, named = [], []
    # each bisect's wall time: its report, first line included, comes at its end
    timed: list[tuple[float, str]] = []
    for case in (*CASES, *HELD_OUT):
        pair = build(case, "distinct")
        lines_written, callables = spec_lines_to_write(
            pair.port_inputs is not None, pair.select_output is not None
        )
        written.append(lines_written)
        named.append(callables)
        began = time.perf_counter()
        report = paritykit.bisect(
            pair.reference,
            pair.port,
            pair.inputs,
            port_inputs=pair.port_inputs,
            select_output=pair.select_output,
        )
        timed.append((time.perf_counter() - began, case.id))
        expected = [case.culprits[0], *case.also] if case.culprits else None
        scored.append(score(case.id, report, expected) + (expected is None,))
    for case in RESEARCH:
        reference, port, inputs = case.build()
        began = time.perf_counter()
        report = paritykit.bisect(reference, port, inputs, **(case.options or {}))
        timed.append((time.perf_counter() - began, case.name))
        expected = None if case.expected is None else [(_reference_of(report, case.expected), case.expected)]
        scored.append(score(case.name, report, expected) + (expected is None,))
    rows = [f"{row:<58s}{t:6.2f} s" for (row, *_), (t, _) in zip(scored, timed)]
    ordered = sorted(timed)
    median, (slowest, slowest_case) = ordered[len(ordered) // 2][0], ordered[-1]
    clean = [screen for _, screen, _, is_clean in scored if is_clean]
    bugs = [screen for _, screen, _, is_clean in scored if not is_clean and screen is not None]
    clean_ok, clean_n, first_ok, first_n = sum(map(bool, clean)), len(clean), sum(bugs), len(bugs)
    seconds = time.perf_counter() - started
    lines = [
        f"paritykit first-screen benchmark: bisect's first {SCREEN} lines over the gallery ({len(CASES)}"
        f" named and {len(HELD_OUT)} held-out cases, trained-like weights) and {len(RESEARCH)} research-port"
        f" cases; {seconds:.1f} s",
        "",
        f"  place and cause in the first {SCREEN} lines (runs whose report has them): {first_ok}/{first_n}",
        f"  correct ports whose first line is 'verdict: match': {clean_ok}/{clean_n}",
        f"  SPEC lines to write per gallery case with the scaffolds: {max(written)} (the callables only:"
        f" {min(named)} to {max(named)} named per case)",
        f"  time to the first line (bisect prints its report when it ends; models built): median"
        f" {median:.2f} s, slowest {slowest:.2f} s ({slowest_case}), one thread",
        "",
        *rows,
    ]
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:7]))
    print(f"wrote {OUT.relative_to(REPO)}")


def _reference_of(report, port: str) -> str:
    r"""The reference module the report pairs with ``port`` (the research cases name the port side)."""
    culprit = report.culprit
    return culprit.reference if culprit is not None and culprit.port == port else "?"


if __name__ == "__main__":
    main()
