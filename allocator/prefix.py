"""Prefix hashing and the prefix index (open addressing, sharded by hash).

The hash of block j chains its parent's: H_j = H_{j-1} * P + c_j (mod 2^64), where c_j is a
random-coefficient polynomial of the block's tokens, so all of a prompt's block hashes come
from one vectorised cumulative sum. The stored and indexed key is fmix64(H_j), never 0. Equal
keys name equal prefixes unless two collide, which the stored token ids and parent key catch.

`fmix64` is the pool's one 64-bit finalizer in Python (the block digests' too: kvbits.py,
integrity.py); the C core's is `fmix64` in csrc/core.h and the kernels' the Triton `fmix64` in
kernels/digest.py, equal bit for bit (tests/test_hash_finalizer.py).
"""

from __future__ import annotations

from typing import NamedTuple, TypeVar

import numpy as np

from kvscope.allocator.crash import crash_point
from kvscope.allocator.layout import INDEX_DTYPE, MASK64, SegmentView

_P = 0x100000001B3
_P_INV = pow(_P, -1, 1 << 64)
_MAX_COEFS = 1024
_COEFS = np.random.default_rng(0x4B5653).integers(0, 2**63, size=_MAX_COEFS, dtype=np.uint64) | 1


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


def chain_hashes(tokens: np.ndarray, block_size: int, start: int = 0) -> np.ndarray:
    """Linear chain values H_j for the full blocks of `tokens`, continuing from `start` (H_{-1})."""
    n = len(tokens) // block_size
    if n == 0:
        return np.zeros(0, np.uint64)
    t = (
        np.asarray(tokens[: n * block_size], dtype=np.int64)
        .astype(np.uint64)
        .reshape(n, block_size)
    )
    with np.errstate(over="ignore"):
        c = (t * _COEFS[:block_size]).sum(axis=1, dtype=np.uint64)
        pj = np.ones(n, np.uint64)
        pinv = np.ones(n, np.uint64)
        if n > 1:
            pj[1:] = np.cumprod(np.full(n - 1, _P, np.uint64), dtype=np.uint64)
            pinv[1:] = np.cumprod(np.full(n - 1, _P_INV, np.uint64), dtype=np.uint64)
        # H_j = P^j * (start * P + sum_{i<=j} c_i * P^-i)
        acc = np.cumsum(c * pinv, dtype=np.uint64) + np.uint64((start * _P) & MASK64)
        h = pj * acc
    return h


def chain_one(prev: int, tokens: list[int]) -> int:
    """Scalar twin of `chain_hashes` for one block."""
    c = 0
    for t, k in zip(tokens, _COEFS_LIST):
        c = (c + (t & MASK64) * k) & MASK64
    return (prev * _P + c) & MASK64


_COEFS_LIST = [int(x) for x in _COEFS]


def keys_of(chain: np.ndarray) -> np.ndarray:
    """Index keys (never 0) of chain values."""
    return fmix64(chain)


def family_keys(keys: np.ndarray, shard_mask: int) -> np.ndarray:
    """Keys whose shard bits are those of the prompt's first key (never 0).

    Every block of one prompt then lives in one index shard, so an allocation, publication or
    free of a prompt takes one shard lock, not every shard's (prompts spread over the shards).
    """
    if len(keys) == 0 or shard_mask == 0:
        return keys
    m = np.uint64(shard_mask)
    out = (keys & ~m) | (keys[0] & m)
    out[out == 0] = m + np.uint64(1)
    return out


def family_key(key: int, first: int, shard_mask: int) -> int:
    """Scalar twin of `family_keys`: `key` in the shard of the prompt's first key `first`."""
    k = (key & ~shard_mask & MASK64) | (first & shard_mask)
    return k or shard_mask + 1


def key_of(chain: int) -> int:
    """Index key of one chain value (scalar twin of `keys_of`)."""
    return fmix64(chain)


class PrefixIndex:
    """Open-addressing table key -> block id; shard s owns slots [s*W, (s+1)*W)."""

    def __init__(self, view: SegmentView):
        self.keys = view.index["hash"]
        self.blocks = view.index["block"]
        self.base = view.offsets["index"]
        self.capacity = len(self.keys)
        self.num_shards = view.layout.num_shards
        self.width = self.capacity // self.num_shards
        # Probing reads one key per step: flat uint64 / int32 views of the section (entry i's
        # key is word 2 i, its block word 4 i + 2) cost less than numpy scalars.
        assert INDEX_DTYPE.itemsize == 16 and INDEX_DTYPE.fields["block"][1] == 8
        raw = view.index.view(np.uint8).data
        self.q = raw.cast("Q")
        self.i = raw.cast("i")

    def shard(self, key: int) -> int:
        """The shard (and lock) that owns a key."""
        return key & (self.num_shards - 1)

    def _start(self, key: int) -> tuple[int, int]:
        s = self.shard(key)
        return s * self.width, (key >> 16) % self.width

    def lookup(self, key: int) -> int:
        """Block indexed under key, or -1."""
        base, i = self._start(key)
        q, w = self.q, self.width
        for _ in range(w):
            k = q[2 * (base + i)]
            if k == key:
                return self.i[4 * (base + i) + 2]
            if k == 0:
                return -1
            i = (i + 1) % w
        return -1

    def insert(self, key: int, block: int, journal) -> bool:
        """Index block under key; False if the key is already present or the shard is full."""
        base, i = self._start(key)
        keys, w = self.keys, self.width
        q = self.q
        for _ in range(w):
            k = q[2 * (base + i)]
            if k == key:
                return False
            if k == 0:
                journal.save(self.base + (base + i) * INDEX_DTYPE.itemsize, INDEX_DTYPE.itemsize)
                self.blocks[base + i] = block
                keys[base + i] = key
                crash_point("prefix.after_insert")
                return True
            i = (i + 1) % w
        return False

    def plan_remove(self, key: int, block: int) -> Removal | None:
        """What removing key (if it maps to block) writes, with backward-shift deletion: its
        slot, the later entries of its probe run pulled back into the hole (at most one lap),
        and the slot left empty; None if absent. Nothing is written."""
        base, i = self._start(key)
        w = self.width
        q, bi = self.q, self.i
        for _ in range(w):
            k = q[2 * (base + i)]
            if k == 0:
                return None
            if k == key and bi[4 * (base + i) + 2] == block:
                break
            i = (i + 1) % w
        else:
            return None
        moves: list[tuple[int, int]] = []
        hole = i
        j = (i + 1) % w
        for _ in range(w - 1):
            kj = q[2 * (base + j)]
            if kj == 0:
                break
            home = (kj >> 16) % w
            # Move entry j into the hole if its home is not in the cyclic range (hole, j].
            if (j - home) % w >= (j - hole) % w:
                moves.append((hole, j))
                hole = j
            j = (j + 1) % w
        # The slots written are [i, hole] (cyclic within the shard): journaled as one range,
        # two when it wraps, whatever the number of moves.
        size = INDEX_DTYPE.itemsize
        if hole >= i:
            spans = [(self.base + (base + i) * size, (hole - i + 1) * size)]
        else:
            spans = [
                (self.base + (base + i) * size, (w - i) * size),
                (self.base + base * size, (hole + 1) * size),
            ]
        return Removal(base, moves, hole, spans)

    def apply_remove(self, r: Removal, journal, by_slot: bool = False) -> None:
        """Carry out a planned removal (the index unchanged since `plan_remove`), journaling
        the range of slots it writes, or (`by_slot`) each slot it writes on its own."""
        size = INDEX_DTYPE.itemsize
        if by_slot:
            for hole in r.slots:
                journal.save(self.base + (r.base + hole) * size, size)
        else:
            for off, length in r.spans:
                journal.save(off, length)
        q, bi, base = self.q, self.i, r.base
        for hole, j in r.moves:
            q[2 * (base + hole)] = q[2 * (base + j)]
            bi[4 * (base + hole) + 2] = bi[4 * (base + j) + 2]
        q[2 * (base + r.last)] = 0
        bi[4 * (base + r.last) + 2] = -1

    def remove(self, key: int, block: int, journal) -> bool:
        """Remove key (if it maps to block) with backward-shift deletion; False if absent.

        Journals at most two ranges of index slots however many entries shift back (each
        written slot on its own when those are fewer bytes)."""
        r = self.plan_remove(key, block)
        if r is None:
            return False
        self.apply_remove(r, journal, by_slot=r.slot_bytes < r.nbytes)
        return True


class Removal(NamedTuple):
    """A planned index removal (`PrefixIndex.plan_remove`)."""

    # The shard's first slot; (hole, j) entries moved back, in order; the slot left empty;
    # the (segment offset, length) ranges it writes.
    base: int
    moves: list[tuple[int, int]]
    last: int
    spans: list[tuple[int, int]]

    @property
    def entries(self) -> int:
        """Journal entries the removal saves."""
        return len(self.spans)

    @property
    def nbytes(self) -> int:
        """Journal bytes the removal saves as ranges."""
        return sum(length for _, length in self.spans)

    @property
    def slots(self) -> list[int]:
        """The slots it writes (shard-relative): each hole filled, then the one left empty."""
        return [hole for hole, _ in self.moves] + [self.last]

    @property
    def slot_bytes(self) -> int:
        """Journal bytes the removal saves slot by slot (one entry per slot written)."""
        return (len(self.moves) + 1) * INDEX_DTYPE.itemsize
