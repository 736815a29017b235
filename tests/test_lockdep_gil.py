"""lockdep sees the GIL: the class `gil`, edges from a traced lock's holder to it, waits on
events and conditions as edges, the core's waits letting the GIL go and one that keeps it
reported (the gil-wait fault). Nothing here deadlocks: the edges and cycles are found from one
thread's acquisitions, and the one test with two threads finishes however they are scheduled."""

from __future__ import annotations

import faulthandler
import threading

import pytest

from kvscope.allocator import faults
from kvscope.probes.lockdep import GIL, LockDep, TracedCondition, TracedEvent, TracedLock
from tests import lockholder


def _edges(pool) -> set[tuple[str, str]]:
    g = pool.view.lockgraph[: int(pool.view.h["lockgraph_used"])]
    return {(s.decode(), d.decode()) for s, d in zip(g["src"].tolist(), g["dst"].tolist())}


def _kinds(pool) -> list[str]:
    return [f.kind for f in pool.findings()]


@pytest.fixture
def traced(make_pool):
    pool = make_pool(64)
    lockdep = LockDep()
    lockdep.instrument(pool)
    yield pool, lockdep
    lockdep.uninstrument(pool)
    faults.configure(None)


def test_a_traced_locks_holder_waits_for_the_gil(traced):
    # GIVEN a traced lock of the pool's graph, WHEN taken
    pool, lockdep = traced
    with TracedLock("cache", pool, lockdep=lockdep):
        pass
    # THEN its holder runs Python, so user:cache -> gil is in the segment's graph
    assert ("user:cache", GIL) in _edges(pool) and _kinds(pool) == []


def test_waiting_on_an_event_whose_setter_takes_the_lock_is_a_cycle(traced):
    # GIVEN an event set by a thread holding lock L (the waiter depends on L and on the GIL)
    pool, lockdep = traced
    lock = TracedLock("L", pool, lockdep=lockdep)
    done = TracedEvent("done", pool, lockdep=lockdep)
    with lock:
        done.set()
    assert {("wait:done", "user:L"), ("wait:done", GIL)} <= _edges(pool)
    assert _kinds(pool) == []
    # WHEN a thread waits for it holding L (it is set: the wait returns at once)
    with lock:
        assert done.wait()
    # THEN the edge L -> wait:done closes the cycle, reported before the wait
    (f,) = pool.findings()
    assert f.kind == "lock_order_cycle"
    assert "takes user:L -> wait:done" in f.message and "took wait:done -> user:L" in f.message


def test_a_conditions_own_lock_gives_no_edge_but_another_held_lock_does(traced):
    # GIVEN a condition notified by a thread holding M (and the condition's own lock)
    pool, lockdep = traced
    m = TracedLock("M", pool, lockdep=lockdep)
    cond = TracedCondition("ready", pool=pool, lockdep=lockdep)
    with m, cond:
        cond.notify_all()
    edges = _edges(pool)
    assert ("wait:ready", "user:M") in edges and ("wait:ready", "user:ready") not in edges
    # WHEN a thread waits on it holding only its own lock (timeout 0: no real wait)
    with cond:
        assert cond.wait(timeout=0) is False
    # THEN nothing: the wait lets its own lock go
    assert ("user:ready", "wait:ready") not in _edges(pool) and _kinds(pool) == []
    # AND one that waits holding M closes M -> wait:ready -> M
    with m, cond:
        assert cond.wait_for(lambda: True, timeout=0)
    assert _kinds(pool) == ["lock_order_cycle"]


def test_a_native_wait_holding_the_gil_for_a_python_signaller_is_a_cycle(traced):
    # GIVEN a worker's event set from Python (wait:work -> gil), the kvcached shape: a binding
    # waits on it without letting the GIL go
    pool, lockdep = traced
    work = TracedEvent("work", pool, lockdep=lockdep)
    work.set()
    # WHEN that wait is declared
    lockdep.native_wait(work.cls, lockdep.graph_for(pool))
    # THEN gil -> wait:work closes the cycle through the GIL
    (f,) = pool.findings()
    assert f.kind == "lock_order_cycle" and "takes gil -> wait:work" in f.message


def test_the_gil_wait_fault_is_reported_before_the_wait(traced):
    # GIVEN lockdep on the pool and the gil-wait fault armed for the next transaction
    pool, lockdep = traced
    faults.configure("gil-wait:1")
    # WHEN an allocation runs (its first lock waited for with the GIL kept)
    seq = pool.allocate("r", list(range(9)))
    # THEN the fault fired, and one wait_holds_gil names the lock and the caller's line
    assert faults.FIRED[-1] == "gil-wait" and not faults.ARMED
    (f,) = pool.findings()
    assert f.kind == "wait_holds_gil" and f.owner_pid == pool.pid
    assert "holding the GIL" in f.message and "test_lockdep_gil.py:" in f.message
    lock = f.message.split("pool lock '")[1].split("'")[0].split(".")[0]  # (its class)
    # (the cycle its edge closes with the core's own lock -> gil is this finding, not another)
    assert {(GIL, lock), (lock, GIL)} <= _edges(pool)
    # AND the operations go on, reporting nothing more
    pool.free(seq)
    pool.free(pool.allocate("s", list(range(9))))
    assert _kinds(pool) == ["wait_holds_gil"]


def test_the_cores_locks_precede_the_gil_and_a_native_wait_for_one_is_a_cycle(traced):
    # GIVEN an operation of the core's under lockdep: it waits for its locks letting the GIL
    # go, and takes the GIL back holding them
    pool, lockdep = traced
    pool.free(pool.allocate("r", list(range(9))))
    edges = _edges(pool)
    assert ("seqs", GIL) in edges and ("free", GIL) in edges and _kinds(pool) == []
    # WHEN native code declares a wait for the seqs lock that keeps the GIL
    lockdep.native_wait("seqs", lockdep.graph_for(pool))
    # THEN gil -> seqs -> gil is the cycle, reported
    (f,) = pool.findings()
    assert f.kind == "lock_order_cycle" and "takes gil -> seqs" in f.message


def test_the_gil_wait_fault_without_lockdep_reports_nothing(make_pool):
    pool = make_pool(64)
    try:
        faults.configure("gil-wait:1")
        pool.free(pool.allocate("r", list(range(9))))
        assert faults.FIRED[-1] == "gil-wait" and pool.findings() == []
    finally:
        faults.configure(None)


def test_the_cores_wait_for_a_lock_lets_the_gil_go(traced):
    # GIVEN this thread holding the pool's `free` lock (tests/lockholder.py), and a second
    # thread whose allocation needs it
    pool, _ = traced
    free = pool.locks.index("free")
    lockholder.hold(pool, free)
    published = pool.view.clients["op"][pool.client : pool.client + 1]
    errors: list[BaseException] = []

    def allocate():
        try:
            pool.free(pool.allocate("w", list(range(9))))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    worker = threading.Thread(target=allocate)
    # (a core that kept the GIL here would stop this thread for good: fail, do not hang)
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        worker.start()
        # WHEN the worker waits for the lock: its wait is published in its client record, and
        # this thread, which needs the GIL to read it, sees it
        while int(published[0]) == 0:
            if not worker.is_alive():
                break
            threading.Event().wait(0.001)
        waited = int(published[0]) != 0
    finally:
        lockholder.let_go(pool, free)
        worker.join()
        faulthandler.cancel_dump_traceback_later()
    # THEN the worker was seen waiting (the GIL let go), and finished once the lock was free
    assert waited and errors == [] and _kinds(pool) == []


def test_without_a_pool_the_gil_edges_go_to_the_process_graph():
    # GIVEN lockdep with no pool (its findings to a callback), WHEN a thread sets an event
    # holding L, then waits for it holding L
    found = []
    lockdep = LockDep(on_finding=found.append)
    lockdep.enabled = True
    lock = TracedLock("L", lockdep=lockdep)
    ev = TracedEvent("ev", lockdep=lockdep)
    with lock:
        ev.set()
    with lock:
        assert ev.wait(timeout=0)
    # THEN the process's own graph has L -> gil and the event's edges, and the cycle is found
    edges = {(e.src, e.dst) for e in lockdep.local.edges()}
    assert {
        ("user:L", GIL),
        ("wait:ev", GIL),
        ("wait:ev", "user:L"),
        ("user:L", "wait:ev"),
    } <= edges
    assert [f.kind for f in found] == ["lock_order_cycle"]
