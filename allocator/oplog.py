"""The operation log (docs/REPLAY.md): what a recording handle's C core appends for every
public operation (csrc/oplog.c), and its reader.

A log is a file of records (records.py OPLOG_FIELDS, then the record's arrays): a START record
each time a handle begins recording (its JSON: the pool's geometry, the probes, the armed
faults, the pool's operation number then), then one record per operation with its global
sequence number (the segment's op_seq, shared by every process recording the pool), pid,
thread, arguments, results, status and the findings the core wrote in it. `read_log` checks
each record (magic, size, CRC-32) and raises `OplogError` with one line for a log that is
truncated or was edited.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from kvscope.allocator.records import (
    OPLOG_FAULT,
    OPLOG_FIELDS,
    OPLOG_FOUND_FIELDS,
    OPLOG_MAGIC,
    OPLOG_REDACTED,
    OPLOG_VERSION,
    OpCode,
    OpStatus,
    packed_offsets,
)

RECORD_OPS_ENV = "KVSCOPE_RECORD_OPS"
# With it, tokens and request ids are written as keyed hashes (an integer key; `kvscope run
# --record-ops FILE --redact` sets a random one).
RECORD_KEY_ENV = "KVSCOPE_RECORD_OPS_KEY"

HEAD = packed_offsets(OPLOG_FIELDS)[""]
FOUND = packed_offsets(OPLOG_FOUND_FIELDS)[""]
_FMT = {"<u4": "I", "<i4": "i", "<u8": "Q", "<i8": "q", "u1": "B"}
_HEAD_STRUCT = struct.Struct(
    "<" + "".join(f"{f[1][1:]}s" if f[1].startswith("S") else _FMT[f[1]] for f in OPLOG_FIELDS)
)
_NAMES = [f[0] for f in OPLOG_FIELDS]
_I = {name: i for i, name in enumerate(_NAMES)}
assert _HEAD_STRUCT.size == HEAD

OP_NAMES = {int(o): o.name.lower() for o in OpCode}
STATUS_NAMES = {int(s): s.name.lower() for s in OpStatus}


class OplogError(ValueError):
    """A log that cannot be read as one: its one-line reason."""


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
    def redacted(self) -> bool:
        return bool(self.flags & OPLOG_REDACTED)

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
        if self.op in (OpCode.MARK_COMPUTED, OpCode.EVICT, OpCode.SET_STATE, OpCode.LOST):
            d["arg"] = self.arg
        if self.op in (OpCode.ALLOCATE, OpCode.MARK_COMPUTED, OpCode.RESUME, OpCode.EVICT):
            d["result"] = self.result
        if self.tokens:
            d["tokens"] = self.tokens
        d["blocks"] = self.blocks
        if self.copies:
            d["copies"] = [list(c) for c in self.copies]
        if self.preempted:
            d["preempted"] = self.preempted
        d["found"] = [{"kind": k, "block": b} for k, b in self.found]
        if self.fault:
            d["fault"] = True
        return d


def pool_tag(name: str, created_ns: int) -> int:
    """The tag of a pool in every record of its log (a log may hold several pools')."""
    return zlib.crc32(f"{name}:{created_ns}".encode())


def _ints(buf: bytes, pos: int, n: int, code: str) -> list:
    return list(struct.unpack_from(f"<{n}{code}", buf, pos)) if n else []


def parse(buf: bytes, name: str = "log") -> list[OpRecord]:
    """Every record of a log's bytes, in file order; OplogError (one line) where a record is
    cut short, fails its check or holds what no core writes."""
    out: list[OpRecord] = []
    pos, end = 0, len(buf)
    unpack = _HEAD_STRUCT.unpack_from
    crc = zlib.crc32
    while pos < end:
        if end - pos < HEAD:
            raise OplogError(
                f"{name}: truncated: {end - pos} bytes at offset {pos} are not a record"
            )
        v = unpack(buf, pos)
        magic, size = v[0], v[1]
        if magic != OPLOG_MAGIC:
            raise OplogError(f"{name}: offset {pos} is not a record (bad magic {magic:#x})")
        if size < HEAD or size % 8:
            raise OplogError(f"{name}: record at offset {pos} has an impossible size {size}")
        if pos + size > end:
            raise OplogError(
                f"{name}: truncated: the record at offset {pos} needs {size} bytes, "
                f"{end - pos} are left"
            )
        rec = buf[pos : pos + size]
        check = v[_I["check"]]
        if crc(rec[:16] + b"\0" * 8 + rec[24:]) != check:
            raise OplogError(
                f"{name}: record at offset {pos} (seq {v[_I['seq']]}) fails its check: "
                "the log was edited or damaged"
            )
        op = v[_I["op"]]
        nt, nb, nc, npre, nf = (
            v[_I["n_tokens"]],
            v[_I["n_blocks"]],
            v[_I["n_copies"]],
            v[_I["n_preempted"]],
            v[_I["n_found"]],
        )
        tok_bytes = nt if op == OpCode.START else 4 * nt
        need = HEAD + tok_bytes + 4 * nb + 8 * nc + 8 * npre + FOUND * nf
        if op not in OP_NAMES or v[_I["status"]] not in STATUS_NAMES or need > size:
            raise OplogError(f"{name}: record at offset {pos} holds what no core writes")
        p = HEAD
        r = OpRecord(
            seq=v[_I["seq"]],
            pid=v[_I["pid"]],
            tid=v[_I["tid"]],
            op=op,
            status=v[_I["status"]],
            flags=v[_I["flags"]],
            probes=v[_I["probes"]],
            pool=v[_I["pool"]],
            seq_id=v[_I["seq_id"]],
            src_id=v[_I["src_id"]],
            arg=v[_I["arg"]],
            result=v[_I["result"]],
            request=v[_I["request"]].rstrip(b"\0").decode("utf-8", "replace"),
            time_ns=v[_I["time_ns"]],
            offset=pos,
        )
        if op == OpCode.START:
            try:
                r.start = json.loads(rec[p : p + nt].decode())
            except ValueError:
                raise OplogError(f"{name}: the start record at offset {pos} is not JSON") from None
            if not isinstance(r.start, dict):
                raise OplogError(f"{name}: the start record at offset {pos} is not an object")
        else:
            r.tokens = _ints(rec, p, nt, "i")
        p += tok_bytes
        r.blocks = _ints(rec, p, nb, "i")
        p += 4 * nb
        flat = _ints(rec, p, 2 * nc, "i")
        r.copies = list(zip(flat[::2], flat[1::2]))
        p += 8 * nc
        r.preempted = _ints(rec, p, npre, "q")
        p += 8 * npre
        for _ in range(nf):
            (block,) = struct.unpack_from("<i", rec, p)
            kind = rec[p + 4 : p + FOUND].rstrip(b"\0").decode("ascii", "replace")
            r.found.append((kind, block))
            p += FOUND
        out.append(r)
        pos += size
    return out


@dataclass
class OpLog:
    """The records of one pool in a log, in operation order."""

    path: str
    records: list[OpRecord]
    start: OpRecord  # the creator's START (or the first one)
    pools: int  # pools the file holds records of

    @property
    def ops(self) -> list[OpRecord]:
        return [r for r in self.records if r.op != OpCode.START]


def read_log(path: str, pool: str | None = None) -> OpLog:
    """The records of one pool of the log at `path` (its first START's, or the pool named
    `pool`), sorted by their sequence numbers; OplogError (one line) for a log that cannot be
    replayed: unreadable, truncated, edited, without a start, or with numbers missing."""
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except OSError as e:
        raise OplogError(f"{path}: {e.strerror or e}") from None
    if not buf:
        raise OplogError(f"{path}: empty: no operation was recorded")
    records = parse(buf, path)
    starts = [r for r in records if r.op == OpCode.START]
    if not starts:
        raise OplogError(f"{path}: no start record (not an operation log from its beginning)")
    tags = {r.pool for r in starts}
    chosen = starts[0]
    if pool is not None:
        named = [r for r in starts if r.start and r.start.get("pool") == pool]
        if not named:
            names = sorted({str(r.start.get("pool")) for r in starts if r.start})
            raise OplogError(f"{path}: no pool {pool!r} in the log (it holds {', '.join(names)})")
        chosen = named[0]
    mine = sorted((r for r in records if r.pool == chosen.pool), key=lambda r: r.seq)
    for r in mine:
        if r.start is not None and r.start.get("version") != OPLOG_VERSION:
            raise OplogError(
                f"{path}: log version {r.start.get('version')!r}, this kvscope reads {OPLOG_VERSION}"
            )
    seqs = [r.seq for r in mine]
    for a, b in zip(seqs, seqs[1:]):
        if b == a:
            raise OplogError(f"{path}: operation {a} is recorded twice")
        if b != a + 1:
            raise OplogError(
                f"{path}: operations {a + 1}..{b - 1} are missing (records lost, or written by "
                "a process that did not record)"
            )
    creators = [r for r in mine if r.start and r.start.get("created")]
    first = creators[0] if creators else mine[0]
    return OpLog(path, mine, first, len(tags))


def start_text(
    name: str,
    created: bool,
    config: Any,
    probes: Any,
    lockdep: bool,
    guard_sample: int,
    op_seq: int,
    redacted: bool,
) -> str:
    """A recording handle's START record (KVPool.record_ops): what a replay needs to rebuild
    its pool: the geometry, the probes (`probes`: a ProbeFlags, or None), lockdep's tracing,
    sampled guard mode, the faults armed in this process and the pool's operation number."""
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
            "faults": dict(faults.ARMED),
            "op_seq": op_seq,
            "redacted": redacted,
        },
        sort_keys=True,
    )
