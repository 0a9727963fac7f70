r"""Infer a weight conversion from tensor VALUES, collapse it into regex rules, and emit it as code.

Research checkpoints and diffusers weights rarely share names, and the conversions between them are where
ports silently break (a fused QKV split in the wrong order, shift/scale swapped, a transposed projection).
:func:`infer_conversion_map` explains every TARGET tensor from SOURCE tensors by value:

1. Every tensor gets a layout-insensitive fingerprint: a multiset hash of its element bit patterns (the
   sum of one scrambled integer per element), computed in the target's dtype. Equal multisets give equal
   hashes under any transpose, reshape or row permutation, and the hash is exact (no tolerance to tune);
   a cast is covered because the source is hashed after casting to the target dtype. Tensors are read in
   blocks (``.safetensors`` inputs through memory maps) and bucketed by hash, so matching is linear in
   total bytes and never quadratic in the number of keys.
2. Candidates sharing a bucket are confirmed exactly (``torch.equal``), which also finds the layout op:
   identity, cast, reshape, transpose/permute, swap_halves, permute_rows.
3. Targets still unexplained are searched among *pieces* of unused sources (equal chunks along each dim
   whose size matches some target, then the leftover ranges: fused QKV, QKV + MLP), and as *concatenations*
   of source tensors (the target's pieces looked up in the source buckets).
4. A target matched equally well by several sources (constants, fresh initialisation) is ``ambiguous``; the
   candidate that fits best is used: inside the source module its value-unique neighbours map to, then by
   naming patterns already proven, layer numbers and shared words (with prefixes and a few synonyms).
5. The mapping is collapsed into regex rules over layer indices and checked: applying the rules to the
   source key names must give exactly the mapping, otherwise the offending rule is spelt out key by key.

The same rule runtime (``_convert_with_rules`` and the helpers above it) is used by
:func:`apply_rules_to_state_dict` and copied verbatim into the module :func:`emit_rules` writes, so the
library and the generated code cannot disagree.

:func:`match_modules` turns the mapping into a module alignment for bisecting two differently named models.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import itertools
import json
import os
import re
import textwrap
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paritykit.errors import ParityKitError
from paritykit.files import atomic_write_text
from paritykit.report import DEFAULT_LIMIT, environment_stamp, render_table

OPS = (
    "identity",
    "cast",
    "transpose",
    "permute",
    "reshape",
    "chunk",
    "concat",
    "swap_halves",
    "permute_rows",
)

# elements hashed per block: temporaries of ~1 MB stay in cache (2x faster than 4 MB blocks here) and memory
# stays bounded however large a tensor is
_BLOCK = 1 << 18
# fused tensors are split into at most this many equal pieces when looking for a target inside them
_MAX_PIECES = 64
# candidates shown per ambiguous row in the text table (the JSON lists every one)
_SHOWN_CANDIDATES = 3
# the text tables fit a terminal of this width
_WIDTH = 120


# --------------------------------------------------------------------------------------------------------
# rule runtime: these functions are copied verbatim into emitted modules; they may use only `re` and `torch`
# --------------------------------------------------------------------------------------------------------


def _row_index(step, n):
    """The index tensor of a ``permute_rows`` step: target row ``i`` is source row ``index[i]``."""
    import torch

    pattern = step["pattern"]
    if pattern == "deinterleave":
        # per group of G rows: (x0, y0, x1, y1, …) -> (x0, x1, …, y0, y1, …)
        return torch.arange(n).view(-1, step["group"] // 2, 2).transpose(1, 2).reshape(-1)
    if pattern == "interleave":
        # per group of G rows: (x0, x1, …, y0, y1, …) -> (x0, y0, x1, y1, …)
        return torch.arange(n).view(-1, 2, step["group"] // 2).transpose(1, 2).reshape(-1)
    if pattern == "blocks":
        block = step["block"]
        order = torch.tensor(step["order"])
        return (order[:, None] * block + torch.arange(block)[None, :]).reshape(-1)
    if pattern == "ranges":
        return torch.cat([torch.arange(start, stop, stride) for start, stop, stride in step["ranges"]])
    raise ValueError(f"unknown permute_rows pattern {pattern!r}")


def _apply_step(x, step):
    """Apply one layout step (a dict with an ``op`` and its arguments) to a tensor."""
    import torch

    op = step["op"]
    if op == "identity":
        return x
    if op == "cast":
        return x.to(getattr(torch, step["dtype"]))
    if op == "reshape":
        return x.reshape(step["shape"])
    if op == "transpose":
        return x.transpose(*step["dims"]).contiguous()
    if op == "permute":
        return x.permute(*step["dims"]).contiguous()
    if op == "chunk":
        return x.narrow(step["dim"], step["start"], step["stop"] - step["start"]).contiguous()
    if op == "swap_halves":
        first, second = x.chunk(2, dim=step["dim"])
        return torch.cat([second, first], dim=step["dim"])
    if op == "permute_rows":
        return x.index_select(step["dim"], _row_index(step, x.shape[step["dim"]]))
    raise ValueError(f"unknown op {op!r}")


def _apply_op(tensors, op, args):
    """Build one target tensor from its source tensors: the main op, then the ``then`` steps in order."""
    import torch

    if op == "concat":
        parts = args.get("parts") or [[] for _ in tensors]
        pieces = []
        for tensor, steps in zip(tensors, parts):
            for step in steps:
                tensor = _apply_step(tensor, step)
            pieces.append(tensor)
        x = torch.cat(pieces, dim=args["dim"])
    else:
        (x,) = tensors
        x = _apply_step(x, {"op": op, **{k: v for k, v in args.items() if k != "then"}})
    for step in args.get("then", []):
        x = _apply_step(x, step)
    return x


def _convert_with_rules(state_dict, rules):
    """Apply conversion rules to a state dict; every rule is tried on every key (``re.fullmatch``)."""
    import re

    out = {}
    for rule in rules:
        regex = re.compile(rule["pattern"])
        for key in state_dict:
            match = regex.fullmatch(key)
            if match is None:
                continue
            names = [key, *(match.expand(template) for template in rule["sources"][1:])]
            missing = [name for name in names if name not in state_dict]
            if missing:
                raise KeyError(
                    f"rule {rule['pattern']!r} needs {missing[0]!r}, which is not in the state dict"
                )
            out[match.expand(rule["target"])] = _apply_op(
                [state_dict[n] for n in names], rule["op"], rule["args"]
            )
    return out


_RUNTIME = (_row_index, _apply_step, _apply_op, _convert_with_rules)


# --------------------------------------------------------------------------------------------------------
# result objects
# --------------------------------------------------------------------------------------------------------


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
    uses, a guess by names.
    """

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
        rows = [
            (
                r.pattern + "".join(f" + {s}" for s in r.sources[1:]),
                describe_op(r.op, r.args) or "=",
                r.target,
                str(r.count),
            )
            for r in self.rules
        ]
        summary = (
            f"{len(self.mapping)} of {self.n_target} target tensors explained by {len(self.rules)} rule{'' if len(self.rules) == 1 else 's'} "
            f"from {self.n_source} source tensors; {len(self.unmapped_target)} unexplained, "
            f"{len(self.unused_source)} sources unused, {self.n_structure} settled by structure, "
            f"{len(self.ambiguous)} ambiguous, {len(self.warnings)} warning{'' if len(self.warnings) == 1 else 's'} "
            f"({self.seconds:.2f} s)"
        )
        parts = [f"weights map: {self.source_label} -> {self.target_label}", ""]
        parts.append(_fitted_table(["source pattern", "op", "target", "n"], rows, limit))
        for title, names in (
            ("Unexplained target tensors", self.unmapped_target),
            ("Unused source tensors", self.unused_source),
        ):
            if names:
                parts += ["", f"{title} ({len(names)}):"]
                shown = names if not limit else names[:limit]
                parts += [f"  {_shorten(n, _WIDTH - 2)}" for n in shown]
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
                f"Ambiguous targets ({len(self.ambiguous)}): equal values in several sources and nothing in the "
                f"structure to choose; the chosen source is a GUESS by names ({verdict}). "
                "Rows alike but for layer numbers are folded (n); --json lists every candidate.",
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
        parts += ["", summary]
        # prose wraps at the table width; table rows were fitted already
        return "\n".join(
            line if len(line) <= _WIDTH else textwrap.fill(line, _WIDTH, subsequent_indent="  ")
            for line in "\n".join(parts).split("\n")
        )


def _folded(ambiguous: list[AmbiguousTarget]) -> list[tuple[str, str, str, str]]:
    r"""One row per group of ambiguous targets alike but for layer numbers (same names, same candidate count)."""
    groups: dict[tuple, list[AmbiguousTarget]] = defaultdict(list)
    for a in ambiguous:
        groups[(_skeleton(a.target), _skeleton(a.chosen), a.n_candidates)].append(a)
    rows = []
    for members in groups.values():
        a = members[0]
        names = a.plausible or a.candidates
        more = ", …" if len(names) > _SHOWN_CANDIDATES else ""
        tails = [".".join(n.split(".")[-3:]) for n in names]
        rows.append(
            (
                a.target,
                a.chosen,
                f"{len(names)} of {a.n_candidates}: " + ", ".join(tails[:_SHOWN_CANDIDATES]) + more,
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
    r"""``render_table`` with the widest columns shortened in the middle until a row fits ``_WIDTH``."""
    shown = rows if not limit else rows[:limit]
    widths = [max([len(h)] + [len(r[i]) for r in shown]) for i, h in enumerate(headers)]
    floor = [max(len(h), 12) for h in headers]
    while sum(widths) + 2 * (len(widths) - 1) > _WIDTH:
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


# --------------------------------------------------------------------------------------------------------
# fingerprints
# --------------------------------------------------------------------------------------------------------

# 32-bit mixing constants (lowbias32), written as signed values: torch integer arithmetic wraps
_GOLDEN = -1640531527
_MUL1 = 0x7FEB352D
_MUL2 = -2073254261


def _mix(z):
    """A cheap bijective scramble of integer bit patterns (int32 or int64)."""
    z = (z + _GOLDEN) * _MUL1
    z = (z ^ (z >> 15)) * _MUL2
    return z ^ (z >> 16)


def _bits(t):
    r"""Element bit patterns as int32 (int64 for 8-byte dtypes), -0.0 folded onto 0.0 as ``torch.equal`` does.

    Hash sums are accumulated in int64 by ``torch.sum``, so int32 working values keep memory traffic low.
    """
    import torch

    if t.is_complex():
        return _bits(torch.view_as_real(t))
    if t.dtype.is_floating_point:
        t = (t + 0.0).contiguous()  # -0.0 + 0.0 == +0.0
        size = t.element_size()
        if size == 8:
            return t.view(torch.int64)
        if size == 4:
            return t.view(torch.int32)
        return t.view(torch.int16 if size == 2 else torch.int8).to(torch.int32)
    if t.dtype in (torch.int64, torch.uint64):
        return t.view(torch.int64) if t.dtype == torch.uint64 else t
    return t.to(torch.int32)


def _castable(src_dtype, dst_dtype) -> bool:
    return src_dtype == dst_dtype or (src_dtype.is_floating_point and dst_dtype.is_floating_point)


def _multiset_hashes(t, dtype, splits: Iterable[tuple[int, int]] = ()):
    r"""Layout-insensitive hash of ``t`` cast to ``dtype``, and of its equal pieces.

    Args:
        splits: ``(dim, count)`` pairs; for each, the hashes of the ``count`` equal pieces along ``dim``.
    Returns:
        ``(full_hash, {(dim, count): [hash per piece]})``. The tensor is read in row blocks, so memory stays
        bounded; wrapping int64 sums make the result independent of element order.
    """
    import torch

    splits = list(splits)
    x = t.reshape(1) if t.ndim == 0 else t
    rows = x.shape[0]
    total = torch.zeros((), dtype=torch.int64)
    pieces = {s: torch.zeros(s[1], dtype=torch.int64) for s in splits}
    if rows == 0 or x.numel() == 0:
        return 0, {s: v.tolist() for s, v in pieces.items()}
    step = max(1, _BLOCK // max(1, x.numel() // rows))
    for r0 in range(0, rows, step):
        block = x[r0 : r0 + step]
        if block.dtype != dtype:
            block = block.to(dtype)
        h = _mix(_bits(block))
        per_row = h.reshape(h.shape[0], -1).sum(1)
        total += per_row.sum()
        for dim, count in splits:
            if dim == 0:
                size = rows // count
                which = torch.arange(r0, r0 + h.shape[0]) // size
                pieces[(dim, count)].index_add_(0, which, per_row)
            else:
                shape = h.shape
                v = h.reshape(*shape[:dim], count, shape[dim] // count, *shape[dim + 1 :])
                pieces[(dim, count)] += v.movedim(dim, 0).reshape(count, -1).sum(1)
    return int(total), {s: v.tolist() for s, v in pieces.items()}


def _position_hash(t) -> int:
    """Layout-SENSITIVE hash (element value mixed with its position): groups byte-identical tensors."""
    import torch

    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.int64)
    for start in range(0, flat.numel(), _BLOCK):
        block = flat[start : start + _BLOCK]
        salt = _mix(torch.arange(start, start + block.numel(), dtype=torch.int32))
        total += _mix(_bits(block) ^ salt).sum()
    return int(total)


def _row_keys(m):
    """One layout-sensitive hash per row of a 2-D tensor."""
    import torch

    salt = _mix(torch.arange(m.shape[1], dtype=torch.int32) * 7919)
    return _mix(_bits(m) ^ salt[None, :]).sum(1).tolist()


# --------------------------------------------------------------------------------------------------------
# exact confirmation: which layout op turns x into t?
# --------------------------------------------------------------------------------------------------------


def _equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a, b)


def _resolve(x, t) -> list[dict[str, Any]] | None:
    r"""Layout steps turning ``x`` (already in ``t``'s dtype) into ``t`` exactly, or ``None``.

    Tried in order of simplicity: identity, reshape, transpose/permute (of the non-singleton dims),
    swap_halves along one dim, a row permutation along one dim.
    """
    if x.numel() != t.numel():
        return None
    if _equal(x, t):
        return []
    tshape = list(t.shape)
    if x.shape != t.shape and _equal(x.reshape(t.shape), t):
        return [{"op": "reshape", "shape": tshape}]
    xs = [s for s in x.shape if s != 1]
    ts = [s for s in t.shape if s != 1]
    if len(xs) == len(ts) and 2 <= len(xs) <= 5 and sorted(xs) == sorted(ts):
        xv = x.reshape(xs)
        for perm in itertools.permutations(range(len(xs))):
            if perm == tuple(range(len(xs))) or [xs[i] for i in perm] != ts:
                continue
            if _equal(xv.permute(perm).reshape(t.shape), t):
                steps = [] if list(x.shape) == xs else [{"op": "reshape", "shape": xs}]
                moved = [i for i, p in enumerate(perm) if p != i]
                if len(moved) == 2:
                    steps.append({"op": "transpose", "dims": moved})
                else:
                    steps.append({"op": "permute", "dims": list(perm)})
                if ts != tshape:
                    steps.append({"op": "reshape", "shape": tshape})
                return steps
    y = x if x.shape == t.shape else x.reshape(t.shape)
    pre = [] if x.shape == t.shape else [{"op": "reshape", "shape": tshape}]
    for dim in range(t.ndim):
        if t.shape[dim] % 2 == 0 and t.shape[dim] >= 2:
            if _equal(_apply_step(y, {"op": "swap_halves", "dim": dim}), t):
                return [*pre, {"op": "swap_halves", "dim": dim}]
    for dim in range(t.ndim):
        if t.shape[dim] < 3:
            continue
        perm = _row_permutation(y, t, dim)
        if perm is not None:
            return [*pre, {"op": "permute_rows", "dim": dim, **_describe_permutation(perm)}]
    return None


def _row_permutation(y, t, dim) -> list[int] | None:
    """``perm`` with ``t == y.index_select(dim, perm)``, found by hashing rows, or ``None``."""
    import torch

    n = t.shape[dim]
    ym = y.movedim(dim, 0).reshape(n, -1)
    tm = t.movedim(dim, 0).reshape(n, -1)
    where: dict[int, list[int]] = defaultdict(list)
    for i, key in enumerate(_row_keys(ym)):
        where[key].append(i)
    perm = []
    for key in _row_keys(tm):
        rows = where.get(key)
        if not rows:
            return None
        perm.append(rows.pop(0))
    if perm == list(range(n)) or not torch.equal(ym[torch.tensor(perm)], tm):
        return None
    return perm


def _describe_permutation(perm: list[int]) -> dict[str, Any]:
    r"""A compact description of a row permutation: a known pattern when one fits, else stride runs.

    Patterns: ``deinterleave``/``interleave`` pairs within groups of ``group`` rows (rotary layouts,
    interleaved heads), ``blocks`` of ``block`` rows reordered by ``order`` (heads or fused pieces reordered),
    else ``ranges`` ``[[start, stop, stride], …]`` concatenated.
    """
    import torch

    n = len(perm)
    p = torch.tensor(perm)
    for group in range(4, n + 1, 2):
        if n % group:
            continue
        for pattern in ("deinterleave", "interleave"):
            if torch.equal(_row_index({"pattern": pattern, "group": group}, n), p):
                return {"pattern": pattern, "group": group}
    for block in range(n // 2, 1, -1):
        if n % block:
            continue
        starts = p[::block]
        if bool((starts % block == 0).all()):
            candidate = _row_index(
                {"pattern": "blocks", "block": block, "order": (starts // block).tolist()}, n
            )
            if torch.equal(candidate, p):
                return {"pattern": "blocks", "block": block, "order": (starts // block).tolist()}
    ranges: list[list[int]] = []
    i = 0
    while i < n:
        j = i + 1
        stride = perm[j] - perm[i] if j < n else 1
        while j < n and perm[j] - perm[j - 1] == stride:
            j += 1
        if stride == 0:
            stride = 1
        ranges.append([perm[i], perm[j - 1] + stride, stride])
        i = j
    return {"pattern": "ranges", "ranges": ranges}


# --------------------------------------------------------------------------------------------------------
# names: similarity for ambiguous matches, and collapsing names into rules
# --------------------------------------------------------------------------------------------------------

_DIGITS = re.compile(r"\d+")
_WORDS = re.compile(r"[A-Za-z]+")


def _skeleton(name: str) -> str:
    return _DIGITS.sub("#", name)


def _numbers(name: str) -> list[str]:
    return _DIGITS.findall(name)


def _layer_indices(name: str) -> tuple[str, ...]:
    # layer indices are whole dotted components; "norm1" is a name, not an index
    return tuple(c for c in name.split(".") if c.isdigit())


def _ancestors(name: str, depth: int = 8) -> list[str]:
    parts = name.split(".")[:-1]
    return [".".join(parts[:n]) for n in range(len(parts), max(0, len(parts) - depth), -1)]


# words that name the same thing across research and diffusers naming (the text stream of dual-stream blocks
# is "txt"/"context" in research code and "added"/"context" in diffusers; norms and MLPs have many names)
_SYNONYMS = [
    {"txt", "text", "context", "added", "add", "encoder", "cond"},
    {"img", "image", "sample", "hidden"},
    {"ln", "norm", "layernorm", "groupnorm", "rmsnorm"},
    {"ff", "ffn", "mlp", "feedforward"},
    {"scale", "weight", "gamma", "g"},
    {"shift", "bias", "beta", "b"},
]
_SYNONYM_OF = {w: frozenset(group) for group in _SYNONYMS for w in group}


def _words_match(a: str, b: str) -> bool:
    # prefixes count: q ~ query, attn ~ attention
    return a == b or a.startswith(b) or b.startswith(a) or b in _SYNONYM_OF.get(a, ())


class _NameScorer:
    r"""Ranks candidate sources for a target whose values several sources share.

    In order: the (source, target) naming pattern was already proven by a value-unique match; the candidate
    sits in a source module that value-unique matches tie to the target's parent modules (their context);
    the layer indices agree; shared words (prefixes and synonyms count: ``q`` ~ ``query``, ``added`` ~
    ``txt``); not yet used; similar tails.
    """

    def __init__(self) -> None:
        self.pairs: set[tuple[str, str]] = set()
        self.used: set[str] = set()
        # target ancestor module -> source ancestor module -> value-unique matches under both
        self.partners: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.totals: dict[str, int] = defaultdict(int)
        self._homes: dict[str, str] | None = None
        # target module -> names of its direct children (modules or tensors)
        self.target_children: dict[str, set[str]] = defaultdict(set)

    def learn(self, source: str, target: str, *, evidence: bool = True) -> None:
        r"""Record a match; only value-unique matches (``evidence``) teach naming patterns and module ties."""
        self.used.add(source)
        if not evidence:
            return
        self.pairs.add((_skeleton(source), _skeleton(target)))
        self._homes = None
        for t_anc in _ancestors(target):
            self.totals[t_anc] += 1
            partners = self.partners[t_anc]
            for s_anc in _ancestors(source):
                partners[s_anc] += 1

    def home_of(self) -> dict[str, str]:
        r"""Target module -> the deepest source module holding all of its value-unique evidence.

        A module whose evidence all comes from one child module sits one level above that child's home
        (``layers.0`` pairs with ``blocks.0``, not with ``blocks.0.proj``, the home of ``layers.0.linear``).
        """
        if self._homes is None:
            homes: dict[str, str] = {}
            children: dict[str, list[str]] = defaultdict(list)
            for t_anc in self.partners:
                if "." in t_anc and t_anc.rsplit(".", 1)[0] in self.partners:
                    children[t_anc.rsplit(".", 1)[0]].append(t_anc)
            for t_anc in sorted(self.partners, key=lambda a: -a.count(".")):
                partners = self.partners[t_anc]
                if not partners:
                    continue  # every source key it met is top-level (``in_proj_weight``): no module to pair with
                top = max(partners.values())
                best = max((s for s, n in partners.items() if n == top), key=lambda s: s.count("."))
                kids = children.get(t_anc, [])
                # only when the module also holds tensors outside that child (a norm beside a linear);
                # ``to_out`` around ``to_out.0`` is the same module as its only child
                wider = len(self.target_children.get(t_anc, ())) > 1
                if len(kids) == 1 and wider and homes.get(kids[0]) == best and "." in best:
                    best = best.rsplit(".", 1)[0]
                homes[t_anc] = best
            self._homes = homes
        return self._homes

    def homes(self, target: str) -> list[str]:
        r"""For each parent module of ``target`` (deepest first), the source module most tied to it."""
        home_of = self.home_of()
        return [home_of[a] for a in _ancestors(target) if a in home_of]

    def claimed(self) -> dict[str, set[str]]:
        r"""Source module -> the target modules it is the home of."""
        out: dict[str, set[str]] = defaultdict(set)
        for t_anc, s_anc in self.home_of().items():
            out[s_anc].add(t_anc)
        return out

    def key(self, source: str, target: str, cheap: bool = False) -> tuple:
        known = (_skeleton(source), _skeleton(target)) in self.pairs
        si, ti = _layer_indices(source), _layer_indices(target)
        indices = sum(a == b for a, b in zip(si, ti)) / max(1, len(si), len(ti))
        context = 0.0
        for t_anc in _ancestors(target):
            partners = self.partners.get(t_anc)
            if partners:
                hits = max((partners.get(s_anc, 0) for s_anc in _ancestors(source)), default=0)
                context += hits / self.totals[t_anc]
        sw = set(_WORDS.findall(source.lower()))
        tw = set(_WORDS.findall(target.lower()))
        common = sum(any(_words_match(w, v) for v in sw) for w in tw)
        words = common / max(1, len(sw | tw))
        head = (known, round(context, 6), indices, round(words, 6), source not in self.used)
        if cheap:
            return head
        tail = difflib.SequenceMatcher(
            None, ".".join(source.split(".")[-2:]), ".".join(target.split(".")[-2:])
        )
        return (*head, tail.ratio())

    def rank(self, target: str, candidates: Iterable[str], *, keep: int = 64) -> list[str]:
        r"""Best candidates first; the costlier string comparison only runs on the ``keep`` best."""
        candidates = list(candidates)
        if len(candidates) > keep:
            candidates = sorted(candidates, key=lambda s: self.key(s, target, cheap=True), reverse=True)[
                :keep
            ]
        return sorted(candidates, key=lambda s: self.key(s, target), reverse=True)


def _template_escape(text: str) -> str:
    return text.replace("\\", "\\\\")


def _sig(entry: MappingEntry) -> str:
    return json.dumps([entry.op, entry.args], sort_keys=True)


def _literal_rule(entry: MappingEntry) -> ConversionRule:
    return ConversionRule(
        re.escape(entry.sources[0]),
        [_template_escape(s) for s in entry.sources],
        _template_escape(entry.target),
        entry.op,
        entry.args,
        1,
    )


def _group_rules(entries: list[MappingEntry]) -> list[ConversionRule]:
    r"""Rules for entries sharing name skeletons and op: numbers that vary together become ``(\d+)``."""
    first = [_numbers(e.sources[0]) for e in entries]
    derived_names = [[*e.sources[1:], e.target] for e in entries]
    derived = [[_numbers(n) for n in names] for names in derived_names]
    n_first = len(first[0])
    src_cols = [tuple(f[i] for f in first) for i in range(n_first)]

    split_src: list[int] = []
    split_derived: list[tuple[int, int]] = []
    spec: dict[tuple[int, int], tuple[str, Any]] = {}
    referenced: set[int] = set()
    for j in range(len(derived[0])):
        for p in range(len(derived[0][j])):
            col = tuple(d[j][p] for d in derived)
            refs = [i for i in range(n_first) if src_cols[i] == col]
            if len(set(col)) == 1 and (not refs or len(set(src_cols[refs[0]])) == 1):
                spec[(j, p)] = ("lit", col[0])
            elif refs:
                i = p if p in refs else refs[0]
                spec[(j, p)] = ("ref", i)
                referenced.add(i)
            else:
                split_derived.append((j, p))
    for i in range(n_first):
        if i not in referenced and len(set(src_cols[i])) > 1:
            split_src.append(i)
    if split_src or split_derived:
        groups: dict[tuple, list[MappingEntry]] = defaultdict(list)
        for k, e in enumerate(entries):
            groups[
                tuple(first[k][i] for i in split_src) + tuple(derived[k][j][p] for j, p in split_derived)
            ].append(e)
        if len(groups) == 1:  # cannot split further: spell every entry out
            return [_literal_rule(e) for e in entries]
        return [r for g in groups.values() for r in _group_rules(g)]

    group_of = {i: g + 1 for g, i in enumerate(sorted(referenced))}
    texts = _DIGITS.split(entries[0].sources[0])
    pattern = re.escape(texts[0])
    for i in range(n_first):
        pattern += r"(\d+)" if i in referenced else re.escape(src_cols[i][0])
        pattern += re.escape(texts[i + 1])

    def template(name: str, j: int) -> str:
        pieces = _DIGITS.split(name)
        out = _template_escape(pieces[0])
        for p in range(len(pieces) - 1):
            kind, value = spec[(j, p)]
            if kind == "lit":
                out += value
            else:
                nxt = pieces[p + 1]
                out += f"\\g<{group_of[value]}>" if nxt[:1].isdigit() else f"\\{group_of[value]}"
            out += _template_escape(pieces[p + 1])
        return out

    templates = [template(n, j) for j, n in enumerate(derived_names[0])]
    sources = [_first_template(entries[0].sources[0], src_cols, referenced, group_of), *templates[:-1]]
    return [ConversionRule(pattern, sources, templates[-1], entries[0].op, entries[0].args, len(entries))]


def _first_template(name: str, src_cols, referenced, group_of) -> str:
    """The first source written as a template (for display and for the ``sources`` list)."""
    pieces = _DIGITS.split(name)
    out = _template_escape(pieces[0])
    for i in range(len(pieces) - 1):
        if i in referenced:
            out += f"\\g<{group_of[i]}>" if pieces[i + 1][:1].isdigit() else f"\\{group_of[i]}"
        else:
            out += src_cols[i][0]
        out += _template_escape(pieces[i + 1])
    return out


def collapse_rules(mapping: list[MappingEntry], source_keys: Iterable[str]) -> list[ConversionRule]:
    r"""Collapse a mapping into regex rules over layer indices, verified against the source key names.

    Entries whose names share a skeleton (digits blanked) and whose op and args are equal form one rule;
    numbers that vary together between source and target become ``(\d+)`` captures and back-references.
    The rules are then applied to every source name: a rule that would produce a target the mapping does
    not contain (or builds it differently) is replaced by one literal rule per entry.
    """
    keys = list(source_keys)
    prefix_rules, mapping = _prefix_rules(mapping, keys)
    groups: dict[tuple, list[MappingEntry]] = defaultdict(list)
    for e in mapping:
        groups[(tuple(_skeleton(s) for s in e.sources), _skeleton(e.target), _sig(e))].append(e)
    rules: list[ConversionRule] = []
    origin: list[list[MappingEntry]] = []
    for entries in groups.values():
        for rule in _group_rules(entries):
            rules.append(rule)
            origin.append(entries)
    expected = {e.target: (tuple(e.sources), _sig(e)) for e in mapping}
    keys = list(source_keys)
    for _ in range(3):
        bad = _bad_rules(rules, expected, keys)
        if not bad:
            break
        fixed: list[ConversionRule] = []
        for k, rule in enumerate(rules):
            if k not in bad:
                fixed.append(rule)
                continue
            regex = re.compile(rule.pattern)
            fixed += [
                _literal_rule(e)
                for e in origin[k]
                if regex.fullmatch(e.sources[0]) and _expand(regex, e.sources[0], rule.target) == e.target
            ]
        rules = fixed
        origin = _origins(rules, mapping)
    # rules read in target order: the first target each rule builds
    origin = _origins(rules, mapping)
    position = {e.target: i for i, e in enumerate(mapping)}
    first = {
        id(r): min((position[e.target] for e in o), default=len(position)) for r, o in zip(rules, origin)
    }
    rules.sort(key=lambda r: first[id(r)])
    return prefix_rules + _merge_suffixes(rules)


def _prefix_rules(
    mapping: list[MappingEntry], keys: list[str]
) -> tuple[list[ConversionRule], list[MappingEntry]]:
    r"""One rule for a pure prefix strip (or swap): every source key under ``P`` maps, unchanged, to the
    same name under ``Q`` (``model.diffusion_model.x -> x``); the entries it covers leave the mapping."""
    groups: dict[tuple, list[MappingEntry]] = defaultdict(list)
    for e in mapping:
        if len(e.sources) != 1 or e.op not in ("identity", "cast"):
            continue
        source, target = e.sources[0], e.target
        tail = os.path.commonprefix([source[::-1], target[::-1]])[::-1]
        tail = tail[tail.find(".") + 1 :] if not (tail == source or tail == target) else tail
        p, q = source[: len(source) - len(tail)], target[: len(target) - len(tail)]
        if tail and (p or q) and (not p or p.endswith(".")) and (not q or q.endswith(".")):
            groups[(p, q, _sig(e))].append(e)
    rules, covered = [], set()
    for (p, q, _), entries in groups.items():
        under = [k for k in keys if k.startswith(p)]
        modules = {_module_of(x.target) for x in entries}
        # a strip spanning several modules, with no layer number in it (those are the index rules' job)
        if len(modules) < 2 or _DIGITS.search(p + q) or len(under) != len(entries):
            continue
        e = entries[0]
        rules.append(
            ConversionRule(
                re.escape(p) + "(.+)",
                [_template_escape(p) + "\\1"],
                _template_escape(q) + "\\1",
                e.op,
                e.args,
                len(entries),
            )
        )
        covered.update(id(x) for x in entries)
    return rules, [e for e in mapping if id(e) not in covered]


_LAST = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _merge_suffixes(rules: list[ConversionRule]) -> list[ConversionRule]:
    r"""Merge rules that differ only in a last name component kept as is (``weight``/``bias``) into one.

    ``…\.qkv\.weight -> ….to_q.weight`` and ``…\.qkv\.bias -> ….to_q.bias`` (same op and args) become
    ``…\.qkv\.(weight|bias) -> ….to_q.``. The merged pattern matches exactly the union of what the
    verified rules matched, so it needs no new check.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    for k, r in enumerate(rules):
        last = r.target.rsplit(".", 1)[-1]
        if (
            len(r.sources) != 1
            or "." not in r.target
            or not _LAST.fullmatch(last)
            or not r.pattern.endswith("\\." + last)
            or not r.sources[0].endswith("." + last)
        ):
            continue
        key = (
            r.pattern[: -len(last)],
            r.sources[0][: -len(last)],
            r.target[: -len(last)],
            r.op,
            json.dumps(r.args, sort_keys=True),
        )
        groups[key].append(k)
    merged: dict[int, ConversionRule] = {}
    dropped: set[int] = set()
    for (pattern, source, target, _, _), members in groups.items():
        if len(members) < 2:
            continue
        lasts = [rules[k].target.rsplit(".", 1)[-1] for k in members]
        group = re.compile(pattern).groups + 1
        ref = f"\\{group}"
        first = rules[members[0]]
        merged[members[0]] = ConversionRule(
            pattern + "(" + "|".join(lasts) + ")",
            [source + ref],
            target + ref,
            first.op,
            first.args,
            sum(rules[k].count for k in members),
        )
        dropped.update(members[1:])
    return [merged.get(k, r) for k, r in enumerate(rules) if k not in dropped]


_TEMPLATE_PART = re.compile(r"\\g<(\d+)>|\\(\d+)|\\(\\)")


@functools.lru_cache(maxsize=4096)
def _template_parts(template: str) -> tuple[str | int, ...]:
    parts: list[str | int] = []
    pos = 0
    for m in _TEMPLATE_PART.finditer(template):
        parts.append(template[pos : m.start()])
        parts.append(int(m.group(1) or m.group(2)) if m.group(3) is None else "\\")
        pos = m.end()
    parts.append(template[pos:])
    return tuple(parts)


def _fill(match: re.Match[str], template: str) -> str:
    """``match.expand(template)`` for the templates rules use, without re-parsing the template every call."""
    return "".join(p if isinstance(p, str) else match.group(p) for p in _template_parts(template))


def _expand(regex: re.Pattern[str], key: str, template: str) -> str | None:
    m = regex.fullmatch(key)
    return _fill(m, template) if m else None


def _origins(rules: list[ConversionRule], mapping: list[MappingEntry]) -> list[list[MappingEntry]]:
    by_first: dict[str, list[MappingEntry]] = defaultdict(list)
    for e in mapping:
        by_first[_skeleton(e.sources[0])].append(e)
    out = []
    for r in rules:
        regex = re.compile(r.pattern)
        skel = _skeleton(_unescape_pattern(r.pattern))
        out.append([e for e in by_first.get(skel, []) if _expand(regex, e.sources[0], r.target) == e.target])
    return out


def _unescape_pattern(pattern: str) -> str:
    return re.sub(r"\\(.)", r"\1", pattern.replace(r"(\d+)", "0"))


def _bad_rules(rules: list[ConversionRule], expected: dict, keys: list[str]) -> set[int]:
    by_skel: dict[str, list[int]] = defaultdict(list)
    for k, r in enumerate(rules):
        by_skel[_skeleton(_unescape_pattern(r.pattern))].append(k)
    bad: set[int] = set()
    for key in keys:
        for k in by_skel.get(_skeleton(key), ()):
            r = rules[k]
            m = re.fullmatch(r.pattern, key)
            if m is None:
                continue
            names = (key, *(_fill(m, s) for s in r.sources[1:]))
            if expected.get(_fill(m, r.target)) != (names, json.dumps([r.op, r.args], sort_keys=True)):
                bad.add(k)
    return bad


# --------------------------------------------------------------------------------------------------------
# inference
# --------------------------------------------------------------------------------------------------------


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load_path(path: Path) -> Mapping[str, Any]:
    if path.is_file() and path.name.endswith((".safetensors", ".safetensors.index.json")):
        mapped = _map_safetensors(path)
        if mapped is not None:
            return mapped
    from paritykit.io import load_state_dict

    return load_state_dict(path)


def _map_safetensors(path: Path) -> dict[str, Any] | None:
    r"""Safetensors tensors as views of privately memory-mapped files, or ``None`` to use the full loader.

    Pages are read when hashing reaches them and stay reclaimable file cache, so checkpoints larger than RAM
    stream through the fingerprint pass. The header is validated first (byte ranges against the file size);
    anything unusual (an unaligned offset, an unknown dtype) falls back to :func:`paritykit.io.load_state_dict`.
    """
    import torch

    from paritykit.safetensors_header import read_safetensors_header

    try:
        header = read_safetensors_header(path)
        storages: dict[Path, Any] = {}
        out = {}
        for name, info in header.tensors.items():
            dtype = getattr(torch, info.dtype, None)
            if not isinstance(dtype, torch.dtype) or info.start % info.itemsize:
                return None
            if info.file not in storages:
                size = info.file.stat().st_size
                storages[info.file] = torch.UntypedStorage.from_file(
                    str(info.file), shared=False, nbytes=size
                )
            view = torch.empty(0, dtype=dtype)
            out[name] = view.set_(storages[info.file], info.start // info.itemsize, info.shape)
        return out
    except Exception:
        return None  # the full loader reports the problem with its own one-line error


def _as_state_dict(obj: Any, label: str) -> tuple[dict[str, Any], str]:
    import torch

    if isinstance(obj, (str, os.PathLike)):
        path = Path(obj)
        if not path.exists():
            raise ParityKitError(f"{label} {str(path)!r}: no such file or directory")
        tensors, name = _load_path(path), str(path)
    elif isinstance(obj, Mapping):
        tensors, name = obj, label
    elif hasattr(obj, "state_dict"):
        tensors, name = obj.state_dict(), type(obj).__name__
    else:
        raise ParityKitError(
            f"{label}: expected a path, a dict of tensors or a module, got {type(obj).__name__}"
        )
    out = {}
    for key, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise ParityKitError(f"{label}: {key!r} is a {type(value).__name__}, not a tensor")
        out[str(key)] = value.detach()
    if not out:
        raise ParityKitError(f"{label} {name!r} holds no tensors")
    return out, name


@dataclass
class _Found:
    """One confirmed way to build a target: sources, op and args."""

    sources: list[str]
    op: str
    args: dict[str, Any]
    # sources with byte-identical values (a class of constants): any of them builds the target the same way;
    # the list is shared between targets, so a big bucket of constants costs no per-target copies
    members: list[str] | None = None
    signature: str | None = field(default=None, compare=False, repr=False)

    def candidates(self) -> list[str]:
        return self.members if self.members else [self.sources[0]]

    def using(self, source: str) -> _Found:
        return self if source == self.sources[0] else _Found([source], self.op, self.args)


def _entry_from_steps(source: str, steps: list[dict[str, Any]], cast: str | None) -> _Found:
    steps = list(steps) + ([{"op": "cast", "dtype": cast}] if cast else [])
    if not steps:
        return _Found([source], "identity", {})
    main, rest = steps[0], steps[1:]
    args = {k: v for k, v in main.items() if k != "op"}
    if rest:
        args["then"] = rest
    return _Found([source], main["op"], args)


class _Matcher:
    """State of one inference run (kept in one place so the phases read top to bottom)."""

    def __init__(self, source: dict, target: dict) -> None:
        self.source = source
        self.target = target
        self.dtypes = sorted({t.dtype for t in target.values()}, key=str)
        # (dtype, numel, multiset hash) -> source keys
        self.src_table: dict[tuple, list[str]] = defaultdict(list)
        self.src_numels: dict[Any, set[int]] = defaultdict(set)
        self.tgt_hash: dict[str, int] = {}
        self.found: dict[str, list[_Found]] = {}
        self.scorer = _NameScorer()
        self.chosen: dict[str, _Found] = {}
        self.ambiguous: dict[str, list[str]] = {}
        self.n_candidates: dict[str, int] = {}
        self._poshash: dict[tuple, int] = {}
        self._resolved: dict[tuple, list[dict[str, Any]] | None] = {}
        self._classes: dict[tuple, dict[tuple, list[str]]] = {}
        self._cast_cache: dict[tuple[str, Any], Any] = {}
        self.evidence: dict[str, str] = {}
        self.plausible: dict[str, list[str]] = {}
        self._subtree: dict[str, list[str]] | None = None
        self._whole: set[str] = set()
        self._anc_cache: dict[str, set[str]] = {}
        self.by_module: dict[str, list[str]] = defaultdict(list)
        # ``in_proj_weight`` / ``in_proj_bias`` are one module's parameters as much as ``qkv.weight`` / ``qkv.bias``
        self.by_stem: dict[str, list[str]] = defaultdict(list)
        self._const_pieces: dict[tuple, list[_Found]] = {}
        for key in target:
            self.by_module[key.rsplit(".", 1)[0] if "." in key else ""].append(key)
            self.by_stem[_param_stem(key)[0]].append(key)
            parts = key.split(".")
            for n in range(1, len(parts)):
                self.scorer.target_children[".".join(parts[:n])].add(parts[n])

    # -- helpers ------------------------------------------------------------------------------------------
    def cast(self, key: str, dtype):
        t = self.source[key]
        if t.dtype == dtype:
            return t
        if (key, dtype) not in self._cast_cache:
            self._cast_cache = {(key, dtype): t.to(dtype)}  # keep one: memory stays bounded
        return self._cast_cache[(key, dtype)]

    def position_class(self, side: str, key: str, dtype) -> tuple:
        tensors = self.source if side == "s" else self.target
        if (side, key, dtype) not in self._poshash:
            t = self.cast(key, dtype) if side == "s" else tensors[key]
            self._poshash[(side, key, dtype)] = _position_hash(t)
        return (tuple(tensors[key].shape), tensors[key].dtype, self._poshash[(side, key, dtype)])

    # -- phase 1: fingerprints ----------------------------------------------------------------------------
    def fingerprint(self) -> None:
        for key, t in self.target.items():
            self.tgt_hash[key] = _multiset_hashes(t, t.dtype)[0]
        for key, s in self.source.items():
            for dtype in self.dtypes:
                if _castable(s.dtype, dtype):
                    h = _multiset_hashes(s, dtype)[0]
                    self.src_table[(dtype, s.numel(), h)].append(key)
                    self.src_numels[dtype].add(s.numel())

    # -- phase 2: whole tensors ---------------------------------------------------------------------------
    def match_whole(self) -> None:
        for key, t in self.target.items():
            bucket = self.src_table.get((t.dtype, t.numel(), self.tgt_hash[key]), [])
            if not bucket:
                continue
            results: list[_Found] = []
            if len(bucket) == 1:
                classes = {None: bucket}
            else:
                # sources with byte-identical values form one class, built once per bucket and resolved once
                # per (target class, source class): buckets of constants cost linear time
                bucket_key = (t.dtype, t.numel(), self.tgt_hash[key])
                if bucket_key not in self._classes:
                    grouped: dict[tuple, list[str]] = defaultdict(list)
                    for s in bucket:
                        grouped[self.position_class("s", s, t.dtype)].append(s)
                    self._classes[bucket_key] = grouped
                classes = self._classes[bucket_key]
            for cls, members in classes.items():
                cache_key = (cls, self.position_class("t", key, t.dtype)) if cls is not None else None
                if cache_key is not None and cache_key in self._resolved:
                    steps = self._resolved[cache_key]
                else:
                    steps = _resolve(self.cast(members[0], t.dtype), t)
                    if cache_key is not None:
                        self._resolved[cache_key] = steps
                if steps is None:
                    continue
                cast = _dtype_name(t.dtype) if self.source[members[0]].dtype != t.dtype else None
                found = _entry_from_steps(members[0], steps, cast)
                found.members = members if len(members) > 1 else None
                results.append(found)
            if results:
                self.found[key] = results

    # -- phase 2b: values rounded through a lower precision ------------------------------------------------
    def match_rounded(self) -> None:
        r"""Targets whose values sit on a bf16/fp16 grid while their dtype is wider: a conversion that went
        through the lower precision (saved in bf16, loaded as fp32). Matched against sources rounded the same way.
        """
        import torch

        lows = (torch.bfloat16, torch.float16)
        open_targets = [
            k
            for k, t in self.target.items()
            if k not in self.found and t.dtype.is_floating_point and t.element_size() >= 4 and t.numel()
        ]
        for low in lows:
            wanted = []
            for k in open_targets:
                t = self.target[k]
                if k not in self.found and _equal(t.to(low).to(t.dtype), t):
                    wanted.append(k)
            if not wanted:
                continue
            table: dict[tuple[int, int], list[str]] = defaultdict(list)
            for skey, src in self.source.items():
                if src.dtype.is_floating_point and src.dtype != low:
                    table[(src.numel(), _multiset_hashes(src, low)[0])].append(skey)
            for k in wanted:
                t = self.target[k]
                t_low = t.to(low)
                for skey in table.get((t.numel(), _multiset_hashes(t_low, low)[0]), []):
                    steps = _resolve(self.source[skey].to(low), t_low)
                    if steps is not None:
                        casts = [
                            {"op": "cast", "dtype": _dtype_name(low)},
                            {"op": "cast", "dtype": _dtype_name(t.dtype)},
                        ]
                        self.found.setdefault(k, []).append(_entry_from_steps(skey, [*steps, *casts], None))

    # -- phase 3: pieces of fused sources -----------------------------------------------------------------
    def match_pieces(self) -> None:
        open_targets = [k for k in self.target if k not in self.found]
        if not open_targets:
            return
        table: dict[tuple, list[str]] = defaultdict(list)
        numels: dict[Any, set[int]] = defaultdict(set)
        for k in open_targets:
            t = self.target[k]
            table[(t.dtype, t.numel(), self.tgt_hash[k])].append(k)
            numels[t.dtype].add(t.numel())
        pools = {id(p): p for fs in self.found.values() for f in fs for p in (f.sources, f.members or [])}
        used = {s for pool in pools.values() for s in pool}
        candidates: dict[str, list[_Found]] = defaultdict(list)
        for skey, s in self.source.items():
            if skey in used or s.ndim == 0:
                continue
            for dtype in self.dtypes:
                if not _castable(s.dtype, dtype) or not numels[dtype]:
                    continue
                splits = [
                    (d, k)
                    for d in range(s.ndim)
                    for k in range(2, min(s.shape[d], _MAX_PIECES) + 1)
                    if s.shape[d] % k == 0 and s.numel() // k in numels[dtype]
                ]
                if not splits:
                    continue
                _, pieces = _multiset_hashes(s, dtype, splits)
                covered: dict[int, list[tuple[int, int]]] = defaultdict(list)
                for (dim, count), hashes in pieces.items():
                    size = s.shape[dim] // count
                    for index, h in enumerate(hashes):
                        for tkey in table.get((dtype, s.numel() // count, h), []):
                            start = index * size
                            f = self._piece(skey, dtype, dim, start, start + size, tkey, index, count)
                            if f is not None:
                                candidates[tkey].append(f)
                                covered[dim].append((start, start + size))
                # leftover ranges next to matched pieces: the unequal parts of a fused tensor (QKV + MLP)
                for dim, spans in covered.items():
                    for start, stop in _gaps(spans, s.shape[dim]):
                        numel = (stop - start) * (s.numel() // s.shape[dim])
                        if numel not in numels[dtype]:
                            continue
                        piece = self.cast(skey, dtype).narrow(dim, start, stop - start)
                        h = _multiset_hashes(piece, dtype)[0]
                        for tkey in table.get((dtype, numel, h), []):
                            f = self._piece(skey, dtype, dim, start, stop, tkey, None, None)
                            if f is not None:
                                candidates[tkey].append(f)
        for tkey, fs in candidates.items():
            self.found[tkey] = fs

    def _piece(self, skey, dtype, dim, start, stop, tkey, index, count) -> _Found | None:
        t = self.target[tkey]
        steps = _resolve(self.cast(skey, dtype).narrow(dim, start, stop - start), t)
        if steps is None:
            return None
        chunk: dict[str, Any] = {"op": "chunk", "dim": dim, "start": start, "stop": stop}
        if count is not None:
            chunk.update(index=index, count=count)
        cast = _dtype_name(t.dtype) if self.source[skey].dtype != t.dtype else None
        return _entry_from_steps(skey, [chunk, *steps], cast)

    # -- phase 4: concatenations of sources ---------------------------------------------------------------
    def match_concat(self) -> None:
        for tkey, t in self.target.items():
            if tkey in self.found or t.ndim == 0:
                continue
            numels = self.src_numels[t.dtype]
            splits = [
                (d, k)
                for d in range(t.ndim)
                for k in range(2, min(t.shape[d], _MAX_PIECES) + 1)
                if t.shape[d] % k == 0 and t.numel() // k in numels
            ]
            if not splits:
                continue
            _, pieces = _multiset_hashes(t, t.dtype, splits)
            for (dim, count), hashes in sorted(pieces.items(), key=lambda kv: kv[0][1]):
                size = t.shape[dim] // count
                spans = [
                    (i * size, (i + 1) * size, h)
                    for i, h in enumerate(hashes)
                    if self.src_table.get((t.dtype, t.numel() // count, h))
                ]
                if not spans:
                    continue
                for start, stop in _gaps([(a, b) for a, b, _ in spans], t.shape[dim]):
                    piece = t.narrow(dim, start, stop - start)
                    spans.append((start, stop, _multiset_hashes(piece, t.dtype)[0]))
                spans.sort()
                found = self._concat(tkey, dim, spans)
                if found is not None:
                    self.found[tkey] = [found]
                    break

    def _concat(self, tkey, dim, spans) -> _Found | None:
        t = self.target[tkey]
        sources, parts = [], []
        per_numel = t.numel() // t.shape[dim]
        for start, stop, h in spans:
            piece = t.narrow(dim, start, stop - start)
            bucket = self.src_table.get((t.dtype, (stop - start) * per_numel, h), [])
            for skey in self.scorer.rank(tkey, bucket):
                steps = _resolve(self.cast(skey, t.dtype), piece)
                if steps is not None:
                    cast = (
                        [{"op": "cast", "dtype": _dtype_name(t.dtype)}]
                        if self.source[skey].dtype != t.dtype
                        else []
                    )
                    sources.append(skey)
                    parts.append([*cast, *steps])
                    break
            else:
                return None
        args: dict[str, Any] = {"dim": dim}
        if any(parts):
            args["parts"] = parts
        return _Found(sources, "concat", args)

    # -- phase 5: choose among equal candidates -----------------------------------------------------------
    def ways(self, tkey: str) -> list[_Found]:
        r"""Every distinct way (one source each for whole-tensor matches) that builds ``tkey`` exactly."""
        out, seen = [], set()
        for f in self.found[tkey]:
            for name in f.candidates():
                way = f.using(name)
                sig = _way_sig(way)
                if sig not in seen:
                    seen.add(sig)
                    out.append(way)
        return out

    def settle(self, tkey: str, way: _Found, evidence: str, *, learn: bool = False) -> None:
        self.chosen[tkey] = way
        self.evidence[tkey] = evidence
        for name in way.sources:
            self.scorer.learn(name, tkey, evidence=learn)

    def choose(self) -> None:
        r"""Pick one way per target: values first, then structure; what neither settles is a guess by names.

        Structure, in order: the way a settled sibling parameter of the same target module is built (a bias
        chunked like its weight), the source module value-unique matches tie to the target's modules, no
        source inside a module tied to a DIFFERENT target module, live weights over EMA/shadow copies, and
        a (source, target, op) pattern already settled in another layer (block 1 maps like block 0).
        """
        all_ways = {k: self.ways(k) for k in self.target if k in self.found}
        self._whole = {w.sources[0] for ways in all_ways.values() for w in ways if w.op != "chunk"}
        for tkey, ways in all_ways.items():
            live = _prefer_live(ways)
            # a constant (zeros, ones) matched whole may still be a piece of a fused constant: structure decides
            if len({_way_sig(w) for w in live}) == 1 and not _constant(self.target[tkey]):
                why = "values" if len(ways) == 1 else "values; live weights over EMA/shadow copies"
                self.settle(tkey, live[0], why, learn=True)
        narrowed: dict[str, list[_Found]] = {}
        for _ in range(4):
            claimed = self.scorer.claimed()
            proven = {_relation(self.chosen[k], k) for k in self.chosen}
            changed = False
            for tkey, ways in all_ways.items():
                if tkey in self.chosen:
                    continue
                extra = self.sibling_ways(tkey)
                pieces = self.home_piece_ways(tkey)
                if extra or pieces:
                    all_ways[tkey] = ways = _dedupe([*extra, *ways, *pieces])
                kept, why = self.narrow(tkey, ways, extra, claimed, proven)
                narrowed[tkey] = kept
                if len({_way_sig(w) for w in kept}) == 1:
                    self.settle(tkey, kept[0], "values" if len(ways) == 1 else "structure: " + why)
                    proven.add(_relation(kept[0], tkey))
                    changed = True
            if not changed:
                break
        self.guess({k: narrowed.get(k, all_ways[k]) for k in all_ways if k not in self.chosen}, all_ways)

    def sibling_ways(self, tkey: str) -> list[_Found]:
        r"""Ways built like a settled sibling of ``tkey`` (same target module, or same stem: ``in_proj_bias``
        beside ``in_proj_weight``): the matching source of the same module or stem, same leading chunk (a fused
        bias split like its fused weight), verified exactly."""
        module, leaf = tkey.rsplit(".", 1) if "." in tkey else ("", tkey)
        stem, stem_leaf = _param_stem(tkey)
        t = self.target[tkey]
        out = []
        siblings = [(o, False) for o in self.by_module.get(module, ()) if "." in tkey]
        if stem_leaf in _PARAM_LEAVES:  # a weight/bias pair, dotted or not; not any two root-level tensors
            siblings += [(o, True) for o in self.by_stem.get(stem, ()) if _param_stem(o)[1] in _PARAM_LEAVES]
        for other, same_stem in siblings:
            way = self.chosen.get(other)
            if other == tkey or way is None or len(way.sources) != 1:
                continue
            names = []
            if "." in way.sources[0]:
                names.append(f"{way.sources[0].rsplit('.', 1)[0]}.{leaf}")
            if same_stem:
                names += _stem_names(_param_stem(way.sources[0])[0], stem_leaf)
            for candidate in dict.fromkeys(names):
                found = self._built_like(way, candidate, t)
                if found is not None:
                    out.append(found)
        return _dedupe(out)

    def _built_like(self, way: _Found, candidate: str, t) -> _Found | None:
        r"""``candidate`` split the way ``way`` splits its source, if that gives ``t`` exactly."""
        s = self.source.get(candidate)
        if s is None or candidate == way.sources[0] or not _castable(s.dtype, t.dtype):
            return None
        steps: list[dict[str, Any]] = []
        x = self.cast(candidate, t.dtype)
        if way.op == "chunk" and way.args["dim"] == 0 and s.ndim >= 1:
            if s.shape[0] != self.source[way.sources[0]].shape[0]:
                return None
            steps.append({"op": "chunk", **{k: v for k, v in way.args.items() if k != "then"}})
            x = _apply_step(x, steps[0])
        rest = _resolve(x, t)
        if rest is None:
            return None
        cast = _dtype_name(t.dtype) if s.dtype != t.dtype else None
        return _entry_from_steps(candidate, [*steps, *rest], cast)

    def home_piece_ways(self, tkey: str) -> list[_Found]:
        r"""Equal row pieces of fused tensors in the target's home module that hold its values too.

        Whole-tensor matches stop the piece search, so a zero ``to_q.bias`` would otherwise never see the
        zero chunks of ``qkv.bias`` beside it: the true source must be among the candidates.
        """
        t = self.target[tkey]
        if _constant(t):
            # a constant is no evidence of its home either: every unused fused tensor is searched (once per
            # shape and value), so the true source is among the candidates even for top-level source keys
            cache_key = self.position_class("t", tkey, t.dtype)
            if cache_key not in self._const_pieces:
                self._const_pieces[cache_key] = self._pieces_in(tkey, list(self.source))
            return self._const_pieces[cache_key]
        homes = self.scorer.homes(tkey)
        if not homes:
            return []
        if self._subtree is None:
            self._subtree = defaultdict(list)
            for key in self.source:
                for anc in _ancestors(key):
                    self._subtree[anc].append(key)
        return self._pieces_in(tkey, self._subtree.get(homes[0], ()))

    def _pieces_in(self, tkey: str, pool: Iterable[str]) -> list[_Found]:
        t = self.target[tkey]
        out = []
        for skey in pool:
            if skey in self._whole:  # a tensor some target matches whole is not a fused one
                continue
            s = self.source[skey]
            if (
                t.ndim == 0
                or s.ndim != t.ndim
                or s.shape[1:] != t.shape[1:]
                or not _castable(s.dtype, t.dtype)
            ):
                continue
            count, rest = divmod(s.shape[0], t.shape[0])
            if rest or not 2 <= count <= _MAX_PIECES:
                continue
            x = self.cast(skey, t.dtype)
            size = t.shape[0]
            for index in range(count):
                if _equal(x.narrow(0, index * size, size), t):
                    chunk = {"op": "chunk", "dim": 0, "start": index * size, "stop": (index + 1) * size}
                    chunk.update(index=index, count=count)
                    cast = _dtype_name(t.dtype) if s.dtype != t.dtype else None
                    out.append(_entry_from_steps(skey, [chunk], cast))
        return out

    def narrow(self, tkey, ways, extra, claimed, proven) -> tuple[list[_Found], str]:
        r"""The ways structure keeps for ``tkey`` and why (each filter applies only if something remains)."""
        reasons = []

        def keep(subset, why):
            nonlocal ways
            if subset and len(subset) < len(ways):
                ways = subset
                reasons.append(why)

        keep(extra, "built like its sibling parameter")
        for home in self.scorer.homes(tkey):
            inside = [w for w in ways if home in self.ancestors(w.sources[0])]
            if inside:
                keep(inside, f"inside {home or 'the root'}, which the module's other tensors come from")
                break
        t_anc = set(_ancestors(tkey))
        keep(
            [w for w in ways if not self.foreign(w.sources[0], t_anc, claimed)],
            "others sit in modules that map to other target modules",
        )
        keep(_prefer_live(ways), "live weights over EMA/shadow copies")
        keep([w for w in ways if _relation(w, tkey) in proven], "maps like the same tensor in other layers")
        return ways, "; ".join(reasons) or "only way"

    def ancestors(self, name: str) -> set[str]:
        if name not in self._anc_cache:
            self._anc_cache[name] = set(_ancestors(name))
        return self._anc_cache[name]

    def foreign(self, source: str, t_anc: set[str], claimed: dict[str, set[str]]) -> bool:
        r"""True when the deepest claimed module around ``source`` is claimed only by modules outside
        the target's."""
        for anc in _ancestors(source):
            owners = claimed.get(anc)
            if owners:
                return not (owners & t_anc)
        return False

    def guess(self, narrowed: dict[str, list[_Found]], all_ways: dict[str, list[_Found]]) -> None:
        r"""Targets structure cannot settle: one (source, target, op) pattern per target group, voted by
        names, so block 1 is guessed like block 0; every candidate is listed."""
        ranked: dict[str, list[_Found]] = {}
        clear: dict[str, bool] = {}
        groups: dict[tuple, list[str]] = defaultdict(list)
        for tkey, ways in narrowed.items():
            by_name: dict[str, list[_Found]] = defaultdict(list)
            for w in ways:
                by_name[w.sources[0]].append(w)
            names = self.scorer.rank(tkey, by_name, keep=64)
            names += [n for n in by_name if n not in set(names)]
            ranked[tkey] = [w for n in names for w in by_name[n]]
            keys = [self.scorer.key(n, tkey) for n in names[:2]]
            clear[tkey] = len(keys) < 2 or keys[0] > keys[1]
            groups[_layer_key(tkey)].append(tkey)
        taken: set[str] = set()
        # groups whose names point clearly (``norm_added_q`` ~ ``txt``) choose first; the rest take what is left
        order = sorted(groups.values(), key=lambda m: -sum(clear[k] for k in m) / len(m))
        for members in order:
            fresh = {k: [w for w in ranked[k] if _way_sig(w) not in taken] or ranked[k] for k in members}
            score: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
            for tkey in members:
                seen: set[tuple] = set()
                for pos, w in enumerate(fresh[tkey]):
                    rel = _relation(w, tkey)
                    if rel not in seen:
                        seen.add(rel)
                        score[rel][0] += 1
                        score[rel][1] -= pos
            # the pattern most layers can follow, then the one names prefer: block 1 guessed like block 0
            rel = max(score, key=lambda r: tuple(score[r]))
            for tkey in members:
                fits = [w for w in fresh[tkey] if _relation(w, tkey) == rel]
                pick = (fits or fresh[tkey])[0]
                taken.add(_way_sig(pick))
                self.settle(tkey, pick, "guess: equal values; chosen by names")
                names = list(dict.fromkeys(w.sources[0] for w in all_ways[tkey]))
                self.ambiguous[tkey] = names
                self.plausible[tkey] = list(dict.fromkeys(w.sources[0] for w in narrowed[tkey]))
                self.n_candidates[tkey] = len(names)


_EMA = re.compile(r"(^|[._])(model_ema|ema|shadow\w*)([._]|$)|(^|[._])ema_|_ema([._]|$)", re.IGNORECASE)


def _constant(t) -> bool:
    r"""Every element equal (a fresh norm or bias): its value says little about where it comes from."""
    flat = t.reshape(-1)
    return flat.numel() <= 1 or bool((flat == flat[0]).all())


_PARAM_LEAVES = ("weight", "bias")
_PARAM_LEAF = re.compile(rf"(.+)_({'|'.join(_PARAM_LEAVES)})")


def _param_stem(name: str) -> tuple[str, str]:
    r"""(module stem, leaf): ``a.qkv.bias`` and ``a.qkv_bias`` are both ``("a.qkv", "bias")``; a top-level
    ``in_proj_weight`` is ``("in_proj", "weight")``; other names split at the last dot."""
    head, _, leaf = name.rpartition(".")
    m = _PARAM_LEAF.fullmatch(leaf)
    if m:
        return (f"{head}.{m[1]}" if head else m[1]), m[2]
    return head, leaf


def _stem_names(stem: str, leaf: str) -> list[str]:
    r"""The source names a parameter ``leaf`` of module ``stem`` may have (``X.bias`` or ``X_bias``)."""
    if not stem:
        return [leaf]
    return [f"{stem}.{leaf}", f"{stem}_{leaf}"] if leaf in _PARAM_LEAVES else [f"{stem}.{leaf}"]


def _is_ema(name: str) -> bool:
    return _EMA.search(name) is not None


def _prefer_live(ways: list[_Found]) -> list[_Found]:
    r"""Ways without EMA/shadow copies among their sources, or all of them when every way uses one."""
    live = [w for w in ways if not any(_is_ema(s) for s in w.sources)]
    return live or ways


def _way_sig(way: _Found) -> str:
    if way.signature is None:
        way.signature = json.dumps([way.sources, way.op, way.args], sort_keys=True)
    return way.signature


def _dedupe(ways: list[_Found]) -> list[_Found]:
    seen: set[str] = set()
    out = []
    for w in ways:
        if _way_sig(w) not in seen:
            seen.add(_way_sig(w))
            out.append(w)
    return out


def _fine_skeleton(name: str) -> str:
    r"""The name with layer indices (whole dotted numbers) blanked; ``norm1`` stays ``norm1``."""
    return ".".join("#" if c.isdigit() else c for c in name.split("."))


def _step_family(op: str, args: dict[str, Any]) -> tuple:
    r"""What an op does, without the sizes that differ between layers of different width."""
    if op == "chunk":
        return ("chunk", args["dim"], args.get("index"), args.get("count"))
    if op in ("transpose", "permute"):
        return (op, tuple(args["dims"]))
    if op in ("swap_halves", "concat"):
        return (op, args["dim"])
    if op == "cast":
        return (op, args["dtype"])
    if op == "permute_rows":
        return (op, args["dim"], args["pattern"])
    return (op,)


def _op_family(op: str, args: dict[str, Any]) -> tuple:
    steps = [] if op == "identity" else [_step_family(op, args)]
    return tuple(steps + [_step_family(s["op"], s) for s in args.get("then", [])])


def _layer_key(name: str) -> tuple[str, tuple[str, ...]]:
    r"""A name without its first layer index: ``blocks.1.m.2.w`` -> ``("blocks.#.m.#.w", ("2",))``.

    Names with equal keys are the same tensor in different layers (the first index counts layers; later
    indices, such as a chunk number or a sub-block, say which tensor inside the layer it is).
    """
    numbers = [c for c in name.split(".") if c.isdigit()]
    return _fine_skeleton(name), tuple(numbers[1:])


def _source_key(name: str) -> tuple[str, str]:
    r"""A source name with every number blanked, and the numbers of the module holding it (``norm2``)."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else ""
    # a whole number there is a layer index, not part of the module's name
    return _skeleton(name), "" if module.isdigit() else "".join(_DIGITS.findall(module))


def _relation(way: Any, target: str) -> tuple:
    r"""The layer-independent form of a way: ``norm1 <- norm2`` in block 1 differs from ``norm1 <- norm1``
    in block 0, while ``resnets.1 <- block_2`` and ``resnets.0 <- block_1`` are alike."""
    return (tuple(_source_key(s) for s in way.sources), _layer_key(target), _op_family(way.op, way.args))


def _gaps(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """Ranges of ``[0, length)`` not covered by ``spans``."""
    out, pos = [], 0
    for start, stop in sorted(set(spans)):
        if start > pos:
            out.append((pos, start))
        pos = max(pos, stop)
    if pos < length:
        out.append((pos, length))
    return out


def infer_conversion_map(source: Any, target: Any, *, allow_ambiguous: bool = False) -> ConversionMap:
    r"""Explain every TARGET tensor from SOURCE tensors by value, and collapse the result into rules.

    Args:
        source: the research checkpoint: a path (anything :func:`paritykit.io.load_state_dict` reads), a
            ``dict[str, Tensor]`` or a module (its ``state_dict()``).
        target: the converted (diffusers) weights, in the same forms.
        allow_ambiguous: targets whose source is a guess (equal values, no structure to choose) do not set
            ``exit_code`` 1.
    Returns:
        A :class:`ConversionMap`: ``mapping`` (one entry per explained target, with op ``identity``, ``cast``,
        ``transpose``, ``permute``, ``reshape``, ``chunk``, ``concat``, ``swap_halves`` or ``permute_rows``,
        and its ``evidence``), ``rules``, ``unmapped_target``, ``unused_source``, ``ambiguous`` (every
        candidate listed), ``warnings``; ``exit_code`` 0 when every target is explained, none is guessed
        (or ``allow_ambiguous``) and nothing looks wrong.
    Raises:
        ParityKitError: a path that does not exist or cannot be read, or an input without tensors.
    """
    started = time.perf_counter()
    src, src_label = _as_state_dict(source, "SOURCE")
    tgt, tgt_label = _as_state_dict(target, "TARGET")
    m = _Matcher(src, tgt)
    m.fingerprint()
    m.match_whole()
    m.match_rounded()
    m.match_pieces()
    m.match_concat()
    m.choose()

    mapping = [
        MappingEntry(k, m.chosen[k].sources, m.chosen[k].op, m.chosen[k].args, m.evidence[k])
        for k in tgt
        if k in m.chosen
    ]
    used = {s for e in mapping for s in e.sources}
    ambiguous = [
        AmbiguousTarget(k, m.ambiguous[k], m.chosen[k].sources[0], m.n_candidates[k], m.plausible[k])
        for k in tgt
        if k in m.ambiguous
    ]
    return ConversionMap(
        mapping=mapping,
        rules=collapse_rules(mapping, src),
        unmapped_target=[k for k in tgt if k not in m.chosen],
        unused_source=[k for k in src if k not in used],
        ambiguous=ambiguous,
        n_source=len(src),
        n_target=len(tgt),
        source_label=src_label,
        target_label=tgt_label,
        seconds=time.perf_counter() - started,
        warnings=conversion_warnings(mapping),
        allow_ambiguous=allow_ambiguous,
    )


# --------------------------------------------------------------------------------------------------------
# warnings: exact mappings that still look wrong
# --------------------------------------------------------------------------------------------------------

_ROLE_ORDER = {"q": 0, "k": 1, "v": 2}
_ROLE_WORDS = {"q": "q", "query": "q", "k": "k", "key": "k", "v": "v", "value": "v"}


def _role(name: str) -> str | None:
    r"""``q``/``k``/``v`` when the module holding ``name`` is named for one (``to_q``, ``k_proj``, ``value``)."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else parts[-1]
    roles = {_ROLE_WORDS[w] for w in re.split(r"[^a-z]+", module.lower()) if w in _ROLE_WORDS}
    return roles.pop() if len(roles) == 1 else None


def conversion_warnings(mapping: list[MappingEntry]) -> list[ConversionWarning]:
    r"""Exact mappings that contradict the names or the other layers.

    * A fused tensor split so that the chunk order contradicts the target names (chunk 0 -> ``k_proj``,
      chunk 1 -> ``q_proj``); the usual orders are q, k, v and k, v. Concatenations are read the same way.
    * A tensor built differently in some layers than in the others (``norm1`` from ``norm2`` in one block,
      shift/scale swapped in one block only).
    """
    out: list[ConversionWarning] = []
    out += _fused_order_warnings(mapping)
    out += _layer_warnings(mapping)
    return out


def _fused_order_warnings(mapping: list[MappingEntry]) -> list[ConversionWarning]:
    out = []
    pieces: dict[tuple, list[tuple[int, str, MappingEntry]]] = defaultdict(list)
    for e in mapping:
        if e.op == "chunk" and len(e.sources) == 1 and _role(e.target):
            pieces[(e.sources[0], e.args["dim"])].append((e.args["start"], _role(e.target), e))
        if e.op == "concat":
            roles = [_role(s) for s in e.sources]
            known = [r for r in roles if r]
            if len(known) >= 2 and known != sorted(known, key=_ROLE_ORDER.get):
                order = ", ".join(f"{s} ({r})" for s, r in zip(e.sources, roles) if r)
                out.append(
                    ConversionWarning(
                        e.target, f"concatenated in the order {order}; the usual orders are q, k, v and k, v"
                    )
                )
    for (source, _dim), items in pieces.items():
        items.sort(key=lambda x: x[0])
        roles = [r for _, r, _ in items]
        if len(roles) < 2 or roles == sorted(roles, key=_ROLE_ORDER.get):
            continue
        order = ", ".join(
            f"{describe_op(e.op, e.args).split(' + ')[0]} -> {e.target.rsplit('.', 2)[-2]}"
            for _, _, e in items
        )
        for _, _, e in items:
            out.append(
                ConversionWarning(
                    e.target,
                    f"{source} is split as {order}: the chunk order contradicts the target names "
                    "(usual orders q, k, v and k, v); check the split",
                )
            )
    return out


def _layer_warnings(mapping: list[MappingEntry]) -> list[ConversionWarning]:
    groups: dict[tuple, list[MappingEntry]] = defaultdict(list)
    for e in mapping:
        groups[_layer_key(e.target)].append(e)
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        relations = [_relation(e, e.target) for e in members]
        counts: dict[tuple, int] = defaultdict(int)
        for r in relations:
            counts[r] += 1
        if len(counts) < 2:
            continue
        usual = max(counts, key=lambda r: (counts[r], -relations.index(r)))
        model = members[relations.index(usual)]
        for e, r in zip(members, relations):
            if r == usual:
                continue
            what = describe_op(e.op, e.args) or "a copy"
            usual_what = describe_op(model.op, model.args) or "a copy"
            swapped = ("swap_halves" in what) != ("swap_halves" in usual_what)
            hint = " (shift/scale order differs between blocks)" if swapped else ""
            out.append(
                ConversionWarning(
                    e.target,
                    f"built as {what} of {', '.join(e.sources)}, but {counts[usual]} other layer(s) build it "
                    f"as {usual_what} of their own tensor ({', '.join(model.sources)} -> {model.target}){hint}: "
                    "the mapping is inconsistent across layer indices",
                )
            )
    return out


# --------------------------------------------------------------------------------------------------------
# applying and emitting rules
# --------------------------------------------------------------------------------------------------------


def _rule_dicts(rules: ConversionMap | Iterable[ConversionRule | dict]) -> list[dict[str, Any]]:
    items = rules.rules if isinstance(rules, ConversionMap) else rules
    out = []
    for r in items:
        d = r.to_dict() if isinstance(r, ConversionRule) else dict(r)
        out.append({k: d[k] for k in ("pattern", "sources", "target", "op", "args")})
    return out


def apply_rules_to_state_dict(
    rules: ConversionMap | Iterable[ConversionRule | dict], state_dict: Mapping
) -> dict:
    r"""Apply inferred rules to a SOURCE state dict and return the TARGET state dict.

    Args:
        rules: a :class:`ConversionMap`, its ``rules``, or their dict form (``to_dict()["rules"]``).
        state_dict: source tensors by name.
    Returns:
        A new dict of target tensors; exactly what the module written by :func:`emit_rules` returns.
    """
    return _convert_with_rules(dict(state_dict), _rule_dicts(rules))


_MODULE_HEADER = '''\
r"""Weight conversion {source} -> {target}.

Generated by `paritykit weights map --emit-rules` (paritykit {version}) from tensor VALUES: every rule below
was confirmed exactly on the checkpoints it was inferred from. Edit freely; re-running the command with
--force overwrites this file.

{coverage}

Usage:
    from {module} import convert
    target_state_dict = convert(source_state_dict)

Each rule's "pattern" is matched (re.fullmatch) against source key names; "sources" are the tensors the op
reads (the first is the matched key), "target" is the new name; "op"/"args" say how the tensor is built.
"""

import torch

RULES = [
{rules}
]

'''

_MODULE_FOOTER = '''

def convert(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Return the converted state dict (new keys; source tensors are not modified)."""
    return _convert_with_rules(state_dict, RULES)
'''


def _py_str(value: str) -> str:
    if "\\" in value and '"' not in value and not value.endswith("\\") and value.isprintable():
        return 'r"' + value + '"'
    if value.isascii() and value.isprintable() and "\\" not in value:
        return json.dumps(value)
    return repr(value)


def _py_literal(value: Any) -> str:
    """Python source for rule data, spelt the way ``ruff format`` leaves it (double quotes)."""
    if isinstance(value, str):
        return _py_str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py_literal(k)}: {_py_literal(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_py_literal(v) for v in value) + "]"
    return repr(value)


def _format_rule(rule: dict[str, Any]) -> str:
    lines = ["    {"]
    lines += [
        f'        "{key}": {_py_literal(rule[key])},'
        for key in ("pattern", "sources", "target", "op", "args")
    ]
    lines.append("    },")
    return "\n".join(lines)


def render_rules_module(conversion_map: ConversionMap, module_name: str = "convert_weights") -> str:
    r"""The text of the Python module :func:`emit_rules` writes (``RULES`` + ``convert(state_dict)``)."""
    from paritykit._version import __version__

    rules = _rule_dicts(conversion_map)
    cm = conversion_map
    coverage = f"Builds {len(cm.mapping)} of the {cm.n_target} target tensors."
    if cm.unmapped_target:
        shown = cm.unmapped_target[:10]
        more = (
            f" (and {len(cm.unmapped_target) - len(shown)} more)"
            if len(cm.unmapped_target) > len(shown)
            else ""
        )
        coverage += " NOT built (no source explains their values): " + ", ".join(shown) + more + "."
    coverage = "\n".join(textwrap.wrap(coverage.replace('"', "'"), 110))
    header = _MODULE_HEADER.format(
        coverage=coverage,
        source=conversion_map.source_label.replace('"', "'"),
        target=conversion_map.target_label.replace('"', "'"),
        version=__version__,
        module=module_name,
        rules="\n".join(
            _guess_comment(r, conversion_map) + f"    # {r.text}\n" + _format_rule(d)
            for r, d in zip(conversion_map.rules, rules)
        ),
    )
    runtime = "\n\n\n".join(inspect.getsource(fn).rstrip() for fn in _RUNTIME)
    return header + "\n" + runtime + "\n" + _MODULE_FOOTER


def _guess_comment(rule: ConversionRule, cmap: ConversionMap) -> str:
    r"""A comment over a rule that builds targets whose source was guessed (equal values, chosen by names)."""
    guessed = {a.target: a for a in cmap.ambiguous}
    if not guessed:
        return ""
    regex = re.compile(rule.pattern)
    hits = [
        guessed[e.target]
        for e in cmap.mapping
        if e.target in guessed
        and regex.fullmatch(e.sources[0])
        and _expand(regex, e.sources[0], rule.target) == e.target
    ]
    if not hits:
        return ""
    n = max(len(a.plausible or a.candidates) for a in hits)
    return (
        f"    # GUESSED: {len(hits)} target(s) here hold values {n} sources share; the source was chosen by "
        "names.\n    # Check it against the reference code or a checkpoint with distinct values.\n"
    )


def emit_rules(conversion_map: ConversionMap, path: str | os.PathLike, force: bool = False) -> Path:
    r"""Write the rules as a small readable Python module with ``convert(state_dict) -> state_dict``.

    Args:
        conversion_map: the result of :func:`infer_conversion_map`.
        path: the ``.py`` file to write.
        force: overwrite an existing file (never done otherwise).
    Returns:
        The path written. The write is atomic (temporary file, then rename).
    Raises:
        ParityKitError: the file exists and ``force`` is false (the file is left untouched), or its folder
            does not exist.
    """
    path = Path(path)
    if conversion_map.ambiguous and not conversion_map.allow_ambiguous:
        raise ParityKitError(
            f"--emit-rules: {len(conversion_map.ambiguous)} target(s) are ambiguous (equal values, source guessed "
            "by names); run without --emit-rules to see them, or pass --allow-ambiguous to write the guesses"
        )
    if path.exists() and not force:
        raise ParityKitError(f"--emit-rules {str(path)!r} already exists; pass --force to overwrite it")
    if not path.parent.is_dir():
        raise ParityKitError(f"--emit-rules {str(path)!r}: folder {str(path.parent)!r} does not exist")
    text = render_rules_module(conversion_map, module_name=path.stem)
    atomic_write_text(path, text)
    conversion_map.emitted_rules = str(path)
    return path


# --------------------------------------------------------------------------------------------------------
# module alignment
# --------------------------------------------------------------------------------------------------------


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def match_modules(
    source: Any,
    target: Any,
    *,
    conversion_map: ConversionMap | None = None,
    include_ambiguous: bool = True,
) -> dict[str, list[str]]:
    r"""Align the modules of two differently named models through the values of their parameters.

    A target module corresponds to a source module when the target's parameters are built from that
    module's parameters (by any op :func:`infer_conversion_map` finds). The module of a parameter is its
    name without the last dotted component (``blocks.0.attn.qkv.weight`` -> ``blocks.0.attn.qkv``; a
    top-level parameter belongs to ``""``).

    The two sides must hold the same VALUES (the port loaded with the reference's converted weights, or two
    checkpoints of one training run); freshly initialised models with independent seeds share nothing.

    Fused <-> split layouts give 1:N alignments: a fused ``attn.qkv`` in SOURCE aligns with ``attn.to_q``,
    ``attn.to_k`` and ``attn.to_v`` in TARGET (each of those lists ``[attn.qkv]``); a target module built by
    concatenating several source modules lists all of them.

    Args:
        source: the reference's parameters: ``dict[str, Tensor]`` (``named_parameters()``/``state_dict()``
            form), a module (its ``state_dict()`` is used) or a checkpoint path.
        target: the port's parameters, same forms.
        conversion_map: reuse an already inferred map of the same two inputs instead of inferring again.
        include_ambiguous: also use parameters whose values several sources share (constant or
            freshly initialised tensors such as LayerNorm weights of ones); their source is the candidate
            whose name fits best. With ``False`` only value-unique evidence counts, which can leave such
            modules (norms) out.
    Returns:
        ``{target_module: [source_module, …]}`` in target parameter order; each list is ordered by how many
        parameters support it (most first). Target modules without explained parameters are absent.
    """
    cmap = conversion_map if conversion_map is not None else infer_conversion_map(source, target)
    ambiguous = {a.target for a in cmap.ambiguous}
    votes: dict[str, dict[str, int]] = {}
    for entry in cmap.mapping:
        if entry.target in ambiguous and not include_ambiguous:
            continue
        counts = votes.setdefault(_module_of(entry.target), {})
        for s in entry.sources:
            mod = _module_of(s)
            counts[mod] = counts.get(mod, 0) + 1
    return {t: sorted(c, key=lambda m: -c[m]) for t, c in votes.items()}
