"""The segment header: writing a fresh one, sealing its checksum, reading the config back, and
naming the field that changed when it no longer checks."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kvscope.allocator.config import PoolConfig
from kvscope.allocator.geometry import SECTION_FIELDS
from kvscope.allocator.layout import (
    BLOCK_MAGIC,
    FORMAT_VERSION,
    HEADER_CHECKSUM_BYTES,
    HEADER_DTYPE,
    POOL_MAGIC,
    BlockState,
    Flag,
    Layout,
    SegmentView,
    block_checksums,
    header_checksum,
    lock_names,
)
from kvscope.allocator.probeflags import (
    IDLE_REQUEST_ENV,
    LOCK_HOLD_ENV,
    THRESHOLDS,
    env_seconds,
    threshold_ms,
)
from kvscope.allocator.process import my_identity, now_ns


def init_segment(view: SegmentView, cfg: PoolConfig, name: str) -> None:
    """Write a fresh header and empty sections."""
    h = view.header
    off = view.offsets
    pid, start = my_identity()
    flags = (Flag.GUARD if cfg.guard else 0) | (Flag.EVENTS if cfg.events else 0)
    flags |= Flag.LOCKDEP if cfg.lockdep else 0
    fields = dict(
        magic=POOL_MAGIC,
        version=FORMAT_VERSION,
        header_size=HEADER_DTYPE.itemsize,
        num_blocks=cfg.num_blocks,
        block_size=cfg.block_size,
        slots_per_block=cfg.slots_per_block,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=cfg.dtype.encode(),
        device=cfg.device.encode(),
        flags=int(flags),
        max_seqs=cfg.max_seqs,
        max_blocks_per_seq=cfg.max_blocks_per_seq,
        max_clients=cfg.max_clients,
        num_shards=cfg.num_shards,
        index_capacity=view.layout.index_capacity,
        num_locks=len(lock_names(cfg.num_shards)),
        event_capacity=cfg.event_capacity,
        local_cache_size=cfg.local_cache_size,
        quarantine=cfg.quarantine,
        idle_request_ms=threshold_ms(IDLE_REQUEST_ENV),
        lock_hold_ms=threshold_ms(LOCK_HOLD_ENV),
        creator_pid=pid,
        creator_start=start,
        created_ns=now_ns(),
        name=name.encode(),
        off_blocks=off["blocks"],
        off_ring=off["ring"],
        off_index=off["index"],
        off_seqs=off["seqs"],
        off_sites=off["sites"],
        off_locks=off["locks"],
        off_clients=off["clients"],
        off_events=off["events"],
        off_lockgraph=off["lockgraph"],
        off_findings=off["findings"],
        off_lru=off["lru"],
        off_leases=off["leases"],
        off_provenance=off["provenance"],
        segment_size=off["end"],
        data_bytes=cfg.data_bytes,
    )
    for k, v in fields.items():
        h[k] = v
    n = cfg.num_blocks
    ids = np.arange(n, dtype=np.int64)
    b = view.blocks
    b["magic"] = BLOCK_MAGIC
    b["state"] = BlockState.FREE
    b["owner_client"] = -1
    b["site"] = -1
    b["checksum"] = block_checksums(b, ids)
    view.ring[:] = ids
    view.ring_header["head"], view.ring_header["tail"], view.ring_header["count"] = 0, n, n
    view.index["block"] = -1
    view.seqs["table"] = -1
    view.lease_header["capacity"] = view.layout.lease_capacity
    names = lock_names(cfg.num_shards)
    for i, lname in enumerate(names):
        view.locks["name"][i] = lname.encode()
    # (each record's process-shared robust mutex: the C core's, which takes them; imported here,
    # when a segment is made, so that the package's import meets a missing core in native.py,
    # which says how to rebuild it)
    from kvscope.allocator import _native

    _native.init_lock_mutexes(view.raw[off["locks"] :], len(names))


def seal_header(view: SegmentView) -> None:
    """Checksum the immutable header fields (after the last of them is written)."""
    view.header["checksum"] = header_checksum(view.raw)


def config_from_header(h: np.void) -> PoolConfig:
    """The PoolConfig a header records."""
    flags = int(h["flags"])
    return PoolConfig(
        num_blocks=int(h["num_blocks"]),
        block_size=int(h["block_size"]),
        num_layers=int(h["num_layers"]),
        num_kv_heads=int(h["num_kv_heads"]),
        head_dim=int(h["head_dim"]),
        dtype=bytes(h["dtype"]).decode(),
        device=bytes(h["device"]).decode(),
        max_seqs=int(h["max_seqs"]),
        max_blocks_per_seq=int(h["max_blocks_per_seq"]),
        max_clients=int(h["max_clients"]),
        local_cache_size=int(h["local_cache_size"]),
        num_shards=int(h["num_shards"]),
        event_capacity=int(h["event_capacity"]),
        guard=bool(flags & Flag.GUARD),
        events=bool(flags & Flag.EVENTS),
        lockdep=bool(flags & Flag.LOCKDEP),
        quarantine=int(h["quarantine"]),
    )


def _expected_from_layout(layout: Layout) -> dict[str, int]:
    """The header's geometry fields as the layout the segment was opened with says they are."""
    off = layout.offsets()
    out = {
        "magic": POOL_MAGIC,
        "version": FORMAT_VERSION,
        "header_size": HEADER_DTYPE.itemsize,
        "num_blocks": layout.num_blocks,
        "block_size": layout.block_size,
        "max_seqs": layout.max_seqs,
        "max_blocks_per_seq": layout.max_blocks_per_seq,
        "max_clients": layout.max_clients,
        "num_shards": layout.num_shards,
        "index_capacity": layout.index_capacity,
        "num_locks": len(lock_names(layout.num_shards)),
        "event_capacity": layout.event_capacity,
    }
    for field, section in SECTION_FIELDS:
        out[field] = off[section]
    return out


def _show(field: str, raw: bytes) -> str:
    dt = HEADER_DTYPE.fields[field][0]  # type: ignore[index]
    if dt.kind in "ui":
        value = int(np.frombuffer(raw, dt, 1)[0])
        return (
            f"{value:#x}"
            if dt.itemsize == 8 and field in ("magic", "creator_start")
            else f"{value} (bytes {raw.hex()})"
        )
    return repr(raw.rstrip(b"\0"))


def header_corruption(
    raw: bytes, layout: Layout | None = None, intact: bytes | None = None
) -> dict[str, Any] | None:
    """Which immutable header field differs from what it must be: the first one, in byte order,
    with the bytes found and expected; None when every known field is as expected.

    Args:
        raw: the header's bytes now (at least its checksummed part).
        layout: the layout the segment was opened with (its geometry fields must match it).
        intact: the header's first bytes as last seen intact (a dump's or a run's saved copy).
    """
    expected: dict[str, bytes] = {}
    for field, value in (_expected_from_layout(layout) if layout else {}).items():
        expected[field] = np.array(value, HEADER_DTYPE.fields[field][0]).tobytes()  # type: ignore[index]
    for field in HEADER_DTYPE.names or ():
        dt, off = HEADER_DTYPE.fields[field][:2]  # type: ignore[index]
        end = off + dt.itemsize
        if intact is not None and end <= min(len(intact), HEADER_CHECKSUM_BYTES):
            expected.setdefault(field, bytes(intact[off:end]))
    for field in HEADER_DTYPE.names or ():
        dt, off = HEADER_DTYPE.fields[field][:2]  # type: ignore[index]
        if field not in expected or off + dt.itemsize > len(raw):
            continue
        found = bytes(raw[off : off + dt.itemsize])
        if found != expected[field]:
            return {
                "field": field,
                "offset": int(off),
                "found": found.hex(),
                "expected": expected[field].hex(),
                "text": f"header field {field} (byte {off}) is {_show(field, found)}, expected {_show(field, expected[field])}",
            }
    return None


def threshold_s(view: SegmentView, name: str, environ=os.environ) -> float:
    """A live check's threshold (probeflags.THRESHOLDS) as a reader of `view` uses it: its own
    environment's where that sets one, else the one the pool's creator recorded in the header."""
    value = env_seconds(name, environ)
    if value is not None:
        return value
    return int(view.header[THRESHOLDS[name][0]][0]) / 1000
