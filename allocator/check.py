"""Whole-pool consistency check over a segment view (a live snapshot or a dump), vectorised."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.geometry import geometry_problem
from kvscope.allocator.header import header_corruption
from kvscope.allocator.layout import (
    BLOCK_MAGIC,
    FORMAT_VERSION,
    HEADER_DTYPE,
    POOL_MAGIC,
    BlockState,
    ClientState,
    SegmentView,
    SeqState,
    block_checksums,
    header_checksum,
)
from kvscope.allocator.process import is_alive, process_state
from kvscope.allocator.ranges import check_tables, local_cache

# Per kind, at most this many per-block findings; the rest are summarised in one more.
MAX_PER_KIND = 50
# A pool lock held longer than this is a stall (`lock_held_too_long`); the lock watchdog's
# variable and default.
LOCK_HOLD_ENV = "KVSCOPE_LOCK_HOLD_S"
DEFAULT_LOCK_HOLD_S = 1.0

Alive = Callable[[int, int], bool]
# (pid, request) a finding about a block names instead of the block's own record.
Who = Callable[[int], tuple[int | None, str | None]]


def _req(view: SegmentView, b: int) -> str | None:
    r = bytes(view.blocks["request"][b]).decode(errors="replace")
    return r or None


class _Report:
    def __init__(self, view: SegmentView):
        self.view = view
        self.out: list[Finding] = []
        self.counts: dict[str, int] = {}

    def block(
        self, kind: FindingKind, b: int, message: str, who: Who | None = None, **extra
    ) -> None:
        n = self.counts.get(kind.value, 0)
        self.counts[kind.value] = n + 1
        if n < MAX_PER_KIND:
            blocks = self.view.blocks
            # The owner is the block's own record, unless `who` names the sequence at fault.
            pid, req = who(b) if who is not None else (None, None)
            self.out.append(
                Finding(
                    kind.value,
                    message,
                    block=int(b),
                    owner_pid=pid or int(blocks["owner_pid"][b]) or None,
                    request=req or _req(self.view, b),
                    extra=extra,
                )
            )

    def blocks(
        self,
        kind: FindingKind,
        ids: np.ndarray,
        message: Callable[[int], str],
        who: Who | None = None,
    ) -> None:
        # Only the first MAX_PER_KIND become findings: count the rest without a Python loop.
        room = max(0, MAX_PER_KIND - self.counts.get(kind.value, 0))
        for b in ids[:room].tolist():
            self.block(kind, b, message(b), who)
        if len(ids) > room:
            self.counts[kind.value] = self.counts.get(kind.value, 0) + len(ids) - room

    def add(self, f: Finding) -> None:
        self.out.append(f)

    def finish(self) -> list[Finding]:
        for kind, n in self.counts.items():
            if n > MAX_PER_KIND:
                self.out.append(
                    Finding(
                        kind, f"{n - MAX_PER_KIND} more {kind} findings not listed ({n} in all)"
                    )
                )
        return self.out


def mapper(seqs: np.ndarray, rows: np.ndarray) -> Who:
    """(pid, request) of the first sequence of seqs[rows] whose block table maps a block:
    who still uses a block that should not be used any more."""

    def who(blk: int) -> tuple[int | None, str | None]:
        tables = seqs["table"][rows]
        used = np.arange(tables.shape[1]) < seqs["num_blocks"][rows][:, None]
        hit = np.flatnonzero(((tables == blk) & used).any(axis=1))
        if len(hit) == 0:
            return None, None
        s = int(rows[hit[0]])
        return int(seqs["owner_pid"][s]), bytes(seqs["request"][s]).decode(errors="replace")

    return who


def table_refs(seqs: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """References to each block from the block tables of seqs[rows], in one bincount."""
    tables = seqs["table"][rows]
    used = np.arange(tables.shape[1]) < seqs["num_blocks"][rows][:, None]
    t = tables[used].astype(np.int64)
    return np.bincount(t[(t >= 0) & (t < n)], minlength=n)


def check_header(view: SegmentView, intact: bytes | None = None) -> list[Finding]:
    """Magic, version and checksum of the header; a changed field is named, with the bytes
    found and expected (against the layout the segment was opened with, and `intact`, the
    header's first bytes as last seen intact, when known)."""
    h = view.h
    magic_ok = int(h["magic"]) == POOL_MAGIC
    version_ok = int(h["version"]) == FORMAT_VERSION
    raw = np.asarray(view.raw[: HEADER_DTYPE.itemsize]).tobytes()
    if intact is None:
        intact = getattr(view, "intact_header", None)
    # Even a header that checks can disagree with the layout it was read with (a dump laid
    # out from its saved copy) or with that copy: someone resealed it.
    diff = header_corruption(raw, getattr(view, "layout", None), intact)
    if diff is None and magic_ok and version_ok and header_checksum(view.raw) == int(h["checksum"]):
        return []
    extra: dict = {}
    if diff is not None:
        text = diff.pop("text")
        extra = diff
    elif not magic_ok:
        text = f"header magic is {int(h['magic']):#018x}, expected {POOL_MAGIC:#018x}"
    elif not version_ok:
        text = f"format version {int(h['version'])}, expected {FORMAT_VERSION}"
    else:
        problem = geometry_problem(h)
        text = (
            f"header checksum {int(h['checksum']):#x} does not match its contents"
            f" ({header_checksum(view.raw):#x}): "
            + (
                problem
                or "a field with no saved copy to compare (name, creator, dtype, ...) changed"
            )
        )
    return [
        Finding(
            FindingKind.HEADER_CORRUPT,
            f"{text}: something outside the allocator overwrote the pool's header",
            extra=extra,
        )
    ]


def _state_name(value: int) -> str:
    return BlockState(value).name if value < len(BlockState) else f"state {value}"


def check_view(view: SegmentView, alive: Alive = is_alive) -> list[Finding]:
    """Every invariant of docs/FORMAT.md; returns findings (empty when healthy)."""
    head = check_header(view)
    if head:
        return head
    r = _Report(view)
    b = view.blocks
    n = len(b)
    ids = np.arange(n, dtype=np.int64)
    state = b["state"]

    bad_magic = ids[b["magic"] != BLOCK_MAGIC]
    r.blocks(
        FindingKind.BLOCK_HEADER_CORRUPT,
        bad_magic,
        lambda x: (
            f"block magic is {int(b['magic'][x]):#010x}, expected {BLOCK_MAGIC:#010x}: the block header was overwritten"
        ),
    )
    sums = block_checksums(b, ids)
    bad_sum = ids[(sums != b["checksum"]) & (b["magic"] == BLOCK_MAGIC)]
    r.blocks(
        FindingKind.BLOCK_HEADER_CORRUPT,
        bad_sum,
        lambda x: (
            "block record checksum mismatch: state, refcount, generation or owner was changed outside the allocator"
        ),
    )
    corrupt = np.zeros(n, bool)
    corrupt[bad_magic] = True
    corrupt[bad_sum] = True
    # A record that checks but holds values no allocator writes was resealed by someone else.
    bad_value = ids[
        ((state >= len(BlockState)) | (b["refcount"] < 0) | (b["indexed"] > 1)) & ~corrupt
    ]
    r.blocks(
        FindingKind.BLOCK_HEADER_CORRUPT,
        bad_value,
        lambda x: (
            f"block record holds state {int(state[x])}, refcount {int(b['refcount'][x])}, indexed"
            f" {int(b['indexed'][x])}: no allocator writes these values (states are 0-{len(BlockState) - 1})"
        ),
    )
    corrupt[bad_value] = True

    # Membership: the free ring.
    rh = view.ring_header[0]
    count, head_pos, tail_pos = int(rh["count"]), int(rh["head"]), int(rh["tail"])
    if count > n:
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"free ring count {count} exceeds the {n} blocks of the pool",
            )
        )
        count = n
    elif (tail_pos - head_pos) % 2**64 != count:
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"free ring head {head_pos} and tail {tail_pos} do not span its count {count}",
            )
        )
    # Positions are taken modulo the pool in Python ints: a head near 2**64 must not overflow.
    ring_ids = view.ring[(head_pos % max(n, 1) + np.arange(count)) % max(n, 1)].astype(np.int64)
    oob = (ring_ids < 0) | (ring_ids >= n)
    if oob.any():
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"free ring holds {int(oob.sum())} ids outside [0, {n})",
            )
        )
        ring_ids = ring_ids[~oob]
    in_ring = np.bincount(ring_ids, minlength=n)
    r.blocks(
        FindingKind.DOUBLE_FREE,
        ids[in_ring > 1],
        lambda x: f"block is in the free ring {int(in_ring[x])} times: it was freed more than once",
    )

    # References from live sequences.
    seqs = view.seqs
    live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
    check_tables(r.add, seqs, live, n, MAX_PER_KIND)
    refs = table_refs(seqs, live, n)

    # Dead clients and their blocks.
    clients = view.clients
    dead_clients = {
        int(c)
        for c in np.flatnonzero(clients["state"] == ClientState.ATTACHED)
        if not alive(int(clients["pid"][c]), int(clients["start"][c]))
    }
    of_dead = live[np.isin(seqs["owner_client"][live], list(dead_clients))]
    dead_refs = table_refs(seqs, of_dead, n) if len(of_dead) else np.zeros(n, np.int64)
    owner = b["owner_client"]
    owned_by_dead = np.isin(owner, list(dead_clients)) if dead_clients else np.zeros(n, bool)

    allocated = state == BlockState.ALLOCATED
    freed = (
        (state == BlockState.FREE) | (state == BlockState.LOCAL) | (state == BlockState.QUARANTINED)
    )
    r.blocks(
        FindingKind.DOUBLE_FREE,
        ids[(in_ring == 1) & (allocated | (state == BlockState.CACHED)) & ~corrupt],
        lambda x: (
            f"block is in the free ring but {_state_name(int(state[x]))}: it was freed while still in use"
        ),
    )
    r.blocks(
        FindingKind.USE_AFTER_FREE,
        ids[(refs > 0) & (freed | (state == BlockState.CACHED)) & (in_ring <= 1) & ~corrupt],
        lambda x: (
            f"block is {_state_name(int(state[x]))} but {int(refs[x])} live sequence(s) still map it"
        ),
        mapper(seqs, live),
    )
    in_free_state = (state == BlockState.FREE) | (state == BlockState.QUARANTINED)
    r.blocks(
        FindingKind.FREE_LIST_CORRUPT,
        ids[in_free_state & (in_ring == 0) & ~corrupt],
        lambda x: "block is FREE but not in the free ring: it can never be allocated again",
    )

    # Local caches.
    local_ids = np.zeros(n, bool)
    for c in np.flatnonzero(clients["state"] == ClientState.ATTACHED).tolist():
        loc = local_cache(r.add, clients, c, n)
        local_ids[loc] = True
        wrong = loc[(state[loc] != BlockState.LOCAL) | (owner[loc] != c)]
        r.blocks(
            FindingKind.FREE_LIST_CORRUPT,
            wrong,
            lambda x, c=c: (  # type: ignore[misc]  # mypy cannot infer a lambda with defaults
                f"block is in the local cache of pid {int(clients['pid'][c])} but is {_state_name(int(state[x]))}"
            ),
        )
    stray_local = ids[(state == BlockState.LOCAL) & ~local_ids & ~owned_by_dead & ~corrupt]
    r.blocks(
        FindingKind.FREE_LIST_CORRUPT,
        stray_local,
        lambda x: "block is LOCAL but in no process's local cache",
    )

    # Sequence-slot reserves: only an attached process (alive, or dead until reclaimed) has one.
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

    # Refcounts against references.
    rc = b["refcount"].astype(np.int64)
    alive_refs = refs - dead_refs
    dead_leak = (dead_refs > 0) | (
        owned_by_dead & (allocated | (state == BlockState.LOCAL)) & (alive_refs == 0)
    )
    r.blocks(
        FindingKind.LEAK_DEAD_OWNER,
        ids[dead_leak & ~corrupt],
        lambda x: (
            f"block is held by pid {mapper(seqs, of_dead)(x)[0] or int(b['owner_pid'][x])}, which died; reclaim it with `kvscope check --repair` or pool.reclaim_dead()"
        ),
        mapper(seqs, of_dead),
    )
    orphan = allocated & (refs == 0) & (rc > 0) & ~owned_by_dead & ~corrupt
    r.blocks(
        FindingKind.LEAK_ORPHAN,
        ids[orphan],
        lambda x: (
            f"block has refcount {int(rc[x])} but no sequence maps it: a free was skipped, the block is lost until reclaimed"
        ),
    )
    mismatch = allocated & (refs > 0) & (rc != refs) & ~corrupt
    r.blocks(
        FindingKind.REFCOUNT_MISMATCH,
        ids[mismatch],
        lambda x: f"refcount is {int(rc[x])} but {int(refs[x])} sequence(s) map the block",
    )
    cached_bad = (state == BlockState.CACHED) & ((rc != 0) | (b["indexed"] != 1)) & ~corrupt
    r.blocks(
        FindingKind.REFCOUNT_MISMATCH,
        ids[cached_bad],
        lambda x: (
            f"CACHED block has refcount {int(rc[x])} and indexed={int(b['indexed'][x])} (expected 0 and 1)"
        ),
    )

    # Prefix index against the indexed blocks.
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
    stale = ib[(b["indexed"][ib] != 1) | (b["prefix_hash"][ib] != keys[used])]
    r.blocks(
        FindingKind.USE_AFTER_FREE,
        stale[~corrupt[stale]],
        lambda x: (
            "prefix index names this block but it no longer holds that prefix: a hit would return another prompt's KV"
        ),
    )
    indexed_n = int((b["indexed"] == 1).sum())
    if indexed_n != len(used):
        r.add(
            Finding(
                FindingKind.REFCOUNT_MISMATCH,
                f"{indexed_n} blocks are marked indexed but the prefix index holds {len(used)} entries",
            )
        )

    # Header counters against the blocks.
    n_free = int(((state == BlockState.FREE) | (state == BlockState.QUARANTINED)).sum())
    if count != n_free and not (in_ring > 1).any():
        r.add(
            Finding(
                FindingKind.FREE_LIST_CORRUPT,
                f"free ring count is {count} but {n_free} blocks are FREE",
            )
        )

    # Locks whose holder died, or holds them too long.
    for f in lock_findings(view, alive):
        r.add(f)
    return r.finish()


def lock_hold_threshold_s() -> float:
    """`KVSCOPE_LOCK_HOLD_S` (seconds; 0 turns the stall check off), else the lock watchdog's
    default (probes/watchdog.py, tests/test_pool_stalls.py compares the two)."""
    try:
        return float(os.environ.get(LOCK_HOLD_ENV, "") or DEFAULT_LOCK_HOLD_S)
    except ValueError:
        return DEFAULT_LOCK_HOLD_S


def lock_findings(view: SegmentView, alive: Alive = is_alive) -> list[Finding]:
    """From the lock records: a lock whose holder died (`lock_dead_holder`), and on a live copy
    (one that carries the monotonic time it was taken, `taken_mono_ns`) a lock a live process
    has held longer than `KVSCOPE_LOCK_HOLD_S` (`lock_held_too_long`), with the holder's state.

    A record's `acquired_ns` is the holder's CLOCK_MONOTONIC, comparable with this host's
    clock while it has not rebooted; a dump does not say when it was taken on that clock, so
    stalls are reported on live pools only.
    """
    out = []
    locks = view.locks
    taken_ns = getattr(view, "taken_mono_ns", None)
    limit_ns = int(lock_hold_threshold_s() * 1e9)
    for i in np.flatnonzero(locks["holder_pid"] != 0).tolist():
        pid = int(locks["holder_pid"][i])
        name = bytes(locks["name"][i]).decode(errors="replace")
        if not alive(pid, int(locks["holder_start"][i])):
            out.append(
                Finding(
                    FindingKind.LOCK_DEAD_HOLDER,
                    f"pool lock {name!r} is held by pid {pid}, which died holding it; the next process to take it rolls back its journal",
                    owner_pid=pid,
                    extra={"lock": name},
                )
            )
            continue
        held_ns = (taken_ns or 0) - int(locks["acquired_ns"][i])
        if taken_ns is None or limit_ns <= 0 or int(locks["seq"][i]) % 2 == 0 or held_ns < limit_ns:
            continue
        state = process_state(pid)
        why = {
            "stopped": f"it is stopped (SIGSTOP or a debugger): every process that needs the lock waits until it continues (kill -CONT {pid})",
            "zombie": "it is exiting",
        }.get(
            state,
            f"it is {state or 'gone'}: do not block, sleep or compute long while holding a pool lock",
        )
        out.append(
            Finding(
                FindingKind.LOCK_HELD_TOO_LONG,
                f"pool lock {name!r} held {held_ns / 1e9:.1f} s so far by pid {pid} thread {int(locks['holder_tid'][i])}; {why}",
                owner_pid=pid,
                extra={"lock": name, "held_s": round(held_ns / 1e9, 3), "holder_state": state},
            )
        )
    return out
