"""Unit tests of every pool operation: allocate, append, fork, copy-on-write, free, evict, preempt."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvscope.allocator import BlockState, KVPool, PoolConfig, PoolError, PoolExhausted
from tests.forking import fork_child, wait_child


def test_allocate_reserves_ceil_blocks_and_check_is_clean(make_pool):
    # GIVEN a pool with block size 4
    pool = make_pool(64)
    # WHEN a 10-token prompt is allocated
    seq = pool.allocate("r1", list(range(10)))
    # THEN it holds 3 distinct blocks, the pool counts them and check() is clean
    assert len(set(seq.block_table)) == 3
    assert pool.block_table(seq) == seq.block_table
    st = pool.stats()
    assert st["num_allocated"] == 3
    assert st["num_free"] + st["num_local"] + st["num_allocated"] == 64
    assert pool.check() == []


def test_block_records_ownership_tokens_and_generation(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("req-7", [5, 6, 7, 8, 9])
    b = pool.view.blocks
    first, second = seq.block_table
    assert b["tokens"][first].tolist() == [5, 6, 7, 8]
    assert b["num_tokens"][second] == 1 and b["tokens"][second][0] == 9
    assert b["request"][first] == b"req-7"
    assert b["owner_pid"][first] == pool.pid
    assert b["generation"][first] == 1
    assert b["alloc_ns"][first] > 0
    pool.free(seq)
    again = pool.allocate("req-8", [1, 2, 3, 4, 5, 6, 7, 8])
    # Blocks are recycled from the local cache, with a new generation each time.
    assert set(again.block_table) & {first, second}
    reused = (set(again.block_table) & {first, second}).pop()
    assert b["generation"][reused] == 2


def test_append_fills_last_block_then_takes_new_ones(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("r", [1, 2, 3])
    assert pool.append(seq, [4]) == []
    assert seq.num_blocks == 1 and seq.num_tokens == 4
    assert pool.append(seq, [5, 6, 7, 8, 9]) == []
    assert seq.num_blocks == 3
    assert pool.view.blocks["tokens"][seq.block_table[2]][0] == 9
    assert pool.view.seqs["num_tokens"][seq.slot] == 9
    assert pool.check() == []


def test_prefix_hit_after_mark_computed_shares_blocks(make_pool):
    pool = make_pool(32)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    a = pool.allocate("a", prompt)
    assert a.num_cached_tokens == 0
    # Nothing is shared before the KV is marked computed.
    b0 = pool.allocate("b0", prompt)
    assert b0.num_cached_tokens == 0
    pool.free(b0)
    assert pool.mark_computed(a, len(prompt)) == 3
    b = pool.allocate("b", prompt[:12] + [999])
    assert b.num_cached_tokens == 12
    assert b.block_table[:3] == a.block_table[:3]
    assert pool.view.blocks["refcount"][a.block_table[0]] == 2
    assert pool.stats()["prefix_hits"] == 3
    # A prompt that is exactly its cached blocks recomputes the last one (its logits are needed).
    c = pool.allocate("c", prompt[:12])
    assert c.num_cached_tokens == 8
    assert pool.check() == []


def test_prefix_hit_is_verified_against_stored_tokens(make_pool):
    # GIVEN a published prefix whose stored token ids are then changed (a forged hash collision)
    pool = make_pool(32)
    a = pool.allocate("a", list(range(9)))
    pool.mark_computed(a, 9)
    pool.view.blocks["tokens"][a.block_table[0], 0] = 12345
    # WHEN another prompt with the same hash chain arrives
    b = pool.allocate("b", list(range(9)))
    # THEN the hit is refused: no other prompt's KV is returned
    assert b.num_cached_tokens == 0
    assert not set(b.block_table) & set(a.block_table)


def test_free_keeps_published_blocks_cached_and_hit_revives_them(make_pool):
    pool = make_pool(32)
    prompt = list(range(9))
    a = pool.allocate("a", prompt)
    pool.mark_computed(a, 9)
    shared = a.block_table[:2]
    pool.free(a)
    assert pool.stats()["num_cached"] == 2
    assert (pool.view.blocks["state"][shared] == BlockState.CACHED).all()
    b = pool.allocate("b", prompt)
    assert b.block_table[:2] == shared
    assert (pool.view.blocks["state"][shared] == BlockState.ALLOCATED).all()
    assert pool.check() == []


def test_fork_shares_everything_and_cow_on_first_write(make_pool):
    pool = make_pool(32)
    parent = pool.allocate("p", [1, 2, 3, 4, 5, 6])
    child = pool.fork(parent, "c")
    assert child.block_table == parent.block_table
    assert (pool.view.blocks["refcount"][parent.block_table] == 2).all()
    # The last block is partly filled and shared: the child's first append copies it.
    copies = pool.append(child, [7])
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == parent.block_table[-1] and dst == child.block_table[-1] and src != dst
    assert pool.view.blocks["tokens"][dst][:3].tolist() == [5, 6, 7]
    assert pool.view.blocks["refcount"][src] == 1
    # The parent now owns its last block alone: no copy.
    assert pool.append(parent, [8]) == []
    assert pool.stats()["num_cow"] == 1
    assert pool.check() == []
    pool.free(parent)
    pool.free(child)
    assert pool.check() == []
    assert pool.stats()["num_allocated"] == 0


def test_eviction_takes_least_recently_used_cached_blocks_first(make_pool):
    pool = make_pool(8, local_cache_size=0)
    old = pool.allocate("old", list(range(5)))  # 2 blocks
    pool.mark_computed(old, 5)
    pool.free(old)  # 1 cached, 1 free
    new = pool.allocate("new", list(range(50, 55)))
    pool.mark_computed(new, 5)
    pool.free(new)
    cached_old = old.block_table if old.block_table else None
    assert pool.stats()["num_cached"] == 2
    before = pool.view.blocks["access_ns"].copy()
    # Fill the pool: 6 free blocks then eviction of the older cached one first.
    big = pool.allocate("big", list(range(200, 228)))  # 7 blocks
    st = pool.stats()
    assert st["num_evictions"] == 1 and st["num_cached"] == 1
    survivor = np.flatnonzero(pool.view.blocks["state"] == BlockState.CACHED)[0]
    victim_time = before[before > 0].min()
    assert before[survivor] > victim_time
    assert cached_old is None
    pool.free(big)
    assert pool.check() == []


def test_eviction_from_a_large_cache_stays_least_recently_used_across_batches(make_pool):
    # GIVEN a cache larger than the LRU list (tests/test_lru_list.py: the C core's list)
    from kvscope.allocator.records import LRU_KEEP

    pool = make_pool(3 * LRU_KEEP, block_size=4, local_cache_size=0)
    for i in range(3 * LRU_KEEP - 8):
        s = pool.allocate(f"p{i}", [i, i, i, i, 0])
        pool.mark_computed(s, 4)
        pool.free(s)
    # AND some of the oldest cached blocks are hit again (they become the newest)
    revived = []
    for i in range(0, 40, 2):
        s = pool.allocate(f"again{i}", [i, i, i, i, 1])
        assert s.num_cached_tokens == 4
        revived.append(s.block_table[0])
        pool.free(s)
    b = pool.view.blocks
    # WHEN blocks are evicted in many small batches
    evicted = []
    for _ in range(30):
        cached = np.flatnonzero(b["state"] == BlockState.CACHED)
        oldest = cached[np.argsort(b["access_ns"][cached], kind="stable")][:3]
        before = set(np.flatnonzero(b["state"] == BlockState.CACHED).tolist())
        assert pool.evict(3) == 3
        gone = before - set(np.flatnonzero(b["state"] == BlockState.CACHED).tolist())
        # THEN each batch takes exactly the least recently used blocks
        assert gone == set(oldest.tolist())
        evicted += sorted(gone)
    # AND the revived blocks were not evicted with their old neighbours
    assert not set(revived) & set(evicted)
    assert pool.check() == []


def test_exhausted_names_holders_and_leaves_pool_unchanged(make_pool):
    pool = make_pool(4, local_cache_size=0)
    a = pool.allocate("holder-a", list(range(12)))  # 3 blocks
    with pytest.raises(PoolExhausted) as e:
        pool.allocate("b", list(range(8)))
    assert e.value.needed == 2 and e.value.free == 1
    assert "holder-a=3" in str(e.value)
    assert pool.stats()["num_sequences"] == 1
    assert pool.check() == []
    pool.free(a)


def test_exhausted_counts_the_holders_it_does_not_name(make_pool):
    # GIVEN a pool held by 7 requests (the message names the 5 biggest)
    pool = make_pool(16, local_cache_size=0)
    held = [pool.allocate(f"r{i}", list(range(i * 100, i * 100 + 8))) for i in range(7)]
    # WHEN an allocation finds it full THEN the 2 left out are counted (not what they hold:
    # requests that share a prefix map the same blocks)
    with pytest.raises(PoolExhausted) as e:
        pool.allocate("b", list(range(5000, 5012)))
    assert len(e.value.holders) == 7
    assert "and 2 more requests);" in str(e.value)
    for s in held:
        pool.free(s)


def test_exhausted_names_the_blocks_a_dead_process_still_holds(make_pool):
    # GIVEN a pool most of which two requests of a process that died attached still hold (a
    # shared prompt: the blocks they share counted once)
    pool = make_pool(16, local_cache_size=0)
    pid = os.fork()
    if pid == 0:
        try:
            p = type(pool).attach(pool.name)
            first = p.allocate("w1-r1", list(range(40)))  # 10 blocks
            p.mark_computed(first, 40)
            p.allocate("w1-r2", list(range(40)) + [7, 7])  # 10 shared + 1
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    mine = pool.allocate("mine", list(range(100, 112)))  # 3 of the 5 left
    # WHEN this process's next allocation finds the pool full
    with pytest.raises(PoolExhausted) as e:
        pool.allocate("b", list(range(5000, 5012)))
    # THEN the message says which dead process holds how many blocks, and what hands them back
    assert e.value.dead == {pid: 11}
    assert (
        f"11 of the held blocks belong to requests of processes that died (pid {pid}: 11)"
        in str(e.value)
    )
    assert "pool.reclaim_dead()" in str(e.value)
    # AND once they are reclaimed the allocation fits
    pool.reclaim_dead()
    pool.free(pool.allocate("b", list(range(5000, 5012))))
    pool.free(mine)


def test_exhausted_says_which_free_blocks_sit_in_other_processes_local_caches(make_pool):
    # GIVEN a pool of 16 blocks and another process that allocated and freed 8 of them and
    # keeps its handle open (its freed blocks stay in its local cache)
    pool = make_pool(16, local_cache_size=4)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()

    def side() -> int:
        p = KVPool.attach(pool.name)
        for s in [p.allocate(f"side{i}", [i] * 4) for i in range(8)]:
            p.free(s)
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        p.close()
        return 0

    pid = fork_child(side, 60)
    os.read(ready_r, 1)
    try:
        # WHEN this process asks for every block
        with pytest.raises(PoolExhausted) as e:
            pool.allocate("big", list(range(64)))
    finally:
        os.write(done_w, b"x")
        assert wait_child(pid) == 0
    # THEN all 16 count as free, and the error says how many of them the other process keeps
    held_there = e.value.elsewhere[pid]
    assert e.value.free == 16 and 0 < held_there <= 8
    assert (
        f"({held_there} of them in other processes' local caches, pid {pid}: {held_there})"
        in str(e.value)
    )
    assert "local_cache_size" in str(e.value)
    assert pool.check() == []


def test_a_prefix_hit_that_runs_out_of_blocks_gives_its_hits_back(make_pool):
    # GIVEN a full pool whose published prefix is still in use
    pool = make_pool(6, local_cache_size=0)
    a = pool.allocate("a", list(range(9)))  # 3 blocks, 2 of them published
    pool.mark_computed(a, 8)
    hold = pool.allocate("hold", list(range(100, 112)))  # the other 3
    refcounts = pool.view.blocks["refcount"].copy()
    # WHEN a prompt hits that prefix but needs 2 new blocks
    with pytest.raises(PoolExhausted) as e:
        pool.allocate("b", list(range(8)) + list(range(200, 208)))
    # THEN its hits were given back: refcounts, sequences and the report are as before
    assert (pool.view.blocks["refcount"] == refcounts).all()
    assert pool.stats()["num_sequences"] == 2
    assert "b" not in e.value.holders and e.value.needed == 2
    assert pool.check() == []
    pool.free(a)
    pool.free(hold)
    assert pool.check() == []


def test_running_sequences_are_never_preempted_waiting_ones_are(make_pool):
    pool = make_pool(4, local_cache_size=0)
    run = pool.allocate("run", list(range(4)))
    wait = pool.allocate("wait", list(range(8)))
    pool.set_state(wait, "waiting")
    got = pool.allocate("new", list(range(12)))  # needs 3 blocks: only by preempting "wait"
    assert wait.state == "preempted" and wait.block_table == []
    assert run.block_table and got.num_blocks == 3
    assert pool.stats()["num_preemptions"] == 1
    with pytest.raises(PoolExhausted):
        pool.allocate("more", list(range(4)))
    pool.free(got)
    assert pool.resume(wait) == 0
    assert wait.num_blocks == 2 and wait.state == "running"
    assert pool.check() == []


def test_abort_and_double_free_are_rejected(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("r", [1, 2, 3])
    pool.abort(seq)
    assert seq.state == "aborted"
    with pytest.raises(PoolError, match="already aborted"):
        pool.free(seq)
    assert pool.stats()["num_allocated"] == 0


def test_sequence_from_another_pool_is_rejected(make_pool):
    a = make_pool(16)
    b = make_pool(16)
    seq = a.allocate("r", [1, 2])
    with pytest.raises(PoolError, match="another pool"):
        b.free(seq)
    with pytest.raises(PoolError, match="expected a Sequence"):
        b.free("r")  # type: ignore[arg-type]


def test_long_sequence_is_allocated_and_freed_in_chunks(make_pool):
    pool = make_pool(1200, block_size=4, max_blocks_per_seq=1024)
    seq = pool.allocate("long", list(range(4 * 1000)))
    assert seq.num_blocks == 1000
    assert pool.check() == []
    pool.append(seq, list(range(4 * 20)))
    assert seq.num_blocks == 1020
    pool.free(seq)
    assert pool.stats()["num_allocated"] == 0
    assert pool.check() == []


def test_attach_sees_the_same_blocks_and_kv_bytes(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("r", [1, 2, 3, 4, 5])
    pool.kv[0, 0, seq.block_table[0]] = 3.5
    other = KVPool.attach(pool.name)
    try:
        assert other.stats()["num_allocated"] == 2
        assert float(other.kv[0, 0, seq.block_table[0]].mean()) == 3.5
        assert other.config.num_blocks == 16 and other.config.block_size == 4
    finally:
        other.close()


def test_evict_returns_cached_blocks_to_the_ring(make_pool):
    pool = make_pool(16)
    a = pool.allocate("a", list(range(9)))
    pool.mark_computed(a, 9)
    pool.free(a)
    assert pool.stats()["num_cached"] == 2
    assert pool.evict(10) == 2
    assert pool.stats()["num_cached"] == 0
    assert pool.check() == []
    b = pool.allocate("b", list(range(9)))
    assert b.num_cached_tokens == 0


def test_slot_mapping_follows_the_block_table(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(6)))
    t = seq.block_table
    assert pool.slot_mapping(seq, 0, 6) == [t[0] * 4 + i for i in range(4)] + [
        t[1] * 4,
        t[1] * 4 + 1,
    ]


def test_prefix_index_survives_full_shards_and_heavy_churn(make_pool):
    # GIVEN a small pool whose prefix index is recycled many times over
    pool = make_pool(16, block_size=4, num_shards=8)
    import random

    rng = random.Random(3)
    # WHEN hundreds of distinct prompts are published, freed and evicted
    for i in range(400):
        prompt = [rng.randrange(1000) for _ in range(13)]
        seq = pool.allocate(f"r{i}", prompt)
        pool.mark_computed(seq, len(prompt))
        pool.free(seq)
    # THEN the index and the blocks still agree
    assert pool.check() == []
    assert pool.stats()["num_evictions"] > 100


def test_verify_reports_a_header_scribble_and_lost_free_blocks(make_pool, monkeypatch):
    # GIVEN a pool with the magic and leaks probes on
    monkeypatch.setenv("KVSCOPE_MAGIC", "1")
    monkeypatch.setenv("KVSCOPE_LEAKS", "1")
    pool = make_pool(16)
    assert pool.verify() == []
    # WHEN a FREE block silently leaves the ring (its state changed behind the allocator's back)
    ring_block = int(pool.view.ring[int(pool.view.ring_header["head"][0]) % 16])
    pool.view.blocks["state"][ring_block] = BlockState.ALLOCATED
    # THEN the per-step verify finds the broken conservation
    assert [f.kind for f in pool.verify()] == ["free_list_corrupt"]
    pool.view.blocks["state"][ring_block] = BlockState.FREE
    # WHEN the header is scribbled
    off = pool.view.header.dtype.fields["num_blocks"][1]
    pool.view.raw[off] ^= 0xFF
    found = pool.verify()
    # THEN header_corrupt names the field, the bytes found and expected
    assert found[0].kind == "header_corrupt"
    assert found[0].extra["field"] == "num_blocks"
    assert found[0].extra["found"] != found[0].extra["expected"]
    assert "header_corrupt" in {f.kind for f in pool.findings()}
    pool.view.raw[off] ^= 0xFF


def test_guard_mode_quarantines_freed_blocks_for_n_allocations(make_pool):
    # GIVEN a guard-mode pool whose freed blocks stay quarantined for 4 allocations
    pool = make_pool(8, guard=True, quarantine=4, local_cache_size=0)
    assert pool.slots_per_block == pool.block_size + 1
    prompt = pool.allocate("prompt", list(range(9)))  # 2 full blocks (published) + 1
    pool.mark_computed(prompt, 9)
    filler = pool.allocate("filler", list(range(100, 116)))  # 4 blocks
    victim = pool.allocate("victim", [1])  # the last free block
    freed = victim.block_table[0]
    pool.free(victim)
    assert pool.view.blocks["state"][freed] == BlockState.QUARANTINED
    # THEN its token slots are poisoned and its guard slot still holds the canary
    assert torch.isnan(pool.kv[:, :, freed, : pool.block_size]).all()
    from kvscope.kernels import guard_scan

    assert guard_scan(pool.kv, blocks=[freed]) == []
    # WHEN older free blocks line up behind it (the published prefix, evicted)
    pool.free(prompt)
    assert pool.evict(2) == 2
    # THEN allocations take the older blocks while the freed one waits out its quarantine
    first = pool.allocate("a", [5, 6])
    second = pool.allocate("b", [7, 8])
    assert freed not in first.block_table + second.block_table
    assert pool.check() == []
    for s in (first, second, filler):
        pool.free(s)


def test_guard_violation_is_found_when_the_block_is_freed(make_pool, monkeypatch):
    # GIVEN a guard-mode pool and a KV write one slot past a block's end
    pool = make_pool(16, guard=True)
    seq = pool.allocate("r", [1, 2, 3, 4, 5])
    blk = seq.block_table[0]
    pool.kv[0, 0, blk, pool.block_size] = 7.0
    # WHEN the request ends
    pool.free(seq)
    # THEN a guard_violation names the block, its owner and request, and the canary is restored
    found = [f for f in pool.findings() if f.kind == "guard_violation"]
    assert (
        found
        and found[0].block == blk
        and found[0].owner_pid == pool.pid
        and found[0].request == "r"
    )
    from kvscope.kernels import guard_scan

    assert guard_scan(pool.kv, blocks=[blk]) == []


def test_a_rolled_back_preemption_leaves_the_waiting_sequences_kv_intact(make_pool):
    # GIVEN a guard-mode pool with a waiting sequence whose KV is written
    pool = make_pool(4, guard=True, local_cache_size=0)
    wait = pool.allocate("wait", list(range(8)))  # 2 blocks
    pool.kv[:, :, wait.block_table, : pool.block_size] = 1.0
    pool.set_state(wait, "waiting")
    run = pool.allocate("run", [1, 2, 3])  # 1 block, 1 left free
    # WHEN an allocation preempts it but still cannot fit, and is rolled back
    with pytest.raises(PoolExhausted):
        pool.allocate("big", list(range(100, 116)))  # 4 blocks
    # THEN the waiting sequence still holds its blocks and its KV was not poisoned
    assert wait.state == "waiting" and len(wait.block_table) == 2
    assert bool((pool.kv[:, :, wait.block_table, : pool.block_size] == 1.0).all())
    assert pool.check() == []
    pool.free(run)
    pool.free(wait)


def test_the_largest_local_cache_never_overflows_its_record(make_pool):
    # GIVEN the largest local cache (its record holds 64 ids; frees park up to twice the size)
    pool = make_pool(256, local_cache_size=64)
    seqs = [pool.allocate(f"r{i}", list(range(i, i + 160))) for i in range(3)]
    # WHEN three 40-block sequences are freed one after another
    for s in seqs:
        pool.free(s)
    # THEN what does not fit goes back to the ring and the pool stays consistent
    assert pool.check() == []
    assert pool.stats()["num_allocated"] == 0


def test_a_prompts_blocks_share_one_index_shard(make_pool):
    # GIVEN two published 16-block prompts in a pool with 8 index shards
    pool = make_pool(128, num_shards=8)
    shards = []
    for first in (0, 1000):
        seq = pool.allocate(f"p{first}", list(range(first, first + 16 * 4)))
        pool.mark_computed(seq, seq.num_tokens)
        keys = pool.view.blocks["prefix_hash"][seq.block_table].astype(np.uint64)
        # THEN every block of a prompt is keyed into the shard of its first block
        assert len({int(k) & 7 for k in keys}) == 1 and all(int(k) for k in keys)
        shards.append(int(keys[0]) & 7)
        # AND a second allocation of the prompt still hits every full block
        again = pool.allocate(f"again{first}", list(range(first, first + 16 * 4 + 1)))
        assert again.num_cached_tokens == 16 * 4
    assert pool.check() == []


@pytest.mark.parametrize("deferred", [False, True])
def test_a_closed_pool_with_every_probe_lets_go_of_its_segment_with_its_last_reference(
    probes, monkeypatch, pool_name, deferred
):
    # GIVEN a pool in guard mode with lockdep, slot provenance and a store check (and with its
    # K/V checks queued, as a CUDA pool's are), closed and unlinked, with the cyclic collector
    # off (a loop of few allocations may not run it for a long while)
    import gc
    import weakref

    from kvscope.allocator import devicechecks
    from kvscope.probes.stores import Writers

    monkeypatch.setenv("KVSCOPE_PROVENANCE_SAMPLE", "1")
    # (deferred: its K/V checks through the core's queue, as a CUDA pool's are)
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", deferred)
    cfg = PoolConfig(num_blocks=16, block_size=4, head_dim=4, guard=True, lockdep=True)
    was = gc.isenabled()
    gc.disable()
    try:
        pool = KVPool.create(pool_name, cfg)
        pool.trace_locks(True)
        s = pool.allocate("a", list(range(9)))
        Writers(pool, [(s, 0, 9)]).check(np.array(pool.slot_mapping(s, 0, 9)))
        pool.mark_computed(s, 8)
        pool.free(pool.fork(s, "b"))
        pool.free(s)
        pool.close()
        pool.unlink()
        gone = weakref.ref(pool)
        # WHEN its last reference goes
        del pool, s
        # THEN so does the pool, and its segment's mapping with it
        assert gone() is None
    finally:
        if was:
            gc.enable()
