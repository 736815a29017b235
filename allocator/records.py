"""The segment's shared constants and the fields of the records the C core writes, in plain
Python: the one definition of each.

layout.py builds its numpy dtypes from these lists; setup.py runs this file on its own (no
numpy, no kvscope import: pip may build in an isolated environment) and writes `c_header()` to
allocator/csrc/layout.h, which the C core includes. The compiled module keeps what it was built
with (`_native.LAYOUT`) and native.py compares that with the dtypes at import, so a core built
for another layout refuses to load instead of writing the wrong bytes.
"""

from __future__ import annotations

import enum

BLOCK_MAGIC = 0x4B56_424B
REQUEST_BYTES = 32
LOCAL_CACHE_MAX = 64
JOURNAL_ENTRIES = 512
JOURNAL_BYTES = 96 * 1024
# The most blocks one transaction frees, claims or reclaims: longer work commits in chunks of
# this many, so one client's undo journal (JOURNAL_ENTRIES) never overflows.
CHUNK = 128
# Extra blocks evicted when the free ring runs dry (one pool scan per batch; at most a quarter
# of the cached blocks, so a small cache keeps its LRU order).
EVICT_BATCH = 32
# Eviction candidates one pool scan remembers for the next evictions, in the segment's LRU
# list (every process takes from it; only when the cache holds over twice as many).
LRU_KEEP = 4096
# Sequence ids a process takes at once from the header's counter (under the seqs lock).
SEQ_ID_BATCH = 256


class BlockState(enum.IntEnum):
    """Lifecycle state of a physical block (docs/FORMAT.md, "Block headers": its `state` byte)."""

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
    # PoolExhausted raised: the core counts each where it raises it (csrc/preempt.c)
    "num_exhausted",
)

# A field: (name, numpy type string) or (name, type, shape).
Field = tuple

# The pool's last PoolExhausted, at the end of the segment header (after `op_seq`;
# docs/FORMAT.md section 1): the C core writes it under the free lock as it raises one, from the
# pool as the failed operation's rollback left it (csrc/preempt.c exhausted_note). A take draws on
# its own process's local cache and the shared free ring; blocks in other processes' local
# caches it cannot reach ("memory still free"), so the three are kept apart.
EXHAUSTION_FIELDS: list[Field] = [
    # wall-clock time of the raise (0: none recorded; cleared first and stored last)
    ("exhausted_ns", "<u8"),
    ("exhausted_pid", "<i4"),
    # the blocks the take needed
    ("exhausted_need", "<u4"),
    # free blocks in the shared free ring (quarantined ones included)
    ("exhausted_free", "<u4"),
    # free blocks in the raising process's own local cache (fewer than it needed)
    ("exhausted_own", "<u4"),
    # free blocks in the local caches of the other attached processes
    ("exhausted_local", "<u4"),
    ("exhausted_pad", "<u4"),
]


def block_fields(block_size: int) -> list[Field]:
    """One fixed record per physical block; the first 32 bytes are the checksummed identity."""
    fields: list[Field] = [
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
        # A quarantined block (guard mode): the free ring's allocation count when it was
        # quarantined; another free block: the pid that freed it, set by a release outside
        # guard mode, a refill (before the refilling process becomes its owner) and an
        # eviction, cleared by an allocation (integrity.freed_by).
        ("freed_at", "<u8"),
        ("tokens", "<i4", (block_size,)),
    ]
    if block_size % 2:
        fields.append(("pad2", "<u4"))
    # Digest probe: the high half of the block's K/V digest taken when it was published, over
    # the generation it was taken in (integrity.py); 0 when none. Appended last: the offsets of
    # the fields above are the same at every block size.
    fields.append(("kv_digest", "<u8"))
    return fields


def seq_fields(max_blocks_per_seq: int) -> list[Field]:
    """One slot per live sequence, with its block table (logical -> physical)."""
    return [
        ("state", "u1"),
        # 1: the slot belongs to owner_client's reserve (EMPTY until that process uses it).
        ("reserved", "u1"),
        # The call that created the sequence (allocate, fork; a resume keeps it): its site id
        # + 1; 0 not recorded.
        ("site", "<u2"),
        ("owner_pid", "<i4"),
        ("owner_client", "<i4"),
        ("num_blocks", "<u4"),
        ("owner_start", "<u8"),
        ("seq_id", "<u8"),
        ("request", f"S{REQUEST_BYTES}"),
        ("num_tokens", "<u8"),
        ("created_ns", "<u8"),
        # The last call that served the sequence (allocate, fork, append, mark_computed,
        # set_state, resume, lease), on CLOCK_MONOTONIC at the tick (the coarse clock the core's
        # gate reads): the whole-pool check's idle_request (allocator/idle.py).
        ("active_ns", "<u8"),
        ("table", "<i4", (max_blocks_per_seq,)),
        # (records start 8-byte aligned: the core and sequence.py read num_tokens as a u8 word)
        *([("table_pad", "u1", (4,))] if max_blocks_per_seq % 2 else []),
    ]


# Bytes the lock record keeps for its mutex (a process-shared robust pthread_mutex_t: 40 bytes
# with glibc on x86-64, 48 on 64-bit Arm).
LOCK_MUTEX_BYTES = 48
LOCK_FIELDS: list[Field] = [
    ("mutex", "u1", (LOCK_MUTEX_BYTES,)),
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
    # to 192 bytes: a record never shares a cache line with its neighbour
    ("pad", "u1", (48,)),
]
RING_HEADER_FIELDS: list[Field] = [
    ("head", "<u8"),
    ("tail", "<u8"),
    ("count", "<u4"),
    ("pad", "<u4"),
    ("allocs", "<u8"),
]
INDEX_FIELDS: list[Field] = [("hash", "<u8"), ("block", "<i4"), ("pad", "<u4")]
# The shared LRU list (written by the C core under the free lock): its header, then LRU_KEEP
# entries, the oldest cached blocks one scan found, oldest first.
LRU_HEADER_FIELDS: list[Field] = [
    # entries the scan left (0: none remembered), and the next one to look at
    ("count", "<u4"),
    ("pos", "<u4"),
    # cached blocks the scan saw, less those evicted from the list since
    ("cached", "<u8"),
    # pool scans that refilled the list, and evictions served from it without a scan
    ("scans", "<u8"),
    ("takes", "<u8"),
]
# An entry holds while its block is CACHED with the access time the scan saw.
LRU_ENTRY_FIELDS: list[Field] = [("block", "<i4"), ("pad", "<u4"), ("access_ns", "<u8")]
# One flight-recorder event (each client has a ring of them).
EVENT_FIELDS: list[Field] = [
    ("time_ns", "<u8"),
    ("pid", "<i4"),
    ("op", "u1"),
    ("pad", "u1", (3,)),
    ("block", "<i4"),
    ("generation", "<u4"),
    ("arg", "<i8"),
    ("request", f"S{REQUEST_BYTES}"),
]
# -- the operation log (docs/REPLAY.md) ---------------------------------------------------------
# A file of chunks the C core appends (csrc/oplog.c) while recording is on: each chunk a header
# (OPLOG_CHUNK_FIELDS) and compact records (docs/REPLAY.md); a reader expands them into records
# of OPLOG_FIELDS (csrc/oplog.c oplog_expand).
OPLOG_MAGIC = 0x504F_564B  # "KVOP": an expanded record
OPLOG_CHUNK_MAGIC = 0x434F_564B  # "KVOC": a chunk of the file
OPLOG_VERSION = 6
# The versions a reader takes: version 5 is version 6 without the FLUSH record, version 4 is
# version 5 without the COPY record.
OPLOG_READABLE = (4, 5, 6)


class OpCode(enum.IntEnum):
    """An operation log record's `op`."""

    START = 1  # a handle began recording: its JSON text (geometry, probes, faults) follows
    ALLOCATE = 2
    APPEND = 3
    FORK = 4
    MARK_COMPUTED = 5
    FREE = 6
    ABORT = 7
    SET_STATE = 8
    RESUME = 9
    EVICT = 10
    REPORT = 11  # a finding reported between operations (KVPool.report: pool.verify(), lockdep)
    LOST = 12  # `arg` records this handle could not write (a failed write(2)) before this one
    LEASE = 13  # KVPool.lease (its lease part: OPLOG_LEASE_FIELDS)
    LEASE_RELEASE = 14  # KVPool.lease_release (Lease.release)
    EXPIRE_LEASES = 15  # KVPool.expire_leases: `arg` the now_ns it compared deadlines with
    STORE = 16  # a store check's input (probes/stores.py Writers.check: OPLOG_STORE_FIELDS)
    # the pool's metadata at this record's number (allocator/checkpoint.py: a recording that
    # does not start at the pool's creation, a bounded log's checkpoint): its bytes follow
    SNAPSHOT = 17
    # a recording handle's close (KVPool.close): the blocks of its local cache it returned to
    # the free ring (its table), its slot reserve's slots (`result`)
    CLOSE = 18
    # blocks the program copied (KVPool.copied: kvscope.kernels.copy_blocks(..., pool=)), as
    # the record's copies
    COPY = 19
    # KVPool.flush_local: the blocks of its local cache it returned to the free ring (its table),
    # which another process's next allocate may take
    FLUSH = 20


class OpStatus(enum.IntEnum):
    """An operation log record's `status`: how the operation returned."""

    OK = 0
    EXHAUSTED = 1  # PoolExhausted
    REFUSED = 2  # another PoolError (a sequence already ended, a bad argument, JournalFull)
    ERROR = 3  # any other exception (TypeError, OSError, RuntimeError)


# Record flags.
OPLOG_FAULT = 1  # an injected fault fired inside the operation
OPLOG_REDACTED = 2  # tokens and request ids are keyed hashes
# A REPORT's `arg` where the findings it holds are a device check's answer, applied at a settle
# after the operation that queued the check (a CUDA pool's), whose number is its `src_id`
# (-1: none known; csrc/oplog.c oplog_answer_report)
OPLOG_ANSWER = -1
# One record: these fields, then int32 tokens[n_tokens] (START: n_tokens bytes of UTF-8 JSON;
# SNAPSHOT: n_tokens bytes, allocator/checkpoint.py),
# int32 blocks[n_blocks], int32 copies[2 * n_copies] (src, dst), int64 preempted[n_preempted]
# (the seq ids the operation preempted), n_found findings (OPLOG_FOUND_FIELDS), a lease
# operation's lease part (OPLOG_LEASE_FIELDS), a STORE's store part (OPLOG_STORE_FIELDS), zero
# padding to a multiple of 8 bytes. `check` is the record's hash with `check` itself 0
# (csrc/oplog.c).
OPLOG_FIELDS: list[Field] = [
    ("magic", "<u4"),
    ("size", "<u4"),
    ("seq", "<u8"),
    ("check", "<u8"),
    ("time_ns", "<u8"),
    ("pid", "<i4"),
    ("tid", "<i4"),
    ("op", "u1"),
    ("status", "u1"),
    ("flags", "u1"),
    ("n_found", "u1"),
    ("probes", "<u4"),
    ("n_tokens", "<u4"),
    ("n_blocks", "<u4"),
    ("n_copies", "<u4"),
    ("n_preempted", "<u4"),
    # the pool's tag (allocator/oplog.py pool_tag: several pools may record into one file)
    ("pool", "<u4"),
    # the injected faults that fired since the record before (bit i: faults.FAULTS[i])
    ("faults", "<u4"),
    # the sequence operated on (allocate, fork: the new one; -1: none), fork's source
    ("seq_id", "<i8"),
    ("src_id", "<i8"),
    # mark_computed's count, evict's count, set_state's state (1 running, 2 waiting), LOST's
    ("arg", "<i8"),
    # allocate's hit blocks, resume's cached tokens, mark_computed's and evict's count
    ("result", "<i8"),
    ("request", f"S{REQUEST_BYTES}"),
]
OPLOG_FOUND_FIELDS: list[Field] = [("block", "<i4"), ("kind", "S28")]
# A lease operation's record (LEASE, LEASE_RELEASE, EXPIRE_LEASES) ends with this, after its
# findings; its `tokens` are the lease's blocks' generations at the take (u4).
OPLOG_LEASE_FIELDS: list[Field] = [
    # 1 read, 2 write (0: none, or a mode the core refused)
    ("mode", "u1"),
    ("pad", "u1", (3,)),
    # the lease's record in the lease table (-1: none)
    ("record", "<i4"),
    ("lease_id", "<u8"),
    # the take's timeout argument (0: none) and the deadline it set on CLOCK_MONOTONIC
    # (2^64 - 1: none)
    ("timeout_ns", "<u8"),
    ("deadline_ns", "<u8"),
    ("holder", f"S{REQUEST_BYTES}"),
]
# A STORE record (a store check's input: docs/REPLAY.md) ends with this, then int64
# spans[3 * n_spans] (each the writer's seq id, start, end: positions [start, end)) and int64
# slots[n_slots] (the slot mapping it checked; none where its slots are checked later). Its `arg`
# says what the check compared there (1: the writers' blocks, 2: the slots, 3: both), `src_id`
# a slots-only record's store: the number of the record that checked its blocks (-1: none).
OPLOG_STORE_FIELDS: list[Field] = [("n_spans", "<u4"), ("n_slots", "<u4")]
# Leases (docs/POOL.md "Leases"; FORMAT.md section 13): the section's header, then one lease
# count per block (u4), then the lease records (lease_capacity of them).
LEASE_HEADER_FIELDS: list[Field] = [
    # records in the table, leases held now, blocks freed while leased and not yet given back
    ("capacity", "<u4"),
    ("active", "<u4"),
    ("quarantined", "<u4"),
    ("pad", "<u4"),
    # the last lease id handed out (ids start at 1)
    ("next_id", "<u8"),
    # leases taken, released, write leases that completed into a changed block, leaks reported,
    # leases reclaimed from dead holders or a holder's close
    ("taken", "<u8"),
    ("released", "<u8"),
    ("late", "<u8"),
    ("leaked", "<u8"),
    ("reclaimed", "<u8"),
]


class LeaseState(enum.IntEnum):
    """State of a lease record."""

    EMPTY = 0
    HELD = 1
    # held, and reported as a leak (past its deadline): reported once
    LEAKED = 2


class LeaseMode(enum.IntEnum):
    """What a lease's transfer does with its blocks."""

    READ = 1
    WRITE = 2


def lease_capacity(max_seqs: int) -> int:
    """Lease records a pool holds: a quarter of its sequence slots, at least 64 (at most
    `max_seqs`): transfers in flight are a fraction of the sequences, and each record holds a
    whole block table."""
    return min(max_seqs, max(64, max_seqs // 4))


def lease_fields(max_blocks_per_seq: int) -> list[Field]:
    """One lease: its holder, what it was taken on, and each block with its generation then."""
    return [
        ("state", "u1"),
        ("mode", "u1"),
        # 1: taken on a sequence (seq_slot, seq_id name it), 0: on a list of blocks
        ("on_seq", "u1"),
        ("pad", "u1"),
        ("holder_client", "<i4"),
        ("holder_pid", "<i4"),
        ("num_blocks", "<u4"),
        ("holder_start", "<u8"),
        ("lease_id", "<u8"),
        ("seq_id", "<u8"),
        ("seq_slot", "<i4"),
        # where it was taken: a site id of the site table (-1: sites off), as a block's `site`
        ("site", "<i4"),
        # wall-clock time it was taken; its deadline on CLOCK_MONOTONIC (a leak past it)
        ("taken_ns", "<u8"),
        ("deadline_ns", "<u8"),
        ("holder", f"S{REQUEST_BYTES}"),
        ("request", f"S{REQUEST_BYTES}"),
        ("blocks", "<i4", (max_blocks_per_seq,)),
        ("generations", "<u4", (max_blocks_per_seq,)),
    ]


# A chunk of the log file: this header, then `n_records` compact records, zero padding to a
# multiple of 8 bytes. `check` is the chunk's hash with `check` itself 0 (the records' hash).
OPLOG_CHUNK_FIELDS: list[Field] = [
    ("magic", "<u4"),
    ("size", "<u4"),
    ("check", "<u8"),
    ("seq", "<u8"),  # the first record's number (each record holds its difference from the last)
    ("time_ns", "<u8"),  # the wall clock the records' times count from
    ("pid", "<i4"),
    ("pool", "<u4"),
    ("n_records", "<u4"),
    ("flags", "<u4"),  # OPLOG_REDACTED
]

# Slot provenance (docs/POOL.md "Slot provenance"; FORMAT.md section 14): one record per KV slot
# a token can hold (num_blocks * block_size, block-major), written by the C core for the
# sampled sequences' tokens as it hands their slots out (allocate, append) and read by the hit
# check and the sweep. A record counts only while its generation is its block's generation.
PROVENANCE_FIELDS: list[Field] = [
    # the writing sequence's id (the sequence record's seq_id: its request while it lives)
    ("seq_id", "<u8"),
    # the logical position written, and the token id written there
    ("position", "<i4"),
    ("token", "<i4"),
    # the block's generation when written (0: never written); stored last
    ("generation", "<u4"),
    # a short hash of the writing request's id (FNV-1a of its 32 bytes, folded to 32 bits)
    ("request_hash", "<u4"),
    # a short hash of the slot's K/V (every layer, K and V) taken when its block was published,
    # on a pool whose data the core reaches (a CPU pool); 0: none
    ("kv_hash", "<u4"),
    ("pad", "<u4"),
]

JOURNAL_ENTRY_FIELDS: list[Field] = [
    ("offset", "<u8"),
    ("length", "<u4"),
    ("data_off", "<u4"),
    ("op", "<u8"),
]

# -- the segment header, the client records, findings, lock-order edges, sites -----------------
FINDINGS_CAPACITY = 256
LOCKGRAPH_CAPACITY = 256
NUM_SITES = 1024


class ClientState(enum.IntEnum):
    """State of a client (attached process) record."""

    EMPTY = 0
    ATTACHED = 1
    DETACHED = 2


# The header's fields before `checksum`, which covers them (checksums.HEADER_CHECKSUM_BYTES):
# written once, at creation.
HEADER_IMMUTABLE: list[Field] = [
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
    # The creating process's KVSCOPE_IDLE_REQUEST_S and KVSCOPE_LOCK_HOLD_S in ms (0: off):
    # the thresholds every reader of the pool uses unless its own environment sets one
    # (allocator/header.py threshold_s).
    ("idle_request_ms", "<u4"),
    ("lock_hold_ms", "<u4"),
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
    ("off_lru", "<u8"),
    ("off_leases", "<u8"),
    ("off_provenance", "<u8"),
    ("segment_size", "<u8"),
    ("data_bytes", "<u8"),
]
HEADER_FIELDS: list[Field] = [
    *HEADER_IMMUTABLE,
    ("checksum", "<u8"),
    ("cuda_ipc_len", "<u4"),
    ("cuda_ipc", "S1024"),
    ("num_sites_used", "<u4"),
    ("findings_head", "<u8"),
    ("lockgraph_used", "<u4"),
    ("next_seq_id", "<u8"),
    ("refcount_peak", "<u4"),
    # the totals of clients that detached or were reclaimed
    *[(name, "<u8") for name in COUNTER_FIELDS],
    # The operation log's global sequence number: the last one taken (docs/REPLAY.md; the C
    # core's atomic add, by every process recording).
    ("op_seq_pad", "<u4"),
    ("op_seq", "<u8"),
    # The pool's last PoolExhausted, written by the C core.
    *EXHAUSTION_FIELDS,
]
CLIENT_FIELDS: list[Field] = [
    ("state", "u1"),
    ("pad", "u1", (3,)),
    ("pid", "<i4"),
    ("start", "<u8"),
    ("attached_ns", "<u8"),
    ("seq", "<u8"),
    # the operation running now: where the core publishes the locks it waits for (waits.py)
    ("op", "<u8"),
    ("local_count", "<u4"),
    ("journal_count", "<u4"),
    ("journal_used", "<u4"),
    ("event_count", "<u4"),
    ("event_head", "<u8"),
    ("local", "<i4", (LOCAL_CACHE_MAX,)),
    # the counters, one block of u8s in COUNTER_FIELDS order (the core indexes them)
    *[(name, "<u8") for name in COUNTER_FIELDS],
    ("journal", JOURNAL_ENTRY_FIELDS, (JOURNAL_ENTRIES,)),
    ("journal_data", "u1", (JOURNAL_BYTES,)),
]
LOCKGRAPH_FIELDS: list[Field] = [
    ("src", "S16"),
    ("dst", "S16"),
    ("pid", "<i4"),
    ("pad", "<u4"),
    ("site", "S120"),
]
FINDING_FIELDS: list[Field] = [
    ("time_ns", "<u8"),
    ("kind", "S24"),
    ("severity", "u1"),
    # 1 once `kvscope check --repair` answered it (KVPool.clear_repaired); readers skip it.
    ("repaired", "u1"),
    ("pad", "u1", (2,)),
    ("block", "<i4"),
    ("owner_pid", "<i4"),
    # The allocation site of the block as the finding saw it, site id + 1 (0: none): the
    # block may have been handed out again since (a write after free found at its reuse).
    ("site", "<u4"),
    ("request", f"S{REQUEST_BYTES}"),
    ("message", "S200"),
]
SITE_FIELDS: list[Field] = [("text", "S120"), ("hits", "<u8")]

# -- the C core's names -------------------------------------------------------------------------

# C macro prefix -> (record, the last field named): a record's fields up to that one get
# `PREFIX + NAME.upper()` (the block and sequence records end in arrays sized by the geometry;
# the C core takes their record sizes at run time).
C_RECORDS = {
    "BF_": ("block", "tokens"),
    "SF_": ("seq", "table"),
    "LF_": ("lock", "max_hold_ns"),
    "RING_": ("ring_header", "allocs"),
    "JE_": ("journal_entry", "op"),
    "EV_": ("event", "request"),
    "LRU_": ("lru_header", "takes"),
    "LE_": ("lru_entry", "access_ns"),
    "OR_": ("oplog", "request"),
    "OF_": ("oplog_found", "kind"),
    "OL_": ("oplog_lease", "holder"),
    "OW_": ("oplog_store", "n_slots"),
    "LH_": ("lease_header", "reclaimed"),
    "LS_": ("lease", "blocks"),
    "PV_": ("provenance", "kv_hash"),
    "OC_": ("oplog_chunk", "flags"),
    "HDR_": ("header", "exhausted_pad"),
    "CF_": ("client", "journal_data"),
    "FD_": ("finding", "message"),
    "LG_": ("lockgraph", "site"),
    "SR_": ("site", "hits"),
}
# Shorter names the C core uses for some fields (the systematic ones are defined too).
C_ALIASES = {
    "LF_ACQUIRED": ("lock", "acquired_ns"),
    "LF_ACQUIRES": ("lock", "num_acquires"),
    "LF_CONTENDED": ("lock", "num_contended"),
    "LF_WAIT": ("lock", "wait_ns"),
    "LF_HOLD": ("lock", "hold_ns"),
    "LF_MAX_HOLD": ("lock", "max_hold_ns"),
    "EV_TIME": ("event", "time_ns"),
    # the counters: one block of u8s in COUNTER_FIELDS order, in the header and each client
    "HDR_COUNTERS": ("header", COUNTER_FIELDS[0]),
    "CF_COUNTERS": ("client", COUNTER_FIELDS[0]),
}
# C macro -> the record whose whole size it is.
C_SIZES = {
    "LOCK_SIZE": "lock",
    "RING_IDS": "ring_header",  # the ring's block ids follow its header
    "INDEX_ENTRY": "index",
    "JENTRY": "journal_entry",
    "EV_SIZE": "event",
    "LRU_ENTRIES": "lru_header",  # the list's entries follow its header
    "LRU_ENTRY": "lru_entry",
    "OPLOG_HEAD": "oplog",
    "OPLOG_FOUND": "oplog_found",
    "OPLOG_LEASE": "oplog_lease",
    "OPLOG_STORE": "oplog_store",
    "LEASE_COUNTS": "lease_header",  # the per-block lease counts follow its header
    "PROVENANCE": "provenance",
    "OPLOG_CHUNK": "oplog_chunk",
    "HEADER_SIZE": "header",
    "CLIENT_SIZE": "client",
    "FINDING_SIZE": "finding",
    "LOCKGRAPH_SIZE": "lockgraph",
    "SITE_SIZE": "site",
}
# C macro -> (record, field) whose bytes it is (the text fields the core fills).
C_FIELD_SIZES = {
    "FD_KIND_BYTES": ("finding", "kind"),
    "FD_MESSAGE_BYTES": ("finding", "message"),
    "LG_SITE_BYTES": ("lockgraph", "site"),
    "SR_TEXT_BYTES": ("site", "text"),
}


def record_fields(record: str) -> list[Field]:
    """The fields of one of the C_RECORDS / C_SIZES records (arrays at their smallest size)."""
    return {
        "block": lambda: block_fields(2),
        "seq": lambda: seq_fields(1),
        "lock": lambda: LOCK_FIELDS,
        "ring_header": lambda: RING_HEADER_FIELDS,
        "index": lambda: INDEX_FIELDS,
        "journal_entry": lambda: JOURNAL_ENTRY_FIELDS,
        "event": lambda: EVENT_FIELDS,
        "lru_header": lambda: LRU_HEADER_FIELDS,
        "lru_entry": lambda: LRU_ENTRY_FIELDS,
        "oplog": lambda: OPLOG_FIELDS,
        "oplog_found": lambda: OPLOG_FOUND_FIELDS,
        "oplog_lease": lambda: OPLOG_LEASE_FIELDS,
        "oplog_store": lambda: OPLOG_STORE_FIELDS,
        "lease_header": lambda: LEASE_HEADER_FIELDS,
        "lease": lambda: lease_fields(2),
        "provenance": lambda: PROVENANCE_FIELDS,
        "oplog_chunk": lambda: OPLOG_CHUNK_FIELDS,
        "header": lambda: HEADER_FIELDS,
        "client": lambda: CLIENT_FIELDS,
        "finding": lambda: FINDING_FIELDS,
        "lockgraph": lambda: LOCKGRAPH_FIELDS,
        "site": lambda: SITE_FIELDS,
    }[record]()


def _counter_name(field: str) -> str:
    return "C_" + field.removeprefix("num_").removeprefix("prefix_").upper()


def c_values() -> dict[str, int]:
    """Every constant of the C core that is not an offset: magic, sizes, states, counters."""
    out = {
        "BLOCK_MAGIC": BLOCK_MAGIC,
        "REQUEST_BYTES": REQUEST_BYTES,
        "LOCAL_CACHE_MAX": LOCAL_CACHE_MAX,
        "CHUNK": CHUNK,
        "EVICT_BATCH": EVICT_BATCH,
        "LRU_KEEP": LRU_KEEP,
        "SEQ_ID_BATCH": SEQ_ID_BATCH,
        "NUM_COUNTERS": len(COUNTER_FIELDS),
        "LOCK_MUTEX_BYTES": LOCK_MUTEX_BYTES,
        "OPLOG_MAGIC": OPLOG_MAGIC,
        "OPLOG_CHUNK_MAGIC": OPLOG_CHUNK_MAGIC,
        "OPLOG_FAULT": OPLOG_FAULT,
        "OPLOG_REDACTED": OPLOG_REDACTED,
        "OPLOG_ANSWER": OPLOG_ANSWER,
        "JOURNAL_ENTRIES": JOURNAL_ENTRIES,
        "JOURNAL_BYTES": JOURNAL_BYTES,
        "FINDINGS_CAPACITY": FINDINGS_CAPACITY,
        "LOCKGRAPH_CAPACITY": LOCKGRAPH_CAPACITY,
        "NUM_SITES": NUM_SITES,
    }
    out.update({f"OP_{o.name}": int(o) for o in OpCode})
    out.update({f"OS_{o.name}": int(o) for o in OpStatus})
    out.update({f"B_{s.name}": int(s) for s in BlockState})
    out.update({f"S_{s.name}": int(s) for s in SeqState})
    out.update({f"L_{s.name}": int(s) for s in LeaseState})
    out.update({f"LM_{s.name}": int(s) for s in LeaseMode})
    out.update({f"CL_{s.name}": int(s) for s in ClientState})
    out.update({_counter_name(f): i for i, f in enumerate(COUNTER_FIELDS)})
    return out


def c_offset_names() -> dict[str, tuple[str, str]]:
    """C macro -> (record, field) of every offset the C core uses."""
    out: dict[str, tuple[str, str]] = {}
    for prefix, (record, last) in C_RECORDS.items():
        for f in record_fields(record):
            out[prefix + f[0].upper()] = (record, f[0])
            if f[0] == last:
                break
    out.update(C_ALIASES)
    return out


_ITEM = {"u1": 1, "<u2": 2, "<u4": 4, "<i4": 4, "<u8": 8, "<i8": 8}


def _itemsize(f: Field) -> int:
    """Bytes of one packed field (numpy's unaligned structured layout)."""
    kind = f[1]
    if isinstance(kind, list):  # a record within the record
        size = packed_offsets(kind)[""]
    else:
        size = int(kind[1:]) if kind.startswith("S") else _ITEM[kind]
    for n in f[2] if len(f) > 2 else ():
        size *= n
    return size


def packed_offsets(fields: list[Field]) -> dict[str, int]:
    """Field -> byte offset, and the record size under key '' (no padding, as numpy packs)."""
    out, pos = {}, 0
    for f in fields:
        out[f[0]] = pos
        pos += _itemsize(f)
    out[""] = pos
    return out


def c_constants() -> dict[str, int]:
    """Every name the C core takes from this file, with its value."""
    out = c_values()
    for name, (record, field) in c_offset_names().items():
        out[name] = packed_offsets(record_fields(record))[field]
    for name, record in C_SIZES.items():
        out[name] = packed_offsets(record_fields(record))[""]
    for name, (record, field) in C_FIELD_SIZES.items():
        f = next(f for f in record_fields(record) if f[0] == field)
        out[name] = _itemsize(f)
    return out


def c_header() -> str:
    """allocator/csrc/layout.h: the constants as macros, the table `_native.LAYOUT` exports, and
    the header's checked fields (the magic probe names the one a change hit)."""
    consts = c_constants()
    lines = [
        "/* Generated by setup.py from allocator/records.py: do not edit (edit records.py). */",
        "#ifndef KVSCOPE_LAYOUT_H",
        "#define KVSCOPE_LAYOUT_H",
    ]
    lines += [
        f"#define {k} {v:#x}u"
        if k in ("BLOCK_MAGIC", "OPLOG_MAGIC", "OPLOG_CHUNK_MAGIC")
        else f"#define {k} {v}"
        for k, v in consts.items()
    ]
    lines.append("static const struct { const char *name; long long value; } KV_LAYOUT[] = {")
    lines += [f'    {{"{k}", {k}}},' for k in consts]
    lines += [
        "};",
        "/* The header's checked fields (HEADER_IMMUTABLE): the one a header_corrupt names. */",
        "static const struct { const char *name; int off, size; } HEADER_CHECKED[] = {",
        *[f'    {{"{f[0]}", HDR_{f[0].upper()}, {_itemsize(f)}}},' for f in HEADER_IMMUTABLE],
        "};",
        "/* _native.LAYOUT: name -> value, what this build was compiled with. */",
        "static PyObject *layout_dict(void) {",
        "    PyObject *d = PyDict_New();",
        "    for (size_t i = 0; d && i < sizeof KV_LAYOUT / sizeof KV_LAYOUT[0]; i++) {",
        "        PyObject *v = PyLong_FromLongLong(KV_LAYOUT[i].value);",
        "        if (v == NULL || PyDict_SetItemString(d, KV_LAYOUT[i].name, v) < 0) Py_CLEAR(d);",
        "        Py_XDECREF(v);",
        "    }",
        "    return d;",
        "}",
        "#endif",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(c_header(), end="")
