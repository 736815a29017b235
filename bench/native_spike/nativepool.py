"""A thin KVPool-like wrapper over the kvcore C extension (feasibility spike, not product code).

The segment is an mmap of a /dev/shm file; kvcore does every shared write (journaled). Python
keeps only the Sequence handle (a __slots__ object with a list block table) and argument checks.
"""

from __future__ import annotations

import itertools
import mmap
import os

import numpy as np

import kvcore

BS = 16
_uids = itertools.count(1)


class Sequence:
    """One request's handle: its block table (a list) and its slot in the shared sequence table."""

    __slots__ = ("request_id", "block_table", "slot", "seq_id", "num_tokens", "state", "pool_uid")

    def __init__(self, request_id, block_table, slot, seq_id, num_tokens, pool_uid):
        self.request_id = request_id
        self.block_table = block_table
        self.slot = slot
        self.seq_id = seq_id
        self.num_tokens = num_tokens
        self.state = "running"
        self.pool_uid = pool_uid


class PoolError(Exception):
    pass


class NativePool:
    def __init__(self, name: str, num_blocks: int, max_seqs: int = 4096, max_bps: int = 256,
                 local_cap: int = 4, full_checksum: bool = False, create: bool = True,
                 client: int = 0, c_api: bool = False):
        self.name = name
        self.path = f"/dev/shm/kvspike.{name}"
        self.num_blocks, self.max_seqs, self.max_bps = num_blocks, max_seqs, max_bps
        self.full_checksum = full_checksum
        self.off = kvcore.layout(num_blocks, max_seqs, max_bps)
        if create:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, self.off["end"])
        else:
            fd = os.open(self.path, os.O_RDWR)
        self.fd = fd
        self.mm = mmap.mmap(fd, self.off["end"], mmap.MAP_SHARED)
        self.core = kvcore.Core(self.mm, fd, num_blocks, max_seqs, max_bps, client, local_cap,
                                0, full_checksum)
        if create:
            self.core.init_segment()
        self._uid = next(_uids)
        self._alloc = self.core.alloc
        self._free = self.core.free
        self._append1 = self.core.append1
        if c_api:
            # Variant: the Sequence handle is a C type and the API methods are the C methods
            # themselves (no Python frame per call).
            self.allocate = self.core.allocate
            self.free = self.core.free_seq
            self.append = self.core.append_seq

    # -- the API ------------------------------------------------------------------------------

    def allocate(self, request_id, tokens) -> Sequence:
        slot, seq_id, table = self._alloc(request_id, tokens, -1)
        return Sequence(request_id, table, slot, seq_id, len(tokens), self._uid)

    def free(self, seq: Sequence) -> None:
        if seq.__class__ is not Sequence or seq.pool_uid != self._uid or seq.slot < 0:
            raise PoolError(f"not a live sequence of this pool: {seq!r}")
        self._free(seq.slot, seq.block_table)
        seq.block_table = []
        seq.slot = -1
        seq.state = "finished"

    def append(self, seq: Sequence, tokens) -> list:
        if seq.__class__ is not Sequence or seq.pool_uid != self._uid or seq.slot < 0:
            raise PoolError(f"not a live sequence of this pool: {seq!r}")
        ap, slot, table, n = self._append1, seq.slot, seq.block_table, seq.num_tokens
        for t in tokens:
            n = ap(slot, table, n, t)
        seq.num_tokens = n
        return []  # no copy-on-write in the spike

    # -- inspection ------------------------------------------------------------------------------

    def blocks(self) -> np.ndarray:
        dt = np.dtype([("magic", "<u4"), ("state", "u1"), ("indexed", "u1"), ("poisoned", "u1"),
                       ("pad", "u1"), ("refcount", "<i4"), ("generation", "<u4"),
                       ("owner_pid", "<i4"), ("owner_client", "<i4"), ("prefix_hash", "<u8"),
                       ("checksum", "<u8"), ("owner_start", "<u8"), ("request", "S32"),
                       ("alloc_ns", "<u8"), ("access_ns", "<u8"), ("site", "<i4"),
                       ("num_tokens", "<u4"), ("parent_hash", "<u8"), ("freed_at", "<u8"),
                       ("tokens", "<i4", (BS,))])
        assert dt.itemsize == 184
        return np.frombuffer(self.mm, dt, self.num_blocks, self.off["blocks"])

    def close(self, unlink: bool = True) -> None:
        self._alloc = self._free = self._append1 = None
        self.__dict__.pop("allocate", None), self.__dict__.pop("free", None), self.__dict__.pop("append", None)
        self.core = None
        try:
            self.mm.close()
        except BufferError:  # a traceback still holds a bound method of the core
            pass
        os.close(self.fd)
        if unlink:
            os.unlink(self.path)


def check(pool: NativePool, live_tables: list[list[int]] = ()) -> list[str]:
    """Consistency: checksums (kvscope's formula), every block in exactly one place."""
    errs = []
    b = pool.blocks()
    K = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5,
                  0xFF51AFD7ED558CCD], np.uint64)
    w = b.view(np.uint64).reshape(len(b), 23)[:, :4]
    with np.errstate(over="ignore"):
        h = (w * K[:4]).sum(axis=1, dtype=np.uint64) + np.arange(len(b), dtype=np.uint64) * K[4]
        h ^= h >> np.uint64(29)
        h *= K[0]
        h ^= h >> np.uint64(32)
    bad = np.flatnonzero(h != b["checksum"])
    if len(bad) and not pool.full_checksum:
        errs.append(f"{len(bad)} checksum mismatches, e.g. {bad[:5].tolist()}")
    raw = np.frombuffer(pool.mm, np.uint8)
    rh = raw[pool.off["ring_header"]: pool.off["ring_header"] + 32].view(np.uint64)
    head, tail = int(rh[0]), int(rh[1])
    count = int(raw[pool.off["ring_header"] + 16: pool.off["ring_header"] + 20].view(np.uint32)[0])
    ring = np.frombuffer(pool.mm, np.int32, pool.num_blocks, pool.off["ring"])
    in_ring = ring[(head + np.arange(count)) % pool.num_blocks]
    if tail - head != count:
        errs.append(f"ring head/tail/count disagree {head} {tail} {count}")
    coff = pool.off["clients"]
    local_count = int(raw[coff + 40: coff + 44].view(np.uint32)[0])
    local = np.frombuffer(pool.mm, np.int32, local_count, coff + 64)
    seen = np.zeros(pool.num_blocks, np.int64)
    np.add.at(seen, in_ring, 1)
    np.add.at(seen, local, 1)
    for t in live_tables:
        np.add.at(seen, np.asarray(t, np.int64), 1)
    if (seen != 1).any():
        errs.append(f"{int((seen != 1).sum())} blocks not in exactly one place")
    st = b["state"]
    if not (st[in_ring] == 0).all():
        errs.append("non-FREE block in ring")
    if not (st[local] == 3).all():
        errs.append("non-LOCAL block in local cache")
    return errs
