"""The C core takes the pool's locks itself: lockdep's edges are learned in the core (the
findings lock waited for, a dead holder of it recovered), the sites lock is waited for and
recovered before an operation's site is recorded, a finding is written under a findings lock a
dead process held, a journal this client left open is rolled back, another thread's operation on
the handle is waited for, and a wait that fails is an OSError."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time

import pytest

from kvscope.allocator import KVPool, faults, sites
from kvscope.allocator.findings import Finding
from kvscope.allocator.sites import site_frames
from kvscope.probes.lockdep import LockDep, TracedLock
from tests import lockholder
from tests.forking import fork_child, wait_child
from tests.journals import journal_save

CHILD_ALARM_S = 20


def _kinds(pool: KVPool, kind: str) -> list[Finding]:
    return [f for f in pool.findings() if f.kind == kind]


def _killed_holding(pool: KVPool, lock: str) -> int:
    """A process that attached, took `lock` and was killed holding it: its pid."""

    def die() -> int:
        p = KVPool.attach(pool.name)
        lockholder.hold(p, p.locks.index(lock))
        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    pid = fork_child(die, CHILD_ALARM_S)
    assert wait_child(pid) == -signal.SIGKILL
    assert int(pool.view.locks["holder_pid"][pool.locks.index(lock)]) == pid
    return pid


def _holding(pool: KVPool, lock: str, hold_s: float) -> int:
    """A process that holds `lock` for hold_s seconds (returns once it holds it): its pid."""
    r, w = os.pipe()

    def hold() -> int:
        p = KVPool.attach(pool.name)
        lockholder.hold(p, p.locks.index(lock))
        os.write(w, b"1")
        time.sleep(hold_s)
        lockholder.let_go(p, p.locks.index(lock))
        return 0

    pid = fork_child(hold, CHILD_ALARM_S)
    os.read(r, 1)
    return pid


def _waiting_in_thread(pool: KVPool, fn) -> tuple[threading.Thread, list]:
    """fn (an operation that waits for a pool lock another process holds) started in a thread
    of its own, returned once it waits: it holds the handle's op mutex then. The thread, and
    the list its result goes into."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(fn()))
    t.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not pool.op_mutex.acquire(blocking=False):
            return t, got
        pool.op_mutex.release()
        time.sleep(0.005)
    raise AssertionError("the operation did not wait")


def _in_thread(fn):
    out: list = []

    def run() -> None:
        try:
            out.append((fn(), None))
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            out.append((None, e))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    ((got, err),) = out
    if err is not None:
        raise err
    return got


# -- lockdep --------------------------------------------------------------------------------


def test_an_operation_under_a_traced_lock_that_closes_a_cycle_runs_in_the_core(make_pool):
    # GIVEN lockdep, a traced user lock, and the graph's edge seqs -> user:cache (a thread that
    # took the lock while it held the sequence-table lock)
    pool = make_pool(32)
    lockdep = LockDep()
    lockdep.instrument(pool)
    cache = TracedLock("cache", pool, lockdep=lockdep)

    def seqs_then_cache() -> None:
        lockholder.hold(pool, pool.SEQS)
        with cache:
            pass
        lockholder.let_go(pool, pool.SEQS)

    _in_thread(seqs_then_cache)
    ops = pool._core.stats()["native_ops"]

    # WHEN a thread allocates and frees while it holds the traced lock
    def cache_then_pool() -> None:
        with cache:
            pool.free(pool.allocate("a", [1, 2, 3]))

    _in_thread(cache_then_pool)
    # THEN the core ran both operations, and wrote the cycle its edge closed
    assert pool._core.stats()["native_ops"] == ops + 2
    (f,) = _kinds(pool, "lock_order_cycle")
    assert "takes user:cache -> seqs" in f.message and "took seqs -> user:cache" in f.message


def test_lockdep_recovers_a_dead_holder_of_the_findings_lock_in_the_core(make_pool):
    # GIVEN lockdep, and a process killed while it held the findings lock
    pool = make_pool(32)
    LockDep().instrument(pool)
    pid = _killed_holding(pool, "findings")
    # WHEN an allocation takes an order edge lockdep has not seen (seqs -> free)
    pool.allocate("a", [1, 2, 3])
    # THEN the core recovered the lock, learned the edge and ran the operation
    assert int(pool.view.locks["holder_pid"][pool.locks.index("findings")]) == 0
    (f,) = _kinds(pool, "lock_dead_holder")
    assert f.owner_pid == pid and "'findings'" in f.message
    g = pool.view.lockgraph[: int(pool.view.h["lockgraph_used"])]
    assert ("seqs", "free") in {(bytes(e["src"]).decode(), bytes(e["dst"]).decode()) for e in g}


def test_a_traced_lock_taken_while_the_core_holds_pool_locks_gives_edges_from_them(make_pool):
    # GIVEN lockdep and a traced user lock, taken by Python the core calls while its
    # transaction holds the prompt's index shard and the sequence-table lock (the
    # lock-inversion fault's announcement, inside the transaction)
    pool = make_pool(32)
    lockdep = LockDep()
    lockdep.instrument(pool)
    cache = TracedLock("cache", pool, lockdep=lockdep)
    prompt = list(range(8))
    pool.mark_computed(pool.allocate("first", prompt), 8)

    def take_cache(name: str) -> None:
        with cache:
            pass

    faults.ON_FIRE.append(take_cache)
    faults.configure("lock-inversion:1")
    try:
        # WHEN a hit takes them
        pool.allocate("hit", prompt + [99])
    finally:
        faults.configure(None)
        faults.ON_FIRE.remove(take_cache)
    # THEN the edges from both pool classes into the user lock are in the segment's graph
    g = pool.view.lockgraph[: int(pool.view.h["lockgraph_used"])]
    edges = {(bytes(e["src"]).decode(), bytes(e["dst"]).decode()) for e in g}
    assert {("index", "user:cache"), ("seqs", "user:cache")} <= edges


# -- sites ----------------------------------------------------------------------------------


def _alloc_here(pool: KVPool):
    return pool.allocate("sited", [7] * 5), sys._getframe()


def _site_text(pool: KVPool, seq) -> list[str]:
    return site_frames(pool.view, int(pool.view.blocks["site"][seq.block_table[0]]))


def test_a_dead_holder_of_the_sites_lock_is_recovered_before_the_site_is_recorded(
    make_pool, monkeypatch
):
    # GIVEN the ownership probe, and a process killed while it held the sites lock
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    pool = make_pool(16)
    pid = _killed_holding(pool, "sites")
    # WHEN a sequence is allocated
    seq, frame = _alloc_here(pool)
    # THEN the core recovered the lock and recorded the allocation's own site
    assert _site_text(pool, seq) == [sites.frame_text(frame)]
    (f,) = _kinds(pool, "lock_dead_holder")
    assert f.owner_pid == pid and "'sites'" in f.message


def test_a_site_waits_for_the_sites_lock_another_process_holds(make_pool, monkeypatch):
    # GIVEN the ownership probe, and another process holding the sites lock for 0.3 s
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    pool = make_pool(16)
    pid = _holding(pool, "sites", 0.3)
    t0 = time.monotonic()
    # WHEN a sequence is allocated meanwhile
    seq, frame = _alloc_here(pool)
    # THEN the core waited for the lock and recorded the allocation's own site
    assert time.monotonic() - t0 > 0.1
    assert wait_child(pid) == 0
    assert _site_text(pool, seq) == [sites.frame_text(frame)]
    i = pool.locks.index("sites")
    assert int(pool.view.locks["num_contended"][i]) == 1


# -- findings -------------------------------------------------------------------------------


def test_report_writes_under_a_findings_lock_a_dead_process_held(make_pool):
    # GIVEN a process killed while it held the findings lock
    pool = make_pool(16)
    pid = _killed_holding(pool, "findings")
    # WHEN a finding is reported
    pool.report(Finding("leak_orphan", "after the death"))
    # THEN the core recovered the lock and wrote the finding, after the dead holder's
    assert [f.kind for f in pool.findings()] == ["lock_dead_holder", "leak_orphan"]
    assert pool.findings()[0].owner_pid == pid


def test_report_waits_for_another_threads_operation_on_the_handle(make_pool):
    # GIVEN another thread's allocation waiting for the sequence-table lock another process
    # holds (the handle's lock bookkeeping is that operation's meanwhile)
    pool = make_pool(32)
    pid = _holding(pool, "seqs", 0.3)
    t, got = _waiting_in_thread(pool, lambda: pool.allocate("first", [1, 2, 3]))
    # WHEN this thread reports a finding
    pool.report(Finding("leak_orphan", "while it waits"))
    # THEN it was written once that operation was done, and that operation ran in the core
    t.join()
    assert wait_child(pid) == 0
    assert [f.kind for f in pool.findings()] == ["leak_orphan"]
    assert got[0].request_id == "first"


@pytest.mark.slow
def test_report_under_the_findings_lock_this_thread_holds_writes_at_once(make_pool):
    # GIVEN another thread's allocation waiting for the sequence-table lock another process
    # holds, and this thread holding the findings lock through the lock table (as lockdep's
    # graph and the watchdog write: an operation may wait for that lock meanwhile)
    pool = make_pool(32)
    pid = _holding(pool, "seqs", 0.5)
    t, got = _waiting_in_thread(pool, lambda: pool.allocate("first", [1, 2, 3]))
    findings = pool.locks.index("findings")
    lockholder.hold(pool, findings)
    try:
        # WHEN it records a finding
        pool.record(Finding("leak_orphan", "under the lock"))
        # THEN the core wrote it under that lock at once, while the operation still waits
        assert t.is_alive()
    finally:
        lockholder.let_go(pool, findings)
    t.join()
    assert wait_child(pid) == 0
    assert [f.kind for f in pool.findings()] == ["leak_orphan"] and got[0].request_id == "first"


# -- a journal left open --------------------------------------------------------------------


def test_a_journal_this_client_left_open_is_rolled_back_by_the_next_operation(make_pool):
    # GIVEN this client's journal left open over a half-written free ring count, as a process
    # would leave it that died inside an operation (its locks already let go)
    pool = make_pool(32)
    pool.free(pool.allocate("warm", [1, 2, 3, 4, 5]))
    count = pool.view.ring_header["count"]
    before = int(count[0])
    at = pool.view.offsets["ring"] + pool.view.ring_header.dtype.fields["count"][1]
    journal_save(pool, at, 4)
    count[0] = 0
    assert int(pool.view.clients["journal_count"][pool.client]) == 1
    ops = pool._core.stats()["native_ops"]
    # WHEN the next operation runs
    seq = pool.allocate("next", [9, 9, 9, 9, 9])
    # THEN the core rolled the journal back and ran it
    assert pool._core.stats()["native_ops"] == ops + 1
    assert int(pool.view.clients["journal_count"][pool.client]) == 0
    assert int(count[0]) == before
    pool.free(seq)
    assert pool.check() == []


# -- waits ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_operation_waits_for_another_threads_operation_on_the_handle(make_pool):
    # GIVEN another process holding the sequence-table lock for 0.4 s, and a thread whose
    # allocation waits for it (the op mutex held, the GIL let go)
    pool = make_pool(32)
    pid = _holding(pool, "seqs", 0.4)
    t, got = _waiting_in_thread(pool, lambda: pool.allocate("first", [1, 2, 3]))
    # WHEN this thread allocates meanwhile
    second = pool.allocate("second", [4, 5, 6])
    t.join()
    # THEN it waited for that operation, and both ran in the core
    assert wait_child(pid) == 0
    assert [s.request_id for s in (got[0], second)] == ["first", "second"]
    assert pool.check() == []


@pytest.mark.slow
def test_a_wait_for_the_op_mutex_another_thread_holds_is_waited_in_the_core(make_pool):
    # GIVEN a cached block, another process holding the sequence-table lock for 0.3 s, and
    # another thread of this one holding the handle's op mutex for 0.6 s, then evicting and
    # allocating under it (as `evict` and otel's spans hold it)
    pool = make_pool(32)
    cached = pool.allocate("cached", list(range(8)))
    pool.mark_computed(cached, 8)
    pool.free(cached)
    held = threading.Event()
    evicted: list[int] = []

    def hold_mutex() -> None:
        with pool.op_mutex:
            held.set()
            time.sleep(0.6)
            evicted.append(pool.evict(1))
            pool.free(pool.allocate("under", [4, 5, 6]))

    t = threading.Thread(target=hold_mutex)
    t.start()
    held.wait()
    pid = _holding(pool, "seqs", 0.3)
    t0 = time.monotonic()
    # WHEN this thread allocates (it must wait for the lock, and so for the mutex first)
    seq = pool.allocate("a", [1, 2, 3])
    # THEN it waited for both, the operations under the mutex went first (the allocation held
    # no lock while it waited for the mutex), and the core ran them all
    assert time.monotonic() - t0 > 0.2
    t.join(10)
    assert not t.is_alive() and evicted == [1]
    assert wait_child(pid) == 0
    assert seq.request_id == "a"
    assert pool.check() == []


def test_a_wait_that_fails_is_an_oserror_with_its_errno(make_pool):
    # GIVEN this thread holding the sequence-table lock through the lock table
    pool = make_pool(32)
    lockholder.hold(pool, pool.SEQS)
    try:
        # WHEN it allocates (the core must take that lock: the error-checking mutex refuses)
        with pytest.raises(OSError) as e:
            pool.allocate("a", [1, 2, 3])
    finally:
        lockholder.let_go(pool, pool.SEQS)
    # THEN the error names the lock and the errno, and the pool is as it was
    assert e.value.errno == errno.EDEADLK and "pool lock 'seqs'" in str(e.value)
    assert pool.live() == {} and pool.check() == []
    pool.free(pool.allocate("b", [1, 2, 3]))


def _holding_until_told(pool: KVPool, lock: str) -> tuple[int, int]:
    """A process that holds `lock` until a byte is written to the returned pipe end (returns
    once it holds it): its pid, and that pipe end."""
    r, w = os.pipe()
    go_r, go_w = os.pipe()

    def hold() -> int:
        p = KVPool.attach(pool.name)
        lockholder.hold(p, p.locks.index(lock))
        os.write(w, b"1")
        os.read(go_r, 1)
        lockholder.let_go(p, p.locks.index(lock))
        return 0

    pid = fork_child(hold, CHILD_ALARM_S)
    os.read(r, 1)
    return pid, go_w


def test_an_operation_that_must_wait_for_a_lock_holds_no_other_meanwhile(make_pool):
    # GIVEN a published prompt (an allocation of it takes its index shard's lock, then the
    # free lock for its new blocks), and another process holding the free lock
    pool = make_pool(64, local_cache_size=1)
    prompt = list(range(16))
    owner = pool.allocate("owner", prompt)
    pool.mark_computed(owner, len(prompt))
    pid, go = _holding_until_told(pool, "free")
    # WHEN a thread allocates the prompt and more, and waits for the free lock
    t, got = _waiting_in_thread(pool, lambda: pool.allocate("hit", prompt + list(range(20))))
    # THEN it waits holding no lock (the shard's is free for others meanwhile): the only lock
    # held is the free lock, by the other process
    holders = pool.view.locks["holder_pid"]
    assert [(pool.locks.names[i], int(h)) for i, h in enumerate(holders) if h] == [("free", pid)]
    # and once the free lock is let go, the allocation runs, with its hit
    os.write(go, b"1")
    t.join(10)
    assert not t.is_alive() and wait_child(pid) == 0
    assert got[0].num_cached_tokens == 16 and got[0].block_table[:4] == owner.block_table
    assert pool.check() == []
