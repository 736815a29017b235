"""Growing a sequence: token appends, copy-on-write of a shared last block, and the prefix keys
of blocks as they fill. Mixed into KVPool through SequenceOps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator import faults
from kvscope.allocator.crash import crash_point
from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import CHUNK
from kvscope.allocator.prefix import chain_one
from kvscope.allocator.sequence import Sequence, request_bytes
from kvscope.allocator.txn import Txn

if TYPE_CHECKING:
    from .surface import PoolSurface
else:
    PoolSurface = object


class AppendOps(PoolSurface):
    """Appends (the `self` is always a KVPool)."""

    def append(self, seq: Sequence, tokens: list[int]) -> list[tuple[int, int]]:
        """Append tokens; returns the copy-on-write (src, dst) block copies to perform first."""
        if self._native is not None:
            done = self._native.append(self, seq, tokens)
            if done is not None:
                return done
        self._own(seq)
        tokens = list(map(int, tokens))
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
        st = self.store
        cow = n_old % bs != 0 and last >= 0 and st.i32[st.refcount_at4 + last * st.rec4] > 1
        if need_blocks <= 0 and not cow:
            # Fast path: the tokens fit in the last block, which only this sequence uses (the
            # decode step: a write of the token, its count and the sequence's length).
            if len(tokens) == 1 and n_old % bs:
                off = n_old % bs
                at = last * st.rec4
                st.i32[st.tokens_at4 + at + off] = tokens[0]
                st.u32[st.num_tokens_at4 + at] = off + 1
            else:
                self._fill(seq.block_table, n_old, tokens)
            seq.tokens.extend(tokens)
            sq = self.seqtab
            sq.u64[sq.num_tokens_at8 + seq.slot * sq.rec8] = n_new
            if n_new // bs > len(seq.chain):
                self._extend_chain(seq)
            return []
        locks = self._take_locks(max(0, need_blocks) + cow)
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
            fields = self.view.header.dtype.fields
            assert fields is not None  # a structured dtype
            off = fields["num_blocks"][1]
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
                self._set_keys(
                    blk, self._key(seq.chain, j), self._key(seq.chain, j - 1) if j else 0
                )

    def _set_keys(self, blk: int, key: int, parent: int) -> None:
        """Record a full block's prefix and parent keys (an unindexed block of our own: no lock).

        The key is checksummed: key and checksum go in one 16-byte store, so a kill at any
        point leaves the record sealed; the parent key is outside the checksum.
        """
        self.store.set_prefix_key(blk, key)
        crash_point("seqs.after_prefix_key")
        self.view.blocks["parent_hash"][blk] = parent
