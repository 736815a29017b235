"""Guard mode: planted bad block-table entries, freed blocks and overflowing slots are recorded
and skipped, never read or written, by the Triton kernels and the torch references alike."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import (
    copy_blocks,
    decode_errors,
    fill_guard,
    guard_scan,
    new_error_buffer,
    num_errors,
    paged_decode,
    paged_prefill,
    store_kv,
)
from kvscope.kernels.common import check_attention_inputs
from kvscope.kernels.decode import DecodeConfig, launch_decode
from tests.kernels_cases import (
    TRITON_TARGETS,
    dense_attention,
    gathered,
    make_case,
    rel_err,
    use_torch,
    use_triton_on,
)

BACKENDS = [pytest.param("torch", id="torch"), *TRITON_TARGETS]


def select(monkeypatch: pytest.MonkeyPatch, backend: str) -> str:
    """Pick the backend; returns the device its tensors live on."""
    if backend == "torch":
        use_torch(monkeypatch)
        return "cpu"
    use_triton_on(monkeypatch, backend)
    return backend


def as_set(errors: torch.Tensor) -> set[tuple[int, int, int, str]]:
    return {
        (e["sequence"], e["logical_block"], e["physical_block"], e["kind"])
        for e in decode_errors(errors)
    }


def planted_case(device: str):
    """Three sequences (block 8, 9 slots with guard) with one bad entry each, and the truth."""
    case = make_case([20, 24, 11], 8, 2, 16, torch.bfloat16, device, slots=9, spare_blocks=4)
    pool = torch.stack([case.k_cache, case.v_cache])[None]  # [1, 2, blocks, 9, 2, 16]
    fill_guard(pool)
    state = torch.ones(case.num_blocks, dtype=torch.uint8, device=device)
    tables = case.block_tables.clone()
    tables[0, 1] = case.num_blocks + 3  # past the pool
    freed = int(tables[1, 2])
    state[freed] = 0  # a freed block still in a table
    tables[2, 0] = -1  # a hole inside the sequence
    expected = {
        (0, 1, case.num_blocks + 3, "out_of_range"),
        (1, 2, freed, "not_allocated"),
        (2, 0, -1, "out_of_range"),
    }
    bad = {(0, 1), (1, 2), (2, 0)}
    return case, pool, tables, state, expected, bad


def truth_without(case, pool, q, bad, new=None):
    """Dense attention over each sequence's good blocks only (bad blocks skipped)."""
    outs = []
    for i in range(q.shape[0] if new is None else len(new)):
        n = int(case.seq_lens[i])
        keep = torch.tensor([(i, p // case.block_size) not in bad for p in range(n)])
        k = gathered(case, i, pool[0, 0], None)[keep]
        v = gathered(case, i, pool[0, 1], None)[keep]
        if new is None:
            outs.append(dense_attention(q[i : i + 1], k, v, None)[0])
    return torch.stack(outs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_records_and_skips_each_planted_violation(monkeypatch, backend):
    device = select(monkeypatch, backend)
    # GIVEN block tables with an out-of-range entry, a freed block and a -1 hole
    case, pool, tables, state, expected, bad = planted_case(device)
    q = torch.randn(3, 4, 16, device=device, dtype=torch.bfloat16)
    errors = new_error_buffer(device=device)
    # WHEN decode runs in guard mode
    out = paged_decode(
        q, pool[0, 0], pool[0, 1], tables, case.seq_lens, None, 8,
        block_state=state, errors=errors,
    )  # fmt: skip
    # THEN each violation is recorded once and the output is attention over the good blocks
    assert as_set(errors) == expected and num_errors(errors) == 3
    assert rel_err(out, truth_without(case, pool, q, bad)) < 1e-2


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize("chunk_blocks", [1, 2], ids=["split1", "split2"])
def test_decode_guard_with_splits_skips_each_planted_violation(monkeypatch, device, chunk_blocks):
    # GIVEN the planted violations and splits of one or two blocks (merged across splits)
    case, pool, tables, state, expected, bad = planted_case(device)
    q = torch.randn(3, 4, 16, device=device, dtype=torch.bfloat16)
    errors = new_error_buffer(device=device)
    use_triton_on(monkeypatch, device)
    a = check_attention_inputs(
        q, pool[0, 0], pool[0, 1], tables, case.seq_lens, None, 8, None, None, state, errors
    )
    out = torch.full_like(q, float("nan"))
    launch_decode(a, out, DecodeConfig(tile=16, chunk_blocks=chunk_blocks))
    # THEN each violation is recorded once (not once per kv head or split) and skipped
    assert as_set(errors) == expected and num_errors(errors) == 3
    assert rel_err(out, truth_without(case, pool, q, bad)) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_guard_without_violations_matches_unguarded(monkeypatch, backend):
    device = select(monkeypatch, backend)
    case = make_case([1, 15, 17, 63], 16, 2, 16, torch.float16, device, slots=17)
    q = torch.randn(4, 4, 16, device=device, dtype=torch.float16)
    state = torch.ones(case.num_blocks, dtype=torch.uint8, device=device)
    errors = new_error_buffer(device=device)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, None, 16)
    guarded = paged_decode(*args, block_state=state, errors=errors)
    assert num_errors(errors) == 0
    assert torch.equal(guarded, paged_decode(*args))


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_records_each_violation_once(monkeypatch, backend):
    device = select(monkeypatch, backend)
    case, pool, tables, state, expected, bad = planted_case(device)
    # new tokens: 12 for seq 0 (two query tiles read block 1), 3 for seq 1, all 11 of seq 2
    qsl = torch.tensor([0, 12, 15, 26], dtype=torch.int32, device=device)
    q = torch.randn(26, 4, 16, device=device, dtype=torch.bfloat16)
    errors = new_error_buffer(device=device)
    out = paged_prefill(
        q, pool[0, 0], pool[0, 1], tables, case.seq_lens, qsl, None, 8,
        block_state=state, errors=errors,
    )  # fmt: skip
    assert as_set(errors) == expected and num_errors(errors) == 3
    assert torch.isfinite(out.float()).all()
    # the last token of sequence 0 sees every good key of its sequence
    n = int(case.seq_lens[0])
    keep = torch.tensor([(0, p // 8) not in bad for p in range(n)])
    k = gathered(case, 0, pool[0, 0], None)[keep]
    v = gathered(case, 0, pool[0, 1], None)[keep]
    assert rel_err(out[11], dense_attention(q[11:12], k, v, None)[0]) < 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_records_bad_slots_and_never_touches_guard_slots(monkeypatch, backend):
    device = select(monkeypatch, backend)
    # GIVEN a pool of 6 blocks of 4 usable slots + 1 guard slot, block 3 freed
    pool = torch.zeros(1, 2, 6, 5, 2, 16, dtype=torch.bfloat16, device=device)
    fill_guard(pool)
    state = torch.ones(6, dtype=torch.uint8, device=device)
    state[3] = 0
    slots = torch.tensor([0, 4, 31, -1, 16, -5, 7], device=device)
    key = torch.randn(7, 2, 16, device=device, dtype=torch.bfloat16)
    errors = new_error_buffer(device=device)
    # WHEN tokens are stored: ok, guard slot of block 0, past the pool, skip, freed, negative, ok
    store_kv(
        key, key, pool[0, 0], pool[0, 1], slots, block_size=4, block_state=state, errors=errors
    )
    # THEN every bad slot is recorded with its kind and the guard slots still hold the canary
    got = {
        (e["sequence"], e["physical_block"], e["slot"], e["kind"]) for e in decode_errors(errors)
    }
    assert got == {
        (1, 0, 4, "slot_overflow"),
        (2, 6, 1, "out_of_range"),
        (4, 3, 1, "not_allocated"),
        (5, -1, 0, "out_of_range"),
    }
    assert guard_scan(pool) == []
    assert torch.equal(pool[0, 0, 0, 0], key[0]) and torch.equal(pool[0, 1, 1, 2], key[6])
    assert int((pool[0, 0, :, :4].float().abs().sum((-1, -2)) > 0).sum()) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_records_bad_pairs_and_copies_the_good_one(monkeypatch, backend):
    device = select(monkeypatch, backend)
    pool = torch.randn(2, 2, 6, 3, 2, 16, device=device).to(torch.float16)
    before = pool.clone()
    state = torch.ones(6, dtype=torch.uint8, device=device)
    state[5] = 0
    errors = new_error_buffer(device=device)
    src = torch.tensor([1, 5, 2], device=device)
    dst = torch.tensor([0, 3, 9], device=device)
    copy_blocks(pool, src, dst, block_state=state, errors=errors)
    assert as_set(errors) == {(1, -1, 5, "not_allocated"), (2, -1, 9, "out_of_range")}
    assert torch.equal(pool[:, :, 0], before[:, :, 1])
    assert torch.equal(pool[:, :, 1:], before[:, :, 1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_error_buffer_counts_past_its_capacity(monkeypatch, backend):
    device = select(monkeypatch, backend)
    pool = torch.zeros(1, 2, 4, 3, 1, 16, dtype=torch.float16, device=device)
    errors = new_error_buffer(capacity=2, device=device)
    slots = torch.tensor([100, 101, 102, 103, 1], device=device)
    key = torch.ones(5, 1, 16, device=device, dtype=torch.float16)
    store_kv(key, key, pool[0, 0], pool[0, 1], slots, errors=errors)
    assert num_errors(errors) == 4 and len(decode_errors(errors)) == 2
