"""The torch references against a dense ground truth (plain softmax over gathered K/V)."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import (
    canary_dtype,
    copy_blocks_ref,
    fill_guard,
    guard_scan_ref,
    paged_decode_ref,
    paged_prefill_ref,
    store_kv_ref,
)
from kvscope.kernels.guard import canary_value
from tests.kernels_cases import dense_attention, gathered, make_case, rel_err

DECODE_CASES = [
    pytest.param([1, 15, 17, 40], 8, 4, 2, 16, id="B4-H4/2-L40-bs8"),
    pytest.param([1023], 16, 8, 1, 32, id="B1-H8/1-L1023-bs16"),
    pytest.param([5, 64, 33], 32, 6, 2, 16, id="B3-H6/2-L64-bs32"),
    pytest.param([130, 7], 128, 2, 2, 16, id="B2-H2/2-L130-bs128"),
]


@pytest.mark.parametrize(("lens", "bs", "q_heads", "kv_heads", "dim"), DECODE_CASES)
def test_decode_ref_matches_dense(lens, bs, q_heads, kv_heads, dim):
    case = make_case(lens, bs, kv_heads, dim, torch.float32)
    q = torch.randn(len(lens), q_heads, dim)
    out = paged_decode_ref(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
    for i in range(len(lens)):
        k = gathered(case, i, case.k_cache, None)
        v = gathered(case, i, case.v_cache, None)
        want = dense_attention(q[i : i + 1], k, v, None)[0]
        assert rel_err(out[i], want) < 1e-5


def test_decode_ref_fp8_dequantises_with_layer_scales():
    case = make_case([9, 30], 8, 2, 16, fp8=True)
    q = torch.randn(2, 4, 16)
    out = paged_decode_ref(
        q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
        k_scale=case.k_scale, v_scale=case.v_scale,
    )  # fmt: skip
    for i in range(2):
        k = gathered(case, i, case.k_cache, case.k_scale)
        v = gathered(case, i, case.v_cache, case.v_scale)
        assert rel_err(out[i], dense_attention(q[i : i + 1], k, v, None)[0]) < 1e-5


def test_decode_ref_guard_layout_never_reads_the_guard_slot():
    # GIVEN slots_per_block = block_size + 1 with a NaN canary in the last slot
    case = make_case([17, 3], 8, 2, 16, torch.float32, slots=9)
    pool = torch.stack([case.k_cache, case.v_cache])[None]
    fill_guard(pool)
    q = torch.randn(2, 2, 16)
    # WHEN decode runs with block_size = slots - 1
    out = paged_decode_ref(q, pool[0, 0], pool[0, 1], case.block_tables, case.seq_lens, None, 8)
    # THEN the result is finite and equals attention over the usable slots only
    for i in range(2):
        k, v = gathered(case, i, pool[0, 0], None), gathered(case, i, pool[0, 1], None)
        assert rel_err(out[i], dense_attention(q[i : i + 1], k, v, None)[0]) < 1e-5


PREFILL_CASES = [
    pytest.param([20, 9, 40], [5, 9, 1], 8, 4, 2, id="B3-H4/2-prefix-midblock-bs8"),
    pytest.param([1023, 17], [40, 0], 16, 2, 1, id="B2-H2/1-L1023-bs16-empty"),
    pytest.param([33], [33], 16, 6, 2, id="B1-H6/2-L33-noprefix"),
]


@pytest.mark.parametrize(("lens", "new", "bs", "q_heads", "kv_heads"), PREFILL_CASES)
def test_prefill_ref_matches_dense_causal(lens, new, bs, q_heads, kv_heads):
    dim = 16
    case = make_case(lens, bs, kv_heads, dim, torch.float32)
    qsl = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(new), q_heads, dim)
    out = paged_prefill_ref(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, qsl)
    for i, (length, n) in enumerate(zip(lens, new)):
        if n == 0:
            continue
        k, v = gathered(case, i, case.k_cache, None), gathered(case, i, case.v_cache, None)
        want = dense_attention(q[qsl[i] : qsl[i + 1]], k, v, causal_from=length - n)
        assert rel_err(out[qsl[i] : qsl[i + 1]], want) < 1e-5


def test_store_ref_writes_each_slot_and_skips_minus_one():
    k_cache = torch.zeros(6, 4, 2, 8)
    v_cache = torch.zeros(6, 4, 2, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([0, 23, -1, 9, 5])
    store_kv_ref(key, value, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // 4, s % 4], key[t])
            assert torch.equal(v_cache[s // 4, s % 4], value[t])
    assert int((k_cache.abs().sum((2, 3)) > 0).sum()) == 4


def test_copy_ref_copies_every_layer_k_and_v():
    kv = torch.randn(3, 2, 8, 4, 2, 8)
    before = kv.clone()
    copy_blocks_ref(kv, torch.tensor([1, 6]), torch.tensor([4, 2]))
    assert torch.equal(kv[:, :, 4], before[:, :, 1]) and torch.equal(kv[:, :, 2], before[:, :, 6])
    untouched = [0, 1, 3, 5, 6, 7]
    assert torch.equal(kv[:, :, untouched], before[:, :, untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_guard_scan_ref_finds_scribbled_guard_slots(dtype):
    kv = torch.randn(2, 2, 10, 5, 2, 8).to(dtype)
    fill_guard(kv)
    assert guard_scan_ref(kv, canary_value(dtype), canary_dtype(dtype)) == []
    kv[1, 1, 7, -1, 0, 3] = 1.0
    kv[0, 0, 2, -1, 1, 0] = 0.5
    assert guard_scan_ref(kv, canary_value(dtype), canary_dtype(dtype)) == [2, 7]
    sub = torch.tensor([7, 8])
    assert guard_scan_ref(kv, canary_value(dtype), canary_dtype(dtype), sub) == [7]
