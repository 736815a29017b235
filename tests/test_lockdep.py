"""lockdep and the lock watchdog: cycles named before they deadlock, long holds named with a stack."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from kvscope.allocator import KVPool, _native, faults
from kvscope.allocator.probing import NATIVE_LOCKDEP
from kvscope.probes.lockdep import LOCKDEP, LockDep, SegmentGraph, TracedLock
from kvscope.probes.watchdog import Watchdog, install
from tests import lockholder
from tests.forking import fork_child

CHILD_ALARM_S = 20


def _fork(fn: Callable[[], int]) -> int:
    return fork_child(fn, CHILD_ALARM_S)


def _wait(pid: int, timeout_s: float = 30.0) -> int:
    """Exit code of a child (killed and -9 if it outlives the timeout)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -9


def _attached(name: str) -> tuple[KVPool, LockDep]:
    pool = KVPool.attach(name)
    lockdep = LockDep()
    lockdep.instrument(pool)
    return pool, lockdep


def _cycles(pool: KVPool) -> list:
    return [f for f in pool.findings() if f.kind == "lock_order_cycle"]


def _published(pool: KVPool, base: int = 0) -> list[int]:
    """A prompt of two blocks, allocated and published (its first allocation fills this
    process's local cache, from which the hits below take their block)."""
    prompt = list(range(base, base + 8))
    pool.mark_computed(pool.allocate(f"first-{base}", prompt), 8)
    return prompt


def _hit(pool: KVPool, prompt: list[int]) -> None:
    """An allocation that hits a published prefix: on a pool too small for slot reserves, the
    core takes the sequence-table lock and the prompt's index shard together."""
    pool.allocate("hit", prompt + [99])


def _hit_prefix(pool: KVPool) -> None:
    _hit(pool, _published(pool))


def _inverted_hit(pool: KVPool, prompt: list[int]) -> None:
    """A hit with the lock-inversion fault armed for it: the core takes the prompt's index
    shard, then the sequence-table lock."""
    faults.configure("lock-inversion:1")
    try:
        pool.allocate("inverted", prompt + [98])
    finally:
        faults.configure(None)
    assert faults.FIRED[-1] == "lock-inversion"


def test_opposite_orders_in_two_processes_are_reported_with_both_chains(make_pool):
    # GIVEN a pool, a process whose allocation hits a prefix (seqs -> index), then one whose
    # hit takes the locks the other way round (index -> seqs)
    pool = make_pool(32)

    def hitter() -> int:
        p, _ = _attached(pool.name)
        _hit_prefix(p)
        return 0

    def inverter() -> int:
        p, _ = _attached(pool.name)
        _inverted_hit(p, _published(p, 100))
        return 0

    # WHEN they run one after the other (they never overlap, so nothing deadlocks)
    p1 = _fork(hitter)
    assert _wait(p1) == 0
    p2 = _fork(inverter)
    assert _wait(p2) == 0

    # THEN one lock_order_cycle names both chains, their pids and sites
    (f,) = _cycles(pool)
    assert f.severity == "error" and f.owner_pid == p2
    assert f"pid {p2} takes index -> seqs at test_lockdep.py:" in f.message
    assert f"pid {p1} took seqs -> index at test_lockdep.py:" in f.message
    assert " _inverted_hit; " in f.message and " _hit: " in f.message
    assert "deadlock" in f.message


def test_a_cycle_is_reported_before_the_thread_waits(make_pool):
    # GIVEN a published prompt; a process whose hit of it took index, then seqs (the
    # lock-inversion fault), and holds them (its fault hook waits inside the core's
    # transaction); and another about to hit it too, seqs then index
    pool = make_pool(32)
    prompt = list(range(8))
    pool.mark_computed(pool.allocate("first", prompt), 8)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    held_r, held_w = os.pipe()
    done_r, done_w = os.pipe()

    def warm(p: KVPool) -> None:
        """A first allocation: this process's local cache holds the blocks its hit takes."""
        p.free(p.allocate(f"warm-{os.getpid()}", [1000 + os.getpid() % 1000] * 5))

    def waiter() -> int:
        p, _ = _attached(pool.name)
        warm(p)
        os.write(ready_w, b"1")
        os.read(go_r, 1)
        p.allocate("waiter", prompt + [98])
        return 0

    def holder() -> int:
        p, _ = _attached(pool.name)
        warm(p)
        faults.ON_FIRE.append(lambda name: (os.write(held_w, b"1"), os.read(done_r, 1)))
        faults.configure("lock-inversion:1")
        p.allocate("holder", prompt + [99])
        return 0

    second = _fork(waiter)
    os.read(ready_r, 1)
    first = _fork(holder)
    os.read(held_r, 1)
    # WHEN the second asks for the locks the first holds
    os.write(go_w, b"1")
    end = time.monotonic() + 10
    while not _cycles(pool) and time.monotonic() < end:
        time.sleep(0.02)
    found = _cycles(pool)
    waiting = os.waitpid(second, os.WNOHANG) == (0, 0)
    os.write(done_w, b"1")
    codes = [_wait(first), _wait(second)]
    # THEN the cycle was reported while it waited, and both finish once the first lets go
    (f,) = found
    assert waiting and codes == [0, 0]
    assert f"pid {second} takes seqs -> index at test_lockdep.py:" in f.message
    assert f"pid {first} took index -> seqs at test_lockdep.py:" in f.message


def test_the_documented_order_is_not_a_cycle(make_pool):
    # GIVEN two processes running every pool operation under lockdep
    pool = make_pool(64, num_shards=4)

    def worker() -> int:
        p, lockdep = _attached(pool.name)
        for i in range(5):
            seq = p.allocate(f"r{i}", list(range(10)))
            p.mark_computed(seq, 8)
            p.append(seq, [1, 2, 3])
            child = p.fork(seq, f"c{i}")
            p.append(child, [4])
            p.free(child)
            p.free(seq)
        p.evict(4)
        assert not lockdep.state().stack
        return 0

    # WHEN they run
    codes = [_wait(pid) for pid in [_fork(worker), _fork(worker)]]
    # THEN no cycle is reported and the edges follow the documented order
    assert codes == [0, 0]
    assert _cycles(pool) == []
    order = ["seqs", "index", "free", "gil"]  # (the core takes the GIL back after a wait)
    edges = {(bytes(r["src"]).decode(), bytes(r["dst"]).decode()) for r in pool.view.lockgraph}
    edges.discard(("", ""))
    assert edges and all(order.index(a) < order.index(b) for a, b in edges)


def _core_edges(pool: KVPool) -> dict[tuple[str, str], tuple[int, str]]:
    """The segment graph's edges: (src, dst) -> (pid, site)."""
    g = pool.view.lockgraph[: int(pool.view.h["lockgraph_used"])]
    return {
        (bytes(e["src"]).decode(), bytes(e["dst"]).decode()): (
            int(e["pid"]),
            bytes(e["site"]).decode(),
        )
        for e in g
    }


def test_an_edge_the_core_takes_is_written_into_the_segment_graph(make_pool):
    # GIVEN a pool on the C core under lockdep
    pool = make_pool(32)
    LockDep().instrument(pool)
    # WHEN an allocation hits a published prefix
    before = pool._core.stats()
    _hit_prefix(pool)
    # THEN the core ran every operation, and its edge seqs -> index is in the segment's graph,
    # with this process and the line of this file that called the pool
    after = pool._core.stats()
    assert after["native_ops"] == before["native_ops"] + 3
    pid, site = _core_edges(pool)[("seqs", "index")]
    assert pid == os.getpid() and site.startswith("test_lockdep.py:") and site.endswith(" _hit")
    assert _cycles(pool) == []


def test_an_inversion_through_an_edge_the_core_took_is_a_cycle(make_pool):
    # GIVEN the core's edge seqs -> index in the segment graph
    pool = make_pool(32)
    LockDep().instrument(pool)
    _hit_prefix(pool)
    assert _cycles(pool) == []
    # WHEN a hit takes an index shard, then the sequence-table lock (the lock-inversion fault)
    _inverted_hit(pool, list(range(8)))
    # THEN lockdep reports the cycle, naming the core's edge with its pid and site
    (f,) = _cycles(pool)
    assert f"pid {os.getpid()} takes index -> seqs at test_lockdep.py:" in f.message
    assert "took seqs -> index at test_lockdep.py:" in f.message and " _hit: " in f.message


def test_an_edge_of_the_core_that_would_close_a_cycle_is_reported(make_pool):
    # GIVEN an edge index -> seqs in the segment graph (the lock-inversion fault's)
    pool = make_pool(32)
    LockDep().instrument(pool)
    prompt = _published(pool)
    _inverted_hit(pool, prompt)
    assert _cycles(pool) == []
    # WHEN an allocation hits a published prefix (the core's order: seqs -> index)
    _hit(pool, prompt)
    # THEN the cycle it closes is reported
    (f,) = _cycles(pool)
    assert "takes seqs -> index" in f.message and "took index -> seqs" in f.message


def _read_only(pool: KVPool) -> None:
    """Make this process's numpy views of the graph, the header, the lock records and the
    findings ring read-only: whatever reaches them from Python here still writes through the
    C core, or fails."""
    for arr in (pool.view.lockgraph, pool.view.header, pool.view.locks, pool.view.findings):
        arr.flags.writeable = False


def test_user_lock_edges_are_written_by_the_core_and_read_in_another_process(make_pool):
    # GIVEN a pool, and processes under lockdep whose own views of the segment are read-only
    pool = make_pool(16)

    def takes(first: str, second: str) -> Callable[[], int]:
        def run() -> int:
            p, lockdep = _attached(pool.name)
            _read_only(p)
            a, b = TracedLock(first, p, lockdep=lockdep), TracedLock(second, p, lockdep=lockdep)
            with a, b:
                pass
            return 0

        return run

    # WHEN one takes user lock a then b, and after it another takes b then a
    first = _fork(takes("a", "b"))
    assert _wait(first) == 0
    second = _fork(takes("b", "a"))
    assert _wait(second) == 0
    # THEN their edges are in the segment's graph, as read here, with each pid and its site
    edges = {(e.src, e.dst): e for e in SegmentGraph(pool).edges()}
    ab, ba = edges[("user:a", "user:b")], edges[("user:b", "user:a")]
    assert (ab.pid, ba.pid) == (first, second)
    assert ab.site.startswith("test_lockdep.py:") and ab.site.endswith(" run")
    assert ("user:a", "gil") in edges and ("user:b", "gil") in edges
    # AND the cycle the second closed is in the findings ring, naming both chains
    (f,) = _cycles(pool)
    assert f.owner_pid == second
    assert f.message.startswith(f"pid {second} takes user:b -> user:a at test_lockdep.py:")
    assert f"pid {first} took user:a -> user:b at test_lockdep.py:" in f.message


def test_an_edge_record_past_the_count_is_unused_and_taken_by_the_next_edge(make_pool):
    # GIVEN a graph with one edge, and a record past its count as a writer killed between the
    # record and the count leaves it (written here, as that writer would have)
    pool = make_pool(16)
    assert pool.core.learn_edge("user:x", "user:y", "here:1 f")
    used = int(pool.view.h["lockgraph_used"])
    torn = pool.view.lockgraph[used : used + 1]
    torn["src"], torn["dst"], torn["pid"], torn["site"] = b"user:y", b"user:x", 4242, b"torn"
    # WHEN it is read, THEN the torn record is not an edge (and closes no cycle)
    assert [(e.src, e.dst) for e in SegmentGraph(pool).edges()] == [("user:x", "user:y")]
    # WHEN the next edge is learned
    assert pool.core.learn_edge("user:y", "user:z", "here:2 g")
    # THEN it takes that record, and the count covers it
    assert int(pool.view.h["lockgraph_used"]) == used + 1
    got = [(e.src, e.dst, e.pid, e.site) for e in SegmentGraph(pool).edges()]
    assert got == [
        ("user:x", "user:y", os.getpid(), "here:1 f"),
        ("user:y", "user:z", os.getpid(), "here:2 g"),
    ]
    assert _cycles(pool) == []


def test_user_locks_and_pool_locks_form_cycles_too(make_pool):
    # GIVEN a traced user lock and a pool, both under lockdep
    pool = make_pool(32)
    lockdep = LockDep()
    lockdep.instrument(pool)
    cache = TracedLock("cache", pool, lockdep=lockdep)

    def cache_then_pool() -> None:
        with cache:
            pool.allocate("a", [1, 2, 3])

    def pool_then_cache() -> None:
        lockholder.hold(pool, pool.SEQS)
        with cache:
            pass
        lockholder.let_go(pool, pool.SEQS)

    # WHEN one thread takes cache then seqs, another seqs then cache
    for fn in (cache_then_pool, pool_then_cache):
        t = threading.Thread(target=fn)
        t.start()
        t.join()
    # THEN the cycle is reported with the user lock's class
    (f,) = _cycles(pool)
    assert "takes seqs -> user:cache at test_lockdep.py:" in f.message
    assert "took user:cache -> seqs" in f.message and "cache_then_pool" in f.message


def _in_thread(fn: Callable[[], object]) -> object:
    """fn's result in a thread of its own (what it raised, raised here)."""
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


def test_a_pool_operation_under_a_traced_user_lock_runs_in_the_core(make_pool):
    # GIVEN a pool under lockdep and a traced user lock of it
    pool = make_pool(32)
    lockdep = LockDep()
    lockdep.instrument(pool)
    cache = TracedLock("cache", pool, lockdep=lockdep)
    ops = pool._core.stats()["native_ops"]

    # WHEN a thread allocates and frees while it holds the user lock
    def cache_then_pool() -> list:
        with cache:
            held = _native.traced_locks_held()
            pool.free(pool.allocate("a", [1, 2, 3]))
        return [held, _native.traced_locks_held()]

    held, after = _in_thread(cache_then_pool)
    # THEN the core ran both operations, knowing the held lock (and forgetting it after), and
    # its edge user:cache -> seqs is in the segment's graph with the line that called the pool
    assert held == [("user:cache", id(pool))] and after == []
    assert pool._core.stats()["native_ops"] == ops + 2
    edges = _core_edges(pool)
    pid, site = edges[("user:cache", "seqs")]
    assert pid == os.getpid() and site.startswith("test_lockdep.py:") and "cache_then_pool" in site
    assert {b for a, b in edges if a == "user:cache"} <= {"seqs", "index", "free", "gil"}
    assert _cycles(pool) == []


def test_a_user_lock_of_another_pool_is_not_ordered_against_this_ones(make_pool):
    # GIVEN two pools under lockdep and a traced user lock recording into the second's graph
    pool, other = make_pool(32), make_pool(32)
    lockdep = LockDep()
    lockdep.instrument(pool)
    lockdep.instrument(other)
    theirs = TracedLock("theirs", other, lockdep=lockdep)

    # WHEN a thread holding it allocates from both pools
    def both() -> None:
        with theirs:
            pool.allocate("a", [1, 2, 3])
            other.allocate("b", [1, 2, 3])

    _in_thread(both)
    # THEN only the second pool's graph has an edge from it
    assert not any(a == "user:theirs" for a, b in _core_edges(pool))
    assert ("user:theirs", "seqs") in _core_edges(other)


def test_a_traced_lock_whose_edge_closes_a_cycle_is_reported_once(make_pool):
    # GIVEN a pool under lockdep whose graph holds seqs -> user:cache, and a traced lock "cache"
    pool = make_pool(32)
    lockdep = LockDep()
    lockdep.instrument(pool)
    seen: list = []
    pool.on_finding = seen.append
    cache = TracedLock("cache", pool, lockdep=lockdep)

    def pool_then_cache() -> None:
        lockholder.hold(pool, pool.SEQS)
        with cache:
            pass
        lockholder.let_go(pool, pool.SEQS)

    def cache_then_pool() -> None:
        with cache:
            pool.free(pool.allocate("a", [1, 2, 3]))

    _in_thread(pool_then_cache)
    ops = pool._core.stats()["native_ops"]
    # WHEN a thread allocates and frees under the traced lock (the order that closes it)
    _in_thread(cache_then_pool)
    # THEN the core ran both operations, and reported one lock_order_cycle naming both chains,
    # in the ring and to on_finding, in lockgraph.cycle_finding's words
    assert pool._core.stats()["native_ops"] == ops + 2
    (f,) = _cycles(pool)
    line = cache_then_pool.__code__.co_firstlineno + 2
    took = pool_then_cache.__code__.co_firstlineno + 2
    pid = os.getpid()
    assert f.message == (
        f"pid {pid} takes user:cache -> seqs at test_lockdep.py:{line} cache_then_pool; "
        f"pid {pid} took seqs -> user:cache at test_lockdep.py:{took} pool_then_cache: "
        "opposite orders deadlock when they overlap"
    )
    assert [(g.kind, g.message) for g in seen] == [(f.kind, f.message)]


def test_traced_locks_without_a_pool_report_through_the_callback():
    # GIVEN two traced locks and no pool
    seen: list = []
    lockdep = LockDep(on_finding=seen.append)
    lockdep.enabled = True
    a, b = TracedLock("a", lockdep=lockdep), TracedLock("b", lockdep=lockdep)
    # WHEN they are taken a -> b, then b -> a
    with a, b:
        assert a.locked() and not b.acquire(blocking=False)
    with b, a:
        pass
    # THEN the callback gets one cycle, and the stacks are empty again
    assert [f.kind for f in seen] == ["lock_order_cycle"]
    assert "takes b -> a" not in seen[0].message and "user:b -> user:a" in seen[0].message
    assert lockdep.state().stack == []


def test_lockdep_is_off_by_default_and_switched_by_its_variable(make_pool, monkeypatch):
    # GIVEN a pool (and the process-wide LockDep restored after)
    monkeypatch.setattr(LOCKDEP, "enabled", LOCKDEP.enabled)
    pool = make_pool(16)
    assert install(pool, {}) is None and not pool._probe_bits[0] & NATIVE_LOCKDEP
    # WHEN lockdep is switched on by its variable, used, and switched off
    lockdep = install(pool, {"KVSCOPE_LOCKDEP": "1", "KVSCOPE_LOCK_HOLD_S": "0"})
    assert lockdep is not None and pool._probe_bits[0] & NATIVE_LOCKDEP
    pool.allocate("a", [1, 2, 3])
    lockdep.uninstrument(pool)
    # THEN the core traced the pool's locks while it was on (its edge in the segment), and no
    # longer does
    assert ("seqs", "free") in _core_edges(pool)
    assert not pool._probe_bits[0] & NATIVE_LOCKDEP


@pytest.mark.slow
def test_the_watchdog_reports_a_long_hold_once_with_the_holders_stack(make_pool):
    # GIVEN a pool with a watchdog at 0.2 s and a finding callback
    pool = make_pool(16)
    seen: list = []
    pool.on_finding = seen.append
    dog = Watchdog(pool, threshold_s=0.2, interval_s=0.05).start()

    def hold_seqs() -> None:
        lockholder.hold(pool, pool.SEQS)
        try:
            time.sleep(0.6)
        finally:
            lockholder.let_go(pool, pool.SEQS)

    # WHEN a thread holds the sequence-table lock for 0.6 s
    t = threading.Thread(target=hold_seqs)
    t.start()
    t.join()
    dog.stop()
    # THEN one lock_held_too_long names the lock and where the holder is, with its stack
    (f,) = [f for f in pool.findings() if f.kind == "lock_held_too_long"]
    assert f.severity == "warning" and "pool lock 'seqs'" in f.message
    assert "hold_seqs" in f.message
    (g,) = seen
    assert any("hold_seqs" in frame for frame in g.extra["stack"])


@pytest.mark.slow
def test_the_watchdog_times_traced_user_locks():
    # GIVEN a traced lock without a pool, and a watchdog on lockdep
    seen: list = []
    lockdep = LockDep(on_finding=seen.append)
    lockdep.enabled = True
    lock = TracedLock("slow", lockdep=lockdep)
    dog = Watchdog(threshold_s=0.1, interval_s=0.02, lockdep=lockdep).start()
    # WHEN it is held for 0.4 s
    with lock:
        time.sleep(0.4)
    dog.stop()
    # THEN it is reported once, with this test in the stack
    (f,) = seen
    assert f.kind == "lock_held_too_long" and "'user:slow'" in f.message
    assert any("test_the_watchdog_times_traced_user_locks" in s for s in f.extra["stack"])


def test_a_holder_waiting_in_a_traced_acquire_is_shown_at_the_programs_line():
    # GIVEN two traced locks, a watchdog, and the second lock held by this thread
    seen: list = []
    lockdep = LockDep(on_finding=seen.append)
    lockdep.enabled = True
    a, b = TracedLock("a", lockdep=lockdep), TracedLock("b", lockdep=lockdep)
    dog = Watchdog(threshold_s=0.1, interval_s=0.02, lockdep=lockdep).start()
    b.acquire()

    def holder() -> None:
        with a:
            with b:
                pass

    # WHEN another thread holds the first lock while it waits for the second
    t = threading.Thread(target=holder)
    t.start()
    deadline = time.monotonic() + 30
    while not any("'user:a'" in f.message for f in seen) and time.monotonic() < deadline:
        time.sleep(0.01)  # (until the watchdog has reported the hold, however loaded the host)
    b.release()
    t.join()
    dog.stop()
    # THEN the long hold of the first names where the holder is in this program (the line
    # waiting for the second), not kvscope's acquire
    (f,) = [f for f in seen if "'user:a'" in f.message]
    assert f"now at test_lockdep.py:{holder.__code__.co_firstlineno + 2} holder" in f.message
    assert not any(frame.startswith("lockdep.py:") for frame in f.extra["stack"])


def test_a_dead_holder_is_recovered_under_lockdep_without_a_false_cycle(make_pool):
    # GIVEN a process killed while it held the free-ring lock, and lockdep plus a watchdog here
    pool = make_pool(32)
    lockdep = LockDep()
    lockdep.instrument(pool)
    dog = Watchdog(pool, threshold_s=0.05, interval_s=0.01, lockdep=lockdep).start()

    def die_holding_free() -> int:
        p = KVPool.attach(pool.name)
        lockholder.hold(p, p.FREE)
        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    assert _wait(_fork(die_holding_free)) == -9
    time.sleep(0.2)
    # WHEN this process allocates (the failed acquisition, recovery, then the retry)
    seq = pool.allocate("after", list(range(8)))
    pool.free(seq)
    dog.stop()
    # THEN the dead holder is reported, with no cycle, no long hold and an empty held stack
    kinds = [f.kind for f in pool.findings()]
    assert "lock_dead_holder" in kinds and "lock_order_cycle" not in kinds
    assert "lock_held_too_long" not in kinds
    assert lockdep.state().stack == []


@pytest.mark.slow
def test_a_long_hold_in_another_process_is_reported_once(make_pool):
    # GIVEN a watchdog here, and another process with its own watchdog
    pool = make_pool(16)
    dog = Watchdog(pool, threshold_s=0.2, interval_s=0.02).start()

    def hold_free_long() -> int:
        p = KVPool.attach(pool.name)
        Watchdog(p, threshold_s=0.2, interval_s=0.02).start()
        lockholder.hold(p, p.FREE)
        time.sleep(0.8)
        lockholder.let_go(p, p.FREE)
        return 0

    # WHEN that process holds the free-ring lock for 0.8 s
    pid = _fork(hold_free_long)
    assert _wait(pid) == 0
    dog.stop()
    # THEN the hold is reported once, by its own process, with where it was
    (f,) = [f for f in pool.findings() if f.kind == "lock_held_too_long"]
    assert f.owner_pid == pid and "pool lock 'free'" in f.message
    assert "hold_free_long" in f.message


@pytest.mark.slow
def test_an_unwatched_process_long_hold_is_reported_by_an_observer(make_pool):
    # GIVEN a watchdog here only
    pool = make_pool(16)
    dog = Watchdog(pool, threshold_s=0.1, interval_s=0.02).start()

    def hold_free_long() -> int:
        p = KVPool.attach(pool.name)
        lockholder.hold(p, p.FREE)
        time.sleep(0.6)
        lockholder.let_go(p, p.FREE)
        return 0

    # WHEN another process holds the free-ring lock for 0.6 s
    pid = _fork(hold_free_long)
    assert _wait(pid) == 0
    dog.stop()
    # THEN this process reports it once, naming the holder (its stack is out of reach)
    (f,) = [f for f in pool.findings() if f.kind == "lock_held_too_long"]
    assert f.owner_pid == pid and f"by pid {pid}" in f.message and "now at" not in f.message


def test_a_closed_pool_is_let_go_by_lockdep(pool_name):
    # GIVEN a pool whose locks lockdep traces (its graph of the pool's segment kept by lockdep)
    import gc
    import weakref

    from kvscope.allocator import PoolConfig

    dep = LockDep()
    pool = KVPool.create(pool_name, PoolConfig(num_blocks=32, block_size=4, head_dim=8))
    dep.instrument(pool)
    _hit_prefix(pool)
    gone = weakref.ref(pool)
    # WHEN the handle closes and the program drops it
    pool.close()
    pool.unlink()
    del pool
    gc.collect()
    # THEN lockdep holds nothing of it: the handle (and its mapping) is gone
    assert gone() is None
    assert dep.graph_for(None) is dep.local
