"""The flight recorder as a Chrome trace-event file, for Perfetto (ui.perfetto.dev) and
chrome://tracing.

    trace = build_trace(view, history=history, findings=findings, end_ns=taken_ns)
    write_trace(trace, "pool.trace.json")

The JSON object format of the Trace Event Format: `{"traceEvents": [...], "otherData": {...}}`;
`ts` and `dur` in microseconds since the pool was created (`otherData.origin_ns`). Tracks:

- one process per pid that wrote events; its requests are complete events (`"ph": "X"`) from
  allocate (or prefix hit, or fork) to free or abort, on as many `requests N` threads as it
  needed for slices never to overlap on one thread (the format wants slices to nest); a
  preemption is a nested slice until the request got its blocks back, a copy-on-write an
  instant inside its request; evictions, reclaims and guard violations are instants on its
  `pool events` thread; each lease (allocator/lease.py) a complete event from its take to its
  release on its `leases` thread, named by its mode (`read lease`, `write lease`), with its
  request, blocks and, while it is held, its holder;
- each finding an instant (`"ph": "i"`) naming its blocks: the findings ring's at their time,
  on their owner's process, the full check's at the end of the trace;
- with a history (kvscope.history): counter tracks (`"ph": "C"`) of the pool's blocks by state,
  demand, sequences and preemptions, and per lock its share of time held and its contended
  acquisitions; a lock hold longer than the sampling interval is a slice on that lock's thread.

With the pool's operation log (`kvscope run --record-ops`, docs/REPLAY.md), `mark_replay` adds
an instant across the trace where a replay of it stopped (a divergence, the finding), at that
operation's recorded time.

The events rings keep each process's last `event_capacity` events: older requests are not in
the trace, and a slice whose start fell out of the ring says so (`"start": "before the
recorder's window"`). Lock holds are not recorded per acquisition; only what the samples saw is.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from kvscope.allocator.dumpfile import check_target, write_atomic
from kvscope.allocator.events import EventOp
from kvscope.allocator.findings import Finding
from kvscope.allocator.layout import LeaseMode, SegmentView, lock_names
from kvscope.allocator.lease import lease_rows
from kvscope.history import History
from kvscope.lifetimes import Record, RequestSlice, assign_lanes, records, request_slices

SCHEMA = 1
# Synthetic pids and tids: above pid_max (at most 2**22), so never a real process or thread.
LOCKS_PID = 1 << 30
POOL_PID = LOCKS_PID + 1
FIRST_TID = 1 << 24
# Block ids listed in one slice's args, at most.
MAX_BLOCKS_ARG = 64
INSTANT_OPS = {
    EventOp.EVICT: "evict",
    EventOp.RECLAIM: "reclaim",
    # (every check that saw an overwritten canary, repeats included: the `guard_violation`
    # findings are one per block and process)
    EventOp.GUARD_VIOLATION: "guard canary overwritten",
}


def _blocks_arg(blocks: Any) -> dict[str, Any]:
    ids = sorted(blocks)
    out: dict[str, Any] = {"num_blocks": len(ids), "blocks": ids[:MAX_BLOCKS_ARG]}
    if len(ids) > MAX_BLOCKS_ARG:
        out["blocks_omitted"] = len(ids) - MAX_BLOCKS_ARG
    return out


class TraceWriter:
    """Trace events in the format's units: µs since `origin_ns`, with ns precision."""

    def __init__(self, origin_ns: int):
        self.origin_ns = origin_ns
        self.events: list[dict[str, Any]] = []
        self.next_tid = FIRST_TID
        self.tids: dict[tuple[int, str], int] = {}

    def us(self, t_ns: int) -> float:
        """A wall-clock time in ns as the trace's µs."""
        return round((t_ns - self.origin_ns) / 1e3, 3)

    def process(self, pid: int, name: str, sort_index: int) -> None:
        """Name a process track."""
        self.events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": pid, "args": {"name": name}}
        )
        self.events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": pid,
                "tid": pid,
                "args": {"sort_index": sort_index},
            }
        )

    def thread(self, pid: int, name: str) -> int:
        """The tid of a named thread track of `pid` (made on first use)."""
        key = (pid, name)
        tid = self.tids.get(key)
        if tid is None:
            tid = self.tids[key] = self.next_tid
            self.next_tid += 1
            self.events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            )
            self.events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid - FIRST_TID},
                }
            )
        return tid

    def complete(
        self, name: str, cat: str, pid: int, tid: int, start: int, end: int, args: dict
    ) -> None:
        """A slice from start to end (ns)."""
        ts = self.us(start)
        self.events.append(
            {
                "ph": "X",
                "name": name,
                "cat": cat,
                "pid": pid,
                "tid": tid,
                "ts": ts,
                "dur": round(self.us(max(start, end)) - ts, 3),
                "args": args,
            }
        )

    def instant(
        self, name: str, cat: str, pid: int, tid: int, t: int, scope: str, args: dict
    ) -> None:
        """A point in time: scope `t` on a thread, `p` on a process, `g` across the trace."""
        self.events.append(
            {
                "ph": "i",
                "name": name,
                "cat": cat,
                "pid": pid,
                "tid": tid,
                "ts": self.us(t),
                "s": scope,
                "args": args,
            }
        )

    def counter(self, name: str, pid: int, t: int, values: dict[str, float]) -> None:
        """One sample of a counter track per key of `values`."""
        self.events.append(
            {"ph": "C", "name": name, "pid": pid, "tid": pid, "ts": self.us(t), "args": values}
        )


def _request_events(w: TraceWriter, slices: list[RequestSlice], end_ns: int) -> None:
    for s in slices:
        tid = w.thread(s.pid, f"requests {s.lane + 1}")
        stop = s.end_ns if s.end_ns is not None else end_ns
        args: dict[str, Any] = {"request": s.request, "pid": s.pid, **_blocks_arg(s.blocks)}
        if s.end:
            args["end"] = s.end
        elif s.preempted and s.preempted[-1][1] is None:
            args["end"] = "preempted at the end of the trace"
        else:
            args["end"] = "still held at the end of the trace"
        if s.seq_id:
            args["seq_id"] = s.seq_id
        if s.prefix_hits:
            args["prefix_hits"] = s.prefix_hits
        if s.forked_from:
            args["forked_from_seq"] = s.forked_from
        if s.cows:
            args["copy_on_write"] = len(s.cows)
        if s.preempted:
            args["preemptions"] = len(s.preempted)
        if s.partial:
            args["start"] = "before the recorder's window"
        w.complete(s.request or "(no request id)", "request", s.pid, tid, s.start_ns, stop, args)
        for start, until, blocks in s.preempted:
            w.complete(
                "preempted",
                "preemption",
                s.pid,
                tid,
                start,
                min(until if until is not None else stop, stop),
                {"request": s.request, **_blocks_arg(blocks)},
            )
        for t, src, dst in s.cows:
            w.instant("copy-on-write", "cow", s.pid, tid, t, "t", {"src": src, "dst": dst})


def _other_events(w: TraceWriter, others: list[Record]) -> None:
    names = {op.value: op.name.lower() for op in EventOp}
    for r in others:
        if r.op in (EventOp.FINDING, EventOp.PREFIX_MISS):
            # Findings come from the findings ring (kind and message); a miss is not an event.
            continue
        name = INSTANT_OPS.get(EventOp(r.op), None) if r.op in names else None
        tid = w.thread(r.pid, "pool events")
        args: dict[str, Any] = _blocks_arg(r.blocks)
        if r.request:
            args["request"] = r.request
        w.instant(name or names.get(r.op, f"op {r.op}"), "pool", r.pid, tid, r.time_ns, "t", args)


LEASE_OPS = (EventOp.LEASE, EventOp.LEASE_END)


def _lease_events(w: TraceWriter, recs: list[Record], held: list[dict[str, Any]], end_ns: int):
    """Each lease a slice from its LEASE record to its LEASE_END (the same process, request, mode
    and blocks, first in first out); one still open at the end runs to it, with its holder
    from the lease table."""
    open_: dict[tuple[Any, ...], list[Record]] = {}
    spans: list[tuple[Record, int | None]] = []
    for r in recs:
        key = (r.pid, r.request, r.arg, tuple(sorted(r.blocks)))
        if r.op == EventOp.LEASE:
            open_.setdefault(key, []).append(r)
        elif open_.get(key):
            spans.append((open_[key].pop(0), r.time_ns))
    spans += [(r, None) for rs in open_.values() for r in rs]
    holders = {(h["pid"], h["request"], tuple(sorted(h["blocks"]))): h["holder"] for h in held}
    for r, until in sorted(spans, key=lambda x: x[0].time_ns):
        mode = "write" if r.arg == LeaseMode.WRITE else "read"
        args: dict[str, Any] = {"request": r.request, "mode": mode, **_blocks_arg(r.blocks)}
        if until is None:
            args["end"] = "still held at the end of the trace"
            who = holders.get((r.pid, r.request, tuple(sorted(r.blocks))))
            if who is not None:
                args["holder"] = who
        tid = w.thread(r.pid, "leases")
        w.complete(f"{mode} lease", "lease", r.pid, tid, r.time_ns, until or end_ns, args)


def _finding_events(w: TraceWriter, findings: list[Finding], pids: set[int], end_ns: int) -> None:
    groups: dict[tuple[Any, ...], tuple[Finding, list[int], int]] = {}
    for f in findings:
        t = int(f.extra.get("time_ns") or 0) or end_ns
        key = (f.kind, f.owner_pid, f.request, f.message, t)
        got = groups.get(key)
        if got is None:
            groups[key] = got = (f, [], t)
        if f.block is not None:
            got[1].append(f.block)
    for f, blocks, t in groups.values():
        args: dict[str, Any] = {
            "severity": f.severity,
            "message": f.message,
            **_blocks_arg(blocks),
        }
        if f.request:
            args["request"] = f.request
        if f.owner_pid:
            args["owner_pid"] = f.owner_pid
        checked = not f.extra.get("time_ns")
        args["source"] = "full check at the end" if checked else "recorded"
        if f.owner_pid in pids and not checked:
            w.instant(f.kind, "finding", f.owner_pid, f.owner_pid, t, "p", args)
        else:
            w.instant(f.kind, "finding", POOL_PID, POOL_PID, t, "g", args)


def _history_events(w: TraceWriter, history: History, locks: list[str]) -> None:
    s = history.samples
    if not len(s):
        return
    w.process(POOL_PID, f"pool {history.name}", 0)
    w.process(LOCKS_PID, f"pool {history.name}: locks", 1)
    for row in s:
        t = int(row["time_ns"])
        w.counter(
            "blocks",
            POOL_PID,
            t,
            {
                k: int(row[f"num_{k}"])
                for k in ("allocated", "cached", "local", "quarantined", "free")
            },
        )
        w.counter(
            "demand", POOL_PID, t, {"demand": int(row["demand"]), "peak": int(row["demand_max"])}
        )
        w.counter(
            "sequences",
            POOL_PID,
            t,
            {k: int(row[f"num_{k}"]) for k in ("running", "waiting", "preempted")},
        )
        w.counter(
            "totals",
            POOL_PID,
            t,
            {
                "preemptions": int(row["num_preemptions"]),
                "evictions": int(row["num_evictions"]),
                "exhausted": int(row["num_exhausted"]),
            },
        )
    for i, name in enumerate(locks[: s["lock_acquires"].shape[1]]):
        _lock_track(w, s, i, name)


def _lock_track(w: TraceWriter, s: np.ndarray, i: int, name: str) -> None:
    """Per-interval share of time held and contended acquisitions; holds seen by two samples."""
    t = s["time_ns"].astype(np.int64)
    hold = s["lock_hold_ns"][:, i].astype(np.int64)
    cont = s["lock_contended"][:, i].astype(np.int64)
    wait = s["lock_wait_ns"][:, i].astype(np.int64)
    for k in range(1, len(s)):
        dt = int(t[k] - t[k - 1])
        if dt <= 0:
            continue
        w.counter(
            f"lock {name}",
            LOCKS_PID,
            int(t[k]),
            {
                "held %": round(100 * max(0, int(hold[k] - hold[k - 1])) / dt, 2),
                "contended": max(0, int(cont[k] - cont[k - 1])),
                "wait ms": round(max(0, int(wait[k] - wait[k - 1])) / 1e6, 3),
            },
        )
    tid = w.thread(LOCKS_PID, f"lock {name}")
    # A hold is the same (holder, acquisition time) seen by consecutive samples.
    pid = s["lock_holder_pid"][:, i]
    acq = s["lock_acquired_ns"][:, i]
    last_end = 0
    k = 0
    while k < len(s):
        if not pid[k] or not acq[k]:
            k += 1
            continue
        j = k
        while j + 1 < len(s) and pid[j + 1] == pid[k] and acq[j + 1] == acq[k]:
            j += 1
        # The holder's monotonic clock to wall time, by the sample that first saw the hold.
        start = int(acq[k]) + int(s["time_ns"][k] - s["mono_ns"][k])
        start = max(start, last_end)
        stop = int(t[j])
        if j > k and stop > start:
            w.complete(
                f"held by pid {int(pid[k])}",
                "lock",
                LOCKS_PID,
                tid,
                start,
                stop,
                {"lock": name, "pid": int(pid[k]), "note": "held at least this long"},
            )
            last_end = stop
        k = j + 1


def build_trace(
    view: SegmentView,
    *,
    history: History | None = None,
    findings: list[Finding] | None = None,
    end_ns: int,
    source: str = "",
) -> dict[str, Any]:
    """The trace-event object of one pool (a consistent copy: live snapshot or dump)."""
    created = int(view.h["created_ns"])
    recs = records(view)
    first = min([created] + [r.time_ns for r in recs[:1]])
    if history is not None and history.count:
        first = min(first, int(history.samples["time_ns"][0]))
    end_ns = max(end_ns, first, *(r.time_ns for r in recs[-1:]))
    w = TraceWriter(first)
    slices, others = request_slices(recs)
    assign_lanes(slices, end_ns)
    pids = sorted({r.pid for r in recs} | {s.pid for s in slices})
    for k, pid in enumerate(pids):
        w.process(pid, f"pid {pid}", 10 + k)
    _request_events(w, slices, end_ns)
    _other_events(w, [r for r in others if r.op not in LEASE_OPS])
    _lease_events(w, [r for r in others if r.op in LEASE_OPS], lease_rows(view), end_ns)
    if history is not None:
        _history_events(w, history, lock_names(view.layout.num_shards))
    if findings:
        if not (history is not None and history.count):
            w.process(POOL_PID, f"pool {bytes(view.h['name']).decode(errors='replace')}", 0)
        _finding_events(w, findings, set(pids), end_ns)
    return {
        "traceEvents": w.events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schema": SCHEMA,
            "pool": bytes(view.h["name"]).decode(errors="replace"),
            "origin_ns": first,
            "end_ns": end_ns,
            "source": source,
            "num_requests": len(slices),
            "history_samples": 0 if history is None else history.count,
        },
    }


def mark_replay(trace: dict[str, Any], outcome: Any, log_path: str) -> dict[str, Any]:
    """Mark where a replay of the pool's operation log (kvscope.replay's Outcome) stopped: an
    instant across the trace at that operation's time, named for how it stopped (a divergence,
    the finding, missing records), with the operation and what differed in its arguments;
    `otherData.replay` says the same. Returns that summary."""
    r = outcome.record
    summary: dict[str, Any] = {
        "log": log_path,
        "reason": outcome.reason,
        "replayed": outcome.replayed,
        "operations": outcome.total,
    }
    if r is not None:
        summary.update(operation=r.seq, op=r.op_name, pid=r.pid, request=r.request)
        if outcome.diff:
            summary["differs"] = list(outcome.diff)
        if r.found:
            summary["found"] = [k for k, _ in r.found]
        what = {
            "divergence": "replay diverged",
            "finding": "replay reproduced the finding",
            "lost": "replay stopped: records missing",
            "missing": "replay stopped: a sequence it lacks",
        }.get(outcome.reason, f"replay: {outcome.reason}")
        origin = int(trace["otherData"]["origin_ns"])
        trace["traceEvents"].append(
            {
                "name": f"{what} at operation {r.seq} ({r.op_name} {r.request})",
                "ph": "i",
                "s": "g",
                "ts": round(max(0, r.time_ns - origin) / 1e3, 3),
                "pid": r.pid,
                "tid": r.tid,
                "args": dict(summary),
            }
        )
    trace["otherData"]["replay"] = summary
    return summary


def write_trace(trace: dict[str, Any], path: str) -> None:
    """Write a trace as JSON to a new or regular file, atomically (`write_atomic`, as dumps
    are written); one PoolError, and nothing left behind, when it cannot be."""
    check_target(path, "a trace", stdout=False)
    write_atomic(path, [json.dumps(trace, separators=(",", ":")).encode()], mode=None)


def trace_path(dump_path: str) -> str:
    """The trace beside a dump: `.kvd` replaced by `.trace.json`."""
    base = dump_path[: -len(".kvd")] if dump_path.endswith(".kvd") else dump_path
    return base + ".trace.json"
