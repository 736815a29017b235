"""Leases (docs/POOL.md "Leases"): a leased block that is freed or preempted is quarantined and
never handed out while leased, eviction passes a leased cached block over, a write lease that
completes into a block its request no longer holds is transfer_after_free, a lease past its
deadline or still held when its holder closes is lease_leak, and a dead holder's leases are
reclaimed with its blocks. No timing: deadlines are crossed with an explicit `now_ns`."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolError, PoolExhausted
from kvscope.allocator.findings import FindingKind
from kvscope.allocator.layout import BlockState
from kvscope.allocator.lease import lease_totals
from kvscope.allocator.probeflags import ProbeFlags
from kvscope.allocator.probing import PoolProbes
from tests import lockholder
from tests.forking import fork_child, killed_after, wait_child

LATE = FindingKind.TRANSFER_AFTER_FREE.value
LEAK = FindingKind.LEASE_LEAK.value


def kinds(pool: KVPool) -> list[str]:
    return [f.kind for f in pool.findings()]


def states(pool: KVPool, blocks: list[int]) -> list[int]:
    return [int(pool.view.blocks["state"][b]) for b in blocks]


def test_a_leased_block_freed_is_quarantined_and_never_handed_out_while_leased(make_pool):
    # GIVEN a request whose 3 blocks an offload reads under a lease
    pool = make_pool(16)
    a = pool.allocate("a", list(range(12)))
    mine = list(a.block_table)
    lease = pool.lease(a, "read", holder="offloader")
    # WHEN the request is freed before the copy is done
    pool.free(a)
    # THEN its blocks are quarantined (not in the local cache) and the pool cannot hand them out:
    # the other 13 blocks are all there is
    assert states(pool, mine) == [BlockState.QUARANTINED] * 3
    assert lease_totals(pool.view)["quarantined"] == 3
    with pytest.raises(PoolExhausted):
        pool.allocate("big", list(range(16 * 4)))
    b = pool.allocate("b", list(range(13 * 4)))
    assert not set(b.block_table) & set(mine)
    # AND once the copy completes, they are free again
    assert lease.release() is True
    c = pool.allocate("c", list(range(12)))
    assert sorted(c.block_table) == sorted(mine)
    assert lease_totals(pool.view)["quarantined"] == 0
    assert kinds(pool) == []


def test_without_the_lease_the_freed_blocks_are_handed_out_at_once(make_pool):
    # (the counterpart of the test above: the quarantine is the lease's doing)
    pool = make_pool(16)
    a = pool.allocate("a", list(range(12)))
    mine = list(a.block_table)
    pool.free(a)
    b = pool.allocate("b", list(range(16 * 4)))
    assert set(mine) <= set(b.block_table)


def preempt_two(pool: KVPool, mode: str):
    """Two waiting requests, the older (w) leased; an allocation that needs both preempted:
    (w, its blocks, the lease, v, x)."""
    w = pool.allocate("w", list(range(12)))
    v = pool.allocate("v", list(range(100, 112)))
    mine = list(w.block_table)
    pool.set_state(w, "waiting")
    pool.set_state(v, "waiting")
    lease = pool.lease(w, mode, holder="store")
    x = pool.allocate("x", list(range(13 * 4)))
    return w, mine, lease, v, x


def test_a_preempted_sequences_leased_blocks_are_quarantined(make_pool):
    # GIVEN two waiting requests, the older one's blocks read by a store under a lease
    pool = make_pool(16)
    # WHEN an allocation needs more than the free blocks: both are preempted, oldest first
    w, mine, lease, v, x = preempt_two(pool, "read")
    # THEN w's blocks are quarantined, not handed to x, which got v's
    assert w.state == "preempted" and v.state == "preempted"
    assert not set(x.block_table) & set(mine)
    assert states(pool, mine) == [BlockState.QUARANTINED] * 3
    lease.release()
    pool.free(x)
    assert pool.resume(w) == 0
    assert kinds(pool) == []


def test_eviction_passes_over_a_leased_cached_block(make_pool):
    # GIVEN a published prompt whose request ended: its blocks are cached; one is leased
    pool = make_pool(16)
    a = pool.allocate("a", list(range(13)))
    pool.mark_computed(a, 13)
    cached = a.block_table[:3]
    pool.free(a)
    assert states(pool, cached) == [BlockState.CACHED] * 3
    lease = pool.lease(cached[:1], "read", holder="offloader")
    # WHEN everything cached is evicted
    assert pool.evict(16) == 2
    # THEN the leased block is still cached (its contents and key kept), the others evicted
    assert states(pool, cached) == [BlockState.CACHED, BlockState.FREE, BlockState.FREE]
    lease.release()
    assert pool.evict(16) == 1


@pytest.mark.parametrize("how", ["generator", "numpy"])
def test_a_lease_on_block_ids_takes_any_iterable_of_them_once(make_pool, how):
    # GIVEN a request's blocks named by a generator (read once) or a numpy array
    pool = make_pool(16)
    a = pool.allocate("a", list(range(9)))
    ids = a.block_table[:2]
    target = (b for b in ids) if how == "generator" else np.array(ids, dtype=np.int64)
    # WHEN they are leased THEN the lease holds them all, and they are quarantined at a free
    lease = pool.lease(target, "read", holder="offloader")
    assert lease.blocks == ids
    pool.free(a)
    assert states(pool, ids) == [BlockState.QUARANTINED] * 2
    assert lease.release() is True


def test_a_write_lease_completing_into_a_freed_block_is_one_finding_naming_holder_and_request(
    make_pool,
):
    # GIVEN a receive into a request's blocks under a write lease
    pool = make_pool(16)
    seen = []
    pool.on_finding = seen.append
    seq = pool.allocate("req-7", list(range(10)))
    lease = pool.lease(seq, "write", holder="kv-receiver")
    # WHEN the request is aborted before the receive completes, and then it completes
    pool.abort(seq)
    assert lease.release() is True
    # THEN one transfer_after_free finding names the holder, the request and its abort,
    # handed to on_finding as well
    (f,) = pool.findings()
    assert f.kind == LATE and f.severity == "error"
    assert f.request == "req-7" and f.owner_pid == os.getpid()
    assert "'kv-receiver'" in f.message and "'req-7'" in f.message
    assert "after the request ended (freed or aborted) and the block was freed" in f.message
    assert f.block in lease.blocks
    assert [x.kind for x in seen] == [LATE]
    assert lease_totals(pool.view)["late"] == 1


@pytest.mark.parametrize("end", ["free", "abort"])
def test_a_late_write_names_a_block_the_end_freed_not_a_shared_one_still_cached(make_pool, end):
    # GIVEN a request whose first block is a published prefix another request holds too, its
    # own blocks after it, received into under a write lease on the whole sequence
    pool = make_pool(16)
    first = pool.allocate("first", list(range(8)))
    pool.mark_computed(first, 8)
    seq = pool.allocate("req-8", list(range(8)) + [50, 51, 52, 53, 54])
    shared, own = seq.block_table[:2], seq.block_table[2:]
    assert first.block_table == shared
    lease = pool.lease(seq, "write", holder="kv-receiver")
    # WHEN the request ends before the receive completes
    getattr(pool, end)(seq)
    lease.release()
    # THEN the finding is about a block the end released (the write landed in the free
    # list), not the shared one the other request still holds, and says how the request ended
    (f,) = [x for x in pool.findings() if x.kind == LATE]
    assert f.block == own[0] and f.block not in shared
    assert "after the request ended (freed or aborted) and the block was freed" in f.message
    pool.free(first)


def test_a_write_lease_completing_in_time_is_no_finding(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(10)))
    with pool.lease(seq, "write", holder="kv-receiver") as lease:
        pool.kv[:, :, lease.blocks] = 1.0
    assert lease.released
    pool.free(seq)
    # a read lease that outlives its request's free, released, is what leases are for
    seq = pool.allocate("s", list(range(10)))
    lease = pool.lease(seq, "read", holder="offloader")
    pool.free(seq)
    lease.release()
    assert kinds(pool) == []
    assert lease_totals(pool.view) == {
        "held": 0,
        "quarantined": 0,
        "taken": 2,
        "released": 2,
        "late": 0,
        "leaked": 0,
        "reclaimed": 0,
    }


def test_a_write_lease_on_a_sequence_that_was_preempted_names_the_preemption(make_pool):
    pool = make_pool(16)
    w, mine, lease, v, x = preempt_two(pool, "write")
    assert w.state == "preempted"
    lease.release()
    (f,) = pool.findings()
    assert f.kind == LATE and "preempted" in f.message and f.request == "w"


def test_a_write_lease_into_a_block_its_sequence_copied_on_write_is_a_finding(make_pool):
    # GIVEN a fork sharing its parent's partly filled last block, written under a lease
    pool = make_pool(16)
    parent = pool.allocate("parent", list(range(10)))
    child = pool.fork(parent, "child")
    lease = pool.lease(child, "write", holder="rx")
    # WHEN the child's append copies that block before the write completes
    assert pool.append(child, [7]) == [(parent.block_table[2], child.block_table[2])]
    lease.release()
    # THEN the write went into the parent's block: the child no longer maps it
    (f,) = pool.findings()
    assert f.kind == LATE and f.request == "child" and "copy-on-write" in f.message
    assert f.block == parent.block_table[2]


def test_a_write_lease_on_block_ids_checks_their_generation(make_pool):
    # GIVEN a write lease on two block ids of a request
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(8)))
    lease = pool.lease(seq.block_table, "write", holder="copier")
    # WHEN the request ends before the copy completes
    pool.free(seq)
    lease.release()
    # THEN the late write is reported about the request the blocks belonged to
    (f,) = pool.findings()
    assert f.kind == LATE and f.request == "r"


def test_a_lease_past_its_deadline_is_one_lease_leak_and_stays_held(make_pool):
    # GIVEN a read lease of 5 s
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(10)))
    lease = pool.lease(seq, "read", holder="offloader", timeout=5.0)
    now = time.monotonic_ns()
    # WHEN the sweep runs before its deadline, then past it, then again
    assert pool.expire_leases(now) == 0
    assert pool.expire_leases(now + 6 * 10**9) == 1
    assert pool.expire_leases(now + 7 * 10**9) == 0
    # THEN one lease_leak names the holder and the request; the lease stays held until released
    (f,) = pool.findings()
    assert f.kind == LEAK and f.request == "r" and "'offloader'" in f.message
    assert "past its deadline" in f.message
    (row,) = pool.leases()
    assert row["leaked"] and row["holder"] == "offloader" and row["blocks"] == seq.block_table
    assert lease.release() is True
    assert pool.leases() == [] and lease_totals(pool.view)["leaked"] == 1


def test_a_lease_without_a_timeout_never_expires(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(10)))
    lease = pool.lease(seq, "read", holder="h", timeout=None)
    assert pool.expire_leases(2**62) == 0
    lease.release()


def test_a_lease_still_held_at_close_is_a_leak_and_released(make_pool, pool_name):
    # GIVEN a second handle that leases a request's blocks and frees the request
    pool = make_pool(16)
    other = KVPool.attach(pool_name)
    seq = other.allocate("r", list(range(10)))
    lease = other.lease(seq, "read", holder="offloader")
    other.free(seq)
    # WHEN it closes without releasing the lease
    other.close()
    # THEN the lease is a lease_leak, counted as one, and it is released: its blocks are free
    # again
    (f,) = pool.findings()
    assert f.kind == LEAK and "closed the pool" in f.message and f.request == "r"
    assert pool.leases() == []
    t = lease_totals(pool.view)
    assert t["held"] == 0 and t["quarantined"] == 0 and t["reclaimed"] == 1
    assert t["leaked"] == 1
    assert not np.any(pool.view.lease_counts)
    with pytest.raises(PoolError, match="closed"):
        lease.release()


def test_a_dead_holders_leases_are_reclaimed_with_its_blocks(make_pool, pool_name):
    # GIVEN a worker that leases its request's blocks, frees the request and is killed
    pool = make_pool(16)

    def work() -> KVPool:
        p = KVPool.attach(pool_name)
        seq = p.allocate("dead-r", list(range(10)))
        p.lease(seq, "read", holder="offloader")
        p.free(seq)
        return p

    pid = killed_after(work)
    (row,) = pool.leases()
    assert row["pid"] == pid
    # WHEN a survivor reclaims the dead
    pool.reclaim_dead()
    # THEN its lease is gone and every block can be allocated again
    assert pool.leases() == [] and not np.any(pool.view.lease_counts)
    assert lease_totals(pool.view)["reclaimed"] == 1
    seq = pool.allocate("all", list(range(16 * 4)))
    assert len(seq.block_table) == 16


def test_release_when_a_future_completes_and_async_with(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(10)))
    lease = pool.lease(seq, "read", holder="h")
    done: Future = Future()
    lease.release_when(done)
    assert not lease.released and len(pool.leases()) == 1
    done.set_result(None)
    assert lease.released and pool.leases() == []
    assert lease.release() is True  # (idempotent: the first answer)

    async def transfer() -> None:
        async with pool.lease(seq, "write", holder="async") as held:
            assert len(pool.leases()) == 1 and held.mode == "write"

    asyncio.run(transfer())
    assert pool.leases() == [] and kinds(pool) == []


@pytest.mark.parametrize(
    ("target", "mode", "error"),
    [
        ("seq", "copy", "mode must be 'read' or 'write'"),
        ([999], "read", "not a block id"),
        (["x"], "read", "not a block id"),
        ([], "read", "nothing to lease"),
        (5, "read", "a Sequence or a list"),
        ("free", "read", "not held or cached"),
    ],
)
def test_a_bad_lease_is_one_pool_error_and_changes_nothing(make_pool, target, mode, error):
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(10)))
    free_block = next(b for b in range(16) if b not in seq.block_table)
    arg = (
        {"seq": seq, "free": [free_block]}.get(target, target)
        if isinstance(target, str)
        else target
    )
    with pytest.raises(PoolError, match=error):
        pool.lease(arg, mode, holder="h")
    assert pool.leases() == [] and lease_totals(pool.view)["taken"] == 0


def test_block_ids_may_be_numpy_integers(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(10)))
    lease = pool.lease(np.asarray(seq.block_table, np.int64), "read", holder="h")
    assert lease.blocks == seq.block_table and pool.leases()[0]["blocks"] == seq.block_table
    lease.release()


def test_a_bad_timeout_is_refused(make_pool):
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(10)))
    with pytest.raises(PoolError, match="timeout"):
        pool.lease(seq, "read", holder="h", timeout=0)


def test_the_lease_table_is_full_at_its_capacity(make_pool):
    # (a quarter of max_seqs, at least 64, at most max_seqs: 4 here)
    pool = make_pool(16, max_seqs=4)
    seq = pool.allocate("r", list(range(4)))
    leases = [pool.lease(seq, "read", holder=f"h{i}") for i in range(4)]
    with pytest.raises(PoolError, match="lease table is full"):
        pool.lease(seq, "read", holder="one more")
    # a block leased four times counts four
    assert int(pool.view.lease_counts[seq.block_table[0]]) == 4
    for lease in leases:
        lease.release()
    assert not np.any(pool.view.lease_counts)


def test_another_processes_unpublished_block_cannot_be_leased(make_pool, pool_name):
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(10)))
    other = KVPool.attach(pool_name)
    try:
        with pytest.raises(PoolError, match="another process's unpublished block"):
            other.lease(seq.block_table, "read", holder="h")
    finally:
        other.close()


def _lease_then_die(name: str, kill_at: int) -> None:
    code = 4
    try:
        pool = KVPool.attach(name)
        seq = pool.allocate("doomed", list(range(10)))
        pool._core.set_crash_at(kill_at)
        lease = pool.lease(seq, "write", holder="h")
        pool.free(seq)
        lease.release()
        other = pool.allocate("after", list(range(10)))
        pool.lease(other.block_table, "read", holder="h").release()
        code = 3  # (not killed: every save passed)
    finally:
        os._exit(code)


@pytest.mark.slow
def test_a_kill_at_any_journal_save_of_a_lease_loses_nothing(make_pool):
    # GIVEN a process that takes a lease, frees its request, releases the lease and leases again
    pool = make_pool(16)
    for n in range(1, 200):
        # WHEN it is killed at its n-th journal save from the lease on
        pid = os.fork()
        if pid == 0:
            _lease_then_die(pool.name, n)
        status = wait_child(pid)
        if status == 3:
            break
        assert status == -signal.SIGKILL, (n, status)
        # THEN a survivor's reclaim leaves no lease, no count, no quarantined block: every block
        # can be allocated, and the pool checks clean
        pool.reclaim_dead()
        assert pool.leases() == [] and not np.any(pool.view.lease_counts), n
        t = lease_totals(pool.view)
        assert t["held"] == 0 and t["quarantined"] == 0, (n, t)
        everything = pool.allocate("all", list(range(16 * 4)))
        pool.free(everything)
        assert [f.kind for f in pool.check()] == [], n
    else:
        pytest.fail("the lease work never finished")
    assert n > 8  # (it was killed at each save before)


@pytest.mark.parametrize("guard", [False, True], ids=["plain", "guard"])
def test_a_pool_holding_quarantined_leased_blocks_checks_clean(make_pool, guard):
    # GIVEN a request's written K/V leased, the request freed (its blocks quarantined unpoisoned)
    pool = make_pool(16, guard=guard)
    seq = pool.allocate("r", list(range(12)))
    pool.kv[:, :, seq.block_table, : pool.block_size] = 3.0
    lease = pool.lease(seq, "read", holder="offloader")
    mine = list(seq.block_table)
    pool.free(seq)
    # THEN the K/V the transfer reads is still there, and every check is clean
    assert bool((pool.kv[:, :, mine, : pool.block_size] == 3.0).all())
    assert pool.check() == [] and pool.verify() == []
    lease.release()
    assert pool.check() == []


def test_a_long_sequences_leased_blocks_are_all_quarantined(make_pool):
    # GIVEN a request of 300 blocks (released in several transactions), leased
    pool = make_pool(400)
    seq = pool.allocate("long", list(range(1200)))
    mine = set(seq.block_table)
    lease = pool.lease(seq, "read", holder="offloader")
    # WHEN it is freed, THEN none of its blocks is handed out while the lease holds them
    pool.free(seq)
    assert lease_totals(pool.view)["quarantined"] == 300
    other = pool.allocate("other", list(range(5000, 5000 + 100 * 4)))
    assert not set(other.block_table) & mine
    with pytest.raises(PoolExhausted):
        pool.allocate("more", list(range(9000, 9000 + 4 * 4)))
    lease.release()
    assert len(pool.allocate("more", list(range(9000, 9000 + 4 * 4))).block_table) == 4


def test_another_processes_eviction_passes_over_a_leased_block(make_pool, pool_name):
    # GIVEN a published prompt's cached blocks, one leased by this handle
    pool = make_pool(16)
    a = pool.allocate("a", list(range(13)))
    pool.mark_computed(a, 13)
    cached = a.block_table[:3]
    pool.free(a)
    lease = pool.lease(cached[1:2], "read", holder="offloader")
    pool.flush_local()  # (its last, unpublished block: for the other process to take)
    # WHEN another process's handle needs every block there is
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            other = KVPool.attach(pool_name)
            try:
                other.allocate("all", list(range(100, 100 + 16 * 4)))
            except PoolExhausted:
                code = (
                    3
                    if len(other.allocate("most", list(range(200, 200 + 15 * 4))).block_table) == 15
                    else 4
                )
        finally:
            os._exit(code)
    # THEN it gets every block but the leased one, which stays cached
    assert wait_child(pid) == 3
    assert states(pool, cached[1:2]) == [BlockState.CACHED]
    lease.release()


def test_a_lease_that_waited_for_a_lock_gives_the_op_mutex_back(make_pool, pool_name):
    # GIVEN another process holding the free lock until told to let go
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(10)))
    held, go = os.pipe(), os.pipe()

    def hold() -> int:
        p = KVPool.attach(pool_name)
        lockholder.hold(p, p.locks.index("free"))
        os.write(held[1], b"1")
        os.read(go[0], 1)
        lockholder.let_go(p, p.locks.index("free"))
        return 0

    pid = fork_child(hold, 30)
    assert os.read(held[0], 1) == b"1"
    # WHEN a thread's lease waits for it (holding the handle's op mutex meanwhile), and gets it
    got: list = []
    t = threading.Thread(target=lambda: got.append(pool.lease(seq, "read", holder="h")))
    t.start()
    while t.is_alive() and pool.op_mutex.acquire(blocking=False):  # (until it waits, under it)
        pool.op_mutex.release()
        t.join(0.001)
    os.write(go[1], b"1")
    t.join()
    assert wait_child(pid) == 0
    # THEN the mutex is free again: another thread's release runs, and so does this one's
    assert pool.op_mutex.acquire(blocking=False)
    pool.op_mutex.release()
    (lease,) = got
    other = threading.Thread(target=lease.release)
    other.start()
    other.join()
    assert lease.released and pool.leases() == []
    for fd in (*held, *go):
        os.close(fd)


def test_a_lease_finding_names_the_line_that_took_the_lease(make_pool):
    # GIVEN a pool under the ownership probe (allocation sites recorded, as under kvscope run)
    pool = make_pool(16)
    pool.probe = PoolProbes(pool, ProbeFlags(ownership=True))
    seq = pool.allocate("r", list(range(10)))
    line = sys._getframe().f_lineno + 1
    lease = pool.lease(seq, "write", holder="rdma")
    # WHEN the request is aborted under the transfer, which then completes
    pool.abort(seq)
    lease.release()
    # THEN the finding names where the lease was taken, beside its holder
    (f,) = [f for f in pool.findings() if f.kind == LATE]
    assert f"(pid {os.getpid()}, taken at tests/test_leases.py:{line} " in f.message, f.message
