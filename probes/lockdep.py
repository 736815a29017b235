"""lockdep: the held-lock stack of every thread and the cross-process lock-order graph.

    from kvscope.probes.lockdep import LockDep, TracedLock
    lockdep = LockDep()
    lockdep.instrument(pool)                # the pool's C core traces its locks
    cache_lock = TracedLock("cache", pool)  # a user lock: lock class "user:cache"
    ...
    lockdep.uninstrument(pool)

A thread that takes lock class B while it holds A adds the edge A -> B, with the site where it
was first seen, to the segment's lock-order graph, which every process attached to the pool
shares and the pool's C core writes (lockgraph.SegmentGraph.learn). An edge whose reverse path
B -> ... -> A is already there is reported as `lock_order_cycle` before the thread waits for
B, so two processes that take locks in opposite orders are named before they ever overlap. The pool's locks are traced by the C core, which
takes them (csrc/probes.c lockdep_ok: the edges between them and from the traced user locks the
thread holds); this module traces user locks (TracedLock), and the edges into them from the
user locks and the traced pool locks the thread holds (read from the pool's lock records).
Shard locks are one class ("index"); "sites" and "findings" are leaves taken last and are not
traced. docs/LOCKDEP.md has the details and cost.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from kvscope.allocator import _native
from kvscope.allocator.errors import PoolError
from kvscope.allocator.findings import Finding
from kvscope.allocator.probeflags import env_flag
from kvscope.probes.lockgraph import (  # noqa: F401
    CLASS_BYTES,
    GIL,
    MESSAGE_BYTES,
    SITE_BYTES,
    UNTRACED,
    Edge,
    LocalGraph,
    SegmentGraph,
    call_site,
    class_name,
    cycle_finding,
    find_path,
    lock_class,
)

ENV = "KVSCOPE_LOCKDEP"


class Held:
    """One traced lock a thread holds (or is about to take): class, graph, and when."""

    __slots__ = ("key", "cls", "graph", "t_ns")

    def __init__(self, key: object, cls: str, graph: Any):
        self.key, self.cls, self.graph = key, cls, graph
        # Set once the lock is taken.
        self.t_ns = 0


class ThreadState:
    """A thread's held-lock stack."""

    __slots__ = ("stack", "busy", "ident", "native_id", "__weakref__")

    def __init__(self) -> None:
        self.stack: list[Held] = []
        self.busy = False
        self.ident = threading.get_ident()
        self.native_id = threading.get_native_id()


class LockDep:
    """The lockdep probe: held-lock stacks per thread, edges into the lock-order graphs."""

    def __init__(self, on_finding: Callable[[Finding], None] | None = None):
        self.enabled = False
        self.on_finding = on_finding
        self.local = LocalGraph(self._local_report)
        # A thread's state goes when the thread does (its threading.local holds the only ref).
        self.threads: weakref.WeakValueDictionary[int, ThreadState] = weakref.WeakValueDictionary()
        self._tls = threading.local()
        self._graphs: dict[int, SegmentGraph] = {}
        # The pools instrumented (by id): their C cores trace their locks, and the traced pool
        # locks a thread holds give edges into the user locks it takes.
        self._pools: set[int] = set()
        _INSTANCES.add(self)

    def after_fork(self) -> None:
        """In a forked child: only the forking thread runs on; the other threads' stacks stay in
        the parent (the module registers it with os.register_at_fork)."""
        st = getattr(self._tls, "s", None)
        if st is not None:
            st.native_id = threading.get_native_id()
        self.threads = weakref.WeakValueDictionary({st.ident: st} if st is not None else {})

    def _local_report(self, f: Finding) -> None:
        if self.on_finding is not None:
            self.on_finding(f)
        else:
            print(f"kvscope: {f.line()}", file=sys.stderr)

    def instrument(self, pool: Any) -> bool:
        """Trace every lock of `pool`; False if it was. The pool's C core traces them (its
        probe word's lockdep bit): it writes the order edges its transactions take, from the
        traced user locks the thread holds too, into the segment's graph, where `_learn` finds
        them (csrc/probes.c lockdep_ok)."""
        if id(pool) in self._pools:
            return False
        self._pools.add(id(pool))
        self.graph_for(pool)
        self.enabled = True
        pool.trace_locks(True)
        # (its graph holds the handle: let go at its close, or a program that opens and closes
        # pools keeps every one mapped)
        if hasattr(pool, "at_close"):
            pool.at_close(self.uninstrument)
        return True

    def uninstrument(self, pool: Any) -> None:
        """Stop tracing `pool`'s locks."""
        if id(pool) not in self._pools:
            return
        self._pools.discard(id(pool))
        pool.trace_locks(False)
        self._graphs.pop(id(pool), None)

    def graph_for(self, pool: Any | None) -> LocalGraph | SegmentGraph:
        """The graph edges into a lock of `pool` go to (the first pool's, or the local one)."""
        if pool is None:
            return next((g for g in self._graphs.values() if g.usable()), self.local)
        g = self._graphs.get(id(pool))
        if g is None:
            g = self._graphs[id(pool)] = SegmentGraph(pool)
        return g if g.usable() else self.local

    def state(self) -> ThreadState:
        """This thread's held-lock stack (created on first use)."""
        st = getattr(self._tls, "s", None)
        if st is None:
            st = self._tls.s = ThreadState()
            self.threads[st.ident] = st
        return st

    def before(self, cls: str, key: object, graph: Any) -> Held | None:
        """Record that this thread is about to take a traced user lock (called before it may
        block): the edges into it from the traced locks the thread holds, user locks (its
        stack) and pool locks of the instrumented pools (their records); and the edge from it
        to the GIL (its holder runs Python, so it waits for the GIL while holding it)."""
        st = self.state()
        if st.busy:
            return None
        new = self._edges_into(st, cls, graph, skip=key)
        if (cls, GIL) not in graph.known:
            new.append((graph, cls, GIL))
        if new:
            self._learn(st, new)
        stack = st.stack
        for h in stack:
            if h.key is key:
                # Left by an acquisition that failed (or a self-deadlock): replaced here.
                stack.remove(h)
                break
        h = Held(key, cls, graph)
        stack.append(h)
        return h

    def _edges_into(
        self, st: ThreadState, cls: str, graph: Any, skip: object = None
    ) -> list[tuple[Any, str, str]]:
        """The edges new to this process from each traced lock this thread holds (its stack,
        and the pool locks of the instrumented pools, by their records) into class `cls` of
        `graph`, each with the graph it goes to; `skip`: a lock of the stack left out."""
        new: list[tuple[Any, str, str]] = []
        for h in st.stack:
            if h.key is skip and skip is not None:
                continue
            if h.cls == cls:
                continue
            if graph.shared:
                if h.graph.shared and h.graph is not graph:
                    continue
                g = graph
            else:
                g = h.graph if h.graph.shared else graph
            if (h.cls, cls) not in g.known:
                new.append((g, h.cls, cls))
        for pid in self._pools:
            g = self._graphs.get(pid)
            # (a pool lock is ordered against the user locks of its pool's graph or of none)
            if g is None or (graph.shared and g is not graph) or not g.usable():
                continue
            for held in g.held_classes():
                if held != cls and (held, cls) not in g.known:
                    new.append((g, held, cls))
        return new

    def waits(self, cls: str, graph: Any, own: object = None) -> None:
        """This thread is about to wait on a condition variable or event of class `cls`: each
        traced lock it holds (but `own`, a condition's own lock, let go by the wait) gives the
        edge held -> cls, checked for a cycle before the wait."""
        st = self.state()
        if st.busy:
            return
        new = self._edges_into(st, cls, graph, skip=own)
        if new:
            self._learn(st, new)

    def native_wait(self, cls: str, graph: Any) -> None:
        """A wait in native code that keeps the GIL (a binding that blocks without letting it
        go) for something of class `cls`: the edge gil -> cls, checked for a cycle (a signaller
        of `cls` that runs Python closes one: cls -> gil). Call it where such a wait is made;
        the pool's C core reports its own (csrc/probes.c gil_wait_report)."""
        st = self.state()
        if not st.busy and (GIL, cls) not in graph.known:
            self._learn(st, [(graph, GIL, cls)])

    def signals(self, cls: str, graph: Any, own: object = None) -> None:
        """This thread sets or notifies an event or condition of class `cls`: a waiter depends
        on what the signaller needed first, each traced lock it holds (but `own`) and the GIL
        (it runs Python), so the edges cls -> held and cls -> gil."""
        st = self.state()
        if st.busy:
            return
        new: list[tuple[Any, str, str]] = []
        for h in st.stack:
            if (own is not None and h.key is own) or h.cls == cls:
                continue
            g = h.graph if h.graph.shared or not graph.shared else graph
            if graph.shared and h.graph.shared and h.graph is not graph:
                continue
            if (cls, h.cls) not in g.known:
                new.append((g, cls, h.cls))
        for pid in self._pools:
            g = self._graphs.get(pid)
            if g is None or (graph.shared and g is not graph) or not g.usable():
                continue
            for held in g.held_classes():
                if (cls, held) not in g.known:
                    new.append((g, cls, held))
        if (cls, GIL) not in graph.known:
            new.append((graph, cls, GIL))
        if new:
            self._learn(st, new)

    def after_release(self, key: object) -> None:
        """Forget the newest entry for a lock this thread released."""
        stack = self.state().stack
        for j in range(len(stack) - 1, -1, -1):
            if stack[j].key is key:
                del stack[j]
                return

    def _learn(self, st: ThreadState, new: list[tuple[Any, str, str]]) -> None:
        """The slow path: add edges (graph, src, dst) new to this process to their graphs (a
        pool's: its C core writes it), then hand over the cycles they close."""
        site = call_site()
        touched: list[Any] = []
        st.busy = True
        try:
            for g, src, dst in new:
                if not g.usable():
                    continue
                try:
                    g.learn(src, dst, site)
                except PoolError:
                    # A dead process left the findings lock held, and this thread is inside a
                    # transaction of the pool (a callback): its next operation recovers it.
                    continue
                g.known.add((src, dst))
                if g not in touched:
                    touched.append(g)
            for g in touched:
                g.deliver()
        finally:
            st.busy = False


class TracedLock:
    """A drop-in for threading.Lock whose acquisitions feed lockdep (class "user:NAME").

    The pool's C core keeps the traced locks each thread holds too (told after each take and
    release): its transactions add the edges from them to the pool's locks themselves."""

    def __init__(self, name: str, pool: Any | None = None, lockdep: LockDep | None = None):
        self.name = name
        self.cls = class_name(f"user:{name}")
        self.pool = pool
        self._lock = threading.Lock()
        self._lockdep = lockdep if lockdep is not None else LOCKDEP
        # The graph key the core was told of while the lock is held (None: not told).
        self._core_graph: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock, as threading.Lock.acquire."""
        ld = self._lockdep
        if not ld.enabled:
            return self._lock.acquire(blocking, timeout)
        graph = ld.graph_for(self.pool)
        h = ld.before(self.cls, self, graph)
        if self._lock.acquire(blocking, timeout):
            if h is not None:
                h.t_ns = time.perf_counter_ns()
            self._core_graph = graph.core_key
            _native.traced_lock_taken(self.cls, graph.core_key)
            return True
        ld.after_release(self)
        return False

    def release(self) -> None:
        """Release the lock."""
        # (read while still held: the next holder sets its own)
        told, self._core_graph = self._core_graph, None
        self._lock.release()
        if told is not None:
            _native.traced_lock_released(self.cls, told)
        if self._lockdep.enabled:
            self._lockdep.after_release(self)

    def locked(self) -> bool:
        """True while some thread holds the lock."""
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class TracedEvent:
    """A drop-in for threading.Event whose waits and sets feed lockdep (class "wait:NAME"):
    waiting while holding traced lock L is the edge L -> wait:NAME; setting it while holding M
    is wait:NAME -> M (the waiter waits for what the setter took first), and wait:NAME -> gil
    (the setter runs Python). A thread that waits holding L for an event whose setter takes L
    first closes the cycle, reported before it waits."""

    def __init__(self, name: str, pool: Any | None = None, lockdep: LockDep | None = None):
        self.name = name
        self.cls = class_name(f"wait:{name}")
        self.pool = pool
        self._event = threading.Event()
        self._lockdep = lockdep if lockdep is not None else LOCKDEP

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the event, as threading.Event.wait."""
        ld = self._lockdep
        if ld.enabled:
            ld.waits(self.cls, ld.graph_for(self.pool))
        return self._event.wait(timeout)

    def set(self) -> None:
        """Set the event, as threading.Event.set."""
        ld = self._lockdep
        if ld.enabled:
            ld.signals(self.cls, ld.graph_for(self.pool))
        self._event.set()

    def clear(self) -> None:
        """Clear the event."""
        self._event.clear()

    def is_set(self) -> bool:
        """True once set (until cleared)."""
        return self._event.is_set()


class TracedCondition:
    """A drop-in for threading.Condition over a TracedLock (its own, or `lock`), whose waits and
    notifications feed lockdep as TracedEvent's do (class "wait:NAME"; the condition's own lock,
    let go by the wait, gives no edge)."""

    def __init__(
        self,
        name: str,
        lock: TracedLock | None = None,
        pool: Any | None = None,
        lockdep: LockDep | None = None,
    ):
        self.name = name
        self.cls = class_name(f"wait:{name}")
        self.pool = pool
        self._lockdep = lockdep if lockdep is not None else LOCKDEP
        self.lock = lock if lock is not None else TracedLock(name, pool, self._lockdep)
        self._cond = threading.Condition(self.lock)  # type: ignore[arg-type]

    def __enter__(self) -> bool:
        return self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait (holding the condition's lock), as threading.Condition.wait."""
        ld = self._lockdep
        if ld.enabled:
            ld.waits(self.cls, ld.graph_for(self.pool), own=self.lock)
        return self._cond.wait(timeout)

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        """Wait until `predicate()` is true, as threading.Condition.wait_for."""
        ld = self._lockdep
        if ld.enabled:
            ld.waits(self.cls, ld.graph_for(self.pool), own=self.lock)
        return self._cond.wait_for(predicate, timeout)

    def notify(self, n: int = 1) -> None:
        """Wake up to n waiters (holding the condition's lock)."""
        ld = self._lockdep
        if ld.enabled:
            ld.signals(self.cls, ld.graph_for(self.pool), own=self.lock)
        self._cond.notify(n)

    def notify_all(self) -> None:
        """Wake every waiter (holding the condition's lock)."""
        ld = self._lockdep
        if ld.enabled:
            ld.signals(self.cls, ld.graph_for(self.pool), own=self.lock)
        self._cond.notify_all()


_INSTANCES: weakref.WeakSet[LockDep] = weakref.WeakSet()


def _after_fork() -> None:
    for lockdep in list(_INSTANCES):
        lockdep.after_fork()


os.register_at_fork(after_in_child=_after_fork)
LOCKDEP = LockDep()
# Under `kvscope run --lockdep` user locks are traced from the start, before any pool opens.
LOCKDEP.enabled = env_flag("LOCKDEP")
