"""Sequence operations of a pool: allocate, append, fork, free, mark_computed, evict, resume.

Mixed into KVPool (allocator/pool.py), which provides the segment views, `_run` and the locks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator import faults
from kvscope.allocator.crash import crash_point
from kvscope.allocator.errors import PoolError, PoolExhausted
from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import BlockState, SeqState, block_checksums
from kvscope.allocator.prefix import chain_hashes, chain_one, key_of, keys_of
from kvscope.allocator.process import now_ns
from kvscope.allocator.sequence import STATE_NAMES, Sequence, request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    pass

# A free of a long sequence commits in chunks so one journal never overflows.
CHUNK = 128
# Extra blocks evicted when the free ring runs dry (one pool scan per batch; at most a quarter
# of the cached blocks, so a small cache keeps its LRU order).
EVICT_BATCH = 32


class SequenceOps:
    """The operations on sequences and blocks (the `self` is always a KVPool)."""

    def _take(
        self, t: Txn, n: int, request: bytes, exclude: int = -1, site: int = -1
    ) -> np.ndarray:
        """n fresh ALLOCATED blocks owned by this client: local cache, ring, eviction, preemption."""
        got = [self.store.local_pop(t, n)]
        short = n - len(got[0])
        if short > 0:
            t.need(self.FREE)
            got.append(self.store.ring_pop(t, short))
            short -= len(got[-1])
            if short == 0:
                self.store.refill(t, self.pid, self.start)
        if short > 0:
            t.need(self.SEQS, self.FREE, *self.SHARDS)
            # Evict a batch: finding the LRU blocks scans the whole pool, so amortize it; the
            # extra evicted blocks go to the free ring.
            evicted = self.store.evict(t, short, extra=EVICT_BATCH)
            got.append(evicted[:short])
            self.store.ring_push(t, evicted[short:])
            short -= len(got[-1])
            self._count(t, "num_evictions", len(evicted))
            # Preempted blocks land in the local cache, the ring, or stay cached (indexed).
            while short > 0 and self._preempt_one(t, exclude):
                for source in (self.store.local_pop, self.store.ring_pop, self.store.evict):
                    more = source(t, short)
                    got.append(more)
                    short -= len(more)
                    if source == self.store.evict:
                        self._count(t, "num_evictions", len(more))
                    if short == 0:
                        break
        if short > 0:
            raise self._exhausted(n)
        ids = np.concatenate(got) if len(got) > 1 else got[0]
        self._count(t, "num_allocs", len(ids))
        self.store.stamp(t, ids, self.pid, self.start, request, site)
        return ids

    def _preempt_one(self, t: Txn, exclude: int) -> bool:
        """Free the blocks of this process's oldest waiting sequence (not `exclude`, the slot
        being grown); False if there is none."""
        # The segment's state, not the Python one: it is rolled back with the transaction.
        states = self.view.seqs["state"]
        waiting = [
            s
            for s in self._seqs.values()
            if states[s.slot] == SeqState.WAITING and s.block_table and s.slot != exclude
        ]
        if not waiting:
            return False
        seq = min(waiting, key=lambda s: s.seq_id)
        if self.probe is not None:
            self.probe.event(t, EventOp.PREEMPT, seq.block_table, request_bytes(seq.request_id))
        self._release_blocks(t, seq, 0)
        self.view.seqs["state"][seq.slot] = SeqState.PREEMPTED
        self._count(t, "num_preemptions")

        def done() -> None:
            seq.block_table = []
            seq.state = "preempted"
            seq.num_published = 0

        t.after_commit.append(done)
        return True

    def _exhausted(self, needed: int) -> PoolExhausted:
        st = np.bincount(self.view.blocks["state"], minlength=len(BlockState))
        seqs = self.view.seqs
        live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
        holders: dict[str, int] = {}
        for s in live.tolist():
            r = seqs["request"][s].decode(errors="replace")
            holders[r] = holders.get(r, 0) + int(seqs["num_blocks"][s])
        return PoolExhausted(
            needed=needed,
            free=int(st[BlockState.FREE] + st[BlockState.LOCAL]),
            cached=int(st[BlockState.CACHED]),
            held=int(st[BlockState.ALLOCATED]),
            holders=holders,
        )

    def _fill(self, ids: list[int], first_pos: int, tokens: list[int]) -> None:
        """Write token ids into blocks covering positions [first_pos, first_pos+len(tokens))."""
        bs = self.block_size
        block_tokens, num_tokens = self.store.tokens, self.store.num_tokens
        pos = first_pos
        i = 0
        while i < len(tokens):
            blk = ids[pos // bs]
            off = pos % bs
            n = min(bs - off, len(tokens) - i)
            if n == 1:
                block_tokens[blk, off] = tokens[i]
            else:
                block_tokens[blk, off : off + n] = tokens[i : i + n]
            num_tokens[blk] = off + n
            pos += n
            i += n

    # -- public operations ---------------------------------------------------------------------

    def allocate(self, request_id: object, tokens: list[int]) -> Sequence:
        """Reserve blocks for a prompt, reusing cached prefix blocks; returns its Sequence."""
        self._check_process()
        tokens = [int(x) for x in tokens]
        if not tokens:
            raise PoolError("allocate needs at least one token")
        bs = self.block_size
        n_blocks = -(-len(tokens) // bs)
        if n_blocks > self.view.layout.max_blocks_per_seq:
            raise PoolError(
                f"a prompt of {len(tokens)} tokens needs {n_blocks} blocks; PoolConfig.max_blocks_per_seq is {self.view.layout.max_blocks_per_seq}"
            )
        chain = [int(x) for x in chain_hashes(np.asarray(tokens), bs)]
        keys = keys_of(np.asarray(chain, np.uint64)).tolist() if chain else []
        max_hits = (len(tokens) - 1) // bs
        shards = {self.SHARDS[k & (len(self.SHARDS) - 1)] for k in keys[:max_hits]}
        locks = {self.SEQS} | shards
        if int(self.store.local_count[0]) < n_blocks:
            locks.add(self.FREE)
        rb = request_bytes(request_id)
        site = self._site()

        def op(t: Txn) -> Sequence:
            slot, seq_id = self.seqtab.claim(t, rb, self.pid, self.start, self.client)
            hits = self._match(t, keys, tokens, max_hits)
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
            self.seqtab.write_blocks(t, slot, 0, table)
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

        seq = self._run(locks, op)
        self._seqs[seq.slot] = seq
        if len(seq.tokens) < len(tokens):
            try:
                self.append(seq, tokens[len(seq.tokens) :])
            except BaseException:
                self.abort(seq)
                raise
        return seq

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
            if (
                int(b["prefix_hash"][blk]) != key
                or int(b["parent_hash"][blk]) != parent
                or b["tokens"][blk].tolist() != tokens[j * bs : (j + 1) * bs]
                or b["indexed"][blk] != 1
            ):
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
        return hits

    def _set_hashes(
        self, ids: np.ndarray, first_logical: int, chain: list[int], keys: list[int]
    ) -> None:
        """Record prefix and parent keys of full blocks among freshly filled ones (unindexed)."""
        b = self.view.blocks
        for i, blk in enumerate(ids.tolist()):
            j = first_logical + i
            if j < len(keys):
                b["prefix_hash"][blk] = keys[j]
                b["parent_hash"][blk] = keys[j - 1] if j else 0
        if len(ids):
            self.store.seal(ids)

    def append(self, seq: Sequence, tokens: list[int]) -> list[tuple[int, int]]:
        """Append tokens; returns the copy-on-write (src, dst) block copies to perform first."""
        self._own(seq)
        tokens = [int(x) for x in tokens]
        if not tokens:
            return []
        if len(tokens) <= self.block_size:
            return self._append_chunk(seq, tokens)
        copies: list[tuple[int, int]] = []
        done = 0
        while done < len(tokens):
            part = tokens[done : done + CHUNK * self.block_size]
            copies += self._append_chunk(seq, part)
            done += len(part)
        return copies

    def _append_chunk(self, seq: Sequence, tokens: list[int]) -> list[tuple[int, int]]:
        bs = self.block_size
        n_old = len(seq.tokens)
        n_new = n_old + len(tokens)
        need_blocks = -(-n_new // bs) - len(seq.block_table)
        b = self.view.blocks
        last = seq.block_table[-1] if seq.block_table else -1
        cow = n_old % bs != 0 and last >= 0 and int(self.store.refcount[last]) > 1
        if need_blocks <= 0 and not cow:
            # Fast path: the tokens fit in the last block, which only this sequence uses.
            self._fill(seq.block_table, n_old, tokens)
            seq.tokens.extend(tokens)
            self.seqtab.num_tokens[seq.slot] = n_new
            if n_new // bs > len(seq.chain):
                self._extend_chain(seq)
            return []
        locks: set[int] = set()
        if int(self.store.local_count[0]) < need_blocks + cow:
            locks.add(self.FREE)
        if cow and b["indexed"][last]:
            locks |= self.store.shard_locks_for(np.array([last]))
        rb = request_bytes(seq.request_id)
        site = self._site()

        def op(t: Txn) -> tuple[list[int], list[tuple[int, int]]]:
            table = list(seq.block_table)
            copies: list[tuple[int, int]] = []
            if cow:
                (dst,) = self._take(t, 1, rb, seq.slot, site).tolist()
                src = table[-1]
                b["tokens"][dst] = b["tokens"][src]
                b["num_tokens"][dst] = b["num_tokens"][src]
                self.store.drop(t, np.array([src]))  # src stays shared: refcount > 1
                self.seqtab.set_blocks(t, seq.slot, len(table) - 1, dst)
                self.store.seal(np.array([dst]))
                table[-1] = dst
                copies.append((src, dst))
                if self.probe is not None:
                    self.probe.event(t, EventOp.ALLOCATE, [dst], rb, arg=seq.seq_id)
                    self.probe.event(t, EventOp.COW, [src], rb, arg=dst)
                self._count(t, "num_cow")
            if need_blocks > 0:
                new = self._take(t, need_blocks, rb, seq.slot, site)
                self.seqtab.write_blocks(t, seq.slot, len(table), new.tolist())
                if self.probe is not None:
                    self.probe.event(t, EventOp.ALLOCATE, new, rb, arg=seq.seq_id)
                table += new.tolist()
            self._fill(table, n_old, tokens)
            self.view.seqs["num_tokens"][seq.slot] = n_new
            return table, copies

        table, copies = self._run(locks, op)
        seq.block_table = table
        seq.tokens.extend(tokens)
        self._extend_chain(seq)
        if faults.ARMED:
            self._append_faults(seq)
        return copies

    def _append_faults(self, seq: Sequence) -> None:
        """Faults that strike while a sequence grows: a KV write past its block, scribbles."""
        if faults.fire("oob-write"):
            blk = seq.block_table[-1]
            # One slot past the block's last token: the guard slot, or the next block's slot 0.
            flat = self.kv.view(self.kv.shape[0], 2, -1, *self.kv.shape[4:])
            flat[:, :, blk * self.slots_per_block + self.block_size] = 1.0
        if faults.fire("header-scribble"):
            off = self.view.header.dtype.fields["num_blocks"][1]
            self.view.raw[off : off + 4] = np.frombuffer(b"\xde\xad\xbe\xef", np.uint8)
        if faults.fire("block-scribble"):
            blk = seq.block_table[0]
            # Raw bytes over the refcount, not through the allocator: the checksum no longer matches.
            self.view.blocks["refcount"][blk] = 0x5A5A5A5A

    def _extend_chain(self, seq: Sequence) -> None:
        """Hash blocks that became full (their keys are recorded, not yet indexed)."""
        bs = self.block_size
        b = self.view.blocks
        full = len(seq.tokens) // bs
        while len(seq.chain) < full:
            j = len(seq.chain)
            prev = seq.chain[-1] if j else 0
            h = chain_one(prev, seq.tokens[j * bs : (j + 1) * bs])
            seq.chain.append(h)
            blk = seq.block_table[j]
            if not b["indexed"][blk] and int(b["refcount"][blk]) == 1:
                b["prefix_hash"][blk] = key_of(h)
                b["parent_hash"][blk] = key_of(prev) if j else 0
                self.store.seal(np.array([blk]))

    def mark_computed(self, seq: Sequence, num_tokens: int) -> int:
        """Publish the full blocks of positions [0, num_tokens) in the prefix index; return how many."""
        self._own(seq)
        bs = self.block_size
        upto = min(num_tokens, len(seq.tokens)) // bs
        todo = list(range(seq.num_published, upto))
        if not todo:
            return 0
        b = self.view.blocks
        keys = [key_of(seq.chain[j]) for j in todo]
        blocks = [seq.block_table[j] for j in todo]
        shard_of = self.store.index.shard
        locks = {self.SHARDS[shard_of(k)] for k in keys}

        def op(t: Txn) -> int:
            n = 0
            for j, key, blk in zip(todo, keys, blocks):
                if b["indexed"][blk]:
                    continue
                if int(b["refcount"][blk]) != 1:
                    # Shared through fork, not through the index: leave it private.
                    continue
                if self.store.index.insert(key, blk, t.journal):
                    self.store.save(t, np.array([blk]))
                    b["indexed"][blk] = 1
                    b["prefix_hash"][blk] = key
                    b["parent_hash"][blk] = key_of(seq.chain[j - 1]) if j else 0
                    self.store.seal(np.array([blk]))
                    n += 1
            return n

        n = self._run(locks, op)
        seq.num_published = upto
        return n

    def fork(self, seq: Sequence, request_id: object) -> Sequence:
        """A new sequence sharing every block of seq (refcounts +1)."""
        self._own(seq)
        ids = np.asarray(seq.block_table, np.int64)
        locks = {self.SEQS} | self.store.shard_locks_for(ids)
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

    def _release_blocks(
        self, t: Txn, seq: Sequence, keep: int, *, skip: tuple[int, ...] = (), keep_table: bool = False
    ) -> None:
        """Drop seq's references to table[keep:] (the caller holds the needed locks)."""
        ids = np.asarray(seq.block_table[keep:], np.int64)
        t.need(*self.store.shard_locks_for(ids))
        probe = self.probe
        rb = request_bytes(seq.request_id)
        if probe is not None and probe.flags.magic:
            # Never build on a record something else scribbled over: report it and leave it.
            bad = ids[block_checksums(self.view.blocks, ids) != self.view.blocks["checksum"][ids]]
            for blk in bad.tolist():
                t.after_commit.append(lambda blk=blk: probe.block_finding(
                    "block_header_corrupt", blk,
                    "block record checksum mismatch when its request released it: its header was overwritten outside the allocator",
                ))
            ids = ids[~np.isin(ids, bad)]
        drop_ids = ids[~np.isin(ids, skip)] if skip else ids
        zero, already = self.store.drop(t, drop_ids)
        for blk in already.tolist():
            if probe is not None:
                t.after_commit.append(lambda blk=blk: probe.block_finding(
                    "double_free", blk, f"block released by request {seq.request_id!r} but it was already free",
                ))
        if len(zero):
            if probe is not None and probe.flags.guard:
                bad_guard = probe.scan_guard(zero)
                t.after_commit.append(lambda: probe.report_guard(bad_guard))
                probe.poison(zero)
                # Quarantine: freed blocks go to the tail of the FIFO ring, never the local cache.
                t.need(self.FREE)
                self.store.ring_push(t, zero, BlockState.QUARANTINED)
            else:
                if int(self.store.local_count[0]) + len(zero) > 2 * self.store.local_cap:
                    t.need(self.FREE)
                self.store.give_back(t, zero)
        if not keep_table:
            self.seqtab.write_blocks(t, seq.slot, keep, [])
        if probe is not None:
            op = EventOp.ABORT if seq.state == "aborted" else EventOp.FREE
            probe.event(t, op, drop_ids, rb)
        self._count(t, "num_frees", len(ids))

    def free(self, seq: Sequence) -> None:
        """Release a finished sequence: shared blocks lose a reference, published ones stay cached."""
        self._end(seq, SeqState.FINISHED)

    def abort(self, seq: Sequence) -> None:
        """Release a sequence whose request did not finish."""
        self._end(seq, SeqState.ABORTED)

    def _end(self, seq: Sequence, final: SeqState) -> None:
        self._own(seq)
        # Long tables are released from the tail in chunks, each its own transaction.
        while len(seq.block_table) > CHUNK:
            keep = len(seq.block_table) - CHUNK
            self._release_tail(seq, keep)
        table = list(seq.block_table)
        ids = np.asarray(table, np.int64)
        locks = {self.SEQS} | self.store.shard_locks_for(ids)
        guard = self.probe is not None and self.probe.flags.guard
        if guard or int(self.store.local_count[0]) + len(ids) > 2 * self.store.local_cap:
            locks.add(self.FREE)
        if self.probe is not None:
            self.probe.before_release(table, seq.request_id)
        skip, stale = self._end_faults(seq, ids)

        def op(t: Txn) -> None:
            self._release_blocks(t, seq, 0, skip=skip, keep_table=stale)
            if not stale:
                self.view.seqs["state"][seq.slot] = final
                self.seqtab.release(t, seq.slot)

        self._run(locks, op)
        self._seqs.pop(seq.slot, None)
        seq.block_table = []
        seq.state = final.name.lower()
        seq.slot = -1
        if self.probe is not None:
            self.probe.after_release(table, seq.request_id)
        if faults.ARMED and faults.fire("double-free"):
            self._release_again(table)

    def _end_faults(self, seq: Sequence, ids: np.ndarray) -> tuple[tuple[int, ...], bool]:
        """Faults that strike when a request ends: (blocks to leak, keep the stale table)."""
        if not faults.ARMED:
            return (), False
        own = [int(b) for b in ids if not self.view.blocks["indexed"][b]]
        if own and faults.fire("leak"):
            return (own[-1],), False
        if faults.fire("use-after-free"):
            # The request's blocks are freed but its table stays live and mapped.
            return (), True
        if faults.fire("kill-holding-lock"):
            from kvscope.allocator import crash

            crash.configure("txn.after_locks:1")
        return (), False

    def _release_again(self, table: list[int]) -> None:
        """The double-free fault: release one of a finished request's blocks a second time."""
        own = [b for b in table if self.view.blocks["state"][b] != BlockState.CACHED]
        if not own:
            return
        blk = np.array(own[-1:], np.int64)
        already = self._run({self.FREE}, lambda t: self.store.drop(t, blk)[1])
        if self.probe is not None:
            for b in already.tolist():
                self.probe.block_finding("double_free", b, "block released a second time after its request ended: it is already free")

    def _release_tail(self, seq: Sequence, keep: int) -> None:
        ids = np.asarray(seq.block_table[keep:], np.int64)
        locks = self.store.shard_locks_for(ids) | {self.FREE}
        self._run(locks, lambda t: self._release_blocks(t, seq, keep))
        seq.block_table = seq.block_table[:keep]

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
        self._run({self.SEQS}, lambda t: self.seqtab.release(t, old_slot))
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
