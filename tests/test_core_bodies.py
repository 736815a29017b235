"""Inside the C core's operations what stops a transaction is dealt with in the core. A take whose shards changed
between its plan and its locks runs again under every shard; an
eviction too large for the undo journal is evicted ahead and the operation runs again; a long prompt, resume, append or mark_computed is one call into the core, in as
many transactions as the journal needs; a K/V check that needs the op mutex another thread holds
waits for it after the rollback; a cached block the prefix index lacks is evicted and reported;
guard mode's preemption is the core's; a full sequence table and a sequence past
max_blocks_per_seq are PoolErrors raised by the core. Each test checks that the core met no
case it does not handle (`stats()["unhandled"]`: a RuntimeError each)."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from kvscope.allocator import (
    BlockState,
    KVPool,
    PoolError,
    PoolExhausted,
    devicechecks,
    integrity,
)
from kvscope.allocator.errors import JournalFull
from kvscope.allocator.findings import read_findings
from kvscope.allocator.layout import CHUNK, SeqState
from kvscope.allocator.waits import wait_word
from tests import lockholder
from tests.forking import fork_child, wait_child
from tests.test_eviction_journal import hold_free_blocks


def _unhandled(pool: KVPool) -> int:
    return pool._core.stats()["unhandled"]


def _txns(pool: KVPool) -> int:
    """Transactions this handle has begun (its client seq goes odd, then even, at each)."""
    return int(pool.view.clients["seq"][pool.client]) // 2


def _shard(pool: KVPool, block: int) -> int:
    return int(pool.view.blocks["prefix_hash"][block]) & (pool.view.layout.num_shards - 1)


def _cache(pool: KVPool, blocks: int, first: int) -> None:
    """`blocks` cached blocks: prompts of 8 full blocks each, published and freed."""
    bs = pool.block_size
    for i in range(blocks // 8):
        s = pool.allocate(f"c{first + i}", [first + 1000 * i + j for j in range(8 * bs)])
        assert pool.mark_computed(s, 8 * bs) == 8
        pool.free(s)


# -- a take whose shards changed between its plan and its locks ----------------------------------


def test_a_take_whose_shards_changed_before_its_locks_runs_again_under_every_shard(
    make_pool, monkeypatch
):
    bs = 4
    # (4 clients: a slot reserve each, so that neither allocation below takes the seqs lock)
    pool = make_pool(96, block_size=bs, local_cache_size=0, max_seqs=64, max_clients=4)
    # GIVEN a live published prompt (its first block indexed in shard S), cached prompts of two
    # blocks in every other shard, one shard each, and two blocks in the free ring
    p = pool.allocate("p", [1] * (2 * bs))
    pool.mark_computed(p, 2 * bs)
    s_home = _shard(pool, p.block_table[0])
    used, kept = {s_home}, []
    for i in range(64):
        if len(used) == pool.view.layout.num_shards:
            break
        s = pool.allocate(f"c{i}", [100 + 10 * i + j for j in range(2 * bs)])
        pool.mark_computed(s, 2 * bs)
        if _shard(pool, s.block_table[0]) in used:
            kept.append(s)  # (held: only one cached prompt a shard)
            continue
        used.add(_shard(pool, s.block_table[0]))
        pool.free(s)
    assert len(used) == pool.view.layout.num_shards
    two = pool.allocate("two", [90_000 + j for j in range(2 * bs)])
    hold_free_blocks(pool)
    pool.free(two)  # (no local cache: to the ring)
    st = pool.stats()
    assert st["num_free"] == 2 and st["num_local"] == 0 and st["num_cached"] == 14
    # (another process, which takes the ring's blocks when told: go, then finish)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = fork_child(lambda: _drain_when_told(pool.name, bs, go_r, done_w), 60)
    os.close(go_r)
    os.close(done_w)
    assert os.read(done_r, 1) == b"r"
    unhandled = _unhandled(pool)
    home = pool.SHARDS[s_home]
    acquires = pool.view.locks["num_acquires"][pool.SHARDS].copy()
    # WHEN a prompt hitting p's first block and needing two new blocks plans its locks (the ring
    # holds two: its plan evicts one more, for the hit it cannot count on yet) and waits for
    # shard S, held here
    lockholder.hold(pool, home)
    got: dict = {}

    def allocate_it() -> None:
        try:
            got["seq"] = pool.allocate("t", [1] * bs + [7000 + j for j in range(2 * bs)])
        except BaseException as e:  # (re-raised by the test)
            got["error"] = e

    t = threading.Thread(target=allocate_it)
    t.start()
    deadline = time.monotonic() + 60
    while int(pool.view.clients["op"][pool.client]) != wait_word(home, home):
        assert time.monotonic() < deadline, "the allocation never waited for shard S"
        time.sleep(0.001)
    # AND meanwhile another process takes the ring's two blocks
    os.write(go_w, b"g")
    assert os.read(done_r, 1) == b"d"
    assert pool.stats()["num_free"] == 0
    lockholder.let_go(pool, home)
    t.join()
    os.write(go_w, b"f")
    assert wait_child(pid) == 0
    # THEN its take, short under the locks it planned, evicted from shards it did not lock:
    # the core ran it again under every shard, and it holds the hit and two evicted blocks
    if "error" in got:
        raise got["error"]
    seq = got["seq"]
    assert seq.block_table[0] == p.block_table[0] and len(seq.block_table) == 3
    assert seq.num_cached_tokens == bs
    assert _unhandled(pool) == unhandled
    grown = pool.view.locks["num_acquires"][pool.SHARDS] - acquires
    assert (grown >= 1).all(), grown
    assert pool.stats()["num_evictions"] >= 2
    assert pool.check() == []


def _drain_when_told(name: str, bs: int, go: int, done: int) -> int:
    """In another process: attach, say ready ("r"); at "g" take two blocks and say done ("d");
    at "f" give them back and detach. (A warm-up first: its first claim fills its slot
    reserve, and its block goes back to the ring.)"""
    pool = KVPool.attach(name)
    pool.free(pool.allocate("warm", [9]))  # (its slot reserve filled: no seqs lock later)
    os.write(done, b"r")
    os.read(go, 1)
    seq = pool.allocate("drain", [8000 + j for j in range(2 * bs)])
    os.write(done, b"d")
    os.read(go, 1)
    pool.free(seq)
    pool.close()
    return 0


# -- evictions the journal cannot hold, evicted ahead ---------------------------------------------


@pytest.mark.parametrize("op", ["allocate", "append", "resume", "copy-on-write"])
def test_an_eviction_the_journal_cannot_hold_is_evicted_ahead_by_the_core(
    make_pool, monkeypatch, op
):
    # GIVEN blocks of 64 tokens (a record of 384 bytes: 128 evicted and stamped outgrow the
    # 96 KiB journal), 136 cached blocks and no free one
    bs = 64
    pool = make_pool(320, block_size=bs, local_cache_size=4)
    pool.free(pool.allocate("warm", [1]))
    if op == "resume":
        # (a waiting sequence of 128 blocks, preempted by a request for every other block)
        waiting = pool.allocate("w", [2_000_000 + j for j in range(128 * bs)])
        pool.set_state(waiting, "waiting")
        st = pool.stats()
        pool.free(pool.allocate("x", [3] * ((st["num_free"] + st["num_local"] + 1) * bs)))
        assert waiting.state == "preempted"
    if op == "append":
        target = pool.allocate("a", [6] * bs)
    if op == "copy-on-write":
        target = pool.allocate("s", [8] * (bs + 1))
        child = pool.fork(target, "s-child")
    _cache(pool, 136, 100)
    hold_free_blocks(pool)
    assert pool.stats()["num_cached"] == 136
    unhandled, txns, evicted = _unhandled(pool), _txns(pool), pool.stats()["num_evictions"]
    # WHEN the operation needs 128 blocks at once
    if op == "allocate":
        seq = pool.allocate("big", [5] * (128 * bs))
        assert len(seq.block_table) == 128
    elif op == "append":
        assert pool.append(target, [7] * (128 * bs)) == []
        assert len(target.block_table) == 129 and len(target.tokens) == 129 * bs
    elif op == "resume":
        assert pool.resume(waiting) == 0
        assert waiting.state == "running" and len(waiting.block_table) == 128
    else:
        last = target.block_table[-1]
        copies = pool.append(target, [9] * (bs - 1 + 127 * bs))
        assert len(copies) == 1 and copies[0][0] == last == child.block_table[-1]
        assert target.block_table[-1 - 127] == copies[0][1] != last
        assert len(target.block_table) == 129
    # THEN the core evicted them ahead, in transactions of their own, and ran it again: more
    # than one transaction, nothing unhandled, every block evicted is accounted for
    assert _unhandled(pool) == unhandled
    assert _txns(pool) - txns >= 3
    assert pool.stats()["num_evictions"] - evicted >= 128 - 1
    assert pool.check() == []


# -- long operations: one call into the core each --------------------------------------------------


class _Calls:
    """The handle's core, counting the calls made into it."""

    # (the operations' entry points; the slot reserve's refill before them is not counted)
    OPS = {"allocate", "append", "mark_computed", "fork", "end", "set_state", "resume", "evict"}

    def __init__(self, core):
        self.core, self.calls = core, Counter()

    def __getattr__(self, name):
        attr = getattr(self.core, name)
        if not callable(attr):
            return attr

        def call(*a, **k):
            if name in self.OPS:
                self.calls[name] += 1
            return attr(*a, **k)

        return call


def _prompt(first: int, blocks: int, bs: int) -> list[int]:
    return [first] + list(range(10_000, 10_000 + blocks * bs - 2))


# Block size 2: CHUNK blocks a transaction; 256: a record of 1,216 bytes, so a transaction holds
# fewer than CHUNK (the journal's 96 KiB: the core halves them until they fit).
@pytest.mark.parametrize("bs", [2, 256])
def test_a_long_prompt_append_and_publish_are_one_call_into_the_core_each(
    make_pool, monkeypatch, bs
):
    blocks = 2 * CHUNK + 30
    pool = make_pool(3 * blocks + 16, block_size=bs, max_seqs=64, max_blocks_per_seq=600)
    pool.free(pool.allocate("warm", [1]))
    monkeypatch.setattr(KVPool, "append", lambda *a: pytest.fail("KVPool.append ran"))
    unhandled = _unhandled(pool)
    core = pool._core = _Calls(pool._core)
    # WHEN a prompt of more than two CHUNKs of blocks is allocated
    toks = _prompt(7, blocks, bs)
    a = pool.allocate("long", toks)
    # THEN one call allocated every block, in order
    assert core.calls == Counter({"allocate": 1}), core.calls
    assert a.tokens == toks and len(a.block_table) == blocks
    assert len(set(a.block_table)) == blocks
    # WHEN every full block is published THEN one call publishes them all
    assert pool.mark_computed(a, len(toks)) == blocks - 1 == a.num_published
    assert core.calls["mark_computed"] == 1
    # WHEN a second request allocates the same prompt THEN every full block is a hit (of
    # 256 tokens: as many as the journal holds; the rest are new blocks)
    b = pool.allocate("again", toks)
    hits = b.num_cached_tokens // bs
    assert hits == blocks - 1 if bs == 2 else 0 < hits < blocks - 1
    assert b.block_table[:hits] == a.block_table[:hits] and b.tokens == toks
    # WHEN more than two CHUNKs of blocks' worth is appended THEN one call appends them
    monkeypatch.undo()
    more = list(range(2 * CHUNK * bs + 3))
    assert pool.append(a, more) == []
    assert core.calls["append"] == 1
    assert a.tokens == toks + more and len(a.block_table) == -(-len(a.tokens) // bs)
    pool.free(a)
    pool.free(b)
    assert _unhandled(pool) == unhandled
    st = pool.stats()
    assert st["num_allocated"] == 0 and st["num_sequences"] == 0
    assert pool.check() == []


def test_a_long_resume_is_one_call_into_the_core(make_pool, monkeypatch):
    bs = 4
    pool = make_pool(4 * CHUNK, block_size=bs, max_seqs=64, max_blocks_per_seq=4 * CHUNK)
    pool.free(pool.allocate("warm", [1]))
    # GIVEN a preempted sequence of more than two CHUNKs of blocks
    waiting = pool.allocate("w", _prompt(3, 2 * CHUNK + 20, bs))
    old = waiting.slot
    pool.set_state(waiting, "waiting")
    st = pool.stats()
    pool.free(pool.allocate("x", [4] * ((st["num_free"] + st["num_local"] + 1) * bs)))
    assert waiting.state == "preempted"
    unhandled = _unhandled(pool)
    core = pool._core = _Calls(pool._core)
    # WHEN it is resumed
    assert pool.resume(waiting) == 0
    # THEN one call allocated every block in a new slot (the rest appended, the old slot
    # released after them), and it runs again there
    assert core.calls["resume"] == 1 and _unhandled(pool) == unhandled
    assert waiting.state == "running" and waiting.slot != old
    assert len(waiting.block_table) == 2 * CHUNK + 20
    assert int(pool.view.seqs["num_blocks"][waiting.slot]) == 2 * CHUNK + 20
    assert int(pool.view.seqs["state"][old]) == SeqState.EMPTY
    assert pool.live() == {waiting.slot: waiting}
    assert pool.check() == []
    pool.free(waiting)
    assert pool.stats()["num_allocated"] == 0 and pool.check() == []


def test_a_long_resume_that_runs_short_stays_preempted(make_pool, monkeypatch):
    bs = 4
    pool = make_pool(3 * CHUNK, block_size=bs, max_seqs=64, max_blocks_per_seq=3 * CHUNK)
    pool.free(pool.allocate("warm", [1]))
    # GIVEN a preempted sequence of more than a CHUNK of blocks, and a pool that has room for
    # its first CHUNK only
    waiting = pool.allocate("w", _prompt(3, CHUNK + 60, bs))
    old = waiting.slot
    pool.set_state(waiting, "waiting")
    st = pool.stats()
    pool.free(pool.allocate("x", [4] * ((st["num_free"] + st["num_local"] + 1) * bs)))
    assert waiting.state == "preempted"
    keep = pool.allocate("keep", [5] * (3 * CHUNK - CHUNK - 40) * bs)
    unhandled, before = _unhandled(pool), pool.stats()
    # WHEN it is resumed THEN the pool is exhausted, what was taken is given back, and the
    # sequence is still preempted in its slot, as it was
    with pytest.raises(PoolExhausted):
        pool.resume(waiting)
    assert _unhandled(pool) == unhandled
    assert waiting.state == "preempted" and waiting.slot == old and waiting.block_table == []
    assert int(pool.view.seqs["state"][old]) == SeqState.PREEMPTED
    st = pool.stats()
    assert st["num_allocated"] == before["num_allocated"]
    assert st["num_sequences"] == before["num_sequences"]
    assert pool.check() == []
    # AND once there is room it resumes
    pool.free(keep)
    assert pool.resume(waiting) == 0 and len(waiting.block_table) == CHUNK + 60


def test_a_table_no_transaction_can_fork_raises_journal_full(make_pool, monkeypatch):
    # GIVEN blocks of 256 tokens, whose records (1,216 bytes) the journal holds 80 of
    bs = 256
    pool = make_pool(256, block_size=bs, max_blocks_per_seq=256)
    seq = pool.allocate("long", list(range(100 * bs)))
    unhandled, before = _unhandled(pool), pool.stats()
    # WHEN a sequence of 100 blocks is forked (one transaction, as fork.py's)
    # THEN the core raises JournalFull, with nothing changed
    with pytest.raises(JournalFull, match="operation too large for the undo journal"):
        pool.fork(seq, "child")
    assert _unhandled(pool) == unhandled and pool.stats() == before and pool.check() == []


# -- a corrupt cached block, guard mode's preemption ----------------------------------------------


def test_a_cached_block_the_index_lacks_is_evicted_and_reported(make_pool, monkeypatch):
    bs = 4
    pool = make_pool(32, block_size=bs)
    pool.free(pool.allocate("warm", [1]))
    # GIVEN one cached block whose prefix-index entry was wiped (a write outside the allocator)
    s = pool.allocate("p", [3] * (bs + 1))
    pool.mark_computed(s, bs + 1)
    blk = s.block_table[0]
    pool.free(s)
    index = pool.view.index
    at = np.flatnonzero(index["block"] == blk)
    assert len(at) == 1 and pool.view.blocks["state"][blk] == BlockState.CACHED
    index["hash"][at] = 0
    index["block"][at] = -1
    hold_free_blocks(pool)
    unhandled = _unhandled(pool)
    # WHEN an allocation must evict it
    seq = pool.allocate("t", [4] * bs)
    # THEN the core evicts it all the same (nothing could hit it) and reports the record, as
    # check() counts it
    assert seq.block_table == [blk] and _unhandled(pool) == unhandled
    found = [f for f in read_findings(pool.view) if f.kind == "refcount_mismatch"]
    assert [f.block for f in found] == [blk]
    assert "prefix index has no entry" in found[0].message
    assert pool.check() == []


@pytest.mark.parametrize("layers", [1, 2])
def test_guard_mode_preempts_in_the_core(make_pool, monkeypatch, layers):
    bs = 4
    pool = make_pool(64, block_size=bs, guard=True, num_layers=layers)
    pool.free(pool.allocate("warm", [1]))
    # GIVEN a waiting sequence, its K/V written, in guard mode, and no other room
    waiting = pool.allocate("w", list(range(100, 100 + 8 * bs)))
    table = list(waiting.block_table)
    pool.kv[:, :, table, :bs] = 1.0
    pool.set_state(waiting, "waiting")
    held = hold_free_blocks(pool)
    unhandled = _unhandled(pool)
    # WHEN a request needs two blocks
    seq = pool.allocate("new", [7] * (2 * bs))
    # THEN the core preempted the waiting one as guard mode releases: its freed blocks pushed
    # to the ring's tail quarantined, their token slots poisoned at the commit; the ring was
    # empty, so the request took the first two, which are not poisoned
    assert waiting.state == "preempted" and _unhandled(pool) == unhandled
    assert seq.block_table == table[:2]
    rest = table[2:]
    b = pool.view.blocks
    assert (b["state"][rest] == BlockState.QUARANTINED).all()
    assert (b["poisoned"][rest] == 1).all() and (b["poisoned"][table[:2]] == 0).all()
    assert bool(torch.isnan(pool.kv[:, :, rest, :bs]).all())
    assert not bool(torch.isnan(pool.kv[:, :, table[:2], :bs]).any())
    assert pool.findings() == []
    assert pool.check() == []
    for s in (seq, *held):
        pool.free(s)


# -- errors the core raises ------------------------------------------------------------------------


def test_a_full_sequence_table_is_a_pool_error(make_pool, monkeypatch):
    # GIVEN a table of 4 slots (too small for slot reserves: each claim takes the lowest empty
    # slot), all live
    pool = make_pool(64, block_size=4, max_seqs=4)
    for i in range(4):
        pool.allocate(f"s{i}", [i + 1] * 5)
    unhandled = _unhandled(pool)
    # WHEN one more is allocated or forked THEN the core raises SeqTable's error, unchanged
    want = (
        "sequence table full: 4 live sequences and 0 empty slots reserved by attached processes "
        "(PoolConfig.max_seqs is 4); free finished ones or create the pool with a larger max_seqs"
    )
    with pytest.raises(PoolError) as e:
        pool.allocate("one-more", [9] * 5)
    assert str(e.value) == want
    with pytest.raises(PoolError) as e:
        pool.fork(next(iter(pool.live().values())), "fork")
    assert str(e.value) == want
    assert _unhandled(pool) == unhandled and pool.check() == []


def test_a_sequence_past_max_blocks_per_seq_is_a_pool_error(make_pool, monkeypatch):
    pool = make_pool(64, block_size=4, max_blocks_per_seq=6)
    seq = pool.allocate("s", [1] * 20)
    unhandled = _unhandled(pool)
    # WHEN it grows past 6 blocks THEN the core raises SeqTable's error, the sequence unchanged
    with pytest.raises(
        PoolError, match="^sequence needs 7 blocks but PoolConfig.max_blocks_per_seq is 6$"
    ):
        pool.append(seq, [2] * 5)
    assert len(seq.tokens) == 20 and len(seq.block_table) == 5
    with pytest.raises(PoolError, match="a prompt of 25 tokens needs 7 blocks"):
        pool.allocate("long", [3] * 25)
    assert _unhandled(pool) == unhandled and pool.check() == []


def test_a_sequence_changed_outside_the_pool_is_a_pool_error(make_pool, monkeypatch):
    pool = make_pool(64, block_size=4)
    seq = pool.allocate("s", [1] * 9)
    unhandled = _unhandled(pool)
    # WHEN its block table names a block outside the pool THEN the core refuses it in one line
    seq.block_table[-1] = 10_000
    for op in (
        lambda: pool.free(seq),
        lambda: pool.fork(seq, "f"),
        lambda: pool.append(seq, [2] * 8),
    ):
        with pytest.raises(PoolError, match="block table was changed outside the pool"):
            op()
    assert _unhandled(pool) == unhandled


# -- the op mutex another thread holds ------------------------------------------------------------


class _WatchedMutex:
    """The handle's op mutex, saying when a thread asks for it without waiting and is refused,
    and when one starts to wait for it while it is watched."""

    def __init__(self, lock):
        self.lock = lock
        self.watch = False
        self.refused = 0
        self.waiting = threading.Event()

    def acquire(self, blocking=True, timeout=-1):
        if blocking and self.watch:
            self.waiting.set()
        got = self.lock.acquire(blocking, timeout)
        if not blocking and not got:
            self.refused += 1
        return got

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def test_a_check_that_needs_the_op_mutex_another_thread_holds_waits_for_it(make_pool, monkeypatch):
    # GIVEN the digest probe on a pool whose checks the core queues (a CUDA pool's way), and the
    # handle's op mutex held by another thread
    monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", True)
    made = []
    real = threading.RLock

    def watched():
        made.append(_WatchedMutex(real()))
        return made[-1]

    with monkeypatch.context() as m:
        m.setattr(threading, "RLock", watched)
        pool = make_pool(64, block_size=4)
    mutex = pool.op_mutex
    assert mutex is made[0]
    seq = pool.allocate("s", list(range(9)))
    unhandled = _unhandled(pool)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with mutex:
            mutex.watch = True
            held.set()
            mutex.waiting.wait(60)
        done.set()

    t = threading.Thread(target=hold)
    t.start()
    held.wait(60)
    # WHEN its blocks are published (the digests' check needs the mutex)
    got = pool.mark_computed(seq, 9)
    t.join()
    # THEN the core was refused the mutex, rolled back, waited for it (no pool lock held) and
    # ran the publication again: both blocks published, nothing unhandled
    assert done.is_set() and mutex.refused == 1
    assert got == 2 and seq.num_published == 2 and _unhandled(pool) == unhandled
    pool.probe.settle(wait=True)
    b = pool.view.blocks
    assert integrity.has_digest(b, np.asarray(seq.block_table[:2])).all()
    assert pool.check() == []


def test_digests_more_than_the_journal_holds_are_written_in_several_transactions(
    make_pool, monkeypatch
):
    # GIVEN blocks of 256 tokens (the journal holds 80 records) with their digests taken later
    # (a CUDA pool's way), and 120 blocks published
    monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", True)
    bs = 256
    pool = make_pool(256, block_size=bs, max_blocks_per_seq=256)
    seq = pool.allocate("s", list(range(120 * bs)))
    pool.probe.later.settling = True  # (left waiting until the settle below)
    assert pool.mark_computed(seq, 120 * bs) == 120
    pool.probe.later.settling = False
    unhandled = _unhandled(pool)
    # WHEN their answers are applied THEN every digest is written, nothing unhandled
    pool.probe.settle(wait=True)
    assert integrity.has_digest(pool.view.blocks, np.asarray(seq.block_table)).all()
    assert _unhandled(pool) == unhandled and pool.check() == []
