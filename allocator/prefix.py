"""Prefix hashing: the coefficients the C core hashes blocks with, and the 64-bit finalizer.

The core (csrc/prefix.c) chains the hash of block j to its parent's: H_j = H_{j-1} * P + c_j
(mod 2^64), where c_j is the polynomial of the block's tokens with the coefficients `COEFS`
(handed to the core when a handle is made: native.py). The stored and indexed key is fmix64(H_j),
never 0, in the shard of the prompt's first key. Equal keys name equal prefixes unless two
collide, which the stored token ids and parent key catch.

`fmix64` is the pool's one 64-bit finalizer in Python (the block digests' too: kvbits.py,
integrity.py); the C core's is `fmix64` in csrc/core.h and the kernels' the Triton `fmix64` in
kernels/digest.py, equal bit for bit (tests/test_hash_finalizer.py).
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from kvscope.allocator.layout import MASK64

# One odd coefficient per token position of a block (at most 1024 tokens).
COEFS = [
    int(x)
    for x in np.random.default_rng(0x4B5653).integers(0, 2**63, size=1024, dtype=np.uint64) | 1
]


H = TypeVar("H", int, np.ndarray)


def fmix64(h: H) -> H:
    """MurmurHash3's 64-bit finalizer, never 0: a Python int (any, taken mod 2^64) or an array
    (elementwise, as uint64).

    The finalizer is a bijection that maps 0 to 0; 0 is reserved for "none" (an empty index
    slot, a block with no digest), so 0 maps to 1 instead (as does one other input).
    """
    if isinstance(h, np.ndarray):
        # (uint64 arrays wrap silently; a 0-d one's scalars would warn)
        with np.errstate(over="ignore"):
            return _murmur_fmix(h.astype(np.uint64, copy=False))
    return _murmur_fmix(h)


def _murmur_fmix(h: H) -> H:
    h = h & MASK64
    h = h ^ (h >> 33)
    h = (h * 0xFF51_AFD7_ED55_8CCD) & MASK64
    h = h ^ (h >> 33)
    h = (h * 0xC4CE_B9FE_1A85_EC53) & MASK64
    h = h ^ (h >> 33)
    return h | (h == 0)
