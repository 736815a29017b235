"""BlockStore: block state changes — take new blocks, drop references, evict — all journaled.

Who may write a block's header (docs/FORMAT.md, "Write domains"):
- FREE and QUARANTINED blocks: the holder of the `free` lock;
- LOCAL blocks and unindexed ALLOCATED blocks: their owner client, without a lock (no other
  process can reach them: cross-process sharing only goes through the prefix index);
- indexed blocks (ALLOCATED or CACHED): the holder of their index shard's lock.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from kvscope.allocator import eviction, ring
from kvscope.allocator.checksums import checksum_of_words
from kvscope.allocator.crash import crash_point
from kvscope.allocator.layout import (
    BLOCK_MAGIC,
    IDENTITY_WORDS,
    LOCAL_CACHE_MAX,
    REQUEST_BYTES,
    BlockState,
    SegmentView,
    block_checksums,
    block_dtype,
)
from kvscope.allocator.prefix import PrefixIndex
from kvscope.allocator.process import now_ns
from kvscope.allocator.txn import Txn

_F = block_dtype(16).fields
# Single-record writes: {magic, state, indexed}; {refcount, generation, owner_pid, owner_client,
# prefix_hash}; {owner_start, request, alloc_ns, access_ns, site, num_tokens, parent_hash}.
_HEAD = struct.Struct("<IBB")
_IDENTITY = struct.Struct("<iIiiQ")
_OWNER = struct.Struct(f"<Q{REQUEST_BYTES}sQQiIQ")
_WORDS = struct.Struct(f"<{IDENTITY_WORDS}Q")
_U4, _U8 = struct.Struct("<I"), struct.Struct("<Q")
_REFCOUNT, _GENERATION = _F["refcount"][1], _F["generation"][1]
_STATE, _INDEXED, _ACCESS_NS = _F["state"][1], _F["indexed"][1], _F["access_ns"][1]
_PREFIX_HASH, _PARENT_HASH = _F["prefix_hash"][1], _F["parent_hash"][1]
_CHECKSUM, _OWNER_START = _F["checksum"][1], _F["owner_start"][1]
# set_prefix_key writes both words at once; the layout keeps them adjacent.
assert _CHECKSUM == _PREFIX_HASH + 8 and _PREFIX_HASH // 8 < IDENTITY_WORDS
_KEY_AND_SUM = struct.Struct("<QQ")
assert _F["state"][1] == 4 and _F["indexed"][1] == 5 and _REFCOUNT == 8
assert _F["prefix_hash"][1] == _REFCOUNT + _IDENTITY.size - 8
assert _F["parent_hash"][1] == _OWNER_START + _OWNER.size - 8


class BlockStore:
    """Block headers, the free ring (ring.py), eviction (eviction.py) and this client's local
    cache."""

    def __init__(self, view: SegmentView, client: int, free_lock: int, shard_locks: list[int]):
        self.view = view
        self.blocks = view.blocks
        self.state = view.blocks["state"]
        self.refcount = view.blocks["refcount"]
        self.indexed = view.blocks["indexed"]
        self.generation = view.blocks["generation"]
        self.prefix_hash = view.blocks["prefix_hash"]
        self.access_ns = view.blocks["access_ns"]
        self.checksum = view.blocks["checksum"]
        self.tokens = view.blocks["tokens"]
        self.num_tokens = view.blocks["num_tokens"]
        self.base = view.offsets["blocks"]
        self.record_size = view.blocks.dtype.itemsize
        # Flat int32 / uint32 views of the whole segment for the per-token hot paths (a record
        # is a whole number of 4-byte words): field f of block b is at word
        # `at4[f] + b * rec4`. Numpy scalar access costs several times more.
        end = view.offsets["end"]
        self.mv = memoryview(view.buf)[:end]
        self.i32 = memoryview(view.buf)[:end].cast("i")
        self.u32 = memoryview(view.buf)[:end].cast("I")
        assert self.record_size % 4 == 0 and self.base % 4 == 0
        self.rec4 = self.record_size // 4
        self.block_size = view.layout.block_size
        fields = view.blocks.dtype.fields
        self.tokens_at4 = (self.base + fields["tokens"][1]) // 4
        self.num_tokens_at4 = (self.base + fields["num_tokens"][1]) // 4
        self.refcount_at4 = (self.base + fields["refcount"][1]) // 4
        self.num_blocks = view.layout.num_blocks
        self.ring = view.ring
        self.ring_header = view.ring_header
        self.ring_off = view.offsets["ring"]
        self.client = client
        crec = view.clients[client : client + 1]
        self.local = view.clients["local"][client]
        self.local_count = crec["local_count"]
        self.local_count_off = (
            view.offsets["clients"]
            + client * view.clients.dtype.itemsize
            + view.clients.dtype.fields["local_count"][1]
        )
        self.local_off = (
            view.offsets["clients"]
            + client * view.clients.dtype.itemsize
            + view.clients.dtype.fields["local"][1]
        )
        self.local_cap = int(view.h["local_cache_size"])
        # Frees park up to twice the refill size, within the client record's array.
        self.local_max = min(2 * self.local_cap, LOCAL_CACHE_MAX)
        self.quarantine = int(view.h["quarantine"])
        self.free_lock = free_lock
        self.shard_locks = shard_locks
        self.index = PrefixIndex(view)
        # Probe hooks (probing.py, writes.py), None when off: `verify_hook(t, ids)` checks
        # records before they are changed; `evict_hook(t, ids)` sees blocks being evicted.
        self.verify_hook: Callable[[Txn | None, np.ndarray], None] | None = None
        self.evict_hook: Callable[[Txn, np.ndarray], None] | None = None

    # -- journaling helpers -------------------------------------------------------------------

    def save(self, t: Txn, ids: np.ndarray) -> None:
        """Journal whole block records before changing them."""
        if self.verify_hook is not None:
            self.verify_hook(t, ids)
        if len(ids) == 1:
            # One record: a plain byte range is several times cheaper than the batch path.
            t.journal.save(self.base + int(ids[0]) * self.record_size, self.record_size)
        else:
            t.journal.save_records(self.blocks, self.base, ids)

    def seal(self, ids: np.ndarray) -> None:
        """Recompute the records' checksums after changing identity fields."""
        if len(ids) <= 8:
            for b in ids.tolist():
                self.seal_one(b)
        else:
            self.checksum[ids] = block_checksums(self.blocks, ids)

    def unsealed(self, ids: np.ndarray | list[int]) -> list[int]:
        """Blocks among ids whose record no longer matches its checksum."""
        if len(ids) <= 8:
            mv, base, size = self.mv, self.base, self.record_size
            out = []
            for b in ids.tolist() if isinstance(ids, np.ndarray) else ids:
                rec = base + b * size
                want = _U8.unpack_from(mv, rec + _CHECKSUM)[0]
                if checksum_of_words(_WORDS.unpack_from(mv, rec), b) != want:
                    out.append(b)
            return out
        arr = np.asarray(ids, np.int64)
        return arr[block_checksums(self.blocks, arr) != self.checksum[arr]].tolist()

    def is_indexed(self, b: int) -> bool:
        """True while the prefix index names block b."""
        return self.mv[self.base + b * self.record_size + _INDEXED] != 0

    def refcount_of(self, b: int) -> int:
        """Block b's reference count."""
        return self.i32[self.refcount_at4 + b * self.rec4]

    def holds_prefix(self, b: int, key: int, parent: int, tokens: list[int]) -> bool:
        """True if block b is indexed under `key`, after `parent`, holding exactly `tokens`."""
        mv, rec = self.mv, self.base + b * self.record_size
        if mv[rec + _INDEXED] != 1 or _U8.unpack_from(mv, rec + _PREFIX_HASH)[0] != key:
            return False
        if _U8.unpack_from(mv, rec + _PARENT_HASH)[0] != parent:
            return False
        at = self.tokens_at4 + b * self.rec4
        return self.i32[at : at + self.block_size].tolist() == tokens

    def num_private(self, ids: np.ndarray) -> int:
        """How many of ids are unindexed with at most one reference (freed when dropped)."""
        if len(ids) > 32:
            return int(((self.indexed[ids] == 0) & (self.refcount[ids] <= 1)).sum())
        mv, i32, base, size = self.mv, self.i32, self.base, self.record_size
        return sum(
            1
            for b in ids.tolist()
            if mv[base + b * size + _INDEXED] == 0 and i32[self.refcount_at4 + b * self.rec4] <= 1
        )

    def set_hashes(self, b: int, key: int, parent: int) -> None:
        """Record block b's prefix and parent keys (not indexed; the caller journals and seals)."""
        rec = self.base + b * self.record_size
        _U8.pack_into(self.mv, rec + _PREFIX_HASH, key)
        _U8.pack_into(self.mv, rec + _PARENT_HASH, parent)

    def publish(self, t: Txn, b: int, key: int, parent: int) -> None:
        """Mark block b indexed under `key` (its entry is already in the index; shard lock)."""
        rec = self.base + b * self.record_size
        if self.verify_hook is not None:
            self.verify_hook(t, np.array([b]))
        t.journal.save(rec, self.record_size)
        self.mv[rec + _INDEXED] = 1
        self.set_hashes(b, key, parent)
        self.seal_one(b)

    def set_prefix_key(self, b: int, key: int) -> None:
        """Set block b's prefix key and its new checksum in one 16-byte store (adjacent words)."""
        rec = self.base + b * self.record_size
        if self.verify_hook is not None:
            self.verify_hook(None, np.array([b]))
        words = list(_WORDS.unpack_from(self.mv, rec))
        words[_PREFIX_HASH // 8] = key
        _KEY_AND_SUM.pack_into(self.mv, rec + _PREFIX_HASH, key, checksum_of_words(words, b))

    def seal_one(self, b: int) -> None:
        """`seal` of one block, from its identity words read with struct."""
        rec = self.base + b * self.record_size
        _U8.pack_into(
            self.mv, rec + _CHECKSUM, checksum_of_words(_WORDS.unpack_from(self.mv, rec), b)
        )

    def shard_locks_for(self, ids: np.ndarray) -> set[int]:
        """Locks of the index shards that govern the indexed blocks among ids."""
        if len(ids) <= 32:
            # A sequence's table: a byte read per block beats building numpy masks.
            mv, base, size = self.mv, self.base, self.record_size
            mask = len(self.shard_locks) - 1
            out: set[int] = set()
            for b in ids.tolist() if isinstance(ids, np.ndarray) else ids:
                rec = base + int(b) * size
                if mv[rec + _INDEXED] == 1:
                    out.add(self.shard_locks[_U8.unpack_from(mv, rec + _PREFIX_HASH)[0] & mask])
            return out
        ids = np.asarray(ids, dtype=np.int64)
        keys = self.prefix_hash[ids[self.indexed[ids] == 1]]
        # a set of Python ints, not np.unique: that sorts, and cost the H200 machine's host
        # ~0.2 ms a call where a few dozen blocks were stamped at once (devicechecks)
        shards = set((keys & np.uint64(len(self.shard_locks) - 1)).tolist())
        return {self.shard_locks[s] for s in shards}

    # -- the free ring (ring.py) and eviction (eviction.py) -------------------------------------

    @property
    def ring_count(self) -> int:
        """Blocks in the free ring (a hint unless the free lock is held)."""
        return int(self.ring_header["count"][0])

    def ring_pop(self, t: Txn, k: int) -> np.ndarray:
        """Take k ids from the ring head (skipping blocks still in quarantine while others exist)."""
        return ring.pop(self, t, k)

    def ring_push(self, t: Txn, ids: np.ndarray, state: BlockState = BlockState.FREE) -> None:
        """Return blocks to the ring tail as FREE (QUARANTINED in guard mode)."""
        ring.push(self, t, ids, state)

    def evict(
        self,
        t: Txn,
        k: int,
        extra: int = 0,
        keep: tuple[int, int] = (0, 0),
        to_ring: int | None = None,
        partial: bool = False,
    ) -> np.ndarray:
        """Unindex up to k CACHED blocks (plus up to `extra`, at most a quarter of the rest),
        least recently used first, as many as the undo journal holds (eviction.evict); return
        them (not yet reset)."""
        return eviction.evict(self, t, k, extra, keep, to_ring, partial)

    # -- the local cache (owner only) --------------------------------------------------------

    def local_pop(self, t: Txn, k: int) -> np.ndarray:
        """Take up to k blocks from this client's local cache."""
        n = int(self.local_count[0])
        k = min(k, n)
        if k == 0:
            return np.zeros(0, np.int64)
        t.journal.save(self.local_count_off, 4)
        ids = self.local[n - k : n].astype(np.int64)
        self.local_count[0] = n - k
        crash_point("blocks.after_local_pop")
        return ids

    def local_push(self, t: Txn, ids: np.ndarray) -> np.ndarray:
        """Park blocks in the local cache (as LOCAL); return those that did not fit."""
        n = int(self.local_count[0])
        room = max(0, self.local_max - n)
        fit, rest = ids[:room], ids[room:]
        if len(fit):
            k = len(fit)
            self.save(t, fit)
            self.state[fit] = BlockState.LOCAL
            self.refcount[fit] = 0
            self.indexed[fit] = 0
            self.seal(fit)
            t.journal.save(self.local_count_off, 4)
            t.journal.save(self.local_off + 4 * n, 4 * k)
            self.local[n : n + k] = fit
            self.local_count[0] = n + k
        return rest

    def refill(self, t: Txn, pid: int, start: int) -> None:
        """Move a batch of FREE blocks from the ring into the local cache."""
        n = int(self.local_count[0])
        want = max(0, self.local_cap - n)
        ids = self.ring_pop(t, want)
        if len(ids):
            self.save(t, ids)
            self.blocks["owner_pid"][ids] = pid
            self.blocks["owner_client"][ids] = self.client
            self.blocks["owner_start"][ids] = start
            self.local_push(t, ids)

    # -- taking and dropping references --------------------------------------------------------

    def stamp(
        self, t: Txn, ids: np.ndarray, pid: int, start: int, request: bytes, site: int
    ) -> None:
        """Turn blocks this client now owns into fresh ALLOCATED blocks with refcount 1."""
        if len(ids) == 0:
            return
        self.save(t, ids)
        if len(ids) <= 4:
            # A few blocks (a decode step's new block): three struct stores per record.
            mv, now = self.mv, now_ns()
            for b in ids.tolist():
                rec = self.base + b * self.record_size
                gen = (_U4.unpack_from(mv, rec + _GENERATION)[0] + 1) & 0xFFFF_FFFF
                _HEAD.pack_into(mv, rec, BLOCK_MAGIC, BlockState.ALLOCATED, 0)
                _IDENTITY.pack_into(mv, rec + _REFCOUNT, 1, gen, pid, self.client, 0)
                _OWNER.pack_into(mv, rec + _OWNER_START, start, request, now, now, site, 0, 0)
                self.seal_one(b)
            crash_point("blocks.after_records")
            return
        b = self.blocks
        now = now_ns()
        b["magic"][ids] = BLOCK_MAGIC
        self.state[ids] = BlockState.ALLOCATED
        self.refcount[ids] = 1
        self.indexed[ids] = 0
        self.generation[ids] += 1
        b["owner_pid"][ids] = pid
        b["owner_client"][ids] = self.client
        b["owner_start"][ids] = start
        b["request"][ids] = request
        b["alloc_ns"][ids] = now
        self.access_ns[ids] = now
        b["site"][ids] = site
        b["num_tokens"][ids] = 0
        self.prefix_hash[ids] = 0
        b["parent_hash"][ids] = 0
        self.seal(ids)
        crash_point("blocks.after_records")

    def drop(self, t: Txn, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drop one reference to each block: (unindexed ones now unreferenced, ones already free).

        A block that is not ALLOCATED with a positive refcount is already free: it is left
        untouched and returned as a double free.
        """
        ids = np.asarray(ids, np.int64)
        if len(ids) == 0:
            return ids, ids
        if len(ids) <= 4:
            return self._drop_few(t, ids.tolist())
        live = (self.state[ids] == BlockState.ALLOCATED) & (self.refcount[ids] > 0)
        already, ids = ids[~live], ids[live]
        if len(ids) == 0:
            return ids, already
        self.save(t, ids)
        self.refcount[ids] -= 1
        now = now_ns()
        self.access_ns[ids] = now
        zero = ids[self.refcount[ids] == 0]
        idx = zero[self.indexed[zero] == 1]
        self.state[idx] = BlockState.CACHED
        self.seal(ids)
        return zero[self.indexed[zero] == 0], already

    def _drop_few(self, t: Txn, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """`drop` of a few blocks, one record at a time."""
        mv, i32, base, size = self.mv, self.i32, self.base, self.record_size
        allocated, cached = int(BlockState.ALLOCATED), int(BlockState.CACHED)
        now = now_ns()
        zero: list[int] = []
        already: list[int] = []
        for b in ids:
            rec = base + b * size
            at = self.refcount_at4 + b * self.rec4
            rc = i32[at]
            if mv[rec + _STATE] != allocated or rc <= 0:
                already.append(b)
                continue
            t.journal.save(rec, size)
            i32[at] = rc - 1
            _U8.pack_into(mv, rec + _ACCESS_NS, now)
            if rc == 1:
                if mv[rec + _INDEXED] == 1:
                    mv[rec + _STATE] = cached
                else:
                    zero.append(b)
            self.seal_one(b)
        return np.asarray(zero, np.int64), np.asarray(already, np.int64)

    def give_back(self, t: Txn, ids: np.ndarray) -> None:
        """Blocks with no references left: into the local cache, the rest to the ring."""
        rest = self.local_push(t, ids)
        if len(rest):
            self.ring_push(t, rest)
