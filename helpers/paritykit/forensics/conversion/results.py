r"""What conversion inference finds: one mapping entry per target tensor, the rules that collapse them, the
ambiguities and warnings, and the report (``ConversionMap``)."""

from __future__ import annotations

import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from paritykit.base.report import DEFAULT_LIMIT, environment_stamp, render_table
from paritykit.forensics.conversion.names import name_skeleton
from paritykit.forensics.conversion.runtime import (
    SHOWN_CANDIDATES,
    WIDTH,
)


@dataclass
class MappingEntry:
    r"""How one target tensor is built from source tensors.

    ``op`` is one of :data:`OPS`; ``args`` holds its arguments plus, when more than one step is needed, a
    ``then`` list of further steps (``{"op": …, …}``), e.g. a chunk followed by a transpose and a cast.
    """

    target: str
    sources: list[str]
    op: str
    args: dict[str, Any] = field(default_factory=dict)
    # why this source: "values" (the only source with these values), "structure: …" (several sources hold
    # the values; the model's structure settled it) or "guess: …" (nothing but names did: ambiguous)
    evidence: str = "values"

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "sources": list(self.sources),
            "op": self.op,
            "args": self.args,
            "evidence": self.evidence,
        }

    def describe(self) -> str:
        return describe_op(self.op, self.args)


@dataclass
class ConversionRule:
    r"""A regex rule covering ``count`` mapping entries.

    ``pattern`` is matched (``re.fullmatch``) against SOURCE key names; ``sources`` are the templates of every
    source the op reads (the first is the matched key itself); ``target`` is the template of the target name.
    """

    pattern: str
    sources: list[str]
    target: str
    op: str
    args: dict[str, Any]
    count: int = 1

    @property
    def text(self) -> str:
        extra = "".join(f" + {s}" for s in self.sources[1:])
        what = describe_op(self.op, self.args)
        return f"{self.pattern}{extra} {f'[{what}] ' if what else ''}-> {self.target}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "pattern": self.pattern,
            "sources": list(self.sources),
            "target": self.target,
            "op": self.op,
            "args": self.args,
            "count": self.count,
            "text": self.text,
        }


@dataclass
class AmbiguousTarget:
    r"""A target several sources explain equally well and structure cannot settle.

    ``candidates`` lists every source that builds it exactly (never cut); ``chosen`` is the one the mapping
    uses, a guess by names."""

    target: str
    candidates: list[str]
    chosen: str
    n_candidates: int
    # the candidates structure could not tell apart (a subset of ``candidates``)
    plausible: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "candidates": list(self.candidates),
            "chosen": self.chosen,
            "n_candidates": self.n_candidates,
            "plausible": list(self.plausible),
        }


@dataclass
class ConversionWarning:
    r"""A mapping that is exact but looks wrong: a fused split whose order contradicts the target names, or
    a tensor built differently in one layer than in the others (shift/scale swapped in one block)."""

    target: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "message": self.message}


@dataclass
class ConversionMap:
    r"""The inferred conversion SOURCE -> TARGET: one object, two faces (``to_dict`` and ``render``).

    Attributes:
        mapping: one :class:`MappingEntry` per explained target, in target order.
        rules: the mapping collapsed into :class:`ConversionRule` s over layer indices.
        unmapped_target: target keys no source explains.
        unused_source: source keys no target uses.
        ambiguous: targets several sources explain equally well and structure cannot settle (constants,
            fresh initialisation); their source is a guess by names.
        warnings: exact mappings that contradict the names or differ between layers.
        allow_ambiguous: guessed targets do not fail the map (``--allow-ambiguous``).
    """

    mapping: list[MappingEntry]
    rules: list[ConversionRule]
    unmapped_target: list[str]
    unused_source: list[str]
    ambiguous: list[AmbiguousTarget]
    n_source: int = 0
    n_target: int = 0
    source_label: str = "source"
    target_label: str = "target"
    seconds: float = 0.0
    emitted_rules: str | None = None
    warnings: list[ConversionWarning] = field(default_factory=list)
    allow_ambiguous: bool = False

    @property
    def exit_code(self) -> int:
        r"""1 when a target is unexplained, a warning was raised, or a target is guessed (unless allowed)."""
        failed = self.unmapped_target or self.warnings or (self.ambiguous and not self.allow_ambiguous)
        return 1 if failed else 0

    def verdict_line(self) -> str:
        r"""The answer in one line: explained, or what is not (with the first warning's words)."""
        if self.exit_code == 0:
            guessed = f", {len(self.ambiguous)} guessed (allowed)" if self.ambiguous else ""
            return f"verdict: all {len(self.mapping)} target tensors explained{guessed}, no warning"
        problems = []
        if self.unmapped_target:
            problems.append(f"{len(self.unmapped_target)} target tensors unexplained")
        if self.ambiguous and not self.allow_ambiguous:
            problems.append(f"{len(self.ambiguous)} guessed (equal values; --allow-ambiguous accepts them)")
        if self.warnings:
            first = self.warnings[0]
            said = (
                "the layer order below" if first.target.endswith(".*") else f"{first.target}: {first.message}"
            )
            count = f"{len(self.warnings)} warning{'' if len(self.warnings) == 1 else 's'}"
            problems.append(f"{count}, first: {said}")
        return "verdict: " + "; ".join(problems)

    @property
    def n_structure(self) -> int:
        return sum(e.evidence.startswith("structure") for e in self.mapping)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "source": self.source_label,
            "target": self.target_label,
            "mapping": [e.to_dict() for e in self.mapping],
            "rules": [r.to_dict() for r in self.rules],
            "unmapped_target": list(self.unmapped_target),
            "unused_source": list(self.unused_source),
            "ambiguous": [a.to_dict() for a in self.ambiguous],
            "warnings": [w.to_dict() for w in self.warnings],
            "allow_ambiguous": self.allow_ambiguous,
            "summary": {
                "n_source": self.n_source,
                "n_target": self.n_target,
                "explained": len(self.mapping),
                "settled_by_structure": self.n_structure,
                "ambiguous": len(self.ambiguous),
                "warnings": len(self.warnings),
                "rules": len(self.rules),
                "seconds": round(self.seconds, 3),
            },
            "environment": environment_stamp(),
        }
        if self.emitted_rules:
            out["emitted_rules"] = self.emitted_rules
        return out

    def render(self, limit: int | None = DEFAULT_LIMIT) -> str:
        rows = _rule_rows(self.rules, self.mapping)
        summary = (
            f"{len(self.mapping)} of {self.n_target} target tensors explained by {len(rows)}"
            f" rule{'' if len(rows) == 1 else 's'}"
            + (
                f" ({len(self.rules)} before folding by the layer order)"
                if len(rows) != len(self.rules)
                else ""
            )
            + f" from {self.n_source} source tensors;"
            f" {len(self.unmapped_target)} unexplained, {len(self.unused_source)} sources unused,"
            f" {self.n_structure} settled by structure, {len(self.ambiguous)} ambiguous, {len(self.warnings)}"
            f" warning{'' if len(self.warnings) == 1 else 's'} ({self.seconds:.2f} s)"
        )
        parts = [f"weights map: {self.source_label} -> {self.target_label}", self.verdict_line()]
        # a reordering of layers is the answer when there is one: first, before the rules it explains
        parts += [f"layer order: {w.message}" for w in self.warnings if w.target.endswith(".*")]
        parts.append("")
        parts.append(_fitted_table(["source pattern", "op", "target", "n"], rows, limit))
        for title, names in (
            ("Unexplained target tensors", self.unmapped_target),
            ("Unused source tensors", self.unused_source),
        ):
            if names:
                parts += ["", f"{title} ({len(names)}):"]
                shown = names if not limit else names[:limit]
                parts += [f"  {_shorten(n, WIDTH - 2)}" for n in shown]
                if len(names) > len(shown):
                    parts.append(
                        f"  … {len(names) - len(shown)} more (raise --limit, or use --json for everything)"
                    )
        if self.ambiguous:
            verdict = (
                "allowed by --allow-ambiguous"
                if self.allow_ambiguous
                else "exit 1; --allow-ambiguous accepts the guesses"
            )
            parts += [
                "",
                (
                    f"Ambiguous targets ({len(self.ambiguous)}): equal values in several sources and nothing"
                    f" in the structure to choose; the chosen source is a GUESS by names ({verdict}). Rows"
                    " alike but for layer numbers are folded (n); --json lists every candidate."
                ),
            ]
            parts.append(
                _fitted_table(["target", "chosen (guess)", "candidates", "n"], _folded(self.ambiguous), limit)
            )
        if self.warnings:
            parts += ["", f"Warnings ({len(self.warnings)}):"]
            shown_w = self.warnings if not limit else self.warnings[:limit]
            parts += [f"  {w.target}: {w.message}" for w in shown_w]
            if len(self.warnings) > len(shown_w):
                parts.append(f"  … {len(self.warnings) - len(shown_w)} more (use --json for everything)")
        if self.emitted_rules:
            parts += ["", f"rules module written to {self.emitted_rules}"]
        parts += ["", summary]  # the counts, after the rows they count
        # prose wraps at the table width; table rows were fitted already
        return "\n".join(
            line if len(line) <= WIDTH else textwrap.fill(line, WIDTH, subsequent_indent="  ")
            for line in "\n".join(parts).split("\n")
        )


def _rule_rows(rules: list[ConversionRule], mapping: list[MappingEntry]) -> list[tuple[str, str, str, str]]:
    r"""The rules as table rows; with layers held in another order, the per-layer rules of each group fold
    into one row whose layer index reads ``<i←j>`` (target layer i holds source layer j, as the layer order
    line says)."""
    import re

    from paritykit.forensics.conversion.layer_order import reordered

    orders = reordered(
        (e.sources[0], e.target) for e in mapping if len(e.sources) == 1 and e.evidence == "values"
    )
    folded: dict[tuple, list] = {}
    for r in rules:
        key: tuple = (r.pattern, tuple(r.sources[1:]), r.target, r.op, repr(r.args))
        for o in orders:
            s = re.match(re.escape(re.escape(o.source_group)) + r"\\\.(\d+)(.*)$", r.pattern)
            t = re.match(re.escape(o.target_group) + r"\.(\d+)(.*)$", r.target)
            if s and t and o.index_map.get(int(t[1])) == int(s[1]):
                key = (
                    f"{re.escape(o.source_group)}\\.<j>{s[2]}",
                    tuple(r.sources[1:]),
                    f"{o.target_group}.<i←j>{t[2]}",
                    r.op,
                    repr(r.args),
                )
                break
        folded.setdefault(key, []).append(r)
    return [
        (
            key[0] + "".join(f" + {s}" for s in key[1]),
            describe_op(members[0].op, members[0].args) or "=",
            key[2],
            str(sum(m.count for m in members)),
        )
        for key, members in folded.items()
    ]


def _folded(ambiguous: list[AmbiguousTarget]) -> list[tuple[str, str, str, str]]:
    r"""One row per group of ambiguous targets alike but for layer numbers (same names, same candidate
    count)."""
    groups: dict[tuple, list[AmbiguousTarget]] = defaultdict(list)
    for a in ambiguous:
        groups[(name_skeleton(a.target), name_skeleton(a.chosen), a.n_candidates)].append(a)
    rows = []
    for members in groups.values():
        a = members[0]
        names = a.plausible or a.candidates
        more = ", …" if len(names) > SHOWN_CANDIDATES else ""
        tails = [".".join(n.split(".")[-3:]) for n in names]
        rows.append(
            (
                a.target,
                a.chosen,
                f"{len(names)} of {a.n_candidates}: " + ", ".join(tails[:SHOWN_CANDIDATES]) + more,
                str(len(members)),
            )
        )
    return rows


def _shorten(text: str, width: int) -> str:
    r"""``text`` cut to ``width`` in the middle, keeping more of the tail (where names differ)."""
    if len(text) <= width:
        return text
    keep = max(1, width - 1)
    head = keep // 3
    return text[:head] + "…" + text[len(text) - (keep - head) :]


def _fitted_table(headers: list[str], rows: list[tuple[str, ...]], limit: int | None) -> str:
    r"""``render_table`` with the widest columns shortened in the middle until a row fits ``WIDTH``."""
    shown = rows if not limit else rows[:limit]
    widths = [max([len(h)] + [len(r[i]) for r in shown]) for i, h in enumerate(headers)]
    floor = [max(len(h), 12) for h in headers]
    while sum(widths) + 2 * (len(widths) - 1) > WIDTH:
        i = max(range(len(widths)), key=lambda k: widths[k] - floor[k])
        if widths[i] <= floor[i]:
            break
        widths[i] -= 1
    fitted = [tuple(_shorten(c, w) for c, w in zip(r, widths)) for r in rows]
    return render_table(headers, fitted, limit=limit)


def describe_op(op: str, args: dict[str, Any]) -> str:
    r"""A short human form of an op and its follow-up steps, e.g. ``chunk 0/3 dim 0`` or ``transpose 0,1``."""
    steps = [] if op == "identity" else [_describe_step(op, args)]
    steps += [_describe_step(s["op"], s) for s in args.get("then", [])]
    return " + ".join(steps)


def _describe_step(op: str, args: dict[str, Any]) -> str:
    if op == "cast":
        return f"cast {args['dtype']}"
    if op == "chunk":
        if "count" in args:
            return f"chunk {args['index']}/{args['count']} dim {args['dim']}"
        return f"slice {args['start']}:{args['stop']} dim {args['dim']}"
    if op in ("transpose", "permute"):
        return f"{op} {','.join(map(str, args['dims']))}"
    if op == "reshape":
        return "reshape " + "x".join(map(str, args["shape"]))
    if op == "swap_halves":
        return f"swap_halves dim {args['dim']}"
    if op == "concat":
        return f"concat dim {args['dim']}"
    if op == "permute_rows":
        pattern = args["pattern"]
        if pattern in ("interleave", "deinterleave"):
            return f"permute_rows dim {args['dim']}: {pattern} pairs in groups of {args['group']}"
        if pattern == "blocks":
            return f"permute_rows dim {args['dim']}: blocks of {args['block']} in order {args['order']}"
        return f"permute_rows dim {args['dim']}: {len(args['ranges'])} ranges"
    return op
