"""Replay an operation log (docs/REPLAY.md): re-execute its operations against a fresh pool of
the same geometry, probes and armed faults, in the recorded order (several processes' handles
attached in one process; a process a fault killed in a child of its own, which dies there
too), compare every result with the recorded one and stop at the first divergence or finding;
shrink a run to a minimal one that still finds the same kind (delta debugging over requests,
then operations) and write it as a plain Python script.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvscope.allocator import KVPool, PoolConfig, PoolError, PoolExhausted, faults
from kvscope.allocator.findings import SEVERITY, FindingKind
from kvscope.allocator.kvread import read_live
from kvscope.allocator.layout import BlockState
from kvscope.allocator.oplog import (
    NO_DEADLINE,
    STORE_BLOCKS,
    STORE_KINDS,
    STORE_SLOTS,
    OpLog,
    OplogError,
    OpRecord,
    from_creation,
)
from kvscope.allocator.probeflags import ProbeFlags
from kvscope.allocator.probing import PoolProbes
from kvscope.allocator.records import OpCode, OpStatus
from kvscope.allocator.sequence import SEQ_ID_BATCH

_ALLOCATE, _APPEND, _FORK, _MARK = (
    int(OpCode.ALLOCATE),
    int(OpCode.APPEND),
    int(OpCode.FORK),
    int(OpCode.MARK_COMPUTED),
)
_FREE, _ABORT, _SET_STATE, _RESUME = (
    int(OpCode.FREE),
    int(OpCode.ABORT),
    int(OpCode.SET_STATE),
    int(OpCode.RESUME),
)
_EVICT, _REPORT, _START, _LOST = (
    int(OpCode.EVICT),
    int(OpCode.REPORT),
    int(OpCode.START),
    int(OpCode.LOST),
)
_LEASE, _LEASE_RELEASE, _EXPIRE = (
    int(OpCode.LEASE),
    int(OpCode.LEASE_RELEASE),
    int(OpCode.EXPIRE_LEASES),
)
_LEASE_OPS = (_LEASE, _LEASE_RELEASE, _EXPIRE)
_STORE = int(OpCode.STORE)
_SNAPSHOT = int(OpCode.SNAPSHOT)
_CLOSE = int(OpCode.CLOSE)
_COPY = int(OpCode.COPY)
_FLUSH = int(OpCode.FLUSH)
_MARKS = (_START, _SNAPSHOT)  # (records that are no operation: a handle's start, a snapshot)
_OK, _EXHAUSTED, _REFUSED, _ERROR = (int(s) for s in OpStatus)
_STATES = {1: "running", 2: "waiting"}
# Kinds the magic probe finds on its own clock (every 10 ms, in whichever operation comes then,
# and at `pool.verify()`): a replay, faster than the recording, runs that check at the
# operation where the recording found one (and a shrink's runs after every operation). A lock
# a dead process held is recovered (`lock_dead_holder`) by the first operation that takes it,
# the magic probe's check of the free list among them: on its clock too.
CADENCED = {"header_corrupt", "free_list_corrupt", "lock_dead_holder"}
# Kinds a handle reports as it closes (a sequence or a lease its process never ended): a
# report of one is replayed as that handle's close.
AT_CLOSE = {"leak_finished", "lease_leak"}
# Faults that kill the process they strike: a recorded process one killed is replayed in a
# child process of its own (Child), which the fault kills there too.
KILLING = ("kill-holding-lock",)
# Kinds found by a call that is no recorded operation, recorded as a REPORT (csrc/oplog.c
# oplog_found_report): a report of one is replayed as that call. `reclaim_dead` (a dead
# process's locks recovered, its blocks reclaimed) and the provenance sweep
# (`check_provenance`).
RECLAIMED = {"lock_dead_holder", "leak_dead_owner"}
SWEPT = {"foreign_slot"}
# The block-table audit of a host table (`audit_block_table`), whose REPORT holds its input
# (`audit_input`).
AUDITED = {"block_table_mismatch"}


_NONE: list[Any] = []  # (shared by every Result that has none: never mutated)


class Result:
    """What one operation gave: the fields a record compares."""

    __slots__ = (
        "status",
        "seq_id",
        "result",
        "blocks",
        "copies",
        "preempted",
        "found",
        "fault",
        "error",
        "lease",
    )

    def __init__(
        self,
        status: int = _OK,
        seq_id: int = -1,
        result: int = 0,
        blocks: list[int] = _NONE,
        copies: list[tuple[int, int]] = _NONE,
        preempted: list[int] = _NONE,
        found: list[tuple[str, int]] = _NONE,
        fault: str = "",
        error: str = "",
        lease: tuple[int, list[int]] | None = None,
    ):
        self.status = status
        self.seq_id = seq_id
        self.result = result
        self.blocks = blocks
        self.copies = copies
        self.preempted = preempted
        self.found = found
        self.fault = fault
        self.error = error
        # a lease's take: the record it got and its blocks' generations then
        self.lease = lease

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "status": OpStatus(self.status).name.lower(),
            "seq_id": self.seq_id,
            "result": self.result,
            "blocks": self.blocks,
            "copies": [list(c) for c in self.copies],
            "preempted": self.preempted,
            "found": [{"kind": k, "block": b} for k, b in self.found],
        }
        if self.fault:
            d["fault"] = self.fault
        if self.error:
            d["error"] = self.error
        if self.lease is not None:
            d["lease"] = {"record": self.lease[0], "generations": self.lease[1]}
        return d


def recorded_result(r: OpRecord) -> Result:
    """A record's results, as a Result."""
    return Result(
        status=r.status,
        seq_id=r.seq_id,
        result=r.result,
        blocks=r.blocks,
        copies=r.copies,
        preempted=r.preempted,
        found=r.found,
        fault="fault" if r.fault else "",
        lease=_taken(r),
    )


def _taken(r: OpRecord) -> tuple[int, list[int]] | None:
    """A LEASE record's lease: the record it got and its blocks' generations."""
    if r.op != _LEASE or r.lease is None:
        return None
    return (r.lease.record, r.lease.generations)


def differences(r: OpRecord, got: Result) -> list[str]:
    """The fields where a replayed operation's results differ from the recorded ones."""
    if (
        r.status == got.status
        and r.blocks == got.blocks
        and r.result == got.result
        and r.seq_id == got.seq_id
        and r.copies == got.copies
        and not r.found
        and not got.found
        and not r.preempted
        and not got.preempted
        and not r.flags & 1
        and not got.fault
        and got.lease is None
    ):
        return []  # (the common case, compared at once)
    out = []
    if r.status != got.status:
        out.append("status")
    op = r.op
    if op in (_ALLOCATE, _FORK, _RESUME) and r.status == _OK and r.seq_id != got.seq_id:
        out.append("seq_id")
    if op in (_ALLOCATE, _MARK, _RESUME, _EVICT, _CLOSE, *_LEASE_OPS) and r.result != got.result:
        out.append("result")
    if op == _LEASE and r.status == _OK and _taken(r) != got.lease:
        out.append("lease")
    if op != _REPORT and r.blocks != got.blocks:
        out.append("blocks")
    if r.copies != got.copies:
        out.append("copies")
    if sorted(r.preempted) != sorted(got.preempted):
        out.append("preempted")
    if op == _REPORT and not all(k in STORE_KINDS for k, _ in r.found):
        if {k for k, _ in r.found} - {k for k, _ in got.found}:
            out.append("found")
    elif sorted(r.found) != sorted(got.found):
        out.append("found")
    if r.fault != bool(got.fault):
        out.append("fault")
    return out


class ReplayError(PoolError):
    """A log that cannot be replayed (exit 2)."""


class Session:
    """A fresh pool rebuilt from a log's start record, with one handle per recorded process,
    and the sequences its operations made (by (pid, recorded seq id))."""

    def __init__(self, log: OpLog, name: str | None = None, arm: bool = True):
        start = log.start.start or {}
        self.start = start
        if not from_creation(start) and log.snapshot is None:
            how = "had a history" if start.get("created") else "its first recorder attached to"
            raise ReplayError(
                f"{log.path}: the log begins at operation {start.get('op_seq', '?')} of pool "
                f"{start.get('pool')!r}, which {how}, and holds no snapshot of it (a redacted "
                "recording writes none): there is no start state to replay from"
            )
        # the processes a fault killed (the record of the operation each died in names it):
        # each replayed in a child process of its own
        self.dying = {
            r.pid for r in log.records if r.faults and any(f in KILLING for f in r.fault_names)
        }
        if int(start.get("pid", log.start.pid)) in self.dying:
            raise ReplayError(
                f"{log.path}: the process that created pool {start.get('pool')!r} was killed "
                "by the fault it armed (kill-holding-lock): a replay runs a killed process in "
                "a child of its own only where another process created the pool (record a run "
                "whose workers attach to it: examples/serve.py --workers 2)"
            )
        self.children: dict[int, Child] = {}
        cfg = dict(start.get("config") or {})
        try:
            self.config = PoolConfig(**cfg, device="cpu")
        except TypeError as e:
            raise ReplayError(f"{log.path}: the start record's geometry is not one: {e}") from None
        self.name = name or f"kvscope-replay-{os.getpid()}-{id(self) & 0xFFFFFF:x}"
        self.handles: dict[int, KVPool] = {}
        self.seqs: dict[tuple[int, int], Any] = {}
        self.found: list[tuple[str, int]] = []
        # what each process's handle reported as the replay closed it (by recorded pid)
        self.closed: dict[int, list[tuple[str, int]]] = {}
        # the requests whose sequences still held blocks there, and whose leases it still held
        self.held: dict[int, set[str]] = {}
        self.lease_held: dict[int, set[str]] = {}
        # what each process's close returned (its local cache's blocks, its reserve's slots)
        self.returned: dict[int, tuple[list[int], int]] = {}
        self._leaked: set[str] = set()  # (the requests of the lease_leaks found, as they come)
        self.preempted: set[tuple[int, int]] = set()
        # the leases taken, by their recorded ids (a lease id is the pool's, any process's)
        self.leases: dict[int, Any] = {}
        # the write leases among them not known released yet (_transfers_before_release reads
        # them at every free; a released one leaves at the next)
        self._writing: dict[int, Any] = {}
        # the store checks: the findings of each thread's last one, not yet matched with the
        # REPORT records that follow it (by (pid, tid)); the writers of the stores whose
        # blocks were checked, for their slots (by the STORE record's number)
        self.stored: dict[tuple[int, int], list[tuple[str, int]]] = {}
        self.writers: dict[int, Any] = {}
        self.store_reports = log.store_reports()
        # the recorded stores and copies applied to the replay's K/V (OpLog.replays_kv, asked
        # at the first STORE or COPY: a log of neither is not scanned for it); the values each
        # STORE wrote (by its number: its slots and their values), for a script
        self.log = log
        self.kv_writes: dict[int, tuple[list[int], list[float]]] = {}
        # whether write leases' transfers are taken as written (transfer_kv): where the replay
        # writes its K/V and the program stores K/V (a STORE record); None: not asked yet
        self._transfers: bool | None = None
        self._bare: dict[int, PoolProbes] = {}  # (by pid: a store check's probes where none)
        # A free run's (a shrink candidate's) blocks: what block of this replay each recorded
        # block id stands for now (relearn), so that a STORE's recorded slots and a COPY's
        # recorded pairs land in the blocks their requests hold here, not in whatever block
        # has the recorded id after earlier requests were dropped. None: a replay of the whole
        # log, whose blocks are the recorded ones (compared, not translated).
        self.reloc: dict[int, int] | None = None
        # what each STORE's check was given and each COPY copied in this run (by the record's
        # number): a free run's, translated, for the script of a shrunk one
        self.store_slots: dict[int, list[int]] = {}
        self.copy_pairs: dict[int, list[tuple[int, int]]] = {}
        self.fired: list[str] = []
        self._armed = dict(faults.ARMED)
        faults.ARMED.clear()
        if arm:
            faults.ARMED.update(start.get("faults") or {})
        self._hook = self.fired.append
        faults.ON_FIRE.append(self._hook)
        # the processes whose sequence ids are not known yet (a snapshot's other than its
        # writer's: their cores held them), by recorded pid
        self.ids_unknown: set[int] = set()
        try:
            if log.snapshot is not None:
                pool = KVPool.restore(self.name, self.config, log.snapshot)
            else:
                pool = KVPool.create(self.name, self.config)
        except PoolError as e:
            self._restore()
            raise ReplayError(f"{log.path}: {e}") from None
        except BaseException:
            self._restore()
            raise
        self.pool = pool
        self._setup(pool, start)
        self.handles[int(start.get("pid", log.start.pid))] = pool
        if log.snapshot is not None:
            try:
                self._adopt(log)
            except BaseException:
                self.close()
                raise

    def _adopt(self, log: OpLog) -> None:
        """A pool restored from the log's snapshot: a handle for each process it shows
        attached (the writer's is the pool's), each taking over that process's client record,
        live sequences (by their recorded ids) and leases (by theirs), and the writer's slot
        reserve and sequence ids; the others' ids are learnt from their first new sequence."""
        from kvscope.allocator import checkpoint

        snap = log.snapshot
        pool = self.pool
        for client, pid in checkpoint.attached(snap):
            if client == snap.client:
                h = pool
                slots, next_id, end_id = snap.meta["reserve"]
                reserve: Any = (list(slots), int(next_id), int(end_id))
            else:
                try:
                    h = KVPool.attach(self.name, client=client)
                except PoolError as e:
                    raise ReplayError(f"{log.path}: {e}") from None
                self._setup(h, log.starts.get(pid, self.start))
                reserve = None
                self.ids_unknown.add(pid)
            self.handles.setdefault(pid, h)
            try:
                seqs, leases = h.adopt_restored(reserve)
            except (PoolError, ValueError) as e:
                raise ReplayError(f"{log.path}: the snapshot cannot be restored: {e}") from None
            for q in seqs:
                self.seqs[(pid, q.seq_id)] = q
            for lease in leases:
                self._took(lease.lease_id, lease)

    def _setup(self, pool: KVPool, start: dict[str, Any]) -> None:
        flags = start.get("probes")
        pool.probe = PoolProbes(pool, ProbeFlags(**flags)) if flags else None
        if start.get("guard_sample", 0) > 1:
            pool.guard_sample = int(start["guard_sample"])
        # slot provenance as the recorded handle sampled it (a log from before the key: as
        # the environment says, as before)
        if "provenance_sample" in start:
            pool.provenance_sample = int(start["provenance_sample"])
        if start.get("lockdep"):
            pool.trace_locks(True)
        pool.on_finding = self._on_finding

    def _on_finding(self, f: Any) -> None:
        kind = f.kind.value if isinstance(f.kind, FindingKind) else str(f.kind)
        self.found.append((kind, -1 if f.block is None else int(f.block)))
        if kind == "lease_leak":
            self._leaked.add(str(f.request))

    def attach(self, r: OpRecord) -> None:
        """A START of another process: a handle of its own on the replay pool (in a child
        process of its own where a fault killed the process)."""
        if r.pid in self.handles or r.pid in self.children:
            return
        if r.pid in self.dying:
            self.children[r.pid] = Child(self, r)
            return
        h = KVPool.attach(self.name)
        self._setup(h, r.start or {})
        self.handles[r.pid] = h

    def become(self, r: OpRecord) -> KVPool:
        """In a Child's process (a fork of the replay's): the handle of the recorded process
        of START r, attached and set up as r says, the only one this copy of the session runs
        (the replay's handles are not this process's)."""
        h = KVPool.attach(self.name)
        self._setup(h, r.start or {})
        self.handles = {r.pid: h}
        self.children = {}
        return h

    def _restore(self) -> None:
        faults.ARMED.clear()
        faults.ARMED.update(self._armed)
        with contextlib.suppress(ValueError):
            faults.ON_FIRE.remove(self._hook)

    def close(self) -> None:
        try:
            for c in reversed(list(self.children.values())):
                c.close()
            for h in reversed(list(self.handles.values())):
                with contextlib.suppress(Exception):
                    h.close()
                # (each handle hands its findings to this session, which holds the handle: the
                # cycle let go, a closed pool's mappings go with its last reference, not at the
                # collector's next pass: a shrink's thousand runs held 24 GB of them)
                h.on_finding = None
            with contextlib.suppress(Exception):
                self.pool.unlink()
        finally:
            self._restore()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close(self, h: KVPool, pid: int) -> None:
        """Close process `pid`'s handle, once: what it returned to the pool (the blocks of
        its local cache, in the cache's order, and its slot reserve's slots, as the core's
        CLOSE record lists them) and the leases it still held (its lease_leaks) kept."""
        returned = _local_cache(h)
        slots = len(h.core.reserve_state()[0])
        self._leaked = set()
        h.close()
        self.returned[pid] = (returned, slots)
        self.lease_held[pid] = self._leaked
        self.closed[pid] = list(self.found)

    def _lease(self, h: KVPool, r: OpRecord, s: Any, out: Result) -> None:
        """A LEASE record's take, with the recorded mode, holder and deadline, on its sequence
        (or the recorded block ids)."""
        part = r.lease
        assert part is not None
        target = s if s is not None else list(r.blocks)
        if part.deadline_ns == NO_DEADLINE:
            lease = h.lease(target, part.mode, holder=part.holder, timeout=None)
        else:
            lease = h.lease(target, part.mode, holder=part.holder, deadline_ns=part.deadline_ns)
        self._took(part.lease_id, lease)
        out.result = lease.lease_id
        out.blocks = list(lease.blocks)
        rec = h.view.leases[lease.record]
        out.lease = (lease.record, [int(g) for g in rec["generations"][: len(out.blocks)]])

    def _store(self, h: KVPool, r: OpRecord) -> Result | None:
        """A STORE record's store check (probes/stores.py Writers), on the replayed sequences
        with the recorded spans and slots: the spans of sequences this replay does not have
        dropped (their slots too), None where none is left. Its findings are kept for the
        REPORT records that follow it on its thread."""
        from kvscope.probes.stores import Writers

        part = r.store
        if part is None:
            return None
        spans, slots = store_spans(part, lambda sid: self.seqs.get((r.pid, sid)))
        if not spans:
            return None
        slots = self._here(slots, h.slots_per_block)
        self.store_slots[r.seq] = slots
        out = Result(seq_id=spans[0][0].seq_id)
        found = self.found
        found.clear()
        probe = h.probe
        if probe is None:
            # (the recording's handle had probes at its stores, turned on after its START: the
            # check runs under probes that change nothing the core does)
            h.probe = self._bare.setdefault(r.pid, PoolProbes(h, ProbeFlags()))
        try:
            if part.what & STORE_BLOCKS and part.what & STORE_SLOTS:
                Writers(h, spans).check(slots)
            elif part.what & STORE_BLOCKS:
                w = self.writers[r.seq] = Writers(h, spans)
                w.check_blocks()
            else:
                w = self.writers.pop(part.ref, None)
                if w is None or len(w.spans) != len(spans):
                    w = Writers(h, spans)
                w.check_slots(slots)
        except Exception as e:  # (a store the check could not make)
            out.status = _ERROR
            out.error = f"{type(e).__name__}: {e}"
        finally:
            if probe is None:
                h.probe = None
        out.found = list(found)
        self.stored[(r.pid, r.tid)] = list(found)
        if part.what & STORE_SLOTS and out.status == _OK and self.log.replays_kv():
            # (after its check, as store_kv checks, then writes)
            values = kv_values(spans, slots)
            write_kv(h, slots, values)
            self.kv_writes[r.seq] = (slots, values)
        return out

    def relearn(self, r: OpRecord, got: Result) -> None:
        """In a free run, each block an operation's record names and the one the replay's
        operation gave in its place (the tables or blocks, position by position; a
        copy-on-write's pairs), as `reloc` keeps them."""
        reloc = self.reloc
        if reloc is None:
            return
        if r.blocks and len(r.blocks) == len(got.blocks):
            reloc.update(zip(r.blocks, got.blocks))
        if r.copies and len(r.copies) == len(got.copies):
            for (a, b), (c, d) in zip(r.copies, got.copies):
                reloc[a], reloc[b] = c, d

    def _here(self, slots: list[int], spb: int) -> list[int]:
        """Recorded slots as this free run's (reloc): each in the block that stands for its
        recorded block, at the same place; as recorded in a whole replay."""
        reloc = self.reloc
        if not reloc:
            return slots
        return [x if x < 0 else reloc.get(x // spb, x // spb) * spb + x % spb for x in slots]

    def transfers(self) -> bool:
        """Whether a write lease's transfer is taken as written (transfer_kv): where the replay
        writes its K/V (OpLog.replays_kv) and the program stores K/V (a STORE record: a
        program that writes none, whose finish checks find nothing, is left so)."""
        if self._transfers is None:
            self._transfers = self.log.replays_kv() and any(
                r.op == _STORE for r in self.log.records
            )
        return self._transfers

    def _transfers_before_release(self, h: KVPool, blocks: list[int]) -> None:
        """A request released while write leases of this replay's still hold its blocks (a
        transfer into them not yet completed): the transfers' K/V, which the log does not
        hold, is taken as written before the release (transfer_kv into the blocks both hold),
        as the release's finish check in the recording found it; where transfers are not taken
        as written (`transfers`), nothing."""
        if not self.transfers():
            return
        mine = set(blocks)
        for lid, lease in list(self._writing.items()):
            if lease.released:
                del self._writing[lid]
                continue
            both = [b for b in lease.blocks if b in mine]
            if both:
                transfer_kv(h, both)

    def _took(self, lease_id: int, lease: Any) -> None:
        """A lease the replay holds, by its recorded id (a write lease also among those whose
        transfers a release takes as written)."""
        self.leases[lease_id] = lease
        if lease.mode == "write":
            self._writing[lease_id] = lease

    def _copy(self, h: KVPool, r: OpRecord) -> Result:
        """A COPY record: the blocks the program copied, copied in the replay's K/V (the
        recorded block ids, as the recorded slots of a store), and their check under the
        probes (`KVPool.copied`), whose findings are kept for the REPORT records that follow
        it on its thread, as a store check's."""
        out = Result(copies=r.copies)
        reloc = self.reloc or {}
        pairs = [(reloc.get(a, a), reloc.get(b, b)) for a, b in r.copies]
        found = self.found
        found.clear()
        if h.probe is not None and pairs:
            h.copied([a for a, _ in pairs], [b for _, b in pairs])
        out.found = list(found)
        self.stored[(r.pid, r.tid)] = list(found)
        if self.log.replays_kv():
            self.copy_pairs[r.seq] = pairs
            try:
                copy_kv(h, pairs)
            except Exception as e:  # (a pair out of the pool's range)
                out.status = _ERROR
                out.error = f"{type(e).__name__}: {e}"
        return out

    def run(self, r: OpRecord, verify: bool = False) -> Result | None:
        """Execute one record's operation on its process's handle. None where the record
        names a process or sequence this replay does not have (a shrunk run's operations on
        the requests it removed). Sequences are found by their recorded ids."""
        op = r.op
        if op == _START:
            self.attach(r)
            return None
        if op == _SNAPSHOT:
            return None
        if op == _LOST:
            return None
        h = self.handles.get(r.pid)
        if h is None:
            child = self.children.get(r.pid)
            return None if child is None else child.run(self, r, verify)
        out = Result()
        found = self.found
        found.clear()
        nfired = len(self.fired)
        seqs = self.seqs
        s: Any = None
        lease: Any = None
        if op in _LEASE_OPS:
            if op == _LEASE and r.seq_id >= 0:
                s = seqs.get((r.pid, r.seq_id))
                if s is None:
                    return None
            elif op == _LEASE_RELEASE:
                lease = self.leases.get(r.lease.lease_id if r.lease else 0)
                if lease is None:
                    return None
        elif op == _STORE:
            return self._store(h, r)
        elif op == _COPY:
            return self._copy(h, r)
        elif op == _REPORT and r.seq in self.store_reports:
            # a store check's finding: the one the replayed check made, in its order
            pending = self.stored.get((r.pid, r.tid), [])
            mine = r.found[0] if r.found else None
            if pending:
                found[:] = [pending.pop(pending.index(mine) if mine in pending else 0)]
                out.found = list(found)
            return out
        elif op not in (_ALLOCATE, _EVICT, _REPORT, _CLOSE, _FLUSH):
            s = seqs.get((r.pid, r.src_id if op in (_FORK, _RESUME) else r.seq_id))
            if s is None:
                return None
        if self.ids_unknown and r.pid in self.ids_unknown and r.seq_id > 0 and r.status == _OK:
            if op in (_ALLOCATE, _FORK, _RESUME):
                # (its process's core held its sequence ids: its batch, from this one's id)
                batch = SEQ_ID_BATCH
                h.adopt_ids(r.seq_id, r.seq_id + batch - (r.seq_id - 1) % batch)
                self.ids_unknown.discard(r.pid)
        preemptions = h.counters["num_preemptions"]
        pre0 = preemptions[0]
        try:
            if op == _ALLOCATE:
                s = h.allocate(r.request, r.tokens)
                seqs[(r.pid, r.seq_id)] = s
                out.seq_id = s.seq_id
                out.result = s.num_cached_tokens
                out.blocks = list(s.block_table)
            elif op == _APPEND:
                out.seq_id = s.seq_id
                out.copies = h.append(s, r.tokens)
                out.blocks = list(s.block_table)
            elif op == _MARK:
                out.seq_id = s.seq_id
                out.result = h.mark_computed(s, r.arg)
            elif op == _FREE or op == _ABORT:
                out.seq_id = s.seq_id
                out.blocks = list(s.block_table)
                self._transfers_before_release(h, out.blocks)
                if op == _FREE:
                    h.free(s)
                else:
                    h.abort(s)
            elif op == _FORK:
                c = h.fork(s, r.request)
                seqs[(r.pid, r.seq_id)] = c
                out.seq_id = c.seq_id
                out.blocks = list(c.block_table)
            elif op == _SET_STATE:
                out.seq_id = s.seq_id
                h.set_state(s, _STATES.get(r.arg, "unknown"))
            elif op == _RESUME:
                out.result = h.resume(s)
                seqs[(r.pid, r.seq_id)] = s
                out.seq_id = s.seq_id
                out.blocks = list(s.block_table)
            elif op == _EVICT:
                out.result = h.evict(r.arg)
            elif op == _LEASE:
                out.seq_id = -1 if s is None else s.seq_id
                self._lease(h, r, s, out)
            elif op == _LEASE_RELEASE:
                out.seq_id = r.seq_id
                blocks = list(lease.blocks)
                out.result = int(h.lease_release(lease))
                out.blocks = blocks if out.result else []
                late = any(k == FindingKind.TRANSFER_AFTER_FREE for k, _ in found)
                if lease.mode == "write" and out.result and not late and self.transfers():
                    transfer_kv(h, blocks)
            elif op == _EXPIRE:
                # (the recorded now_ns, compared with the recorded deadlines: not the clock)
                out.result = h.expire_leases(r.arg)
            elif op == _REPORT and any(k in AT_CLOSE for k, _ in r.found):
                # a leak the recording's handle reported as it closed: the close, replayed
                # once (its other reports then), after the process's last operation
                if r.pid not in self.closed:
                    # (the close: its sequences' leaks, as it aborts them, and its leases')
                    self.held[r.pid] = {
                        str(q.request_id) for q in h.live().values() if q.block_table
                    }
                    self._close(h, r.pid)
                found[:] = self.closed[r.pid]
            elif op == _CLOSE:
                # a handle's close (its leaks' REPORTs before it closed it already: what they
                # found is theirs): the local cache and slot reserve it returned compared
                if r.pid not in self.closed:
                    self._close(h, r.pid)
                else:
                    found.clear()
                out.blocks, out.result = self.returned[r.pid]
                # (its process may attach again: a later START of its pid, a handle of its own)
                self.handles.pop(r.pid, None)
            elif op == _FLUSH:
                # the local cache returned to the free ring (pool.flush_local): its blocks
                out.blocks = _local_cache(h)
                h.flush_local()
            elif op == _REPORT and any(k in RECLAIMED for k, _ in r.found):
                # a dead process's locks and blocks, recovered by `reclaim_dead` there
                h.reclaim_dead()
            elif op == _REPORT and any(k in SWEPT for k, _ in r.found):
                # the provenance sweep (the handle's live sequences)
                h.check_provenance()
            elif op == _REPORT and is_audit(r):
                # the block-table audit of the recorded table, its rows the replayed sequences
                ids, lengths, table = audit_input(r)
                if any((r.pid, i) not in seqs for i in ids):
                    return None
                rows = [seqs[(r.pid, i)] for i in ids]
                h.audit_block_table(table, rows=rows, lengths=lengths, padding=r.result)
            elif op == _REPORT:
                # a finding reported between operations: the check that reports it, now
                h.verify()
        except PoolExhausted as e:
            out.status = _EXHAUSTED
            out.error = str(e)
        except PoolError as e:
            out.status = _REFUSED
            out.error = str(e)
        except Exception as e:  # (recorded as ERROR: a TypeError, an OSError, a bug)
            out.status = _ERROR
            out.error = f"{type(e).__name__}: {e}"
        if op == _RESUME and out.status != _OK and s is not None:
            out.seq_id = s.seq_id
            out.blocks = list(s.block_table)
        elif op == _APPEND and out.status != _OK and s is not None:
            out.blocks = list(s.block_table)
        elif op == _LEASE and out.status != _OK:
            out.blocks = list(r.blocks) if s is None else []  # (the block ids it was asked)
        if op == _FREE or op == _ABORT:
            if out.status != _OK:
                out.blocks = []
        if preemptions[0] != pre0:
            known = self.preempted
            pre = []
            for q in h.live().values():
                if q.state == "preempted" and (r.pid, q.seq_id) not in known:
                    known.add((r.pid, q.seq_id))
                    pre.append(q.seq_id)
            out.preempted = pre
        if verify or (r.found and not found and any(k in CADENCED for k, _ in r.found)):
            with contextlib.suppress(Exception):
                h.verify()
        if found:
            out.found = list(found)
        if len(self.fired) != nfired:
            out.fault = ",".join(self.fired[nfired:])
        return out


class Child:
    """A recorded process that a fault killed (KILLING), replayed in a forked child of the
    replay's: it attaches to the replay's pool where the recorded process did (its START),
    runs that process's operations one at a time as the replay hands them over (with the
    faults the replay arms there), and dies where the fault kills it: a real process, dead
    holding the locks its release took, which the replay's other handles then recover and
    reclaim as the recording's survivors did. Its result there: status error, the fault, the
    sequence and the table it was releasing (sent as the fault fired, before the kill)."""

    def __init__(self, session: Session, r: OpRecord):
        self.recorded_pid = r.pid
        self.ended = ""  # how it ended ("": running)
        self.conn, theirs = multiprocessing.Pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover (the child: coverage is not collected there)
            self.conn.close()
            code = 1
            try:
                code = self._serve(session, r, theirs)
            finally:
                os._exit(code)
        theirs.close()
        try:
            msg = self.conn.recv()
        except EOFError:
            msg = ("error", "it ended before it attached")
        if msg[0] != "ready":
            self._reap()
            raise ReplayError(
                f"the replay's process for recorded pid {r.pid} could not attach: {msg[1]}"
            )

    @staticmethod
    def _serve(session: Session, r: OpRecord, conn: Any) -> int:
        """The child's side: attach, then run each record handed over until told to close."""
        pid = r.pid
        try:
            faults.ARMED.clear()
            h = session.become(r)
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
            return 1
        current: list[OpRecord | None] = [None]

        def fired(name: str) -> None:
            # the fault acted (a killing one kills right after): the parent learns it now,
            # with the sequence and the table the operation in flight holds
            rec = current[0]
            s = session.seqs.get((pid, rec.seq_id)) if rec is not None else None
            table = [] if s is None else list(s.block_table)
            conn.send(("fired", name, -1 if s is None else s.seq_id, table))

        faults.ON_FIRE.append(fired)
        conn.send(("ready",))
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return 0
            if msg[0] == "close":
                with contextlib.suppress(Exception):
                    if not h.closed:
                        h.close()
                conn.send(("closed",))
                return 0
            # ("run", records, the faults armed for each, verify): each run in order, its
            # result sent as it returns (a batch: a free run's consecutive records of this
            # process, one message each way instead of a round trip a record)
            _, recs, armeds, verify = msg
            for rec, armed in zip(recs, armeds):
                faults.ARMED.clear()
                faults.ARMED.update(armed)
                current[0] = rec
                try:
                    got = session.run(rec, verify)
                except Exception:
                    conn.send(("error", traceback.format_exc()))
                    return 1
                finally:
                    faults.ARMED.clear()
                conn.send(("result", got, session.held.get(pid), session.lease_held.get(pid)))

    def run(self, session: Session, r: OpRecord, verify: bool) -> Result | None:
        """Record r run in the child (the faults armed here armed there): its result; where the
        child dies in it, the result of an operation its process died in."""
        return self.run_many(session, [r], [dict(faults.ARMED)], verify)[0]

    def run_many(
        self, session: Session, recs: list[OpRecord], armeds: list[dict], verify: bool
    ) -> list[Result | None]:
        """Records `recs` run in the child in order, each with its faults armed there (`armeds`),
        sent together: their results (where the child dies in one, that operation's result as
        `run` says, and None for those after it)."""
        out: list[Result | None] = []
        if self.ended:
            return [None] * len(recs)
        self.conn.send(("run", recs, armeds, verify))
        fired: list[str] = []
        seq_id, table = -1, []
        while len(out) < len(recs):
            try:
                msg = self.conn.recv()
            except EOFError:
                break
            if msg[0] == "fired":
                fired.append(msg[1])
                seq_id, table = msg[2], msg[3]
            elif msg[0] == "result":
                got, held, lease_held = msg[1], msg[2], msg[3]
                pid = recs[len(out)].pid
                if held is not None:
                    session.held[pid] = held
                if lease_held is not None:
                    session.lease_held[pid] = lease_held
                out.append(got)
                fired, seq_id, table = [], -1, []
            else:
                self._reap()
                raise ReplayError(f"the replay's process for recorded pid {recs[0].pid}: {msg[1]}")
        if len(out) == len(recs):
            return out
        out.append(self._died(session, seq_id, table, fired))
        return out + [None] * (len(recs) - len(out))

    def _died(self, session: Session, seq_id: int, table: list, fired: list[str]) -> Result:
        """The result of the operation the child died in."""
        # it died in the operation: how, and the pool locks its record names it holding
        view = session.pool.view
        locks = view.locks
        names = [
            bytes(locks["name"][i]).decode(errors="replace")
            for i in np.flatnonzero(locks["holder_pid"] == self.pid).tolist()
        ]
        self._reap()
        held = f" holding pool lock(s) {', '.join(names)}" if names else " holding no pool lock"
        return Result(
            status=_ERROR,
            seq_id=seq_id,
            blocks=table,
            fault=",".join(fired),
            error=f"pid {self.pid} {self.ended}{held}",
        )

    def _reap(self) -> None:
        """Wait for the child (a dead process's pid is dead only once waited for: the
        survivors' recovery tells a dead holder by it) and say how it ended."""
        if self.ended:
            return
        self.conn.close()
        _, status = os.waitpid(self.pid, 0)
        if os.WIFSIGNALED(status):
            self.ended = f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            self.ended = f"exited with code {os.WEXITSTATUS(status)}"

    def close(self) -> None:
        if self.ended:
            return
        with contextlib.suppress(OSError, EOFError):
            self.conn.send(("close",))
            self.conn.recv()
        self._reap()


def _local_cache(h: KVPool) -> list[int]:
    """The blocks of handle `h`'s local cache, in the cache's order: what a flush returns."""
    cl = h.view.clients
    return [int(b) for b in cl["local"][h.client][: int(cl["local_count"][h.client])]]


def is_audit(r: OpRecord) -> bool:
    """A REPORT of the block-table audit, which holds its input (csrc/oplog.c oplog_audit)."""
    return r.op == _REPORT and r.src_id > 0 and any(k in AUDITED for k, _ in r.found)


def audit_input(r: OpRecord) -> tuple[list[int], list[int], Any]:
    """An audit's REPORT's input: its rows' recorded sequence ids, the tokens each reads, and
    the table (an int32 array of `src_id` rows of `arg` entries)."""
    size = r.src_id * r.arg
    live = (len(r.tokens) - size) // 2
    table = np.array(r.tokens[2 * live :], dtype=np.int32).reshape(r.src_id, r.arg)
    return list(r.tokens[:live]), list(r.tokens[live : 2 * live]), table


def store_spans(
    part: Any, seq_of: Callable[[int], Any]
) -> tuple[list[tuple[Any, int, int]], list[int]]:
    """A STORE's spans with what `seq_of` gives for each recorded seq id (None: the span
    dropped), and its slots, those of the dropped spans left out (where the slots are the spans'
    positions one for one; else all of them)."""
    aligned = len(part.slots) == sum(end - start for _, start, end in part.spans)
    spans: list[tuple[Any, int, int]] = []
    slots: list[int] = []
    at = 0
    for sid, start, end in part.spans:
        seq = seq_of(sid)
        if seq is not None:
            spans.append((seq, start, end))
            if aligned:
                slots += part.slots[at : at + end - start]
        at += end - start
    return spans, slots if aligned else list(part.slots)


def kv_value(token: int, pos: int) -> float:
    """The K (its V: negated) a replay, or its script, writes for a token at a position: any
    value but the poison, the same for the same token and position, so that a program that
    stores a position's K/V again (a prefix hit's prompt stored over the blocks it shares)
    leaves it as it was, in the replay as in the recording."""
    return 1.0 + ((token * 131 + pos * 7) % 1021) / 1024.0


def kv_values(spans: list[tuple[Any, int, int]], slots: list[int]) -> list[float]:
    """The value of each slot of a store of `spans` (the writers, their positions in slot
    order) into `slots`: its writer's token and position where the slots (those not -1) are
    the positions one for one, else one of the slot itself."""
    where = [(seq, p) for seq, start, end in spans for p in range(start, end)]
    if len(where) != len(slots):
        mapped = [x for x in slots if x >= 0]
        if len(mapped) != len(where):
            return [kv_value(-1, x) for x in slots]
        it = iter(where)
        where = [next(it) if x >= 0 else (None, -1) for x in slots]
    out = []
    for seq, p in where:
        tokens = [] if seq is None else seq.tokens
        out.append(kv_value(int(tokens[p]) if 0 <= p < len(tokens) else -1, p))
    return out


def write_kv(pool: Any, slots: list[int], values: list[float]) -> None:
    """A store's K/V as a replay writes it: each slot (not -1, in the pool's range) of every
    layer, K and V, its value (kv_values; V negated), as store_kv would write it. (One indexed
    write for every layer, K and V: a replay of a store-heavy log runs one a store.)"""
    import torch

    if not slots:
        return
    kv = pool.kv
    layers, _, blocks, spb, heads, dim = kv.shape
    if min(slots) < 0 or max(slots) >= blocks * spb:
        kept = [(x, v) for x, v in zip(slots, values) if 0 <= x < blocks * spb]
        if not kept:
            return
        slots, values = [x for x, _ in kept], [v for _, v in kept]
    at = torch.tensor(slots, dtype=torch.int64)
    vals = torch.tensor(values, dtype=torch.float32)
    both = torch.stack((vals, -vals))[:, :, None].expand(2, len(slots), heads * dim)
    if kv.is_contiguous():
        kv.view(layers, 2, blocks * spb, heads * dim)[:, :, at] = both.to(kv.dtype)
    else:
        both = both.reshape(2, len(slots), heads, dim).to(kv.dtype)
        kv[:, :, at // spb, at % spb] = both


def transfer_kv(pool: Any, blocks: list[int]) -> None:
    """A write lease's transfer as a replay makes it, at its release (one that completed into
    the blocks it was taken on: no transfer_after_free): the transfer's K/V is not in the log
    (raw writes into the pool's K/V: docs/REPLAY.md), so the token slots of its blocks that
    still hold the poison (never written in the replay) are written, each slot kv_value(-1,
    slot), as write_kv writes a store. Slots the replay wrote are left as they are, and so is
    a published block the lease covers (a prefix other requests share). Nothing where the K/V
    is not poisoned (not floating point)."""
    import torch

    from kvscope.kernels.checks import poison_bits
    from kvscope.kernels.digest import int_view

    kv = pool.kv
    # (a published block's K/V is the prefix other requests share, its digest taken: a
    # transfer into a request's pages does not write it, and the replay leaves it as it is)
    blocks = [b for b in blocks if pool.view.blocks["indexed"][b] != 1]
    if not blocks or not kv.dtype.is_floating_point:
        return
    bs, spb = pool.block_size, pool.slots_per_block
    ids = torch.tensor(blocks, dtype=torch.int64)
    # every element of a slot, every layer, K and V: still the poison
    same = int_view(kv)[:, :, ids, :bs] == poison_bits(kv.dtype)  # [L, 2, n, bs, H, D]
    blank = same.flatten(4).all(4).all(1).all(0)  # [n, bs]
    slots = [int(b) * spb + s for i, b in enumerate(blocks) for s in range(bs) if blank[i, s]]
    write_kv(pool, slots, [kv_value(-1, x) for x in slots])


def copy_kv(pool: Any, pairs: list[tuple[int, int]]) -> None:
    """A program's block copies as a replay makes them: each block whole, every layer, K and V,
    in the replay pool's K/V (kvscope.kernels.copy_blocks' reference: its kernels, Triton's
    import, are not needed on the replay's CPU pool)."""
    import torch

    if pairs:
        t = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
        pool.kv[:, :, t[:, 1]] = pool.kv[:, :, t[:, 0]]


@dataclass
class Outcome:
    """How a replay ended."""

    reason: str  # "end", "until", "divergence", "finding", "missing", "lost"
    replayed: int  # operations executed
    total: int  # operations in the log
    record: OpRecord | None = None
    got: Result | None = None
    diff: list[str] = field(default_factory=list)
    blocks: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    faults: dict[int, str] = field(default_factory=dict)  # seq -> the fault that fired there
    lost: tuple[int, int] | None = None  # the numbers missing where the replay stopped
    # the START the replay stopped at: its handle had run operations no record holds
    unrecorded: int | None = None
    # the REPORTs where the recording learned the findings of the operation it stopped at: its
    # device checks' answers, applied at a later settle (a CUDA pool's), by number
    answered_at: list[int] = field(default_factory=list)

    @property
    def error_finding(self) -> bool:
        if self.got is None:
            return False
        for k, _ in self.got.found:
            try:
                if SEVERITY[FindingKind(k)] == "error":
                    return True
            except ValueError:
                return True
        return False

    @property
    def exit_code(self) -> int:
        if self.reason in ("divergence", "missing", "lost"):
            return 1
        return 1 if self.reason == "finding" and self.error_finding else 0


def block_rows(session: Session, rec: Result | None, got: Result | None) -> list[dict[str, Any]]:
    """The blocks an operation involves, recorded beside replayed, with the replay pool's
    record of each now."""
    ids: set[int] = set()
    for res in (rec, got):
        if res is None:
            continue
        ids.update(res.blocks)
        ids.update(b for c in res.copies for b in c)
        ids.update(b for _, b in res.found if b >= 0)
    # (a copy of the segment once the replay closed the creator's handle: its close replayed)
    pool = session.pool
    blocks = read_live(session.name).blocks if pool.closed else pool.view.blocks
    rows = []
    for b in sorted(ids):
        if not 0 <= b < len(blocks):
            continue
        rec_b = blocks[b]
        rows.append(
            {
                "block": b,
                "recorded": _role(rec, b),
                "replayed": _role(got, b),
                "state": _state_name(int(rec_b["state"])),
                "refcount": int(rec_b["refcount"]),
                "request": bytes(rec_b["request"]).rstrip(b"\0").decode("utf-8", "replace"),
            }
        )
    return rows


def _with_close_reports(records: list[OpRecord], at: int) -> Result:
    """Record `at`'s results, and where it is a REPORT, the findings of the REPORTs of the same
    process right after it too: a close's reports, one finding each, which the replay's close
    finds at once (its table's recorded column shows each block as recorded, not as missing)."""
    r = records[at]
    out = recorded_result(r)
    if r.op != _REPORT:
        return out
    found = list(r.found)
    for q in records[at + 1 :]:
        if q.op != _REPORT or q.pid != r.pid:
            break
        found += q.found
    out.found = found
    return out


def _state_name(state: int) -> str:
    try:
        return BlockState(state).name.lower()
    except ValueError:
        return str(state)


def _role(res: Result | None, b: int) -> str:
    if res is None:
        return "-"
    roles = []
    if b in res.blocks:
        roles.append(f"table[{res.blocks.index(b)}]")
    for src, dst in res.copies:
        if b == src:
            roles.append("cow src")
        if b == dst:
            roles.append("cow dst")
    roles += [k for k, fb in res.found if fb == b]
    return ", ".join(roles) or "-"


def _cadenced(r: OpRecord, got: Result, early: set[tuple[str, int]]) -> None:
    """The magic probe's own-clock findings (CADENCED) come at whichever operation its clock
    says, in the recording and in the replay alike: one the replay found before the recording
    did is kept aside (`early`) and counted at the operation where the recording found it."""
    mine = [f for f in got.found if f[0] in CADENCED and f not in r.found]
    if mine:
        early.update(mine)
        got.found = [f for f in got.found if f not in mine]
    owed = [f for f in r.found if f[0] in CADENCED and f not in got.found and f in early]
    if owed:
        early.difference_update(owed)
        got.found = list(got.found) + owed


@contextlib.contextmanager
def _quiet(on: bool) -> Iterator[None]:
    """The faults' announcements (stderr) kept out of a shrink's many runs."""
    if not on:
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield


def replay(log: OpLog, until: int | None = None, quiet: bool = False) -> Outcome:
    """Replay `log` against a fresh pool and compare every result; stop at the first divergence
    or finding (or after operation `until`)."""
    records = log.records
    total = sum(1 for r in records if r.op not in _MARKS)
    done = 0
    t0 = time.perf_counter()
    # Each fault is armed just before the operation the recording says it fired in, to strike
    # at its next opportunity: the recording's process may have had opportunities a replay does
    # not (transactions that are no operation: a slot-reserve refill).
    with _quiet(quiet), Session(log, arm=False) as session:
        outcome = Outcome("end", 0, total)
        gap_after = {a - 1: (a, b) for a, b in log.gaps}
        breaks = set(log.breaks)
        early: set[tuple[str, int]] = set()
        # the findings of device checks' answers the recording applied after the operation
        # that queued them (a CUDA pool's), by that operation: the replay's CPU pool finds them
        # in it, and compares them there; their REPORTs then are that operation's
        answers = log.answer_reports()
        answered = {q.seq for qs in answers.values() for q in qs}
        # each STORE's findings, as the REPORT records after it have them
        by_store: dict[int, list[tuple[str, int]]] = {}
        if session.store_reports:
            for q in records:
                st = session.store_reports.get(q.seq)
                if st is not None:
                    by_store.setdefault(st, []).extend(q.found)
        for at, r in enumerate(records):
            if until is not None and r.seq > until:
                outcome.reason = "until"
                break
            if r.seq in gap_after or r.op == _LOST:
                outcome = Outcome("lost", done, total, r, faults=outcome.faults)
                a, b = gap_after.get(r.seq, (r.seq - r.arg, r.seq - 1))
                outcome.lost = (a, b)
                if r.op == _LOST:
                    break
                # (this record runs; the replay stops before the missing ones)
            if r.seq in breaks:
                # (a handle that began recording again after operations no record holds, and
                # no snapshot after it: what follows depends on those)
                # (no record to show: the START is no operation, `unrecorded` names it)
                outcome = Outcome("lost", done, total, faults=outcome.faults)
                outcome.unrecorded = r.seq
                break
            if r.op in _MARKS:
                if r.op == _START and r is not log.start:
                    session.attach(r)
                continue
            if answered and r.seq in answered:
                # (a device check's answer: compared at the operation it names, above)
                done += 1
                continue
            if r.faults:
                faults.ARMED.clear()
                faults.ARMED.update({f: 1 for f in r.fault_names})
            got = session.run(r)
            if r.faults:
                faults.ARMED.clear()
            if got is None:
                outcome = Outcome("missing", done, total, r)
                break
            done += 1
            if got.fault:
                outcome.faults[r.seq] = got.fault
            if r.op in (_STORE, _COPY):
                # a store or copy check: its findings are the REPORT records that follow it on
                # its thread, where the replay stops; a check that finds otherwise diverges here
                expected = by_store.get(r.seq, [])
                if sorted(got.found) == sorted(expected) and got.status == _OK:
                    got.found = []  # (the REPORTs after it compare them, one each)
                else:
                    fired = outcome.faults
                    shown = dataclasses.replace(r, found=expected)
                    diff = ["found"] if got.status == _OK else ["status"]
                    outcome = Outcome("divergence", done, total, shown, got, diff, faults=fired)
                    outcome.blocks = block_rows(session, recorded_result(shown), got)
                    break
            late = answers.get(r.seq) if answers else None
            if late:
                # what the recording found in this operation, its device checks' answers
                # included (learned at their REPORTs)
                r = dataclasses.replace(r, found=r.found + [f for q in late for f in q.found])
            if got.found or r.found:
                _cadenced(r, got, early)
            diff = differences(r, got)
            if diff or got.found or r.found:
                fired = outcome.faults
                outcome = Outcome(
                    "divergence" if diff else "finding", done, total, r, got, diff, faults=fired
                )
                outcome.blocks = block_rows(session, _with_close_reports(records, at), got)
                if late:
                    outcome.answered_at = [q.seq for q in late]
                break
            if outcome.reason == "lost":
                break
        outcome.replayed = done
        outcome.seconds = time.perf_counter() - t0
    return outcome


# -- shrinking ------------------------------------------------------------------------------


def _units(ops: list[OpRecord]) -> list[list[int]]:
    """The log's requests as units for delta debugging: the indexes of each request's
    operations (a fork's child and a resumed sequence belong to their request, a lease to its
    sequence's request, or to the request of the blocks it was taken on, its release to the
    lease, a store check to the request of each of its spans), and each operation on no request
    as a unit of its own."""
    family: dict[tuple[int, int], int] = {}
    by_request: dict[str, int] = {}
    leases: dict[int, int] = {}
    units: list[list[int]] = []
    # each copy-on-write pair's unit, by (pid, src, dst): the request whose append returned it
    pairs: dict[tuple[int, int, int], int] = {}
    for i, r in enumerate(ops):
        key = (r.pid, r.seq_id)
        if r.op == _COPY:
            # (with the request whose append gave its pairs, else a unit of its own)
            given = {pairs[(r.pid, a, b)] for a, b in r.copies if (r.pid, a, b) in pairs}
            if not given:
                given = {len(units)}
                units.append([])
            for unit in sorted(given):
                units[unit].append(i)
            continue
        if r.copies and key in family:
            for a, b in r.copies:
                pairs[(r.pid, a, b)] = family[key]
        if r.op == _STORE and r.store is not None:
            # (in every unit of its writers: kept while one of them is, the others' spans
            # dropped as it runs)
            mine = {family[(r.pid, sid)] for sid, _, _ in r.store.spans if (r.pid, sid) in family}
            if not mine:
                mine = {len(units)}
                units.append([])
            for u in sorted(mine):
                units[u].append(i)
        elif r.op in _LEASE_OPS:
            lease_id = r.lease.lease_id if r.lease is not None else 0
            u = None
            if r.op == _LEASE_RELEASE:
                u = leases.get(lease_id)
            elif r.op == _LEASE:
                u = family.get(key) if r.seq_id >= 0 else by_request.get(r.request)
            if u is None:
                u = len(units)
                units.append([])
            units[u].append(i)
            if r.op == _LEASE and lease_id:
                leases[lease_id] = u
        elif r.op == _ALLOCATE:
            family[key] = len(units)
            by_request[r.request] = len(units)
            units.append([i])
        elif r.op in (_FORK, _RESUME) and (r.pid, r.src_id) in family:
            u = family[(r.pid, r.src_id)]
            family[key] = u
            if r.op == _FORK:
                by_request[r.request] = u
            units[u].append(i)
        elif key in family:
            units[family[key]].append(i)
        else:
            units.append([i])
    return units


def _ddmin(items: list[Any], test: Callable[[list[Any]], bool]) -> list[Any]:
    """Zeller's delta debugging: a 1-minimal sublist of items (in order) that passes test."""
    n = 2
    while len(items) >= 2:
        size = -(-len(items) // n)
        parts = [items[i : i + size] for i in range(0, len(items), size)]
        for i, part in enumerate(parts):
            if test(part):
                items, n = part, 2
                break
            rest = [x for j, p in enumerate(parts) if j != i for x in p]
            if len(parts) > 2 and test(rest):
                items, n = rest, max(n - 1, 2)
                break
        else:
            if n >= len(items):
                break
            n = min(len(items), 2 * n)
    return items


@dataclass
class Shrunk:
    """A minimal run: its operations, the kind it finds, the operation that finds it."""

    log: OpLog
    ops: list[OpRecord]
    kind: str
    fault_at: dict[int, str]  # seq -> the fault armed just before that operation
    tests: int
    seconds: float
    statuses: list[int]
    # the K/V each STORE of the minimal run wrote (its slots and their values), by its number
    kv_writes: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    # the slots each STORE's check was given and the pairs each COPY copied in the minimal run
    # (the recorded ones, in the blocks the minimal run's requests hold: Session.reloc)
    store_slots: dict[int, list[int]] = field(default_factory=dict)
    copy_pairs: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    # an interrupted shrink's: the shortest run found so far, not 1-minimal
    partial: bool = False


class Shrinker:
    """Delta debugging over a log's requests, then its operations, keeping a finding."""

    def __init__(self, log: OpLog, outcome: Outcome):
        if outcome.reason != "finding" or outcome.got is None or outcome.record is None:
            raise ReplayError(
                f"{log.path}: nothing to shrink: the replay "
                + (
                    "diverged from the recording before any finding"
                    if outcome.reason in ("divergence", "missing", "lost")
                    else "found nothing"
                )
            )
        if log.snapshot is not None:
            raise ReplayError(
                f"{log.path}: the log starts from a snapshot of the pool (operation "
                f"{log.start.seq}), and a shrink runs its candidates on a fresh pool: not shrunk "
                "(replay it without --shrink, or record from the pool's creation)"
            )
        self.log = log
        self.kind = (outcome.got.found or outcome.record.found)[0][0]
        # a leak found at a close is kept about the same request (a fork that outlived its
        # parent's abort, a lease whose release never happened), not any sequence or lease the
        # shrunk run leaves unended
        self.leaked = (
            outcome.record.request
            if self.kind in AT_CLOSE and outcome.record.op == _REPORT
            else None
        )
        last = outcome.record.seq
        # The operation that finds the kind in a free run of the whole log (`shrink` learns it):
        # a candidate that finds it at another is another occurrence (a store's recorded slots
        # landing in blocks the shrunk run never took, say), not kept. The magic probe's
        # own-clock kinds come at whichever operation its clock says.
        self.at: int | None = None
        self.ops = [r for r in log.records if r.op not in (*_MARKS, _LOST) and r.seq <= last]
        self.starts = [r for r in log.records if r.op == _START and r is not log.start]
        self.fault_at = dict(outcome.faults)
        self.tests = 0
        self.statuses: list[int] = []
        self.kv_writes: dict[int, tuple[list[int], list[float]]] = {}
        self.store_slots: dict[int, list[int]] = {}
        self.copy_pairs: dict[int, list[tuple[int, int]]] = {}
        # told (runs so far, operations in the shortest run that still found it) after each run
        self.progress: Callable[[int, int], None] | None = None
        # the shortest candidate that found it so far (None: none yet): what an interrupted
        # shrink gives (Shrinker.so_far)
        self.best_ops: list[OpRecord] | None = None
        # the requests still held where it was found: in the whole run (the first run), and
        # in the last run that found it (a leak's script names them: Shrinker.end_others)
        self.held_then: set[str] | None = None
        self.held_last: set[str] = set()
        self.t0 = time.perf_counter()

    def run(self, ops: list[OpRecord]) -> tuple[bool, list[int]]:
        """Whether `ops` (as a free run: results not compared, operations on requests it
        lacks skipped) finds the kind, first at the operation the whole log's run first found
        it at (`at`); the statuses of the operations it ran."""
        self.tests += 1
        statuses: list[int] = []
        verify = self.kind in CADENCED
        with _quiet(True), Session(self.log, arm=False) as session:
            session.reloc = {}  # (a free run: the recorded blocks as this run's)
            # (the last run's: the shrunk one's, for its script)
            self.kv_writes = session.kv_writes
            self.store_slots, self.copy_pairs = session.store_slots, session.copy_pairs
            for r in self.starts:
                session.attach(r)
            i = 0
            while i < len(ops):
                r = ops[i]
                child = session.children.get(r.pid) if r.pid not in session.handles else None
                if child is not None:
                    # a killed process's run of records, handed to its child at once (no
                    # result is compared in a free run: one round trip, not one a record)
                    j = i
                    while j < len(ops) and ops[j].pid == r.pid and ops[j].op != _START:
                        j += 1
                    batch = ops[i:j]
                    armeds = [self._armed(b) for b in batch]
                    results = child.run_many(session, batch, armeds, verify)
                else:
                    batch = [r]
                    fault = self.fault_at.get(r.seq)
                    if fault:
                        faults.ARMED.clear()
                        faults.ARMED.update(self._armed(r))
                    results = [session.run(r, verify=verify)]
                    if fault:
                        faults.ARMED.clear()
                i += len(batch)
                for b, got in zip(batch, results):
                    statuses.append(-1 if got is None else got.status)
                    if got is not None:
                        session.relearn(b, got)
                    if got is not None and any(k == self.kind for k, _ in got.found):
                        if self.at is None and self.kind not in CADENCED:
                            self.at = b.seq
                        elif self.at is not None and b.seq != self.at:
                            return False, statuses
                        held = session.lease_held if self.kind == "lease_leak" else session.held
                        now = set(held.get(b.pid, ()))
                        if self.leaked is None or self.leaked in now:
                            # (what it leaves unended there: the whole run's, the first)
                            if self.held_then is None:
                                self.held_then = now
                            self.held_last = now
                            return True, statuses
        return False, statuses

    def _armed(self, r: OpRecord) -> dict[str, int]:
        """The faults armed for record r (those the recording says fired in it), as ARMED."""
        fault = self.fault_at.get(r.seq)
        return {f: 1 for f in fault.split(",")} if fault else {}

    def test(self, ops: list[OpRecord]) -> bool:
        found = self.run(ops)[0]
        if found and (self.best_ops is None or len(ops) <= len(self.best_ops)):
            self.best_ops = list(ops)
        if self.progress is not None:
            self.progress(self.tests, len(self.best_ops or self.ops))
        return found

    def merge_appends(self, ops: list[OpRecord]) -> list[OpRecord]:
        """Each append merged into the sequence's append before it (its tokens added there)
        where the run still finds the kind: a decode loop's one-token appends become a few."""
        ops = list(ops)
        i = 0
        while i < len(ops):
            r = ops[i]
            if r.op == _APPEND and r.seq not in self.fault_at:
                key = (r.pid, r.seq_id)
                j = next(
                    (
                        j
                        for j in range(i - 1, -1, -1)
                        if (ops[j].pid, ops[j].seq_id) == key
                        and ops[j].op in (_APPEND, _ALLOCATE, _FORK, _RESUME)
                    ),
                    None,
                )
                if j is not None and ops[j].op == _APPEND and ops[j].seq not in self.fault_at:
                    into = dataclasses.replace(ops[j], tokens=ops[j].tokens + r.tokens)
                    candidate = ops[:j] + [into] + ops[j + 1 : i] + ops[i + 1 :]
                    if self.test(candidate):
                        ops = candidate
                        continue
            i += 1
        return ops

    def so_far(self) -> Shrunk | None:
        """What a shrink stopped before its end (interrupted) got: the shortest candidate that
        found the kind so far, run once more for its statuses and its stores' slots (not
        1-minimal); None where no candidate had found it yet."""
        if self.best_ops is None:
            return None
        ops = self.best_ops
        ok, statuses = self.run(ops)
        if not ok:
            return None
        return self._shrunk(ops, statuses, partial=True)

    def _shrunk(self, ops: list[OpRecord], statuses: list[int], partial: bool = False) -> Shrunk:
        return Shrunk(
            self.log,
            ops,
            self.kind,
            {r.seq: self.fault_at[r.seq] for r in ops if r.seq in self.fault_at},
            self.tests,
            time.perf_counter() - self.t0,
            statuses,
            self.kv_writes,
            self.store_slots,
            self.copy_pairs,
            partial,
        )

    def shrink(self) -> Shrunk:
        self.t0 = time.perf_counter()
        ops = self.ops
        if not self.test(ops):
            raise ReplayError(
                f"{self.log.path}: the finding {self.kind!r} does not come back when the "
                "operations are run with the fault armed at the operation where it fired: "
                "nothing to shrink"
            )
        units = _units(ops)
        test_units = lambda us: self.test(_flatten(ops, us))  # noqa: E731
        # a long run: first the shortest tail of requests that still finds it (a binary search,
        # a few runs), then delta debugging over what is left
        kept_units = _ddmin(_tail(units, test_units), test_units)
        ops = _flatten(ops, kept_units)
        # a sequence's appends one at a time (a decode loop's) merged into fewer, then delta
        # debugging over single operations
        ops = self.end_others(_ddmin(self.merge_appends(ops), self.test))
        ok, statuses = self.run(ops)
        assert ok
        return self._shrunk(ops, statuses)

    def end_others(self, ops: list[OpRecord]) -> list[OpRecord]:
        """A leak's minimal run that leaves other requests unended where the whole run had
        ended them (a fork's parent whose free was dropped: its script would say "held: r10
        r10-s1" where only r10-s1 leaked): each one's recorded free or abort put back, where
        the run still finds the kind."""
        if self.leaked is None or self.held_then is None:
            return ops
        for request in sorted(self.held_last - self.held_then):
            ends = [r for r in self.ops if r.request == request and r.op in (_FREE, _ABORT)]
            if not ends or ends[-1] in ops:
                continue
            candidate = sorted([*ops, ends[-1]], key=lambda r: r.seq)
            if self.test(candidate):
                ops = candidate
        return ops


def _tail(items: list[Any], test: Callable[[list[Any]], bool]) -> list[Any]:
    """The shortest tail of items that passes test (which all of them pass), by binary search
    (where a longer tail fails and a shorter one passes, one of them)."""
    lo, hi = 0, len(items) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if test(items[mid:]):
            lo = mid
        else:
            hi = mid - 1
    return items[lo:]


def _flatten(ops: list[OpRecord], units: list[list[int]]) -> list[OpRecord]:
    return [ops[i] for i in sorted({i for u in units for i in u})]


# -- the script ------------------------------------------------------------------------------

_PROBE_ENV = {
    "events": "KVSCOPE_EVENTS",
    "ownership": "KVSCOPE_OWNERSHIP",
    "leaks": "KVSCOPE_LEAKS",
    "magic": "KVSCOPE_MAGIC",
    "digest": "KVSCOPE_DIGEST",
}


def emit_script(shrunk: Shrunk) -> str:
    """A plain Python script against the public pool API that runs the minimal operations and
    exits 1 when it finds the kind (0 otherwise)."""
    log = shrunk.log
    start = log.start.start or {}
    cfg = start.get("config") or {}
    flags = start.get("probes") or {}
    env = {v: "1" if flags.get(k) else "0" for k, v in _PROBE_ENV.items()}
    cfg_args = ", ".join(f"{k}={v!r}" for k, v in sorted(cfg.items()))
    stores_in = any(r.op == _STORE for r in shrunk.ops)
    audits_in = any(is_audit(r) for r in shrunk.ops)
    # the K/V its stores wrote and the blocks it copied, where the replay wrote them
    # (OpLog.replays_kv)
    writes_in = bool(shrunk.kv_writes) and log.replays_kv()
    copies_in = any(r.op == _COPY for r in shrunk.ops) and log.replays_kv()
    # (stores checked, but no probes at the START: the recording's handle turned them on after)
    bare = stores_in and not any(flags.values())
    lines = [
        '"""A minimal reproduction of a kvscope finding, written by `kvscope replay --shrink',
        f"--emit-script` from the operation log {os.path.basename(log.path)}: "
        f"{len(shrunk.ops)} operation(s) on a fresh pool",
        f"find {shrunk.kind!r}. Run it: python THIS.py (exit 1: found, 0: not found).",
        '"""',
        "",
        "import os",
        "import sys",
        "",
        "# The probes the recorded process ran (docs/PROBES.md), before kvscope is imported.",
        f"os.environ.update({env!r})",
        "",
        "from kvscope.allocator import KVPool, PoolConfig, PoolError, faults  # noqa: E402",
        *(["import numpy as np  # noqa: E402"] if stores_in or audits_in else []),
        *(["from kvscope.probes.stores import Writers  # noqa: E402"] if stores_in else []),
        *(["import torch  # noqa: E402"] if writes_in or copies_in else []),
        *(["from kvscope.kernels import store_kv  # noqa: E402"] if writes_in else []),
        *(["from kvscope.kernels import copy_blocks  # noqa: E402"] if copies_in else []),
        *(
            [
                "from kvscope.allocator.probeflags import ProbeFlags  # noqa: E402",
                "from kvscope.allocator.probing import PoolProbes  # noqa: E402",
            ]
            if bare
            else []
        ),
        "",
        "found = []",
        "held = set()  # requests still holding blocks where the recording's pool was closed",
        f'pool = KVPool.create(f"repro-{{os.getpid()}}", PoolConfig({cfg_args}))',
    ]
    handles = {int(start.get("pid", log.start.pid)): "pool"}
    starts = {int(start.get("pid", log.start.pid)): start}
    # the processes a fault killed: each a forked child (Process, below), whose handle is
    # `pool` there, its statements run in it in order with the script's own
    dying = {r.pid for r in log.records if r.faults and any(f in KILLING for f in r.fault_names)}
    procs: dict[int, str] = {}
    for r in log.records:
        if r.op == _START and r is not log.start and r.pid not in handles:
            if r.pid in dying:
                handles[r.pid] = procs[r.pid] = f"proc_{len(handles)}"
            else:
                handles[r.pid] = f"pool_{len(handles)}"
            starts[r.pid] = r.start or {}

    def on(pid: int, stmt: str) -> str:
        """`stmt` about a handle (`{h}`) on the process's handle: in its child where it has one."""
        proc = procs.get(pid)
        return (
            stmt.format(h=handles[pid])
            if proc is None
            else f"{proc}.run({stmt.format(h='pool')!r})"
        )

    if procs:
        lines[lines.index("import sys")] = "import multiprocessing\nimport signal\nimport sys"
        lines[lines.index("found = []") : lines.index("found = []")] = PROCESS.split("\n")
    if writes_in:
        lines[lines.index("found = []") : lines.index("found = []")] = WRITE.split("\n")
    setup = []
    for pid, var in handles.items():
        if pid in procs:
            setup.append(f"{var} = Process(pool.name, {pid})  # pid {pid} of the recording")
        else:
            if var != "pool":
                setup.append(f"{var} = KVPool.attach(pool.name)")
            setup.append(f"{var}.on_finding = found.append")
    if start.get("guard_sample", 0) > 1:
        setup.append(f"pool.guard_sample = {int(start['guard_sample'])}")
    for pid in handles:
        every = int(starts[pid].get("provenance_sample", 0) or 0)
        if every:
            setup.append(on(pid, f"{{h}}.provenance_sample = {every}  # slot provenance"))
    if start.get("lockdep"):
        setup += [on(pid, "{h}.trace_locks(True)") for pid in handles]
    if bare:
        setup += [
            "# the store check runs under the probes (the recording's handle had them at its",
            "# stores): probes that change nothing the core does",
            *[on(pid, "{h}.probe = PoolProbes({h}, ProbeFlags())") for pid in handles],
        ]
    lines += setup
    lines += ["try:"]
    names: dict[tuple[int, int], str] = {}
    leases: dict[int, str] = {}
    stores: dict[int, str] = {}  # a CUDA store's Writers, by its STORE record's number
    done: set[tuple[int, int]] = set()  # the sequences the script made
    body: list[str] = []
    for r, status in zip(shrunk.ops, shrunk.statuses + [0] * len(shrunk.ops)):
        proc = procs.get(r.pid)
        h = "pool" if proc is not None else handles.get(r.pid, "pool")
        fault = shrunk.fault_at.get(r.seq)
        if fault:
            spec = ",".join(f"{f}:1" for f in fault.split(","))
            body.append("# the fault the recording injected here, at its next opportunity")
            body.append(
                on(r.pid, f"faults.configure({spec!r})") if proc else f"faults.configure({spec!r})"
            )
        if r.op == _STORE:
            call = _store_call(r, h, names, stores, done, shrunk.store_slots.get(r.seq))
            if call is not None and writes_in and r.seq in shrunk.kv_writes:
                slots, values = shrunk.kv_writes[r.seq]
                call += f"\nwrite({h}, {slots!r}, {values!r})"
        elif r.op == _COPY:
            call = _copy_call(r, h, shrunk.copy_pairs.get(r.seq)) if copies_in else None
        else:
            call = _call(r, h, names, leases)
        if call is None:
            continue
        killed = proc is not None and fault and any(f in KILLING for f in fault.split(","))
        stmts = call.split("\n")
        if status not in (_OK, -1) and not killed:
            stmts = [
                "try:",
                *[f"    {c}" for c in stmts],
                "except PoolError as e:  # the pool refused it in the recording too",
                '    print("PoolError:", e)',
            ]
        if killed:
            body.append("# the process dies in it (SIGKILL, holding the locks it took)")
        body += [f"{proc}.run({chr(10).join(stmts)!r})"] if proc else stmts
        if fault:
            body.append(on(r.pid, "faults.configure(None)") if proc else "faults.configure(None)")
        if r.op in (_ALLOCATE, _FORK, _RESUME) and status in (_OK, -1):
            done.add((r.pid, r.seq_id))
    lines += ["    " + b for b in body] or ["    pass"]
    lines += [
        *(
            ["    pool.verify()  # the magic probe's check, which runs every 10 ms on its own"]
            if shrunk.kind in CADENCED
            else []
        ),
        "finally:",
        "    ran = len(found)  # (a sequence the closes below find still live: `held` says it)",
        *[f"    {v}.close()" for v in reversed(list(handles.values()))],
        "    pool.unlink()",
        'kinds = sorted({getattr(f.kind, "value", f.kind) for f in found[:ran]}'
        + ' | {getattr(f.kind, "value", f.kind) for f in found[ran:]} - {"leak_finished"}'
        + "".join(f" | {v}.kinds" for v in procs.values())
        + ' | ({"leak_finished"} if held else set()))',
        'print("findings:", ", ".join(kinds) or "none", *(["held:", *sorted(held)] if held else []))',
        f"sys.exit(1 if {shrunk.kind!r} in kinds else 0)",
        "",
    ]
    return "\n".join(lines)


def _call(
    r: OpRecord, h: str, names: dict[tuple[int, int], str], leases: dict[int, str]
) -> str | None:
    op = r.op

    def seq(i: int) -> str:
        return names.get((r.pid, i), f"s{i}")

    if op in _LEASE_OPS:
        return _lease_call(r, h, seq, leases)
    if op == _ALLOCATE:
        v = names.setdefault((r.pid, r.seq_id), f"s{len(names) + 1}")
        return f"{v} = {h}.allocate({r.request!r}, {r.tokens!r})"
    if op == _FORK:
        v = names.setdefault((r.pid, r.seq_id), f"s{len(names) + 1}")
        return f"{v} = {h}.fork({seq(r.src_id)}, {r.request!r})"
    if op == _APPEND:
        return f"{h}.append({seq(r.seq_id)}, {r.tokens!r})"
    if op == _MARK:
        return f"{h}.mark_computed({seq(r.seq_id)}, {r.arg})"
    if op == _FREE:
        return f"{h}.free({seq(r.seq_id)})"
    if op == _ABORT:
        return f"{h}.abort({seq(r.seq_id)})"
    if op == _SET_STATE:
        return f"{h}.set_state({seq(r.seq_id)}, {_STATES.get(r.arg, 'unknown')!r})"
    if op == _RESUME:
        v = seq(r.src_id)
        names[(r.pid, r.seq_id)] = v
        return f"{h}.resume({v})"
    if op == _EVICT:
        return f"{h}.evict({r.arg})"
    if op == _REPORT and r.found and all(k in STORE_KINDS for k, _ in r.found):
        return None  # (a store check's finding: its check above reports it)
    if op == _REPORT and any(k == "lease_leak" for k, _ in r.found):
        return None  # (a lease still held as the pool closed: the close below reports it)
    if op == _REPORT and any(k == "leak_finished" for k, _ in r.found):
        # (a sequence still holding blocks as its handle closed, or at kvscope run's exit)
        return f"held |= {{str(s.request_id) for s in {h}.live().values() if s.block_table}}"
    if op == _REPORT and any(k in RECLAIMED for k, _ in r.found):
        return f"{h}.reclaim_dead()  # a dead process's locks and blocks recovered"
    if op == _REPORT and any(k in SWEPT for k, _ in r.found):
        return f"{h}.check_provenance()  # the provenance sweep"
    if is_audit(r):
        ids, lengths, table = audit_input(r)
        rows = ", ".join(seq(i) for i in ids)
        return (
            f"{h}.audit_block_table(np.array({table.tolist()!r}, dtype=np.int32), "
            f"rows=[{rows}], lengths={lengths!r}, padding={r.result})"
        )
    if op == _REPORT:
        return f"{h}.verify()"
    if op == _CLOSE:
        return f"{h}.close()"
    if op == _FLUSH:
        return f"{h}.flush_local()"
    return None


# The emitted script's helper where a process of the recording was killed (kill-holding-lock).
PROCESS = '''
class Process:
    """A process of the recording that a fault killed, run as a forked child attached to the
    pool: run(code) runs statements in it (its handle is `pool` there), in order with this
    script's own; where it dies, it says how. `kinds`: what its handle found."""

    def __init__(self, name, recorded_pid):
        self.recorded_pid = recorded_pid
        self.ended = ""
        self.conn, theirs = multiprocessing.Pipe()
        self.pid = os.fork()
        if self.pid == 0:
            self.conn.close()
            scope = dict(globals(), found=[], held=set())
            code = 0
            try:
                scope["pool"] = KVPool.attach(name)
                scope["pool"].on_finding = scope["found"].append
                theirs.send([])
                while (stmt := theirs.recv()) is not None:
                    exec(stmt, scope)
                    sys.stdout.flush()
                    theirs.send([getattr(f.kind, "value", f.kind) for f in scope["found"]])
                scope["pool"].close()
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        theirs.close()
        self.kinds = set(self.conn.recv())

    def run(self, stmt):
        if self.ended:
            return
        self.conn.send(stmt)
        try:
            self.kinds |= set(self.conn.recv())
        except EOFError:  # it died in it
            self.wait()

    def wait(self):
        _, status = os.waitpid(self.pid, 0)
        self.ended = (
            f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
            if os.WIFSIGNALED(status)
            else f"exited with code {os.WEXITSTATUS(status)}"
        )
        print(f"pid {self.pid} (pid {self.recorded_pid} of the recording) {self.ended}")

    def close(self):
        if not self.ended:
            self.conn.send(None)
            _, status = os.waitpid(self.pid, 0)
            self.ended = "closed"

'''


def _store_call(
    r: OpRecord,
    h: str,
    names: dict[tuple[int, int], str],
    stores: dict[int, str],
    done: set,
    here: list[int] | None = None,
) -> str | None:
    """A store check as a plain call: `Writers(pool, [(s1, 0, 12)]).check(np.array([...]))`
    (a CUDA store's: `check_blocks()` at the store, `check_slots(...)` where its slots were read
    back), the spans of sequences the script does not make left out; `here`: the slots the
    shrunk run's check was given (the recorded ones in its blocks), else the recorded ones."""
    part = r.store
    if part is None:
        return None
    spans, slots = store_spans(
        part, lambda sid: names.get((r.pid, sid)) if (r.pid, sid) in done else None
    )
    if not spans:
        return None
    if here is not None and len(here) == len(slots):
        slots = here
    writers = f"Writers({h}, [{', '.join(f'({v}, {a}, {b})' for v, a, b in spans)}])"
    if part.what & STORE_BLOCKS and part.what & STORE_SLOTS:
        return f"{writers}.check(np.array({slots!r}))"
    if part.what & STORE_BLOCKS:
        v = stores[r.seq] = f"w{len(stores) + 1}"
        return f"{v} = {writers}\n{v}.check_blocks()"
    return f"{stores.get(part.ref, writers)}.check_slots(np.array({slots!r}))"


def _copy_call(r: OpRecord, h: str, here: list[tuple[int, int]] | None = None) -> str | None:
    """The program's copy of blocks as a plain call, told to the pool as the program told it:
    `copy_blocks(pool.kv, torch.tensor([src, ...]), torch.tensor([dst, ...]), pool=pool)` with
    the blocks the shrunk run copied (`here`: the recorded ones in its blocks), else the
    recorded ones (the pool's copy check runs on them)."""
    pairs = here if here is not None else r.copies
    if not pairs:
        return None
    src, dst = [a for a, _ in pairs], [b for _, b in pairs]
    return f"copy_blocks({h}.kv, torch.tensor({src!r}), torch.tensor({dst!r}), pool={h})"


# The emitted script's helper where the replay wrote its stores' K/V: the values it wrote.
WRITE = '''
def write(pool, slots, values):
    """A store's K/V: K `values` (V negated), one a slot, at `slots` of every layer (what
    `kvscope replay` wrote for the recorded store: a value of its token and position)."""
    mapping = torch.tensor(slots, dtype=torch.int64)
    _, _, _, _, heads, dim = pool.kv.shape
    k = torch.tensor(values, dtype=torch.float32)[:, None, None].expand(-1, heads, dim)
    k = k.contiguous()  # (stored in the pool's dtype by store_kv)
    for layer in range(pool.kv.shape[0]):
        store_kv(k, -k, pool.kv[layer, 0], pool.kv[layer, 1], mapping)
'''


def _lease_call(r: OpRecord, h: str, seq: Callable[[int], str], leases: dict[int, str]) -> str:
    """A lease operation as a plain call: `pool.lease(...)` with the recorded mode, holder and
    deadline, `lease.release()`, `pool.expire_leases(now_ns)` with the recorded now_ns."""
    part = r.lease
    lease_id = part.lease_id if part is not None else 0
    if r.op == _EXPIRE or part is None:
        return f"{h}.expire_leases({r.arg})"
    if r.op == _LEASE_RELEASE:
        return f"{leases.get(lease_id, f'lease{lease_id}')}.release()"
    target = seq(r.seq_id) if r.seq_id >= 0 else repr(list(r.blocks))
    when = "timeout=None" if part.deadline_ns == NO_DEADLINE else f"deadline_ns={part.deadline_ns}"
    call = f"{h}.lease({target}, {part.mode!r}, holder={part.holder!r}, {when})"
    if not lease_id:
        return call
    v = leases.setdefault(lease_id, f"lease{len(leases) + 1}")
    return f"{v} = {call}"


__all__ = [
    "OplogError",
    "Outcome",
    "ReplayError",
    "Shrinker",
    "emit_script",
    "replay",
]


# -- stepping through a log ---------------------------------------------------------------------


class Stepper:
    """A log's pool at any of its operations (`kvscope top DUMP --at N`): `goto(n)` replays the
    operations numbered up to n on a fresh pool (forward from where it is, or from the start
    going back), with each recorded fault armed where it fired, and `view()` is a consistent
    copy of that pool. Results are not compared (`kvscope replay` does)."""

    def __init__(self, log: OpLog):
        self.log = log
        self.ops = [r for r in log.records if r.op not in _MARKS]
        self._session: Session | None = None
        self._next = 0  # index in log.records of the next record to run
        self.at = 0  # the last operation run (0: none)
        self.record: OpRecord | None = None
        # a read-only mapping of the pool's segment, once the replay's own handle closed (a
        # CLOSE of the creator's process: the segment stays until the session ends)
        self._reader: Any = None
        self._layout: Any = None

    @property
    def first(self) -> int:
        return self.ops[0].seq if self.ops else 0

    @property
    def last(self) -> int:
        return self.ops[-1].seq if self.ops else 0

    def goto(self, n: int) -> None:
        """The pool after operation `n` (clamped to the log's: 0 before the first)."""
        n = max(0, min(n, self.last))
        if self._session is None or n < self.at:
            self.close()
            self._session = Session(self.log, arm=False)
            self._layout = self._session.pool.view.layout
            self._next = 0
            self.at = 0
            self.record = None
        records = self.log.records
        session = self._session
        with _quiet(True):
            while self._next < len(records) and records[self._next].seq <= n:
                r = records[self._next]
                self._next += 1
                if r.op in _MARKS:
                    if r.op == _START and r is not self.log.start:
                        session.attach(r)
                    continue
                if r.faults:
                    faults.ARMED.clear()
                    faults.ARMED.update({f: 1 for f in r.fault_names})
                try:
                    session.run(r)
                finally:
                    if r.faults:
                        faults.ARMED.clear()
                self.at = r.seq
                self.record = r

    def step(self, delta: int) -> None:
        """`delta` operations forward (or back)."""
        i = bisect.bisect_right([r.seq for r in self.ops], self.at) - 1  # (the op at `at`)
        j = max(-1, min(len(self.ops) - 1, i + delta))
        self.goto(0 if j < 0 else self.ops[j].seq)

    def view(self) -> Any:
        """A consistent copy of the pool now (a SegmentView)."""
        from kvscope.allocator.snapshot import snapshot

        assert self._session is not None, "goto first"
        pool = self._session.pool
        if not pool.closed:
            return snapshot(pool.view)
        if self._reader is None:
            from kvscope.allocator.segment import segment_path
            from kvscope.supervisor import map_readonly

            self._reader, fd = map_readonly(segment_path(self._session.name), self._layout)
            os.close(fd)
        return snapshot(self._reader)

    def describe(self) -> str:
        """Where it is: the operation and its request, of how many."""
        r = self.record
        if r is None:
            return f"before operation {self.first} (0/{len(self.ops)} in the log)"
        i = bisect.bisect_right([x.seq for x in self.ops], r.seq)
        what = f"{r.op_name} {r.request}".strip()
        found = f" found {','.join(k for k, _ in r.found)}" if r.found else ""
        # `seq` is the pool's operation counter (a START takes a number, other processes'
        # operations too), so it is told apart from the place in this log's operations.
        return f"operation {r.seq} ({i}/{len(self.ops)} in the log): {what}{found}"

    def close(self) -> None:
        self._reader = None
        if self._session is not None:
            self._session.close()
            self._session = None
