"""The SNAPSHOT record of the operation log, read (docs/REPLAY.md "Starting from a snapshot"):
its bytes as a Snapshot, and where a bounded log's chunks begin after the hole its checkpoints
punched. allocator/checkpoint.py writes it and restores a pool from it.

A SNAPSHOT's bytes:

    b"KVSS", u32 length of the JSON, the JSON (its `meta`), zlib of the ranges' bytes in order

`meta`: version, pool, op_seq (the last number in it), size (the segment's), offsets (the
sections'), ranges ([start, end) each), crc32 (of the uncompressed bytes), client (the writer's
client record), reserve (the writer's slot reserve and sequence ids, which its core holds and
the segment does not: [slots, next_id, end_id]), start (the writer's START: geometry, probes,
faults: oplog.start_text's) and a bounded log's ring (limit, drops_before).
"""

from __future__ import annotations

import errno
import json
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvscope.allocator.errors import OplogError
from kvscope.allocator.layout import HEADER_DTYPE, Layout, SegmentView, SeqState, field_text
from kvscope.allocator.records import OPLOG_CHUNK_FIELDS, OPLOG_CHUNK_MAGIC, OpCode, packed_offsets

MAGIC = b"KVSS"
VERSION = 1
_CHUNK = packed_offsets(OPLOG_CHUNK_FIELDS)
OPLOG_CHUNK = _CHUNK[""]  # (a chunk's header: its first record follows)
_TAG_AT = _CHUNK["pool"]
# The states of a live sequence's record.
LIVE = (int(SeqState.RUNNING), int(SeqState.WAITING), int(SeqState.PREEMPTED))


@dataclass
class Snapshot:
    """A SNAPSHOT record's contents: its meta and the segment's bytes (the ranges it holds,
    zeros elsewhere)."""

    meta: dict[str, Any]
    raw: np.ndarray  # uint8, the segment's size

    @property
    def start(self) -> dict[str, Any]:
        return dict(self.meta.get("start") or {})

    @property
    def client(self) -> int:
        return int(self.meta["client"])

    def view(self, layout: Any = None) -> SegmentView:
        if layout is None:
            h = np.frombuffer(self.raw, HEADER_DTYPE, 1)[0]
            layout = Layout.from_header(h)
        return SegmentView(self.raw, layout)

    def complete(self, records: list[Any]) -> None:
        """The records after it (in number order) with what the reader could not give them,
        the records before it being gone: the block table entries an append's record keeps
        from the sequence's record before (-1 there), and the request id an operation on a
        live sequence leaves out, from the snapshot's sequence table."""
        seqs = self.view().seqs
        live = np.flatnonzero(np.isin(seqs["state"], LIVE))
        tables = {
            int(seqs["seq_id"][i]): [int(b) for b in seqs["table"][i][: int(seqs["num_blocks"][i])]]
            for i in live
        }
        requests = {int(seqs["seq_id"][i]): field_text(seqs["request"][i]) for i in live}
        skip = (int(OpCode.LEASE), int(OpCode.LEASE_RELEASE), int(OpCode.EXPIRE_LEASES))
        store = int(OpCode.STORE)
        for r in records:
            if r.seq_id < 0 or r.op in skip or r.op == store:
                continue
            base = tables.get(r.seq_id)
            if base is not None and r.blocks and min(r.blocks) < 0:
                r.blocks = [
                    base[j] if b < 0 and j < len(base) else b for j, b in enumerate(r.blocks)
                ]
            if not r.request:
                r.request = requests.get(r.seq_id) or requests.get(r.src_id, "")
            if r.blocks or r.op in (int(OpCode.ALLOCATE), int(OpCode.FORK)):
                tables[r.seq_id] = list(r.blocks)
            requests.setdefault(r.seq_id, r.request)


def meta_of(payload: bytes, where: str) -> dict[str, Any]:
    """A SNAPSHOT record's description alone (its JSON: the pool, the writer's START), without
    its bytes; OplogError (one line) where it is not one."""
    if payload[:4] != MAGIC or len(payload) < 8:
        raise OplogError(f"{where}: the snapshot record is not one (bad magic)")
    (n,) = struct.unpack_from("<I", payload, 4)
    try:
        meta = json.loads(payload[8 : 8 + n].decode())
    except ValueError:
        raise OplogError(f"{where}: the snapshot record's description is not JSON") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("start", {}), dict):
        raise OplogError(f"{where}: the snapshot record's description is not an object")
    return meta


def parse(payload: bytes, where: str) -> Snapshot:
    """A SNAPSHOT record's bytes as a Snapshot; OplogError (one line) where they are not one."""
    bad = f"{where}: the snapshot record"
    meta = meta_of(payload, where)
    (n,) = struct.unpack_from("<I", payload, 4)
    if meta.get("version") != VERSION:
        raise OplogError(f"{bad} is of another version ({meta.get('version')!r})")
    try:
        size = int(meta["size"])
        ranges = [(int(a), int(b)) for a, b in meta["ranges"]]
        int(meta["client"]), int(meta["op_seq"])
        slots, next_id, end_id = meta["reserve"]
        [int(s) for s in slots], int(next_id), int(end_id)
        dict(meta["offsets"])
        crc = int(meta["crc32"])
    except (KeyError, TypeError, ValueError):
        raise OplogError(f"{bad}'s description lacks what a snapshot holds") from None
    if not 0 < size <= 1 << 40 or any(not 0 <= a <= b <= size for a, b in ranges):
        raise OplogError(f"{bad}'s ranges are not in its segment")
    try:
        data = zlib.decompress(payload[8 + n :])
    except zlib.error:
        raise OplogError(f"{bad}'s bytes are damaged (zlib)") from None
    if len(data) != sum(b - a for a, b in ranges) or zlib.crc32(data) != crc:
        raise OplogError(f"{bad}'s bytes are not the ones it describes (cut short or edited)")
    # (the segment's other sections, not in it, are some times its size at most: its event
    # rings and slot provenance)
    if size > 64 * len(data) + (1 << 26) or int(dict(meta["offsets"]).get("end", -1)) != size:
        raise OplogError(f"{bad}'s segment size is not the one its sections give")
    try:
        raw = np.zeros(size, np.uint8)
    except MemoryError:
        raise OplogError(f"{bad}'s segment is too large to restore here") from None
    at = 0
    for a, b in ranges:
        raw[a:b] = np.frombuffer(data, np.uint8, b - a, at)
        at += b - a
    return Snapshot(meta, raw)


def data_start(fd: int) -> int:
    """The offset of a log file's first chunk: past the hole a bounded log's checkpoints
    punched (zeros to the first chunk: the punch ends at one)."""
    try:
        pos = os.lseek(fd, 0, os.SEEK_DATA)
    except OSError as e:
        if e.errno == errno.ENXIO:  # (nothing but a hole)
            return os.fstat(fd).st_size
        if e.errno != errno.EINVAL:
            raise
        pos = 0
    while True:
        buf = os.pread(fd, 1 << 16, pos)
        if not buf:
            return pos
        words = np.frombuffer(buf[: len(buf) // 8 * 8], np.uint64)
        nz = np.flatnonzero(words)
        if len(nz):
            return pos + 8 * int(nz[0])
        pos += len(buf) // 8 * 8
        if len(buf) % 8:
            return pos


def chunks(fd: int, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """The chunks of a log file from `start` to `end` as (offset, size, pool tag, first
    record's op), read from their headers; stops at what is not a whole chunk (one another
    process is writing now)."""
    out = []
    pos = start
    head = OPLOG_CHUNK + 2
    while pos + head <= end:
        b = os.pread(fd, head, pos)
        if len(b) < head:
            break
        magic, size = struct.unpack_from("<II", b, 0)
        if magic != OPLOG_CHUNK_MAGIC or size < OPLOG_CHUNK or size % 8 or pos + size > end:
            break
        (tag,) = struct.unpack_from("<I", b, _TAG_AT)
        out.append((pos, size, tag, b[OPLOG_CHUNK]))
        pos += size
    return out
