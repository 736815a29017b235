"""The C core's operations beyond what the model test (tests/test_pool_model.py) drives: a long
append running out after its first chunk, preemption and a full pool's PoolExhausted, a kill at
any journal save of an operation or of a preempting take losing nothing, threads sharing a handle,
and an operation waiting for another process's lock."""

from __future__ import annotations

import functools
import os
import random
import signal
import sys
import threading
import time

import pytest
import torch

from kvscope.allocator import KVPool, PoolExhausted
from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import CLIENT_DTYPE, BlockState, SeqState
from kvscope.allocator.lease import lease_totals
from tests import lockholder
from tests.test_crash import _survive_and_reclaim, _work

BS = 4


def test_a_long_append_that_runs_out_after_a_chunk_keeps_that_chunk(make_pool):
    # GIVEN a sequence, another holding 20 blocks, and too few blocks for a long append
    # (within max_blocks_per_seq): its first chunk (128 blocks) fits, the second does not
    pool = make_pool(160, block_size=BS, local_cache_size=3, max_clients=4, max_seqs=64)
    pool.allocate("other", list(range(500, 500 + 20 * BS)))
    seq = pool.allocate("a", [1])
    more = list(range(2, 602))
    # WHEN the long append runs (chunks of 128 blocks' worth of tokens)
    # THEN it appends the first chunk and then says the pool is exhausted
    with pytest.raises(PoolExhausted):
        pool.append(seq, more)
    assert seq.tokens == [1] + more[: 128 * BS] and len(seq.block_table) == 129
    assert pool.check() == []
    pool.free(seq)
    assert pool.check() == [] and pool.stats()["num_allocated"] == 20


def test_the_core_preempts_says_the_pool_is_full_and_resumes_itself(make_pool):
    # GIVEN a pool of 8 blocks with three sequences of 2, the two oldest marked waiting
    pool = make_pool(8, block_size=BS, local_cache_size=0, max_clients=4, max_seqs=64)
    old, young, run = (
        pool.allocate(r, list(range(i, i + 8))) for i, r in ((0, "o"), (8, "y"), (16, "r"))
    )
    before = pool._core.stats()
    pool.set_state(young, "waiting")
    pool.set_state(old, "waiting")
    assert pool.view.seqs["state"][old.slot] == SeqState.WAITING and old.state == "waiting"
    table = list(young.block_table)
    # WHEN a prompt needs 3 blocks (2 are free)
    new = pool.allocate("new", list(range(100, 112)))
    # THEN the core preempted the oldest waiting one, and only it
    assert (old.state, old.block_table, old.num_published) == ("preempted", [], 0)
    assert pool.view.seqs["state"][old.slot] == SeqState.PREEMPTED
    assert young.state == "waiting" and young.block_table == table
    assert pool.stats()["num_preemptions"] == 1
    assert pool._core.stats()["native_ops"] == before["native_ops"] + 3  # set_state x2, allocate
    # WHEN a prompt needs 4 (1 free, 2 more by preempting `young`: still short)
    with pytest.raises(PoolExhausted) as e:
        pool.allocate("big", list(range(200, 216)))
    # THEN the core raised PoolExhausted with the counts and holders, the pool as it was
    got = e.value
    assert (got.needed, got.free, got.cached, got.held) == (4, 1, 0, 7)
    assert got.holders == {"y": 2, "r": 2, "new": 3} and got.elsewhere == {}
    assert str(got) == (
        "pool exhausted: 4 blocks needed, 1 free, 0 cached, 7 held (by new=3, r=2, y=2); "
        "free finished requests, mark idle ones waiting, or create a larger pool"
    )
    assert young.state == "waiting" and young.block_table == table
    # and set_state's errors come from the core too
    with pytest.raises(PoolError, match="must be resumed"):
        pool.set_state(old, "running")
    with pytest.raises(PoolError, match="'running' or 'waiting', got 'paused'"):
        pool.set_state(run, "paused")
    # and a resume is one core call: allocated again in a new slot, the old one released
    pool.free(new)
    ops, slot = pool._core.stats()["native_ops"], old.slot
    assert pool.resume(old) == 0 and old.state == "running" and len(old.block_table) == 2
    assert pool._core.stats()["native_ops"] == ops + 1
    live = pool.live()
    assert live[old.slot] is old and (slot == old.slot or slot not in live)
    assert pool.view.seqs["state"][old.slot] == SeqState.RUNNING
    for s in (old, young, run):
        pool.free(s)
    assert pool.check() == []


def _copy_that_preempts(make_pool):
    """A full pool of 4 blocks: a waiting sequence and its fork share a partial last block, and
    another waiting sequence holds the other 2. The pool, (a, the fork b, other), and the shared
    block."""
    pool = make_pool(4, block_size=BS, local_cache_size=0, max_clients=4, max_seqs=64)
    a = pool.allocate("a", [1, 2, 3, 4, 5, 6])
    b = pool.fork(a, "b")
    other = pool.allocate("other", list(range(100, 108)))
    pool.set_state(a, "waiting")
    pool.set_state(other, "waiting")
    return pool, (a, b, other), b.block_table[1]


def test_a_copy_whose_take_preempts_the_blocks_other_holder_gives_the_block_back(make_pool):
    # GIVEN the fork of a waiting sequence sharing its partial last block, in a full pool
    pool, (a, b, other), src = _copy_that_preempts(make_pool)
    # WHEN the fork appends into the shared block (copy-on-write: one block, found only by
    # preempting both waiting sequences; the first frees nothing but the block's share)
    copies = pool.append(b, [7])
    # THEN the copy's source, left with no reference, is given back (not held by nobody)
    assert copies[0][0] == src and a.state == other.state == "preempted"
    assert pool.view.blocks["refcount"][src] == 0 and pool.view.blocks["state"][src] != 1
    assert pool.stats()["num_allocated"] == 2 and pool.check() == []
    for s in (a, b, other):
        pool.free(s)
    assert pool.check() == [] and pool.stats()["num_allocated"] == 0


@pytest.mark.parametrize("how", ["lease", "guard"])
def test_the_copys_source_left_unreferenced_is_given_back_as_a_free_gives_it(
    make_pool, monkeypatch, how
):
    # GIVEN the pool above, where the fork's copy frees its source, with the source under a
    # transfer's lease, or in guard mode
    if how == "guard":
        monkeypatch.setenv("KVSCOPE_GUARD", "1")
    pool, (a, b, other), src = _copy_that_preempts(make_pool)
    lease = pool.lease([src], "read", holder="offload") if how == "lease" else None
    # WHEN the fork's append copies it, preempting both waiting sequences
    assert pool.append(b, [7])[0][0] == src and a.state == other.state == "preempted"
    # THEN the source is given back as a free gives it: quarantined while leased (not handed
    # to the next take), or in guard mode quarantined and poisoned, as the fork's free would
    blocks = pool.view.blocks
    assert blocks["refcount"][src] == 0 and blocks["state"][src] == BlockState.QUARANTINED
    if lease is not None:
        assert lease_totals(pool.view)["quarantined"] == 1
        assert lease.release() is True and lease_totals(pool.view)["quarantined"] == 0
    else:
        assert blocks["poisoned"][src] == 1 and torch.isnan(pool.kv[:, :, src, :BS]).all()
    assert pool.check() == [] and pool.findings() == []
    for s in (a, b, other):
        pool.free(s)
    assert pool.check() == [] and pool.stats()["num_allocated"] == 0


def _killed_child(name: str, kill_at: int, seed: int) -> None:
    code = 0
    try:
        pool = KVPool.attach(name)
        pool._core.set_crash_at(kill_at)
        _work(pool, random.Random(seed), 400)
        code = 3
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 4
    os._exit(code)


def test_a_kill_at_any_journal_save_of_an_operation_loses_nothing(make_pool):
    # The slot reserve and the local cache on (max_clients 8): the C core's common case.
    pool = make_pool(48, block_size=BS, local_cache_size=2, num_shards=2, max_clients=8)
    rng = random.Random(5)
    kills = sorted({1, 2, 3, 5, 8, 13, 21, 34, 55, *(rng.randrange(60, 2000) for _ in range(10))})
    for n in kills:
        pid = os.fork()
        if pid == 0:
            _killed_child(pool.name, n, seed=n)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"journal save {n} was not reached (exit {os.waitstatus_to_exitcode(status)})"
        )
        # It died inside an operation (its client seq is odd): recovery rolls the journal
        # back and reclaims its blocks; nothing is lost.
        c = pool.view.clients
        (dead,) = [i for i in range(len(c)) if c["pid"][i] == pid and c["state"][i] == 1]
        assert c["seq"][dead] % 2 == 1, (n, int(c["seq"][dead]), int(c["journal_count"][dead]))
        _survive_and_reclaim(pool)


def _preempting_child(name: str, kill_at: int, want: int) -> None:
    """Fill the pool with waiting sequences (half of each published), then, with a kill armed
    at journal save `kill_at`, allocate `want` blocks: the core's take preempts them; free
    them and resume the preempted sequences."""
    code = 0
    try:
        pool = KVPool.attach(name)
        waiting = []
        for i in range(11):  # 44 of the 48 blocks
            waiting.append(pool.allocate(f"w{i}", [i] * 8 + [100 + i] * 8))
            pool.mark_computed(waiting[-1], 8)
            pool.set_state(waiting[-1], "waiting")
        pool.allocate("hold", list(range(16)))  # the last 4
        pool._core.set_crash_at(kill_at)
        try:
            pool.free(pool.allocate("big", list(range(200, 200 + want * BS))))
            ended = pool.stats()["num_preemptions"] >= 3
            for s in [s for s in waiting if s.state == "preempted"][:2]:  # (in 10 blocks)
                pool.resume(s)  # (its published half hits, unless it was evicted)
                assert s.state == "running" and len(s.block_table) == 4
        except PoolExhausted:
            ended = want > 44  # (its preemptions rolled back)
        # (not killed: every save passed)
        code = 3 if ended else 5
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 4
    os._exit(code)


@pytest.mark.slow
@pytest.mark.parametrize("want", [10, 47], ids=["preempts", "then-exhausted"])
def test_a_kill_at_any_journal_save_of_a_preempting_take_loses_nothing(make_pool, want):
    # GIVEN a full pool whose sequences are waiting (the NUM_BLOCKS of tests/test_crash.py)
    pool = make_pool(48, block_size=BS, local_cache_size=2, num_shards=2, max_clients=8)
    kills = 0
    # WHEN a process allocating blocks that only preemption can give (10: three of them, then
    # resumed; 47: all eleven, and still short) is killed at its first, second, ... journal
    # save
    for n in range(1, 2000):
        if n > 30 and n % 13:
            continue  # (every save of the first two preemptions, then every 13th)
        pid = os.fork()
        if pid == 0:
            _preempting_child(pool.name, n, want)
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status):
            assert os.WEXITSTATUS(status) == 3, f"save {n}: exit {os.WEXITSTATUS(status)}"
            break  # past its last save
        assert os.WTERMSIG(status) == signal.SIGKILL
        kills += 1
        # THEN it died inside the operation (its client seq odd), and recovery and a reclaim
        # lose nothing
        c = pool.view.clients
        (dead,) = [i for i in range(len(c)) if c["pid"][i] == pid and c["state"][i] == 1]
        assert c["seq"][dead] % 2 == 1, (n, int(c["seq"][dead]))
        _survive_and_reclaim(pool)
    assert kills > 30, kills


def test_client_record_layout_matches_the_core():
    # The C core reads the journal entries as {offset u8, length u4, data_off u4, op u8}.
    e = CLIENT_DTYPE.fields["journal"][0].base
    assert e.itemsize == 24 and [e.fields[f][1] for f in ("offset", "length", "data_off")] == [
        0,
        8,
        12,
    ]


def _run_threads(targets: list, switch_s: float) -> None:
    """Run each target in a thread of its own, all at once, switching threads every switch_s."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    try:
        threads = [threading.Thread(target=f) for f in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)


def test_threads_of_one_process_share_a_handle(make_pool):
    # GIVEN one handle used by four threads: allocations and publications, single- and
    # multi-token appends, forks (copy-on-write), frees, and evictions when the pool fills
    pool = make_pool(96, block_size=BS, max_clients=4, max_seqs=64, local_cache_size=2)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        live: list = []
        try:
            for i in range(400):
                r = rng.random()
                if r < 0.3 or not live:
                    s = pool.allocate(f"t{seed}-{i}", [rng.randrange(9) for _ in range(6)])
                    pool.mark_computed(s, s.num_tokens)
                    live.append(s)
                elif r < 0.6:
                    pool.append(rng.choice(live), [rng.randrange(9)])
                elif r < 0.7:
                    pool.append(rng.choice(live), [1, 2, 3])
                elif r < 0.75 and len(live) < 6:
                    live.append(pool.fork(rng.choice(live), f"t{seed}-f{i}"))
                else:
                    pool.free(live.pop(rng.randrange(len(live))))
        except PoolExhausted:
            pass
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            for s in live:
                pool.free(s)

    # WHEN they run at once (switching threads every 10 µs, between and around the core's
    # calls)
    _run_threads([functools.partial(work, k) for k in range(4)], switch_s=1e-5)
    # THEN nothing failed and the pool is consistent, with no block lost
    assert errors == []
    assert pool.check() == []
    assert pool.stats()["num_allocated"] == 0
    assert pool._core.stats()["native_ops"] > 0


@pytest.mark.slow
def test_a_thread_preempting_while_others_allocate_and_free(make_pool):
    # GIVEN 300 idle sequences, two threads allocating and freeing one-block sequences (the
    # core enters and drops them from the handle's live sequences) and a third that fills the
    # pool with waiting sequences, so each of its takes preempts (the core scanning the live
    # sequences)
    pool = make_pool(400, block_size=BS, max_clients=4, max_seqs=512)
    idle = [pool.allocate(f"idle{i}", [i]) for i in range(300)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                pool.free(pool.allocate(f"c{seed}", [rng.randrange(9)]))
        except PoolExhausted:
            pass
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    def hog() -> None:
        rng = random.Random(0)
        try:
            for i in range(100):
                live = []
                try:
                    while len(live) < 60:
                        s = pool.allocate(f"h{i}", [rng.randrange(99) for _ in range(9)])
                        pool.set_state(s, "waiting")
                        live.append(s)
                except PoolExhausted:
                    pass
                for s in live:
                    pool.free(s)
        except BaseException as e:
            errors.append(e)
        finally:
            stop.set()

    # WHEN they run at once, switching threads every microsecond
    _run_threads([functools.partial(churn, 0), functools.partial(churn, 1), hog], switch_s=1e-6)
    # THEN no operation failed, the handle knows exactly its live sequences, and the pool is
    # consistent
    assert errors == []
    assert sorted(pool.live()) == sorted(s.slot for s in idle)
    assert pool.check() == []
    assert pool.stats()["num_allocated"] == len(idle)


def test_an_operation_that_waits_for_another_process_gives_the_mutex_back(make_pool):
    # GIVEN a published sequence whose index shard another process holds locked for a while
    pool = make_pool(64, block_size=BS, max_clients=4, max_seqs=64)
    first = pool.allocate("a", list(range(9)))  # (the slot reserve's first claim)
    seq = pool.allocate("b", list(range(20, 29)))
    pool.mark_computed(seq, seq.num_tokens)
    key = int(pool.view.blocks["prefix_hash"][seq.block_table[0]])
    shard = pool.SHARDS[key & (pool.view.layout.num_shards - 1)]  # the key's low bits
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        other = KVPool.attach(pool.name)
        lockholder.hold(other, shard)
        os.write(w, b"x")
        time.sleep(0.3)
        lockholder.let_go(other, shard)
        os._exit(0)
    os.read(r, 1)
    # WHEN this process forks the sequence (the C core waits for the lock, GIL released)
    before = pool._core.stats()["native_ops"]
    t0 = time.monotonic()
    child = pool.fork(seq, "c")
    waited = time.monotonic() - t0
    os.waitpid(pid, 0)
    # THEN the core waited for the lock and did it, and the handle's op mutex and busy count are
    # free again
    assert waited > 0.1
    assert pool._core.stats()["native_ops"] == before + 1

    got: list[bool] = []

    def try_mutex() -> None:
        if pool.op_mutex.acquire(blocking=False):
            pool.op_mutex.release()
            got.append(True)

    t = threading.Thread(target=try_mutex)
    t.start()
    t.join()
    assert got == [True]
    for s in (child, seq, first):
        pool.free(s)
    assert pool.check() == []
