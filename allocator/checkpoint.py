"""Snapshots of a pool in its operation log, written and restored (docs/REPLAY.md "Starting
from a snapshot", "A bounded log"): what a replay starts from where the log does not begin at the
pool's creation. allocator/oplogsnap.py reads the record (its bytes: there).

A SNAPSHOT record (OpCode.SNAPSHOT, written by the core: csrc/oplog.c oplog_snapshot) holds the
pool's metadata as a reader's consistent copy has it (snapshot.py copy_metadata: the header,
blocks, free ring, prefix index, sequence and site tables, the client records without their
journals, the lock-order graph, findings ring, LRU list and leases; not the K/V bytes, the
event rings, the slot provenance or the locks), taken at the operation number just below its
own: every operation numbered below it is in it, none after.

A replay restores it into a fresh segment of the same geometry (`restore`, before any handle
attaches, as header.init_segment writes a new one), each client record the snapshot shows
attached taken over by a handle of the replay (KVPool.restore, KVPool.attach(client=)), which
adopts its live sequences and leases (KVPool.adopt_restored).

A bounded log (`Ring`, KVPool.record_ops(limit=)): past the limit, the recording writes a
SNAPSHOT (a checkpoint) and frees the file before its previous one (a hole: fallocate
PUNCH_HOLE), so that the file holds about twice the limit at most.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from kvscope.allocator import ofd
from kvscope.allocator.checksums import block_checksums
from kvscope.allocator.errors import OplogError
from kvscope.allocator.layout import ClientState, SegmentView, field_text
from kvscope.allocator.oplog import from_creation, parse_log, pool_tag
from kvscope.allocator.oplogsnap import LIVE, MAGIC, VERSION, Snapshot, chunks, data_start
from kvscope.allocator.prefix import COEFS
from kvscope.allocator.records import OpCode
from kvscope.allocator.snapshot import copy_metadata, metadata_ranges

if TYPE_CHECKING:
    from kvscope.allocator.sequence import Sequence

# (the handle a snapshot is taken of, or written by: a KVPool, which imports this module)
KVPool = Any

# The prefix chain's multiplier (csrc/core.h CHAIN_P): a restored sequence's chain values.
CHAIN_P = 0x100000001B3
_M64 = (1 << 64) - 1
# The header's fields a restore takes from the snapshot: its mutable tail but the checksum and
# a CUDA pool's IPC handle (a replay's pool is a CPU pool of its own).
_NOT_RESTORED = {"checksum", "cuda_ipc_len", "cuda_ipc"}
# The least limit `kvscope run --record-ops-limit` takes: below it, the log would be mostly
# checkpoints (a pool's metadata, compressed, is some kilobytes).
MIN_LIMIT = 64 * 1024


def take(
    pool: KVPool, start: dict[str, Any], ring: dict[str, Any] | None = None, tries: int = 200
) -> tuple[bytes, int] | None:
    """The pool's metadata now as a SNAPSHOT record's bytes, and the op_seq it was taken at
    (None: no consistent copy in `tries`)."""
    got = copy_metadata(pool.view, tries)
    if got is None:
        return None
    raw, op_seq = got
    ranges = metadata_ranges(pool.view)
    data = b"".join(raw[a:b].tobytes() for a, b in ranges)
    slots, next_id, end_id = pool.core.reserve_state()
    meta = {
        "version": VERSION,
        "pool": pool.name,
        "op_seq": op_seq,
        "size": int(pool.view.offsets["end"]),
        "offsets": {k: int(v) for k, v in pool.view.offsets.items()},
        "ranges": [[a, b] for a, b in ranges],
        "crc32": zlib.crc32(data),
        "client": int(pool.client),
        "reserve": [list(slots), int(next_id), int(end_id)],
        "start": start,
    }
    if ring is not None:
        meta["ring"] = ring
    text = json.dumps(meta, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(text)) + text + zlib.compress(data, 1), op_seq


def write(
    pool: KVPool, start: dict[str, Any], ring: dict[str, Any] | None = None, tries: int = 50
) -> tuple[int, int] | None:
    """A SNAPSHOT record of the pool into the log the handle records into: (its number, its
    chunk's offset in the file), or None where every one of `tries` copies saw an operation
    number taken before its record could be (a pool that busy has no quiet moment)."""
    for _ in range(tries):
        got = take(pool, start, ring)
        if got is None:
            return None
        payload, op_seq = got
        with pool.op_mutex:
            done = pool.core.oplog_snapshot(payload, op_seq)
        if done is not None:
            return done
    return None


def restore(view: SegmentView, snap: Snapshot, pid: int, start: int) -> None:
    """Write the snapshot's metadata into a new segment of the same geometry (`view`, made by
    header.init_segment and not yet attached: lifecycle.create), its client records that were
    attached made this process's (`pid`, `start`) to be taken over by the replay's handles, as
    are what they own (blocks, sequences and their slot reserves, leases); ValueError where the
    geometry differs. The block records whose checksum held are sealed again (their owner
    changed); one that failed it in the snapshot still fails it."""
    offsets = {k: int(v) for k, v in view.offsets.items()}
    if offsets != {k: int(v) for k, v in snap.meta["offsets"].items()}:
        raise ValueError("the snapshot's segment is not of this pool's geometry")
    src = snap.view()
    raw, got = view.raw, snap.raw
    hdr_end = offsets["blocks"]
    for a, b in snap.meta["ranges"]:
        a = max(a, hdr_end)  # (the header's fields: below)
        if a < b:
            raw[a:b] = got[a:b]
    h, sh = view.header, src.header
    for name in sh.dtype.names or ():
        off = sh.dtype.fields[name][1]
        if off >= hdr_end or name in _NOT_RESTORED or off < view.header.dtype.fields["checksum"][1]:
            continue
        h[name] = sh[name]
    cl = view.clients
    mine = np.flatnonzero(cl["state"] == ClientState.ATTACHED)
    for c in mine.tolist():
        rec = cl[c : c + 1]
        rec["pid"], rec["start"] = pid, start
        rec["journal_count"] = rec["journal_used"] = 0
        rec["event_count"] = rec["event_head"] = 0
        rec["seq"] += rec["seq"] % 2
    blocks = view.blocks
    ids = np.arange(len(blocks), dtype=np.int64)
    sealed = block_checksums(blocks, ids) == blocks["checksum"]
    owned = np.isin(blocks["owner_client"], mine)
    blocks["owner_pid"][owned] = pid
    blocks["owner_start"][owned] = start
    fix = ids[owned & sealed]
    blocks["checksum"][fix] = block_checksums(blocks, fix)
    seqs = view.seqs
    owned = np.isin(seqs["owner_client"], mine)
    seqs["owner_pid"][owned] = pid
    seqs["owner_start"][owned] = start
    leases = view.leases
    owned = np.isin(leases["holder_client"], mine) & (leases["state"] != 0)
    leases["holder_pid"][owned] = pid
    leases["holder_start"][owned] = start


def attached(snap: Snapshot) -> list[tuple[int, int]]:
    """The client records the snapshot shows attached, with the pid each had: (client, pid)."""
    cl = snap.view().clients
    return [
        (int(c), int(cl["pid"][c])) for c in np.flatnonzero(cl["state"] == ClientState.ATTACHED)
    ]


def sequences(view: SegmentView, client: int, block_size: int) -> list[Sequence]:
    """The live sequences of `client` in a restored segment, as Sequences (not yet registered:
    KVPool.adopt_restored): the request id and block table from the record, the tokens from
    its blocks, the chain values of its full blocks as the core computes them, the leading
    published ones counted. A PREEMPTED one holds no blocks, so no tokens: its resume does not
    replay."""
    from kvscope.allocator.sequence import Sequence

    seqs, blocks = view.seqs, view.blocks
    out = []
    coefs = np.array(COEFS[:block_size], dtype=np.uint64)
    state_names = {1: "running", 2: "waiting", 5: "preempted"}
    for slot in np.flatnonzero(np.isin(seqs["state"], LIVE) & (seqs["owner_client"] == client)):
        r = seqs[slot]
        k = int(r["num_blocks"])
        table = [int(b) for b in r["table"][:k]]
        ntok = int(r["num_tokens"]) if table else 0
        # (a snapshot's bytes are the log's, which anyone may have edited: checked before use)
        if (
            k > len(r["table"])
            or any(not 0 <= b < len(blocks) for b in table)
            or ntok > k * block_size
        ):
            raise ValueError(f"slot {int(slot)}'s record is not a sequence's")
        toks: Any = blocks["tokens"][table].reshape(-1)[:ntok].astype(np.int64) if table else []
        tokens = [int(t) for t in toks]
        chain: list[int] = []
        prev = 0
        with np.errstate(over="ignore"):
            for j in range(ntok // block_size):
                part = np.asarray(toks[j * block_size : (j + 1) * block_size]).astype(np.uint64)
                c = int((part * coefs).sum(dtype=np.uint64))
                prev = (prev * CHAIN_P + c) & _M64
                chain.append(prev)
        published = 0
        while published < len(chain) and blocks["indexed"][table[published]]:
            published += 1
        seq = Sequence(
            field_text(r["request"]),
            tokens,
            table,
            int(slot),
            int(r["seq_id"]),
            0,
            0,
            state_names.get(int(r["state"]), "running"),
            chain,
            published,
        )
        out.append(seq)
    return out


def reserved_slots(view: SegmentView, client: int) -> list[int]:
    """The EMPTY slots the table marks reserved by `client`, lowest last (claimed from the
    end, as a refill leaves them)."""
    seqs = view.seqs
    mask = (seqs["state"] == 0) & (seqs["reserved"] == 1) & (seqs["owner_client"] == client)
    return [int(s) for s in np.flatnonzero(mask)[::-1]]


# -- a bounded log ----------------------------------------------------------------------------


class Ring:
    """A bounded log's checkpoint (the core calls it, KVPool.record_ops(limit=)): once the file
    passes `limit` bytes after the pool's last checkpoint in it, a SNAPSHOT is written and the
    file before the checkpoint before it freed (punched: a hole, whose bytes read as zeros),
    where the ring wrapped: a replay starts at a checkpoint the file holds whole. One process
    at a time (an OFD lock on the file's first byte, not waited for: another process
    checkpointing now does it for all); the pool's last checkpoint is found in the file, so
    every recording process bounds it alike."""

    def __init__(self, pool: KVPool, path: str, limit: int, start: dict[str, Any]):
        self.pool = pool
        self.path = path
        self.limit = limit
        self.start = start
        self.tag = pool_tag(pool.name, int(pool.view.h["created_ns"]))
        self.checkpoints = 0  # written by this handle

    def last(self, fd: int) -> tuple[int, int | None]:
        """The file's size and the offset of the pool's last checkpoint in it (None: none)."""
        size = os.fstat(fd).st_size
        latest = None
        snap = int(OpCode.SNAPSHOT)
        for off, _, tag, op in chunks(fd, data_start(fd), size):
            if tag == self.tag and op == snap:
                latest = off
        return size, latest

    def base(self) -> int:
        """Where the bound counts from now: the pool's last checkpoint in the file, else its
        size."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size, latest = self.last(fd)
        finally:
            os.close(fd)
        return size if latest is None else latest

    def __call__(self) -> None:
        try:
            self._checkpoint()
        except OSError:
            pass  # (the file gone or unreadable: nothing to bound; the records still go out)

    def _checkpoint(self) -> None:
        pool = self.pool
        # (read and written: an OFD write lock wants a descriptor open for writing)
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if not ofd.lock(fd, 0, 1, wait=False):
                return  # (another process is taking one)
            try:
                size, latest = self.last(fd)
                if latest is not None and size < latest + self.limit:
                    # (another process took one since this handle's base)
                    pool.core.oplog_ring(self.limit, self, latest)
                    return
                # (the ring's mark: where the file before it is dropped, as this one is written)
                mark = {"limit": self.limit, "drops_before": latest or 0}
                got = write(pool, self.start, mark)
                if got is None:
                    return  # (no quiet moment: the base stays, the next chunk tries again)
                _, offset = got
                self.checkpoints += 1
                if latest is not None:
                    pool.core.oplog_punch(latest)
                pool.core.oplog_ring(self.limit, self, offset if offset >= 0 else size)
            finally:
                ofd.unlock(fd, 0, 1)
        finally:
            os.close(fd)


def leases(view: SegmentView, client: int) -> list[tuple[int, int, str, str, list[int]]]:
    """The leases `client` holds in a restored segment, as Lease's arguments after its pool:
    (record, lease id, mode, holder, blocks)."""
    recs = view.leases
    out = []
    for i in np.flatnonzero((recs["state"] != 0) & (recs["holder_client"] == client)).tolist():
        r = recs[i]
        k = min(int(r["num_blocks"]), len(r["blocks"]))
        if any(not 0 <= b < len(view.blocks) for b in r["blocks"][:k]):
            raise ValueError(f"lease record {i} names a block the pool does not have")
        mode = "write" if int(r["mode"]) == 2 else "read"
        out.append(
            (
                i,
                int(r["lease_id"]),
                mode,
                field_text(r["holder"]),
                [int(b) for b in r["blocks"][:k]],
            )
        )
    return out


def fresh(view: SegmentView) -> bool:
    """Whether a pool is as its creation left it: no sequence id, block or lease ever handed
    out."""
    return (
        int(view.h["next_seq_id"]) == 0
        and int(view.ring_header["allocs"][0]) == 0
        and int(view.lease_header["taken"][0]) == 0
        and int(view.h["op_seq"]) == 0
    )


def has_history(pool: KVPool, path: str, tag: int) -> bool:
    """Whether a handle beginning to record into `path` needs a snapshot: the pool has a
    history (it is not as its creation left it) and the file holds no START of its creation
    (one that was recording from the pool's creation: a replay starts there)."""
    if pool.created and fresh(pool.view):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        size = os.fstat(fd).st_size
        start = int(OpCode.START)
        for off, length, t, op in chunks(fd, data_start(fd), size):
            if t != tag or op != start:
                continue
            try:
                first = parse_log(os.pread(fd, length, off), path, off)
            except OplogError:
                continue
            if any(r.op == start and from_creation(r.start) for r in first):
                return False
    finally:
        os.close(fd)
    return True


def parse_size(text: str) -> int:
    """A size in bytes: an integer, or one with K, M, G (binary) after it ("64M"); ValueError
    for anything else, or a negative one."""
    t = str(text).strip().upper().removesuffix("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    value = int(t) * mult
    if value < 0:
        raise ValueError(f"not a size: {text!r}")
    return value
