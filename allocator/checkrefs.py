"""The whole-pool check's conservation of references: every block's state and refcount against
the live block tables that map it, the blocks of dead processes, the prefix index, and the
sequence slots reserved by processes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvscope.allocator.checkreport import Alive, CheckReport, TableEntries, mapper, state_name
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.layout import BlockState, ClientState, SegmentView, SeqState


@dataclass
class DeadOwners:
    """What processes that died without detaching still hold."""

    # live sequence slots whose owner died, and their tables' entries
    of_dead: np.ndarray
    entries: TableEntries
    # references to each block from those sequences' tables
    refs: np.ndarray
    # blocks whose record names a dead client as owner
    owned: np.ndarray


def dead_owners(
    r: CheckReport, live: np.ndarray, entries: TableEntries, alive: Alive
) -> DeadOwners:
    """The sequences and blocks of clients still attached whose process died (`entries`: the
    tables of the `live` sequences)."""
    view = r.view
    clients, seqs = view.clients, view.seqs
    n = len(view.blocks)
    dead_clients = [
        int(c)
        for c in np.flatnonzero(clients["state"] == ClientState.ATTACHED).tolist()
        if not alive(int(clients["pid"][c]), int(clients["start"][c]))
    ]
    if not dead_clients:
        none = np.zeros(0, np.int64)
        return DeadOwners(none, TableEntries(none, none), np.zeros(n, np.int64), np.zeros(n, bool))
    keep = np.isin(seqs["owner_client"][live], dead_clients)
    of_dead = entries.subset(keep)
    owned = np.isin(r.cols.owner_client, dead_clients)
    return DeadOwners(live[keep], of_dead, of_dead.refs(n), owned)


def check_orphans(r: CheckReport, live: np.ndarray) -> None:
    """Live sequences no handle holds: their owner's client record holds no process of the
    sequence's owner pid (it closed its handle, or detached, without ending them; a record
    reused since holds another process). Each holding blocks is a `leak_finished` by its
    request's own first block, as the close reported it (`merge` keeps one of the two where the
    ring still holds that report), and so is each preempted one, which holds none (no block:
    a request its engine lost while it waited); `kvscope check --repair` ends them."""
    seqs, clients = r.view.seqs, r.view.clients
    owner = seqs["owner_client"][live].astype(np.int64)
    pid = seqs["owner_pid"][live].astype(np.int64)
    known = (owner >= 0) & (owner < len(clients))
    held = np.zeros(len(live), bool)
    held[known] = (clients["state"][owner[known]] == ClientState.ATTACHED) & (
        clients["pid"][owner[known]] == pid[known]
    )
    width = seqs["table"].shape[1]
    for s in live[known & ~held].tolist():
        k = min(int(seqs["num_blocks"][s]), width)
        preempted = int(seqs["state"][s]) == SeqState.PREEMPTED
        if k == 0 and not preempted:
            continue
        request = bytes(seqs["request"][s]).decode(errors="replace")
        what = f"still holds {k} block(s)" if k else "was preempted and neither resumed nor ended"
        r.capped(
            Finding(
                FindingKind.LEAK_FINISHED.value,
                f"request {request!r} {what}, but pid {int(seqs['owner_pid'][s])}"
                " closed the pool without freeing or aborting it: no handle can end it"
                " (`kvscope check --repair` does)",
                block=own_block(r.view.blocks, seqs["table"][s][:k].tolist(), seqs["request"][s]),
                owner_pid=int(seqs["owner_pid"][s]),
                request=request,
            )
        )


def own_block(blocks: np.ndarray, table: list[int], request: bytes) -> int | None:
    """The block a leaked sequence (its `table`, its `request` as the records hold it) is
    reported by, as the core's close reports it: the first its own request allocated (its
    record names that request, and its site is the request's own `allocate`), not a shared
    prefix block another request allocated; else the first naming its request; else the last
    (a fork holding only its parent's blocks). None for an empty table (a preempted
    sequence's: a finding about no block)."""
    if not len(table):
        return None
    ids = [x for x in table if 0 <= x < len(blocks)]
    if not ids:
        return int(table[-1])
    named = [x for x in ids if bytes(blocks["request"][x]) == bytes(request)]
    own = [x for x in named if blocks["indexed"][x] != 1]
    return int((own or named or ids[-1:])[0])


def check_states(
    r: CheckReport,
    live: np.ndarray,
    entries: TableEntries,
    refs: np.ndarray,
    in_ring: np.ndarray,
    corrupt: np.ndarray,
) -> None:
    """A block in the ring but in use (double free), one mapped but free or cached (use after
    free), one FREE but not in the ring (lost)."""
    state = r.cols.state
    allocated = state == BlockState.ALLOCATED
    cached = state == BlockState.CACHED
    free = (state == BlockState.FREE) | (state == BlockState.QUARANTINED)
    r.blocks(
        FindingKind.DOUBLE_FREE,
        np.flatnonzero((in_ring == 1) & (allocated | cached) & ~corrupt),
        lambda x: (
            f"block is in the free ring but {state_name(int(state[x]))}: it was freed while still in use"
        ),
    )
    freed = free | (state == BlockState.LOCAL)
    r.blocks(
        FindingKind.USE_AFTER_FREE,
        np.flatnonzero((refs > 0) & (freed | cached) & (in_ring <= 1) & ~corrupt),
        lambda x: (
            f"block is {state_name(int(state[x]))} but {int(refs[x])} live sequence(s) still map it"
        ),
        mapper(r.view.seqs, live, entries),
    )
    r.blocks(
        FindingKind.FREE_LIST_CORRUPT,
        np.flatnonzero(free & (in_ring == 0) & ~corrupt),
        lambda x: "block is FREE but not in the free ring: it can never be allocated again",
    )


def check_reserves(r: CheckReport, view: SegmentView) -> None:
    """Only an attached process (alive, or dead until reclaimed) holds a sequence-slot reserve."""
    seqs, clients = view.seqs, view.clients
    reserved = np.flatnonzero(seqs["reserved"] == 1)
    holder = seqs["owner_client"][reserved].astype(np.int64)
    ok = (holder >= 0) & (holder < len(clients))
    ok[ok] = clients["state"][holder[ok]] == ClientState.ATTACHED
    if not ok.all():
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"{int((~ok).sum())} sequence slots are reserved by client records that are not attached: no process can use them",
            )
        )


def check_refcounts(
    r: CheckReport, refs: np.ndarray, dead: DeadOwners, corrupt: np.ndarray
) -> None:
    """Refcounts against references: blocks of dead processes, blocks no table maps (orphans),
    counts that disagree, cached blocks still counted."""
    b, seqs = r.view.blocks, r.view.seqs
    state = r.cols.state
    allocated = state == BlockState.ALLOCATED
    rc = r.cols.refcount
    alive_refs = refs - dead.refs
    dead_leak = (dead.refs > 0) | (dead.owned & allocated & (alive_refs == 0))
    # A dead process's local cache (free blocks it kept for its next allocations) goes back
    # with the rest of what it held: one cause, said in the message of its held blocks. It is
    # listed on its own only for a process that held nothing else.
    local = dead.owned & (state == BlockState.LOCAL) & (alive_refs == 0) & ~dead_leak
    owner = r.cols.owner_client
    holding = np.union1d(seqs["owner_client"][dead.of_dead], owner[dead_leak & dead.owned])
    folded = local & np.isin(owner, holding)
    dead_leak |= local & ~folded
    pids = r.view.clients["pid"]
    cached = Counter(int(pids[c]) for c in owner[folded].tolist())
    of_dead = mapper(seqs, dead.of_dead, dead.entries)

    def held_by(x: int) -> str:
        pid = of_dead(x)[0] or int(b["owner_pid"][x])
        if local[x]:
            what = f"block is free in the local cache of pid {pid}, which died"
        else:
            also = f", with {cached[pid]} more free in its local cache" if cached[pid] else ""
            what = f"block is held by pid {pid}, which died{also}"
        return f"{what}; reclaim it with `kvscope check --repair` or pool.reclaim_dead()"

    r.blocks(FindingKind.LEAK_DEAD_OWNER, np.flatnonzero(dead_leak & ~corrupt), held_by, of_dead)
    orphan = allocated & (refs == 0) & (rc > 0) & ~dead.owned & ~corrupt
    r.blocks(
        FindingKind.LEAK_ORPHAN,
        np.flatnonzero(orphan),
        lambda x: (
            f"block has refcount {int(rc[x])} but no sequence maps it: a free was skipped, the block is lost until reclaimed"
        ),
    )
    mismatch = allocated & (refs > 0) & (rc != refs) & ~corrupt
    r.blocks(
        FindingKind.REFCOUNT_MISMATCH,
        np.flatnonzero(mismatch),
        lambda x: f"refcount is {int(rc[x])} but {int(refs[x])} sequence(s) map the block",
    )
    cached_bad = (state == BlockState.CACHED) & ((rc != 0) | (r.cols.indexed != 1)) & ~corrupt
    r.blocks(
        FindingKind.REFCOUNT_MISMATCH,
        np.flatnonzero(cached_bad),
        lambda x: (
            f"CACHED block has refcount {int(rc[x])} and indexed={int(b['indexed'][x])} (expected 0 and 1)"
        ),
    )


def check_index(r: CheckReport, corrupt: np.ndarray) -> None:
    """The prefix index against the indexed blocks: every entry names a block that holds its
    prefix, and every indexed block has an entry."""
    view = r.view
    b = view.blocks
    n = len(b)
    keys = view.index["hash"]
    used = np.flatnonzero(keys != 0)
    ib = view.index["block"][used].astype(np.int64)
    okb = (ib >= 0) & (ib < n)
    bad_entries = used[~okb]
    if len(bad_entries):
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"prefix index has {len(bad_entries)} entries naming blocks outside the pool",
            )
        )
    used, ib = used[okb], ib[okb]
    stale = ib[(r.cols.indexed[ib] != 1) | (b["prefix_hash"][ib] != keys[used])]
    r.blocks(
        FindingKind.USE_AFTER_FREE,
        stale[~corrupt[stale]],
        lambda x: (
            "prefix index names this block but it no longer holds that prefix: a hit would return another prompt's KV"
        ),
    )
    indexed_n = int((r.cols.indexed == 1).sum())
    if indexed_n != len(used):
        r.add(
            Finding(
                FindingKind.REFCOUNT_MISMATCH,
                f"{indexed_n} blocks are marked indexed but the prefix index holds {len(used)} entries",
            )
        )
