r"""The repair search: try the grammar's edits at a site, tier by tier, and keep only those that make the
replay match the reference (``repair_site``); turn the outcome into hints (``RepairOutcome.hints``).

The search is budgeted in edits tried, and, unless a budget is given (``--repair-budget N``, which makes the
same input give the same report on any machine and under any load), by a clock: at a top-level culprit, where
each edit replays the whole port, :data:`TOP_LEVEL_SECONDS`; below it, after its first :data:`FIRST_EDITS`
edits, as long as the capture and replays before it took (at least :data:`MIN_SECONDS`). Where a clock
stops it, the report says so."""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.report import format_number
from paritykit.bisection.repair.edits import TIERS, Edit, RepairHint, Tier
from paritykit.bisection.repair.grammar import input_edits, output_edits, parameter_edits, use_edits
from paritykit.bisection.repair.settings import setting_edits
from paritykit.bisection.repair.site import Site, call_leaves

GENERATORS: dict[Tier, Callable[[Site, Any], Iterator[Edit]]] = {
    "parameters": parameter_edits,
    "inputs": input_edits,
    "outputs": output_edits,
    "settings": setting_edits,
    "uses": use_edits,
}

# a search longer than this (seconds) shows a progress bar on stderr
PROGRESS_AFTER = 2.0
# the edits a culprit's search may try: a base and more for each parameter tensor and submodule of its sites
# (the grammar's edits grow with them), but no more than REPLAY_ELEMENTS weights replayed in all, so a whole
# model's ten thousand edits, each a replay of the model, are not all tried; at least MIN_EDITS. Every number
# here is read from the model, never from a clock: the same model gives the same search on any machine.
BASE_EDITS = 1500
EDITS_PER_PART = 8
REPLAY_ELEMENTS = 30_000_000
MIN_EDITS = 100
# at a top-level culprit every edit is a run of the whole port: unless --repair-budget is given, the search
# there stops after this many seconds (a tiny model's whole search fits in it)
TOP_LEVEL_SECONDS = 10.0
# below the top level, unless --repair-budget is given, the search may take as long as the capture and
# replays before it took, at least this many seconds, and always tries its first FIRST_EDITS edits (the
# cheapest tiers: the same model gives the same first edits on any machine)
MIN_SECONDS = 5.0
FIRST_EDITS = 100


@dataclass
class Budget:
    r"""Edits left for the repair search at one culprit (shared by its sites); with ``seconds``, also a
    wall-clock cap (set only where each edit replays the whole port and no ``--repair-budget`` was given)."""

    edits: int
    used: int = 0
    seconds: float | None = None
    started: float | None = None
    timed_out: bool = False
    # edits tried before the clock is read (0: the clock from the first edit)
    first: int = 0
    # why the clock: "top" (each edit replays the whole port) or "capture" (as long as the capture took)
    clock: str = "top"

    def __post_init__(self) -> None:
        if self.seconds is not None and self.started is None:
            self.started = time.perf_counter()

    @classmethod
    def for_modules(cls, modules: Sequence[Any], floor: int | None = None) -> Budget:
        r"""The default budget for sites holding ``modules``: :data:`BASE_EDITS` plus :data:`EDITS_PER_PART`
        for each parameter tensor and submodule, at most :data:`REPLAY_ELEMENTS` over their weight count,
        at least ``floor`` (default :data:`MIN_EDITS`)."""
        parts = sum(len(list(m.parameters())) + len(list(m.modules())) for m in modules)
        elements = max(1, sum(p.numel() for m in modules for p in m.parameters()))
        grown = BASE_EDITS + EDITS_PER_PART * parts
        return cls(max(MIN_EDITS if floor is None else floor, min(grown, REPLAY_ELEMENTS // elements)))

    @property
    def left(self) -> bool:
        if self.used >= self.edits:
            return False
        if self.used < self.first:
            return True
        if self.seconds is not None and time.perf_counter() - self.started > self.seconds:
            self.timed_out = True
            return False
        return True

    def spend(self) -> None:
        self.used += 1


@dataclass
class RepairOutcome:
    r"""What the search did at one site: the verified edits of the cheapest tier that had any, how many edits
    were tried in which tiers, and whether the budget ran out first."""

    site: Site
    before: float
    verified: list[tuple[Edit, float]] = field(default_factory=list)
    tried: int = 0
    tiers: list[Tier] = field(default_factory=list)
    exhausted: bool = False
    # seconds of the wall-clock cap the search stopped at, if it did (``clock`` says which cap)
    timed_out: float | None = None
    clock: str = "top"
    failed: list[str] = field(default_factory=list)
    # edits that verified, but so did the same edit with its factor moved: evidence of nothing
    unspecific: list[str] = field(default_factory=list)

    @property
    def ambiguous(self) -> bool:
        return len(self.verified) > 1

    def hints(self) -> list[RepairHint]:
        r"""One hint per verified edit (``id`` ``repair``, ``verified`` True), smallest edit first."""
        out = []
        others = [e.words for e, _ in self.verified]
        for edit, after in self.verified:
            message = edit.words
            evidence: dict[str, Any] = {"site": self.site.path(), "tried": self.tried, "tier": edit.tier}
            # an edit away from the culprit is verified by replaying the culprit with the edited module
            if self.site.role == "producer":
                evidence["producer_of"] = self.site.reference_name
            elif self.site.role == "untestable":
                evidence["untestable_in"] = self.site.reference_name
            if self.ambiguous:
                rest = [w for w in others if w != edit.words]
                evidence["ambiguous"] = rest
                message = (
                    f"ambiguous: {len(self.verified)} edits each make it match and the numbers cannot tell"
                    f" them apart; read the port's code to choose. This one: {message}"
                )
            message += (
                f" (verified: {self.site.path()} replayed with this edit matches the reference, max_abs "
                f"{format_number(self.before)} -> {format_number(after)}; found by the repair search, "
                f"{self.tried} edits tried)"
            )
            out.append(
                RepairHint(
                    "repair",
                    message,
                    evidence,
                    score=0.995 if not self.ambiguous else 0.97,
                    verified=True,
                    fix=edit.words,
                    edit=edit.to_dict(),
                    residual={"max_abs_before": self.before, "max_abs_after": after},
                    site_edit=(self.site.name, lambda e=edit, m=self.site.module: e.apply(copy.deepcopy(m))),
                )
            )
        return out

    def ruled_out(self) -> str:
        r"""What an unsuccessful search covered, for the "unknown" hint."""
        text = (
            f"repair search at {self.site.path()}: {self.tried} edits over"
            f" {', '.join(self.tiers) or 'no tier'}"
        )
        text += ", none verified"
        if self.timed_out is not None and self.clock == "capture":
            text += (
                f" (stopped after {self.timed_out:.3g} s, as long as the capture and replays before it took;"
                " --repair-budget N searches N edits whatever they take)"
            )
        elif self.timed_out is not None:
            text += (
                f" (stopped after {self.timed_out:g} s: each edit there replays the whole port;"
                " --repair-budget N searches N edits whatever they take)"
            )
        elif self.exhausted:
            text += " (stopped at its budget of edits; --repair-budget N raises it)"
        if self.unspecific:
            text += (
                f"; {len(self.unspecific)} rescaling edit(s) matched but so did other factors (the module is "
                "nearly invariant to that scale), so they prove nothing"
            )
        if self.failed:
            text += f"; could not run: {', '.join(self.failed)}"
        return text


def repair_site(
    site: Site, budget: Budget | None = None, tiers: Sequence[Tier] = TIERS, progress: Any = None
) -> RepairOutcome:
    r"""Try the grammar at ``site``, cheapest tier first.

    An edit counts as verified only when the edited port's outputs on the site's inputs are within tolerance
    of the reference's (and, at a producer site, when the culprit replayed with the edited producer matches
    too). The search stops after the first tier with an *exact* verified edit (residual at float precision),
    then probes the later tiers (at most :data:`PROBE` edits) for an equally exact one, so ambiguity shows;
    an edit that verifies only within tolerance lets it go on, since an exact one in a later tier is the
    better explanation (an input scaled by 1/π stands in for a LayerNorm eps ten times larger, to within
    tolerance). Inside a tier, once an edit verifies only edits as cheap are still tried. The answer is the
    best residual's edits: exact ones if any (several exact ones are ambiguous), else every verified one.
    Edits of one kind and target whose outputs are identical count once (the same change in other words).
    """
    import torch

    budget = budget or Budget.for_modules([site.module])
    outcome = RepairOutcome(site, site.before)
    if site.wanted and not site.failing():
        return outcome
    work = copy.deepcopy(site.module)
    found: list[tuple[Edit, float, list]] = []
    stopped: list[int] | None = None  # once an exact edit is found: what is left of the probe's edits
    # rebuilding a module with a changed setting may warn (an empty layer initialised): not the user's concern
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for tier in tiers:
            if not budget.left:
                outcome.exhausted = True
                break
            outcome.tiers.append(tier)
            if stopped is not None:  # probing for an equally exact edit in a later tier
                _search_tier(site, work, tier, budget, outcome, found, progress, probe=stopped)
                continue
            here = _search_tier(site, work, tier, budget, outcome, found, progress)
            if here and (not site.wanted or any(_exact(site, after, outcome.before) for _, after, _ in here)):
                stopped = [PROBE]
    if budget.timed_out:
        outcome.exhausted, outcome.timed_out, outcome.clock = True, budget.seconds, budget.clock
    chosen = _best(site, found)
    outcome.verified = [(e, after) for e, after, _ in sorted(chosen, key=lambda f: (f[1], f[0].cost))]
    return outcome


# after an exact edit, at most this many edits of the later tiers are tried, so an equally exact edit there
# (an odd module negates its output when its input is negated) is shown beside it: the report says ambiguous
PROBE = 400
# a verified edit is exact when it removes all but this share of the difference, or leaves float noise only
# (at most FLOAT_NOISE of the reference output's largest value)
EXACT = 1e-3
FLOAT_NOISE = 1e-7
# edits whose residual is within this factor of the best one's (or at float precision) explain it as well
AS_WELL = 10.0


def _scale(site: Site) -> float:
    return max((float(t.detach().abs().max()) if t.numel() else 0.0 for _, t in site.wanted), default=0.0)


def _exact(site: Site, after: float, before: float) -> bool:
    return not site.wanted or after <= max(EXACT * before, FLOAT_NOISE * _scale(site))


def _best(site: Site, found: list[tuple[Edit, float, list]]) -> list[tuple[Edit, float, list]]:
    r"""The edits that explain the difference best: those within :data:`AS_WELL` of the smallest residual
    (or at float precision); an edit that verifies only within tolerance is dropped beside an exact one."""
    if not found:
        return []
    best = min(after for _, after, _ in found)
    floor = FLOAT_NOISE * _scale(site)
    return [f for f in found if f[1] <= max(AS_WELL * best, floor)]


def _search_tier(
    site: Site,
    work: Any,
    tier: Tier,
    budget: Budget,
    outcome: RepairOutcome,
    found: list[tuple[Edit, float, list]],
    progress: Any,
    probe: list[int] | None = None,
) -> list[tuple[Edit, float, list]]:
    r"""Every verified edit of one tier (appended to ``found`` too); with ``probe`` (edits left to try, shared
    across tiers), only that many, and only exact edits are kept."""
    here: list[tuple[Edit, float, list]] = []
    edits = GENERATORS[tier](site, work)
    last_cost = -math.inf
    while True:
        if not budget.left:
            outcome.exhausted = probe is None
            break
        if probe is not None:
            if probe[0] <= 0:
                break
            probe[0] -= 1
        try:
            edit = next(edits)
        except StopIteration:
            break
        except Exception as exc:  # a generator that cannot read this module: the tier is skipped, and said
            outcome.failed.append(f"{tier} ({type(exc).__name__}: {str(exc)[:60]})")
            break
        if edit.cost < last_cost:
            # stopping at the first edit dearer than a verified one is sound only over a cost-ordered tier: a
            # grammar that breaks the order is a paritykit bug, said in the report, not a crash of the bisect
            outcome.failed.append(
                f"{tier} (out of cost order: {edit.kind} at cost {edit.cost} after {last_cost})"
            )
            break
        last_cost = edit.cost
        if here and edit.cost > here[0][0].cost:
            break  # every later edit of the tier is dearer still
        outcome.tried += 1
        budget.spend()
        if progress is not None:
            progress.update(1)
        tried = _try(site, work, edit)
        if tried is None:
            continue
        if any(_try(site, work, c) is not None for c in edit.controls()):
            outcome.unspecific.append(edit.words)
            continue
        leaves, after = tried
        if any(_same_edit(edit, other) and _same_leaves(leaves, out) for other, _, out in found):
            continue  # the same change in other words (two chunks swapped = four chunks reordered in pairs)
        entry = (edit, after, leaves)
        if probe is not None and not _exact(site, entry[1], outcome.before):
            continue
        here.append(entry)
        found.append(entry)
    return here


def _try(site: Site, work: Any, edit: Edit) -> tuple[list, float] | None:
    r"""The edited port's output leaves and the residual max_abs when they match the reference (verified),
    else ``None``. The residual is the site's own, or, at a site with nothing to compare locally, the
    culprit's replayed with the edit."""
    if site.verify is None:
        edited = edit.on_outputs(site.got)
        if edited is not None:  # an edit of the outputs alone is checked on the replayed outputs
            cmp = site.compare(site.wanted, edited)
            return (edited, _max_abs(cmp)) if cmp is not None and cmp.passed else None
    try:
        module = edit.apply(work)
        leaves = call_leaves(module, site.inputs())
        if leaves is None:
            return None
        # a site with nothing to compare locally (an extra input the reference never computes) relies on
        # verify
        cmp = site.compare(site.wanted, leaves) if site.wanted else None
        if site.wanted and (cmp is None or not cmp.passed):
            return None
        if site.verify is not None:
            outer = site.verify(module)
            if outer is None or not outer.passed:
                return None
            cmp = cmp if site.wanted else outer
        return leaves, _max_abs(cmp)
    except Exception:  # an edit the module cannot take (a shape its forward rejects) is no repair
        return None
    finally:
        edit.undo()


def _max_abs(cmp: Any) -> float:
    return cmp.max_abs if cmp.max_abs is not None else math.inf


def _same_edit(a: Edit, b: Edit) -> bool:
    return (a.tier, a.kind, a.target) == (b.tier, b.kind, b.target)


def _same_leaves(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(
        x.shape == y.shape and bool(torch.equal(x, y)) for (_, x), (_, y) in zip(a, b)
    )


def progress_bar(total: int | None = None) -> Any:
    r"""A tqdm bar on stderr that appears only when the search runs longer than :data:`PROGRESS_AFTER`, and
    only on a terminal: a reader of captured output (an agent's ``2>&1``) gets no redrawn bar lines."""
    import sys

    from tqdm import tqdm

    return tqdm(
        total=total,
        desc="repair search",
        unit="edit",
        delay=PROGRESS_AFTER,
        leave=False,
        disable=not sys.stderr.isatty(),
    )
