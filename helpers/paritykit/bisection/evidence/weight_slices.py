r"""Weights evidence (``weights``): port parameters holding a different reference slice than their name
implies, found by conversion inference and verified by undoing it."""

from __future__ import annotations

import re
from typing import Any

from paritykit.base.report import format_number
from paritykit.bisection.evidence.culprit import (
    Culprit,
    patched_copy,
    verify_hint,
)
from paritykit.bisection.leaves import torch_equal
from paritykit.compare.diagnose import Hint
from paritykit.forensics.conversion.fingerprints import informative

# the role words of an attention projection, in the conventional order of a fused q, k, v
_ROLES = (
    ("q", "query", "to_q", "q_proj", "wq"),
    ("k", "key", "to_k", "k_proj", "wk"),
    ("v", "value", "to_v", "v_proj", "wv"),
)


def _role(name: str) -> int | None:
    r"""The role a parameter's name says (0 q, 1 k, 2 v: ``to_k.weight`` is 1), if it says one."""
    words = set(re.split(r"[._]", name.rpartition(".")[0] or name)) | set(name.split("."))
    hits = [i for i, names in enumerate(_ROLES) if words & set(names)]
    return hits[0] if len(hits) == 1 else None


def _implied_chunk(target: str, source: str, count: int) -> int | None:
    r"""The chunk of fused ``source`` that split ``target`` should hold: its role's place in the order the
    source's name spells (``to_qk``: q, k; ``wkv``: k, v), else in q, k, v for three chunks. ``None`` when the
    name does not say: two chunks are k, v in one model and q, k in another."""
    role = _role(target)
    if role is None:
        return None
    order = next(
        (
            found[1]
            for word in re.split(r"[._]", source.lower())
            if (found := re.fullmatch(r"w?([qkv]{2,3})", word)) and len(set(found[1])) == len(found[1])
        ),
        "qkv" if count == 3 else None,
    )
    if order is None or len(order) != count or "qkv"[role] not in order:
        return None
    return order.index("qkv"[role])


def _state(module: Any) -> dict[str, Any]:
    return {k: v for k, v in module.state_dict().items() if v.is_floating_point() and v.ndim > 0}


def weights(c: Culprit) -> list[Hint]:
    r"""``weights``: port parameters built from another reference slice than their name implies.

    The two modules' state dicts go through
    :func:`paritykit.forensics.conversion.matching.infer_conversion_map` (the value matching
    of ``paritykit weights map``); a split parameter whose chunk index differs from the one its role word
    implies is a conversion bug. The fix loads each from its implied slice, through the same rule runtime.
    """
    if c.reference is None or c.port is None:
        return []
    from paritykit.forensics.conversion.emit import apply_rules_to_state_dict
    from paritykit.forensics.conversion.matching import infer_conversion_map

    # keyed by their names in the whole models, as `paritykit weights map` sees them (and names them)
    ref_prefix, port_prefix = _prefix(c.reference_name), _prefix(c.port_name)
    ref_sd = {ref_prefix + k: v for k, v in _state(c.reference).items()}
    port_sd = {port_prefix + k: v for k, v in _state(c.port).items()}
    if not ref_sd or not port_sd:
        return []
    cmap = infer_conversion_map(ref_sd, port_sd)
    ambiguous = {a.target for a in cmap.ambiguous}
    entries = [e for e in cmap.mapping if e.target not in ambiguous]
    c.layouts = [
        f"{e.target} ({e.describe()})" for e in entries if any(st["op"] in _LAYOUT_OPS for st in _steps(e))
    ]
    rules, lines = [], []
    for entry in entries:
        found = _misassigned(entry, ref_sd)
        if found is not None:
            rules.append(found[0])
            lines.append(found[1])
    if rules:
        message = "conversion bug: " + "; ".join(lines)
    else:
        # a layout op (transpose, reordered rows) the names do not call for is only a slip when undoing it
        # makes the module match, so these come back only verified
        rules = [r for r in (_without_layout(e, ref_sd, port_sd) for e in entries) if r is not None]
        if not rules:
            return _rounded(c, entries, ref_sd, port_sd, port_prefix) + _unmatched(c, cmap, ref_sd, port_sd)
        message = "conversion slip: " + "; ".join(
            f"port {r['target']} is reference {r['sources'][0]} after {r['layout']}" for r in rules
        )
    fixed = apply_rules_to_state_dict(rules, {k: ref_sd[k] for k in {r["sources"][0] for r in rules}})
    hint = Hint(
        "weights",
        message + " (evidence: parameter values matched as in `paritykit weights map`)",
        {"rules": [{k: v for k, v in r.items() if k != "pattern"} for r in rules]},
        score=0.95,
        fix="; ".join(f"load {r['target']} from {r['sources'][0]}" + _describe(r) for r in rules),
    )
    patch = {k.removeprefix(port_prefix): v.to(port_sd[k].dtype) for k, v in fixed.items()}
    verify_hint(c, lambda: patched_copy(c.port, patch), hint)
    if "layout" in rules[0] and not hint.verified:
        return _unmatched(c, cmap, ref_sd, port_sd)
    return [hint]


_LAYOUT_OPS = ("transpose", "permute", "swap_halves", "permute_rows")
_NARROW = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _rounded(
    c: Culprit, entries: list[Any], ref_sd: dict[str, Any], port_sd: dict[str, Any], port_prefix: str
) -> list[Hint]:
    r"""Port parameters that are their reference tensor rounded through a narrower float type and widened
    again (round 32, AudioLDM: a converter ending in ``.to(torch.float16)`` whose tensors were loaded into
    a float32 model): every element is the reference's rounded, which no layout op explains and which the
    parameter's own dtype hides. Verified by loading the reference's exact values."""
    rounded: dict[str, str] = {}
    for entry in entries:
        source = ref_sd.get(entry.sources[0]) if entry.sources else None
        if source is None or not all(st["op"] == "cast" for st in _steps(entry)):
            continue  # a cast among layout ops: the relation is said by weights map, not replayed here
        wide = min(_NARROW.get(str(source.dtype).removeprefix("torch."), 0), _width(port_sd[entry.target]))
        narrow = [
            st["dtype"] for st in _steps(entry) if st["op"] == "cast" and _NARROW.get(st["dtype"], 9) < wide
        ]
        port_value = port_sd[entry.target]
        if narrow and not torch_equal(port_value, source.to(port_value.dtype)):
            rounded[entry.target] = narrow[0]
    if not rounded:
        return []
    kinds = sorted(set(rounded.values()))
    names = list(rounded)
    hint = Hint(
        "weights",
        f"port parameters {', '.join(names[:6])}{f' and {len(names) - 6} more' if len(names) > 6 else ''}"
        f" hold the reference's values rounded to {' or '.join(kinds)}, every element (the reference's and"
        " the port's are wider): a conversion that passed them through that dtype"
        + _model_wide(c, kinds[0])
        + " (evidence: parameter values matched as in `paritykit weights map`)",
        {"rounded": rounded},
        score=0.9,
        fix=f"load {', '.join(names[:3])}{' …' if len(names) > 3 else ''} without the cast to {kinds[0]}",
    )
    sources = {e.target: e.sources[0] for e in entries}
    patch = {
        k.removeprefix(port_prefix): ref_sd[sources[k]].to(port_sd[k].dtype).reshape(port_sd[k].shape)
        for k in rounded
    }
    verify_hint(c, lambda: patched_copy(c.port, patch), hint)
    return [hint]


def _buffers(c: Culprit, names: list[str]) -> list[str]:
    r"""Those of ``names`` (whole-model names) that are buffers of the culprit's port module, not
    parameters."""
    prefix = _prefix(c.port_name)
    held = {prefix + k for k, _ in c.port.named_buffers()} if c.port is not None else set()
    return [k for k in names if k in held]


def _model_wide(c: Culprit, dtype_name: str) -> str:
    r"""How many of each whole model's wider floating-point parameters hold values ``dtype_name`` represents
    exactly, every element: a rounding in the conversion shows on (nearly) every port parameter and on
    (nearly) none of a reference trained in the wider type."""
    import torch

    dtype = getattr(torch, dtype_name)
    counts = []
    for model in (c.port_model, c.reference_model):
        if model is None:
            return ""
        wide = [p for p in model.parameters() if p.is_floating_point() and _width(p) > _NARROW[dtype_name]]
        held = sum(bool(torch.equal(p.detach(), p.detach().to(dtype).to(p.dtype))) for p in wide)
        counts.append((held, len(wide)))
    (port_held, port_all), (ref_held, ref_all) = counts
    return (
        f"; in the whole models {port_held} of the port's {port_all} wider parameters hold only values"
        f" {dtype_name} represents, {ref_held} of the reference's {ref_all}"
    )


def _width(t: Any) -> int:
    return _NARROW.get(str(t.dtype).removeprefix("torch."), 0)


def _describe(rule: dict[str, Any]) -> str:
    from paritykit.forensics.conversion.results import describe_op

    text = describe_op(rule["op"], rule["args"])
    return f" ({text})" if text else ""


def _rule(source: str, target: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    op, args = (
        ("identity", {}) if not steps else (steps[0]["op"], {k: v for k, v in steps[0].items() if k != "op"})
    )
    if len(steps) > 1:
        args["then"] = steps[1:]
    return {"pattern": re.escape(source), "sources": [source], "target": target, "op": op, "args": args}


def _steps(entry: Any) -> list[dict[str, Any]]:
    main = {"op": entry.op, **{k: v for k, v in entry.args.items() if k != "then"}}
    return ([main] if entry.op != "identity" else []) + list(entry.args.get("then", []))


def _misassigned(entry: Any, ref_sd: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    r"""The corrected rule and a sentence when a port parameter holds another role's tensor than its name
    says: a chunk of a fused projection other than the one its role implies, or a whole tensor of another role
    (``to_k`` loaded from ``v_proj``)."""
    if len(entry.sources) != 1:
        return None
    source = entry.sources[0]
    steps = _steps(entry)
    if entry.op == "chunk" and "count" in entry.args:
        count, index = entry.args["count"], entry.args["index"]
        implied = _implied_chunk(entry.target, source, count)
        if implied is None or implied == index:
            return None
        size = entry.args["stop"] - entry.args["start"]
        steps[0] = dict(steps[0], index=implied, start=implied * size, stop=(implied + 1) * size)
        return (
            _rule(source, entry.target, steps),
            (
                f"port {entry.target} holds chunk {index}/{count} of reference {source} "
                f"(its name implies chunk {implied}/{count})"
            ),
        )
    want, have = _role(entry.target), _role(source)
    if entry.op == "chunk" or want is None or have is None or want == have:
        return None
    leaf = source.rsplit(".", 1)[-1]
    others = [
        k
        for k in ref_sd
        if k.rsplit(".", 1)[-1] == leaf
        and _role(k) == want
        and k.count(".") == source.count(".")
        and _same_but_role(k, source)
    ]
    if len(others) != 1:
        return None
    return (
        _rule(others[0], entry.target, steps),
        f"port {entry.target} holds reference {source} (its name implies {others[0]})",
    )


def _same_but_role(a: str, b: str) -> bool:
    r"""Whether two names differ only in their role segment (``attn.k_proj.weight`` /
    ``attn.v_proj.weight``)."""
    diff = [(x, y) for x, y in zip(a.split("."), b.split(".")) if x != y]
    return len(diff) == 1


def _without_layout(entry: Any, ref_sd: dict[str, Any], port_sd: dict[str, Any]) -> dict[str, Any] | None:
    r"""The rule for ``entry`` with its layout steps (transpose, row reorders) dropped, when the shapes
    allow."""
    if len(entry.sources) != 1:
        return None
    steps = _steps(entry)
    kept = [s for s in steps if s["op"] not in _LAYOUT_OPS]
    if len(kept) == len(steps):
        return None
    rule = _rule(entry.sources[0], entry.target, kept)
    rule["layout"] = " + ".join(_layout_words(s) for s in steps if s["op"] in _LAYOUT_OPS)
    from paritykit.forensics.conversion.emit import apply_rules_to_state_dict

    # the shape must come out right without the layout step (a transposed square matrix, a reordered row set)
    try:
        out = apply_rules_to_state_dict([rule], {entry.sources[0]: ref_sd[entry.sources[0]]})
    except Exception:
        return None
    return rule if tuple(out[entry.target].shape) == tuple(port_sd[entry.target].shape) else None


def _layout_words(step: dict[str, Any]) -> str:
    r"""A layout step as read: a reorder along dim 1 of a matrix is of its columns (round 35, lerobot: the
    weight's columns permuted was said as "permute_rows (dim 1)")."""
    if step["op"] == "permute_rows" and step.get("dim") == 1:
        return "its columns (dim 1) reordered"
    if step["op"] == "permute_rows":
        return f"its rows (dim {step.get('dim', 0)}) reordered"
    return step["op"] + (f" (dim {step['dim']})" if "dim" in step else "")


def _prefix(name: str) -> str:
    return name + "." if name else ""


# the layout ops the value matcher tries (``paritykit weights map``): what "equals no …" was checked against
_OPS_TRIED = (
    "one contiguous slice, a transpose, reshape or cast, swapped halves, all rows permuted, or a"
    " concatenation of whole tensors; a gather of scattered rows, or slices of several tensors joined, is"
    " not tried"
)


def _constant_said(c: Culprit, name: str) -> str:
    r"""A port parameter's name, with its value where every element holds the same one (``(all 1)``: a
    norm's identity fill, which matches no reference tensor because the reference has no such norm)."""
    from paritykit.forensics.conversion.fingerprints import all_equal

    # ``name`` is the whole model's (as weights map names it); the culprit's own parameters are relative
    own = name.removeprefix(_prefix(c.port_name))
    tensor = dict(c.port.named_parameters()).get(own) if c.port is not None else None
    if tensor is None or tensor.numel() < 2 or not all_equal(tensor.detach()):
        return name
    return f"{name} (all {format_number(float(tensor.detach().reshape(-1)[0]))})"


def _unmatched(c: Culprit, cmap: Any, ref_sd: dict[str, Any], port_sd: dict[str, Any]) -> list[Hint]:
    r"""Port parameters that equal no reference tensor (nor a slice, transpose or cast of one), and reference
    parameters with information (not constant) that no port parameter uses: dropped in the conversion."""
    dropped = [k for k in cmap.unused_source if informative(ref_sd[k])]
    if not cmap.unmapped_target and not dropped:
        return []
    parts = []
    offsets = _offsets(port_sd, cmap.unmapped_target, {k: ref_sd[k] for k in dropped})
    left = [k for k in cmap.unmapped_target if k not in offsets]
    used = {r for r, _ in offsets.values()}
    exps = _exp_affine(port_sd, left, {k: ref_sd[k] for k in dropped if k not in used})
    used |= {r for r, _, _ in exps.values()}
    left = [k for k in left if k not in exps]
    scaled = _axis_scaled(port_sd, left, {k: ref_sd[k] for k in dropped if k not in used})
    used |= _wholly_used([r for r, _ in scaled.values()])
    left = [k for k in left if k not in scaled]
    gathered = _head_gathered(port_sd, left, {k: ref_sd[k] for k in dropped if k not in used})
    used |= _wholly_used([r for r, _ in gathered.values()])
    left = [k for k in left if k not in gathered]
    blocks = _block_gathered(port_sd, left, {k: ref_sd[k] for k in dropped if k not in used})
    spare = _blocks_unused(blocks)
    used |= {r for r, *_ in blocks.values()} - set(spare)
    unmapped = [k for k in left if k not in blocks]
    dropped = [k for k in dropped if k not in used]
    built = _buffers(c, unmapped)
    unmapped = [k for k in unmapped if k not in built]
    if unmapped:
        names = ", ".join(_constant_said(c, name) for name in unmapped[:6])
        parts.append(
            f"port parameters {names} equal no reference tensor of {c.reference_path()}, nor a layout op of"
            f" one ({_OPS_TRIED})"
        )
    if built:
        parts.append(
            f"port buffers {', '.join(built[:6])} (tables the port's modules hold, not parameters) equal no"
            f" reference tensor of {c.reference_path()}: a lead that the port's module computes a part the"
            " reference's does not (a setting that adds it, such as a positional embedding), or builds it"
            " otherwise"
        )
    elsewhere = _held_elsewhere(c, {k: ref_sd[k] for k in dropped})
    if spare:
        parts.append(
            "; ".join(
                f"reference {r} row blocks {', '.join(map(str, left_over))} of {count}: in no port"
                " parameter of the culprit"
                for r, (count, left_over) in spare.items()
            )
        )
    dropped = [k for k in dropped if k not in spare]
    if dropped:
        names = ", ".join(dropped[:6])
        held = {_prefix(c.reference_name) + k for k, _ in c.reference.named_buffers()}
        kind = "buffers" if all(k in held for k in dropped[:6]) else "parameters"
        parts.append(
            f"reference {kind} {names} (not constant): no port parameter of the culprit equals one of"
            f" them or a layout op of one ({_OPS_TRIED})"
        )
    if elsewhere:
        parts.append(
            "the port holds them elsewhere, value for value: "
            + ", ".join(f"{r} in port {p}" for r, p in list(elsewhere.items())[:6])
        )
    # explained by their values: said after what nothing explains
    explained = (
        (
            [f"{p} = reference {r} {d:+g}" for p, (r, d) in offsets.items()],
            "every element: a constant added in the conversion, as for a norm stored as γ on one side and"
            " 1 + γ on the other",
        ),
        (
            [f"{p} = exp({a:g} · reference {r} {b:+g})" for p, (r, a, b) in exps.items()],
            "every element: a log-parameterised value the conversion exponentiates",
        ),
        (
            [f"{p} = reference {r} with {how}" for p, (r, how) in scaled.items()],
            "a norm or gain folded in by the conversion, or a weight normalised",
        ),
        (
            [f"{p} = reference {r}" for p, (r, _) in gathered.items()],
            "a fused projection laid out head by head, split by the conversion",
        ),
        (
            [f"{p} = reference {_block_words(*found)}" for p, found in blocks.items()],
            "a fused projection's blocks gathered by the conversion",
        ),
    )
    parts += [
        f"port parameters {', '.join(said[:6])} ({why}; whether each forward reads them so is not compared by"
        " this)"
        for said, why in explained
        if said
    ]
    if not parts:
        return []
    return [
        Hint(
            "weights",
            "; ".join(parts) + " (evidence: parameter values matched as in `paritykit weights map`)",
            {
                "offsets": {p: [r, d] for p, (r, d) in offsets.items()},
                "exponentiated": {p: [r, a, b] for p, (r, a, b) in exps.items()},
                "scaled": {p: [r, how] for p, (r, how) in scaled.items()},
                "gathered": {p: r for p, (r, _) in gathered.items()},
                "blocks": {
                    p: [r, order, count, {str(k): v for k, v in added.items()}]
                    for p, (r, order, count, added) in blocks.items()
                },
                "unmatched_port": unmapped,
                "unmatched_buffers": built,
                "unused_reference": dropped,
                "elsewhere": elsewhere,
            },
            # tensors a relation explains, every one, are no sign of a slip: ranked after the other hints
            score=0.85 if unmapped or dropped or elsewhere else 0.6 if built else 0.3,
        )
    ]


def _one_relation(
    port_sd: dict[str, Any],
    unmapped: list[str],
    candidates: dict[str, Any],
    relation: Any,
    chunks: bool = False,
) -> dict[str, tuple]:
    r"""The port parameters among ``unmapped`` that ``relation(port, reference)`` (its measured values, or
    ``None``) ties to exactly one of ``candidates``: port name -> (reference name, *values). Each reference
    tensor explains one port parameter at most. With ``chunks``, a reference tensor whose dim 0 is 2 to 4
    times the port's is tried chunk by chunk too (a fused q/k/v split by the conversion), each chunk
    explaining one port parameter: the values then end with ``(chunk index, chunk count)``."""
    found: dict[str, tuple] = {}
    taken: set[tuple[str, int]] = set()
    for name in unmapped:
        p = port_sd.get(name)
        if p is None or not p.is_floating_point() or p.numel() < 2:
            continue
        pd = p.detach().cpu().double()
        hits = []
        for ref_name, r in candidates.items():
            if not r.is_floating_point():
                continue
            for index, count, heads, part in _parts(r, p, chunks):
                if (ref_name, index) in taken:
                    continue
                got = relation(pd, part.detach().cpu().double().reshape(p.shape))
                if got is not None:
                    chunk = (index, count, heads) if count > 1 else ()
                    hits.append(((ref_name, index), (ref_name, *got, *chunk)))
                    break  # one layout of this tensor explains it
        if len(hits) == 1:
            key, found[name] = hits[0]
            taken.add(key)
    return found


def _parts(r: Any, p: Any, chunks: bool) -> list[tuple[int, int, int, Any]]:
    r"""``(index, count, heads, tensor)`` of ``r`` to compare with ``p``: ``r`` itself when it has ``p``'s
    shape (a 1x1 conv's (out, in, 1) weight against a Linear's (out, in) is one shape); with ``chunks``, each
    of its 2 to 4 equal chunks along dim 0 that has ``p``'s shape, taken whole (``heads`` 1) or head by head
    (rows laid out ``[head][chunk][row]``, guided diffusion's legacy q/k/v: ``heads`` H)."""
    if _squeezed(r) == _squeezed(p):
        return [(0, 1, 1, r)]
    if not chunks or r.dim() == 0 or p.dim() == 0 or r.shape[0] % p.shape[0]:
        return []
    count = r.shape[0] // p.shape[0]
    if not 2 <= count <= 4 or _squeezed(r[: p.shape[0]]) != _squeezed(p):
        return []
    rows, rest = p.shape[0], tuple(r.shape[1:])
    parts = [(i, count, 1, part) for i, part in enumerate(r.chunk(count, 0))]
    for heads in (h for h in range(2, min(rows, 64) + 1) if rows % h == 0):
        grouped = r.reshape(heads, count, rows // heads, *rest)
        parts += [(i, count, heads, grouped[:, i].reshape(rows, *rest)) for i in range(count)]
    return parts


def _part_words(ref_name: str, shape0: int, index: int, count: int, heads: int) -> str:
    rows = shape0 // count
    if heads == 1:
        return f"{ref_name} rows {index * rows}:{(index + 1) * rows} (chunk {index} of {count})"
    return f"{ref_name} rows of chunk {index} of {count} in each of {heads} heads"


_CHUNK = re.compile(r"^(.*?) rows .*?chunk (\d+) of (\d+)")


def _wholly_used(said: list[str]) -> set[str]:
    r"""The reference tensors that ``said`` (names, or :func:`_part_words` of their chunks) explain whole: a
    fused tensor only when each of its chunks is explained."""
    whole: set[str] = set()
    chunks: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    for text in said:
        m = _CHUNK.match(text)
        if m is None:
            whole.add(text)
            continue
        chunks.setdefault(m.group(1), set()).add(int(m.group(2)))
        counts[m.group(1)] = int(m.group(3))
    whole |= {name for name, got in chunks.items() if len(got) == counts[name]}
    return whole


def _offsets(port_sd: dict[str, Any], unmapped: list[str], candidates: dict[str, Any]) -> dict[str, tuple]:
    r"""Port parameters that are one reference tensor plus one constant, every element (a norm's γ stored as
    1 + γ on one side): port name -> (reference name, the constant)."""
    return _one_relation(port_sd, unmapped, candidates, _offset)


def _offset(p: Any, r: Any) -> tuple[float] | None:
    d = p - r
    step = float(d.reshape(-1)[0])
    scale = max(1.0, float(r.abs().max()), abs(step))
    return (round(step, 6),) if step != 0 and float((d - step).abs().max()) <= 1e-6 * scale else None


def _exp_affine(port_sd: dict[str, Any], unmapped: list[str], candidates: dict[str, Any]) -> dict[str, tuple]:
    r"""Port parameters that are ``exp(a · r + b)`` of one reference tensor ``r``, every element (a scale the
    research keeps as its log): port name -> (reference name, a, b). The reference tensor must not be
    constant, so ``a`` is measured."""
    return _one_relation(port_sd, unmapped, candidates, _exp_fit)


def _exp_fit(p: Any, r: Any) -> tuple[float, float] | None:
    if not bool((p > 0).all()):
        return None
    y, x = p.log().reshape(-1), r.reshape(-1)
    spread = x - x.mean()
    if float(spread.abs().max()) == 0:
        return None
    a = float((spread * (y - y.mean())).sum() / (spread * spread).sum())
    b = float(y.mean() - a * x.mean())
    exact = float((a * x + b - y).abs().max()) <= 1e-5 * max(1.0, float(y.abs().max()))
    return (round(a, 6), round(b, 6)) if a != 0 and exact else None


def _axis_scaled(
    port_sd: dict[str, Any], unmapped: list[str], candidates: dict[str, Any]
) -> dict[str, tuple]:
    r"""Port parameters that are one reference tensor with each row (dim 0) or each column (dim 1) multiplied
    by its own factor, not all 1 (a gain folded into a projection, a weight-normalised layer), or, for a 1-D
    tensor, every element by one (a norm's gain folded with a constant): port name -> (reference name, which
    axis and the factors' range). Elements where the reference is 0 must be 0."""
    found = _one_relation(
        port_sd,
        unmapped,
        candidates,
        # a 1-D tensor (a norm's gain) only scaled as a whole: per element, any two tensors are "scaled"
        lambda p, r: (
            (how,) if (how := _factors(p, r)) and (p.dim() >= 2 or how.startswith("every")) else None
        ),
        chunks=True,
    )
    return _named_parts(found, candidates)


def _named_parts(found: dict[str, tuple], candidates: dict[str, Any]) -> dict[str, tuple]:
    r"""``found`` with each chunk's reference name said as :func:`_part_words`."""
    out = {}
    for name, (ref_name, how, *chunk) in found.items():
        if chunk:
            ref_name = _part_words(ref_name, candidates[ref_name].shape[0], *chunk)
        out[name] = (ref_name, how)
    return out


def _head_gathered(
    port_sd: dict[str, Any], unmapped: list[str], candidates: dict[str, Any]
) -> dict[str, tuple]:
    r"""Port parameters that equal a chunk of a fused reference tensor gathered head by head (rows laid out
    ``[head][q, k, v][row]``, guided diffusion's legacy attention): port name -> (reference words, "")."""
    import torch

    found = _one_relation(
        port_sd,
        unmapped,
        candidates,
        lambda p, r: ("",) if torch.equal(p, r) else None,
        chunks=True,
    )
    return _named_parts({k: v for k, v in found.items() if len(v) > 2 and v[-1] > 1}, candidates)


# a gather of row blocks is looked for in reference tensors of at most this many blocks
MAX_BLOCKS = 64


def _block_gathered(
    port_sd: dict[str, Any], unmapped: list[str], candidates: dict[str, Any]
) -> dict[str, tuple]:
    r"""Port parameters that are equal-sized row blocks of one fused reference tensor, joined in some order
    (a 12-chunk modulation split into two AdaLN projections): port name -> (reference name, the block
    indices in the port's order, the reference's block count, {block: constant added}). Each port block must
    equal exactly one reference block, every element, or for a 1-D tensor that block plus one constant (a
    scale stored as 1 + γ on one side). The coarsest blocks that explain it are said."""
    found: dict[str, tuple] = {}
    for name in unmapped:
        p = port_sd.get(name)
        if p is None or not p.is_floating_point() or p.dim() == 0 or p.shape[0] < 2:
            continue
        ours = p.detach().cpu().double()  # read once, against every candidate
        hits = [
            (ref_name, *got)
            for ref_name, r in candidates.items()
            if r.is_floating_point() and r.dim() == p.dim() and r.shape[1:] == p.shape[1:]
            if (got := _blocks_of(ours, r.detach().cpu().double())) is not None
        ]
        if len(hits) == 1:
            found[name] = hits[0]
    return found


def _blocks_of(p: Any, r: Any) -> tuple[list[int], int, dict[int, float]] | None:
    import math

    n, m = p.shape[0], r.shape[0]
    for size in sorted((b for b in range(1, math.gcd(n, m) + 1) if n % b == 0 and m % b == 0), reverse=True):
        if m // size > MAX_BLOCKS or (size == n == m):
            continue
        ours, theirs = p.split(size), r.split(size)
        order, added = [], {}
        for block in ours:
            matches = [
                (j, d) for j, other in enumerate(theirs) if (d := _same_block(block, other)) is not None
            ]
            if len(matches) != 1:
                break
            j, d = matches[0]
            order.append(j)
            if d:
                added[j] = d
        else:
            # consecutive blocks as they are: one contiguous slice, which the value matcher already tries
            if added or order != list(range(order[0], order[0] + len(order))):
                return order, len(theirs), added
    return None


def _same_block(a: Any, b: Any) -> float | None:
    r"""0 where ``a`` equals ``b``; the constant where a 1-D ``a`` is ``b`` plus one; ``None`` otherwise."""
    import torch

    if torch.equal(a, b):
        return 0.0
    if a.dim() != 1 or a.numel() < 2:
        return None
    got = _offset(a, b)
    return got[0] if got else None


def _blocks_unused(blocks: dict[str, tuple]) -> dict[str, tuple[int, list[int]]]:
    r"""Reference tensors some of whose blocks no port parameter took: name -> (block count, those blocks)."""
    taken: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    for r, order, count, _ in blocks.values():
        taken.setdefault(r, set()).update(order)
        counts[r] = count
    return {
        r: (counts[r], sorted(set(range(counts[r])) - got))
        for r, got in taken.items()
        if len(got) < counts[r]
    }


def _block_words(ref_name: str, order: list[int], count: int, added: dict[int, float]) -> str:
    text = f"{ref_name} row blocks {', '.join(map(str, order))} of {count}, in that order"
    by_value: dict[float, list[str]] = {}
    for j, d in added.items():
        by_value.setdefault(d, []).append(str(j))
    if by_value:
        text += (
            " (" + "; ".join(f"{d:+g} added to blocks {', '.join(js)}" for d, js in by_value.items()) + ")"
        )
    return text


def _squeezed(t: Any) -> tuple[int, ...]:
    return tuple(d for d in t.shape if d != 1)


def _factors(p: Any, r: Any) -> str:
    r"""``"each row scaled (factors a to b)"`` (or column) where ``p`` is ``r`` with one factor per index of
    dim 0 (or 1), every element, within 1e-6; ``""`` otherwise."""
    import torch

    zero = r == 0
    if not bool((p[zero] == 0).all()) or bool(zero.all()) or not bool(p.any()):
        return ""  # an all-zero port tensor is a constant (said so), no scaling of anything
    ratio = torch.where(zero, torch.nan, p / torch.where(zero, 1.0, r))
    for dim, word in ((0, "row"), (1, "column")):
        others = [d for d in range(p.dim()) if d != dim]
        factor = ratio.nanmean(dim=others, keepdim=True)
        if bool(factor.isnan().any()):
            continue
        close = (p - factor * r).abs() <= 1e-6 * max(1.0, float(p.abs().max()))
        spread = float(factor.max() - factor.min())
        if bool(close.all()) and (spread > 1e-6 or abs(float(factor.mean()) - 1) > 1e-6):
            low, high = float(factor.min()), float(factor.max())
            if spread <= 1e-6 * max(1.0, abs(high)):
                return f"every element scaled by {high:.4g}"
            return f"each {word} scaled (factors {low:.4g} to {high:.4g})"
    return ""


def _held_elsewhere(c: Culprit, tensors: dict[str, Any]) -> dict[str, str]:
    r"""Reference tensors the culprit's port lacks that another port module holds exactly (a conversion that
    put them in another layer): reference name -> port name."""
    import torch

    if c.port_model is None or not tensors:
        return {}
    inside = _prefix(c.port_name)
    found = {}
    for name, value in c.port_model.state_dict().items():
        if name.startswith(inside) or not value.is_floating_point():
            continue
        for ref_name, ref_value in tensors.items():
            if ref_name in found or value.shape != ref_value.shape:
                continue
            if torch.equal(value.detach().cpu().to(ref_value.dtype), ref_value.detach().cpu()):
                found[ref_name] = name
    return found
