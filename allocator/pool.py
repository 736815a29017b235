"""KVPool: the shared paged KV pool (create/attach, allocate, append, fork, free, stats, check)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from kvscope.allocator import kvdata
from kvscope.allocator.blocks import BlockStore
from kvscope.allocator.config import PoolConfig
from kvscope.allocator.crash import crash_point
from kvscope.allocator.errors import PoolError, PoolExhausted
from kvscope.allocator.journal import Journal
from kvscope.allocator.layout import (
    COUNTER_FIELDS,
    FORMAT_VERSION,
    HEADER_DTYPE,
    POOL_MAGIC,
    BlockState,
    ClientState,
    Flag,
    Layout,
    SegmentView,
    SeqState,
    header_checksum,
)
from kvscope.allocator.locks import DeadHolder, LockTable
from kvscope.allocator.prefix import chain_hashes, chain_one, key_of, keys_of
from kvscope.allocator.process import my_identity, now_ns
from kvscope.allocator.segment import (
    check_name,
    data_path,
    map_new,
    open_existing,
    release,
    segment_path,
    shm_free_bytes,
    view_of,
)
from kvscope.allocator.sequence import STATE_NAMES, SeqTable, Sequence, request_bytes
from kvscope.allocator.txn import Escalate, Txn

T = TypeVar("T")

# Harness hooks, set by `kvscope run`'s bootstrap: each OPEN_HOOKS entry is called with every
# pool this process creates or attaches; UNLINK_HOOK, when set, is called instead of unlinking
# (the supervisor unlinks after it has dumped and analyzed the pool).
OPEN_HOOKS: list[Callable[[KVPool], None]] = []
UNLINK_HOOK: Callable[[KVPool], None] | None = None
# A free of a long sequence commits in chunks so one journal never overflows.
CHUNK = 128


class KVPool:
    """A paged KV-cache pool in shared memory, usable by many processes at once."""

    def __init__(self, name: str, mf, view: SegmentView, kv: torch.Tensor, created: bool):
        self.name = name
        self._mf = mf
        self.view = view
        self.kv = kv
        self.created = created
        self.config = config_from_header(view.h)
        self.block_size = self.config.block_size
        self.slots_per_block = self.config.slots_per_block
        self.pid, self.start = my_identity()
        self._mutex = threading.RLock()
        self._closed = False
        self.client = self._register_client()
        self._client_seq = view.clients["seq"][self.client : self.client + 1]
        self.counters = {f: view.clients[f][self.client : self.client + 1] for f in COUNTER_FIELDS}
        self.journal = Journal(view, self.client)
        self.locks = LockTable(mf, view, self.pid, self.start, self.client)
        n_shards = view.layout.num_shards
        self.SEQS = self.locks.index("seqs")
        self.SHARDS = [self.locks.index(f"index.{i}") for i in range(n_shards)]
        self.FREE = self.locks.index("free")
        self.ALL = set(range(len(self.locks.names)))
        self.store = BlockStore(view, self.client, self.FREE, self.SHARDS)
        self.seqtab = SeqTable(view, self.SEQS)
        self._seqs: dict[int, Sequence] = {}
        self._uid = id(self)
        # Probe hooks: None when off (one attribute check per operation).
        self.on_event: Callable[..., None] | None = None
        self.site_of: Callable[[], int] | None = None
        self.on_finding: Callable[[Any], None] | None = None
        for hook in OPEN_HOOKS:
            hook(self)

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, config: PoolConfig) -> KVPool:
        """Create a new pool named `name`; PoolError if one exists or it cannot fit."""
        check_name(name)
        cfg = config.resolved()
        layout = Layout(
            cfg.num_blocks,
            cfg.block_size,
            cfg.max_seqs,
            cfg.max_blocks_per_seq,
            cfg.max_clients,
            cfg.num_shards,
            cfg.event_capacity,
        )
        size = layout.offsets()["end"]
        kvdata.check_fits(cfg, shm_free_bytes(), size)
        path = segment_path(name)
        mf = map_new(path, size, cfg.group)
        try:
            view = SegmentView(mf.mm, layout)
            _init_segment(view, cfg, name)
            if cfg.device == "cpu":
                kv = kvdata.create_cpu(data_path(name), cfg)
            else:
                kv, blob = kvdata.create_cuda(cfg)
                view.header["cuda_ipc_len"] = len(blob)
                view.header["cuda_ipc"] = blob
            _seal_header(view)
        except BaseException:
            release(mf)
            for p in (path, data_path(name)):
                if os.path.exists(p):
                    os.unlink(p)
            raise
        return cls(name, mf, view, kv, created=True)

    @classmethod
    def attach(cls, name: str) -> KVPool:
        """Attach to an existing pool by name."""
        check_name(name)
        mf = open_existing(segment_path(name), name)
        try:
            view = view_of(mf)
            cfg = config_from_header(view.h)
            if cfg.device == "cpu":
                kv = kvdata.attach_cpu(data_path(name), cfg)
            else:
                blob = bytes(view.h["cuda_ipc"])[: int(view.h["cuda_ipc_len"])]
                kv = kvdata.attach_cuda(blob, cfg)
        except BaseException:
            release(mf)
            raise
        return cls(name, mf, view, kv, created=False)

    def _register_client(self) -> int:
        """Claim a client record (slot reuse prefers never-used slots, keeping dead ones for analysis)."""
        c = self.view.clients
        fd_lock = self._file_lock()
        with fd_lock:
            states = c["state"]
            empty = np.flatnonzero(states == ClientState.EMPTY)
            if len(empty) == 0:
                empty = np.flatnonzero(states == ClientState.DETACHED)
            if len(empty) == 0:
                raise PoolError(
                    f"pool {self.name!r} has {len(states)} attached processes (PoolConfig.max_clients); "
                    "detach some or reclaim dead ones with `kvscope check --repair`"
                )
            i = int(empty[0])
            rec = c[i : i + 1]
            rec["pid"], rec["start"], rec["attached_ns"] = self.pid, self.start, now_ns()
            rec["local_count"] = 0
            rec["journal_count"] = 0
            rec["journal_used"] = 0
            rec["event_count"] = 0
            rec["event_head"] = 0
            for f in COUNTER_FIELDS:
                rec[f] = 0
            c["state"][i] = ClientState.ATTACHED
        return i

    def _file_lock(self):
        """A short-lived exclusive section for client registration (the `seqs` lock's byte)."""
        pool = self

        class _Section:
            def __enter__(self):
                import fcntl

                self.tl = pool._mf.__dict__.setdefault("reg_lock", threading.Lock())
                self.tl.acquire()
                fcntl.lockf(pool._mf.fd, fcntl.LOCK_EX, 1, pool.view.offsets["clients"])
                return self

            def __exit__(self, *exc):
                import fcntl

                fcntl.lockf(pool._mf.fd, fcntl.LOCK_UN, 1, pool.view.offsets["clients"])
                self.tl.release()

        return _Section()

    def close(self) -> None:
        """Detach: return this process's local cache to the ring and release the mapping."""
        if self._closed:
            return
        self._check_process()
        if self.journal.count:
            self.journal.rollback()
        self._run({self.FREE}, self._flush_local)
        with self._file_lock():
            c = self.view.clients
            h = self.view.header
            for f in COUNTER_FIELDS:
                h[f] = int(h[f][0]) + int(c[f][self.client])
            c["state"][self.client] = ClientState.DETACHED
        self._closed = True
        self.view = None  # type: ignore[assignment]
        release(self._mf)

    def _flush_local(self, t: Txn) -> None:
        ids = self.store.local_pop(t, len(self.store.local))
        if len(ids):
            self.store.ring_push(t, ids)

    def unlink(self) -> None:
        """Remove the pool's files; processes still attached keep their mappings until they close."""
        if UNLINK_HOOK is not None:
            UNLINK_HOOK(self)
            return
        for p in (segment_path(self.name), data_path(self.name)):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_process(self) -> None:
        if self._closed:
            raise PoolError(f"pool {self.name!r} is closed")
        if os.getpid() != self.pid:
            raise PoolError(
                f"this handle on pool {self.name!r} was opened by pid {self.pid}; "
                "in a forked child call KVPool.attach(name) instead"
            )

    # -- the operation runner ------------------------------------------------------------------

    def _run(self, locks: set[int], fn: Callable[[Txn], T]) -> T:
        """Run fn in a transaction, escalating locks and recovering dead holders as needed."""
        self._check_process()
        with self._mutex:
            while True:
                try:
                    with Txn(self.locks, self.journal, self._client_seq, locks) as t:
                        return fn(t)
                except Escalate as e:
                    locks = e.locks
                except DeadHolder:
                    from kvscope.allocator.recovery import recover_dead_holders

                    recover_dead_holders(self)

    def _count(self, t: Txn, field: str, n: int = 1) -> None:
        """Add to a counter when (and only if) the transaction commits."""
        if n:
            t.after_commit.append(lambda: self.counters[field].__setitem__(0, self.counters[field][0] + n))

    def _site(self) -> int:
        return self.site_of() if self.site_of is not None else -1

    # -- taking blocks -------------------------------------------------------------------------

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
            evicted = self.store.evict(t, short)
            got.append(evicted)
            short -= len(evicted)
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
        b = self.view.blocks
        pos = first_pos
        i = 0
        while i < len(tokens):
            blk = ids[pos // bs]
            off = pos % bs
            n = min(bs - off, len(tokens) - i)
            b["tokens"][blk, off : off + n] = tokens[i : i + n]
            b["num_tokens"][blk] = off + n
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

        def op(t: Txn) -> Sequence:
            slot, seq_id = self.seqtab.claim(t, rb, self.pid, self.start, self.client)
            hits = self._match(t, keys, tokens, max_hits)
            first = min(n_blocks, len(hits) + CHUNK)
            new = self._take(t, first - len(hits), rb)
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
        cow = n_old % bs != 0 and last >= 0 and int(b["refcount"][last]) > 1
        if need_blocks <= 0 and not cow:
            # Fast path: the tokens fit in the last block, which only this sequence uses.
            self._check_process()
            self._fill(seq.block_table, n_old, tokens)
            seq.tokens.extend(tokens)
            self.view.seqs["num_tokens"][seq.slot] = n_new
            if n_new // bs > len(seq.chain):
                self._extend_chain(seq)
            return []
        locks: set[int] = set()
        if int(self.store.local_count[0]) < need_blocks + cow:
            locks.add(self.FREE)
        if cow and b["indexed"][last]:
            locks |= self.store.shard_locks_for(np.array([last]))
        rb = request_bytes(seq.request_id)

        def op(t: Txn) -> tuple[list[int], list[tuple[int, int]]]:
            table = list(seq.block_table)
            copies: list[tuple[int, int]] = []
            if cow:
                (dst,) = self._take(t, 1, rb, seq.slot).tolist()
                src = table[-1]
                b["tokens"][dst] = b["tokens"][src]
                b["num_tokens"][dst] = b["num_tokens"][src]
                self.store.drop(t, np.array([src]))
                self.seqtab.set_blocks(t, seq.slot, len(table) - 1, dst)
                self.store.seal(np.array([dst]))
                table[-1] = dst
                copies.append((src, dst))
                self._count(t, "num_cow")
            if need_blocks > 0:
                new = self._take(t, need_blocks, rb, seq.slot)
                self.seqtab.write_blocks(t, seq.slot, len(table), new.tolist())
                table += new.tolist()
            self._fill(table, n_old, tokens)
            self.view.seqs["num_tokens"][seq.slot] = n_new
            return table, copies

        table, copies = self._run(locks, op)
        seq.block_table = table
        seq.tokens.extend(tokens)
        self._extend_chain(seq)
        return copies

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

    def _release_blocks(self, t: Txn, seq: Sequence, keep: int) -> None:
        """Drop seq's references to table[keep:] (the caller holds the needed locks)."""
        ids = np.asarray(seq.block_table[keep:], np.int64)
        t.need(*self.store.shard_locks_for(ids))
        zero = self.store.drop(t, ids)
        if len(zero):
            if int(self.store.local_count[0]) + len(zero) > 2 * self.store.local_cap:
                t.need(self.FREE)
            self.store.give_back(t, zero)
        self.seqtab.write_blocks(t, seq.slot, keep, [])
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
        ids = np.asarray(seq.block_table, np.int64)
        locks = {self.SEQS} | self.store.shard_locks_for(ids)
        if int(self.store.local_count[0]) + len(ids) > 2 * self.store.local_cap:
            locks.add(self.FREE)

        def op(t: Txn) -> None:
            self._release_blocks(t, seq, 0)
            self.view.seqs["state"][seq.slot] = final
            self.seqtab.release(t, seq.slot)

        self._run(locks, op)
        self._seqs.pop(seq.slot, None)
        seq.block_table = []
        seq.state = final.name.lower()
        seq.slot = -1

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

    # -- looking -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Block counts by state and the pool's counters (all processes)."""
        from kvscope.allocator.stats import pool_stats

        self._check_process()
        return pool_stats(self.view)

    def check(self) -> list:
        """Full consistency check; returns findings (empty when healthy)."""
        from kvscope.allocator.check import check_view
        from kvscope.allocator.snapshot import snapshot

        self._check_process()
        return check_view(snapshot(self.view))

    def report(self, finding) -> None:
        """Record a finding in the segment's findings ring (and hand it to the probe callback)."""
        from kvscope.allocator.findings import write_finding

        fl = self.locks.index("findings")
        self._run({fl}, lambda t: write_finding(self.view, t, finding))
        if self.on_finding is not None:
            self.on_finding(finding)

    def findings(self) -> list:
        """Findings recorded in the segment by any process, oldest first."""
        from kvscope.allocator.findings import read_findings

        return read_findings(self.view)

    def dead_owners(self) -> list[dict[str, Any]]:
        """Processes that died while attached, with the blocks and sequences they left."""
        from kvscope.allocator.recovery import dead_owners

        return dead_owners(self.view)

    def reclaim_dead(self) -> dict[str, int]:
        """Return dead processes' blocks to the pool; shared blocks lose only their references."""
        from kvscope.allocator.recovery import reclaim_dead

        self._check_process()
        with self._mutex:
            return reclaim_dead(self)


def _init_segment(view: SegmentView, cfg: PoolConfig, name: str) -> None:
    """Write a fresh header and empty sections."""
    from kvscope.allocator.layout import BLOCK_MAGIC, block_checksums, lock_names

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
    for i, lname in enumerate(lock_names(cfg.num_shards)):
        view.locks["name"][i] = lname.encode()


def _seal_header(view: SegmentView) -> None:
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
