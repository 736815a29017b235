"""The lock-order graph: edges between lock classes, kept per process (LocalGraph) or in the
segment (SegmentGraph: the pool's C core writes it, this module reads it), and the cycle search
that names both chains of a lock-order inversion (used by lockdep.py; the core's csrc/probes.c
lg_chain and lg_cycle search and name them the same way)."""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import kvscope.allocator
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.layout import LOCKGRAPH_CAPACITY
from kvscope.allocator.locks import UNTRACED, lock_class  # noqa: F401 - lockdep imports them here

CLASS_BYTES, SITE_BYTES, MESSAGE_BYTES = 16, 120, 200
# The GIL's lock class: a thread that holds lock L and runs Python waits for the GIL holding
# L (L -> gil); a wait that keeps the GIL is gil -> what it waits for (the C core's own waits let
# it go: csrc/probes.c gil_wait_report names one that does not).
GIL = "gil"
# kvscope's own folders, whose frames are not the caller's code: the harness's (the parent
# package, loaded before any of its subpackages: nothing of it is imported here), the
# allocator's and this one.
_OWN_DIRS = tuple(
    os.path.dirname(path or "") + os.sep
    for path in (sys.modules["kvscope"].__file__, kvscope.allocator.__file__, __file__)
)
_GLUE = ("contextlib.py", "threading.py")


class Edge(NamedTuple):
    """One lock-order edge: some thread took `dst` while holding `src`."""

    src: str
    dst: str
    pid: int
    site: str


def class_name(text: str) -> str:
    """A lock class name as the segment stores it (16 bytes)."""
    return text.encode()[:CLASS_BYTES].decode(errors="ignore")


def call_site() -> str:
    """`file:line function` of the innermost frame outside kvscope (the caller's code)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None and (
        f.f_code.co_filename.startswith(_OWN_DIRS) or f.f_code.co_filename.endswith(_GLUE)
    ):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} {f.f_code.co_name}"[:SITE_BYTES]


def find_path(edges: list[Edge], src: str, dst: str) -> list[Edge]:
    """The shortest chain of edges src -> ... -> dst (empty if there is none)."""
    out: dict[str, list[Edge]] = {}
    for e in edges:
        out.setdefault(e.src, []).append(e)
    came: dict[str, Edge | None] = {src: None}
    todo = deque([src])
    while todo:
        node = todo.popleft()
        if node == dst:
            path: list[Edge] = []
            while (step := came[node]) is not None:
                path.append(step)
                node = step.src
            return path[::-1]
        for e in out.get(node, ()):
            if e.dst not in came:
                came[e.dst] = e
                todo.append(e.dst)
    return []


def cycle_finding(new: Edge, path: list[Edge]) -> Finding:
    """The `lock_order_cycle` finding for a new edge that closes `path` (its reverse chain)."""
    mine = f"pid {new.pid} takes {new.src} -> {new.dst} at {new.site}"
    theirs = "; ".join(f"pid {e.pid} took {e.src} -> {e.dst} at {e.site}" for e in path)
    why = "opposite orders" if len(path) == 1 else "these orders form a cycle that"
    msg = f"{mine}; {theirs}"
    tail = f": {why} deadlock{'' if len(path) == 1 else 's'} when they overlap"
    if len(msg) + len(tail) <= MESSAGE_BYTES:
        msg += tail
    return Finding(
        FindingKind.LOCK_ORDER_CYCLE,
        msg,
        owner_pid=new.pid,
        extra={"chain": [new._asdict()] + [e._asdict() for e in path]},
    )


class LocalGraph:
    """A lock-order graph in this process only (user locks with no pool to share one through)."""

    shared = False
    # The pool's C core records the edges from a user lock of this graph into whichever pool's
    # graph the thread then takes locks of.
    core_key = 0

    def __init__(self, notify: Callable[[Finding], None]):
        self._edges: list[Edge] = []
        self._lock = threading.Lock()
        # The cycles learned and not yet handed over (deliver).
        self._found: list[Finding] = []
        # Findings have no ring to go to here: reporting is notifying.
        self.notify = self.report = notify
        self.known: set[tuple[str, str]] = set()

    def usable(self) -> bool:
        """Always: the graph lives in this process."""
        return True

    def edges(self) -> list[Edge]:
        """Every edge, oldest first."""
        with self._lock:
            return list(self._edges)

    def learn(self, src: str, dst: str, site: str) -> None:
        """Add the edge src -> dst this process took at `site` unless the graph has it; a
        cycle it closes is a `lock_order_cycle` finding, handed over by `deliver`."""
        with self._lock:
            if any(e.src == src and e.dst == dst for e in self._edges):
                return
            e = Edge(src, dst, os.getpid(), site)
            path = find_path(self._edges, dst, src)
            self._edges.append(e)
            if path:
                self._found.append(cycle_finding(e, path))

    def deliver(self) -> None:
        """Hand the cycles learned to the callback."""
        with self._lock:
            found, self._found = self._found, []
        for f in found:
            self.notify(f)


class SegmentGraph:
    """The lock-order graph in a pool's segment, shared by every attached process. The pool's C
    core writes it (`learn`: csrc/probes.c N_learn_edge, under the findings lock); this class
    reads it."""

    shared = True

    def __init__(self, pool: Any):
        self.pool = pool
        # The pool handle as the C core knows it (KVPool's uid: its id): a user lock of this
        # graph is ordered against that handle's locks only.
        self.core_key = id(pool)
        self.findings_lock = pool.locks.index("findings")
        self.known: set[tuple[str, str]] = set()
        # The traced pool locks: (index, class).
        self.traced = [
            (i, lock_class(n)) for i, n in enumerate(pool.locks.names) if n not in UNTRACED
        ]

    def usable(self) -> bool:
        """False once the pool is closed, or in a forked child of the process that opened it."""
        return not self.pool.closed and self.pool.pid == os.getpid()

    def held_classes(self) -> list[str]:
        """The classes of the traced pool locks this thread holds now, whoever took them (the
        C core, inside an operation that called Python; `pool.locks`): their records name this
        process and thread (the core reads them: `held_here`)."""
        held = self.pool.core.held_here()
        return [c for i, c in self.traced if held >> i & 1] if held else []

    def edges(self) -> list[Edge]:
        """Every edge in the segment, oldest first."""
        view = self.pool.view
        g = view.lockgraph[: min(int(view.h["lockgraph_used"]), LOCKGRAPH_CAPACITY)]
        cols = (g["src"].tolist(), g["dst"].tolist(), g["pid"].tolist(), g["site"].tolist())
        return [
            Edge(s.decode(), d.decode(), p, t.decode(errors="replace")) for s, d, p, t in zip(*cols)
        ]

    def learn(self, src: str, dst: str, site: str) -> None:
        """Have the pool's C core add the edge src -> dst this process took at `site` to the
        segment's graph unless it is there (record first, count last: a death in between leaves
        an unused record; a full graph takes no more), under the findings lock (waited for, a
        dead holder recovered); a cycle it closes goes into the findings ring, handed over by
        `deliver`. PoolError where the lock is not to be had (a callback inside the pool's
        transaction, while a dead process holds it)."""
        self.pool.core.learn_edge(src, dst, site)

    def deliver(self) -> None:
        """Hand what the core reported (the cycles, a dead holder it recovered) to the pool's
        probe callback."""
        self.pool.deliver_findings()

    def notify(self, f: Finding) -> None:
        """Hand a finding to the pool's probe callback."""
        if self.pool.on_finding is not None:
            self.pool.on_finding(f)

    def report(self, f: Finding) -> None:
        """Write a finding into the segment's ring and hand it over (the pool's C core writes
        it, under the findings lock: `KVPool.record`)."""
        self.pool.record(f)
        self.notify(f)
