r"""The repair search at a located culprit: its sites (the culprit itself, then the unaligned port modules
that produce a differing input of an inline culprit), and how verified edits join the catalogue's hints."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paritykit.bisection.extra_inputs import extra_inputs, extra_producers, replay_with_extras
from paritykit.bisection.leaves import module_device
from paritykit.bisection.module_fit import first_differing_input, replay_with_module
from paritykit.bisection.repair.engine import (
    FIRST_EDITS,
    MIN_SECONDS,
    TOP_LEVEL_SECONDS,
    Budget,
    RepairOutcome,
    progress_bar,
    repair_site,
)
from paritykit.bisection.repair.site import Site, faithful_parameters, held_parameters
from paritykit.compare.diagnose import Hint

if TYPE_CHECKING:
    from paritykit.bisection.searcher import Searcher
    from paritykit.tracing.trace import Record


@dataclass
class RepairOptions:
    r"""How a bisect explains a culprit.

    Args:
        enabled: run the repair search (``--no-repair`` turns it off).
        catalogue: run the catalogue's detectors (off only to measure the repair search alone).
        budget: the edits the search may try at one culprit, shared fairly by its sites
            (``--repair-budget N``); None: :meth:`Budget.for_modules` of the culprit, which grows with its
            size, and a clock: the search takes no longer than the bisect had run when it began (from
            ``started``, the capture's start), at least :data:`MIN_SECONDS`, after its first
            :data:`FIRST_EDITS` edits.
    """

    enabled: bool = True
    catalogue: bool = True
    budget: int | None = None
    started: float | None = None


def culprit_site(searcher: Searcher, call: Record, port_call: Record | None) -> Site | None:
    r"""The culprit as a repair site: its port module replayed on the reference's inputs (``None`` when the
    culprit was not replayed, so there is nothing to verify an edit against)."""
    if port_call is None:
        return None
    module = searcher.port_modules.get(port_call.module)
    if module is None:
        return None
    replayed = searcher.replays.get(call.name)
    if replayed is None:
        outcome = searcher.run_replay(call, port_call)
        if isinstance(outcome, str):
            return None
        replayed = outcome
    ref_leaves, port_leaves = replayed
    device = module_device(module)

    if searcher.adapt_inputs(call, port_call, device) is None:
        return None

    def inputs() -> tuple[tuple, dict]:  # fresh copies each time: an edited module may work in place
        return searcher.adapt_inputs(call, port_call, device)

    reference = searcher.ref_modules.get(call.module)
    return Site(
        name=port_call.module,
        reference_name=call.name,
        module=module,
        inputs=inputs,
        wanted=list(ref_leaves),
        got=list(port_leaves),
        compare=lambda a, b: searcher.compare_leaves(a, b, call.name) if b is not None else None,
        faithful=faithful_parameters(
            reference, module, searcher.alignment.inside(call.module, port_call.module)
        ),
        held=held_parameters(reference, module),
        ancestor=config_ancestor(searcher, port_call.module),
    )


def config_ancestor(searcher: Searcher, name: str) -> tuple[Any, str, str] | None:
    r"""For a port module with no config of its own, the nearest enclosing diffusers model (a ConfigMixin):
    ``(model, its path, the module's path inside it)``; None when the module has a config or nothing
    encloses it."""
    module = searcher.port_modules.get(name)
    if module is None or getattr(module, "config", None) is not None or not name:
        return None
    parts = name.split(".")
    for k in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:k])
        model = searcher.port_modules.get(path)
        if isinstance(getattr(model, "config", None), dict) and hasattr(type(model), "from_config"):
            return model, path, ".".join(parts[k:])
    return None


def producer_sites(searcher: Searcher, call: Record, port_call: Record | None) -> list[Site]:
    r"""The unaligned port modules inside an inline culprit whose output is exactly the first differing input
    of an aligned child (:func:`paritykit.bisection.module_fit.first_differing_input`): each must produce the
    reference's tensor, and an edit there is verified by replaying the culprit with the edited module."""
    import torch

    if port_call is None:
        return []
    found = first_differing_input(searcher, call)
    if found is None:
        return []
    sites = []
    for record in reversed(found.producers):
        module = searcher.port_modules.get(record.module)
        if module is None or not record.replayable:
            continue
        outputs = list(record.outputs.items())
        wanted = found.port_input
        index = next(
            (k for k, (_, t) in enumerate(outputs) if t.shape == wanted.shape and torch.equal(t, wanted)),
            None,
        )
        if index is None:
            continue
        path = outputs[index][0]

        def compare(a: list, b: list | None, path: str = path) -> Any:
            if b is None:
                return None
            leaf = dict(b).get(path)
            return searcher.compare_leaves(a, [(path, leaf)], call.name) if leaf is not None else None

        def verify(edited: Any, where: str = record.module) -> Any:
            return replay_with_module(searcher, call, port_call, where, edited)

        sites.append(
            Site(
                name=record.module,
                reference_name=call.name,
                module=module,
                inputs=record.call_inputs,
                wanted=[(path, found.reference_input)],
                got=outputs,
                compare=compare,
                verify=verify,
                role="producer",
            )
        )
    return sites


def extra_input_sites(searcher: Searcher, call: Record, port_call: Record | None) -> list[Site]:
    r"""The unaligned port modules that compute inputs the culprit's replay took from the port's own run
    (the reference computes them inside the culprit: rotary cos/sin): nothing to compare them with, so an
    edit there is verified only by replaying the culprit with the edited module's outputs."""
    extras = extra_inputs(searcher, call, port_call)
    if not extras:
        return []
    sites = []
    for record, feeds in extra_producers(searcher, extras):
        module = searcher.port_modules.get(record.module)
        if module is None or not record.replayable:
            continue

        def verify(edited: Any, record: Any = record, feeds: dict = feeds) -> Any:
            return replay_with_extras(searcher, call, port_call, edited, record.call_inputs(), feeds)

        sites.append(_verified_by_culprit(call, record, module, verify, "producer"))
    return sites


def _verified_by_culprit(
    call: Record, record: Record, module: Any, verify: Callable[[Any], Any], role: str
) -> Site:
    r"""A site with no output of its own to compare: port module ``module`` (its call ``record``), every edit
    checked by ``verify`` alone (the culprit ``call`` replayed with the edited module)."""
    return Site(
        name=record.module,
        reference_name=call.name,
        module=module,
        inputs=record.call_inputs,
        wanted=[],
        got=list(record.outputs.items()),
        compare=lambda a, b: None,
        verify=verify,
        role=role,
    )


def untestable_sites(searcher: Searcher, call: Record, port_call: Record | None) -> list[Site]:
    r"""The culprit's aligned children left untestable (their outputs pair with the reference's in no order or
    layout, so no test saw them): each is edited in place and verified by replaying the culprit with it."""
    if port_call is None:
        return []
    sites = []
    for child in searcher.frontier(call):
        result = searcher.results.get(child.name)
        port_child = searcher.port_record(child)
        if result is None or result.status != "untestable" or port_child is None or not port_child.replayable:
            continue
        module = searcher.port_modules.get(port_child.module)
        if module is None:
            continue

        def verify(edited: Any, where: str = port_child.module) -> Any:
            return replay_with_module(searcher, call, port_call, where, edited)

        sites.append(_verified_by_culprit(call, port_child, module, verify, "untestable"))
    return sites


def repair_hints(
    searcher: Searcher,
    call: Record,
    port_call: Record | None,
    hints: Sequence[Hint],
    options: RepairOptions,
    inline: bool,
) -> list[Hint]:
    r"""``hints`` with the repair search's verified edits joined in.

    A catalogue hint already verified explains the culprit and the search is skipped. Otherwise the culprit
    is searched, then (inline) the producers of its first differing input, the producers of the inputs its
    replay took from the port's own run, and its aligned children left untestable. A verified edit leads; a
    catalogue hint naming the same fix is marked verified instead of repeating it; the plain "unknown" hint
    goes, or, when nothing verifies, says what the search covered.
    """
    if not options.enabled or any(h.verified and not h.evidence.get("code_change") for h in hints):
        return list(hints)
    outcomes: list[RepairOutcome] = []
    site = culprit_site(searcher, call, port_call)
    sites = [site] if site is not None else []
    if any(h.verified for h in hints):
        # a verified fix that changes code (a module class put in place of the port's): a setting of the
        # port that does the same is the smaller fix, so only the settings are searched, at the culprit
        found = repair_site(site, Budget(options.budget or 400), tiers=("settings",)) if site else None
        settings = found.hints() if found is not None and found.verified else []
        return [*settings, *hints]
    if inline:
        sites += producer_sites(searcher, call, port_call)
    sites += extra_input_sites(searcher, call, port_call)
    sites += untestable_sites(searcher, call, port_call)
    # one budget for the culprit (--repair-budget N, else one that grows with the culprit's size), shared
    # fairly: each site may spend what is left over the sites still to search, so the culprit's own search
    # cannot starve its producers'
    total = (
        options.budget
        if options.budget is not None
        # at the top level every edit is a run of the whole port: no floor of edits there, so a big model
        # gets none unless asked (--repair-budget N) and a search never outlasts the capture it follows
        else Budget.for_modules([s.module for s in sites[:1]], floor=0 if call.parent is None else None).edits
    )
    if total == 0:
        return [*hints, *_not_searched(hints)]
    # at the top level each edit replays the whole port: a wall-clock cap there unless a budget was asked for;
    # below it, as long as the capture and replays before the search took (after its first edits)
    seconds, first, kind = None, 0, "top"
    if options.budget is None and call.parent is None:
        seconds = TOP_LEVEL_SECONDS
    elif options.budget is None and options.started is not None:
        seconds = max(MIN_SECONDS, time.perf_counter() - options.started)
        first, kind = FIRST_EDITS, "capture"
    clock = Budget(total, seconds=seconds)  # started now: every site's budget shares its start
    with progress_bar() as progress:
        for k, s in enumerate(sites):
            if k and seconds is not None and not clock.left:
                break  # the first site always reports, so a search cut short says so
            share = max(1, total // (len(sites) - k))
            budget = Budget(
                share, seconds=seconds, started=clock.started, first=min(first, share), clock=kind
            )
            outcome = repair_site(s, budget, progress=progress)
            total -= budget.used
            outcomes.append(outcome)
            if outcome.verified:
                break
    verified = [h for o in outcomes for h in o.hints()]
    if not verified:
        return _with_ruled_out(list(hints), outcomes)
    return _joined(verified, list(hints))


def _not_searched(hints: Sequence[Hint]) -> list[Hint]:
    r"""Said once: the repair search did not run at a top-level culprit too big for its default budget."""
    return (
        [
            Hint(
                "unknown",
                "repair search not run: at the top level each edit is a run of the whole port, and the model"
                " is too big for the default budget (--repair-budget N runs it)",
                {"repair": "not run"},
                score=0.05,
            )
        ]
        if not any(h.id == "no-signature" for h in hints)
        else []
    )


def _joined(verified: list[Hint], hints: list[Hint]) -> list[Hint]:
    r"""Verified edits first; a catalogue hint that states the same fix takes the edit's verification."""
    rest = []
    lead: list[Hint] = []
    for h in hints:
        if h.id in ("no-signature", "unknown"):
            continue  # the cause is no longer unknown
        same = next((r for r in verified if _agrees(h, r)), None)
        if same is not None:
            h.verified = True
            h.score = max(h.score, 0.99)
            h.evidence["verified_by_repair"] = same.to_dict()["edit"]
            h.message += f" (verified by the repair search: {same.fix})"
            h.fix = h.fix or same.fix
            h.site_edit = same.site_edit  # the edit that verified it, to run the whole port with
            lead.append(h)
            verified = [r for r in verified if r is not same]
        else:
            rest.append(h)
    return [*lead, *verified, *rest]


def _agrees(hint: Hint, repair: Any) -> bool:
    r"""Whether a catalogue hint names the fix a repair verified (today: a constant output scale)."""
    edit = repair.edit
    if hint.id != "constant-scale" or edit.get("kind") != "rescale" or edit.get("tier") != "outputs":
        return False
    factor = hint.evidence.get("k")
    fitted = edit["parameters"].get("factor")
    if not isinstance(factor, (int, float)) or not fitted:
        return False
    # the hint gives port/reference; the edit multiplies the port by reference/port
    return abs(factor * fitted - 1) < 1e-3


def _with_ruled_out(hints: list[Hint], outcomes: list[RepairOutcome]) -> list[Hint]:
    if not outcomes:
        return hints
    covered = "; ".join(o.ruled_out() for o in outcomes)
    for h in hints:
        if h.id == "no-signature":
            h.message += f"; {covered}"
            h.evidence["repair"] = covered
            return hints
    if hints:
        return hints
    return [
        Hint(
            "unknown",
            f"unknown: no edit of the repair search verified, so no cause is claimed ({covered})",
            {"repair": covered},
            score=0.1,
        )
    ]
