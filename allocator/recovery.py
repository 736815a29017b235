"""Crash recovery: roll back dead holders' journals, find dead owners, reclaim what they held.

Any number of processes may recover and reclaim at once (survivors calling `reclaim_dead()`,
`kvscope check --repair`, an attach that finds the client table full). The list of dead clients
is taken without locks, so it can be stale by the time a reclaimer acts on it: another
reclaimer may have reclaimed a record, and a new process attached into it. So every step of a
reclaim runs under every pool lock and first re-verifies that the record still belongs to the
same dead process (`DeadClient.still_dead`: state, pid, start time, attach generation, and the
process gone); a step that finds otherwise does nothing, and the reclaim of that client ends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kvscope.allocator.blocks import BlockStore
from kvscope.allocator.check import table_refs
from kvscope.allocator.findings import (
    Finding,
    FindingKind,
    mark_repaired,
    readable_findings,
    write_finding,
)
from kvscope.allocator.journal import Journal
from kvscope.allocator.layout import (
    CHUNK,
    COUNTER_FIELDS,
    BlockState,
    ClientState,
    SegmentView,
    SeqState,
)
from kvscope.allocator.locks import DeadHolder, LockTable
from kvscope.allocator.process import is_alive
from kvscope.allocator.sequence import SeqTable
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool

T = TypeVar("T")
# Runs fn in a transaction that holds every pool lock (recovering dead holders first).
RunAll = Callable[[Callable[[Txn], Any]], Any]


@dataclass(frozen=True)
class DeadClient:
    """A client record and the identity of the dead process attached in it when it was found."""

    client: int
    pid: int
    start: int
    # The record's attach generation (`attached_ns`, strictly increasing per record).
    generation: int

    def still_dead(self, view: SegmentView) -> bool:
        """True while the record still holds this same process, attached, and it is gone."""
        c, i = view.clients, self.client
        return (
            int(c["state"][i]) == ClientState.ATTACHED
            and int(c["pid"][i]) == self.pid
            and int(c["start"][i]) == self.start
            and int(c["attached_ns"][i]) == self.generation
            and not is_alive(self.pid, self.start)
        )


def find_dead(view: SegmentView, me: int = -1) -> list[DeadClient]:
    """Client records still marked attached whose process is gone (a hint: re-verify under
    the locks before acting on one)."""
    c = view.clients
    out = []
    for i in np.flatnonzero(c["state"] == ClientState.ATTACHED).tolist():
        pid, start = int(c["pid"][i]), int(c["start"][i])
        if i != me and not is_alive(pid, start):
            out.append(DeadClient(i, pid, start, int(c["attached_ns"][i])))
    return out


def dead_clients(view: SegmentView, me: int = -1) -> list[int]:
    """Client records still marked attached whose process is gone."""
    return [d.client for d in find_dead(view, me)]


def recover_dead_holders(
    lt: LockTable, view: SegmentView, me: int, report: Callable[[Any], None]
) -> list[dict[str, Any]]:
    """Stop the world (every lock, in order), roll back every dead client's journal, clear
    holders; `report` gets a `lock_dead_holder` finding per lock a dead process held."""
    recovered: list[dict[str, Any]] = []
    taken: list[int] = []
    dead_holders: dict[str, int] = {}
    # A holder named in a lock record we now hold is dead even if /proc still shows it exiting:
    # a live holder clears the record before unlocking, and the kernel unlocks at exit.
    holder_clients: dict[int, int] = {}

    def on_dead(lock: int, pid: int, client: int) -> None:
        dead_holders[lt.names[lock]] = pid
        holder_clients[client] = pid

    c = view.clients
    try:
        for i in range(len(lt.names)):
            lt.acquire(i, recovering=True, on_dead=on_dead)
            taken.append(i)
        # Only while the record still shows the dead holder (attached, its pid).
        held = {
            k
            for k, pid in holder_clients.items()
            if 0 <= k < len(c) and int(c["pid"][k]) == pid and c["state"][k] == ClientState.ATTACHED
        }
        for k in sorted(held | set(dead_clients(view, me))):
            if k != me and int(c["journal_count"][k]):
                j = Journal(view, k)
                n = j.rollback()
                recovered.append({"pid": int(c["pid"][k]), "entries": n, "skipped": j.skipped})
    finally:
        for i in reversed(taken):
            lt.release(i)
    if dead_holders:
        for name, pid in dead_holders.items():
            report(
                Finding(
                    FindingKind.LOCK_DEAD_HOLDER,
                    f"pid {pid} died holding pool lock {name!r}; its unfinished operation was rolled back",
                    owner_pid=pid,
                    extra={"lock": name},
                )
            )
    return recovered


def detach_client(view: SegmentView, t: Txn, c: int, *, dead: bool = False) -> bool:
    """Return up to CHUNK of a client's reserved sequence slots; once none is left, fold its
    counters into the header and mark its record detached (True). The caller holds the seqs
    lock, which guards both, and calls again while this returns False. `dead`: the client's
    process died (its counter is evened)."""
    seqs = view.seqs
    mine = np.flatnonzero((seqs["reserved"] == 1) & (seqs["owner_client"] == c))
    head = seqs.dtype.fields["table"][1]
    for s in mine[:CHUNK].tolist():
        t.journal.save(view.offsets["seqs"] + s * seqs.dtype.itemsize, head)
    seqs["reserved"][mine[:CHUNK]] = 0
    if len(mine) > CHUNK:
        return False
    h = view.header
    for f in COUNTER_FIELDS:
        t.journal.save(h.dtype.fields[f][1], 8)
        h[f] = int(h[f][0]) + int(view.clients[f][c])
    rec = view.offsets["clients"] + c * view.clients.dtype.itemsize
    t.journal.save(rec, 1)
    if dead:
        # A process that died inside an operation left its counter odd: even it, so that no
        # snapshot waits for a writer that will never finish.
        t.journal.save(rec + view.clients.dtype.fields["seq"][1], 8)
        view.clients["seq"][c] += int(view.clients["seq"][c]) % 2
    view.clients["state"][c] = ClientState.DETACHED
    return True


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


class _Gone(Exception):
    """The record no longer holds the dead process a reclaim was for (another reclaimer got
    there first): the step writes nothing and the reclaim of that client ends."""


def reclaim_client(
    view: SegmentView, run: RunAll, store: BlockStore, seqtab: SeqTable, d: DeadClient
) -> dict[str, Any] | None:
    """Return one dead client's blocks, sequences and slots, each step its own transaction
    under every lock; what was done (sequences, blocks, journal entries rolled back, and why
    its journal was skipped, `Journal.problem`), or None when another reclaimer took over the
    record."""
    c = d.client
    seqs, b = view.seqs, view.blocks

    def step(fn: Callable[[Txn], T]) -> T:
        def checked(t: Txn) -> T:
            if not d.still_dead(view):
                raise _Gone
            return fn(t)

        return run(checked)

    def rollback(t: Txn) -> tuple[int, str | None]:
        if not int(view.clients["journal_count"][c]):
            return 0, None
        j = Journal(view, c)
        return j.rollback(), j.skipped

    def mine(s: int) -> bool:
        return (
            int(seqs["state"][s]) != SeqState.EMPTY
            and int(seqs["owner_client"][s]) == c
            and int(seqs["owner_pid"][s]) == d.pid
        )

    def drop_tail(t: Txn, s: int) -> tuple[int, bool]:
        """Drop the last CHUNK blocks of sequence s, releasing it after the last: (blocks
        freed, released); (-1, True) when the slot is no longer that process's."""
        if not mine(s):
            return -1, True
        k = int(seqs["num_blocks"][s])
        keep = max(0, k - CHUNK)
        ids = seqs["table"][s, keep:k].astype(np.int64)
        zero, _ = store.drop(t, ids)
        store.ring_push(t, zero)
        seqtab.write_blocks(t, s, keep, [])
        if keep == 0:
            seqtab.release(t, s)
        return len(zero), keep == 0

    def free_owned(t: Txn) -> int:
        """Return up to 2 * CHUNK of its cached and stray private blocks nobody maps."""
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

    done: dict[str, Any] = {"sequences": 0, "blocks": 0}
    try:
        done["entries"], done["skipped"] = step(rollback)
        live = (seqs["owner_client"] == c) & (seqs["state"] != SeqState.EMPTY)
        for s in np.flatnonzero(live).tolist():
            released = False
            while not released:
                n, released = step(functools.partial(drop_tail, s=s))
                done["blocks"] += max(n, 0)
            done["sequences"] += int(n >= 0)
        while True:
            n = step(free_owned)
            done["blocks"] += n
            if n < CHUNK * 2:
                break
        while not step(functools.partial(detach_client, view, c=c, dead=True)):
            pass
    except _Gone:
        return None
    return done


def reclaim_dead(pool: KVPool, done: list[dict[str, Any]] | None = None) -> dict[str, int]:
    """Return every dead client's blocks (totals); `done` gets one entry per dead process this
    call acted on: pid, sequences, blocks, journal entries rolled back (`skipped`: why its
    journal could not be trusted and was not), and whether it was this call that reclaimed the
    process (`detached`) or another reclaimer finished it."""
    totals = {"processes": 0, "sequences": 0, "blocks": 0}
    # Stop the world once: dead holders' and every dead client's journals rolled back.
    rolled: dict[int, dict[str, Any]] = {}
    for r in recover_dead_holders(pool.locks, pool.view, pool.client, pool.report):
        rolled[r["pid"]] = r
    said = _said_at_exit(pool.view)
    for d in find_dead(pool.view, pool.client):
        got = reclaim_client(
            pool.view, lambda fn: pool._run(pool.ALL, fn), pool.store, pool.seqtab, d
        )
        if got is None:
            continue
        totals["processes"] += 1
        totals["sequences"] += got["sequences"]
        totals["blocks"] += got["blocks"]
        if (got["blocks"] or got["sequences"]) and d.pid not in said:
            pool.report(_reclaimed_finding(d.pid, pool.pid, got))
        if d.pid in rolled:
            r = rolled.pop(d.pid)
            got["entries"] += r["entries"]
            got["skipped"] = got["skipped"] or r["skipped"]
        if done is not None:
            done.append({"pid": d.pid, **got, "detached": True})
    if done is not None:
        for pid, r in rolled.items():
            done.append({**r, "pid": pid, "sequences": 0, "blocks": 0, "detached": False})
    return totals


def _said_at_exit(view: SegmentView) -> set[int]:
    """Processes whose own exit (or pool close) recorded what they still held (leak_finished):
    reclaiming it afterwards is the same cause, not a second finding. Nothing when the ring is
    scribbled over (a record of no known kind): it says nothing then."""
    return {
        f.owner_pid
        for f in readable_findings(view)
        if f.kind == FindingKind.LEAK_FINISHED and f.owner_pid is not None
    }


def _reclaimed_finding(pid: int, me: int, got: dict[str, Any]) -> Finding:
    """What a survivor's reclaim writes into the findings ring: the dead process and what it
    held (the supervisor of a run says a dead worker once, from whichever it sees first)."""
    return Finding(
        FindingKind.LEAK_DEAD_OWNER,
        f"pid {pid} died attached to the pool holding {got['sequences']} sequence(s) and"
        f" {got['blocks']} block(s); pid {me} reclaimed them (pool.reclaim_dead())",
        owner_pid=pid,
    )


def clear_repaired(pool: KVPool, pids: set[int]) -> list[Finding]:
    """After a repair returned what the dead processes `pids` held: mark the recorded findings
    about their leaks and the locks they died holding as repaired, so that a repaired pool
    reads healthy (readers leave them out: allocator/findingset.py); the findings marked."""
    if not pids:
        return []
    fl = pool.locks.index("findings")
    return pool._run({fl}, lambda t: mark_repaired(pool.view, t, pids))


class _Unseen:
    """The client counter of a borrowed record: not bumped (the borrower writes only under
    every pool lock, whose own counters tell readers; the record's dead owner may have left
    its counter odd)."""

    def bump(self) -> None:
        pass


def reclaim_for_attach(
    mf: Any, view: SegmentView, pid: int, start: int, done: list[dict[str, Any]]
) -> int | None:
    """Free a client record for a process attaching to a full client table: reclaim a dead
    client with transactions journaled in that client's own record (the attacher has none
    yet); the record's index, now detached, or None when every attached process is alive.
    The caller holds the registration lock, so no other attach takes the record meanwhile."""
    for d in find_dead(view):
        lt = LockTable(mf, view, pid, start, d.client)
        every = set(range(len(lt.names)))
        shards = [i for i, n in enumerate(lt.names) if n.startswith("index.")]

        def run(
            fn: Callable[[Txn], T], lt: LockTable = lt, d: DeadClient = d, every: set[int] = every
        ) -> T:
            while True:
                try:
                    with Txn(lt, Journal(view, d.client), _Unseen(), every) as t:  # type: ignore[arg-type]
                        return fn(t)
                except DeadHolder:
                    # The record's journal holds only its dead owner's entries outside `run`:
                    # roll it back with the others (me=-1).
                    recover_dead_holders(
                        lt, view, -1, lambda f: run(lambda t: write_finding(view, t, f))
                    )

        store = BlockStore(view, d.client, lt.index("free"), shards)
        # Client -1: a slot it releases goes back to the table, never to a reserve.
        seqtab = SeqTable(view, lt.index("seqs"), -1)
        got = reclaim_client(view, run, store, seqtab, d)
        if got is not None:
            done.append({"pid": d.pid, **got, "detached": True})
            return d.client
        if int(view.clients["state"][d.client]) == ClientState.DETACHED:
            # Another reclaimer finished it; no other attach can take it while we register.
            return d.client
    return None


def _live_refs(view: SegmentView, ids: np.ndarray) -> np.ndarray:
    """References to ids from live sequences (ids of dead owners that someone still maps stay)."""
    seqs = view.seqs
    live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
    return table_refs(seqs, live, len(view.blocks))[ids]
