"""The pool's C core (allocator/_native.c, csrc/): its view of the segment, made for each handle.

The core is the pool's only writer: allocate, free/abort, append (copy-on-write too),
mark_computed, fork, set_state and resume, eviction, the slot reserve, recovery and close run
in it, on the segment's bytes, journal and locks, preempting this handle's oldest waiting
sequence when a take is short and raising PoolExhausted (the class handed over once:
`register_errors`, with PoolError and JournalFull) when nothing is left, and PoolError
(TypeError for a non-integer) for what a caller gets wrong (a closed or a forked parent's
handle, a sequence that is not this handle's live one, a bad argument: docs/FORMAT.md). What
stops a transaction it deals with itself (more locks, evicting or preempting ahead, smaller
transactions); a case it does not handle is a bug, raised as a RuntimeError. `pip install`
compiles it; a missing or stale build fails the import in one line. Every probe `kvscope run`
switches on runs in the core (events, ownership, leaks, magic, lockdep, guard mode in full or
sampled, with a quarantine count or not, the digest: `PoolProbes.native_bits`, read from the
handle's probe word at every call), and so do the injectable faults and crash points
(csrc/faults.c, on the counts faults.py and crash.py keep); sites are the probe's site
table's, composed and interned by the core. The core waits for the pool locks it takes
(holding the op mutex meanwhile), recovers a dead holder of one itself (csrc/recovery.c), and
waits for another thread's operation on the handle before it starts one. The findings ring
and the site table have no other writer: KVPool.report and sites.py write through the core's
`report` and `intern_site`, and the findings the core detects it writes itself.
docs/FORMAT.md, "The core".

Guard mode's and the digest's work on the KV data (canaries, NaN poison, digests, a finished
request's unwritten slots: csrc/kvdata.c) the core does on the bytes of a CPU pool's data file,
mapped in this process. A CUDA pool's data it cannot reach: there it launches each operation's
checks itself (csrc/devchecks.c: one `cuLaunchKernel` of the check kernel, configured by
allocator/devicechecks.py), and reads and applies their answers later, when the GPU has them
(csrc/devanswers.c: no operation waits for the GPU). Nothing of it calls back into Python.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvscope.allocator import crash, faults, integrity, records
from kvscope.allocator.errors import JournalFull, PoolError, PoolExhausted
from kvscope.allocator.findings import ERROR, SEVERITY
from kvscope.allocator.layout import (
    CLIENT_DTYPE,
    COUNTER_FIELDS,
    EVENT_DTYPE,
    FINDING_DTYPE,
    FINDINGS_CAPACITY,
    HEADER_CHECKSUM_BYTES,
    INDEX_DTYPE,
    JOURNAL_BYTES,
    JOURNAL_ENTRIES,
    JOURNAL_ENTRY_DTYPE,
    LEASE_HEADER_DTYPE,
    LOCAL_CACHE_MAX,
    LOCK_DTYPE,
    LOCKGRAPH_CAPACITY,
    LOCKGRAPH_DTYPE,
    LRU_ENTRY_DTYPE,
    LRU_HEADER_DTYPE,
    NUM_SITES,
    OPLOG_CHUNK_DTYPE,
    OPLOG_DTYPE,
    OPLOG_FOUND_DTYPE,
    OPLOG_LEASE_DTYPE,
    OPLOG_STORE_DTYPE,
    PROVENANCE_DTYPE,
    RING_HEADER_DTYPE,
    SITE_DTYPE,
    ClientState,
    block_dtype,
    lease_dtype,
    seq_dtype,
)
from kvscope.allocator.locks import UNTRACED, lock_class
from kvscope.allocator.prefix import COEFS
from kvscope.allocator.sequence import SEQ_ID_BATCH, Sequence, slot_batch
from kvscope.allocator.sites import KVSCOPE_DIRS

if TYPE_CHECKING:
    from kvscope.allocator.handle import PoolHandle

try:
    from kvscope.allocator import _native as _built
except ImportError:
    raise ImportError(
        "kvscope: the pool's C core (kvscope.allocator._native) is not built; reinstall with "
        "a C compiler and Python headers: pip install -e ."
    ) from None
# (a compiled module: typed as Any for mypy, which has no stub of it)
_native: Any = _built


class LayoutMismatch(ImportError):
    """The C core was compiled for another segment layout than records.py/layout.py describe."""


def expected_layout() -> dict[str, int]:
    """Every constant the C core takes from records.py, with the value the numpy dtypes give
    (independent of the header generator's own arithmetic)."""
    dtypes = {
        "block": block_dtype(2),
        "seq": seq_dtype(1),
        "lock": LOCK_DTYPE,
        "ring_header": RING_HEADER_DTYPE,
        "index": INDEX_DTYPE,
        "journal_entry": JOURNAL_ENTRY_DTYPE,
        "event": EVENT_DTYPE,
        "lru_header": LRU_HEADER_DTYPE,
        "lru_entry": LRU_ENTRY_DTYPE,
        "oplog": OPLOG_DTYPE,
        "oplog_found": OPLOG_FOUND_DTYPE,
        "oplog_lease": OPLOG_LEASE_DTYPE,
        "oplog_store": OPLOG_STORE_DTYPE,
        "lease_header": LEASE_HEADER_DTYPE,
        "lease": lease_dtype(2),
        "provenance": PROVENANCE_DTYPE,
        "oplog_chunk": OPLOG_CHUNK_DTYPE,
    }
    out = records.c_values()
    for name, (record, field) in records.c_offset_names().items():
        out[name] = dtypes[record].fields[field][1]
    for name, record in records.C_SIZES.items():
        out[name] = dtypes[record].itemsize
    return out


def check_layout(built: Mapping[str, int]) -> None:
    """Raise LayoutMismatch unless `built` (the core's `_native.LAYOUT`) is today's layout."""
    want = expected_layout()
    diff = [
        f"{k}: built {built.get(k)}, layout {want.get(k)}"
        for k in sorted(set(want) | set(built))
        if built.get(k) != want.get(k)
    ]
    if diff:
        shown = "; ".join(diff[:3]) + (f" (and {len(diff) - 3} more)" if len(diff) > 3 else "")
        raise LayoutMismatch(
            "kvscope: the pool's C core (kvscope.allocator._native) was built for another "
            f"segment layout ({shown}); rebuild it: pip install -e ."
        )


# The counters are one block of u8s in COUNTER_FIELDS order (the core indexes them).
_CF = CLIENT_DTYPE.fields
assert all(_CF[f][1] == _CF[COUNTER_FIELDS[0]][1] + 8 * i for i, f in enumerate(COUNTER_FIELDS)), (
    "COUNTER_FIELDS are not contiguous in CLIENT_DTYPE"
)


check_layout(getattr(_native, "LAYOUT", {}))
# The exception classes the core raises (a full pool's PoolExhausted, a bad input's PoolError,
# an operation its journal cannot hold's JournalFull), handed over once.
_native.register_errors(PoolError, PoolExhausted, JournalFull)


def kv_layout(pool: PoolHandle) -> dict[str, Any]:
    """Where the core finds the KV data `[layers, 2, blocks, slots, heads, dim]` (csrc/kvdata.c):
    its address in this process (0: its checks are queued, csrc/devchecks.c: a CUDA pool, or a
    CPU pool under the tests' devicechecks.DEFERRED_ON_CPU), strides in bytes, the canary and
    poison bits of its element size."""
    import torch  # (the pool has imported it)

    from kvscope.allocator import devicechecks

    kv = pool.kv
    esize = kv.element_size()
    layers, _, _, spb, heads, dim = kv.shape
    direct = kv.device.type == "cpu" and kv.is_contiguous() and not devicechecks.DEFERRED_ON_CPU
    canary = nan = 0
    if spb > pool.block_size:
        from kvscope.kernels.canary import CANARY_BITS

        canary = CANARY_BITS.get(esize, 0)
    poison = kv.dtype.is_floating_point
    if poison:
        # kernels.checks.poison_bits, without the kernels' import
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[esize]
        bits = torch.full((1,), float("nan"), dtype=kv.dtype).view(width)
        nan = int(bits[0]) & ((1 << (8 * esize)) - 1)
    return {
        "kv_ptr": kv.data_ptr() if direct else 0,
        "kv_tensor": kv if direct else None,
        "kv_rows": layers * 2,
        "kv_row_stride": kv.stride(1) * esize,
        "kv_block_stride": kv.stride(2) * esize,
        "kv_slot_bytes": heads * dim * esize,
        "kv_spb": spb,
        "kv_esize": esize,
        "canary": canary,
        "nan_bits": nan,
        "poison_ok": int(poison),
        "off_kv_digest": pool.view.blocks.dtype.fields["kv_digest"][1],
        "unwritten_message": integrity.UNWRITTEN_MESSAGE,
    }


def probe_layout(pool: PoolHandle) -> dict[str, Any]:
    """Where the core writes what its probes find and what Python reports (csrc/probes.c): the
    lock-order graph, the findings ring with each kind's severity (1 error, 2 warning), and the
    site table (the list the core leaves its findings' ring positions in is `shared`'s:
    core_for)."""
    lg, fd = LOCKGRAPH_DTYPE.fields, FINDING_DTYPE.fields
    h = pool.view.header.dtype.fields
    assert h is not None
    return {
        "off_lockgraph": pool.view.offsets["lockgraph"],
        "lockgraph_used_at": h["lockgraph_used"][1],
        "lockgraph_record_size": LOCKGRAPH_DTYPE.itemsize,
        "lockgraph_capacity": LOCKGRAPH_CAPACITY,
        **{f"lg_{name}": lg[name][1] for name in ("src", "dst", "pid", "site")},
        "lg_site_bytes": lg["site"][0].itemsize,
        "lock_findings": pool.locks.index("findings"),
        "off_findings": pool.view.offsets["findings"],
        "findings_head_at": h["findings_head"][1],
        "finding_record_size": FINDING_DTYPE.itemsize,
        "findings_capacity": FINDINGS_CAPACITY,
        **{f"fd_{name}": fd[name][1] for name in FINDING_FIELDS},
        "fd_kind_bytes": fd["kind"][0].itemsize,
        "fd_message_bytes": fd["message"][0].itemsize,
        "lock_sites": pool.locks.index("sites"),
        "off_sites": pool.view.offsets["sites"],
        "site_record_size": SITE_DTYPE.itemsize,
        "site_text_bytes": SITE_DTYPE.fields["text"][0].itemsize,
        "num_sites": NUM_SITES,
        "sites_used_at": h["num_sites_used"][1],
        "finding_severity": {k.value: 1 if s == ERROR else 2 for k, s in SEVERITY.items()},
        "canary_message": integrity.CANARY_MESSAGE,
        "poison_message": integrity.POISON_MESSAGE,
        "modified_message": integrity.MODIFIED_MESSAGE,
        "blank_modified_message": integrity.BLANK_MODIFIED_MESSAGE,
        # magic: the header's fields, for the byte a header_corrupt finding names
        "header_fields": tuple((name, off, dt.itemsize) for name, (dt, off, *_) in h.items()),
    }


FINDING_FIELDS = ("time_ns", "kind", "severity", "block", "owner_pid", "site", "request", "message")


# The core holds its locks in a 64-bit mask: seqs, free, sites, findings and the index shards.
MAX_SHARDS = 32


def core_for(pool: PoolHandle, mf: Any, shared: dict[str, Any]) -> Any:
    """The C core for one handle (every handle has one), on the pool's mapping `mf`. `shared`:
    what the handle shares with it (KVPool._bind): `found` (the ring positions of the findings
    it writes in a call), `uid`, `mutex` (the op mutex), `overdue` and `probe_bits` (the light
    probes the core runs itself: probing.PoolProbes.native_bits)."""
    if len(pool.locks.names) > 64:
        raise PoolError(
            f"pool {pool.name!r} has {pool.view.layout.num_shards} index shards; the core "
            f"takes at most {MAX_SHARDS}"
        )
    view = pool.view
    off = view.offsets
    client = pool.client
    cbase = off["clients"] + client * CLIENT_DTYPE.itemsize
    cf = CLIENT_DTYPE.fields
    num_shards = view.layout.num_shards
    # Frees park up to twice the refill size in the local cache, within the client record.
    local_cap = int(view.h["local_cache_size"])
    layout = {
        "num_blocks": view.layout.num_blocks,
        "block_size": view.layout.block_size,
        "record_size": view.blocks.dtype.itemsize,
        "max_seqs": view.layout.max_seqs,
        "seq_record_size": view.seqs.dtype.itemsize,
        "max_blocks_per_seq": view.layout.max_blocks_per_seq,
        "index_width": len(view.index) // num_shards,
        "num_shards": num_shards,
        "local_cap": local_cap,
        "local_max": min(2 * local_cap, LOCAL_CACHE_MAX),
        "slot_batch": slot_batch(view.layout.max_seqs, view.layout.max_clients),
        "seq_id_batch": SEQ_ID_BATCH,
        "quarantine": int(view.h["quarantine"]),
        "off_blocks": off["blocks"],
        "off_ring": off["ring"],
        "off_index": off["index"],
        "off_seqs": off["seqs"],
        "off_locks": off["locks"],
        "off_lru": off["lru"],
        # leases (csrc/leases.c): the section, where its records start, a record's size
        "off_leases": off["leases"],
        "lease_records": view.layout.lease_records_at,
        "lease_record_size": view.layout.lease.itemsize,
        # slot provenance (csrc/provenance.c)
        "off_provenance": off["provenance"],
        "provenance_records": view.layout.provenance_records_at,
        "lease_capacity": view.layout.lease_capacity,
        "c_seq": cbase + cf["seq"][1],
        "c_local_count": cbase + cf["local_count"][1],
        "c_local": cbase + cf["local"][1],
        "c_jcount": cbase + cf["journal_count"][1],
        "c_jused": cbase + cf["journal_used"][1],
        "c_journal": cbase + cf["journal"][1],
        "c_jdata": cbase + cf["journal_data"][1],
        "c_counters": cbase + cf[COUNTER_FIELDS[0]][1],
        "c_wait": pool.locks.wait_at,
        "off_events": off["events"] + client * view.layout.event_capacity * EVENT_DTYPE.itemsize,
        "c_event_head": cbase + cf["event_head"][1],
        "event_capacity": view.layout.event_capacity,
        "max_clients": view.layout.max_clients,
        "client_record_size": CLIENT_DTYPE.itemsize,
        # every client's record (a full pool's PoolExhausted names other processes' caches)
        "off_clients": off["clients"],
        "cf_state": cf["state"][1],
        "cf_pid": cf["pid"][1],
        "cf_local_count": cf["local_count"][1],
        # recovery (csrc/recovery.c): a record's identity, the header's counters, a finding's
        # repaired byte
        "cf_start": cf["start"][1],
        "cf_attached_ns": cf["attached_ns"][1],
        "off_hdr_counters": view.header.dtype.fields[COUNTER_FIELDS[0]][1],
        "fd_repaired": FINDING_DTYPE.fields["repaired"][1],
        "client_attached": int(ClientState.ATTACHED),
        "client_detached": int(ClientState.DETACHED),
        # magic: the header's bytes up to and with its checksum
        "header_check_bytes": HEADER_CHECKSUM_BYTES + 8,
        "client": client,
        "lock_free": pool.FREE,
        "lock_shard0": pool.SHARDS[0],
        "lock_seqs": pool.SEQS,
        "off_next_seq_id": view.header.dtype.fields["next_seq_id"][1],
        "num_locks": len(pool.locks.names),
        "pid": pool.pid,
        "start": pool.start,
        "journal_entries": JOURNAL_ENTRIES,
        "journal_bytes": JOURNAL_BYTES,
        # (the handle's errors name the pool)
        "name": pool.name,
        "seq_type": Sequence,
        "seq_fields": tuple(f.name for f in dataclasses.fields(Sequence)),
        # The faults and crash points (csrc/faults.c): armed here, counted down by the core.
        "faults_armed": faults.ARMED,
        "fault_names": faults.FAULTS,
        "fault_fired": faults.fired,
        "write_past": faults.write_past,
        "crash_armed": crash.ARMED,
        "crash_points": tuple(crash.CRASH_POINTS),
        "off_num_blocks": view.header.dtype.fields["num_blocks"][1],
        **shared,
        "lock_classes": tuple(
            None if name in UNTRACED else lock_class(name) for name in pool.locks.names
        ),
        "kvscope_dirs": KVSCOPE_DIRS,
        "coefs": COEFS[: view.layout.block_size],
        # Guard mode and the digest on the KV data.
        **kv_layout(pool),
        **probe_layout(pool),
    }
    return _native.Native(mf.mm, mf.fd, layout)
