r"""What ``paritykit triage`` reports: the verdict, each cause found (where, what differs, the evidence, a
verified fix when there is one, and the command that reproduces it alone), what was ruled out, and the error
call by call. One object, two faces: :meth:`TriageReport.render` for a person, :meth:`TriageReport.to_dict`
for an agent."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from paritykit.base.report import DEFAULT_LIMIT, format_cosine, format_number, render_table

# the places a sampling pipeline can part from its reference, in the order the data flows through them
Place = Literal[
    "initial noise",
    "schedule",
    "conditioning",
    "denoiser",
    "update",
    "decoder input",
    "decoder",
    "post-processing",
    "result",
]
PLACES: tuple[Place, ...] = get_args(Place)
PLACE_ORDER = {place: index for index, place in enumerate(PLACES)}
Verdict = Literal["match", "differ"]


@dataclass
class Note:
    r"""One line of what was ruled out or not checked: the place, the check at that place when a place has
    several (``fit``, ``calls``), and what was found. Tests and agents read ``place`` and ``check``; ``text``
    is for a person."""

    place: Place
    text: str
    check: str | None = None

    @property
    def label(self) -> str:
        return f"{self.place} {self.check}" if self.check else self.place

    def render(self) -> str:
        return f"{self.label}: {self.text}"

    def to_dict(self) -> dict[str, Any]:
        return {"place": self.place, "check": self.check, "text": self.text}


@dataclass
class ReproduceFile:
    r"""A file a finding's reproduce command reads, written into ``--out`` after the walk (never by the code
    that builds the command).

    Args:
        path: where it goes.
        kind: ``text`` (``content`` a str), ``safetensors`` (a dict of tensors) or ``torch`` (any object
            ``torch.save`` takes).
        content: what it holds.
    """

    path: Path
    kind: Literal["text", "safetensors", "torch"]
    content: Any = field(repr=False)


@dataclass
class Finding:
    r"""One cause.

    Args:
        place: one of :data:`PLACES`.
        call: the denoiser call (or step) where it first shows; ``None`` for a whole-run quantity.
        summary: one sentence: what differs, the quantity named.
        evidence: the numbers behind it, one line each.
        fix: the change that makes the two agree, when one is known.
        verified: ``True`` when that fix was replayed (or fitted) and then matched.
        command: the ``paritykit …`` command that reproduces this finding alone; ``None`` when there is none
            (no ``--out``, or its files could not be written: the evidence says why).
        details: the nested report of the command that found it (``bisect``, ``schedule --fit``), as JSON.
        files: what ``command`` reads, written into ``--out`` once the walk is done.
    """

    place: Place
    call: int | None
    summary: str
    evidence: list[str] = field(default_factory=list)
    fix: str | None = None
    verified: bool = False
    # where a verified fix was measured beyond its module (the whole output with it and without it)
    fix_scope: str = ""
    command: str | None = None
    details: dict[str, Any] | None = None
    files: list[ReproduceFile] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "place": self.place,
            "call": self.call,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "fix": self.fix,
            "verified": self.verified,
            "fix_scope": self.fix_scope,
            "command": self.command,
            "details": self.details,
        }


@dataclass
class CallError:
    r"""One row of the per-step error curve: denoiser call ``call``'s timesteps and relative errors."""

    call: int
    t_reference: float | None
    t_port: float | None
    latents: float | None
    output: float | None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class TriageReport:
    r"""``verdict`` is the result's: ``match`` when the two results agree within tolerance, whatever differs
    inside the run (those places are then measurements, never causes), else ``differ``. ``findings`` list the
    places that differ, first difference first (with ``all_causes``, every place, each checked on its own on
    the reference's inputs: how many independent causes there are is not claimed); ``ruled_out`` the places
    compared whole and found to agree; ``not_checked`` what could not be, or was only partly, with why."""

    spec: str
    findings: list[Finding]
    ruled_out: list[Note]
    not_checked: list[Note]
    curve: list[CallError]
    calls: tuple[int, int]
    result: dict[str, Any]
    all_causes: bool
    out_dir: str | None
    environment: dict[str, Any] = field(default_factory=dict)
    # how the two sides' calls were paired when one makes several per step (CallGroups.words)
    grouping: str = ""
    # a run from callables or scripts (no SPEC file): the SPEC it wrote and ran, to keep
    spec_written: str = ""
    # a run of scripts: what each side's run was read as (its denoiser, calls, result, scheduler)
    sides: list[str] = field(default_factory=list)
    # the sides make other numbers of calls and no grouping pairs them: the table's rows are paired by order
    by_order: bool = False

    @property
    def result_matches(self) -> bool:
        return self.result.get("passed") is True

    @property
    def verdict(self) -> Verdict:
        if self.result_matches:
            return "match"
        # results of other shapes are not one result: never a match
        differ = self.findings or self.result.get("passed") is False or "error" in self.result
        return "differ" if differ else "match"

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "differ" else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "spec": self.spec,
            "all_causes": self.all_causes,
            "calls": {"reference": self.calls[0], "port": self.calls[1]},
            "result": self.result,
            "findings": [f.to_dict() for f in self.findings],
            # the lines as a person reads them (as in every earlier schema_version 1 report), and by place
            "ruled_out": [n.render() for n in self.ruled_out],
            "not_checked": [n.render() for n in self.not_checked],
            "notes": {
                "ruled_out": [n.to_dict() for n in self.ruled_out],
                "not_checked": [n.to_dict() for n in self.not_checked],
            },
            "curve": [row.to_dict() for row in self.curve],
            "out_dir": self.out_dir,
            "environment": self.environment,
            "spec_written": self.spec_written,
            "sides": self.sides,
            "by_order": self.by_order,
        }

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        head = f"verdict: {self.verdict}"
        one = len(self.findings) == 1
        places = f"{len(self.findings)} place{'' if one else 's'} differ{'s' if one else ''}"
        if self.findings and self.verdict == "match":
            head += f" (the results agree within tolerance; inside the run {places}, listed below)"
        elif self.findings:
            # the places not checked are not among those that agree: said beside the count
            unchecked = sorted({n.place for n in self.not_checked} - {f.place for f in self.findings})
            head += (
                f" ({places}, each checked on its own; causes in a place are not counted"
                + (f"; not checked: {', '.join(unchecked)})" if unchecked else ")")
                if self.all_causes
                else " (the first place that differs; --all checks every place on its own)"
            )
        lines = [
            head,
            f"denoiser calls: reference {self.calls[0]}, port {self.calls[1]}"
            + (f" ({self.grouping})" if self.grouping else "")
            + f"; {_result_text(self.result)}",
            *(f"{side}: {text}" for side, text in zip(("reference", "port"), self.sides)),
        ]
        for number, f in enumerate(self.findings, 1):
            where = f" at call {f.call}" if f.call is not None else ""
            inside = "inside the run, " if self.verdict == "match" else ""
            lines.append(f"{number}. {inside}{f.place}{where}: {f.summary}")
            lines += [f"     {e}" for e in f.evidence]
            if f.fix:
                lines.append(
                    f"     fix ({'verified' if f.verified else 'not verified'}): {f.fix}{f.fix_scope}"
                )
            if f.command:
                lines.append(f"     reproduce: {f.command}")
        lines += [f"ruled out: {n.render()}" for n in self.ruled_out]
        lines += [f"not checked: {n.render()}" for n in self.not_checked]
        if self.curve:
            rows = [
                [
                    str(r.call),
                    format_number(r.t_reference),
                    format_number(r.t_port),
                    format_number(r.latents),
                    format_number(r.output),
                ]
                for r in self.curve
            ]
            lines.append(
                "error per denoiser call (relative L2, port against reference"
                + (
                    f"; the k-th call of each side, by order alone: the sides make {self.calls[0]} and"
                    f" {self.calls[1]} calls and no grouping pairs them, so a row compares calls at the"
                    " timesteps its two columns show"
                    if self.by_order
                    else ""
                )
                + "):"
            )
            lines.append(render_table(["call", "t ref", "t port", "latents in", "output"], rows, limit=limit))
        if self.out_dir:
            lines.append(f"recordings and reproduction files: {self.out_dir}")
        if self.spec_written:
            lines.append(
                f"this run's SPEC, written from the {'scripts' if self.sides else 'callables'}"
                f" (keep it, rerun it): {self.spec_written}"
            )
        return "\n".join(lines)


def _result_text(result: dict[str, Any]) -> str:
    if result.get("error"):
        return f"results not compared: {result['error']}"
    peak, max_abs = result.get("peak"), result.get("max_abs")
    # the size of the difference against the result's own: 1e-6 of it reads as rounding, 1e-2 does not;
    # no float floor is measured for a whole run (run_reference() cannot be rerun in float64)
    share = (
        f", {format_number(max_abs / peak)} of the reference result's largest value"
        if peak and max_abs is not None and not result.get("passed")
        else ""
    )
    return (
        f"result {'matches' if result.get('passed') else 'differs'} "
        f"(max_abs {format_number(max_abs)}{share}, cosine {format_cosine(result.get('cosine'))})"
    )
