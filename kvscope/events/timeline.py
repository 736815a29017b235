"""A recorded KV-event stream as a Chrome trace-event file, for Perfetto (`kvscope timeline FILE`).

    trace = build_stream_trace(walk_file("engine.kvev"))
    write_trace(trace, "engine.trace.json")          # kvscope.timeline's writer

The same format and writer as a pool's trace (kvscope/timeline.py): `ts` and `dur` in µs since
`otherData.origin_ns`, the stream's first batch. Tracks (docs/CLI.md, `kvscope timeline`):

- a process per publisher (endpoint, topic, rank): counters `cache` (block copies stored and
  distinct hashes), `stores` (new hashes and hashes stored again, cumulative) and `totals`
  (hashes stored and removed, cumulative); `blocks 1`, `blocks 2`, ...: a slice per hash from
  the store that found no copy of it to the removal of its last copy, `AllBlocksCleared` or the
  publisher's restart (lanes so that slices never overlap on one thread); `events`: an instant
  per `AllBlocksCleared` and restart; each finding an instant at its batch's time;
- a `stream` process: findings that name no publisher (a malformed message) and the recorder's
  notes.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from kvscope.errors import EXIT_OK, UsageError
from kvscope.events.walk import Life, StreamWalk, Walked, walk_file
from kvscope.events.wire import hash_text
from kvscope.lifetimes import RequestSlice, assign_lanes
from kvscope.timeline import LOCKS_PID, SCHEMA, TraceWriter, write_trace

# Synthetic pids above pid_max, past the pool trace's: the stream, then one per publisher.
STREAM_PID = LOCKS_PID + 16
FIRST_PUB_PID = STREAM_PID + 1
# A hash in a slice's name: its first characters.
NAME_CHARS = 12


def _life_args(life: Life, walk: StreamWalk) -> dict[str, Any]:
    medium, group = life.cache
    args: dict[str, Any] = {
        "hash": hash_text(life.hash),
        "parent": None if life.parent is None else hash_text(life.parent),
        "block_size": life.block_size,
        "stored_batch": life.batch,
        "stored_seq": life.seq,
        "end": life.end or "still stored at the end of the stream",
        "stored_again": life.stored_again,
        "max_copies": life.max_copies,
    }
    if life.end_batch is not None:
        args["end_batch"] = life.end_batch
    if medium is not None:
        args["medium"] = medium
    if group is not None:
        args["group"] = group
    return args


def build_stream_trace(walked: Walked) -> dict[str, Any]:
    """The trace-event object of a walked stream."""
    walk = walked.walk
    origin = walk.first_ns or walk.last_ns
    end_ns = max(walk.last_ns, origin)
    w = TraceWriter(origin)
    w.process(STREAM_PID, f"stream {walked.path}", 0)
    pids: dict[Any, int] = {}
    for k, key in enumerate(walk.publishers):
        pids[key] = FIRST_PUB_PID + k
        w.process(pids[key], f"publisher {walk.publisher_name(key)}", 1 + k)
    # cache over time
    for key, s in walk.series.items():
        pid = pids[key]
        for i, t in enumerate(s.time_ns):
            w.counter("cache", pid, t, {"block copies": s.peak[i], "hashes": s.hashes[i]})
            w.counter("stores", pid, t, {"new": s.new[i], "stored again": s.again[i]})
            w.counter("totals", pid, t, {"stored": s.stored[i], "removed": s.removed[i]})
    # each hash's stay, on lanes that never overlap
    slices = [
        RequestSlice(pid=pids[life.pub], request="", start_ns=life.start_ns, end_ns=life.end_ns)
        for life in walk.lives
    ]
    assign_lanes(slices, end_ns)
    for life, sl in zip(walk.lives, slices):
        tid = w.thread(sl.pid, f"blocks {sl.lane + 1}")
        stop = life.end_ns if life.end_ns is not None else end_ns
        name = hash_text(life.hash)[:NAME_CHARS]
        w.complete(name, "block", sl.pid, tid, life.start_ns, stop, _life_args(life, walk))
    for key, t, batch in walk.clears:
        tid = w.thread(pids[key], "events")
        w.instant("AllBlocksCleared", "clear", pids[key], tid, t, "t", {"batch": batch})
    for key, t, batch in walk.resets:
        tid = w.thread(pids[key], "events")
        w.instant("publisher restarted", "restart", pids[key], tid, t, "t", {"batch": batch})
    names = {walk.publisher_name(k): pid for k, pid in pids.items()}
    for f in walk.findings:
        extra = f.extra
        args: dict[str, Any] = {"severity": f.severity, "message": f.message}
        for name in ("batch", "seq", "hash", "publisher", "medium", "group"):
            if extra.get(name) is not None:
                args[name] = extra[name]
        if f.events:
            args["events"] = f.events
        t = walk.batch_ns(extra.get("batch"))
        on = names.get(extra.get("publisher", ""))
        if on is not None:
            w.instant(f.kind, "finding", on, on, t, "p", args)
        else:
            w.instant(f.kind, "finding", STREAM_PID, STREAM_PID, t, "g", args)
    for note in walk.notes:
        tid = w.thread(STREAM_PID, "recorder notes")
        args = {k: v for k, v in note.items() if isinstance(v, (str, int, float, bool))}
        w.instant(
            str(note.get("note", "note")),
            "note",
            STREAM_PID,
            tid,
            walk.batch_ns(note.get("batch")),
            "t",
            args,
        )
    summary = walked.report["summary"]
    return {
        "traceEvents": w.events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schema": SCHEMA,
            "stream": walked.path,
            "origin_ns": origin,
            "end_ns": end_ns,
            "source": walked.path,
            "healthy": walked.report["healthy"],
            "publishers": len(pids),
            "batches": summary["batches"],
            "events": summary["events"],
            "block_slices": len(walk.lives),
            "block_slices_omitted": walk.lives_omitted,
            "findings": sum(summary["findings_by_kind"].values()),
            "findings_by_kind": summary["findings_by_kind"],
        },
    }


def timeline_verb(target: str, output: str, history: str | None) -> int:
    """`kvscope timeline FILE -o OUT` of a recorded stream (the verb checked OUT already)."""
    if history is not None:
        raise UsageError("--history is a pool's; a recorded event stream carries its own times")
    trace = build_stream_trace(walk_file(target))
    if output == "-":
        json.dump(trace, sys.stdout, separators=(",", ":"))
        sys.stdout.write("\n")
    else:
        write_trace(trace, output)
    od = trace["otherData"]
    what = (
        f"{od['publishers']} publisher(s), {od['batches']:,} batch(es), {od['block_slices']:,}"
        f" block slice(s)"
        + (
            f" ({od['block_slices_omitted']:,} more not drawn)"
            if od["block_slices_omitted"]
            else ""
        )
        + f", {od['findings']} finding(s)"
    )
    where = "stdout" if output == "-" else os.path.abspath(output)
    print(
        f"kvscope: wrote {where}: {what}; open it in Perfetto or chrome://tracing",
        file=sys.stderr,
    )
    return EXIT_OK
