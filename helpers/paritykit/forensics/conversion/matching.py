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

The same rule runtime (``convert_with_rules`` and the helpers above it) is used by
:func:`apply_rules_to_state_dict` and copied verbatim into the module :func:`emit_rules` writes, so the
library and the generated code cannot disagree.

:func:`match_modules` turns the mapping into a module alignment for bisecting two differently named models.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from paritykit.forensics.conversion.checks import conversion_warnings
from paritykit.forensics.conversion.fingerprints import (
    all_equal,
    castable,
    equal_values,
    even_splits,
    multiset_hashes,
    multiset_rows,
    piece_gaps,
    position_hash,
    resolve_candidates,
)
from paritykit.forensics.conversion.loading import (
    PAGES,
    as_state_dict,
    dtype_name,
    in_threads,
    without_cycle_collection,
)
from paritykit.forensics.conversion.names import (
    PARAM_LEAVES,
    NameScorer,
    is_ema,
    layer_key,
    name_ancestors,
    name_relation,
    param_stem,
    stem_names,
)
from paritykit.forensics.conversion.results import (
    AmbiguousTarget,
    ConversionMap,
    MappingEntry,
)
from paritykit.forensics.conversion.rules import collapse_rules
from paritykit.forensics.conversion.runtime import (
    MAX_OFFSET_TARGETS,
    MAX_PIECES,
    apply_step,
)

# ------------------------------------------------------------------------------------------------------------
# inference
# ------------------------------------------------------------------------------------------------------------


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
        self.scorer = NameScorer()
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
        # ``in_proj_weight`` / ``in_proj_bias`` are one module's parameters as much as ``qkv.weight`` /
        # ``qkv.bias``
        self.by_stem: dict[str, list[str]] = defaultdict(list)
        self._const_pieces: dict[tuple, list[_Found]] = {}
        # (side, key, dtype) -> each row's hash (dim 0), read with the fingerprints: pieces along dim 0 are
        # hashed from them without reading the tensor again (multiset_rows)
        self.rows: dict[tuple, Any] = {}
        for key in target:
            self.by_module[key.rsplit(".", 1)[0] if "." in key else ""].append(key)
            self.by_stem[param_stem(key)[0]].append(key)
            parts = key.split(".")
            for n in range(1, len(parts)):
                self.scorer.target_children[".".join(parts[:n])].add(parts[n])

    # -- helpers ------------------------------------------------------------------------------------------
    def cast(self, key: str, dtype):
        t = self.source[key]
        if t.dtype == dtype:
            return t
        cached = self._cast_cache.get((key, dtype))
        if cached is None:  # keep one: memory stays bounded (and a thread's cast is its own)
            cached = t.to(dtype)
            self._cast_cache = {(key, dtype): cached}
        return cached

    def _resolve_pair(self, pair: tuple[str, str]) -> list[dict[str, Any]] | None:
        r""":func:`resolve_candidates` of one (target, source) pair; safe on a thread (no cache touched)."""
        tkey, skey = pair
        t, s = self.target[tkey], self.source[skey]
        PAGES.read(2 * t.nbytes)
        return resolve_candidates(s if s.dtype == t.dtype else s.to(t.dtype), t)

    def position_class(self, side: str, key: str, dtype) -> tuple:
        tensors = self.source if side == "s" else self.target
        if (side, key, dtype) not in self._poshash:
            t = self.cast(key, dtype) if side == "s" else tensors[key]
            self._poshash[(side, key, dtype)] = position_hash(t)
        return (tuple(tensors[key].shape), tensors[key].dtype, self._poshash[(side, key, dtype)])

    def piece_hashes(self, side: str, key: str, t, dtype, splits: list[tuple[int, int]]) -> dict:
        r"""The hashes of ``t``'s equal pieces for each ``(dim, count)`` split: along dim 0 from the row
        hashes the fingerprints kept, along other dims by reading the tensor again."""
        rows = self.rows.get((side, key, dtype))
        out = {}
        for dim, count in splits:
            if dim == 0 and rows is not None:
                out[(dim, count)] = [int(h) for h in rows.reshape(count, -1).sum(1).tolist()]
        rest = [split for split in splits if split not in out]
        if rest:
            PAGES.read(t.nbytes)
            out.update(multiset_hashes(t, dtype, rest)[1])
        return out

    def range_hash(self, side: str, key: str, dtype, dim: int, start: int, stop: int) -> int:
        r"""The hash of ``key``'s piece ``start:stop`` along ``dim``: from the kept row hashes along dim 0,
        else read."""
        rows = self.rows.get((side, key, dtype))
        if dim == 0 and rows is not None:
            return int(rows[start:stop].sum())
        tensor = self.cast(key, dtype) if side == "s" else self.target[key]
        return multiset_hashes(tensor.narrow(dim, start, stop - start), dtype)[0]

    # -- phase 1: fingerprints ----------------------------------------------------------------------------
    def fingerprint(self) -> None:
        jobs = [("t", key, t, t.dtype) for key, t in self.target.items()]
        jobs += [
            ("s", key, s, dtype)
            for key, s in self.source.items()
            for dtype in self.dtypes
            if castable(s.dtype, dtype)
        ]
        hashed = in_threads(_full_hash, jobs, [job[2].nbytes for job in jobs])
        for (side, key, t, dtype), (h, rows) in zip(jobs, hashed, strict=True):
            if rows is not None:
                self.rows[(side, key, dtype)] = rows
            if side == "t":
                self.tgt_hash[key] = h
            else:
                self.src_table[(dtype, t.numel(), h)].append(key)
                self.src_numels[dtype].add(t.numel())

    # -- phase 2: whole tensors ---------------------------------------------------------------------------
    def match_whole(self) -> None:
        # a target whose hash one source shares is compared with it on the threads, before the walk below
        singles = [
            (key, bucket[0])
            for key, t in self.target.items()
            if len(bucket := self.src_table.get((t.dtype, t.numel(), self.tgt_hash[key]), [])) == 1
        ]
        sizes = [self.target[key].nbytes for key, _ in singles]
        single_steps = dict(zip(singles, in_threads(self._resolve_pair, singles, sizes), strict=True))
        for key, t in self.target.items():
            bucket = self.src_table.get((t.dtype, t.numel(), self.tgt_hash[key]), [])
            if not bucket:
                continue
            if len(bucket) > 1:
                PAGES.read(2 * t.nbytes)
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
                elif cls is None:
                    steps = single_steps[(key, members[0])]
                else:
                    steps = resolve_candidates(self.cast(members[0], t.dtype), t)
                    if cache_key is not None:
                        self._resolved[cache_key] = steps
                if steps is None:
                    continue
                cast = dtype_name(t.dtype) if self.source[members[0]].dtype != t.dtype else None
                found = _entry_from_steps(members[0], steps, cast)
                found.members = members if len(members) > 1 else None
                results.append(found)
            if results:
                self.found[key] = results

    # -- phase 2b: values rounded through a lower precision ------------------------------------------------
    def match_rounded(self) -> None:
        r"""Targets whose values sit on a bf16/fp16 grid while their dtype is wider: a conversion that went
        through the lower precision (saved in bf16, loaded as fp32). Matched against sources rounded the same
        way."""
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
                if k not in self.found and equal_values(t.to(low).to(t.dtype), t):
                    wanted.append(k)
            if not wanted:
                continue
            table: dict[tuple[int, int], list[str]] = defaultdict(list)
            for skey, src in self.source.items():
                if src.dtype.is_floating_point and src.dtype != low:
                    table[(src.numel(), multiset_hashes(src, low)[0])].append(skey)
            for k in wanted:
                t = self.target[k]
                t_low = t.to(low)
                for skey in table.get((t.numel(), multiset_hashes(t_low, low)[0]), []):
                    steps = resolve_candidates(self.source[skey].to(low), t_low)
                    if steps is not None:
                        casts = [
                            {"op": "cast", "dtype": dtype_name(low)},
                            {"op": "cast", "dtype": dtype_name(t.dtype)},
                        ]
                        self.found.setdefault(k, []).append(_entry_from_steps(skey, [*steps, *casts], None))

    # -- phase 3: pieces of fused sources -----------------------------------------------------------------
    def match_pieces(self) -> None:
        import numpy as np

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
        # the pieces whose hashes a target shares, confirmed on the threads; then the leftover ranges next
        # to confirmed pieces (the unequal parts of a fused tensor: QKV + MLP), confirmed alike
        # the open targets' hashes by (dtype, numel), to look a piece's hashes up in one vectorised step
        wanted = defaultdict(list)
        for dtype, numel, h in table:
            wanted[(dtype, numel)].append(h)
        wanted_arrays = {key: np.array(hs, dtype=np.int64) for key, hs in wanted.items()}
        tasks, shapes = [], {}
        for skey, s in self.source.items():
            if skey in used or s.ndim == 0:
                continue
            for dtype in self.dtypes:
                if not castable(s.dtype, dtype) or not numels[dtype]:
                    continue
                splits = even_splits(tuple(s.shape), numels[dtype])
                if not splits:
                    continue
                shapes[(skey, dtype)] = s
                for (dim, count), hashes in self.piece_hashes("s", skey, s, dtype, splits).items():
                    size, numel = s.shape[dim] // count, s.numel() // count
                    found = np.nonzero(
                        np.isin(np.asarray(hashes, dtype=np.int64), wanted_arrays[(dtype, numel)])
                    )
                    for index in found[0].tolist():
                        for tkey in table.get((dtype, numel, int(hashes[index])), []):
                            start = index * size
                            tasks.append((skey, dtype, dim, start, start + size, tkey, index, count))
        candidates: dict[str, list[_Found]] = defaultdict(list)
        covered: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        for task, f in zip(tasks, in_threads(self._piece_task, tasks), strict=True):
            if f is not None:
                skey, dtype, dim, start, stop, tkey = task[:6]
                candidates[tkey].append(f)
                covered[(skey, dtype, dim)].append((start, stop))
        tasks = []
        for (skey, dtype, dim), spans in covered.items():
            s = shapes[(skey, dtype)]
            for start, stop in piece_gaps(spans, s.shape[dim]):
                numel = (stop - start) * (s.numel() // s.shape[dim])
                if numel not in numels[dtype]:
                    continue
                h = self.range_hash("s", skey, dtype, dim, start, stop)
                tasks += [
                    (skey, dtype, dim, start, stop, tkey, None, None)
                    for tkey in table.get((dtype, numel, h), [])
                ]
        for task, f in zip(tasks, in_threads(self._piece_task, tasks), strict=True):
            if f is not None:
                candidates[task[5]].append(f)
        for tkey, fs in candidates.items():
            self.found[tkey] = fs

    def _piece_task(self, task: tuple) -> _Found | None:
        skey, dtype, dim, start, stop, tkey, index, count = task
        PAGES.read(2 * self.target[tkey].nbytes)
        return self._piece(skey, dtype, dim, start, stop, tkey, index, count)

    def _piece(self, skey, dtype, dim, start, stop, tkey, index, count) -> _Found | None:
        t = self.target[tkey]
        steps = resolve_candidates(self.cast(skey, dtype).narrow(dim, start, stop - start), t)
        if steps is None:
            return None
        chunk: dict[str, Any] = {"op": "chunk", "dim": dim, "start": start, "stop": stop}
        if count is not None:
            chunk.update(index=index, count=count)
        cast = dtype_name(t.dtype) if self.source[skey].dtype != t.dtype else None
        return _entry_from_steps(skey, [chunk, *steps], cast)

    # -- phase 3b: slices at any offset ------------------------------------------------------------------
    def match_offsets(self) -> None:
        r"""A target still unexplained that is a slice of a source along one dim at any offset, the pieces
        unequal in size (a projection of ``cat(x, cond, text)`` split into ``x_proj``, ``cond_proj`` and
        ``text_proj`` of 24, 24 and 32 input columns): each offset probed on its first slice, then compared
        whole. Only a few open targets are probed (a converter that left many unexplained has other
        trouble)."""
        import torch

        open_targets = [k for k in self.target if k not in self.found and self.target[k].ndim >= 1]
        if not open_targets or len(open_targets) > MAX_OFFSET_TARGETS:
            return
        for tkey in open_targets:
            t = self.target[tkey]
            for skey, s in self.source.items():
                dims = [d for d in range(t.ndim) if s.ndim == t.ndim and s.shape[d] != t.shape[d]]
                if len(dims) != 1 or s.shape[dims[0]] < t.shape[dims[0]] or not castable(s.dtype, t.dtype):
                    continue
                dim, size = dims[0], t.shape[dims[0]]
                cast = self.cast(skey, t.dtype)
                head = t.narrow(dim, 0, 1)
                for start in range(s.shape[dim] - size + 1):
                    if not torch.equal(cast.narrow(dim, start, 1), head):
                        continue
                    f = self._piece(skey, t.dtype, dim, start, start + size, tkey, None, None)
                    if f is not None:
                        self.found.setdefault(tkey, []).append(f)
                        break

    # -- phase 4: concatenations of sources ---------------------------------------------------------------
    def match_concat(self) -> None:
        for tkey, t in self.target.items():
            if tkey in self.found or t.ndim == 0:
                continue
            PAGES.read(2 * t.nbytes)
            numels = self.src_numels[t.dtype]
            splits = [
                (d, k)
                for d in range(t.ndim)
                for k in range(2, min(t.shape[d], MAX_PIECES) + 1)
                if t.shape[d] % k == 0 and t.numel() // k in numels
            ]
            if not splits:
                continue
            pieces = self.piece_hashes("t", tkey, t, t.dtype, splits)
            for (dim, count), hashes in sorted(pieces.items(), key=lambda kv: kv[0][1]):
                size = t.shape[dim] // count
                spans = [
                    (i * size, (i + 1) * size, h)
                    for i, h in enumerate(hashes)
                    if self.src_table.get((t.dtype, t.numel() // count, h))
                ]
                if not spans:
                    continue
                for start, stop in piece_gaps([(a, b) for a, b, _ in spans], t.shape[dim]):
                    spans.append((start, stop, self.range_hash("t", tkey, t.dtype, dim, start, stop)))
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
                steps = resolve_candidates(self.cast(skey, t.dtype), piece)
                if steps is not None:
                    cast = (
                        [{"op": "cast", "dtype": dtype_name(t.dtype)}]
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
            # a constant (zeros, ones) matched whole may still be a piece of a fused constant: structure
            # decides
            if len({_way_sig(w) for w in live}) == 1 and not all_equal(self.target[tkey]):
                why = "values" if len(ways) == 1 else "values; live weights over EMA/shadow copies"
                self.settle(tkey, live[0], why, learn=True)
        narrowed: dict[str, list[_Found]] = {}
        for _ in range(4):
            claimed = self.scorer.claimed()
            proven = {name_relation(self.chosen[k], k) for k in self.chosen}
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
                    proven.add(name_relation(kept[0], tkey))
                    changed = True
            if not changed:
                break
        self.guess({k: narrowed.get(k, all_ways[k]) for k in all_ways if k not in self.chosen}, all_ways)

    def sibling_ways(self, tkey: str) -> list[_Found]:
        r"""Ways built like a settled sibling of ``tkey`` (same target module, or same stem: ``in_proj_bias``
        beside ``in_proj_weight``): the matching source of the same module or stem, same leading chunk (a
        fused bias split like its fused weight), verified exactly."""
        module, leaf = tkey.rsplit(".", 1) if "." in tkey else ("", tkey)
        stem, stem_leaf = param_stem(tkey)
        t = self.target[tkey]
        out = []
        siblings = [(o, False) for o in self.by_module.get(module, ()) if "." in tkey]
        if stem_leaf in PARAM_LEAVES:  # a weight/bias pair, dotted or not; not any two root-level tensors
            siblings += [(o, True) for o in self.by_stem.get(stem, ()) if param_stem(o)[1] in PARAM_LEAVES]
        for other, same_stem in siblings:
            way = self.chosen.get(other)
            if other == tkey or way is None or len(way.sources) != 1:
                continue
            names = []
            if "." in way.sources[0]:
                names.append(f"{way.sources[0].rsplit('.', 1)[0]}.{leaf}")
            if same_stem:
                names += stem_names(param_stem(way.sources[0])[0], stem_leaf)
            for candidate in dict.fromkeys(names):
                found = self._built_like(way, candidate, t)
                if found is not None:
                    out.append(found)
        return _dedupe(out)

    def _built_like(self, way: _Found, candidate: str, t) -> _Found | None:
        r"""``candidate`` split the way ``way`` splits its source, if that gives ``t`` exactly."""
        s = self.source.get(candidate)
        if s is None or candidate == way.sources[0] or not castable(s.dtype, t.dtype):
            return None
        steps: list[dict[str, Any]] = []
        x = self.cast(candidate, t.dtype)
        if way.op == "chunk" and way.args["dim"] == 0 and s.ndim >= 1:
            if s.shape[0] != self.source[way.sources[0]].shape[0]:
                return None
            steps.append({"op": "chunk", **{k: v for k, v in way.args.items() if k != "then"}})
            x = apply_step(x, steps[0])
        rest = resolve_candidates(x, t)
        if rest is None:
            return None
        cast = dtype_name(t.dtype) if s.dtype != t.dtype else None
        return _entry_from_steps(candidate, [*steps, *rest], cast)

    def home_piece_ways(self, tkey: str) -> list[_Found]:
        r"""Equal row pieces of fused tensors in the target's home module that hold its values too.

        Whole-tensor matches stop the piece search, so a zero ``to_q.bias`` would otherwise never see the
        zero chunks of ``qkv.bias`` beside it: the true source must be among the candidates.
        """
        t = self.target[tkey]
        if all_equal(t):  # a constant (a fresh norm or bias) says little about where it comes from
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
                for anc in name_ancestors(key):
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
                or not castable(s.dtype, t.dtype)
            ):
                continue
            count, rest = divmod(s.shape[0], t.shape[0])
            if rest or not 2 <= count <= MAX_PIECES:
                continue
            x = self.cast(skey, t.dtype)
            size = t.shape[0]
            for index in range(count):
                if equal_values(x.narrow(0, index * size, size), t):
                    chunk = {"op": "chunk", "dim": 0, "start": index * size, "stop": (index + 1) * size}
                    chunk.update(index=index, count=count)
                    cast = dtype_name(t.dtype) if s.dtype != t.dtype else None
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
        t_anc = set(name_ancestors(tkey))
        keep(
            [w for w in ways if not self.foreign(w.sources[0], t_anc, claimed)],
            "others sit in modules that map to other target modules",
        )
        keep(_prefer_live(ways), "live weights over EMA/shadow copies")
        keep(
            [w for w in ways if name_relation(w, tkey) in proven], "maps like the same tensor in other layers"
        )
        return ways, "; ".join(reasons) or "only way"

    def ancestors(self, name: str) -> set[str]:
        if name not in self._anc_cache:
            self._anc_cache[name] = set(name_ancestors(name))
        return self._anc_cache[name]

    def foreign(self, source: str, t_anc: set[str], claimed: dict[str, set[str]]) -> bool:
        r"""True when the deepest claimed module around ``source`` is claimed only by modules outside
        the target's."""
        for anc in name_ancestors(source):
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
            groups[layer_key(tkey)].append(tkey)
        taken: set[str] = set()
        # groups whose names point clearly (``norm_added_q`` ~ ``txt``) choose first; the rest take what is
        # left
        order = sorted(groups.values(), key=lambda m: -sum(clear[k] for k in m) / len(m))
        for members in order:
            fresh = {k: [w for w in ranked[k] if _way_sig(w) not in taken] or ranked[k] for k in members}
            score: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
            for tkey in members:
                seen: set[tuple] = set()
                for pos, w in enumerate(fresh[tkey]):
                    rel = name_relation(w, tkey)
                    if rel not in seen:
                        seen.add(rel)
                        score[rel][0] += 1
                        score[rel][1] -= pos
            # the pattern most layers can follow, then the one names prefer: block 1 guessed like block 0
            rel = max(score, key=lambda r: tuple(score[r]))
            for tkey in members:
                fits = [w for w in fresh[tkey] if name_relation(w, tkey) == rel]
                pick = (fits or fresh[tkey])[0]
                taken.add(_way_sig(pick))
                self.settle(tkey, pick, "guess: equal values; chosen by names")
                names = list(dict.fromkeys(w.sources[0] for w in all_ways[tkey]))
                self.ambiguous[tkey] = names
                self.plausible[tkey] = list(dict.fromkeys(w.sources[0] for w in narrowed[tkey]))
                self.n_candidates[tkey] = len(names)


def _full_hash(job: tuple) -> tuple[int, Any]:
    _, _, t, dtype = job
    PAGES.read(t.nbytes)
    return multiset_rows(t, dtype)


def _prefer_live(ways: list[_Found]) -> list[_Found]:
    r"""Ways without EMA/shadow copies among their sources, or all of them when every way uses one."""
    live = [w for w in ways if not any(is_ema(s) for s in w.sources)]
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


def infer_conversion_map(source: Any, target: Any, *, allow_ambiguous: bool = False) -> ConversionMap:
    r"""Explain every TARGET tensor from SOURCE tensors by value, and collapse the result into rules.

    Args:
        source: the research checkpoint: a path (anything :func:`paritykit.base.io.load_state_dict` reads), a
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
    src, src_label = as_state_dict(source, "SOURCE")
    tgt, tgt_label = as_state_dict(target, "TARGET")
    m = _Matcher(src, tgt)
    with without_cycle_collection():
        m.fingerprint()
        m.match_whole()
        m.match_rounded()
        m.match_pieces()
        m.match_concat()
        m.match_offsets()
        m.choose()
    PAGES.release()

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
        warnings=conversion_warnings(mapping, {k: tuple(getattr(tgt[k], "shape", ())) for k in tgt}),
        allow_ambiguous=allow_ambiguous,
    )
