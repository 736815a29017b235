"""The flight recorder: each process's ring of recent allocator events, inside the segment.

Each client (attached process) writes only its own ring, so recording takes no lock; readers
merge the rings by time. Off unless the pool was created with `events=True` or the process runs
with KVSCOPE_EVENTS=1 (as under `kvscope run`).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from kvscope.allocator.layout import SegmentView
from kvscope.allocator.process import now_ns


class EventOp(enum.IntEnum):
    """What happened to a block."""

    ALLOCATE = 1
    FREE = 2
    FORK = 3
    COW = 4
    EVICT = 5
    PREFIX_HIT = 6
    PREFIX_MISS = 7
    GUARD_VIOLATION = 8
    FINDING = 9
    # (arg 1: the core abandoned a sequence its own operation could not finish, a long
    # prompt's or a resume's rest failing; 0: the program's pool.abort)
    ABORT = 10
    PREEMPT = 11
    RECLAIM = 12
    PUBLISH = 13
    # a lease taken on the block (arg: 1 read, 2 write), and its end (docs/POOL.md "Leases")
    LEASE = 14
    LEASE_END = 15


OP_NAMES = {op.value: op.name.lower() for op in EventOp}


class EventRecorder:
    """Appends events to this client's ring (lock-free: the ring has one writer)."""

    def __init__(self, view: SegmentView, client: int, pid: int):
        self.ring = view.events[client]
        self.capacity = len(self.ring)
        self.head = view.clients["event_head"][client : client + 1]
        self.generation = view.blocks["generation"]
        self.pid = pid

    def record(self, op: EventOp, blocks: Any, request: bytes = b"", arg: int = 0) -> None:
        """One event per block (or one with block -1 when blocks is empty)."""
        ids = np.atleast_1d(np.asarray(blocks, dtype=np.int64))
        if len(ids) == 0:
            ids = np.array([-1], np.int64)
        k = min(len(ids), self.capacity)
        ids = ids[-k:]
        h = int(self.head[0])
        pos = (h + np.arange(k)) % self.capacity
        r = self.ring
        r["time_ns"][pos] = now_ns()
        r["pid"][pos] = self.pid
        r["op"][pos] = int(op)
        r["block"][pos] = ids
        valid = ids >= 0
        gens = np.zeros(k, np.uint32)
        gens[valid] = self.generation[ids[valid]]
        r["generation"][pos] = gens
        r["arg"][pos] = arg
        r["request"][pos] = request
        self.head[0] = h + k


def _as_dicts(ev: np.ndarray) -> list[dict[str, Any]]:
    return [
        {
            "time_ns": int(e["time_ns"]),
            "pid": int(e["pid"]),
            "op": OP_NAMES.get(int(e["op"]), f"op{int(e['op'])}"),
            "block": int(e["block"]),
            "generation": int(e["generation"]),
            "arg": int(e["arg"]),
            "request": bytes(e["request"]).decode(errors="replace"),
        }
        for e in ev
    ]


def events_for_block(view: SegmentView, block: int, n: int = 10) -> list[dict[str, Any]]:
    """The last n events that touched a block, oldest first (one vectorised pass over the rings)."""
    ev = view.events.reshape(-1)
    hit = ev[(ev["block"] == block) & (ev["time_ns"] > 0)]
    hit = hit[np.argsort(hit["time_ns"], kind="stable")][-n:]
    return _as_dicts(hit)


def recent_events(view: SegmentView, n: int = 50) -> list[dict[str, Any]]:
    """The last n events of every process, oldest first."""
    ev = view.events.reshape(-1)
    ev = ev[ev["time_ns"] > 0]
    ev = ev[np.argsort(ev["time_ns"], kind="stable")][-n:]
    return _as_dicts(ev)
