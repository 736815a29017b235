"""Range checks on what a segment's records hold: every id, count and counter that `check`
and `check --repair` would index with, loop over or add to, checked against the pool first.

A value out of range is a finding (through `add`), or a reason not to repair
(`repair_blocker`), never an IndexError, an overflow or a loop over garbage.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.layout import (
    COUNTER_FIELDS,
    LOCAL_CACHE_MAX,
    LOCK_DTYPE,
    ClientState,
    SegmentView,
    SeqState,
)
from kvscope.allocator.process import is_alive

Add = Callable[[Finding], None]
Alive = Callable[[int, int], bool]


def local_cache(add: Add, clients: np.ndarray, c: int, n: int) -> np.ndarray:
    """Client c's local cache of free block ids, with a finding for each count or id that
    cannot be right (only the ids inside the pool are returned)."""
    k = int(clients["local_count"][c])
    pid = int(clients["pid"][c])
    if k > LOCAL_CACHE_MAX:
        add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"the local cache of pid {pid} claims {k} blocks; it holds at most {LOCAL_CACHE_MAX}",
                owner_pid=pid or None,
            )
        )
    loc = clients["local"][c, : min(k, LOCAL_CACHE_MAX)].astype(np.int64)
    inside = (loc >= 0) & (loc < n)
    if not inside.all():
        add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"the local cache of pid {pid} holds {int((~inside).sum())} ids outside the pool's blocks [0, {n})",
                owner_pid=pid or None,
            )
        )
    return loc[inside]


def check_tables(add: Add, seqs: np.ndarray, live: np.ndarray, n: int, limit: int) -> None:
    """Sequence records that cannot be right: a state outside the enum, a block count past the
    table, or a block-table entry outside the pool (a kernel would read or write outside the
    KV tensor: out_of_bounds)."""
    bad_state = live[seqs["state"][live] >= len(SeqState)]
    for s in bad_state[:limit].tolist():
        add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"sequence slot {s} has state {int(seqs['state'][s])}, not a sequence state (0-{len(SeqState) - 1}): no process can use or free it",
                owner_pid=int(seqs["owner_pid"][s]) or None,
                request=_seq_req(seqs, s),
            )
        )
    width = seqs["table"].shape[1]
    claimed = seqs["num_blocks"][live].astype(np.int64)
    for s in live[claimed > width][:limit].tolist():
        add(
            Finding(
                FindingKind.OUT_OF_BOUNDS,
                f"sequence slot {s} claims {int(seqs['num_blocks'][s])} blocks; its table holds {width}",
                owner_pid=int(seqs["owner_pid"][s]) or None,
                request=_seq_req(seqs, s),
            )
        )
    tables = seqs["table"][live].astype(np.int64)
    used = np.arange(width) < np.minimum(claimed, width)[:, None]
    outside = used & ((tables < 0) | (tables >= n))
    rows = np.flatnonzero(outside.any(axis=1))
    for i in rows[:limit].tolist():
        s = int(live[i])
        cols = np.flatnonzero(outside[i])
        add(
            Finding(
                FindingKind.OUT_OF_BOUNDS,
                f"the block table of sequence slot {s} maps logical block {int(cols[0])} to block"
                f" {int(tables[i, cols[0]])}, outside the pool's blocks [0, {n})"
                + (f" ({len(cols)} such entries)" if len(cols) > 1 else "")
                + ": a kernel would read or write outside the KV tensor",
                owner_pid=int(seqs["owner_pid"][s]) or None,
                request=_seq_req(seqs, s),
            )
        )
    if len(rows) > limit:
        add(
            Finding(
                FindingKind.OUT_OF_BOUNDS,
                f"{len(rows) - limit} more sequences map blocks outside the pool",
            )
        )


def _seq_req(seqs: np.ndarray, s: int) -> str | None:
    return bytes(seqs["request"][s]).decode(errors="replace") or None


# No count, time or position the allocator keeps gets near this (2**62 ns is 146 years):
# a larger one was written by someone else, and adding to it would overflow.
COUNTER_LIMIT = 2**62


def _huge_counter(view: SegmentView) -> str | None:
    """The first 64-bit counter of the header, ring, locks or clients past COUNTER_LIMIT."""
    places = [
        ("header", view.header, ["findings_head", "next_seq_id", *COUNTER_FIELDS]),
        ("free ring", view.ring_header, ["head", "tail", "allocs"]),
        ("lock", view.locks, [f for f in LOCK_DTYPE.names or () if LOCK_DTYPE[f] == np.uint64]),
        ("client", view.clients, ["seq", "event_head", *COUNTER_FIELDS]),
    ]
    for where, arr, fields in places:
        for f in fields:
            big = np.flatnonzero(arr[f] >= np.uint64(COUNTER_LIMIT))
            if len(big):
                return f"its {where} field {f} is {int(arr[f][big[0]])}, beyond any real count"
    return None


def repair_blocker(view: SegmentView, alive: Alive = is_alive) -> str | None:
    """Why reclaiming this pool's dead processes cannot be done safely, or None.

    Reclaiming walks the free ring and each dead process's local cache and block tables, adds
    to counters and takes every lock: an id outside the pool, a lock naming a client record
    that does not exist, or a counter no allocator reaches means the segment was damaged and
    the repair would act on garbage. (A dead process's journal that cannot be trusted is not a
    blocker: the repair skips it and says so, csrc/recovery.c journal_problem.)
    """
    n = view.layout.num_blocks
    rh = view.ring_header[0]
    if int(rh["count"]) > n:
        return f"its free ring (head {int(rh['head'])}, tail {int(rh['tail'])}, count {int(rh['count'])}) is damaged"
    huge = _huge_counter(view)
    if huge is not None:
        return huge
    c, seqs, locks = view.clients, view.seqs, view.locks
    held = np.flatnonzero(locks["holder_pid"] != 0)
    for i in held.tolist():
        if not 0 <= int(locks["holder_client"][i]) < len(c):
            name = bytes(locks["name"][i]).decode(errors="replace")
            return f"its lock {name!r} names client record {int(locks['holder_client'][i])}, which does not exist"
    for i in np.flatnonzero(c["state"] == ClientState.ATTACHED).tolist():
        pid = int(c["pid"][i])
        if alive(pid, int(c["start"][i])):
            continue
        k = int(c["local_count"][i])
        loc = c["local"][i, : min(k, LOCAL_CACHE_MAX)]
        if k > LOCAL_CACHE_MAX or ((loc < 0) | (loc >= n)).any():
            return f"the local cache of dead pid {pid} holds ids outside the pool"
        mine = np.flatnonzero((seqs["owner_client"] == i) & (seqs["state"] != SeqState.EMPTY))
        width = seqs["table"].shape[1]
        for s in mine.tolist():
            k = int(seqs["num_blocks"][s])
            t = seqs["table"][s, : min(k, width)]
            if k > width or ((t < 0) | (t >= n)).any():
                return f"a block table of dead pid {pid} (sequence slot {s}) maps blocks outside the pool"
    return None
