"""The probes a pool handle runs: flight recorder, ownership sites, guard slots, leak and magic
checks. The pool holds `probe = None` when every one is off, so each hook costs one attribute
check; `kvscope run` turns them on through KVSCOPE_* variables (docs/PROBES.md).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator import integrity
from kvscope.allocator.events import EventOp, EventRecorder, events_for_block, recent_events
from kvscope.allocator.findings import Finding, FindingKind, finding_at
from kvscope.allocator.layout import (
    FINDINGS_CAPACITY,
    HEADER_CHECKSUM_BYTES,
    BlockState,
    header_checksum,
)
from kvscope.allocator.probeflags import ProbeFlags
from kvscope.allocator.sites import SiteTable, caller_site, site_text
from kvscope.allocator.writes import WriteProbes

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool
    from kvscope.allocator.sequence import Sequence
    from kvscope.allocator.txn import Txn


# With the magic probe on, operations re-verify the header at most this often.
VERIFY_EVERY_S = 0.01
# Bits of the C core's probe word (allocator/csrc/core.h P_*): the probes it runs itself.
NATIVE_EVENTS, NATIVE_SITES, NATIVE_LEAKS, NATIVE_MAGIC, NATIVE_SITES_EACH = 1, 2, 4, 8, 16
NATIVE_LOCKDEP = 32
NATIVE_GUARD_SAMPLED, NATIVE_GUARD, NATIVE_DIGEST = 64, 128, 256
NATIVE_SITE_DEPTH_SHIFT = 16  # the frames per site, from this bit up


class PoolProbes:
    """Probe state of one pool handle."""

    def __init__(self, pool: KVPool, flags: ProbeFlags):
        self.pool = pool
        self.flags = flags
        self.recorder = EventRecorder(pool.view, pool.client, pool.pid) if flags.events else None
        self.sites = SiteTable(pool) if flags.ownership else None
        self.header_bytes = pool.view.raw[:HEADER_CHECKSUM_BYTES].tobytes()
        self.reported: set[tuple[str, int, str | None]] = set()
        # verify() runs inside pool operations that verify() itself starts: never recurse.
        self.verifying = False
        self.last_verify = 0.0
        if flags.magic:
            # Every record an operation is about to change is checked first (blocks.py `save`).
            pool.store.verify_hook = self.check_records
        self.writes = WriteProbes(self)

    def native_bits(self) -> int:
        """The probes as the C core's probe word (P_* of allocator/csrc/core.h)."""
        f = self.flags
        sampled = f.guard and self.pool.guard_sample > 1
        bits = NATIVE_EVENTS * f.events + NATIVE_LEAKS * f.leaks + NATIVE_MAGIC * f.magic
        # Guard mode: every release guarded, or (sampled) those of the requests it samples.
        bits |= NATIVE_GUARD_SAMPLED * sampled | NATIVE_GUARD * (f.guard and not sampled)
        bits |= NATIVE_DIGEST * f.digest
        if self.sites is not None:
            bits |= NATIVE_SITES if self.sites.depth == 1 else NATIVE_SITES_EACH
            bits |= self.sites.depth << NATIVE_SITE_DEPTH_SHIFT
        return bits

    # -- flight recorder -----------------------------------------------------------------------

    def event(self, t: Txn, op: EventOp, ids, request: bytes = b"", arg: int = 0) -> None:
        """Record an event when the transaction commits."""
        if self.recorder is not None:
            rec = self.recorder
            ids = np.array(ids, np.int64, copy=True)
            t.after_commit.append(lambda: rec.record(op, ids, request, arg))

    def report(self, f: Finding, rec: np.void | None = None) -> bool:
        """Report a finding once per (kind, block), with the block's last events and the
        allocation site of `rec` (the block's record as the finding saw it; default: now).

        The kinds the C core reports itself are counted once in the core, whichever path
        finds them (its `first_report`); the finding is written into the ring by the core
        (`KVPool.report`)."""
        key = (f.kind, -1 if f.block is None else f.block, f.request if f.block is None else "")
        first = self.pool._core.first_report(f.kind, key[1])
        if first is None:
            first = key not in self.reported
            self.reported.add(key)
        if not first:
            return False
        view = self.pool.view
        if f.block is not None and 0 <= f.block < len(view.blocks):
            f.events = f.events or events_for_block(view, f.block, 8)
            site_id = int((view.blocks[f.block] if rec is None else rec)["site"])
            site = site_text(view, site_id)
            if site:
                f.extra.setdefault("site", site)
                if f.site_id < 0:
                    f.site_id = site_id
        if self.recorder is not None:
            self.recorder.record(
                EventOp.FINDING,
                [-1 if f.block is None else f.block],
                (f.request or "").encode()[:32],
            )
        self.pool.report(f)
        return True

    def block_finding(
        self, kind: str, block: int, message: str, rec: np.void | None = None, **extra
    ) -> Finding | None:
        """Report a finding about one block; owner, request and site come from `rec`, the
        block's own record as it was when the problem was seen (default: the record now).

        A block can change hands between the moment a problem is seen and the report (another
        process allocates a block this one just freed): callers that see it inside a
        transaction pass the record they saw there.
        """
        r = self.pool.view.blocks[block].copy() if rec is None else rec
        req = bytes(r["request"]).decode(errors="replace") or None
        f = Finding(
            kind,
            message,
            block=int(block),
            owner_pid=int(r["owner_pid"]) or None,
            request=req,
            extra=dict(extra),
        )
        return f if self.report(f, rec=r) else None

    def double_end(self, seq: Sequence) -> None:
        """A sequence already freed or aborted is released again (the pool refuses it)."""
        self.report(
            Finding(
                FindingKind.DOUBLE_FREE,
                f"request {seq.request_id!r} was already {seq.state} and is released again at "
                f"{caller_site()}: the pool refused it (PoolError), but the caller frees twice",
                owner_pid=self.pool.pid,
                request=str(seq.request_id)[:32],
            )
        )

    # -- magic -----------------------------------------------------------------------------------

    def verify_often(self) -> None:
        """The header (and conservation) from inside operations, at most every VERIFY_EVERY_S
        (a step's cadence). Where the handle has the C core, the core's own check on the core's
        clock (the one its operations keep: one check per interval, whichever path asks),
        which reports what it finds itself."""
        core = self.pool._native
        if core is not None and core.verify_often(self.pool) is not None:
            if self.pool._found:
                self.pool._hand_findings()
            return
        now = time.monotonic()
        if now - self.last_verify >= VERIFY_EVERY_S:
            self.verify_due()

    def verify_due(self) -> None:
        """The header (and conservation) now: the interval is over."""
        self.last_verify = time.monotonic()
        self._once(self._verify)

    def verify(self) -> list[Finding]:
        """Header magic, version and checksum against the bytes seen at attach (cheap); with
        the leaks probe, block conservation too; in guard mode, every block's canary."""
        self.writes.settle(wait=True)
        return self._once(lambda: self._verify() + self.writes.scan_canaries())

    def _once(self, fn) -> list[Finding]:
        if self.verifying:
            return []
        self.verifying = True
        try:
            return fn()
        finally:
            self.verifying = False

    def check_records(self, t: Txn | None, ids: np.ndarray) -> None:
        """Before an operation changes block records: each must still match its checksum (a
        record something outside the allocator wrote is reported, once, before it is resealed
        over). Records already checked in this transaction are skipped: it may change one in
        steps and save it again."""
        todo = np.atleast_1d(ids).tolist()
        if t is not None:
            seen = t.__dict__.setdefault("checked_records", set())
            todo = [b for b in todo if b not in seen]
            seen.update(todo)
        if not todo:
            return
        b = self.pool.view.blocks
        for blk in self.pool.store.unsealed(todo):
            rec = b[blk].copy()

            def found(blk: int = blk, rec: np.void = rec) -> None:
                self.block_finding(
                    FindingKind.BLOCK_HEADER_CORRUPT,
                    blk,
                    "block record checksum mismatch when the allocator was about to change it: "
                    "its header was overwritten outside the allocator",
                    rec=rec,
                )

            if t is None:
                found()
            else:
                t.after_commit.append(found)

    def _verify(self) -> list[Finding]:
        view = self.pool.view
        now = view.raw[:HEADER_CHECKSUM_BYTES].tobytes()
        if now == self.header_bytes and header_checksum(view.raw) == int(view.h["checksum"]):
            return self.conservation() if self.flags.leaks else []
        diff = (
            next(i for i in range(len(now)) if now[i] != self.header_bytes[i])
            if now != self.header_bytes
            else -1
        )
        field = _field_at(diff)
        found = now[diff : diff + 8].hex() if diff >= 0 else "?"
        want = self.header_bytes[diff : diff + 8].hex() if diff >= 0 else "?"
        f = Finding(
            FindingKind.HEADER_CORRUPT,
            f"segment header changed at byte {diff} ({field}): found {found}, expected {want}; "
            "something outside the allocator wrote into the pool's metadata",
            extra={"offset": diff, "field": field, "found": found, "expected": want},
        )
        if self.recorder is not None:
            f.events = recent_events(view, 8)
        self.report(f)
        return [f]

    # -- leaks at request end ----------------------------------------------------------------------

    def conservation(self) -> list[Finding]:
        """Under the free lock: the ring holds exactly the free blocks, and this process's
        local cache exactly its LOCAL blocks (free + cached + allocated + local == total)."""
        pool = self.pool
        b = pool.view.blocks

        def count(t: Txn) -> tuple[int, int, int, int]:
            st = np.bincount(b["state"], minlength=len(BlockState))
            mine = int(
                ((b["state"] == BlockState.LOCAL) & (b["owner_client"] == pool.client)).sum()
            )
            free = int(st[BlockState.FREE] + st[BlockState.QUARANTINED])
            return free, pool.store.ring_count, mine, int(pool.store.local_count[0])

        free, ring, mine, local = pool._run({pool.FREE}, count)
        out = []
        if free != ring:
            out.append(
                Finding(
                    FindingKind.FREE_LIST_CORRUPT,
                    f"{free} blocks are free but the free ring holds {ring}: blocks were lost or freed twice",
                )
            )
        if mine != local:
            out.append(
                Finding(
                    FindingKind.FREE_LIST_CORRUPT,
                    f"this process has {mine} LOCAL blocks but its local cache lists {local}",
                )
            )
        for f in out:
            self.report(f)
        return out

    def before_release(self, ids: list[int], request: str) -> None:
        """Refcounts of this process's unindexed blocks against its own block tables."""
        if not self.flags.leaks or not ids:
            return
        b = self.pool.view.blocks
        refs = self._mapped()
        for blk in ids:
            if b["indexed"][blk] or b["state"][blk] != BlockState.ALLOCATED:
                continue
            rc = int(b["refcount"][blk])
            if rc != refs[blk]:
                self.block_finding(
                    FindingKind.REFCOUNT_MISMATCH,
                    blk,
                    f"refcount is {rc} but {refs[blk]} sequence(s) of this process map the block (at the end of request {request!r})",
                )

    def _mapped(self) -> Counter[int]:
        """How many of this handle's live sequences map each block (their tables in the
        segment: what the C core counts too)."""
        seqs = self.pool.view.seqs
        refs: Counter[int] = Counter()
        for slot in self.pool.live():
            refs.update(seqs["table"][slot, : int(seqs["num_blocks"][slot])].tolist())
        return refs

    def held_after_release(self, ids: list[int]) -> list[tuple[int, np.void]]:
        """Inside a release's transaction, after its drops: the blocks of `ids` this process
        still holds (its own, unindexed, referenced), with their records as they are now.

        Read here and not after the commit: a block the release freed can be taken by another
        process the moment the locks are released, and would then look held by this one.
        """
        if not self.flags.leaks or not ids:
            return []
        b = self.pool.view.blocks
        arr = np.asarray(ids, np.int64)
        held = arr[
            (b["state"][arr] == BlockState.ALLOCATED)
            & (b["indexed"][arr] == 0)
            & (b["refcount"][arr] > 0)
            & (b["owner_client"][arr] == self.pool.client)
        ]
        return [(int(blk), b[int(blk)].copy()) for blk in np.unique(held).tolist()]

    def after_release(self, held: list[tuple[int, np.void]], request: str) -> None:
        """Blocks a finished request left held (`held_after_release`) that no sequence of this
        process maps: leaked, reported with the record seen inside the release."""
        if not held:
            return
        mapped = self._mapped()
        for blk, rec in held:
            if blk not in mapped:
                self.block_finding(
                    FindingKind.LEAK_FINISHED,
                    blk,
                    f"request {request!r} ended but its block is still allocated (refcount {int(rec['refcount'])}) and no sequence maps it",
                    rec=rec,
                )

    # -- guard mode -----------------------------------------------------------------------------

    def check_guard(self, t: Txn, ids: np.ndarray) -> None:
        """The guard slots of blocks a release frees: one that changed is reported (and its
        canary restored) when the release commits; on a CUDA pool the check is answered later
        (devicechecks.py), as the C core's releases are."""
        later = self.writes.later
        if later is not None:
            later.canaries([int(x) for x in ids])
            return
        from kvscope.kernels import fill_guard

        bad = list(integrity.broken_canaries(self.pool.kv, np.asarray(ids, np.int64)))
        if bad:
            fill_guard(self.pool.kv, blocks=bad)
            t.after_commit.append(lambda: self.report_guard(bad))

    def report_guard(self, bad: list[int], recs: np.ndarray | None = None) -> None:
        """Report guard violations found by check_guard (with the blocks' records as the release
        saw them, `recs`, when they are reported later: devicechecks.py)."""
        for i, blk in enumerate(bad):
            if self.recorder is not None:
                self.recorder.record(EventOp.GUARD_VIOLATION, [blk])
            rec = None if recs is None else recs[i]
            self.block_finding(FindingKind.GUARD_VIOLATION, blk, integrity.CANARY_MESSAGE, rec=rec)

    def poison(self, ids: list[int]) -> None:
        """Fill freed blocks' token slots with NaN so a stale read shows up as NaN attention
        (at commit: blocks the same operation handed out again are left alone)."""
        b = self.pool.view.blocks
        ids = [int(x) for x in ids if b["state"][x] != BlockState.ALLOCATED]
        later = self.writes.later
        if later is not None and ids:
            later.fill(ids)  # (a CUDA pool: the check kernel's fill, as the core's releases)
        else:
            integrity.poison(self.pool.kv, ids, self.pool.block_size)


def ring_findings(view, positions: list[int]) -> list[Finding]:
    """The findings at these positions of the segment's ring (those the C core wrote in a
    call: KVPool._found) as the probe reports its own: with the block's allocation site and
    its last events before the finding (a header_corrupt: the pool's last events); one
    overwritten since is left out."""
    head = int(view.h["findings_head"])
    out = []
    for k in positions:
        if head - k > FINDINGS_CAPACITY:
            continue
        f = finding_at(view, k)
        at = f.extra.pop("time_ns")
        if f.kind == FindingKind.HEADER_CORRUPT:
            f.events = _events_before(view, at)
        elif f.kind == FindingKind.LOCK_DEAD_HOLDER:
            # the lock, as its message names it (csrc/recovery.c)
            f.extra["lock"] = f.message.partition("pool lock '")[2].partition("'")[0]
        elif f.block is not None:
            f.events = _events_before(view, at, f.block)
            site = site_text(view, f.site_id) if f.site_id >= 0 else None
            if site:
                f.extra["site"] = site
        out.append(f)
    return out


def _events_before(view, at_ns: int, block: int | None = None) -> list[dict]:
    """The last 8 events before a finding the C core wrote at at_ns (of one block, or of the
    pool), its own FINDING event, recorded just before it, left out: what the probe lists when
    it reports."""
    ev = view.events.reshape(-1)
    later = ev["time_ns"] >= at_ns
    if block is None:
        got = recent_events(view, 9 + int(later.sum()))
    else:
        later &= ev["block"] == block
        got = events_for_block(view, block, 9 + int(later.sum()))
    got = [e for e in got if e["time_ns"] < at_ns]
    if got and got[-1]["op"] == "finding":
        got.pop()
    return got[-8:]


def _field_at(offset: int) -> str:
    from kvscope.allocator.layout import HEADER_DTYPE

    for name in HEADER_DTYPE.names:
        dt, off = HEADER_DTYPE.fields[name][:2]
        if off <= offset < off + dt.itemsize:
            return name
    return "?"
