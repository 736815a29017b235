"""Range checks for a segment header read from a file: every geometry field, before any use.

A header's checksum only says that its bytes are the ones its writer sealed, and anyone who can
write the file can reseal it. So every field that sizes a dtype, a section or a loop is checked
against fixed bounds and against the others (offsets, segment size, KV data size) before a
`Layout` is built from it: a hostile or damaged header becomes one `PoolError` line, never a
numpy error, a hang or a huge allocation. The bounds are far above any pool `PoolConfig` makes.
"""

from __future__ import annotations

import numpy as np

from kvscope.allocator.layout import (
    HEADER_DTYPE,
    LOCAL_CACHE_MAX,
    Flag,
    Layout,
    lock_names,
)

# Bytes per element of each KV dtype (kvdata.py checks this against torch at import).
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}

# (field, lowest, highest): far above anything PoolConfig creates, low enough that a dtype or a
# section built from them stays small until the file size is compared.
BOUNDS = (
    ("num_blocks", 1, 2**31 - 2),
    ("block_size", 1, 1024),
    ("num_layers", 1, 2**16),
    ("num_kv_heads", 1, 2**16),
    ("head_dim", 1, 2**16),
    ("max_seqs", 1, 2**24),
    ("max_blocks_per_seq", 1, 2**24),
    ("max_clients", 1, 1024),
    ("num_shards", 1, 2**16),
    ("index_capacity", 1, 2**34),
    ("event_capacity", 0, 2**24),
    ("local_cache_size", 0, LOCAL_CACHE_MAX),
    ("flags", 0, int(Flag.GUARD | Flag.EVENTS | Flag.LOCKDEP)),
)

SECTION_FIELDS = (
    ("off_blocks", "blocks"),
    ("off_ring", "ring"),
    ("off_index", "index"),
    ("off_seqs", "seqs"),
    ("off_sites", "sites"),
    ("off_locks", "locks"),
    ("off_clients", "clients"),
    ("off_events", "events"),
    ("off_lockgraph", "lockgraph"),
    ("off_findings", "findings"),
    ("off_lru", "lru"),
    ("off_leases", "leases"),
    ("off_provenance", "provenance"),
    ("segment_size", "end"),
)


def _text(raw: bytes | np.bytes_) -> str:
    return bytes(raw).decode("ascii", errors="replace")


def data_bytes_of(h: np.void) -> int:
    """Bytes of the KV tensor the header's geometry describes (its dtype must be known)."""
    return (
        int(h["num_layers"])
        * 2
        * int(h["num_blocks"])
        * int(h["slots_per_block"])
        * int(h["num_kv_heads"])
        * int(h["head_dim"])
        * ELEMENT_BYTES[_text(h["dtype"])]
    )


def _end(field: str) -> int:
    dt, off = HEADER_DTYPE.fields[field][:2]  # type: ignore[index]
    return int(off) + int(dt.itemsize)


def geometry_problem(h: np.void, known_bytes: int = HEADER_DTYPE.itemsize) -> str | None:
    """What is wrong with a header's geometry (checksum aside), or None when it is usable.

    Args:
        known_bytes: how many leading header bytes are real (a saved prefix); fields past
            them are not checked.
    """
    if int(h["header_size"]) != HEADER_DTYPE.itemsize:
        return f"header_size is {int(h['header_size'])}, expected {HEADER_DTYPE.itemsize}"
    for name, lo, hi in BOUNDS:
        value = int(h[name])
        if not lo <= value <= hi:
            return f"{name} is {value}, outside [{lo}, {hi}]"
    bs, shards = int(h["block_size"]), int(h["num_shards"])
    if int(h["slots_per_block"]) not in (bs, bs + 1):
        return f"slots_per_block is {int(h['slots_per_block'])}, expected {bs} or {bs + 1}"
    if shards & (shards - 1):
        return f"num_shards is {shards}, not a power of two"
    cap = int(h["index_capacity"])
    if cap & (cap - 1) or cap < shards:
        return f"index_capacity is {cap}, not a power of two of at least num_shards ({shards})"
    if int(h["num_locks"]) != len(lock_names(shards)):
        return f"num_locks is {int(h['num_locks'])}, expected {len(lock_names(shards))}"
    dtype, device = _text(h["dtype"]), _text(h["device"])
    if dtype not in ELEMENT_BYTES:
        return f"dtype is {dtype!r}, not one of {', '.join(ELEMENT_BYTES)}"
    if not (device == "cpu" or device == "cuda" or _is_cuda_index(device)):
        return f"device is {device!r}, not 'cpu' or 'cuda[:N]'"
    off = Layout.from_header(h).offsets()
    for field, section in SECTION_FIELDS:
        if _end(field) <= known_bytes and int(h[field]) != off[section]:
            return f"{field} is {int(h[field])}, but the geometry puts it at {off[section]}"
    if _end("data_bytes") <= known_bytes and int(h["data_bytes"]) != data_bytes_of(h):
        return f"data_bytes is {int(h['data_bytes'])}, but the geometry needs {data_bytes_of(h)}"
    return None


def _is_cuda_index(device: str) -> bool:
    head, _, index = device.partition(":")
    return head == "cuda" and index.isdigit() and len(index) <= 3
