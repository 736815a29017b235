"""The flight recorder: each process's ring of recent allocator events, inside the segment.

The C core records them (allocator/csrc/probes.c `ev_record`), each process into its own client's
ring, so recording takes no lock; this module names the events and reads them, merging the
rings by time. Off unless the pool was created with `events=True` or the process runs
with KVSCOPE_EVENTS=1 (as under `kvscope run`).
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from kvscope.allocator.layout import SegmentView


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
    # a take that found too few blocks (arg: how many it needed): its operation raised
    # PoolExhausted, and changed nothing else
    EXHAUSTED = 16


OP_NAMES = {op.value: op.name.lower() for op in EventOp}


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


def _newest(view: SegmentView, keep: Any, n: int) -> list[dict[str, Any]]:
    """The last n recorded events of every ring where `keep` (a mask over them, or True),
    oldest first: one vectorised pass over the rings."""
    ev = view.events.reshape(-1)
    ev = ev[keep & (ev["time_ns"] > 0)]
    return _as_dicts(ev[np.argsort(ev["time_ns"], kind="stable")][-n:])


def events_for_block(view: SegmentView, block: int, n: int = 10) -> list[dict[str, Any]]:
    """The last n events that touched a block, oldest first."""
    return _newest(view, view.events.reshape(-1)["block"] == block, n)


def recent_events(view: SegmentView, n: int = 50) -> list[dict[str, Any]]:
    """The last n events of every process, oldest first."""
    return _newest(view, True, n)


def events_of_process(
    view: SegmentView, pid: int, n: int = 8, until_ns: int = 0
) -> list[dict[str, Any]]:
    """The last n events of one process (before `until_ns`, where given), oldest first: what a
    process that died holding a lock last did."""
    ev = view.events.reshape(-1)
    keep = ev["pid"] == pid
    if until_ns:
        keep &= ev["time_ns"] <= until_ns
    return _newest(view, keep, n)


def hit_blocks(view: SegmentView, request: bytes) -> set[int]:
    """The blocks the flight recorder saw `request` (as the records keep it) take through a
    prefix hit."""
    ev = view.events.reshape(-1)
    ev = ev[(ev["op"] == EventOp.PREFIX_HIT) & (ev["request"] == request)]
    return set(np.unique(ev["block"]).tolist())
