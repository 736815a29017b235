"""Slot provenance (docs/POOL.md "Slot provenance"): the records the core writes for a sampled
sequence's slots, the check at a prefix hit, the sweep, sampling, copy-on-write, a slot handed
out again, and the foreign-slot fault."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.allocator import KVPool, PoolConfig, faults
from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import FORMAT_VERSION


@pytest.fixture
def pool(pool_name):
    p = KVPool.create(
        pool_name,
        PoolConfig(num_blocks=48, block_size=4, head_dim=8, num_layers=1, dtype="float32"),
    )
    p.provenance_sample = 1
    yield p
    faults.configure(None)
    p.close()
    p.unlink()


def _kinds(pool: KVPool) -> list[str]:
    return [f.kind for f in pool.findings()]


def _records(pool: KVPool, block: int) -> np.ndarray:
    return pool.view.provenance[block]


def test_the_layout_has_a_provenance_record_per_token_slot(pool):
    # GIVEN a pool of 48 blocks of 4 tokens (layout version 6 and later)
    assert FORMAT_VERSION >= 6
    # THEN its provenance section holds a 32-byte record per token slot, block-major
    assert pool.view.provenance.shape == (48, 4)
    assert pool.view.provenance.dtype.itemsize == 32
    assert int(pool.view.h["off_provenance"]) == pool.view.offsets["provenance"]
    # ... after a generation per block (the one word a check reads of an unrecorded block)
    assert pool.view.provenance_recorded.shape == (48,)


def test_allocate_and_append_record_each_slot_with_its_position_and_token(pool):
    # GIVEN a sampled sequence's prompt and two appended tokens
    seq = pool.allocate("a", list(range(10, 16)))
    pool.append(seq, [70, 71])
    # THEN each of its 8 slots says its position and token, under the block's generation
    b0, b1 = seq.block_table
    for j, b in enumerate((b0, b1)):
        rec = _records(pool, b)
        gen = int(pool.view.blocks["generation"][b])
        assert list(rec["position"]) == [4 * j + i for i in range(4)]
        assert list(rec["generation"]) == [gen] * 4
    assert list(_records(pool, b0)["token"]) == [10, 11, 12, 13]
    assert list(_records(pool, b1)["token"]) == [14, 15, 70, 71]
    assert len(set(_records(pool, b0)["seq_id"])) == 1
    assert [int(pool.view.provenance_recorded[b]) for b in (b0, b1)] == [
        int(pool.view.blocks["generation"][b]) for b in (b0, b1)
    ]
    # ... and the sweep finds nothing
    assert pool.check_provenance() == []


def _fnv1a_folded(data: bytes) -> int:
    h = 1469598103934665603
    for byte in data:
        h = ((h ^ byte) * 1099511628211) % (1 << 64)
    return (h ^ (h >> 32)) & 0xFFFFFFFF


@pytest.mark.parametrize("request_id", ["r", "req-12", "x" * 31, "x" * 32, "y" * 40, "a\x00b"])
def test_each_record_holds_the_hash_of_its_requests_32_bytes(pool, request_id):
    # GIVEN a sampled sequence of a request id short, long, cut at 32 bytes, or with a zero byte
    seq = pool.allocate(request_id, [1, 2, 3])
    pool.append(seq, [4, 5])
    # THEN each slot's record holds the FNV-1a of the id's 32 bytes (zero-padded), folded to 32
    # bits: the allocation's slots and the append's alike
    want = _fnv1a_folded(request_id.encode()[:32].ljust(32, b"\0"))
    b0, b1 = seq.block_table
    written = [*_records(pool, b0)["request_hash"], _records(pool, b1)["request_hash"][0]]
    assert [int(h) for h in written] == [want] * 5


def test_a_prefix_hit_on_clean_blocks_and_a_fork_find_nothing(pool):
    # GIVEN a published prompt, a hit on it, a fork and appends on both
    a = pool.allocate("a", list(range(9)))
    assert pool.mark_computed(a, 8) == 2
    b = pool.allocate("b", list(range(9)))
    assert b.block_table[:2] == a.block_table[:2]
    c = pool.fork(b, "c")
    pool.append(b, [1, 2, 3, 4])
    pool.append(c, [5])  # (a copy-on-write of the shared last block: its records copied)
    # THEN no foreign slot, at the hit or in the sweep
    assert pool.check_provenance() == []
    assert _kinds(pool) == []
    copied = c.block_table[-1]
    assert list(_records(pool, copied)["token"][:2]) == [8, 5]
    assert int(_records(pool, copied)["generation"][0]) == int(
        pool.view.blocks["generation"][copied]
    )


def test_a_hit_on_a_block_holding_another_requests_kv_is_reported_at_the_hit(pool):
    # GIVEN a published prompt, one of whose slots another request's late store wrote
    # (the record rewritten as the core records a write: its generation last)
    a = pool.allocate("owner", list(range(9)))
    assert pool.mark_computed(a, 8) == 2
    second = a.block_table[1]
    pool.free(a)
    pool.view.provenance[second, 2]["token"] = 777
    # WHEN another request hits that prefix
    b = pool.allocate("hitter", list(range(9)))
    # THEN one foreign_slot finding, at the hit, about that block, naming the hit's request
    (f,) = pool.findings()
    assert f.kind == "foreign_slot"
    assert f.block == second and f.request == "hitter"
    assert "a prefix hit: slot 2 of block" in f.message
    assert "as position 6 (token 6)" in f.message and "(token 777)" in f.message
    # ... and the sweep of the hitting sequence reports that block no more (once per block)
    assert pool.check_provenance([b]) == []
    assert len(pool.findings()) == 1


def test_a_published_slot_whose_kv_changed_since_is_reported_at_the_hit(pool):
    # GIVEN a published prompt with its K/V stored (a CPU pool: each slot's hash recorded)
    a = pool.allocate("owner", list(range(9)))
    pool.kv[:, :, a.block_table[:2], :4] = torch.randn(
        pool.kv[:, :, a.block_table[:2], :4].shape, generator=torch.Generator().manual_seed(0)
    )
    assert pool.mark_computed(a, 8) == 2
    assert all(int(h) != 0 for h in _records(pool, a.block_table[0])["kv_hash"])
    # WHEN something writes one slot's K/V afterwards, and another request hits the prefix
    pool.kv[0, 1, a.block_table[0], 3] += 1.0
    pool.allocate("hitter", list(range(9)))
    # THEN one foreign_slot at the hit, about that slot, saying its hash changed
    (f,) = pool.findings()
    assert f.kind == "foreign_slot" and f.block == a.block_table[0] and f.request == "hitter"
    assert "slot 3 of block" in f.message and "was written since its publication" in f.message


def test_the_sweep_finds_a_slot_written_for_another_position(pool):
    # GIVEN a live sequence one of whose slots says it was written for another position
    a = pool.allocate("a", list(range(6)))
    pool.view.provenance[a.block_table[1], 0]["position"] = 40
    # WHEN swept
    found = pool.check_provenance([a])
    # THEN one foreign_slot about that block, naming the sequence's request
    assert [(f.kind, f.block, f.request) for f in found] == [
        ("foreign_slot", a.block_table[1], "a")
    ]
    assert "position 4" in found[0].message and "position 40" in found[0].message


def test_an_unsampled_sequence_is_not_recorded_and_a_reused_block_not_checked(pool):
    # GIVEN a recorded sequence freed, its blocks handed out again to an unsampled one
    a = pool.allocate("a", list(range(8)))
    blocks = set(a.block_table)
    pool.free(a)
    pool.provenance_sample = 0
    seqs = [pool.allocate(f"u{i}", list(range(100 + 8 * i, 108 + 8 * i))) for i in range(24)]
    reused = [s for s in seqs if set(s.block_table) & blocks]
    assert reused
    # THEN the old records do not count (their generation is not the blocks' now)
    pool.provenance_sample = 1
    assert pool.check_provenance() == []
    for b in blocks:
        assert all(
            int(g) != int(pool.view.blocks["generation"][b])
            for g in _records(pool, b)["generation"]
        )


def test_one_sequence_in_n_is_recorded(pool):
    # GIVEN a sample of one sequence in 4
    pool.provenance_sample = 4
    assert pool.provenance_sample == 4
    seqs = [pool.allocate(f"r{i}", [i, i + 1]) for i in range(8)]
    # THEN exactly the sequences whose id is a multiple of 4 have records
    for s in seqs:
        rec = _records(pool, s.block_table[0])
        gen = int(pool.view.blocks["generation"][s.block_table[0]])
        recorded = int(rec["generation"][0]) == gen
        assert recorded == (s.seq_id % 4 == 0), s.seq_id


def test_a_bad_sample_is_refused(pool):
    with pytest.raises(PoolError, match="provenance sample -1"):
        pool.provenance_sample = -1


def test_the_fault_writes_a_slot_of_a_published_block_and_the_hit_reports_it(pool):
    # GIVEN a published prompt, and the foreign-slot fault armed for the first opportunity
    owner = pool.allocate("owner", list(range(9)))
    assert pool.mark_computed(owner, 8) == 2
    writer = pool.allocate("writer", list(range(50, 55)))
    faults.configure("foreign-slot:1")
    # WHEN the writer appends (its write also lands in a slot of the owner's published block)
    pool.append(writer, [99])
    assert faults.FIRED[-1] == "foreign-slot"
    assert _kinds(pool) == []
    # ... and a third request hits that prefix
    pool.allocate("reader", list(range(9)))
    # THEN exactly one foreign_slot, at the hit, naming the reader and the writer
    (f,) = pool.findings()
    assert f.kind == "foreign_slot" and f.request == "reader"
    assert f.block in owner.block_table[:2]
    assert "request 'writer'" in f.message and "token 99" in f.message


def test_the_fault_waits_for_a_published_block_it_can_write(pool):
    # GIVEN the fault armed, and nothing published but the writer's own blocks
    faults.configure("foreign-slot:1")
    a = pool.allocate("a", list(range(9)))
    pool.mark_computed(a, 8)
    pool.append(a, [1])
    # THEN it has not fired (its only published blocks are its own) ...
    assert faults.ARMED == {"foreign-slot": 1}
    # ... until another request appends
    b = pool.allocate("b", [7, 7])
    pool.append(b, [3])
    assert "foreign-slot" not in faults.ARMED
    assert [f.kind for f in pool.check_provenance([a])] == ["foreign_slot"]


def test_without_provenance_the_fault_has_no_opportunity(pool):
    # GIVEN provenance off and the fault armed
    pool.provenance_sample = 0
    faults.configure("foreign-slot:1")
    a = pool.allocate("a", list(range(9)))
    pool.mark_computed(a, 8)
    b = pool.allocate("b", [7, 7])
    pool.append(b, [3])
    # THEN it never fired
    assert faults.ARMED == {"foreign-slot": 1}
    assert _kinds(pool) == []


def test_another_handles_hit_checks_the_publishers_records(pool, pool_name):
    # GIVEN a prompt published by one handle, one of whose slots another token wrote since
    a = pool.allocate("owner", list(range(9)))
    assert pool.mark_computed(a, 8) == 2
    pool.view.provenance[a.block_table[0], 1]["token"] = 555
    # WHEN a second handle (its own client record) with provenance on hits that prefix
    other = KVPool.attach(pool_name)
    try:
        other.provenance_sample = 1
        other.allocate("elsewhere", list(range(9)))
        # THEN its hit reports the slot, naming its own request
        (f,) = other.findings()
        assert (f.kind, f.block, f.request) == ("foreign_slot", a.block_table[0], "elsewhere")
    finally:
        other.close()


def _hit_in_a_child(pool_name: str) -> None:
    other = KVPool.attach(pool_name)
    other.provenance_sample = 1
    seq = other.allocate("elsewhere", list(range(9)))
    other.free(seq)
    other.close()


def test_a_hit_in_another_process_names_that_process(pool, pool_name):
    # GIVEN a prompt published by this process, one of whose slots another token wrote since
    a = pool.allocate("owner", list(range(9)))
    assert pool.mark_computed(a, 8) == 2
    pool.view.provenance[a.block_table[0], 1]["token"] = 555
    # WHEN another process hits that prefix
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=_hit_in_a_child, args=(pool_name,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    # THEN the finding names the hitting request and its process, not the publisher's
    (f,) = pool.findings()
    assert (f.kind, f.request) == ("foreign_slot", "elsewhere")
    assert f.owner_pid == child.pid != pool.pid
