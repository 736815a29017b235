"""Request lifetimes from the flight recorder: each request's slice of time in one process,
from its allocation (or prefix hit, or fork) to its free or abort, with its blocks, its
preemptions and its copy-on-write copies; and lanes on which slices of one process never overlap.

The rings keep each process's last `event_capacity` events: a request whose first event fell
out of them is `partial`. A preemption records PREEMPT and then the release of the blocks as
FREE (one transaction): that FREE is part of the preemption, not the request's end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import SegmentView

STARTS = (EventOp.ALLOCATE, EventOp.PREFIX_HIT, EventOp.FORK)
ENDS = {EventOp.FREE: "free", EventOp.ABORT: "abort"}


@dataclass
class Record:
    """One operation: the per-block events of one op, process, request and time, merged."""

    time_ns: int
    pid: int
    op: int
    request: str
    arg: int
    blocks: list[int]


@dataclass
class RequestSlice:
    """One request's life in one process, as far as the recorder saw it."""

    pid: int
    request: str
    start_ns: int
    end_ns: int | None = None
    end: str = ""
    blocks: set[int] = field(default_factory=set)
    seq_id: int = 0
    prefix_hits: int = 0
    partial: bool = False
    # [start, end or None, blocks] of each preemption; (time, src, dst) of each copy-on-write.
    preempted: list[list[Any]] = field(default_factory=list)
    cows: list[tuple[int, int, int]] = field(default_factory=list)
    forked_from: int = 0
    lane: int = 0
    # The last record was a preemption: the release it records next is part of it.
    preempting: bool = False


def records(view: SegmentView) -> list[Record]:
    """Every recorded event of every ring, oldest first, per-block events of one op merged."""
    ev = view.events.reshape(-1)
    ev = ev[ev["time_ns"] != 0]
    ev = ev[np.argsort(ev["time_ns"], kind="stable")]
    out: list[Record] = []
    last: tuple[Any, ...] | None = None
    for t, pid, op, blk, arg, req in zip(
        ev["time_ns"].tolist(),
        ev["pid"].tolist(),
        ev["op"].tolist(),
        ev["block"].tolist(),
        ev["arg"].tolist(),
        ev["request"].tolist(),
    ):
        key = (t, pid, op, req, arg)
        if key == last:
            if blk >= 0:
                out[-1].blocks.append(blk)
            continue
        last = key
        out.append(Record(t, pid, op, req.decode(errors="replace"), arg, [blk] if blk >= 0 else []))
    return out


def request_slices(recs: list[Record]) -> tuple[list[RequestSlice], list[Record]]:
    """Requests from their records; the records that are not about a request's life."""
    slices: list[RequestSlice] = []
    open_: dict[tuple[int, str], RequestSlice] = {}
    other: list[Record] = []
    for r in recs:
        key = (r.pid, r.request)
        s = open_.get(key)
        if r.op in STARTS or r.op in ENDS or r.op in (EventOp.PREEMPT, EventOp.COW):
            # A new life after a free or abort (the same request id allocated again).
            if s is not None and s.end_ns is not None and r.op not in ENDS:
                s = None
            if s is None:
                s = RequestSlice(r.pid, r.request, r.time_ns, partial=r.op not in STARTS)
                open_[key] = s
                slices.append(s)
        if s is not None and s.preempting:
            s.preempting = False
            if r.op == EventOp.FREE:
                continue
        if r.op in STARTS:
            assert s is not None
            s.blocks.update(r.blocks)
            if r.op == EventOp.PREFIX_HIT:
                s.prefix_hits += len(r.blocks)
            elif r.op == EventOp.FORK:
                s.forked_from = r.arg
            elif r.arg > 0:
                s.seq_id = r.arg
            if s.preempted and s.preempted[-1][1] is None and r.op == EventOp.ALLOCATE:
                s.preempted[-1][1] = r.time_ns
        elif r.op in ENDS:
            assert s is not None
            s.blocks.update(r.blocks)
            # A long table is released in chunks: the last chunk ends the slice.
            s.end_ns, s.end = r.time_ns, ENDS[EventOp(r.op)]
        elif r.op == EventOp.PREEMPT:
            assert s is not None
            s.preempted.append([r.time_ns, None, list(r.blocks)])
            s.preempting = True
        elif r.op == EventOp.COW:
            assert s is not None
            s.cows.append((r.time_ns, r.blocks[0] if r.blocks else -1, r.arg))
        else:
            other.append(r)
    return slices, other


def assign_lanes(slices: list[RequestSlice], end_ns: int) -> dict[int, int]:
    """Put each process's slices on lanes where none overlap; the number of lanes per pid."""
    lanes: dict[int, list[int]] = {}
    for s in sorted(slices, key=lambda s: (s.start_ns, s.pid)):
        ends = lanes.setdefault(s.pid, [])
        stop = s.end_ns if s.end_ns is not None else end_ns
        for k, e in enumerate(ends):
            if e <= s.start_ns:
                s.lane, ends[k] = k, stop
                break
        else:
            s.lane = len(ends)
            ends.append(stop)
    return {pid: len(e) for pid, e in lanes.items()}
