"""The probes that catch writes into blocks the writer does not own, as operations run.

- **digest** (`KVSCOPE_DIGEST`): `mark_computed` records a digest of each block it publishes;
  a prefix hit, an eviction and a request's release of a published block verify it
  (`published_block_modified`).
- **poison** (guard mode): a block freed in guard mode is marked `poisoned` with its token slots
  NaN; before it is handed out again the poison is verified (a write after free,
  `use_after_free`, naming who freed it and when).
- **stale tables** (`KVSCOPE_LEAKS`): a block about to be handed out must not be in any live
  sequence's block table (`use_after_free`, naming the process and request still mapping it).
- **canaries** (guard mode): `pool.verify()` scans every block's guard slot.

The checks themselves are integrity.py's; here they are wired to the moments a block changes
hands. Findings are reported when the operation commits, with the block's record as it was seen
inside the operation.

The C core runs the same checks in its own operations (allocator/csrc/kvdata.c) and reports
what they find itself: on a CPU pool's bytes, or, for data it cannot reach (a CUDA pool),
through its own queue of checks, launched and answered later (devicechecks.py), so that no
operation waits for the GPU. The Python path's operations queue theirs there too (`later`); a
finished request's unwritten slots are the core's check on either path (`finished`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator import devicechecks, integrity
from kvscope.allocator.findings import FindingKind
from kvscope.allocator.layout import SeqState

if TYPE_CHECKING:
    from kvscope.allocator.findings import Finding
    from kvscope.allocator.probing import PoolProbes
    from kvscope.allocator.sequence import Sequence
    from kvscope.allocator.txn import Txn


class WriteProbes:
    """The write probes of one pool handle (part of its PoolProbes)."""

    def __init__(self, probes: PoolProbes):
        self.probes = probes
        self.pool = probes.pool
        # The C core's queue of checks of the K/V, answered later (a CUDA pool; a CPU pool's
        # core reads the bytes itself).
        self.later = devicechecks.for_probes(probes)
        self.digest = probes.flags.digest
        self.guard = probes.flags.guard and integrity.can_poison(probes.pool.kv)
        self.stale = probes.flags.leaks
        if self.digest:
            # Eviction resets a record: its digest is verified first (eviction.py).
            self.pool.store.evict_hook = self.evicting

    def _later(self, t: Txn, kind: str, blk: int, message: str, **extra) -> None:
        """Report a finding about blk when t commits, with its record as it is now."""
        rec = self.pool.view.blocks[blk].copy()
        probes = self.probes
        t.after_commit.append(lambda: probes.block_finding(kind, blk, message, rec=rec, **extra))

    # -- digests of published blocks -------------------------------------------------------------

    def published(self, t: Txn, ids: list[int]) -> None:
        """Blocks `mark_computed` just published (records journaled): record their digests."""
        if self.digest and ids:
            pool = self.pool
            if self.later is not None:
                self.later.stamp([int(x) for x in ids])  # (into the records once answered)
                return
            integrity.stamp_digests(
                pool.view.blocks, pool.kv, np.asarray(ids, np.int64), pool.block_size
            )

    def verify_published(self, t: Txn, ids, when: str) -> None:
        """Verify the digests of the published blocks among ids (`when`: what is happening)."""
        if not self.digest or len(ids) == 0:
            return
        pool = self.pool
        ids = np.asarray(ids, np.int64)
        ids = ids[pool.view.blocks["indexed"][ids] == 1]
        if self.later is not None:
            # answered later, reported with the records as they are now (as the core's are)
            mine = ids[integrity.has_digest(pool.view.blocks, ids)]
            if len(mine):
                self.later.verify(mine.tolist(), when)
            return
        for blk, found, want in integrity.modified(pool.view.blocks, pool.kv, ids, pool.block_size):
            rec = pool.view.blocks[blk]
            msg = integrity.modified_message(when, found, want, pool.kv, pool.block_size, rec)
            self._later(t, FindingKind.PUBLISHED_BLOCK_MODIFIED, blk, msg)

    def evicting(self, t: Txn, ids: np.ndarray) -> None:
        """Eviction hook (records saved, not yet reset)."""
        self.verify_published(t, ids, "its eviction")

    # -- blocks changing hands -----------------------------------------------------------------

    def quarantined(self, t: Txn, ids: np.ndarray) -> None:
        """Guard mode: blocks a release froze in quarantine will be poisoned at its commit."""
        if self.guard and len(ids):
            store = self.pool.store
            store.blocks["poisoned"][ids] = 1
            store.seal(ids)
            # The poison lands at commit: the same operation may hand them out again first
            # (a preemption freeing blocks for the sequence it grows).
            t.__dict__.setdefault("quarantined", set()).update(ids.tolist())

    def before_reuse(self, t: Txn, ids: np.ndarray, request: bytes) -> None:
        """Blocks about to be handed to `request`: their poison must be intact and no live
        sequence may still map them."""
        if len(ids) == 0:
            return
        if self.guard:
            self._check_poison(t, ids)
        if self.stale:
            self._check_unmapped(t, ids, request)

    def reused(self, t: Txn, ids: np.ndarray) -> None:
        """Blocks just handed out (records journaled by the stamp): no longer poisoned."""
        if self.guard and len(ids):
            b = self.pool.view.blocks
            mine = ids[b["poisoned"][ids] == 1]
            if len(mine):
                b["poisoned"][mine] = 0
                self.pool.store.seal(mine)

    def finished(self, seq: Sequence) -> None:
        """Guard mode, a request that finished (not aborted): the K/V of every position but
        its last was written into its own blocks (an engine may end a request before feeding
        back its last sampled token). Token slots still poisoned, from the pool's creation or
        the block's last free, mean the writes went elsewhere: `kv_never_written`, reported by
        the core (now on a CPU pool, at the next settle on a CUDA pool)."""
        if not self.guard or not seq.block_table:
            return
        pool = self.pool
        with pool._mutex:  # (queued as the core queues its checks)
            pool._core.unwritten(list(seq.block_table), len(seq.tokens) - 1, str(seq.request_id))

    def _check_poison(self, t: Txn, ids: np.ndarray) -> None:
        pool = self.pool
        b = pool.view.blocks
        mine = ids[b["poisoned"][ids] == 1]
        fresh = t.__dict__.get("quarantined")
        if fresh:
            mine = mine[~np.isin(mine, list(fresh))]
        if len(mine) == 0:
            return
        if self.later is not None:
            self.later.poison(mine.tolist())  # (answered later, as the core's checks are)
            return
        for blk, count in integrity.poison_broken(pool.kv, mine, pool.block_size):
            rec = b[blk]
            msg = integrity.poison_message(rec, count)
            self._later(t, FindingKind.USE_AFTER_FREE, blk, msg, freed_ns=int(rec["access_ns"]))

    def _check_unmapped(self, t: Txn, ids: np.ndarray, request: bytes) -> None:
        seqs = self.pool.view.seqs
        live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
        if len(live) == 0:
            return
        width = int(seqs["num_blocks"][live].max())
        if width == 0:
            return
        tables = seqs["table"][live, :width]
        used = np.arange(width) < seqs["num_blocks"][live][:, None]
        hit = np.isin(tables, ids) & used
        if not hit.any():
            return
        rows, cols = np.nonzero(hit)
        seen: set[int] = set()
        for r, c in zip(rows.tolist(), cols.tolist()):
            blk = int(tables[r, c])
            if blk in seen:
                continue
            seen.add(blk)
            s = int(live[r])
            holder = bytes(seqs["request"][s]).decode(errors="replace")
            pid = int(seqs["owner_pid"][s])
            self._stale_finding(t, blk, pid, holder, request.decode(errors="replace"))

    def _stale_finding(self, t: Txn, blk: int, pid: int, holder: str, taker: str) -> None:
        from kvscope.allocator.findings import Finding

        rec = self.pool.view.blocks[blk].copy()
        f = Finding(
            FindingKind.USE_AFTER_FREE,
            f"block is being handed to request {taker!r} but request {holder!r} of pid {pid} "
            "still maps it: it was freed while that request's block table was in use",
            block=blk,
            owner_pid=pid,
            request=holder,
        )
        probes = self.probes
        t.after_commit.append(lambda: probes.report(f, rec=rec))

    # -- canaries ------------------------------------------------------------------------------

    def settle(self, wait: bool = False) -> None:
        """The answers of the checks launched on the GPU that are in (all, with `wait`)."""
        if self.later is not None:
            self.later.settle(wait)

    def scan_canaries(self) -> list[Finding]:
        """Guard mode: every block's guard slot (pool.verify()); findings reported."""
        if not self.probes.flags.guard:
            return []
        self.settle(wait=True)
        probes = self.probes
        out = []
        for blk in integrity.broken_canaries(self.pool.kv):
            if probes.block_finding(FindingKind.GUARD_VIOLATION, blk, integrity.CANARY_MESSAGE):
                out.append(blk)
        from kvscope.allocator.findings import Finding

        return [
            Finding(FindingKind.GUARD_VIOLATION, integrity.CANARY_MESSAGE, block=b) for b in out
        ]
