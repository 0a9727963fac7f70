"""The value fingerprints weights are matched by: the fast CPU paths (numpy views, int32 runs, wide byte
compares, the weighted position sum) give exactly what the plain definitions give, on the values where a
shortcut could go wrong (-0.0, NaN, the extremes of a 16-bit pattern, offsets a wide view cannot take)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paritykit.forensics.conversion import fingerprints as fp


def _bf16(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _plain_multiset(t: torch.Tensor) -> int:
    # the definition: the wrapping int64 sum of every element's bit pattern, -0.0 taken as 0.0
    bits = (t.reshape(-1) + 0.0).view(torch.int16).numpy().astype(np.int64)
    total = int(bits.sum())
    return (total + (1 << 63)) % (1 << 64) - (1 << 63)


def test_int32_runs_sum_exactly_at_the_extremes_of_a_16_bit_pattern():
    for value in (-32768, 32767):
        a = np.full(5 * (1 << 15) + 7, value, dtype=np.int16)  # several whole runs and a tail
        assert fp._numpy_sum(a) == value * a.size
    b = np.random.default_rng(0).integers(-32768, 32768, size=300_001, dtype=np.int16)
    assert fp._numpy_sum(b) == int(b.astype(np.int64).sum())


def test_the_numpy_view_path_hashes_as_the_definition_says():
    w = _bf16(0, 96, 40)
    w[3, 5] = -0.0
    w[7, 1] = 0.0
    assert fp.multiset_hashes(w, torch.bfloat16)[0] == _plain_multiset(w)
    # a strided view takes the torch path: the same answer
    assert fp.multiset_hashes(w.t(), torch.bfloat16)[0] == _plain_multiset(w)
    # -0.0 and 0.0 are one value to torch.equal, so to the hash; any other change is seen
    flipped = w.clone()
    flipped[3, 5] = 0.0
    assert fp.multiset_hashes(flipped, torch.bfloat16)[0] == fp.multiset_hashes(w, torch.bfloat16)[0]
    flipped[0, 0] = flipped[0, 0] * 2 + 1
    assert fp.multiset_hashes(flipped, torch.bfloat16)[0] != fp.multiset_hashes(w, torch.bfloat16)[0]


def test_pieces_are_the_same_whichever_path_reads_them():
    w = _bf16(1, 48, 30)
    fast = fp.multiset_hashes(w, torch.bfloat16, [(0, 3), (1, 5)])
    slow = fp.multiset_hashes(w.t().contiguous().t(), torch.bfloat16, [(0, 3), (1, 5)])  # not contiguous
    assert fast == slow
    assert fast[1][(0, 3)] == [_plain_multiset(p) for p in w.chunk(3, 0)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_equal_values_keeps_torch_equal_semantics(dtype):
    a = torch.randn(64, 33, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert fp.equal_values(a, a.clone())
    b = a.clone()
    b[10, 3] = b[10, 3] + 1
    assert not fp.equal_values(a, b)
    z, nz = a.clone(), a.clone()
    z[0, 0], nz[0, 0] = 0.0, -0.0
    assert fp.equal_values(z, nz) and torch.equal(z, nz)
    n = a.clone()
    n[5, 5] = float("nan")
    assert not fp.equal_values(n, n.clone())  # NaN equals nothing, itself included
    neg = a.clone()
    neg[6, 6] = -float("nan")
    assert not fp.equal_values(neg, neg.clone())


def test_empty_tensors_are_equal():
    empty = torch.zeros(0, 4, dtype=torch.bfloat16)
    assert fp.equal_values(empty, empty.clone())


def test_equal_values_at_an_offset_no_wide_view_can_take():
    base = _bf16(3, 1001)
    a, b = base[1:], base.clone()[1:]  # 1000 elements starting 2 bytes into their storage
    assert fp.equal_values(a, b)
    b[999] = b[999] + 1
    assert not fp.equal_values(a, b)


def test_position_hash_sees_order_and_is_the_same_by_numpy_and_by_torch():
    w = torch.randn(3 * fp.BLOCK // 64 + 5, 64, generator=torch.Generator().manual_seed(4))  # past one block
    h = fp.position_hash(w)
    assert h == fp.position_hash(w.clone())
    assert h != fp.position_hash(w.flip(0))
    swapped = w.clone().reshape(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    assert h != fp.position_hash(swapped)
    z = w.clone()
    z[0, 0] = 0.0
    nz = z.clone()
    nz[0, 0] = -0.0
    assert fp.position_hash(z) == fp.position_hash(nz)
    # what a GPU computes: the same sums by torch ops on the tensor's own device (here the CPU)
    assert h == fp._position_hash(w, by_numpy=False)
    assert fp.position_hash(nz) == fp._position_hash(nz, by_numpy=False)


def test_position_hash_by_torch_spans_many_blocks_as_numpy_does(monkeypatch):
    # a GPU hashes DEVICE_BLOCKS blocks per step, the last one short: spans of two blocks here, so the hash
    # crosses span and block ends mid-tensor, in bfloat16 with a -0.0 (folded onto 0.0) inside a later span
    monkeypatch.setattr(fp, "DEVICE_BLOCKS", 2)
    w = torch.randn(5 * fp.BLOCK + 77, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    w[3 * fp.BLOCK + 1] = -0.0
    assert fp._position_hash(w, by_numpy=False) == fp._position_hash(w, by_numpy=True)
    w[3 * fp.BLOCK + 1] = 0.0
    assert fp._position_hash(w, by_numpy=False) == fp._position_hash(w, by_numpy=True)
    moved = w.clone()
    moved[[4 * fp.BLOCK, 4 * fp.BLOCK + 1]] = moved[[4 * fp.BLOCK + 1, 4 * fp.BLOCK]]
    assert fp._position_hash(moved, by_numpy=False) != fp._position_hash(w, by_numpy=False)


def test_a_models_weight_hashes_are_taken_once_while_its_weights_hold():
    # zoom aligns each level with a Side of its own: the weights are hashed once, and again after any edit
    from paritykit.bisection.align_sides import side_of

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    first = side_of(model, None).keys()
    assert side_of(model, None).keys() is first
    with torch.no_grad():
        model[1].weight[0, 0] += 1.0  # an in-place edit: the version counter moves
    edited = side_of(model, None).keys()
    assert edited is not first and edited["1.weight"] != first["1.weight"]
    assert edited["0.weight"] == first["0.weight"]
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().flip(0))  # a new tensor
    assert side_of(model, None).keys()["0.weight"] != first["0.weight"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_hashes_kept_in_the_first_read_give_every_piece_along_dim_0(dtype):
    # weights map hashes the pieces of a fused tensor (QKV + MLP rows) from the row hashes its fingerprint
    # pass keeps: every split and every range of rows must hash as reading the piece would
    torch.manual_seed(0)
    t = torch.randn(12, 5).to(dtype)
    t[3, 1] = -0.0
    full, rows = fp.multiset_rows(t, dtype)
    assert full == fp.multiset_hashes(t, dtype)[0]
    for count in (2, 3, 4, 6):
        pieces = fp.multiset_hashes(t, dtype, [(0, count)])[1][(0, count)]
        assert [int(h) for h in rows.reshape(count, -1).sum(1)] == pieces
    for start, stop in ((0, 5), (5, 12), (3, 4)):
        assert int(rows[start:stop].sum()) == fp.multiset_hashes(t[start:stop], dtype)[0]
    assert fp.multiset_rows(t[0], dtype)[1] is None  # one dim: no rows kept
