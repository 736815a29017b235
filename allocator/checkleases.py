"""The whole-pool check's leases (docs/FORMAT.md section 13, docs/POOL.md "Leases").

Every held lease record holds a lease state and mode, names blocks of the pool (no more than
its record holds), each at the generation it took it in and still held, cached or
QUARANTINED (a leased block that is freed is quarantined, never FREE or in a local cache);
each block's lease count is the number of held leases naming it (a QUARANTINED block with a
count that no lease explains is passed over by the free ring for ever); the section header's
counts are the records'; and each lease's holder is the attached process of the client
record it names, alive (a dead one's leases are reclaimed with its blocks; a lease whose
holder detached or whose record another process took is ended by nothing but
`kvscope check --repair`).
"""

from __future__ import annotations

import numpy as np

from kvscope.allocator.checkreport import Alive, CheckReport, state_name
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.layout import (
    BlockState,
    ClientState,
    LeaseMode,
    LeaseState,
    SegmentView,
    field_text,
)
from kvscope.allocator.records import lease_capacity

REPAIR = "`kvscope check --repair`"


class _Lease:
    """What a finding says of one lease record."""

    def __init__(self, recs: np.ndarray, i: int):
        r = recs[i]
        self.record = i
        self.id = int(r["lease_id"])
        self.pid = int(r["holder_pid"])
        self.holder = field_text(r["holder"])
        self.request = field_text(r["request"]) or None
        self.mode = "write" if int(r["mode"]) == LeaseMode.WRITE else "read"

    @property
    def name(self) -> str:
        return f"{self.mode} lease {self.id} of holder {self.holder!r} (pid {self.pid})"

    def who(self, _block: int) -> tuple[int | None, str | None]:
        return self.pid or None, self.request

    def finding(
        self, kind: FindingKind, message: str, block: int | None = None, **extra: object
    ) -> Finding:
        """A finding about this lease: its holder's pid and request, `extra` beside them."""
        return Finding(
            kind, message, block=block, owner_pid=self.pid or None, request=self.request,
            extra=extra,
        )  # fmt: skip


def check_leases(r: CheckReport, corrupt: np.ndarray, alive: Alive) -> None:
    """The lease section against the blocks and the client table (`corrupt`: block records the
    check judged damaged already, not judged again)."""
    view = r.view
    recs = view.leases
    n = len(view.blocks)
    width = recs["blocks"].shape[1]
    held = np.flatnonzero(recs["state"] != LeaseState.EMPTY)
    leases = {i: _Lease(recs, i) for i in held.tolist()}
    # The entries the core counts (leases.c lease_drop): a held record's first num_blocks, at
    # most its width, inside the pool.
    k = np.minimum(recs["num_blocks"][held].astype(np.int64), width)
    rec_of = np.repeat(held, k)
    col = np.arange(len(rec_of)) - np.repeat(np.cumsum(k) - k, k)
    blk = recs["blocks"][rec_of, col].astype(np.int64)
    gen = recs["generations"][rec_of, col]
    inside = (blk >= 0) & (blk < n)
    _records(r, recs, leases, width, n, blk, inside, rec_of)
    _holders(r, view, leases, alive, blk, inside, rec_of)
    rec_of, blk, gen = rec_of[inside], blk[inside], gen[inside]
    _blocks(r, leases, rec_of, blk, gen, corrupt)
    want = np.bincount(blk, minlength=n)
    _counts(r, leases, rec_of, blk, want, corrupt)
    _header(r, recs, held, len(view.seqs))


def _records(
    r: CheckReport,
    recs: np.ndarray,
    leases: dict[int, _Lease],
    width: int,
    n: int,
    blk: np.ndarray,
    inside: np.ndarray,
    rec_of: np.ndarray,
) -> None:
    """Records no core writes: a state or mode outside its enum, more blocks than the record
    holds, or a block outside the pool (a transfer would read or write outside the KV
    tensor)."""
    for i, lease in leases.items():
        state, mode, k = int(recs["state"][i]), int(recs["mode"][i]), int(recs["num_blocks"][i])
        bad = []
        if state >= len(LeaseState):
            bad.append(f"state {state}, not a lease state (0-{len(LeaseState) - 1})")
        if mode not in (LeaseMode.READ, LeaseMode.WRITE):
            bad.append(f"mode {mode}, neither read (1) nor write (2)")
        if bad:
            r.capped(
                lease.finding(
                    FindingKind.FREE_LIST_CORRUPT,
                    f"lease record {i} ({lease.name}) holds {' and '.join(bad)}: no core writes it",
                )
            )
        if k == 0 or k > width:
            r.capped(
                lease.finding(
                    FindingKind.OUT_OF_BOUNDS,
                    f"{lease.name} claims {k} blocks; its record holds 1 to {width}",
                )
            )
    outside = np.flatnonzero(~inside)
    # (each record's first entry outside, and how many: its entries are in order in rec_of)
    recs_out, first, many = np.unique(rec_of[outside], return_index=True, return_counts=True)
    for i, j, more in zip(recs_out.tolist(), outside[first].tolist(), many.tolist(), strict=True):
        lease = leases[i]
        r.capped(
            lease.finding(
                FindingKind.OUT_OF_BOUNDS,
                f"{lease.name} names block {int(blk[j])}, outside the pool's blocks [0, {n})"
                + (f" ({more} such entries)" if more > 1 else "")
                + ": its transfer reads or writes outside the KV tensor",
            )
        )


def _holders(
    r: CheckReport,
    view: SegmentView,
    leases: dict[int, _Lease],
    alive: Alive,
    blk: np.ndarray,
    inside: np.ndarray,
    rec_of: np.ndarray,
) -> None:
    """Each lease's holder: the attached process of the client record it names (a lease of a
    record detached, or taken over by another process, is released by nothing), alive (a dead
    one's leases go with its blocks at a reclaim)."""
    clients = view.clients
    # (each record's first block inside the pool: its entries are in order in rec_of)
    recs_in, first = np.unique(rec_of[inside], return_index=True)
    first_block = dict(zip(recs_in.tolist(), blk[inside][first].tolist(), strict=True))
    for i, lease in leases.items():
        rec = view.leases[i]
        c, start = int(rec["holder_client"]), int(rec["holder_start"])
        block = first_block.get(i)
        where = f" (block {block} first)" if block is not None else ""
        count = f"{int(rec['num_blocks'])} block(s){where}"
        if not 0 <= c < len(clients):
            why = f"names client record {c}, which does not exist"
        elif int(clients["state"][c]) != ClientState.ATTACHED:
            why = f"names client record {c}, which is detached (closed or reclaimed)"
        elif int(clients["pid"][c]) != lease.pid or int(clients["start"][c]) != start:
            why = f"names client record {c}, which pid {int(clients['pid'][c])} holds now"
        elif not alive(lease.pid, start):
            r.capped(
                lease.finding(
                    FindingKind.LEAK_DEAD_OWNER,
                    f"{lease.name} on {count} is held by pid {lease.pid}, which died; reclaim"
                    f" it with {REPAIR} or pool.reclaim_dead()",
                    block,
                    lease=lease.id,
                )
            )
            continue
        else:
            continue
        r.capped(
            lease.finding(
                FindingKind.LEASE_LEAK,
                f"{lease.name} on {count} {why}: no holder, close or reclaim will release it,"
                f" and its blocks, once freed, stay quarantined; {REPAIR} ends it",
                block,
                lease=lease.id,
            )
        )


def _blocks(
    r: CheckReport,
    leases: dict[int, _Lease],
    rec_of: np.ndarray,
    blk: np.ndarray,
    gen: np.ndarray,
    corrupt: np.ndarray,
) -> None:
    """A leased block is the one its lease took (the same generation: the pool hands a leased
    block out to no one) and is held, cached or QUARANTINED: freed, it is quarantined."""
    state = r.cols.state
    now = r.view.blocks["generation"][blk]
    moved = (now != gen) & ~corrupt[blk]
    freed = ~moved & np.isin(state[blk], (BlockState.FREE, BlockState.LOCAL)) & ~corrupt[blk]
    # (one finding per block: the first lease that names it)
    for mask, what in ((moved, "moved"), (freed, "freed")):
        ids, first = np.unique(blk[mask], return_index=True)
        at = np.flatnonzero(mask)[first]

        def lease_of(b: int, ids: np.ndarray = ids, at: np.ndarray = at) -> tuple[_Lease, int]:
            j = int(at[np.searchsorted(ids, b)])
            return leases[int(rec_of[j])], j

        def message(b: int, what: str = what) -> str:
            lease, j = lease_of(b)
            if what == "moved":
                return (
                    f"{lease.name} took the block at generation {int(gen[j])}; it is at"
                    f" generation {int(now[j])}: it was handed out again while leased, and the"
                    f" transfer {'writes' if lease.mode == 'write' else 'reads'} another"
                    " request's K/V"
                )
            return (
                f"block is {state_name(int(state[b]))} but {lease.name} holds it: a leased"
                " block freed must be QUARANTINED (passed over by every take until its"
                " lease ends), or it is handed out while the transfer runs"
            )

        r.blocks(
            FindingKind.USE_AFTER_FREE,
            ids,
            message,
            lambda b: lease_of(b)[0].who(b),
            lambda b: {"lease": lease_of(b)[0].id},
        )


def _counts(
    r: CheckReport,
    leases: dict[int, _Lease],
    rec_of: np.ndarray,
    blk: np.ndarray,
    want: np.ndarray,
    corrupt: np.ndarray,
) -> None:
    """Each block's lease count against the held leases that name it."""
    counts = r.view.lease_counts.astype(np.int64)
    state = r.cols.state
    wrong = (counts != want) & ~corrupt
    lost = wrong & (want == 0) & (state == BlockState.QUARANTINED)
    r.blocks(
        FindingKind.LEAK_ORPHAN,
        np.flatnonzero(lost),
        lambda b: (
            f"QUARANTINED block has lease count {int(counts[b])} but no lease holds it: the free"
            f" ring passes it over for ever, it is lost until {REPAIR} recounts"
        ),
    )
    order = np.argsort(blk, kind="stable")
    keys = blk[order]

    def first_lease(b: int) -> _Lease | None:
        j = int(np.searchsorted(keys, b))
        return leases[int(rec_of[order[j]])] if j < len(keys) and keys[j] == b else None

    def message(b: int) -> str:
        c, w = int(counts[b]), int(want[b])
        lease = first_lease(b)
        by = f" ({lease.name} first)" if lease is not None else ""
        if c < w:
            why = "a free would not quarantine it while they transfer"
        else:
            why = "freed, it would be quarantined after its leases end"
        return f"lease count is {c} but {w} held lease(s) name the block{by}: {why}"

    def who(b: int) -> tuple[int | None, str | None]:
        lease = first_lease(b)
        return lease.who(b) if lease is not None else (None, None)

    r.blocks(FindingKind.REFCOUNT_MISMATCH, np.flatnonzero(wrong & ~lost), message, who)


def _header(r: CheckReport, recs: np.ndarray, held: np.ndarray, max_seqs: int) -> None:
    """The section header's counts against the records: leases held, quarantined leased
    blocks, the capacity, and the last id handed out."""
    h = r.view.lease_header[0]
    active, quarantined = int(h["active"]), int(h["quarantined"])
    if active != len(held):
        zero = (
            " (0: the free path reads it as no block leased, and gives a leased block freed"
            " back unquarantined)"
            if active == 0
            else ""
        )
        r.add(
            Finding(
                FindingKind.REFCOUNT_MISMATCH,
                f"the lease section's header counts {active} leases held but its table holds"
                f" {len(held)}{zero}; {REPAIR} recounts",
            )
        )
    counts = r.view.lease_counts
    q = int(((r.cols.state == BlockState.QUARANTINED) & (counts > 0)).sum())
    if quarantined != q:
        r.add(
            Finding(
                FindingKind.REFCOUNT_MISMATCH,
                f"the lease section's header counts {quarantined} quarantined leased blocks but"
                f" {q} QUARANTINED blocks have a lease count; {REPAIR} recounts",
            )
        )
    cap = lease_capacity(max_seqs)
    if int(h["capacity"]) != cap:
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"the lease section's header says {int(h['capacity'])} records; the pool's"
                f" table holds {cap}; {REPAIR} sets it",
            )
        )
    ids = recs["lease_id"][held].astype(np.uint64)
    if len(ids) and int(ids.max()) > int(h["next_id"]):
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"the lease section's last id handed out is {int(h['next_id'])} but lease"
                f" {int(ids.max())} is held: a lease taken now could repeat a held lease's id;"
                f" {REPAIR} moves it past",
            )
        )
