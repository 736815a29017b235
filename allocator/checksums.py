"""Checksums of the segment: the immutable header fields and each block record's identity.

Below layout.py, which re-exports these functions beside the dtypes; the two sizes they need are
stated here and layout.py asserts its dtypes agree.
"""

from __future__ import annotations

import hashlib

import numpy as np

# The header bytes the checksum covers: every field before `checksum` (layout.HEADER_DTYPE).
HEADER_CHECKSUM_BYTES = 324
# A block record's identity: its first four u64 words (layout.block_dtype).
IDENTITY_WORDS = 4


def header_checksum(raw: np.ndarray) -> int:
    """Checksum over the immutable header fields (BLAKE2b, 8 bytes, little-endian)."""
    digest = hashlib.blake2b(raw[:HEADER_CHECKSUM_BYTES].tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


_K = np.array(
    [
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0x27D4EB2F165667C5,
        0xFF51AFD7ED558CCD,
    ],
    dtype=np.uint64,
)
MASK64 = (1 << 64) - 1


def block_words(blocks: np.ndarray) -> np.ndarray:
    """The block records as rows of little-endian 64-bit words (identity = first 4 words)."""
    return blocks.view(np.uint64).reshape(len(blocks), blocks.dtype.itemsize // 8)


def block_checksums(blocks: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Checksum of each block record's identity words (magic, state, refcount, generation, owner, hash)."""
    return _checksums(block_words(blocks)[ids, :IDENTITY_WORDS], ids)


def record_checksums(rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """block_checksums of records read out of the segment (`rows[i]` a copy of block
    `ids[i]`'s record): what its checksum says of the copy, however the live record moved on."""
    return _checksums(block_words(rows)[:, :IDENTITY_WORDS], ids)


def _checksums(w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = (w * _K[:IDENTITY_WORDS]).sum(axis=1, dtype=np.uint64) + np.asarray(
            ids, np.uint64
        ) * _K[4]
        h ^= h >> np.uint64(29)
        h *= _K[0]
        h ^= h >> np.uint64(32)
    return h
