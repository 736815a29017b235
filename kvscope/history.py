"""The pool's history: a bounded time series of its counters, sampled from outside the pool.

`kvscope run`'s supervisor samples every pool the script opens (`History.sample`, from its
read-only mapping: no lock, nothing written) and writes the series beside the dump as
`<dump>.history.json`. `kvscope report`, `analyze` and `timeline` read it back from there.

The series is bounded without losing the run's start or its peaks: when it holds CAPACITY
samples, every two consecutive samples merge into one (the later one's values, the larger of
the two for the `*_max` columns) and the sampling interval doubles. A run of any length keeps
its whole span in at most CAPACITY rows.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import (
    COUNTER_FIELDS,
    BlockState,
    ClientState,
    SegmentView,
    SeqState,
    lock_names,
)
from kvscope.target import looks_like_path

SCHEMA = 1
CAPACITY = 2048
HISTORY_SUFFIX = ".history.json"
# Sampling may use at most 1/COST_SHARE of the sampler's time (large pools are sampled less often).
COST_SHARE = 50

GAUGES = (
    "num_free",
    "num_cached",
    "num_allocated",
    "num_local",
    "num_quarantined",
    "num_running",
    "num_waiting",
    "num_preempted",
    # Blocks the preempted sequences need back to resume (their tokens, rounded up to blocks).
    "preempted_blocks",
    # What the requests wanted at that moment: blocks held by sequences + preempted_blocks.
    "demand",
    "refcount_peak",
)
# Kept as the larger of two merged samples, so decimation never loses a peak.
PEAKS = ("demand_max", "allocated_max", "refcount_peak_max")
LOCK_COLUMNS = (
    "lock_acquires",
    "lock_contended",
    "lock_wait_ns",
    "lock_hold_ns",
    "lock_holder_pid",
    # perf_counter_ns of the holder when it took the lock (CLOCK_MONOTONIC: host-wide).
    "lock_acquired_ns",
)


def sample_dtype(num_locks: int) -> np.dtype:
    """One sample: wall and monotonic time, gauges, their peaks, counters, per-lock records."""
    fields: list[tuple[Any, ...]] = [("time_ns", "<i8"), ("mono_ns", "<i8")]
    fields += [(g, "<i8") for g in (*GAUGES, *PEAKS, *COUNTER_FIELDS)]
    fields += [(c, "<i8", (num_locks,)) for c in LOCK_COLUMNS]
    return np.dtype(fields)


def read_sample(view: SegmentView, out: np.void) -> None:
    """Fill one sample from a segment view (a live read-only mapping or a copy).

    Not under the seqlock: each value is read whole, but the counts may be a few operations
    apart from one another, which a time series of many samples does not notice.
    """
    b = view.blocks
    st = np.bincount(b["state"], minlength=len(BlockState))
    seqs = view.seqs
    state = seqs["state"]
    sst = np.bincount(state, minlength=len(SeqState))
    bs = int(view.h["block_size"])
    pre = state == SeqState.PREEMPTED
    wanted = int(((seqs["num_tokens"][pre].astype(np.int64) + bs - 1) // bs).sum())
    clients = view.clients
    live = clients["state"] == ClientState.ATTACHED
    out["time_ns"] = time.time_ns()
    out["mono_ns"] = time.perf_counter_ns()
    out["num_free"] = int(st[BlockState.FREE])
    out["num_cached"] = int(st[BlockState.CACHED])
    out["num_allocated"] = int(st[BlockState.ALLOCATED])
    out["num_local"] = int(st[BlockState.LOCAL])
    out["num_quarantined"] = int(st[BlockState.QUARANTINED])
    out["num_running"] = int(sst[SeqState.RUNNING])
    out["num_waiting"] = int(sst[SeqState.WAITING])
    out["num_preempted"] = int(sst[SeqState.PREEMPTED])
    out["preempted_blocks"] = wanted
    out["demand"] = int(st[BlockState.ALLOCATED]) + wanted
    out["refcount_peak"] = int(b["refcount"].max()) if len(b) else 0
    out["demand_max"] = out["demand"]
    out["allocated_max"] = out["num_allocated"]
    out["refcount_peak_max"] = out["refcount_peak"]
    h = view.h
    for f in COUNTER_FIELDS:
        out[f] = int(h[f]) + int(clients[f][live].sum())
    locks = view.locks
    out["lock_acquires"] = locks["num_acquires"]
    out["lock_contended"] = locks["num_contended"]
    out["lock_wait_ns"] = locks["wait_ns"]
    out["lock_hold_ns"] = locks["hold_ns"]
    out["lock_holder_pid"] = locks["holder_pid"]
    out["lock_acquired_ns"] = locks["acquired_ns"]


class History:
    """A bounded time series of one pool's counters (see the module docstring)."""

    def __init__(
        self,
        name: str,
        created_ns: int,
        locks: list[str],
        *,
        interval_s: float = 0.1,
        capacity: int = CAPACITY,
    ):
        assert capacity >= 2 and capacity % 2 == 0
        self.name = name
        self.created_ns = created_ns
        self.locks = locks
        self.interval_s = interval_s
        self.rows = np.zeros(capacity, sample_dtype(len(locks)))
        self.count = 0
        self.next_s = 0.0
        self.cost_s = 0.0

    @classmethod
    def for_view(cls, view: SegmentView, **kw: Any) -> History:
        """An empty history for the pool a view shows."""
        h = view.h
        return cls(
            bytes(h["name"]).decode(errors="replace"),
            int(h["created_ns"]),
            lock_names(view.layout.num_shards),
            **kw,
        )

    @property
    def samples(self) -> np.ndarray:
        """The samples so far, oldest first."""
        return self.rows[: self.count]

    def sample(self, view: SegmentView, now_s: float | None = None) -> bool:
        """Take a sample when one is due (every interval_s, stretched so sampling stays within
        1/COST_SHARE of the time); True when one was taken."""
        now = time.monotonic() if now_s is None else now_s
        if now < self.next_s:
            return False
        t0 = time.perf_counter()
        self.add(view)
        self.cost_s = time.perf_counter() - t0
        self.next_s = now + max(self.interval_s, COST_SHARE * self.cost_s)
        return True

    def add(self, view: SegmentView) -> None:
        """Append one sample now, merging pairs first when the series is full."""
        if self.count == len(self.rows):
            self._halve()
        read_sample(view, self.rows[self.count : self.count + 1][0])
        self.count += 1

    def _halve(self) -> None:
        rows = self.rows
        early, late = rows[0::2].copy(), rows[1::2].copy()
        for p in PEAKS:
            late[p] = np.maximum(early[p], late[p])
        half = len(rows) // 2
        rows[:half] = late
        rows[half:] = 0
        self.count = half
        self.interval_s *= 2

    # -- files -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The series as one JSON object: columns of numbers, one list per field."""
        s = self.samples
        cols = {f: s[f].tolist() for f in s.dtype.names or ()}
        return {
            "schema": SCHEMA,
            "pool": self.name,
            "created_ns": self.created_ns,
            "interval_s": self.interval_s,
            "locks": self.locks,
            "columns": cols,
        }

    def write(self, path: str) -> None:
        """Write the series as JSON (atomically: a temporary file renamed into place)."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> History:
        """The series a `to_json` object holds (ValueError when it is not one)."""
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise ValueError(f"not a kvscope history of schema {SCHEMA}")
        cols = d["columns"]
        missing = [f for f in sample_dtype(len(d["locks"])).names or () if f not in cols]
        if missing:
            # (a series of another kvscope version: its counters are not these)
            raise ValueError(f"no column {', '.join(missing)}: written by another kvscope version")
        n = len(cols["time_ns"])
        hist = cls(
            str(d["pool"]),
            int(d["created_ns"]),
            [str(x) for x in d["locks"]],
            interval_s=float(d["interval_s"]),
            capacity=max(2, n + n % 2),
        )
        for f in hist.rows.dtype.names or ():
            hist.rows[f][:n] = np.asarray(cols[f], np.int64).reshape(hist.rows[f][:n].shape)
        hist.count = n
        return hist


def history_path(dump_path: str) -> str:
    """Where the history of a dump lives: beside it, `.kvd` replaced by `.history.json`."""
    base = dump_path[: -len(".kvd")] if dump_path.endswith(".kvd") else dump_path
    return base + HISTORY_SUFFIX


def read_history(path: str) -> History:
    """A history file (PoolError with one line when it cannot be read)."""
    try:
        with open(path) as f:
            return History.from_json(json.load(f))
    except FileNotFoundError:
        raise PoolError(f"no history file at {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PoolError(f"{path} is not a kvscope history file ({e})") from None


def history_beside(target: str) -> History | None:
    """The history written beside a dump file, or None (a live pool, or none written); a
    PoolError when there is one that cannot be read."""
    path = history_path(target)
    if not os.path.isfile(path):
        return None
    return read_history(path)


def history_for(target: str, explicit: str | None = None) -> History | None:
    """The history of what a verb looks at: `explicit` (a --history file; PoolError when it
    cannot be read) when given, else the one beside a dump file (a warning on stderr and None
    when that one cannot be read: the dump is still worth reading); None for a live pool."""
    if explicit:
        return read_history(explicit)
    if not looks_like_path(target):
        return None
    try:
        return history_beside(target)
    except PoolError as e:
        print(f"kvscope: warning: {e}; going on without it", file=sys.stderr)
        return None
