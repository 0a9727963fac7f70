r"""What the culprit search reports: each module test, the culprit finding, the first differing op, and the
whole ``BisectReport`` (table and JSON from one object)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from paritykit.base.report import DEFAULT_LIMIT, format_cosine, format_number, render_table
from paritykit.bisection.align import Alignment, Confidence
from paritykit.bisection.floor import FLOOR_MEASURED

# how one aligned call was tested: replayed on the reference's inputs, judged from both sides' captured inputs
# and outputs (an error jump), or from the final output alone
TestKind = Literal["replay", "jump", "output"]
Status = Literal["pass", "fail", "untestable"]
# match: the output agrees and nothing inside fails; masked: it agrees, an aligned module inside fails on
# identical inputs; diverge: the output differs
Verdict = Literal["match", "masked", "diverge"]


@dataclass
class ModuleTest:
    r"""The verdict on one aligned call: ``status`` is ``pass``, ``fail`` or ``untestable``."""

    reference: str
    port: str
    test: TestKind
    status: Status
    max_abs: float | None = None
    cosine: float | None = None
    input_error: float | None = None
    output_error: float | None = None
    note: str = ""
    comparison: Any = field(default=None, repr=False)
    # the larger side's float32 error on the replayed inputs (paritykit.bisection.floor), when measured
    floor: float | None = None
    # how the replay fed the port's arguments: (port argument, reference argument, relation) rows
    arguments: list[tuple[str, str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "reference": self.reference,
            "port": self.port,
            "test": self.test,
            "status": self.status,
            "max_abs": self.max_abs,
            "cosine": self.cosine,
        }
        if self.test == "jump":
            out["input_error"] = self.input_error
            out["output_error"] = self.output_error
        if self.floor is not None:
            out["floor"] = self.floor
        if self.note:
            out["note"] = self.note
        return out


@dataclass
class ModuleFinding:
    r"""A named divergence: the culprit, or the first aligned module whose captured outputs differ."""

    reference: str
    port: str
    how_aligned: str
    test: TestKind
    max_abs: float | None
    cosine: float | None
    inline: bool = False
    hints: list[Any] = field(default_factory=list)
    confidence: Confidence = "high"
    children_passed: int = 0
    note: str = ""
    op: OpDivergence | None = None
    # --ops asked for, no op named: why (the culprit was not replayed, the top level, no op found)
    ops_note: str = ""
    # masked verdict: its captured outputs differ, but nothing aligned fails on identical inputs (see note)
    through_inputs: bool = False
    # pairs inside it that replay could not check (fused<->split, reordered outputs: the note names them)
    uncompared: bool = False
    # a culprit found by replay whose captured outputs in the run differ far more than it makes on identical
    # inputs: that max_abs in the run (most of the difference reaches it with its inputs)
    in_run: float | None = None
    # the first aligned module whose outputs differ, replayed: ("pass" or "fail", max_abs on the reference's
    # inputs, whether some port inputs the reference has no counterpart for came from the port's own run)
    replayed: tuple[str, float | None, bool] | None = None
    # how the port's tensor relates to the reference's there, derived from the values
    # (paritykit.bisection.value_relations.Relation)
    relations: list[Any] = field(default_factory=list)
    # the first module whose outputs differ: an earlier pair, aligned by order and output shape alone (not
    # counted), whose captured outputs differ too
    before: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {
            "reference": self.reference,
            "port": self.port,
            "how_aligned": self.how_aligned,
            "confidence": self.confidence,
            "test": self.test,
            "max_abs": self.max_abs,
            "cosine": self.cosine,
            "inline": self.inline,
            "children_passed": self.children_passed,
            "hints": [h.to_dict() for h in self.hints],
            "note": self.note,
            "through_inputs": self.through_inputs,
            "in_run": self.in_run,
        }
        if self.replayed is not None:
            out["replayed"] = {
                "status": self.replayed[0],
                "max_abs": self.replayed[1],
                "own_port_inputs": self.replayed[2],
            }
        if self.op is not None:
            out["op"] = self.op.to_dict()
        if self.ops_note:
            out["ops_note"] = self.ops_note
        out["relations"] = [r.to_dict() for r in self.relations]
        return out


@dataclass
class OpDivergence:
    r"""The first op inside the culprit whose result differs while its inputs still agree (``--ops``)."""

    index: int
    port_op: str
    port_args: str
    shape: list[int]
    reference_op: str | None = None
    reference_args: str | None = None
    max_abs: float | None = None
    port_ops: int = 0
    reference_ops: int = 0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "note": self.note,
            "index": self.index,
            "port_op": self.port_op,
            "port_args": self.port_args,
            "shape": self.shape,
            "reference_op": self.reference_op,
            "reference_args": self.reference_args,
            "max_abs": self.max_abs,
            "port_ops": self.port_ops,
            "reference_ops": self.reference_ops,
        }

    def render(self) -> str:
        text = f"  first differing op: port op #{self.index} {self.port_op}({self.port_args}) -> {self.shape}"
        if self.reference_op:
            text += (
                f"\n    closest reference op: {self.reference_op}({self.reference_args}), "
                f"max_abs {format_number(self.max_abs)}"
            )
        if self.note:
            text += f"\n    {self.note}"
        return text


@dataclass
class BisectReport:
    r"""What ``paritykit bisect`` prints; one object, two faces (``to_dict`` and ``render``)."""

    verdict: Verdict
    culprit: ModuleFinding | None
    first_output_divergence: ModuleFinding | None
    output: Any
    alignment: Alignment
    tested: list[ModuleTest] = field(default_factory=list)
    # failing pairs aligned on order and output shape alone: leads, never named the culprit
    candidates: list[ModuleTest] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    # every independent culprit in execution order (``all_culprits=True``); else just ``[culprit]``
    culprits: list[ModuleFinding] = field(default_factory=list)
    allow_masked: bool = False
    # with all_culprits: the final output once every culprit is replaced by the reference's behaviour
    output_after: Any = None
    all_note: str = ""
    # commands to run next when the culprit is a block the traces did not look inside
    # (paritykit.bisection.zoom)
    next_steps: list[str] = field(default_factory=list)
    # settings that differ between aligned modules, over the whole models
    # (paritykit.bisection.evidence.settings.config_differences)
    config_differences: list[Any] = field(default_factory=list)
    # the output differs by float noise only: where the two sides differ most in precision
    # (paritykit.bisection.floor); float_floor says whether the float64 runs were measured, or why not
    precision: str = ""
    # final outputs of other shapes: which blocks of the larger batch the smaller output equals (measured), or
    # that they were compared through a view where they differ by size-1 dims alone
    shape_note: str = ""
    float_floor: str = ""
    # a run from --reference/--port/--inputs: the command that writes the SPEC it used, to keep it
    spec_command: str = ""

    @property
    def exit_code(self) -> int:
        if self.verdict == "masked" and self.allow_masked:
            return 0
        return 0 if self.verdict == "match" else 1

    def interface_map(self) -> str:
        r"""The two models' interfaces as paired by the replays, one Markdown table per pair of module
        classes (its first replayed call): the table a porter otherwise keeps by hand."""
        lines = [
            "# Interface map: port arguments and the reference arguments that give them",
            "",
            "Written by `paritykit bisect --interface-map`: every replayed module pair's arguments,",
            "paired by their captured values.",
        ]
        seen: set[tuple[str, str]] = set()
        for test in self.tested:
            if not test.arguments:
                continue
            key = (module_of_call(test.reference), module_of_call(test.port))
            if key in seen:
                continue
            seen.add(key)
            lines += ["", f"## {shown_name(key[0])} <-> {shown_name(key[1])}", ""]
            lines += ["| port argument | reference argument | relation |", "|---|---|---|"]
            lines += [f"| `{p}` | {f'`{r}`' if r else '—'} | {how} |" for p, r, how in test.arguments]
        if not seen:
            lines += ["", "No module was replayed: no interface to show."]
        return "\n".join(lines) + "\n"

    def reordered_layers(self) -> list[Any]:
        r"""The layer groups the port calls in another order than the reference (by the tensors each layer
        holds and, where traced, the order the two sides called them)."""
        return [o for o in self.alignment.layer_orders if not o.monotone and o.calls_differ is not False]

    def _holds_reordered(self, finding: ModuleFinding) -> bool:
        r"""Whether a culprit holds a group of layers the port calls in another order."""
        prefix = f"{finding.reference}." if finding.reference else ""
        return any(o.source_group.startswith(prefix) for o in self.reordered_layers())

    def to_dict(self) -> dict[str, Any]:
        al = self.alignment.to_dict()
        return {
            "verdict": self.verdict,
            "culprit": self.culprit.to_dict() if self.culprit else None,
            "first_output_divergence": (
                self.first_output_divergence.to_dict() if self.first_output_divergence else None
            ),
            "aligned": al["aligned"],
            "unaligned_reference": al["unaligned_reference"],
            "unaligned_port": al["unaligned_port"],
            "output": _comparison_summary(self.output),
            "layer_orders": [o.to_dict() for o in self.reordered_layers()],
            "precision": self.precision,
            "float_floor": self.float_floor,
            "spec_command": self.spec_command,
            "alignment": {"by": al["by"], "pairs": al["pairs"]},
            "tested": [t.to_dict() for t in self.tested],
            "candidates": [t.to_dict() for t in self.candidates],
            "culprits": [c.to_dict() for c in self.culprits],
            "output_after_substitution": _comparison_summary(self.output_after),
            "matches_after_substitution": (
                None if self.output_after is None else bool(self.output_after.passed)
            ),
            "split_work": al["split_work"],
            "environment": self.environment,
            "next_steps": self.next_steps,
            "config_differences": [d.to_dict() for d in self.config_differences],
        }

    def _row_note(self, test: ModuleTest) -> str:
        r"""A table row's note, led by what a failing pair aligned on order and output shape alone is: a
        lead, never the culprit."""
        from paritykit.tracing.trace import module_of

        pair = self.alignment.pair_of(module_of(test.reference))
        if test.status == "fail" and pair is not None and pair.how == "order" and pair.confidence == "low":
            lead = "paired by order and output shape only: a lead"
            return f"{lead}; {test.note}" if test.note else lead
        return test.note

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        out = _comparison_summary(self.output) or {}
        dtypes = (out.get("dtype_reference"), out.get("dtype_port"))
        in_dtype = "" if set(dtypes) <= {"float32", None} else f"; reference {dtypes[0]}, port {dtypes[1]}"
        lines = [
            f"verdict: {self.verdict} (final output max_abs {format_number(out.get('max_abs'))}, "
            f"cosine {format_cosine(out.get('cosine'))}{in_dtype})"
        ]
        for order in self.reordered_layers():
            lines.append(f"layer order: {order.words()}; aligned by the tensors each layer holds")
        if self.precision:
            lines.append(self.precision)
        if self.float_floor not in ("", "off", FLOOR_MEASURED):
            lines.append(f"float floor: {self.float_floor}")
        if out.get("status") != "shape_mismatch" and self.shape_note:
            lines.append(self.shape_note)
        if out.get("status") == "shape_mismatch":
            lines.append(
                f"final output shapes differ: reference {out['shape_reference']} vs port {out['shape_port']}"
                + (f"; {self.shape_note}" if self.shape_note else "")
            )
        if self.verdict == "masked":
            what = (
                "an aligned module's captured outputs differ beyond tolerance (named below)"
                if self.culprit is not None and self.culprit.through_inputs
                else "the aligned module below fails on identical inputs"
            )
            lines.append(
                f"masked: the final output is within tolerance, but {what}"
                + (" (accepted: --allow-masked)" if self.allow_masked else "")
            )
        if len(self.culprits) > 1:
            for i, finding in enumerate(self.culprits, 1):
                lines += _render_finding(f"culprit {i}", finding, self._holds_reordered(finding))
        elif self.culprit:
            leads = sum(1 for t in self.candidates if _inside(t.reference, self.culprit.reference))
            lines += _render_finding("culprit", self.culprit, self._holds_reordered(self.culprit), leads)
        lines += [_lead_line(test, self.alignment) for test in self.candidates]
        if self.all_note:
            lines.append(self.all_note)
        if not self.culprit and self.verdict == "diverge" and out.get("status") == "shape_mismatch":
            lines.append(
                "culprit: none named (no aligned module below the top level fails on identical inputs, and"
                " outputs of other shapes are not one computation to blame the top level for)"
            )
        elif not self.culprit and self.verdict == "diverge":
            lines.append("culprit: none found (no aligned module fails; see the table of tested modules)")
        if self.first_output_divergence:
            f = self.first_output_divergence
            on = (
                "the reference's inputs, with port inputs the reference has no counterpart for from the"
                " port's own run"
                if f.replayed is not None and f.replayed[2]
                else "identical inputs"
            )
            if f.replayed is None:
                own = "not replayed: its difference may come with its inputs"
            elif f.replayed[0] == "pass":
                own = (
                    f"it passes on {on} (max_abs {format_number(f.replayed[1])}): the difference comes with"
                    " its inputs"
                )
            else:
                own = f"it fails on {on} too (max_abs {format_number(f.replayed[1])})"
            lines.append(
                f"first aligned module whose outputs differ: {shown_name(f.reference)} <->"
                f" {shown_name(f.port)} (max_abs {format_number(f.max_abs)}; {own})"
            )
            if f.before:
                lines.append(f"  {f.before}")
            same = self.culprit is not None and self.culprit.reference == f.reference
            if not same:
                lines += [f"  relation of the captured outputs there: {r.line()}" for r in f.relations]
        rows = [
            [
                shown_name(t.reference),
                shown_name(t.port),
                t.test,
                t.status,
                t.max_abs,
                format_cosine(t.cosine),
                self._row_note(t),
            ]
            for t in self.tested
        ]
        if rows:
            lines.append("")
            lines.append(
                render_table(
                    ["reference", "port", "test", "status", "max_abs", "cosine", "note"], rows, limit=limit
                )
            )
        lines.append("")
        lines.append(self.alignment.summary())
        lines += [s.render() for s in self.alignment.split_work]
        al = self.alignment
        for side, names in (("reference", al.unaligned_reference), ("port", al.unaligned_port)):
            if names:
                lines.append(
                    f"unaligned {side} ({len(names)}): {', '.join(shown_name(n) for n in names[:10])}"
                    + (" …" if len(names) > 10 else "")
                )
        if self.spec_command:
            lines += ["", f"this run's SPEC, to keep it as a file: {self.spec_command}"]
        if self.next_steps:
            lines += [
                "",
                (
                    "the traces hold this block's outputs only; to look inside it, run the first command"
                    " where the reference runs, the second where the port runs, the third where both folders"
                    " are:"
                ),
            ]
            lines += [f"  {command}" for command in self.next_steps]
        return "\n".join(lines)


# how a culprit was found, in words: a jump never ran the module, so it is labelled as such
_FOUND_BY = {"jump": "capture, not replayed", "replay": "replay", "output": "the final output"}


def _render_finding(label: str, f: ModuleFinding, reordered: bool = False, leads: int = 0) -> list[str]:
    low = "" if f.confidence == "high" else f", {f.confidence} confidence"
    lines = [
        f"{label}: reference {shown_name(f.reference)}  <->  port {shown_name(f.port)}",
        (
            f"  aligned by {f.how_aligned}{low}; found by {_FOUND_BY.get(f.test, f.test)};"
            f" max_abs {format_number(f.max_abs)}, "
            f"cosine {format_cosine(f.cosine)}"
        ),
    ]
    passed = f"its {f.children_passed} aligned submodule call(s) pass on identical inputs"
    if f.uncompared:  # pairs inside it that replay could not check are among the places left
        passed += " (the pairs the note names were not compared)"
    if f.inline and reordered:
        lines.append(
            f"  inline: {passed}, each layer on the inputs of the reference layer it holds; the layers are"
            " called in another order (the layer order above)"
        )
    elif f.inline and any(h.verified for h in f.hints):
        lines.append(f"  inline: {passed}; the verified fix below makes it match")
    elif f.inline and leads:
        lines.append(f"  inline: {passed}; {leads} paired by order only fail (the leads below)")
    elif f.inline and any(h.id in ("module-fit", "inline-reference") for h in f.hints):
        lines.append(f"  inline: {passed}; the hints follow the first differing input to where it is made")
    elif f.inline:
        lines.append(
            f"  inline: {passed}, the module itself does not: the difference is made outside those calls (its"
            " own forward code, submodules no pair covers, or weights and settings it uses directly)"
        )
    elif f.through_inputs:
        lines.append("  its captured outputs differ, but it passes on the reference's inputs: see the note")
    elif f.children_passed == 0 and f.test == "replay":
        lines.append("  it fails on identical inputs; no submodule call inside it passed a replay")
    if f.in_run is not None:
        lines.append(
            f"  in the run its outputs differ by max_abs {format_number(f.in_run)}, against"
            f" {format_number(f.max_abs)} on identical inputs: most of that difference reaches it with its"
            " inputs (the first aligned module whose outputs differ is named below)"
        )
    if f.note:
        lines.append(f"  note: {f.note}")
    for hint in f.hints:
        if hint.verified and hint.fix and hint.evidence.get("in_run", True) is not True:
            left = hint.evidence.get("in_run_max_abs")
            lines.append(
                f"  fix on the reference's inputs only: {hint.fix}; the port feeds this module other inputs"
                " in its run, and with this edit its output there still differs"
                + (f" (max_abs {format_number(left)})" if left is not None else " (not re-run there)")
            )
        elif hint.verified and hint.fix:
            lines.append(f"  fix (verified): {hint.fix}{hint.fix_scope()}")
    for relation in f.relations:
        lines.append(f"  relation: {relation.line()}")
    for i, hint in enumerate(f.hints, 1):
        lines.append(f"  hint {i}: [{hint.id}] {hint.message}")
    if f.op is not None:
        lines.append(f.op.render())
    elif f.ops_note:
        lines.append(f"  {f.ops_note}")
    return lines


def _lead_line(test: ModuleTest, alignment: Alignment) -> str:
    r"""A failing pair aligned with low confidence, said as a lead: what was measured and how weakly the two
    were paired."""
    pair = alignment.pair_of(module_of_call(test.reference))
    how = (
        "by order and output shape only"
        if pair is None or pair.how == "order"
        else f"by {pair.how} that carry no identifying values"
    )
    on = "on identical inputs" if test.test == "replay" else "on captured inputs that agree"
    return (
        f"lead: reference {shown_name(test.reference)} <-> port {shown_name(test.port)} fails {on} (max_abs"
        f" {format_number(test.max_abs)}), but the two were paired {how}: not named the culprit; --map"
        " naming the pair tests it as one"
    )


def _inside(name: str, parent: str) -> bool:
    r"""Whether call ``name`` is inside module ``parent`` (every call is inside the top level, ``""``)."""
    return not parent or name.startswith(parent + ".")


def module_of_call(name: str) -> str:
    r"""The module of a call name (``block#2`` -> ``block``)."""
    return name.split("#", 1)[0]


def shown_name(name: str) -> str:
    return name if name else "(top level)"


def _comparison_summary(cmp: Any) -> dict[str, Any] | None:
    if cmp is None:
        return None
    return {
        "status": cmp.status,
        "max_abs": cmp.max_abs,
        "cosine": cmp.cosine,
        "shape_reference": list(cmp.shape_a),
        "shape_port": list(cmp.shape_b),
        "dtype_reference": cmp.dtype_a,
        "dtype_port": cmp.dtype_b,
        "atol": cmp.atol,
        "rtol": cmp.rtol,
    }
