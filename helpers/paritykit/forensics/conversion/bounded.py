r"""Value matching of two models' weights that are read one tensor at a time (offloaded by accelerate).

:func:`paritykit.forensics.conversion.matching.infer_conversion_map` holds every tensor of both sides while it
matches them. For weights that live in an offload folder that is the whole model twice. Most tensors of a port
loaded with the reference's weights are simply the same tensor under another name, and those need no value at
all once that is known: :func:`compact_pair` fingerprints every tensor in one pass (each read, hashed and
dropped), proves each pair that is unique and equal (the two tensors read side by side), and stands a tiny
distinct tensor in for both members. Only what needs a closer look (constant tensors, values several tensors
share, transposed, fused or cast tensors) is loaded. :func:`restore_for` puts the real values back where a
stand-in may hide a match the matcher would otherwise find (a target left unexplained).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

from paritykit.forensics.conversion.fingerprints import informative


class Subset(Mapping):
    r"""The entries of a lazy mapping whose names are in ``keys``; values are read on access, never kept."""

    def __init__(self, weights: Mapping[str, Any], keys: list[str]):
        self.weights = weights
        self.keys_ = keys
        self._known = set(keys)

    def __len__(self) -> int:
        return len(self.keys_)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __getitem__(self, name: str) -> Any:
        if name not in self._known:
            raise KeyError(name)
        return self.weights[name]


def _fingerprints(weights: Mapping[str, Any], dtypes: list[Any] | None) -> dict[str, dict[str, Any]]:
    """Shape, dtype, informativeness and the matcher's hash (per target dtype for sources), one tensor at a
    time: each tensor is dropped before the next is read."""
    from paritykit.forensics.conversion.fingerprints import castable, multiset_hashes

    out = {}
    for key in weights:
        t = weights[key].detach()
        wanted = [t.dtype] if dtypes is None else [d for d in dtypes if castable(t.dtype, d)]
        out[key] = {
            "shape": tuple(t.shape),
            "dtype": t.dtype,
            "numel": t.numel(),
            "informative": t.dtype.is_floating_point and informative(t),
            "hash": {d: multiset_hashes(t, d)[0] for d in wanted},
        }
        del t
    return out


def _unique_equal_pairs(source: Mapping, target: Mapping, src_fp: dict, tgt_fp: dict) -> dict[str, str]:
    """``{source_key: target_key}`` for tensors that equal exactly one tensor of the other side and whose
    hash no other tensor shares in any dtype the matcher looks at (so no cast match is lost either)."""
    import torch

    src_bucket: dict[tuple, list[str]] = defaultdict(list)
    tgt_bucket: dict[tuple, list[str]] = defaultdict(list)
    for key, fp in src_fp.items():
        for dtype, h in fp["hash"].items():
            src_bucket[(dtype, fp["numel"], h)].append(key)
    for key, fp in tgt_fp.items():
        tgt_bucket[(fp["dtype"], fp["numel"], fp["hash"][fp["dtype"]])].append(key)
    pairs = {}
    for tkey, tfp in tgt_fp.items():
        bucket = (tfp["dtype"], tfp["numel"], tfp["hash"][tfp["dtype"]])
        if not tfp["informative"] or len(tgt_bucket[bucket]) != 1 or len(src_bucket.get(bucket, ())) != 1:
            continue
        skey = src_bucket[bucket][0]
        sfp = src_fp[skey]
        if not sfp["informative"] or sfp["dtype"] != tfp["dtype"] or sfp["shape"] != tfp["shape"]:
            continue
        others = [(d, sfp["numel"], h) for d, h in sfp["hash"].items() if d != sfp["dtype"]]
        if any(tgt_bucket.get(b) for b in others):
            continue  # the source also explains a target of another dtype: keep its values
        # the hash makes equality likely; reading the two tensors side by side proves it
        if torch.equal(source[skey].detach(), target[tkey].detach()):
            pairs[skey] = tkey
    return pairs


def _stand_ins(pairs: dict[str, str], src_fp: dict, tgt_fp: dict) -> dict[str, Any]:
    """A distinct small tensor per pair, of a size no real tensor has, so nothing else can match it."""
    import torch

    used = {fp["numel"] for fp in [*src_fp.values(), *tgt_fp.values()]}
    size = next(n for n in range(3, 1 << 20) if n not in used)
    gen = torch.Generator().manual_seed(0)
    seen: set[bytes] = set()
    out = {}
    for skey in pairs:
        value = torch.randn(size, generator=gen, dtype=torch.float64).to(src_fp[skey]["dtype"])
        raw = value.view(torch.uint8).numpy().tobytes() if value.dtype.is_floating_point else b""
        if raw in seen or not informative(value):
            continue  # vanishingly rare: that pair keeps its real values
        seen.add(raw)
        out[skey] = value
    return out


def compact_pair(
    source: Mapping, target: Mapping
) -> tuple[dict[str, Any], dict[str, Any], dict[str, tuple[str, int]]]:
    r"""``source`` and ``target`` as plain dicts for
    :func:`paritykit.forensics.conversion.matching.infer_conversion_map`, with a
    stand-in for both members of every unique equal pair (see the module docstring).

    Returns:
        ``(source_dict, target_dict, stood_in)``; ``stood_in`` maps each replaced source key to its target key
        and its number of elements. Peak memory: the tensors that need their values, plus two tensors while a
        pair is proved equal.
    """
    tgt_fp = _fingerprints(target, None)
    dtypes = sorted({fp["dtype"] for fp in tgt_fp.values()}, key=str)
    src_fp = _fingerprints(source, dtypes)
    pairs = _unique_equal_pairs(source, target, src_fp, tgt_fp)
    stand = _stand_ins(pairs, src_fp, tgt_fp)
    stood_in = {s: (pairs[s], src_fp[s]["numel"]) for s in stand}
    by_target = {t: stand[s] for s, (t, _) in stood_in.items()}
    src = {k: stand[k] if k in stand else source[k].detach() for k in source}
    tgt = {k: by_target[k] if k in by_target else target[k].detach() for k in target}
    return src, tgt, stood_in


def restore_for(
    cmap: Any, source: Mapping, target: Mapping, src: dict, tgt: dict, stood_in: dict[str, tuple[str, int]]
) -> bool:
    r"""Put real values back (in ``src``/``tgt``) for the pairs a stand-in may have hidden from a target
    ``cmap`` left unexplained: a source can be part of a concatenation, or the rounded or cast copy of a
    tensor, of a target at least its size. Returns whether anything was restored (infer again then)."""
    if not cmap.unmapped_target or not stood_in:
        return False
    largest = max(tgt[k].numel() for k in cmap.unmapped_target)
    restored = False
    for skey, (tkey, numel) in list(stood_in.items()):
        if numel <= largest:
            del stood_in[skey]
            src[skey], tgt[tkey] = source[skey].detach(), target[tkey].detach()
            restored = True
    return restored
