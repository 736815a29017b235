"""Pool statistics computed from a segment view (live or dump): one vectorised pass."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.allocator.idle import idle_requests, idle_threshold_s
from kvscope.allocator.layout import COUNTER_FIELDS, BlockState, ClientState, SegmentView, SeqState


def pool_stats(
    view: SegmentView, blocks: Any = None, now_mono_ns: int | None = None
) -> dict[str, Any]:
    """Block counts by state, occupancy and counters summed over every process.

    `blocks`: the records' state, refcount and num_tokens when the caller holds them apart
    (the TUI copies those columns of a live pool, not its records); `view.blocks` otherwise.
    `now_mono_ns`: the CLOCK_MONOTONIC time a live pool was read at, for the metrics' idle
    requests (allocator/idle.py): with it, `idle_requests` (those past KVSCOPE_IDLE_REQUEST_S)
    and `max_idle_s` (the longest unserved, 0 with none) too.
    """
    h = view.h
    b = view.blocks if blocks is None else blocks
    # One strided pass over the records; every use after reads a contiguous copy.
    state = np.ascontiguousarray(b["state"])
    st = np.bincount(state, minlength=len(BlockState))
    n = int(h["num_blocks"])
    clients = view.clients
    live = clients["state"] == ClientState.ATTACHED
    seqs = view.seqs
    live_seqs = seqs["state"] != SeqState.EMPTY
    out: dict[str, Any] = {
        "num_blocks": n,
        "num_free": int(st[BlockState.FREE]),
        "num_cached": int(st[BlockState.CACHED]),
        "num_allocated": int(st[BlockState.ALLOCATED]),
        "num_local": int(st[BlockState.LOCAL]),
        "num_quarantined": int(st[BlockState.QUARANTINED]),
        "num_sequences": int(live_seqs.sum()),
        "num_clients": int(live.sum()),
        "ring_count": int(view.ring_header["count"][0]),
        "refcount_peak": int(b["refcount"].max()) if n else 0,
        "tokens_stored": int(b["num_tokens"][state == BlockState.ALLOCATED].sum()),
    }
    # what an allocation can take besides a process's own local cache: the shared free ring's
    # blocks (guard mode's quarantined ones are handed out when nothing else is free) and the
    # cached ones (evicted as it needs them)
    out["num_available"] = out["num_free"] + out["num_quarantined"] + out["num_cached"]
    for f in COUNTER_FIELDS:
        out[f] = int(h[f]) + int(clients[f][live].sum())
    out["utilization"] = out["num_allocated"] / n if n else 0.0
    held = out["num_allocated"] * int(h["block_size"])
    out["internal_fragmentation"] = 1 - out["tokens_stored"] / held if held else 0.0
    q = out["prefix_queries"]
    out["prefix_hit_rate"] = out["prefix_hits"] / q if q else 0.0
    out["last_exhausted"] = last_exhaustion(view)
    if now_mono_ns is not None:
        idle = idle_requests(view, now_mono_ns, 0.0)
        limit = idle_threshold_s(view)
        out["idle_requests"] = sum(r.idle_s >= limit for r in idle) if limit > 0 else 0
        out["max_idle_s"] = round(idle[0].idle_s, 3) if idle else 0.0
    return out


def last_exhaustion(view: SegmentView) -> dict[str, int] | None:
    """The pool's last PoolExhausted as the C core recorded it in the header (records.py
    EXHAUSTION_FIELDS): when, which process, the blocks the take needed, and the free blocks
    then in the shared free ring, in that process's own local cache and in the other processes'
    local caches (which it cannot take). None when none was recorded."""
    h = view.h
    if not int(h["exhausted_ns"]):
        return None
    return {
        "time_ns": int(h["exhausted_ns"]),
        "pid": int(h["exhausted_pid"]),
        "needed": int(h["exhausted_need"]),
        "free_list": int(h["exhausted_free"]),
        "own_cache": int(h["exhausted_own"]),
        "other_caches": int(h["exhausted_local"]),
    }
