"""Redaction of a segment copy (`kvscope dump --redact`): token ids, prefix keys, request ids.

Everything derived from a prompt or naming a request is replaced by a keyed hash, under keys
drawn fresh for every dump and never written, so nothing can be recovered or confirmed by
guessing a prompt or an id, while equal values stay equal and the analysis of the dump reports
what the original's would:

- each token id in a block record becomes a keyed hash of the whole prefix that ends at it (the
  block's parent key and every token of the block up to it), so equal prefixes still look equal;
- prefix keys (block `prefix_hash` and `parent_hash`, prefix-index keys) are keyed the same way
  everywhere, and the index is laid out again by the new keys (a key's slot is derived from it:
  leaving entries where they were would tell the original keys' bits); a key keeps its shard
  up to a keyed permutation, so no shard overflows;
- request ids, wherever they occur (block records, sequence table, event rings, lease table,
  findings ring, and inside findings' messages) become `r~` and 16 hex digits of a keyed BLAKE2b;
- the undo journals' saved bytes (old copies of records: tokens, request ids) are zeroed;
- slot provenance's token ids become the redacted token of their block's slot where they equal
  the block's token there (a clean slot still checks clean), a keyed hash elsewhere, and its
  request hashes are keyed too.

Block checksums are resealed so that a healthy block still checks healthy and a corrupt one
still checks corrupt. Site texts (code locations), lock names and the pool name are kept.
"""

from __future__ import annotations

import hashlib
import re
import secrets

import numpy as np

from kvscope.allocator.layout import REQUEST_BYTES, SegmentView, block_checksums

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
# A request id's stand-in: this prefix and 16 hex digits (18 bytes, within REQUEST_BYTES).
REDACTED_PREFIX = "r~"


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise (wraps mod 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _keyed(x: np.ndarray, k1: np.uint64, k2: np.uint64) -> np.ndarray:
    """Two keyed rounds of the mix (0 stays 0: it means "no hash" in the segment)."""
    with np.errstate(over="ignore"):
        out = _mix(_mix(x ^ k1) + k2)
    return np.where(x == 0, np.uint64(0), out)


class Redactor:
    """One dump's keys, and the keyed stand-in of each kind of value."""

    def __init__(self, num_shards: int):
        self.k1, self.k2, self.k3, self.k4 = (np.uint64(secrets.randbits(64)) for _ in range(4))
        self.request_key = secrets.token_bytes(32)
        self.shard_mask = np.uint64(max(num_shards, 1) - 1)
        self.requests: dict[bytes, bytes] = {}

    def prefix_keys(self, keys: np.ndarray) -> np.ndarray:
        """Keyed prefix keys: the shard bits permuted by a keyed XOR, the rest keyed hashes."""
        mask = self.shard_mask
        mixed = _keyed(keys, self.k1, self.k2)
        out = (mixed & ~mask) | ((keys & mask) ^ (self.k4 & mask))
        # 0 means "no key": an empty key stays empty, a key never becomes one.
        out = np.where(out == 0, mask + np.uint64(1), out)
        return np.where(keys == 0, np.uint64(0), out)

    def request(self, rid: bytes) -> bytes:
        """The stand-in of one request id (b"" stays b"")."""
        if not rid:
            return rid
        out = self.requests.get(rid)
        if out is None:
            digest = hashlib.blake2b(rid, key=self.request_key, digest_size=8).hexdigest()
            out = (REDACTED_PREFIX + digest).encode()
            assert len(out) <= REQUEST_BYTES
            self.requests[rid] = out
        return out

    def requests_in(self, field: np.ndarray) -> None:
        """Replace every request id in an `S32` array in place."""
        flat = field.reshape(-1)
        values, inverse = np.unique(flat, return_inverse=True)
        stand_in = np.array([self.request(bytes(v)) for v in values], dtype=flat.dtype)
        flat[:] = stand_in[inverse]

    def message(self, text: bytes) -> bytes:
        """A finding's message with each known request id replaced (longest first)."""
        for rid in sorted(self.requests, key=len, reverse=True):
            # A 32-byte id may be the cut-off head of a longer one: take the rest with it.
            tail = rb"[^'\"\s]*" if len(rid) >= REQUEST_BYTES else rb"(?![\w.-])"
            # The stand-in is `r~` and hex digits: no backslash for re.sub to interpret.
            text = re.sub(rb"(?<![\w.-])" + re.escape(rid) + tail, self.requests[rid], text)
        return text


def redact_view(view: SegmentView) -> None:
    """Replace token ids, prefix keys and request ids in view (a private copy) with keyed
    hashes, and zero the undo journals' saved bytes."""
    red = Redactor(view.layout.num_shards)
    prov = view.provenance
    same = prov["token"] == view.blocks["tokens"][:, : prov.shape[1]]
    _tokens(view, red)
    _provenance(view, red, same)
    _index(view, red)
    for arr in (view.blocks, view.seqs, view.events, view.findings, view.leases):
        red.requests_in(arr["request"])
    msgs = view.findings["message"]
    for i in range(len(msgs)):
        if msgs[i]:
            msgs[i] = red.message(bytes(msgs[i]))[: msgs.dtype.itemsize]
    view.clients["journal_data"] = 0


def _tokens(view: SegmentView, red: Redactor) -> None:
    b = view.blocks
    ids = np.arange(len(b), dtype=np.int64)
    # Keep each record's checksum error (zero for intact records) across the rewrite.
    err = b["checksum"] ^ block_checksums(b, ids)
    tokens = b["tokens"]
    filled = np.minimum(b["num_tokens"].astype(np.int64), tokens.shape[1])
    with np.errstate(over="ignore"):
        h = _keyed(b["parent_hash"], red.k1, red.k2) ^ red.k3
        for j in range(tokens.shape[1]):
            h = _mix(h ^ (tokens[:, j].astype(np.int64).astype(np.uint64) + red.k3) + red.k1)
            out = (h >> np.uint64(33)).astype(np.int32)
            tokens[:, j] = np.where(j < filled, out, 0)
    b["prefix_hash"] = red.prefix_keys(b["prefix_hash"])
    b["parent_hash"] = red.prefix_keys(b["parent_hash"])
    b["checksum"] = block_checksums(b, ids) ^ err


def _provenance(view: SegmentView, red: Redactor, same: np.ndarray) -> None:
    """Slot provenance's tokens and request hashes (the block tokens already redacted): a
    record's token that was its block's token at that slot becomes the redacted one."""
    prov = view.provenance
    with np.errstate(over="ignore"):
        other = _mix(prov["token"].astype(np.int64).astype(np.uint64) ^ red.k4) >> np.uint64(33)
        rh = _mix(prov["request_hash"].astype(np.uint64) ^ red.k2) >> np.uint64(32)
    prov["token"] = np.where(
        same, view.blocks["tokens"][:, : prov.shape[1]], other.astype(np.int32)
    )
    prov["request_hash"] = rh.astype(np.uint32)


def _index(view: SegmentView, red: Redactor) -> None:
    """Key the prefix index and lay it out again: each key in its shard, linearly probed from
    its home slot, as the pool would have placed it."""
    index = view.index
    used = np.flatnonzero(index["hash"] != 0)
    keys = red.prefix_keys(index["hash"][used]).tolist()
    blocks = index["block"][used].tolist()
    cap, shards = len(index), max(view.layout.num_shards, 1)
    width = cap // shards
    new_keys, new_blocks = [0] * cap, [-1] * cap
    for key, blk in zip(keys, blocks, strict=True):
        base, pos = (key & (shards - 1)) * width, (key >> 16) % width
        for _ in range(width):
            if new_keys[base + pos] == 0:
                break
            pos = (pos + 1) % width
        slot = base + pos
        if new_keys[slot]:
            # Only a damaged index has more keys in a shard than the shard holds: any free slot.
            slot = new_keys.index(0)
        new_keys[slot], new_blocks[slot] = key, blk
    index["hash"] = np.array(new_keys, np.uint64)
    index["block"] = np.array(new_blocks, np.int32)
