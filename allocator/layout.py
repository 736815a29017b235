"""The segment's byte layout: every structured dtype and section offset, in one place.

The pool, the dump reader, the analyzer and the TUI all read the segment through `SegmentView`;
there is no second parser. docs/FORMAT.md describes the same layout in prose.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

# The checksum functions live in checksums.py; the readers import them with the dtypes.
from kvscope.allocator.checksums import (  # noqa: F401
    HEADER_CHECKSUM_BYTES,
    MASK64,
    block_checksums,
    block_words,
    header_checksum,
)

# The constants and record fields the C core shares are defined once, in records.py (plain
# Python, which setup.py turns into the core's header); the dtypes below are built from them.
from kvscope.allocator.records import (  # noqa: F401 - re-exported: the readers import them here
    BLOCK_MAGIC,
    CHUNK,
    CLIENT_FIELDS,
    COUNTER_FIELDS,
    EVENT_FIELDS,
    EVICT_BATCH,
    FINDING_FIELDS,
    FINDINGS_CAPACITY,
    HEADER_FIELDS,
    INDEX_FIELDS,
    JOURNAL_BYTES,
    JOURNAL_ENTRIES,
    LEASE_HEADER_FIELDS,
    LOCAL_CACHE_MAX,
    LOCK_FIELDS,
    LOCKGRAPH_CAPACITY,
    LOCKGRAPH_FIELDS,
    LRU_ENTRY_FIELDS,
    LRU_HEADER_FIELDS,
    LRU_KEEP,
    NUM_SITES,
    PROVENANCE_FIELDS,
    REQUEST_BYTES,
    RING_HEADER_FIELDS,
    SITE_FIELDS,
    BlockState,
    ClientState,
    LeaseMode,
    LeaseState,
    SeqState,
    block_fields,
    lease_capacity,
    lease_fields,
    seq_fields,
)

POOL_MAGIC = 0x4B56_5343_4F50_4531
FORMAT_VERSION = 9
ALIGN = 64


class Flag(enum.IntFlag):
    """Probe flags recorded in the header."""

    GUARD = 1
    EVENTS = 2
    LOCKDEP = 4


HEADER_DTYPE = np.dtype(HEADER_FIELDS)
assert HEADER_DTYPE.fields["checksum"][1] == HEADER_CHECKSUM_BYTES  # type: ignore[index]


def block_dtype(block_size: int) -> np.dtype:
    """One fixed record per physical block (records.block_fields)."""
    return np.dtype(block_fields(block_size))


RING_HEADER_DTYPE = np.dtype(RING_HEADER_FIELDS)
INDEX_DTYPE = np.dtype(INDEX_FIELDS)
LRU_HEADER_DTYPE = np.dtype(LRU_HEADER_FIELDS)
LRU_ENTRY_DTYPE = np.dtype(LRU_ENTRY_FIELDS)
LEASE_HEADER_DTYPE = np.dtype(LEASE_HEADER_FIELDS)
PROVENANCE_DTYPE = np.dtype(PROVENANCE_FIELDS)


def lease_dtype(max_blocks_per_seq: int) -> np.dtype:
    """One lease record (records.lease_fields); the table holds `lease_capacity` of them."""
    return np.dtype(lease_fields(max_blocks_per_seq))


def seq_dtype(max_blocks_per_seq: int) -> np.dtype:
    """One slot per live sequence, with its block table (records.seq_fields)."""
    return np.dtype(seq_fields(max_blocks_per_seq))


SITE_DTYPE = np.dtype(SITE_FIELDS)

LOCK_DTYPE = np.dtype(LOCK_FIELDS)

CLIENT_DTYPE = np.dtype(CLIENT_FIELDS)

EVENT_DTYPE = np.dtype(EVENT_FIELDS)

LOCKGRAPH_DTYPE = np.dtype(LOCKGRAPH_FIELDS)
FINDING_DTYPE = np.dtype(FINDING_FIELDS)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


def field_text(raw: Any) -> str:
    """A text field of a record (a request id, a lease's holder): its bytes up to the NULs that
    pad it, decoded (bytes that are not UTF-8 replaced)."""
    return bytes(raw).rstrip(b"\0").decode(errors="replace")


def lock_names(num_shards: int) -> list[str]:
    """Every pool lock, in the one order in which they are taken (docs/FORMAT.md)."""
    return ["seqs"] + [f"index.{i}" for i in range(num_shards)] + ["free", "sites", "findings"]


@dataclass(frozen=True)
class Layout:
    """Section offsets and dtypes for one geometry."""

    num_blocks: int
    block_size: int
    max_seqs: int
    max_blocks_per_seq: int
    max_clients: int
    num_shards: int
    event_capacity: int
    # 0: derived from the block count (new pools); an existing pool's header records its own.
    index_slots: int = 0

    @property
    def index_capacity(self) -> int:
        """Prefix-index slots: a power of two at least 4x the blocks, 64 per shard at least."""
        if self.index_slots:
            return self.index_slots
        cap = 1
        while cap < 4 * self.num_blocks:
            cap *= 2
        return max(cap, 64 * self.num_shards)

    @property
    def block(self) -> np.dtype:
        return block_dtype(self.block_size)

    @property
    def seq(self) -> np.dtype:
        return seq_dtype(self.max_blocks_per_seq)

    @property
    def lease(self) -> np.dtype:
        return lease_dtype(self.max_blocks_per_seq)

    @property
    def lease_capacity(self) -> int:
        """Records of the lease table (records.lease_capacity)."""
        return lease_capacity(self.max_seqs)

    @property
    def provenance_records_at(self) -> int:
        """Where the slot-provenance records start within their section (after the per-block
        generations, 64-byte aligned)."""
        return _align(4 * self.num_blocks)

    @property
    def lease_records_at(self) -> int:
        """Where the lease records start within the leases section (after the counts)."""
        return _align8(LEASE_HEADER_DTYPE.itemsize + 4 * self.num_blocks)

    def offsets(self) -> dict[str, int]:
        """Byte offset of every section, and the total size under key 'end'."""
        sizes = [
            ("header", HEADER_DTYPE.itemsize),
            ("blocks", self.block.itemsize * self.num_blocks),
            ("ring", RING_HEADER_DTYPE.itemsize + 4 * self.num_blocks),
            ("index", INDEX_DTYPE.itemsize * self.index_capacity),
            ("seqs", self.seq.itemsize * self.max_seqs),
            ("sites", SITE_DTYPE.itemsize * NUM_SITES),
            ("locks", LOCK_DTYPE.itemsize * len(lock_names(self.num_shards))),
            ("clients", CLIENT_DTYPE.itemsize * self.max_clients),
            ("events", EVENT_DTYPE.itemsize * self.event_capacity * self.max_clients),
            ("lockgraph", LOCKGRAPH_DTYPE.itemsize * LOCKGRAPH_CAPACITY),
            ("findings", FINDING_DTYPE.itemsize * FINDINGS_CAPACITY),
            ("lru", LRU_HEADER_DTYPE.itemsize + LRU_ENTRY_DTYPE.itemsize * LRU_KEEP),
            ("leases", self.lease_records_at + self.lease.itemsize * self.lease_capacity),
            (
                "provenance",
                self.provenance_records_at
                + PROVENANCE_DTYPE.itemsize * self.num_blocks * self.block_size,
            ),
        ]
        out: dict[str, int] = {}
        pos = 0
        for name, size in sizes:
            out[name] = pos
            pos = _align(pos + size)
        out["end"] = pos
        return out

    @classmethod
    def from_header(cls, h: np.void) -> Layout:
        """The layout a header describes."""
        return cls(
            num_blocks=int(h["num_blocks"]),
            block_size=int(h["block_size"]),
            max_seqs=int(h["max_seqs"]),
            max_blocks_per_seq=int(h["max_blocks_per_seq"]),
            max_clients=int(h["max_clients"]),
            num_shards=int(h["num_shards"]),
            event_capacity=int(h["event_capacity"]),
            index_slots=int(h["index_capacity"]),
        )


class SegmentView:
    """Numpy views of every section of one segment buffer (live mmap or dump bytes)."""

    # buf: anything with the buffer protocol (a live mmap; bytes, a bytearray or a numpy array
    # holding a copy).
    def __init__(self, buf: Any, layout: Layout):
        self.buf = buf
        self.layout = layout
        off = layout.offsets()
        self.offsets = off
        self.raw = np.frombuffer(buf, dtype=np.uint8, count=off["end"])
        self.header = np.frombuffer(buf, dtype=HEADER_DTYPE, count=1)[0:1]
        self.blocks = np.frombuffer(buf, layout.block, layout.num_blocks, off["blocks"])
        self.ring_header = np.frombuffer(buf, RING_HEADER_DTYPE, 1, off["ring"])
        self.ring = np.frombuffer(
            buf, np.int32, layout.num_blocks, off["ring"] + RING_HEADER_DTYPE.itemsize
        )
        self.index = np.frombuffer(buf, INDEX_DTYPE, layout.index_capacity, off["index"])
        self.seqs = np.frombuffer(buf, layout.seq, layout.max_seqs, off["seqs"])
        self.sites = np.frombuffer(buf, SITE_DTYPE, NUM_SITES, off["sites"])
        self.locks = np.frombuffer(
            buf, LOCK_DTYPE, len(lock_names(layout.num_shards)), off["locks"]
        )
        self.clients = np.frombuffer(buf, CLIENT_DTYPE, layout.max_clients, off["clients"])
        self.events = np.frombuffer(
            buf, EVENT_DTYPE, layout.event_capacity * layout.max_clients, off["events"]
        ).reshape(layout.max_clients, layout.event_capacity)
        self.lockgraph = np.frombuffer(buf, LOCKGRAPH_DTYPE, LOCKGRAPH_CAPACITY, off["lockgraph"])
        self.findings = np.frombuffer(buf, FINDING_DTYPE, FINDINGS_CAPACITY, off["findings"])
        self.lru_header = np.frombuffer(buf, LRU_HEADER_DTYPE, 1, off["lru"])
        self.lru = np.frombuffer(
            buf, LRU_ENTRY_DTYPE, LRU_KEEP, off["lru"] + LRU_HEADER_DTYPE.itemsize
        )
        self.lease_header = np.frombuffer(buf, LEASE_HEADER_DTYPE, 1, off["leases"])
        self.lease_counts = np.frombuffer(
            buf, "<u4", layout.num_blocks, off["leases"] + LEASE_HEADER_DTYPE.itemsize
        )
        self.leases = np.frombuffer(
            buf, layout.lease, layout.lease_capacity, off["leases"] + layout.lease_records_at
        )
        # slot provenance (docs/POOL.md "Slot provenance"): each block's generation whose
        # slots hold records (0: none), then [num_blocks, block_size] records
        self.provenance_recorded = np.frombuffer(buf, "<u4", layout.num_blocks, off["provenance"])
        self.provenance = np.frombuffer(
            buf,
            PROVENANCE_DTYPE,
            layout.num_blocks * layout.block_size,
            off["provenance"] + layout.provenance_records_at,
        ).reshape(layout.num_blocks, layout.block_size)

    @property
    def h(self) -> np.void:
        """The header record."""
        return self.header[0]


DUMP_MAGIC = 0x3150_4D55_4453_564B  # "KVSDUMP1" little-endian
DUMP_VERSION = 1

# A dump file: this header, then the segment bytes (segment_size), then the KV data if any.
DUMP_HEADER_DTYPE = np.dtype(
    [
        ("magic", "<u8"),
        ("version", "<u4"),
        ("flags", "<u4"),  # 1: KV data follows, 2: token ids redacted, 4: torn snapshot
        ("segment_size", "<u8"),
        ("data_size", "<u8"),
        ("created_ns", "<u8"),
        ("pid", "<i4"),
        ("pad", "<u4"),
        ("host", "S64"),
        ("pool", "S64"),
        ("reason", "S128"),
        # The first 256 bytes of the segment header as last seen intact (a scribbled header
        # must not make its own dump unreadable).
        ("segment_header_prefix", "u1", (256,)),
    ]
)
DUMP_WITH_DATA, DUMP_REDACTED, DUMP_TORN, DUMP_FAILED = 1, 2, 4, 8
