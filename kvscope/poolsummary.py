"""What `analyze` says of a pool before its findings: its name, geometry, device, probes and
origin (`pool_info`), and its blocks, sequences and processes counted (`summary`), as the
`pool` and `summary` keys of docs/CLI.md's JSON object (kvscope/analysis.py builds the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvscope.allocator.layout import (
    DUMP_FAILED,
    DUMP_REDACTED,
    DUMP_TORN,
    DUMP_WITH_DATA,
    BlockState,
    ClientState,
    Flag,
    SegmentView,
    SeqState,
    field_text,
)
from kvscope.allocator.lease import lease_rows, lease_totals
from kvscope.allocator.process import is_stopped
from kvscope.allocator.stats import pool_stats

# Held leases `summary` lists (its `leases.list`), oldest first.
MAX_LEASES_LISTED = 20
# (pid, start time) -> whether that process is alive
Alive = Callable[[int, int], bool]


def some(texts: Iterable[str], n: int = 3) -> str:
    """The first `n` of `texts`, comma-separated, and how many more there are (`'a', 'b',
    'c' and 4 more`): where a line names a few of many."""
    texts = list(texts)
    more = f" and {len(texts) - n} more" if len(texts) > n else ""
    return ", ".join(texts[:n]) + more


def pool_info(view: SegmentView, dump_header: np.void | None = None) -> dict[str, Any]:
    """Name, geometry, device, probe flags and origin of the pool a view shows."""
    h = view.h
    lay = view.layout
    flags = int(h["flags"])
    info: dict[str, Any] = {
        "name": field_text(h["name"]),
        "geometry": {
            "num_blocks": lay.num_blocks,
            "block_size": lay.block_size,
            "slots_per_block": int(h["slots_per_block"]),
            "num_layers": int(h["num_layers"]),
            "num_kv_heads": int(h["num_kv_heads"]),
            "head_dim": int(h["head_dim"]),
            "dtype": field_text(h["dtype"]),
            "max_seqs": lay.max_seqs,
            "max_blocks_per_seq": lay.max_blocks_per_seq,
        },
        "device": field_text(h["device"]),
        # bytes of the pool's KV tensor (all blocks, every layer, K and V)
        "data_bytes": int(h["data_bytes"]),
        "flags": {
            "guard": bool(flags & Flag.GUARD),
            "events": bool(flags & Flag.EVENTS),
            "lockdep": bool(flags & Flag.LOCKDEP),
        },
        "creator_pid": int(h["creator_pid"]),
        "created_ns": int(h["created_ns"]),
        # False when the copy was taken while a live writer was mid-operation (no quiet moment
        # came): its findings may show a half-done operation that a consistent copy would not.
        "consistent": not getattr(view, "torn", False)
        and not (dump_header is not None and int(dump_header["flags"]) & DUMP_TORN),
    }
    if dump_header is not None:
        df = int(dump_header["flags"])
        info["dump"] = {
            "pid": int(dump_header["pid"]),
            "host": field_text(dump_header["host"]),
            "reason": field_text(dump_header["reason"]),
            "created_ns": int(dump_header["created_ns"]),
            "with_data": bool(df & DUMP_WITH_DATA),
            "redacted": bool(df & DUMP_REDACTED),
            "torn": bool(df & DUMP_TORN),
            "failed": bool(df & DUMP_FAILED),
        }
    return info


def _held_for_others(view: SegmentView, allocated: np.ndarray, live: np.ndarray) -> dict[int, int]:
    """Per owner pid, its allocated blocks that none of its own live sequences maps: a block's
    owner is the process that allocated it, and a shared prefix block stays held by the
    requests of other processes that hit it after the allocator's own request ended (so a
    clean process shows blocks held that only another process's requests keep)."""
    seqs = view.seqs[live]
    n = view.layout.num_blocks
    if not len(seqs):
        mapped_by_owner = np.zeros(0, np.int64)
    else:
        lengths = np.minimum(seqs["num_blocks"].astype(np.int64), seqs["table"].shape[1])
        width = int(lengths.max())  # (the tables' used columns only: a table is mostly unused)
        cols = np.arange(width)[None, :] < lengths[:, None]
        blocks = seqs["table"][:, :width][cols].astype(np.int64)
        pids = np.repeat(seqs["owner_pid"].astype(np.int64), cols.sum(1))
        ok = (blocks >= 0) & (blocks < n)
        blocks, pids = blocks[ok], pids[ok]
        owner = view.blocks["owner_pid"].astype(np.int64)
        # the blocks some sequence of their own owner maps
        mapped_by_owner = np.unique(blocks[owner[blocks] == pids])
    mine = np.zeros(n, bool)
    mine[mapped_by_owner] = True
    lone = np.flatnonzero(allocated & ~mine)
    if not len(lone):
        return {}
    p, c = np.unique(view.blocks["owner_pid"][lone], return_counts=True)
    return dict(zip(p.tolist(), c.tolist()))


def summary(view: SegmentView, alive: Alive) -> dict[str, Any]:
    """Blocks by state and by owner, sequences by state, processes alive and dead."""
    b = view.blocks
    # One strided pass over the records; every use after reads a contiguous copy.
    state = np.ascontiguousarray(b["state"])
    counts = np.bincount(state, minlength=len(BlockState))
    by_state = {s.name.lower(): int(counts[s]) for s in BlockState}
    other = int(counts[len(BlockState) :].sum())
    if other:
        by_state["invalid"] = other
    clients = view.clients
    attached = np.flatnonzero(clients["state"] == ClientState.ATTACHED)
    pid_alive = {
        int(clients["pid"][c]): alive(int(clients["pid"][c]), int(clients["start"][c]))
        for c in attached.tolist()
    }
    held = (state == BlockState.ALLOCATED) | (state == BlockState.LOCAL)
    owner = b["owner_pid"]
    pids, num = np.unique(owner[held], return_counts=True)
    # Of them, the free blocks each process keeps in its local cache: no request holds them,
    # but no other process can allocate them either (the "N free" of another process's
    # PoolExhausted that it could not take).
    lpids, lnum = np.unique(owner[state == BlockState.LOCAL], return_counts=True)
    local = dict(zip(lpids.tolist(), lnum.tolist()))
    seqs = view.seqs
    live = seqs["state"] != SeqState.EMPTY
    seq_pids, seq_num = np.unique(seqs["owner_pid"][live], return_counts=True)
    requests = dict(zip(seq_pids.tolist(), seq_num.tolist()))
    others = _held_for_others(view, state == BlockState.ALLOCATED, live)
    # (a live copy's alive processes that are stopped now: SIGSTOP or a debugger; a dump's
    # processes are not asked about)
    live_copy = getattr(view, "taken_mono_ns", None) is not None
    stopped = {p for p, a in pid_alive.items() if a and live_copy and is_stopped(p)}
    by_owner = [
        {
            "pid": pid,
            "alive": pid_alive.get(pid),
            **({"stopped": True} if pid in stopped else {}),
            "blocks": n,
            "requests": int(requests.get(pid, 0)),
            "held_for_others": int(others.get(pid, 0)),
            "local": int(local.get(pid, 0)),
        }
        for pid, n in sorted(zip(pids.tolist(), num.tolist()), key=lambda x: -x[1])
    ]
    seq_states = np.bincount(seqs["state"], minlength=len(SeqState))
    stats = pool_stats(view)
    leases: dict[str, Any] = {**lease_totals(view), "list": lease_rows(view)[:MAX_LEASES_LISTED]}
    return {
        "blocks_by_state": by_state,
        "blocks_by_owner": by_owner,
        "sequences_by_state": {
            s.name.lower(): int(seq_states[s]) for s in SeqState if s != SeqState.EMPTY
        },
        "processes": {
            "alive": sorted(p for p, a in pid_alive.items() if a),
            "dead": sorted(p for p, a in pid_alive.items() if not a),
            "stopped": sorted(stopped),
        },
        "utilization": stats["utilization"],
        "prefix_hit_rate": stats["prefix_hit_rate"],
        "leases": leases,
        "counters": {
            k: stats[k]
            for k in (
                "num_allocs",
                "num_frees",
                "num_cow",
                "num_evictions",
                "num_preemptions",
                "num_forks",
                "num_exhausted",
            )
        },
    }
