"""Sequence operations of a pool: allocate, fork, mark_computed, evict, resume; with append
(append.py), taking blocks (reserve.py) and free/abort (release.py) mixed in.

Mixed into KVPool (allocator/pool.py), which provides the segment views, `_run` and the locks.
"""

from __future__ import annotations

import numpy as np

from kvscope.allocator import faults
from kvscope.allocator.append import AppendOps
from kvscope.allocator.crash import crash_point
from kvscope.allocator.errors import PoolError, PoolExhausted
from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import CHUNK, BlockState
from kvscope.allocator.prefix import (
    chain_hashes,
    family_key,
    family_keys,
    key_of,
    keys_of,
)
from kvscope.allocator.process import now_ns
from kvscope.allocator.release import ReleaseOps
from kvscope.allocator.reserve import ReserveOps
from kvscope.allocator.sequence import STATE_NAMES, Sequence, request_bytes
from kvscope.allocator.txn import Txn


class SequenceOps(AppendOps, ReserveOps, ReleaseOps):
    """The operations on sequences and blocks (the `self` is always a KVPool)."""

    # -- public operations ---------------------------------------------------------------------

    def allocate(self, request_id: object, tokens: list[int]) -> Sequence:
        """Reserve blocks for a prompt, reusing cached prefix blocks; returns its Sequence."""
        guarded = self._guard_every > 1 and self._sample_guard()
        seq = None if self._native is None else self._native.allocate(self, tokens, request_id)
        if seq is None:
            seq = self._allocate(request_id, tokens)
        if guarded:
            # Sampled guard mode: this one is guarded (its release runs on the Python path).
            self._guarded.add(seq.slot)
        return seq

    def _allocate(self, request_id: object, tokens: list[int]) -> Sequence:
        # The Python path (a function of its own: its closures' cells cost every call).
        self._check_process()
        tokens = list(map(int, tokens))
        if not tokens:
            raise PoolError("allocate needs at least one token")
        bs = self.block_size
        n_blocks = -(-len(tokens) // bs)
        if n_blocks > self.view.layout.max_blocks_per_seq:
            raise PoolError(
                f"a prompt of {len(tokens)} tokens needs {n_blocks} blocks; PoolConfig.max_blocks_per_seq is {self.view.layout.max_blocks_per_seq}"
            )
        chain = [int(x) for x in chain_hashes(np.asarray(tokens), bs)]
        keys = self._keys(chain)
        max_hits = (len(tokens) - 1) // bs
        index = self.store.index
        shards = {self.SHARDS[index.shard(k)] for k in keys[:max_hits]}
        claim_locks = shards if self.seqtab.can_claim_locally() else {self.SEQS} | shards
        rb = request_bytes(request_id)
        site = self._site()
        # A prompt with a full block looks itself up in the index under the shard locks of its
        # keys: it takes its hits in one transaction and its new blocks in a second, so other
        # processes wait for those locks only while the hits are taken; a failure in the
        # second undoes the first.
        split = max_hits > 0

        def claim(t: Txn) -> tuple[int, int, list[int]]:
            slot, seq_id = self.seqtab.claim(t, rb, self.pid, self.start, self.client)
            hits = self._match(t, keys, tokens, max_hits)
            if split:
                self.seqtab.write_blocks(t, slot, 0, hits)
                self.view.seqs["num_tokens"][slot] = len(hits) * bs
            return slot, seq_id, hits

        def grow(t: Txn, slot: int, seq_id: int, hits: list[int]) -> Sequence:
            first = min(n_blocks, len(hits) + CHUNK)
            new = self._take(t, first - len(hits), rb, site=site)
            if faults.ARMED and len(new) and faults.fire("refcount-skew"):
                # A reference taken twice: the refcount no longer matches the block tables.
                self.store.save(t, new[:1])
                self.view.blocks["refcount"][new[:1]] += 1
                self.store.seal(new[:1])
            if self.probe is not None:
                self.probe.event(t, EventOp.PREFIX_HIT, hits, rb)
                self.probe.event(t, EventOp.ALLOCATE, new, rb, arg=seq_id)
                if len(hits) < max_hits:
                    self.probe.event(t, EventOp.PREFIX_MISS, [], rb, arg=max_hits - len(hits))
            table = hits + new.tolist()
            done = len(hits) if split else 0
            self.seqtab.write_blocks(t, slot, done, table[done:])
            self._fill(table, len(hits) * bs, tokens[len(hits) * bs : first * bs])
            self._set_hashes(new, len(hits), chain, keys)
            self.view.seqs["num_tokens"][slot] = min(len(tokens), first * bs)
            self._count(t, "prefix_queries", max_hits)
            self._count(t, "prefix_hits", len(hits))
            return Sequence(
                request_id=str(request_id),
                tokens=tokens[: first * bs],
                block_table=table,
                slot=slot,
                seq_id=seq_id,
                pool_uid=self._uid,
                num_cached_tokens=len(hits) * bs,
                chain=chain[:first],
                num_published=len(hits),
            )

        if not split:
            locks = claim_locks | self._take_locks(min(n_blocks, CHUNK))
            seq = self._run(locks, lambda t: grow(t, *claim(t)))
        else:
            slot, seq_id, hits = self._run(claim_locks, claim)
            more = min(n_blocks, len(hits) + CHUNK) - len(hits)
            try:
                seq = self._run(self._take_locks(more), lambda t: grow(t, slot, seq_id, hits))
            except BaseException as e:
                self._unclaim(slot, hits)
                if isinstance(e, PoolExhausted):
                    raise self._exhausted(e.needed) from None
                raise
        self._seqs[seq.slot] = seq
        if len(seq.tokens) < len(tokens):
            try:
                self.append(seq, tokens[len(seq.tokens) :])
            except BaseException:
                self.abort(seq)
                raise
        return seq

    def _unclaim(self, slot: int, hits: list[int]) -> None:
        """Undo the first half of a split allocation: drop its hits, give its slot back."""
        ids = np.asarray(hits, np.int64)
        locks = self.store.shard_locks_for(ids)
        if not self.seqtab.can_release_locally(slot):
            locks.add(self.SEQS)

        def op(t: Txn) -> None:
            zero, _ = self.store.drop(t, ids)
            if len(zero):
                # Not reached while the hits stay indexed (an unreferenced one is CACHED).
                t.need(self.FREE)
                self.store.give_back(t, zero)
            self.seqtab.write_blocks(t, slot, 0, [])
            self.seqtab.release(t, slot)

        self._run(locks, op)

    def _match(self, t: Txn, keys: list[int], tokens: list[int], max_hits: int) -> list[int]:
        """Longest verified prefix hit: take a reference on each hit block."""
        if max_hits <= 0:
            return []
        index = self.store.index
        b = self.view.blocks
        bs = self.block_size
        hits: list[int] = []
        parent = 0
        for j in range(max_hits):
            key = keys[j]
            t.need(self.SHARDS[index.shard(key)])
            blk = index.lookup(key)
            if blk < 0:
                break
            # A hash hit is trusted only if the stored tokens and parent key agree too.
            if not self.store.holds_prefix(blk, key, parent, tokens[j * bs : (j + 1) * bs]):
                break
            hits.append(blk)
            parent = key
        if hits:
            ids = np.asarray(hits, np.int64)
            self.store.save(t, ids)
            b["refcount"][ids] += 1
            b["state"][ids] = BlockState.ALLOCATED
            b["access_ns"][ids] = now_ns()
            self.store.seal(ids)
            crash_point("prefix.after_hit")
            if self.probe is not None:
                self.probe.writes.verify_published(t, ids, "a prefix hit")
        return hits

    def _set_hashes(
        self, ids: np.ndarray, first_logical: int, chain: list[int], keys: list[int]
    ) -> None:
        """Record prefix and parent keys of full blocks among freshly filled ones (unindexed)."""
        b = self.view.blocks
        n = min(len(ids), len(keys) - first_logical)
        if n > 4:
            js = np.arange(first_logical, first_logical + n)
            k = np.asarray(keys, np.uint64)
            b["prefix_hash"][ids[:n]] = k[js]
            b["parent_hash"][ids[:n]] = np.where(js > 0, k[js - 1], np.uint64(0))
        else:
            for i, blk in enumerate(ids[: max(n, 0)].tolist()):
                j = first_logical + i
                self.store.set_hashes(blk, keys[j], keys[j - 1] if j else 0)
        if len(ids):
            self.store.seal(ids)

    def _keys(self, chain: list[int]) -> list[int]:
        """Index keys of a prompt's chain values (`prefix.family_keys`: one shard per prompt)."""
        if not chain:
            return []
        keys = keys_of(np.asarray(chain, np.uint64))
        return family_keys(keys, self.store.index.num_shards - 1).tolist()

    def _key(self, chain: list[int], j: int) -> int:
        """Index key of block j of a chain (scalar twin of `_keys`)."""
        return family_key(key_of(chain[j]), key_of(chain[0]), self.store.index.num_shards - 1)

    def mark_computed(self, seq: Sequence, num_tokens: int) -> int:
        """Publish the full blocks of positions [0, num_tokens) in the prefix index; return how many."""
        if self._native is not None:
            done = self._native.mark_computed(self, seq, num_tokens)
            if done is not None:
                return done
        return self._mark_computed(seq, num_tokens)

    def _mark_computed(self, seq: Sequence, num_tokens: int) -> int:
        self._own(seq)
        bs = self.block_size
        upto = min(num_tokens, len(seq.tokens)) // bs
        todo = list(range(seq.num_published, upto))
        if not todo:
            return 0
        keys = [self._key(seq.chain, j) for j in todo]
        blocks = [seq.block_table[j] for j in todo]
        shard_of = self.store.index.shard
        locks = {self.SHARDS[shard_of(k)] for k in keys}

        store = self.store

        def op(t: Txn) -> int:
            done: list[int] = []
            for j, key, blk in zip(todo, keys, blocks):
                if store.is_indexed(blk):
                    continue
                if store.refcount_of(blk) != 1:
                    # Shared through fork, not through the index: leave it private.
                    continue
                if store.index.insert(key, blk, t.journal):
                    store.publish(t, blk, key, self._key(seq.chain, j - 1) if j else 0)
                    done.append(blk)
            if self.probe is not None:
                self.probe.writes.published(t, done)
            return len(done)

        n = self._run(locks, op)
        seq.num_published = upto
        return n

    def fork(self, seq: Sequence, request_id: object) -> Sequence:
        """A new sequence sharing every block of seq (refcounts +1)."""
        if self._native is not None:
            child = self._native.fork(self, seq, request_id)
            if child is not None:
                return child
        return self._fork(seq, request_id)

    def _fork(self, seq: Sequence, request_id: object) -> Sequence:
        self._own(seq)
        ids = np.asarray(seq.block_table, np.int64)
        locks = self.store.shard_locks_for(ids)
        if not self.seqtab.can_claim_locally():
            locks.add(self.SEQS)
        rb = request_bytes(request_id)

        def op(t: Txn) -> Sequence:
            slot, seq_id = self.seqtab.claim(t, rb, self.pid, self.start, self.client)
            if len(ids):
                self.store.save(t, ids)
                self.view.blocks["refcount"][ids] += 1
                self.store.seal(ids)
            self.seqtab.write_blocks(t, slot, 0, ids)
            self.view.seqs["num_tokens"][slot] = len(seq.tokens)
            if self.probe is not None:
                self.probe.event(t, EventOp.FORK, ids, rb, arg=seq.seq_id)
            self._count(t, "num_forks")
            return Sequence(
                request_id=str(request_id),
                tokens=list(seq.tokens),
                block_table=list(seq.block_table),
                slot=slot,
                seq_id=seq_id,
                pool_uid=self._uid,
                num_cached_tokens=seq.num_cached_tokens,
                chain=list(seq.chain),
                num_published=seq.num_published,
            )

        child = self._run(locks, op)
        self._seqs[child.slot] = child
        return child

    def set_state(self, seq: Sequence, state: str) -> None:
        """Mark a sequence running or waiting (only waiting ones may be preempted)."""
        self._own(seq)
        if state not in ("running", "waiting"):
            raise PoolError(f"set_state takes 'running' or 'waiting', got {state!r}")
        if seq.state == "preempted":
            raise PoolError("a preempted sequence must be resumed with pool.resume(seq) first")
        self.view.seqs["state"][seq.slot] = STATE_NAMES[state]
        seq.state = state

    def resume(self, seq: Sequence) -> int:
        """Re-reserve blocks for a preempted sequence's tokens; returns its cached-token count."""
        self._own(seq)
        if seq.state != "preempted":
            raise PoolError(f"resume needs a preempted sequence, this one is {seq.state}")
        tokens = list(seq.tokens)
        fresh = self.allocate(seq.request_id, tokens)
        # Move the fresh sequence's slot into place of the old one.
        old_slot = seq.slot
        locks = set() if self.seqtab.can_release_locally(old_slot) else {self.SEQS}
        self._run(locks, lambda t: self.seqtab.release(t, old_slot))
        self._seqs.pop(old_slot, None)
        self._seqs.pop(fresh.slot, None)
        seq.slot, seq.seq_id, seq.block_table = fresh.slot, fresh.seq_id, fresh.block_table
        seq.chain, seq.num_published = fresh.chain, fresh.num_published
        seq.num_cached_tokens, seq.state = fresh.num_cached_tokens, "running"
        self._seqs[seq.slot] = seq
        return seq.num_cached_tokens

    def evict(self, num_blocks: int) -> int:
        """Evict up to num_blocks CACHED blocks (LRU first) to the free ring; return how many."""

        def op(t: Txn) -> int:
            ids = self.store.evict(t, num_blocks)
            if len(ids):
                self.store.ring_push(t, ids)
                self._count(t, "num_evictions", len(ids))
            return len(ids)

        return self._run({self.FREE, *self.SHARDS}, op)

    def block_table(self, seq: Sequence) -> list[int]:
        """Physical block ids of seq, logical order."""
        self._own(seq)
        return list(seq.block_table)

    def slot_mapping(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat KV slot (block * slots_per_block + offset) of each position in [start, end)."""
        bs, spb, table = self.block_size, self.slots_per_block, seq.block_table
        return [table[p // bs] * spb + p % bs for p in range(start, end)]

    def _own(self, seq: Sequence) -> None:
        self._check_process()
        if not isinstance(seq, Sequence):
            raise PoolError(f"expected a Sequence, got {type(seq).__name__}")
        if seq.pool_uid != self._uid:
            raise PoolError(
                f"sequence {seq.request_id!r} belongs to another pool handle, not to pool {self.name!r}"
            )
        if seq.slot < 0:
            raise PoolError(f"sequence {seq.request_id!r} was already {seq.state}")
