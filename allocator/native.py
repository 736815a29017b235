"""The pool's C core (allocator/_native.c, csrc/): its view of the segment, made for each handle.

The core is the pool's only writer: allocate, free/abort, append (copy-on-write too),
mark_computed, fork, set_state and resume, eviction, the slot reserve, recovery and close run
in it, on the segment's bytes, journal and locks, preempting this handle's oldest waiting
sequence when a take is short and raising PoolExhausted (the class handed over once:
`register_errors`, with PoolError, JournalFull and HandleInherited) when nothing is left, and
PoolError (TypeError for a non-integer) for what a caller gets wrong (a closed handle, a
forked parent's: HandleInherited, a sequence that is not this handle's live one, a bad
argument: docs/FORMAT.md). What stops a transaction it deals with itself (more locks, evicting or preempting ahead, smaller
transactions); a case it does not handle is a bug, raised as a RuntimeError. `pip install`
compiles it; a missing or stale build fails the import in one line. Every probe `kvscope run`
switches on runs in the core (events, ownership, leaks, magic, lockdep, guard mode in full or
sampled, with a quarantine count or not, the digest: `PoolProbes.native_bits`, read from the
handle's probe word at every call), and so do the injectable faults and crash points
(csrc/faults.c, on the counts faults.py and crash.py keep); sites are the probe's site
table's, composed and interned by the core. The core waits for the pool locks it takes
(holding the op mutex meanwhile), recovers a dead holder of one itself (csrc/recovery.c), and
waits for another thread's operation on the handle before it starts one. The findings ring
and the site table have no other writer: KVPool.report writes through the core's `report`,
and the findings the core detects and the sites it composes it writes itself.
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

import numpy as np

from kvscope.allocator import crash, faults, integrity, records
from kvscope.allocator.errors import HandleInherited, JournalFull, PoolError, PoolExhausted
from kvscope.allocator.findings import ERROR, SEVERITY
from kvscope.allocator.locks import UNTRACED, lock_class
from kvscope.allocator.prefix import COEFS
from kvscope.allocator.sequence import Sequence, slot_batch
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
    """Every constant the C core takes from records.py, with the value numpy's packing of the
    records gives (independent of the header generator's own arithmetic)."""
    offsets = records.c_offset_names()
    named = [*offsets.values(), *records.C_FIELD_SIZES.values()]
    used = {r for r, _ in named} | set(records.C_SIZES.values())
    dt = {r: np.dtype(records.record_fields(r)) for r in used}
    out = records.c_values()
    out.update({k: dt[r].fields[f][1] for k, (r, f) in offsets.items()})
    out.update({k: dt[r].itemsize for k, r in records.C_SIZES.items()})
    out.update({k: dt[r].fields[f][0].itemsize for k, (r, f) in records.C_FIELD_SIZES.items()})
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


check_layout(getattr(_native, "LAYOUT", {}))
# The exception classes the core raises (a full pool's PoolExhausted, a bad input's PoolError,
# an operation its journal cannot hold's JournalFull, a forked parent's handle's
# HandleInherited), handed over once.
_native.register_errors(PoolError, PoolExhausted, JournalFull, HandleInherited)


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
    site table (their records' fields are layout.h's; the list the core leaves its findings'
    ring positions in is `shared`'s: core_for)."""
    return {
        "off_lockgraph": pool.view.offsets["lockgraph"],
        "lock_findings": pool.locks.index("findings"),
        "off_findings": pool.view.offsets["findings"],
        "lock_sites": pool.locks.index("sites"),
        "off_sites": pool.view.offsets["sites"],
        "finding_severity": {k.value: 1 if s == ERROR else 2 for k, s in SEVERITY.items()},
        "canary_message": integrity.CANARY_MESSAGE,
        "poison_message": integrity.POISON_MESSAGE,
        "modified_message": integrity.MODIFIED_MESSAGE,
        "blank_modified_message": integrity.BLANK_MODIFIED_MESSAGE,
    }


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
        "local_max": min(2 * local_cap, records.LOCAL_CACHE_MAX),
        "slot_batch": slot_batch(view.layout.max_seqs, view.layout.max_clients),
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
        # every client's record and event ring (the core finds this client's from `client`)
        "off_clients": off["clients"],
        "off_events": off["events"],
        "event_capacity": view.layout.event_capacity,
        "max_clients": view.layout.max_clients,
        "client": pool.client,
        "lock_free": pool.FREE,
        "lock_shard0": pool.SHARDS[0],
        "lock_seqs": pool.SEQS,
        "num_locks": len(pool.locks.names),
        "pid": pool.pid,
        "start": pool.start,
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
