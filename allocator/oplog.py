"""The operation log (docs/REPLAY.md): what a recording handle's C core appends for every
public operation (csrc/oplog.c), and its reader.

A log is a file of chunks of compact records (docs/REPLAY.md), which the core's reader expands
to records of a fixed layout (records.py OPLOG_FIELDS, then the record's arrays): a START record
each time a handle begins recording (its JSON: the pool's geometry, the probes, the armed
faults, the pool's operation number then), then one record per operation with its global
sequence number (the segment's op_seq, shared by every process recording the pool), pid,
thread, arguments, results, status and the findings the core wrote in it. `read_log` checks
each chunk (magic, size, check) and raises `OplogError` with one line for a log that is
truncated or was edited.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvscope.allocator import oplogsnap
from kvscope.allocator.errors import OplogError
from kvscope.allocator.faults import FAULTS
from kvscope.allocator.records import (
    OPLOG_ANSWER,
    OPLOG_FAULT,
    OPLOG_FIELDS,
    OPLOG_FOUND_FIELDS,
    OPLOG_LEASE_FIELDS,
    OPLOG_READABLE,
    OPLOG_REDACTED,
    OPLOG_STORE_FIELDS,
    OPLOG_VERSION,
    OpCode,
    OpStatus,
    packed_offsets,
)

RECORD_OPS_ENV = "KVSCOPE_RECORD_OPS"
# With it, tokens and request ids are written as keyed hashes (an integer key; `kvscope run
# --record-ops FILE --redact` sets a random one).
RECORD_KEY_ENV = "KVSCOPE_RECORD_OPS_KEY"
# With it (a size: 64M, 1G, bytes), the log is bounded (docs/REPLAY.md "A bounded log";
# `kvscope run --record-ops-limit`).
RECORD_LIMIT_ENV = "KVSCOPE_RECORD_OPS_LIMIT"

HEAD = packed_offsets(OPLOG_FIELDS)[""]
FOUND = packed_offsets(OPLOG_FOUND_FIELDS)[""]
_LEASE_DTYPE = np.dtype(OPLOG_LEASE_FIELDS)
LEASE_OPS = (int(OpCode.LEASE), int(OpCode.LEASE_RELEASE), int(OpCode.EXPIRE_LEASES))
STORE_PART = packed_offsets(OPLOG_STORE_FIELDS)[""]
# What a STORE record's check compared there (its `arg`: bits).
STORE_BLOCKS, STORE_SLOTS = 1, 2
# The kinds the store check finds (probes/stores.py), in FindingKind's order.
STORE_KINDS = ("use_after_free", "published_block_modified", "unmapped_write")
# A lease's deadline when it has none (its timeout None).
NO_DEADLINE = 2**64 - 1
_NAMES = [f[0] for f in OPLOG_FIELDS]
_HEAD_DTYPE = np.dtype(OPLOG_FIELDS)
assert _HEAD_DTYPE.itemsize == HEAD  # (the heads are read with it, HEAD bytes apart)
_OFF = packed_offsets(OPLOG_FIELDS)
_N_AT, _NF_AT = _OFF["n_tokens"], _OFF["n_found"]
assert _OFF["faults"] - _N_AT == 20  # (n_tokens .. n_preempted, pool, faults: _complete's)

OP_NAMES = {int(o): o.name.lower() for o in OpCode}
STATUS_NAMES = {int(s): s.name.lower() for s in OpStatus}


# (the empty list every record without copies, preemptions or findings shares: never mutated)
_NONE: list[Any] = []


@dataclass(slots=True)
class LeasePart:
    """A lease operation's own arguments and results (OPLOG_LEASE_FIELDS): LEASE the take (its
    mode, holder, timeout and the deadline it set, the record and id it got, the generations of
    its blocks then), LEASE_RELEASE the lease it ended (record and id; mode and holder where it
    was held), EXPIRE_LEASES none (its now_ns is the record's `arg`)."""

    mode: str  # "read", "write" ("": none, or one the core refused)
    holder: str
    record: int  # the lease's record in the table (-1: none)
    lease_id: int
    timeout_ns: int  # 0: none
    deadline_ns: int  # on CLOCK_MONOTONIC; NO_DEADLINE: none
    generations: list[int] = field(default_factory=list)

    def to_dict(self, take: bool = True) -> dict[str, Any]:
        """Its keys (a release's: which lease, its mode and holder)."""
        d: dict[str, Any] = {
            "mode": self.mode,
            "holder": self.holder,
            "record": self.record,
            "lease_id": self.lease_id,
        }
        if take:
            d["timeout_ns"] = self.timeout_ns
            d["deadline_ns"] = None if self.deadline_ns == NO_DEADLINE else self.deadline_ns
            d["generations"] = self.generations
        return d


@dataclass(slots=True)
class StorePart:
    """A STORE record's store check input (OPLOG_STORE_FIELDS): the writers, as (seq id, start,
    end) spans in slot order, and the slot mapping the check compared (none where it checked
    the writers' blocks only: a CUDA store's slots are read back, and recorded, later)."""

    spans: list[tuple[int, int, int]]
    slots: list[int]
    what: int  # STORE_BLOCKS | STORE_SLOTS: what the check compared at this record
    ref: int  # a slots-only record's store: the number of the record that checked its blocks

    def to_dict(self) -> dict[str, Any]:
        return {
            "spans": [list(s) for s in self.spans],
            "slots": self.slots,
            "checked": [w for b, w in ((1, "blocks"), (2, "slots")) if self.what & b],
            **({"store": self.ref} if self.ref >= 0 else {}),
        }


@dataclass(slots=True)
class OpRecord:
    """One record of the log."""

    seq: int
    pid: int
    tid: int
    op: int
    status: int
    flags: int
    probes: int
    pool: int
    seq_id: int
    src_id: int
    arg: int
    result: int
    request: str
    time_ns: int
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    found: list[tuple[str, int]] = field(default_factory=list)
    start: dict[str, Any] | None = None
    offset: int = 0
    faults: int = 0  # the injected faults that fired (bit i: faults.FAULTS[i])
    lease: LeasePart | None = None  # a lease operation's (LEASE_OPS)
    store: StorePart | None = None  # a STORE's
    state: bytes | None = None  # a SNAPSHOT's bytes (allocator/checkpoint.py)

    @property
    def op_name(self) -> str:
        return OP_NAMES.get(self.op, f"op{self.op}")

    @property
    def status_name(self) -> str:
        return STATUS_NAMES.get(self.status, f"status{self.status}")

    @property
    def fault(self) -> bool:
        return bool(self.flags & OPLOG_FAULT)

    @property
    def fault_names(self) -> list[str]:
        """The injected faults that fired in the operation (or since the record before)."""
        return [f for i, f in enumerate(FAULTS) if self.faults >> i & 1]

    @property
    def redacted(self) -> bool:
        return bool(self.flags & OPLOG_REDACTED)

    @property
    def answer(self) -> bool:
        """A REPORT of a device check's answer, applied at a settle after the operation that
        queued the check (a CUDA pool's: docs/REPLAY.md), that operation's number its
        `src_id` (-1: none known)."""
        return self.op == OpCode.REPORT and self.arg == OPLOG_ANSWER

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "seq": self.seq,
            "pid": self.pid,
            "tid": self.tid,
            "op": self.op_name,
            "status": self.status_name,
            "request": self.request,
        }
        if self.seq_id >= 0:
            d["seq_id"] = self.seq_id
        if self.src_id >= 0:
            d["src_id"] = self.src_id
        if self.answer:
            d["answers"] = self.src_id  # (the operation whose device check it answers)
        if self.op in (
            OpCode.MARK_COMPUTED,
            OpCode.EVICT,
            OpCode.SET_STATE,
            OpCode.LOST,
            OpCode.EXPIRE_LEASES,
        ):
            d["arg"] = self.arg
        if self.op in (OpCode.ALLOCATE, OpCode.MARK_COMPUTED, OpCode.RESUME, OpCode.EVICT):
            d["result"] = self.result
        if self.op in LEASE_OPS:
            d["result"] = self.result
        if self.lease is not None and self.op != OpCode.EXPIRE_LEASES:
            d["lease"] = self.lease.to_dict(take=self.op == OpCode.LEASE)
        if self.store is not None:
            d["store"] = self.store.to_dict()
        if self.tokens and self.lease is None:
            d["tokens"] = self.tokens
        d["blocks"] = self.blocks
        if self.copies:
            d["copies"] = [list(c) for c in self.copies]
        if self.preempted:
            d["preempted"] = self.preempted
        d["found"] = [{"kind": k, "block": b} for k, b in self.found]
        if self.fault:
            d["fault"] = True
            if self.faults:
                d["faults"] = self.fault_names
        return d


def pool_tag(name: str, created_ns: int) -> int:
    """The tag of a pool in every record of its log (a log may hold several pools')."""
    return zlib.crc32(f"{name}:{created_ns}".encode())


def _ints(buf: bytes, pos: int, n: int, code: str) -> list:
    return list(struct.unpack_from(f"<{n}{code}", buf, pos)) if n else []


def _complete(r: OpRecord, buf: bytes, pos: int, name: str) -> None:
    """A record's START text, fired faults, copies, preemptions and findings, from its bytes
    at `pos` (OPLOG_FIELDS' layout)."""
    nt, nb, nc, npre, fired = struct.unpack_from("<IIIIxxxxI", buf, pos + _N_AT)
    nf = buf[pos + _NF_AT]
    r.faults = fired
    if r.op in LEASE_OPS:
        # (after the arrays: its lease part; its tokens are the generations, u4)
        p = pos + HEAD + 4 * nt + 4 * nb + 8 * nc + 8 * npre + FOUND * nf
        part = np.frombuffer(buf, dtype=_LEASE_DTYPE, count=1, offset=p)[0]
        r.lease = LeasePart(
            {1: "read", 2: "write"}.get(int(part["mode"]), ""),
            bytes(part["holder"]).rstrip(b"\0").decode("utf-8", "replace"),
            int(part["record"]),
            int(part["lease_id"]),
            int(part["timeout_ns"]),
            int(part["deadline_ns"]),
            [g & 0xFFFF_FFFF for g in r.tokens],
        )
        r.tokens = []
    if r.op == OpCode.STORE:
        # (after the arrays: its store part, then its spans and slots, int64)
        p = pos + HEAD + 4 * nb + 8 * nc + 8 * npre + FOUND * nf
        n_spans, n_slots = struct.unpack_from("<II", buf, p)
        flat = _ints(buf, p + STORE_PART, 3 * n_spans + n_slots, "q")
        spans = list(
            zip(flat[0 : 3 * n_spans : 3], flat[1 : 3 * n_spans : 3], flat[2 : 3 * n_spans : 3])
        )
        r.store = StorePart(spans[:n_spans], flat[3 * n_spans :], r.arg, r.src_id)
    if r.op == OpCode.SNAPSHOT:
        r.state = bytes(buf[pos + HEAD : pos + HEAD + nt])
        return
    if r.op == OpCode.START:
        try:
            r.start = json.loads(buf[pos + HEAD : pos + HEAD + nt].decode())
        except ValueError:
            raise OplogError(f"{name}: the start record at offset {pos} is not JSON") from None
        if not isinstance(r.start, dict):
            raise OplogError(f"{name}: the start record at offset {pos} is not an object")
        return
    if nc or npre or nf:
        p = pos + HEAD + 4 * nt + 4 * nb
        flat = _ints(buf, p, 2 * nc, "i")
        r.copies = list(zip(flat[::2], flat[1::2]))
        p += 8 * nc
        r.preempted = _ints(buf, p, npre, "q")
        p += 8 * npre
        found = []
        for _ in range(nf):
            (block,) = struct.unpack_from("<i", buf, p)
            kind = buf[p + 4 : p + FOUND].rstrip(b"\0").decode("ascii", "replace")
            found.append((kind, block))
            p += FOUND
        r.found = found


def parse(buf: bytes, name: str, at: list[int], lists: list, heads: bytes) -> list[OpRecord]:
    """The records the core's reader expanded (oplog_expand: each chunk checked there) into
    `buf`, records of OPLOG_FIELDS' layout at offsets `at`, with their tokens and tables as
    `lists` and their fixed parts `heads`, in their order; OplogError (one line) where a record
    holds what no core writes."""
    if not at:
        return []
    n = len(at)
    hdr = np.frombuffer(heads, dtype=_HEAD_DTYPE)
    col = {name: hdr[name].tolist() for name in _NAMES if name not in ("magic", "check")}
    start_op = int(OpCode.START)
    op_a = hdr["op"].astype(np.int64)
    bad_a = ~np.isin(op_a, list(OP_NAMES)) | ~np.isin(hdr["status"], list(STATUS_NAMES))
    if bad_a.any():
        bad_at = at[int(np.flatnonzero(bad_a)[0])]
        raise OplogError(f"{name}: record at offset {bad_at} holds what no core writes")
    requests = col["request"]  # (numpy's S32 items: their trailing zeros dropped)
    names = {b: b.decode("utf-8", "replace") for b in set(requests)}
    nones = [_NONE] * n
    # the records built at once, then the few with more to them completed from their bytes
    out = list(
        map(
            OpRecord,
            col["seq"],
            col["pid"],
            col["tid"],
            col["op"],
            col["status"],
            col["flags"],
            col["probes"],
            col["pool"],
            col["seq_id"],
            col["src_id"],
            col["arg"],
            col["result"],
            [names[b] for b in requests],
            col["time_ns"],
            lists[0::2],
            lists[1::2],
            nones,
            nones,
            nones,
        )
    )
    more = (op_a == start_op) | (hdr["faults"] != 0)
    more |= np.isin(op_a, (*LEASE_OPS, OpCode.STORE, OpCode.SNAPSHOT))
    more |= (hdr["n_copies"] != 0) | (hdr["n_preempted"] != 0) | (hdr["n_found"] != 0)
    for k in np.flatnonzero(more).tolist():
        _complete(out[k], buf, at[k], name)
    return out


def parse_log(data: bytes, name: str = "log", base: int = 0) -> list[OpRecord]:
    """Every record of a log file's bytes (chunks of compact records, csrc/oplog.c), expanded
    by the core's reader (csrc/oplogread.c) and sorted by pool and number, each record's
    `offset` its chunk's in the file (`data` read from offset `base`: a bounded log's first
    chunk after its hole); OplogError (one line) where a chunk is cut short, fails its check or
    holds what no core writes."""
    from kvscope.allocator import _native  # (the core's reader)

    try:
        expanded, chunks, at, lists, heads = _native.oplog_expand(data)
    except ValueError as e:
        msg = re.sub(r"offset (\d+)", lambda m: f"offset {int(m.group(1)) + base}", str(e))
        raise OplogError(f"{name}: {msg}") from None
    records = parse(expanded, name, np.frombuffer(at, dtype=np.int64).tolist(), lists, heads)
    for r, at in zip(records, np.frombuffer(chunks, dtype=np.int64).tolist()):
        r.offset = at + base
    return records


@dataclass
class OpLog:
    """The records of one pool in a log, in operation order."""

    path: str
    records: list[OpRecord]
    start: OpRecord  # the creator's START (or the first one)
    pools: int  # pools the file holds records of
    # numbers missing between the records (first, last): lost, or a process that did not record
    gaps: list[tuple[int, int]] = field(default_factory=list)
    # where the log does not begin at the pool's creation: the snapshot it starts from
    # (allocator/oplogsnap.py Snapshot; `start` is then its SNAPSHOT record, whose `start` is
    # its writer's START), the records after it; the STARTs of each process before it, by pid
    snapshot: Any = None
    starts: dict[int, dict[str, Any]] = field(default_factory=dict)
    # a bounded log's bytes dropped before its first chunk (the hole its checkpoints punched)
    dropped: int = 0
    # the numbers of the STARTs after the log's start whose handle ran operations no record
    # holds (`unrecorded`) and after which the log holds no snapshot: a replay stops there
    breaks: list[int] = field(default_factory=list)
    # the names of the other pools the file holds records of, in the file's order
    others: list[str] = field(default_factory=list)

    _stores: dict[int, int] | None = field(default=None, repr=False, compare=False)
    _answers: dict[int, list[OpRecord]] | None = field(default=None, repr=False, compare=False)
    _kv: bool | None = field(default=None, repr=False, compare=False)

    @property
    def ops(self) -> list[OpRecord]:
        return [r for r in self.records if r.op not in (OpCode.START, OpCode.SNAPSHOT)]

    def replays_kv(self) -> bool:
        """Whether a replay of this log writes its stores and copies into its own K/V
        (docs/REPLAY.md "What replays"): where the log starts at the pool's creation (a
        snapshot holds no K/V) and the program told the pool of its block copies (a COPY
        record), or had none to make (no copy-on-write pair). A program that copies without
        telling the pool (copy_blocks without `pool=`) would leave every copy it made missing
        in the replay: its K/V is not replayed, as before COPY records."""
        if self._kv is None:
            copy, pairs = int(OpCode.COPY), False
            for r in self.records:
                if r.op == copy:
                    self._kv = self.snapshot is None
                    return self._kv
                pairs = pairs or bool(r.copies)
            self._kv = self.snapshot is None and not pairs
        return self._kv

    def store_reports(self) -> dict[int, int]:
        """The REPORT records that are a store check's findings, by number, each to the number
        of its STORE: the REPORTs of the kinds the check finds (STORE_KINDS) that follow a
        STORE on its thread (pid, tid) before any other record of that thread; and so a copy
        check's, to its COPY (`KVPool.copied`: a copy into a block that is no copy-on-write
        destination)."""
        if self._stores is None:
            out: dict[int, int] = {}
            last: dict[tuple[int, int], int] = {}
            for r in self.records:
                key = (r.pid, r.tid)
                if r.op in (OpCode.STORE, OpCode.COPY):
                    last[key] = r.seq
                elif (
                    r.op == OpCode.REPORT
                    and key in last
                    and r.found
                    and all(k in STORE_KINDS for k, _ in r.found)
                    and not r.answer  # (a device check's answer, applied after the STORE)
                ):
                    out[r.seq] = last[key]
                elif key in last:
                    del last[key]
            self._stores = out
        return self._stores

    def answer_reports(self) -> dict[int, list[OpRecord]]:
        """The REPORTs of device checks' answers (OpRecord.answer) that name an operation
        among the log's records, by that operation's number: a replay compares them there
        (docs/REPLAY.md "What replays")."""
        if self._answers is None:
            report, mark = int(OpCode.REPORT), (OpCode.START, OpCode.SNAPSHOT)
            answers = [r for r in self.records if r.op == report and r.arg == OPLOG_ANSWER]
            ops = {r.seq for r in self.records if r.op not in mark} if answers else set()
            out: dict[int, list[OpRecord]] = {}
            for r in answers:
                if r.src_id in ops and r.src_id < r.seq:
                    out.setdefault(r.src_id, []).append(r)
            self._answers = out
        return self._answers


def read_log(path: str, pool: str | None = None) -> OpLog:
    """The records of one pool of the log at `path` (its first START's, or the pool named
    `pool`), sorted by their sequence numbers; OplogError (one line) for a log that cannot be
    replayed: unreadable, truncated, edited, without a start, or with numbers missing.

    A log that holds the pool's creation START starts there; one that does not (a recording
    that began on a pool with a history, a bounded log whose older records were dropped)
    starts at a SNAPSHOT of the pool (allocator/oplogsnap.py): the first one after the last
    numbers missing before it, so that the records after it are whole (a bounded log's oldest
    checkpoint: every record the file still holds is replayed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise OplogError(f"{path}: {e.strerror or e}") from None
    try:
        base = oplogsnap.data_start(fd)
        size = os.fstat(fd).st_size
        buf = os.pread(fd, size - base, base) if size > base else b""
    except OSError as e:
        raise OplogError(f"{path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if not buf:
        raise OplogError(f"{path}: empty: no operation was recorded")
    records = parse_log(buf, path, base)
    snap_op = int(OpCode.SNAPSHOT)
    starts = [r for r in records if r.op == OpCode.START]
    snaps = [r for r in records if r.op == snap_op]
    if not starts and not snaps:
        raise OplogError(f"{path}: no start record (not an operation log from its beginning)")
    named: dict[int, str] = {}
    for r in starts:
        named.setdefault(r.pool, str((r.start or {}).get("pool")))
    for r in snaps:
        if r.pool not in named:
            named[r.pool] = str(oplogsnap.meta_of(r.state or b"", path).get("pool"))
    # (the file's first pool, where none is named: the records are sorted by pool tag)
    tag = min(starts or snaps, key=lambda r: r.offset).pool
    if pool is not None:
        tags = [t for t, n in named.items() if n == pool]
        if not tags:
            names = sorted(set(named.values()))
            raise OplogError(f"{path}: no pool {pool!r} in the log (it holds {', '.join(names)})")
        tag = tags[0]
    mine = records if len(named) == 1 else [r for r in records if r.pool == tag]
    # the other pools the file holds, in the file's order (a replay says it skipped them)
    first_at: dict[int, int] = {}
    for r in starts + snaps:
        first_at[r.pool] = min(first_at.get(r.pool, r.offset), r.offset)
    others = [named[t] for t in sorted(first_at, key=first_at.__getitem__) if t != tag]
    seqs = np.fromiter((r.seq for r in mine), dtype=np.int64, count=len(mine))
    step = np.diff(seqs)
    if len(step) and step.min() < 1:  # (records of several processes, not in order in the file)
        order = np.argsort(seqs, kind="stable")
        mine = [mine[i] for i in order.tolist()]
        seqs = seqs[order]
        step = np.diff(seqs)
    versions = [(r.start or {}).get("version") for r in starts if r.pool == tag]
    for r in snaps:
        if r.pool == tag:
            versions.append(oplogsnap.meta_of(r.state or b"", path).get("start", {}).get("version"))
    for v in versions:
        if v not in OPLOG_READABLE:
            readable = " and ".join(str(x) for x in OPLOG_READABLE)
            raise OplogError(f"{path}: log version {v!r}, this kvscope reads {readable}")
    twice = np.flatnonzero(step == 0)
    if len(twice):
        raise OplogError(f"{path}: operation {int(seqs[twice[0]])} is recorded twice")
    # numbers missing: records a process did not get to write (killed with records not yet
    # written), or a process that did not record; a replay stops there
    gaps = [(int(seqs[i]) + 1, int(seqs[i + 1]) - 1) for i in np.flatnonzero(step > 1).tolist()]
    creators = [r for r in starts if r.pool == tag and from_creation(r.start)]
    points = [r for r in mine if r.op == snap_op]
    # a handle that began recording after operations no record holds (its START's
    # `unrecorded`; unrecorded operations take no number, so no gap shows them): the records
    # before it do not lead to the pool after it. A replay starts at the snapshot that follows
    # it, or, where none does (a redacted recording writes none), stops there.
    breaks = [
        r.seq
        for r in mine
        if r.op == OpCode.START and (r.start or {}).get("unrecorded") and r.seq > int(seqs[0])
    ]
    cut = max(breaks, default=0)
    if not any(p.seq > cut for p in points):
        cut = 0
    if creators and not cut:
        return OpLog(
            path, mine, creators[0], len(named), gaps, dropped=base, breaks=breaks, others=others
        )
    if not points:
        first_start = next((r for r in mine if r.op == OpCode.START), mine[0])
        return OpLog(
            path, mine, first_start, len(named), gaps, dropped=base, breaks=breaks, others=others
        )
    # the first snapshot after the last numbers missing before one (else the last one), and
    # after the last break that one follows
    after_gap = max((b for _, b in gaps if any(p.seq > b for p in points)), default=0)
    after_gap = max(after_gap, cut)
    at = next((p for p in points if p.seq > after_gap), points[-1])
    snap = oplogsnap.parse(at.state or b"", path)
    at.start = snap.start
    by_pid: dict[int, dict[str, Any]] = {}
    for r in mine:  # (each process's last START before the snapshot, else its first after)
        if r.op == OpCode.START and r.start is not None and (r.seq < at.seq or r.pid not in by_pid):
            by_pid[r.pid] = r.start
    kept = [r for r in mine if r.seq > at.seq]  # (later snapshots too: numbered, not run)
    try:
        snap.complete(kept)
    except (ValueError, TypeError, OverflowError, ZeroDivisionError) as e:  # (no layout)
        raise OplogError(f"{path}: the snapshot record's segment is not one: {e}") from None
    kept_seqs = [at.seq] + [r.seq for r in kept]
    gaps = [
        (kept_seqs[i] + 1, kept_seqs[i + 1] - 1)
        for i in range(len(kept_seqs) - 1)
        if kept_seqs[i + 1] - kept_seqs[i] > 1
    ]
    return OpLog(
        path,
        kept,
        at,
        len(named),
        gaps,
        snapshot=snap,
        starts=by_pid,
        dropped=base,
        breaks=[b for b in breaks if b > at.seq],
        others=others,
    )


def from_creation(start: dict[str, Any] | None) -> bool:
    """Whether a START's handle recorded from the pool's creation (the pool's start state is
    a fresh pool's): its creator's, on a pool with no history then."""
    return bool((start or {}).get("created")) and not (start or {}).get("history")


def start_text(
    name: str,
    created: bool,
    config: Any,
    probes: Any,
    lockdep: bool,
    guard_sample: int,
    op_seq: int,
    redacted: bool,
    provenance_sample: int = 0,
    history: bool = False,
    unrecorded: bool = False,
) -> str:
    """A recording handle's START record (KVPool.record_ops): what a replay needs to rebuild
    its pool: the geometry, the probes (`probes`: a ProbeFlags, or None), lockdep's tracing,
    sampled guard mode, slot provenance's sample, the faults armed in this process and the
    pool's operation number; `history`: the pool had a history the log does not hold (a
    SNAPSHOT of it follows, unless redacted: allocator/checkpoint.py), so that even a creator's
    START is no start state then; `unrecorded`: this handle ran operations no record in the
    file holds (before it began recording, or since it last stopped recording into the file):
    the records before this START do not lead to the pool after it (a replay starts at the
    snapshot after it, or stops there)."""
    from kvscope.allocator import faults

    geometry = {
        k: getattr(config, k)
        for k in (
            "num_blocks",
            "block_size",
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "dtype",
            "max_seqs",
            "max_blocks_per_seq",
            "max_clients",
            "local_cache_size",
            "num_shards",
            "event_capacity",
            "guard",
            "events",
            "lockdep",
            "quarantine",
        )
    }
    flags = None
    if probes is not None:
        flags = {
            k: bool(getattr(probes, k))
            for k in ("events", "ownership", "guard", "leaks", "magic", "digest")
        }
    return json.dumps(
        {
            "version": OPLOG_VERSION,
            "pool": name,
            "created": created,
            "pid": os.getpid(),
            "device": str(config.device),
            "config": geometry,
            "probes": flags,
            "lockdep": lockdep,
            "guard_sample": guard_sample,
            "provenance_sample": provenance_sample,
            "faults": dict(faults.ARMED),
            "op_seq": op_seq,
            "redacted": redacted,
            "history": history,
            "unrecorded": unrecorded,
        },
        sort_keys=True,
    )
