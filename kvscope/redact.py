"""Redaction of prompt token ids in a segment copy (`kvscope dump --redact`).

Each token id becomes a keyed hash of the whole prefix that ends at it: the block's parent
prefix hash and every token of the block up to and including it. Equal prefixes therefore still
look equal (a prefix-sharing bug stays visible), while the key, drawn fresh for every dump and
never written, keeps the ids from being recovered or confirmed by guessing a prompt. Prefix
hashes (blocks and index) are keyed the same way, and block checksums are resealed so that a
redacted healthy block still checks healthy and a corrupt one still checks corrupt.
"""

from __future__ import annotations

import secrets

import numpy as np

from kvscope.allocator.layout import SegmentView, block_checksums

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


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


def redact_view(view: SegmentView) -> None:
    """Replace every token id and prefix hash in view (a private copy) with keyed hashes."""
    k1, k2, k3 = (np.uint64(secrets.randbits(64)) for _ in range(3))
    b = view.blocks
    n = len(b)
    ids = np.arange(n, dtype=np.int64)
    # Keep each record's checksum error (zero for intact records) across the rewrite.
    err = b["checksum"] ^ block_checksums(b, ids)
    tokens = b["tokens"]
    filled = np.minimum(b["num_tokens"].astype(np.int64), tokens.shape[1])
    with np.errstate(over="ignore"):
        h = _keyed(b["parent_hash"], k1, k2) ^ k3
        for j in range(tokens.shape[1]):
            h = _mix(h ^ (tokens[:, j].astype(np.int64).astype(np.uint64) + k3) + k1)
            out = (h >> np.uint64(33)).astype(np.int32)
            tokens[:, j] = np.where(j < filled, out, 0)
    b["prefix_hash"] = _keyed(b["prefix_hash"], k1, k2)
    b["parent_hash"] = _keyed(b["parent_hash"], k1, k2)
    view.index["hash"] = _keyed(view.index["hash"], k1, k2)
    b["checksum"] = block_checksums(b, ids) ^ err
