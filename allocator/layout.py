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
    IDENTITY_WORDS,
    MASK64,
    block_checksum,
    block_checksums,
    block_words,
    header_checksum,
)

POOL_MAGIC = 0x4B56_5343_4F50_4531
BLOCK_MAGIC = 0x4B56_424B
FORMAT_VERSION = 1
ALIGN = 64
NO_BLOCK = -1

LOCAL_CACHE_MAX = 64
JOURNAL_ENTRIES = 512
JOURNAL_BYTES = 96 * 1024
FINDINGS_CAPACITY = 256
LOCKGRAPH_CAPACITY = 256
NUM_SITES = 1024
REQUEST_BYTES = 32


class BlockState(enum.IntEnum):
    """Lifecycle state of a physical block (docs/FORMAT.md, "Block headers")."""

    FREE = 0
    ALLOCATED = 1
    CACHED = 2
    LOCAL = 3
    QUARANTINED = 4


class SeqState(enum.IntEnum):
    """State of a sequence-table slot."""

    EMPTY = 0
    RUNNING = 1
    WAITING = 2
    FINISHED = 3
    ABORTED = 4
    PREEMPTED = 5


class ClientState(enum.IntEnum):
    """State of a client (attached process) record."""

    EMPTY = 0
    ATTACHED = 1
    DETACHED = 2


class Flag(enum.IntFlag):
    """Probe flags recorded in the header."""

    GUARD = 1
    EVENTS = 2
    LOCKDEP = 4


# Per-client counters; the header keeps the totals of clients that detached or were reclaimed.
COUNTER_FIELDS = (
    "num_allocs",
    "num_frees",
    "num_cow",
    "num_evictions",
    "num_preemptions",
    "prefix_queries",
    "prefix_hits",
    "num_forks",
)

HEADER_IMMUTABLE = [
    ("magic", "<u8"),
    ("version", "<u4"),
    ("header_size", "<u4"),
    ("num_blocks", "<u4"),
    ("block_size", "<u4"),
    ("slots_per_block", "<u4"),
    ("num_layers", "<u4"),
    ("num_kv_heads", "<u4"),
    ("head_dim", "<u4"),
    ("dtype", "S16"),
    ("device", "S16"),
    ("flags", "<u4"),
    ("max_seqs", "<u4"),
    ("max_blocks_per_seq", "<u4"),
    ("max_clients", "<u4"),
    ("num_shards", "<u4"),
    ("index_capacity", "<u4"),
    ("num_locks", "<u4"),
    ("event_capacity", "<u4"),
    ("local_cache_size", "<u4"),
    ("quarantine", "<u4"),
    ("creator_pid", "<i4"),
    ("creator_start", "<u8"),
    ("created_ns", "<u8"),
    ("name", "S64"),
    ("off_blocks", "<u8"),
    ("off_ring", "<u8"),
    ("off_index", "<u8"),
    ("off_seqs", "<u8"),
    ("off_sites", "<u8"),
    ("off_locks", "<u8"),
    ("off_clients", "<u8"),
    ("off_events", "<u8"),
    ("off_lockgraph", "<u8"),
    ("off_findings", "<u8"),
    ("segment_size", "<u8"),
    ("data_bytes", "<u8"),
]

HEADER_DTYPE = np.dtype(
    HEADER_IMMUTABLE
    + [
        ("checksum", "<u8"),
        ("cuda_ipc_len", "<u4"),
        ("cuda_ipc", "S1024"),
        ("num_sites_used", "<u4"),
        ("findings_head", "<u8"),
        ("lockgraph_used", "<u4"),
        ("next_seq_id", "<u8"),
        ("refcount_peak", "<u4"),
    ]
    + [(name, "<u8") for name in COUNTER_FIELDS]
)
assert HEADER_DTYPE.fields["checksum"][1] == HEADER_CHECKSUM_BYTES  # type: ignore[index]


def header_field_at(offset: int) -> str:
    """The name of the header field holding byte `offset` ("?" outside the header)."""
    for name in HEADER_DTYPE.names or ():
        dt, off = HEADER_DTYPE.fields[name][:2]  # type: ignore[index]
        if off <= offset < off + dt.itemsize:
            return name
    return "?"


def block_dtype(block_size: int) -> np.dtype:
    """One fixed record per physical block; the first 32 bytes are the checksummed identity."""
    fields = [
        ("magic", "<u4"),
        ("state", "u1"),
        ("indexed", "u1"),
        ("poisoned", "u1"),
        ("pad", "u1"),
        ("refcount", "<i4"),
        ("generation", "<u4"),
        ("owner_pid", "<i4"),
        ("owner_client", "<i4"),
        ("prefix_hash", "<u8"),
        ("checksum", "<u8"),
        ("owner_start", "<u8"),
        ("request", f"S{REQUEST_BYTES}"),
        ("alloc_ns", "<u8"),
        ("access_ns", "<u8"),
        ("site", "<i4"),
        ("num_tokens", "<u4"),
        ("parent_hash", "<u8"),
        # Guard mode: the free ring's allocation count when this block was quarantined.
        ("freed_at", "<u8"),
        ("tokens", "<i4", (block_size,)),
    ]
    if block_size % 2:
        fields.append(("pad2", "<u4"))
    # Digest probe: the high half of the block's K/V digest taken when it was published, over
    # the generation it was taken in (integrity.py); 0 when none. Appended last: the C core's
    # compiled offsets of the fields above never move.
    fields.append(("kv_digest", "<u8"))
    return np.dtype(fields)


RING_HEADER_DTYPE = np.dtype(
    [("head", "<u8"), ("tail", "<u8"), ("count", "<u4"), ("pad", "<u4"), ("allocs", "<u8")]
)
INDEX_DTYPE = np.dtype([("hash", "<u8"), ("block", "<i4"), ("pad", "<u4")])


def seq_dtype(max_blocks_per_seq: int) -> np.dtype:
    """One slot per live sequence, with its block table (logical -> physical)."""
    return np.dtype(
        [
            ("state", "u1"),
            # 1: the slot belongs to owner_client's reserve (EMPTY until that process uses it).
            ("reserved", "u1"),
            ("pad", "u1", (2,)),
            ("owner_pid", "<i4"),
            ("owner_client", "<i4"),
            ("num_blocks", "<u4"),
            ("owner_start", "<u8"),
            ("seq_id", "<u8"),
            ("request", f"S{REQUEST_BYTES}"),
            ("num_tokens", "<u8"),
            ("created_ns", "<u8"),
            ("table", "<i4", (max_blocks_per_seq,)),
        ]
    )


SITE_DTYPE = np.dtype([("text", "S120"), ("hits", "<u8")])

LOCK_DTYPE = np.dtype(
    [
        ("name", "S16"),
        ("seq", "<u8"),
        ("holder_pid", "<i4"),
        ("holder_client", "<i4"),
        ("holder_start", "<u8"),
        ("holder_tid", "<u8"),
        ("acquired_ns", "<u8"),
        ("num_acquires", "<u8"),
        ("num_contended", "<u8"),
        ("wait_ns", "<u8"),
        ("hold_ns", "<u8"),
        ("max_hold_ns", "<u8"),
    ]
)

JOURNAL_ENTRY_DTYPE = np.dtype(
    [("offset", "<u8"), ("length", "<u4"), ("data_off", "<u4"), ("op", "<u8")]
)

CLIENT_DTYPE = np.dtype(
    [
        ("state", "u1"),
        ("pad", "u1", (3,)),
        ("pid", "<i4"),
        ("start", "<u8"),
        ("attached_ns", "<u8"),
        ("seq", "<u8"),
        ("op", "<u8"),
        ("local_count", "<u4"),
        ("journal_count", "<u4"),
        ("journal_used", "<u4"),
        ("event_count", "<u4"),
        ("event_head", "<u8"),
        ("local", "<i4", (LOCAL_CACHE_MAX,)),
    ]
    + [(name, "<u8") for name in COUNTER_FIELDS]
    + [
        ("journal", JOURNAL_ENTRY_DTYPE, (JOURNAL_ENTRIES,)),
        ("journal_data", "u1", (JOURNAL_BYTES,)),
    ]
)

EVENT_DTYPE = np.dtype(
    [
        ("time_ns", "<u8"),
        ("pid", "<i4"),
        ("op", "u1"),
        ("pad", "u1", (3,)),
        ("block", "<i4"),
        ("generation", "<u4"),
        ("arg", "<i8"),
        ("request", f"S{REQUEST_BYTES}"),
    ]
)

LOCKGRAPH_DTYPE = np.dtype(
    [("src", "S16"), ("dst", "S16"), ("pid", "<i4"), ("pad", "<u4"), ("site", "S120")]
)

FINDING_DTYPE = np.dtype(
    [
        ("time_ns", "<u8"),
        ("kind", "S24"),
        ("severity", "u1"),
        ("pad", "u1", (3,)),
        ("block", "<i4"),
        ("owner_pid", "<i4"),
        ("pad2", "<u4"),
        ("request", f"S{REQUEST_BYTES}"),
        ("message", "S200"),
    ]
)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
DUMP_WITH_DATA, DUMP_REDACTED, DUMP_TORN = 1, 2, 4
