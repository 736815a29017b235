"""Crash recovery: roll back dead holders' journals, find dead owners, reclaim what they held."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvscope.allocator.check import table_refs
from kvscope.allocator.journal import Journal
from kvscope.allocator.layout import COUNTER_FIELDS, BlockState, ClientState, SegmentView, SeqState
from kvscope.allocator.process import is_alive
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool

CHUNK = 128


def dead_clients(view: SegmentView, me: int = -1) -> list[int]:
    """Client records still marked attached whose process is gone."""
    c = view.clients
    return [
        i
        for i in np.flatnonzero(c["state"] == ClientState.ATTACHED).tolist()
        if i != me and not is_alive(int(c["pid"][i]), int(c["start"][i]))
    ]


def recover_dead_holders(pool: KVPool) -> list[dict[str, Any]]:
    """Stop the world (every lock, in order), roll back every dead client's journal, clear holders."""
    lt = pool.locks
    view = pool.view
    recovered: list[dict[str, Any]] = []
    taken: list[int] = []
    dead_holders: dict[str, int] = {}
    # A holder named in a lock record we now hold is dead even if /proc still shows it exiting:
    # a live holder clears the record before unlocking, and the kernel unlocks at exit.
    holder_clients: set[int] = set()

    def on_dead(lock: int, pid: int, client: int) -> None:
        dead_holders[lt.names[lock]] = pid
        holder_clients.add(client)

    try:
        for i in range(len(lt.names)):
            lt.acquire(i, recovering=True, on_dead=on_dead)
            taken.append(i)
        for c in sorted(holder_clients | set(dead_clients(view, pool.client))):
            if c != pool.client and int(view.clients["journal_count"][c]):
                n = Journal(view, c).rollback()
                recovered.append({"pid": int(view.clients["pid"][c]), "entries": n})
    finally:
        for i in reversed(taken):
            lt.release(i)
    if dead_holders:
        from kvscope.allocator.findings import Finding

        for name, pid in dead_holders.items():
            pool.report(
                Finding(
                    "lock_dead_holder",
                    f"pid {pid} died holding pool lock {name!r}; its unfinished operation was rolled back",
                    owner_pid=pid,
                    extra={"lock": name},
                )
            )
    return recovered


def detach_client(view: SegmentView, t: Txn, c: int) -> None:
    """Return a client's reserved sequence slots, fold its counters into the header and mark
    its record detached (caller holds the seqs lock, which guards both)."""
    seqs = view.seqs
    mine = np.flatnonzero((seqs["reserved"] == 1) & (seqs["owner_client"] == c))
    head = seqs.dtype.fields["table"][1]
    for s in mine.tolist():
        t.journal.save(view.offsets["seqs"] + s * seqs.dtype.itemsize, head)
    seqs["reserved"][mine] = 0
    h = view.header
    for f in COUNTER_FIELDS:
        t.journal.save(h.dtype.fields[f][1], 8)
        h[f] = int(h[f][0]) + int(view.clients[f][c])
    t.journal.save(view.offsets["clients"] + c * view.clients.dtype.itemsize, 1)
    view.clients["state"][c] = ClientState.DETACHED


def dead_owners(view: SegmentView) -> list[dict[str, Any]]:
    """For each dead client: pid, its live sequences and the blocks it holds."""
    out = []
    b = view.blocks
    seqs = view.seqs
    for c in dead_clients(view):
        mine = np.flatnonzero((seqs["owner_client"] == c) & (seqs["state"] != SeqState.EMPTY))
        held = np.flatnonzero(
            (b["owner_client"] == c)
            & ((b["state"] == BlockState.ALLOCATED) | (b["state"] == BlockState.LOCAL))
        )
        out.append(
            {
                "client": c,
                "pid": int(view.clients["pid"][c]),
                "sequences": [bytes(seqs["request"][s]).decode(errors="replace") for s in mine],
                "blocks": held.tolist(),
            }
        )
    return out


def reclaim_dead(pool: KVPool) -> dict[str, int]:
    """Return every dead client's blocks; each step is its own journaled transaction."""
    view = pool.view
    store, seqtab = pool.store, pool.seqtab
    b, seqs = view.blocks, view.seqs
    totals = {"processes": 0, "sequences": 0, "blocks": 0}
    pool._run(pool.ALL, lambda t: None)  # recovers dead lock holders first
    for c in dead_clients(view, pool.client):
        if int(view.clients["journal_count"][c]):
            pool._run(pool.ALL, lambda t, c=c: Journal(view, c).rollback())
        for s in np.flatnonzero(
            (seqs["owner_client"] == c) & (seqs["state"] != SeqState.EMPTY)
        ).tolist():
            while True:
                k = int(seqs["num_blocks"][s])
                keep = max(0, k - CHUNK)

                def drop_tail(t: Txn, s: int = s, k: int = k, keep: int = keep) -> int:
                    ids = seqs["table"][s, keep:k].astype(np.int64)
                    zero, _ = store.drop(t, ids)
                    store.ring_push(t, zero)
                    seqtab.write_blocks(t, s, keep, [])
                    if keep == 0:
                        seqtab.release(t, s)
                    return len(zero)

                totals["blocks"] += pool._run(pool.ALL, drop_tail)
                if keep == 0:
                    break
            totals["sequences"] += 1

        def free_owned(t: Txn, c: int = c) -> int:
            loc = view.clients["local"][c, : int(view.clients["local_count"][c])]
            stray = np.flatnonzero(
                (b["owner_client"] == c)
                & (
                    (b["state"] == BlockState.LOCAL)
                    | ((b["state"] == BlockState.ALLOCATED) & (b["indexed"] == 0))
                )
            )
            ids = np.unique(np.concatenate([loc.astype(np.int64), stray])).astype(np.int64)
            refs = _live_refs(view, ids)
            ids = ids[refs == 0][: CHUNK * 2]
            store.ring_push(t, ids)
            if len(ids) < CHUNK * 2:
                t.journal.save(
                    view.offsets["clients"] + c * view.clients.dtype.itemsize,
                    view.clients.dtype.fields["local"][1],
                )
                view.clients["local_count"][c] = 0
            return len(ids)

        while True:
            got = pool._run(pool.ALL, free_owned)
            totals["blocks"] += got
            if got < CHUNK * 2:
                break

        pool._run(pool.ALL, lambda t, c=c: detach_client(view, t, c))
        totals["processes"] += 1
    return totals


def _live_refs(view: SegmentView, ids: np.ndarray) -> np.ndarray:
    """References to ids from live sequences (ids of dead owners that someone still maps stay)."""
    seqs = view.seqs
    live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
    return table_refs(seqs, live, len(view.blocks))[ids]
