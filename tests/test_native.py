"""The C core (allocator/_native.c) against the Python allocator: the same operations leave the
same bytes, a kill at any journal save of a native operation loses nothing, and every path that
must stay in Python does."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import signal
import sys
import threading

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolConfig, PoolExhausted, faults, native, reserve
from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import CLIENT_DTYPE, SeqState
from tests.test_crash import _survive_and_reclaim, _work

BS = 4


def test_the_core_is_built_and_on():
    # pip install compiles it on a machine with a C compiler (every machine of this project).
    assert native.available(), "kvscope.allocator._native was not built (no C compiler?)"


def _pool(name: str, use_native: bool, num_blocks: int = 48) -> KVPool:
    pool = KVPool.create(
        name,
        PoolConfig(
            num_blocks=num_blocks,
            block_size=BS,
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
            dtype="float32",
            local_cache_size=3,
            num_shards=2,
            max_clients=4,
            max_seqs=64,
        ),
    )
    if not use_native:
        pool._native = None
    return pool


def _state(pool: KVPool) -> dict[str, np.ndarray]:
    """The segment's allocator state, without times, lock statistics and journal scratch."""
    v = pool.view
    blocks = v.blocks.copy()
    blocks["alloc_ns"] = blocks["access_ns"] = 0
    seqs = v.seqs.copy()
    seqs["created_ns"] = 0
    # An empty slot's other fields are leftovers, not state: a failed allocation with prefix
    # hits leaves none in the core (one transaction, rolled back) and its claim's in the
    # Python path (two transactions, the first undone by a third).
    empty = seqs["state"] == 0
    for f in ("request", "seq_id", "num_tokens", "num_blocks", "table", "site"):
        seqs[f][empty] = 0
    for f in ("owner_pid", "owner_start"):
        seqs[f][empty & (seqs["reserved"] == 0)] = 0
    # (and a table's entries past its blocks; sequence ids as their order: the Python path's
    # failed claim used one, the core's rollback none, so the header's next id is not compared)
    seqs["table"][np.arange(seqs["table"].shape[1]) >= seqs["num_blocks"][:, None]] = 0
    live = np.flatnonzero(~empty)
    seqs["seq_id"][live] = np.argsort(np.argsort(seqs["seq_id"][live]))
    c = v.clients[pool.client]
    keep = ["local_count", "journal_count", "journal_used", "local", "num_allocs", "num_frees"]
    keep += ["num_cow", "num_evictions", "num_preemptions", "prefix_queries", "prefix_hits"]
    keep += ["num_forks"]
    return {
        "blocks": blocks.view(np.uint8),
        "ring": np.concatenate([v.ring_header.view(np.uint8), v.ring.view(np.uint8)]),
        "index": v.index.view(np.uint8).copy(),
        "seqs": seqs.view(np.uint8),
        **{f: np.array(c[f]).ravel().copy() for f in keep},
        "client_seq_even": np.array([int(c["seq"]) % 2]),
    }


def _fields(seq) -> tuple:
    """A Sequence's fields but the handle it belongs to."""
    return tuple(getattr(seq, f.name) for f in dataclasses.fields(seq) if f.name != "pool_uid") + (
        type(seq),
    )


def _live_fields(live: list) -> list[tuple]:
    """Each Sequence's fields but the handle it belongs to, its id as its order among them."""
    order = np.argsort(np.argsort([s.seq_id for s in live])).tolist()
    skip = ("pool_uid", "seq_id")
    return [
        tuple(getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in skip)
        + (type(s), rank)
        for s, rank in zip(live, order)
    ]


def _same(a: KVPool, b: KVPool, step: str) -> None:
    sa, sb = _state(a), _state(b)
    for key in sa:
        if not np.array_equal(sa[key], sb[key]):
            raise AssertionError(f"after {step}: section {key} differs between C and Python")


def _script(rng: random.Random, steps: int, churn: bool = False, waits: bool = False):
    """Operations with shared prefixes, decode steps, publication, forks (copy-on-write),
    aborts and a pool small enough to evict; `churn` ends sequences about as often as it
    starts them and publishes more (the cache fills with prefixes: eviction); `waits` marks
    sequences waiting now and then (takes preempt them; an operation on a preempted one
    resumes it)."""
    systems = [[rng.randrange(50) for _ in range(9)] for _ in range(3)]
    for i in range(steps):
        r = rng.random()
        if waits and r < 0.12:
            yield ("wait" if r < 0.1 else "run", rng.random(), None)
            continue
        if churn and r < 0.35:
            own = [rng.randrange(500) for _ in range(rng.randrange(4, 13))]
            yield ("allocate", f"r{i}", own)
            yield ("publish", 1.0 - 1e-9, None)
            if r < 0.3:
                yield ("free", 0.0, None)
        elif r < 0.25:
            own = [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            yield ("allocate", f"r{i}", (rng.choice(systems) if rng.random() < 0.7 else []) + own)
        elif r < 0.6:
            yield ("append", rng.random(), [rng.randrange(50)])
        elif r < 0.66:
            yield ("append", rng.random(), [rng.randrange(50) for _ in range(rng.randrange(2, 7))])
        elif r < 0.78:
            yield ("publish", rng.random(), None)
        elif r < 0.83:
            yield ("fork", rng.random(), f"f{i}")
        elif r < 0.93:
            yield ("free", rng.random(), None)
        else:
            yield ("abort", rng.random(), None)


def _apply(pool: KVPool, live: list, op: tuple, written=None) -> object:
    """One scripted operation; `written(seq, first, copies)` writes K/V as an engine does after
    an allocation (copies None) and an append."""
    kind, arg, extra = op
    try:
        if kind == "allocate":
            live.append(pool.allocate(arg, extra))
            if written is not None:
                written(live[-1], live[-1].num_cached_tokens, None)
            return live[-1].block_table
        if not live:
            return None
        seq = live[int(arg * len(live))]
        if seq.state == "preempted" and kind in ("append", "publish", "fork", "wait", "run"):
            return ("resumed", pool.resume(seq), seq.block_table)
        if kind in ("wait", "run"):
            pool.set_state(seq, "waiting" if kind == "wait" else "running")
            return None
        if kind == "append":
            first = len(seq.tokens)
            copies = pool.append(seq, extra)
            if written is not None:
                written(seq, first, copies)
            return copies
        if kind == "publish":
            return pool.mark_computed(seq, seq.num_tokens)
        if kind == "fork":
            live.append(pool.fork(seq, extra))
            return live[-1].block_table
        live.remove(seq)
        (pool.free if kind == "free" or seq.state == "preempted" else pool.abort)(seq)
        return None
    except PoolExhausted as e:
        return ("exhausted", e.needed)


@pytest.mark.parametrize(
    "seed,churn,waits",
    [(1, False, False), (2, False, False), (3, True, False), (4, True, False), (5, False, True)]
    + [(7, False, True), (9, True, True)],
)
def test_same_operations_leave_the_same_bytes(pool_name, seed, churn, waits, monkeypatch):
    # GIVEN two pools of one geometry, one using the C core and one pure Python
    # (with waiting sequences, a pool of 20 blocks: full often enough to preempt)
    fast = _pool(pool_name, True, 20 if waits else 48)
    slow = _pool(f"{pool_name}-py", False, 20 if waits else 48)
    live_fast: list = []
    live_slow: list = []
    try:
        # WHEN the same random operations run on both
        for i, op in enumerate(_script(random.Random(seed), 600, churn, waits)):
            got_fast = _apply(fast, live_fast, op)
            got_slow = _apply(slow, live_slow, op)
            # THEN every result, every sequence and every byte of allocator state agree
            assert got_fast == got_slow, f"step {i} {op[0]}"
            assert [s.block_table for s in live_fast] == [s.block_table for s in live_slow]
            assert [s.tokens for s in live_fast] == [s.tokens for s in live_slow]
            # (every field of every Sequence: the core builds them at their slots)
            assert _live_fields(live_fast) == _live_fields(live_slow)
            _same(fast, slow, f"step {i} {op}")
        assert fast.check() == [] and slow.check() == []
        # and the C core ran them (multi-token appends and copy-on-write too; Python only
        # what it hands back: an exhausted pool)
        done = fast._native.stats()
        assert done["native_ops"] > 200, done
        # eviction among them when the cache fills with prefixes
        assert done["evictions"] > 0 or not churn, done
        # and preemption of waiting sequences and full pools, which the core handles itself:
        # nothing handed back
        if waits:
            assert fast.stats()["num_preemptions"] > 0 and done["fallbacks"] == 0, done
    finally:
        for p in (fast, slow):
            p.close()
            p.unlink()


def test_paths_that_stay_in_python(make_pool):
    pool = make_pool(32, block_size=BS, max_clients=4, max_seqs=64)
    assert pool._native is not None
    s = pool.allocate("a", [1, 2, 3, 4, 5])  # the first claim refills the reserve: Python
    before = pool._native.stats()
    pool.append(s, [6])
    assert pool._native.stats()["native_ops"] == before["native_ops"] + 1
    # A fault armed at run time strikes in the core: an append, an allocation and a free it
    # could strike stay there (tests/test_native_faults.py).
    faults.configure("leak:99")
    try:
        n = pool._native.stats()["native_ops"]
        pool.append(s, [7])
        pool.free(pool.allocate("z", [1, 2, 3]))
        assert pool._native.stats()["native_ops"] == n + 3
    finally:
        faults.configure(None)
    # Copy-on-write of a shared last block: in the core too.
    child = pool.fork(s, "b")
    n = pool._native.stats()["native_ops"]
    copies = pool.append(child, [8])
    assert len(copies) == 1 and copies[0][0] == s.block_table[-1]
    assert pool._native.stats()["native_ops"] == n + 1
    pool.free(child)
    pool.free(s)
    assert pool.check() == []


def test_a_long_append_that_runs_out_after_a_chunk_ends_as_in_python(pool_name):
    # GIVEN two pools, C core and Python, each with a sequence, another holding 20 blocks, and
    # too few blocks for a long append (within max_blocks_per_seq): its first chunk (128
    # blocks) fits, the second does not
    fast = _pool(pool_name, True, num_blocks=160)
    slow = _pool(f"{pool_name}-py", False, num_blocks=160)
    try:
        for pool in (fast, slow):
            pool.allocate("other", list(range(500, 500 + 20 * BS)))
        seqs = [pool.allocate("a", [1]) for pool in (fast, slow)]
        more = list(range(2, 602))
        # WHEN the long append runs on both (chunks of 128 blocks' worth of tokens, as append.py)
        # THEN both append the first chunk and then say the pool is exhausted, leaving the
        # same sequence and the same bytes
        before = fast._native.stats()["fallbacks"]
        for pool, seq in zip((fast, slow), seqs):
            with pytest.raises(PoolExhausted):
                pool.append(seq, more)
        # (the core ran the first chunk and raised PoolExhausted itself: nothing handed back)
        assert fast._native.stats()["fallbacks"] == before
        assert seqs[0].tokens == seqs[1].tokens == [1] + more[: 128 * BS]
        assert seqs[0].block_table == seqs[1].block_table
        _same(fast, slow, "the long append")
        assert fast.check() == [] and slow.check() == []
    finally:
        for pool in (fast, slow):
            pool.close()
            pool.unlink()


def test_the_core_preempts_says_the_pool_is_full_and_resumes_itself(make_pool):
    # GIVEN a pool of 8 blocks with three sequences of 2, the two oldest marked waiting
    pool = make_pool(8, block_size=BS, local_cache_size=0, max_clients=4, max_seqs=64)
    old, young, run = (
        pool.allocate(r, list(range(i, i + 8))) for i, r in ((0, "o"), (8, "y"), (16, "r"))
    )
    before = pool._native.stats()
    pool.set_state(young, "waiting")
    pool.set_state(old, "waiting")
    assert pool.view.seqs["state"][old.slot] == SeqState.WAITING and old.state == "waiting"
    table = list(young.block_table)
    # WHEN a prompt needs 3 blocks (2 are free)
    new = pool.allocate("new", list(range(100, 112)))
    # THEN the core preempted the oldest waiting one, and only it: nothing handed back
    assert (old.state, old.block_table, old.num_published) == ("preempted", [], 0)
    assert pool.view.seqs["state"][old.slot] == SeqState.PREEMPTED
    assert young.state == "waiting" and young.block_table == table
    assert pool.stats()["num_preemptions"] == 1
    done = pool._native.stats()
    assert done["fallbacks"] == before["fallbacks"], done
    assert done["native_ops"] == before["native_ops"] + 3  # set_state twice, allocate
    # WHEN a prompt needs 4 (1 free, 2 more by preempting `young`: still short)
    with pytest.raises(PoolExhausted) as e:
        pool.allocate("big", list(range(200, 216)))
    # THEN the core raised PoolExhausted as reserve.exhausted says it, with the pool as it was
    want = reserve.exhausted(pool, 4)
    got = e.value
    assert (got.needed, got.free, got.cached, got.held) == (4, 1, 0, 7)
    assert (got.holders, got.elsewhere, str(got)) == (want.holders, want.elsewhere, str(want))
    assert young.state == "waiting" and young.block_table == table
    assert pool._native.stats()["fallbacks"] == before["fallbacks"]
    # and set_state's errors come from the core too
    with pytest.raises(PoolError, match="must be resumed"):
        pool.set_state(old, "running")
    with pytest.raises(PoolError, match="'running' or 'waiting', got 'paused'"):
        pool.set_state(run, "paused")
    assert pool._native.stats()["fallbacks"] == before["fallbacks"]
    # and a resume is one core call: allocated again in a new slot, the old one released
    pool.free(new)
    ops, slot = pool._native.stats()["native_ops"], old.slot
    assert pool.resume(old) == 0 and old.state == "running" and len(old.block_table) == 2
    assert pool._native.stats()["native_ops"] == ops + 1
    assert pool._native.stats()["fallbacks"] == before["fallbacks"]
    live = pool.live()
    assert live[old.slot] is old and (slot == old.slot or slot not in live)
    assert pool.view.seqs["state"][old.slot] == SeqState.RUNNING
    for s in (old, young, run):
        pool.free(s)
    assert pool.check() == []


@pytest.mark.parametrize("core", [True, False], ids=["core", "python"])
def test_a_copy_whose_take_preempts_the_blocks_other_holder_gives_the_block_back(make_pool, core):
    # GIVEN a full pool of 4 blocks: a waiting sequence and its fork share a partial last
    # block, and another waiting sequence holds the other 2
    pool = make_pool(4, block_size=BS, local_cache_size=0, max_clients=4, max_seqs=64)
    if not core:
        pool._native = None
    a = pool.allocate("a", [1, 2, 3, 4, 5, 6])
    b = pool.fork(a, "b")
    other = pool.allocate("other", list(range(100, 108)))
    pool.set_state(a, "waiting")
    pool.set_state(other, "waiting")
    src = b.block_table[1]
    handbacks = pool._native.stats()["fallbacks"] if core else 0
    # WHEN the fork appends into the shared block (copy-on-write: one block, found only by
    # preempting both waiting sequences; the first frees nothing but the block's share)
    copies = pool.append(b, [7])
    # THEN the copy's source, left with no reference, is given back (not held by nobody)
    assert copies[0][0] == src and a.state == other.state == "preempted"
    assert pool.view.blocks["refcount"][src] == 0 and pool.view.blocks["state"][src] != 1
    assert pool.stats()["num_allocated"] == 2 and pool.check() == []
    if core:
        assert pool._native.stats()["fallbacks"] == handbacks
    for s in (a, b, other):
        pool.free(s)
    assert pool.check() == [] and pool.stats()["num_allocated"] == 0


# Switched off by KVSCOPE_NATIVE=0 (the probes the core runs itself, a guard pool's quarantine
# count included, are tests/test_native_probes.py's and tests/test_native_guard.py's).
def test_the_python_path_alone(pool_name, monkeypatch):
    monkeypatch.setenv("KVSCOPE_NATIVE", "0")
    pool = _pool(pool_name, True)
    try:
        assert pool._native is None
        pool.free(pool.allocate("a", [1, 2, 3]))
        pool.free(pool.allocate("b", [1, 2, 3]))
        assert pool._native is None or pool._native.stats()["native_ops"] == 0
        assert pool.check() == []
    finally:
        pool.close()
        pool.unlink()


def _native_child(name: str, kill_at: int, seed: int) -> None:
    code = 0
    try:
        pool = KVPool.attach(name)
        pool._native.set_crash_at(kill_at)
        _work(pool, random.Random(seed), 400)
        code = 3
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 4
    os._exit(code)


def test_a_kill_at_any_journal_save_of_a_native_operation_loses_nothing(make_pool):
    # The slot reserve and the local cache on (max_clients 8): the C core's common case.
    pool = make_pool(48, block_size=BS, local_cache_size=2, num_shards=2, max_clients=8)
    rng = random.Random(5)
    kills = sorted({1, 2, 3, 5, 8, 13, 21, 34, 55, *(rng.randrange(60, 2000) for _ in range(10))})
    for n in kills:
        pid = os.fork()
        if pid == 0:
            _native_child(pool.name, n, seed=n)
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
        before = pool._native.stats()["fallbacks"]
        pool._native.set_crash_at(kill_at)
        try:
            pool.free(pool.allocate("big", list(range(200, 200 + want * BS))))
            ended = pool.stats()["num_preemptions"] >= 3
            for s in [s for s in waiting if s.state == "preempted"][:2]:  # (in 10 blocks)
                pool.resume(s)  # (its published half hits, unless it was evicted)
                assert s.state == "running" and len(s.block_table) == 4
        except PoolExhausted:
            ended = want > 44  # (its preemptions rolled back)
        # (not killed: every save passed; the core did it all, nothing handed back)
        code = 3 if ended and pool._native.stats()["fallbacks"] == before else 5
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 4
    os._exit(code)


@pytest.mark.parametrize(
    "want", [10, pytest.param(47, marks=pytest.mark.slow)], ids=["preempts", "then-exhausted"]
)
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


def test_threads_of_one_process_mix_both_paths(make_pool):
    # GIVEN one handle used by four threads: single-token appends and allocations take the C
    # core, multi-token appends, forks' copy-on-write and evictions that scan take Python
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

    # WHEN they run at once (switching threads every 10 µs: Python-path operations are
    # interrupted halfway, while the C core runs)
    _run_threads([functools.partial(work, k) for k in range(4)], switch_s=1e-5)
    # THEN nothing failed and the pool is consistent, with no block lost
    assert errors == []
    assert pool.check() == []
    assert pool.stats()["num_allocated"] == 0
    assert pool._native.stats()["native_ops"] > 0


@pytest.mark.slow
def test_a_thread_preempting_while_others_allocate_and_free(make_pool):
    # GIVEN 300 idle sequences, two threads allocating and freeing one-block sequences (the C
    # core, which enters and drops them from the handle's live sequences) and a third that
    # fills the pool with waiting sequences, so each of its takes preempts (the Python path,
    # scanning the live sequences under the mutex)
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
    first = pool.allocate("a", list(range(9)))  # the slot reserve's first claim: Python
    seq = pool.allocate("b", list(range(20, 29)))
    pool.mark_computed(seq, seq.num_tokens)
    shard = pool.SHARDS[pool.store.index.shard(pool.view.blocks["prefix_hash"][seq.block_table[0]])]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        other = KVPool.attach(pool.name)
        other.locks.acquire(shard)
        os.write(w, b"x")
        import time

        time.sleep(0.3)
        other.locks.release(shard)
        os._exit(0)
    os.read(r, 1)
    # WHEN this process forks the sequence (the C core waits for the lock, GIL released)
    before = pool._native.stats()["native_ops"]
    child = pool.fork(seq, "c")
    os.waitpid(pid, 0)
    # THEN it did so natively, and the handle's op mutex and busy count are free again
    assert pool._native.stats()["native_ops"] == before + 1
    assert pool._busy[0] == 0
    import threading

    got: list[bool] = []

    def try_mutex() -> None:
        if pool._mutex.acquire(blocking=False):
            pool._mutex.release()
            got.append(True)

    t = threading.Thread(target=try_mutex)
    t.start()
    t.join()
    assert got == [True]
    for s in (child, seq, first):
        pool.free(s)
    assert pool.check() == []
