r"""Run one gallery case through paritykit and score the answer against the case's ground truth."""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any

from tests.gallery.base import BuiltPair
from tests.gallery.catalogue import Case, Pair

# hints that claim nothing but "the forward code differs" are only false when the truth denies that cause
# "transplant" too: it says the module's own code differs (the donor held the same parameters)
UNKNOWN_HINTS = frozenset({"no-signature", "transplant"})
# hints that locate (where a differing tensor is computed) without naming a cause, or say plainly that the
# cause is unknown and what was ruled out: neither true nor false
LOCATING_HINTS = frozenset({"inline-reference", "inline-input", "unknown"})


def build(case: Case, variant: str, bug: str | None = ...) -> BuiltPair:
    module = importlib.import_module(f"tests.gallery.{case.pair}")
    return module.build(variant, case.bug if bug is ... else bug)


@dataclass
class Outcome:
    case: str
    variant: str
    expected: list[Pair]
    verdict: str
    found: list[Pair]
    culprit_ok: bool
    all_ok: bool | None  # every culprit named, in order (multi-bug cases with --all available)
    first_hint: str | None
    first_hint_true: bool | None  # None when the case has no true hint to give (clean)
    false_hints: list[str] = field(default_factory=list)
    fix: str | None = None
    fix_verified: bool | None = None
    conversion: str | None = None
    conversion_ok: bool | None = None
    seconds: float = 0.0

    @property
    def false_alarm(self) -> bool:
        r"""A clean case that did not come out as a plain match, or an invisible one that came out otherwise
        than a match or a masked verdict claiming no cause (see :func:`run_case`)."""
        return not self.expected and (not self.culprit_ok or bool(self.false_hints))


def _pairs(report: Any) -> list[Pair]:
    return [(c.reference, c.port) for c in report.culprits]


def _all_hints(report: Any) -> list[Any]:
    hints = [h for c in report.culprits for h in c.hints]
    if report.first_output_divergence is not None:
        hints += list(report.first_output_divergence.hints)
    return hints


def _misplaced_fixes(report: Any, accepted: set[Pair]) -> list[str]:
    r"""Verified fixes at a module that is not a true culprit: applied to the real port they would break it
    (a GELU "fix" verified on the Dropout that follows the real activation applies GELU twice)."""
    return [
        f"{h.id} (fix verified at {c.port or '(top)'}, not a culprit)"
        for c in report.culprits
        if accepted and (c.reference, c.port) not in accepted
        for h in c.hints
        if h.verified is True
    ]


def _true_edit(hint: Any, case: Case) -> bool:
    edit = getattr(hint, "edit", {}) or {}
    said = f"{edit.get('kind')}@{edit.get('target')}"
    return any(said.startswith(pattern) for pattern in case.repairs)


def is_true(hint: Any, case: Case, siblings: list | None = None) -> bool:
    r"""A hint stating the true cause: one of the case's hint ids, or a repair whose edit is one of its fixes.
    An ambiguous repair (the report shows several edits that verify equally) is true when the true edit is
    among the ``siblings`` it is reported with."""
    if hint.id == "repair":
        if _true_edit(hint, case):
            return True
        return bool(hint.evidence.get("ambiguous")) and any(
            h.id == "repair" and _true_edit(h, case) for h in siblings or []
        )
    return hint.id in case.hints


def is_false(hint: Any, case: Case, variant: str, siblings: list | None = None) -> bool:
    r"""A hint the ground truth contradicts: any hint on a clean port, an unknown-cause hint that says the
    forward code differs when the cause is config or weights, a repair whose edit is not a true fix, or a
    named cause that is not the true one."""
    if not case.expected(variant):
        return True
    if hint.id == "repair":
        return not is_true(hint, case, siblings)
    if hint.id in UNKNOWN_HINTS:
        return case.cause != "code"
    if hint.id in LOCATING_HINTS or hint.id in case.neutral:
        return False
    return hint.id not in case.hints


def _conversion(case: Case, pair: BuiltPair, variant: str) -> tuple[str | None, bool | None]:
    r"""What ``weights map`` says about the planted tensor, and whether it differs from the faithful
    mapping."""
    if not case.conversion:
        return None, None
    import paritykit

    def entry(p: BuiltPair) -> Any:
        cmap = paritykit.infer_conversion_map(p.source_state, p.target_state)
        return next((e for e in cmap.mapping if e.target == case.planted), None)

    bad = entry(pair)
    good = entry(build(case, variant, None))
    if bad is None:
        return f"{case.planted}: unexplained", True
    text = f"{case.planted} <- {', '.join(bad.sources)} [{bad.describe() or '='}]"
    same = good is not None and (good.sources, good.op, good.args) == (bad.sources, bad.op, bad.args)
    return text, not same


def run_case(
    case: Case, variant: str, use_all: bool = True, catalogue: bool = True, device: str | None = None
) -> Outcome:
    r"""Bisect one case and score it; ``catalogue=False`` switches the catalogue's detectors off, so only the
    repair search explains the culprits; ``device``: both models and the inputs moved there first."""
    import paritykit
    from paritykit.base.inputs import to_device

    bisect = paritykit.bisect  # the public function: no submodule of that name shadows it

    pair = build(case, variant)
    if device is not None:
        pair.reference, pair.port = pair.reference.to(device), pair.port.to(device)
        pair.inputs = to_device(pair.inputs, device)
    every = use_all and len(case.culprits) > 1
    started = time.perf_counter()
    report = bisect(
        pair.reference,
        pair.port,
        pair.inputs,
        port_inputs=pair.port_inputs,
        select_output=pair.select_output,
        all_culprits=every,
        catalogue=catalogue,
    )
    conversion, conversion_ok = _conversion(case, pair, variant)
    seconds = time.perf_counter() - started
    expected = list(case.expected(variant))
    found = _pairs(report)
    if expected:
        culprit_ok = bool(found) and (found[0] == expected[0] or found[0] in case.also)
    elif case.invisible_when_fresh:
        # below tolerance at the output; inside, the difference may still exceed it somewhere downstream of
        # the bug: a masked verdict that names where it shows, claiming no module fails on its own, is true
        # too
        culprit_ok = report.verdict == "match" or (
            report.verdict == "masked" and all(c.through_inputs and not c.hints for c in report.culprits)
        )
    else:
        culprit_ok = report.verdict == "match" and not found
    all_ok = None
    if every and expected:
        allowed = [{e, *case.also} for e in expected]
        all_ok = len(found) == len(expected) and all(f in ok for f, ok in zip(found, allowed))
    first = report.culprit.hints[0] if report.culprit is not None and report.culprit.hints else None
    hints = _all_hints(report)
    # a verified fix counts only at a true culprit: a fix verified on a misaligned module would break the port
    accepted = {*expected, *case.also}
    verified = [
        h for c in report.culprits if (c.reference, c.port) in accepted for h in c.hints if h.verified is True
    ]
    # an ambiguous repair group counts by its true member, if any
    verified.sort(key=lambda h: not (h.id != "repair" or _true_edit(h, case)))
    return Outcome(
        case=case.id,
        variant=variant,
        expected=expected,
        verdict=report.verdict,
        found=found,
        culprit_ok=culprit_ok,
        all_ok=all_ok,
        first_hint=f"[{first.id}] {first.message}" if first is not None else None,
        # a true first hint is the true cause stated at the true culprit
        first_hint_true=(
            (culprit_ok and first is not None and is_true(first, case, report.culprit.hints))
            if expected
            else None
        ),
        false_hints=[h.id for h in hints if is_false(h, case, variant, hints)]
        + _misplaced_fixes(report, accepted),
        fix=verified[0].fix if verified else None,
        fix_verified=(
            (bool(verified) and is_true(verified[0], case, verified))
            if (case.fix or case.repairs) and expected
            else None
        ),
        conversion=conversion,
        conversion_ok=conversion_ok,
        seconds=seconds,
    )
