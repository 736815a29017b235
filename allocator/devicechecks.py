"""Checks of a CUDA pool's K/V whose answers are read later, so that no operation waits for the
GPU: the C core's handbacks (writes.WriteProbes.native_kv) on a CUDA pool, and on a CPU pool
under `KVSCOPE_NATIVE_KV=deferred` (the tests' way to run this code without a GPU).

A check is launched on the current stream, where it runs after every write enqueued before it
and before every write enqueued after it, so it sees the K/V as the operation did. Its small
answer (flags, counts, digests) is copied to page-locked host memory without waiting and an
event is recorded. `settle()` takes the answers whose event has completed, oldest first, and acts
on them: a finding, reported with the block's record as the operation saw it, or a digest
written into the record of the block it was taken of (in a transaction of its own under the
block's shard lock, only while the block is still published in the same generation: until then
the block has no digest and is not verified). `settle(wait=True)` waits for every answer.

`settle` runs between operations only: at a request's allocation, free or abort, and, waiting,
at `pool.verify()`, `pool.check()` and close. A finding is therefore reported at the first of those
after the GPU produced its answer, not inside the operation that launched the check.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvscope.allocator import integrity
from kvscope.allocator.findings import FindingKind
from kvscope.allocator.layout import CHUNK

if TYPE_CHECKING:
    import torch

    from kvscope.allocator.probing import PoolProbes

# Answers waiting past this many: settle() waits for the oldest (a program that never frees).
MAX_PENDING = 4096


class DeviceChecks:
    """The checks of one pool handle whose answers are still on the GPU (or not yet read)."""

    def __init__(self, probes: PoolProbes):
        self.probes = probes
        self.pool = probes.pool
        self.cuda = self.pool.kv.device.type == "cuda"
        # (answer on the host, its event or None when ready, what to do with it)
        self.pending: deque[tuple[torch.Tensor, Any, Callable[[np.ndarray], None]]] = deque()
        # digests answered, to be written into their records: (blocks, generations, digests)
        self._stamps: list[tuple[np.ndarray, np.ndarray, list[int]]] = []
        self.settling = False
        if self.cuda:
            self._warm_up()

    def _warm_up(self) -> None:
        """Launch each check once on block 0 (read only) as the handle opens: a kernel's first
        launch in a process loads it (Triton's, from its cache: a tenth of a second or more),
        which would otherwise stall the first operation that needs it, mid-serving."""
        import torch

        from kvscope.kernels.digest import raw_digests
        from kvscope.kernels.guard import guard_flags

        kv, bs, flags = self.pool.kv, self.pool.block_size, self.probes.flags
        torch.empty(1, pin_memory=True)
        if flags.digest:
            raw_digests(kv, [0], bs)
        if flags.guard and integrity.has_guard(self.pool.view):
            guard_flags(kv, [0])
        if flags.guard and integrity.can_poison(kv):
            integrity.unpoisoned_counts(kv, np.zeros(1, np.int64), bs)
            integrity.blank_slots(kv, [0], bs)
        torch.cuda.synchronize(kv.device)

    def _later(self, answer: torch.Tensor, then: Callable[[np.ndarray], None]) -> None:
        """Copy `answer` to the host without waiting; `then(host array)` once it is there."""
        if not self.cuda:
            self.pending.append((answer, None, then))
        else:
            import torch

            host = torch.empty(answer.shape, dtype=answer.dtype, pin_memory=True)
            host.copy_(answer, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((host, event, then))
        if len(self.pending) > MAX_PENDING:
            host, event, then = self.pending.popleft()
            if event is not None:
                event.synchronize()
            self.pending.appendleft((host, None, then))

    # -- the checks --------------------------------------------------------------------------------

    def canaries(self, ids: list[int]) -> None:
        """Released blocks' guard slots (kernels/guard.py guard_flags)."""
        from kvscope.kernels.guard import guard_flags

        recs = self.pool.view.blocks[ids].copy()
        self._later(guard_flags(self.pool.kv, ids), lambda f: self._canaries_read(f, ids, recs))

    def poison(self, ids: list[int]) -> None:
        """Blocks about to be handed out again: their poison must be intact (use_after_free)."""
        recs = self.pool.view.blocks[ids].copy()
        counts = integrity.unpoisoned_counts(self.pool.kv, np.asarray(ids), self.pool.block_size)
        self._later(counts, lambda c: self._poison_read(c, ids, recs))

    def stamp(self, ids: list[int]) -> None:
        """Blocks just published: their digests, for their records."""
        from kvscope.kernels.digest import raw_digests

        gens = self.pool.view.blocks["generation"][ids].copy()
        raw = raw_digests(self.pool.kv, ids, self.pool.block_size)
        self._later(raw, lambda r: self._stamps.append((np.asarray(ids), gens, _digests(r))))

    def verify(self, ids: list[int], when: str) -> None:
        """Published blocks (with a digest of their generation): unchanged since."""
        from kvscope.kernels.digest import raw_digests

        recs = self.pool.view.blocks[ids].copy()
        raw = raw_digests(self.pool.kv, ids, self.pool.block_size)
        self._later(raw, lambda r: self._verify_read(_digests(r), ids, recs, when))

    def unwritten(self, table: list[int], num_tokens: int, request: str) -> None:
        """A finished request's token slots still poisoned (kv_never_written)."""
        bs = self.pool.block_size
        n = min(len(table), -(-num_tokens // bs))
        if n <= 0:
            return  # (a one-token request: no position whose K/V had to be written)
        blank = integrity.blank_slots(self.pool.kv, table[:n], bs)
        self._later(blank, lambda b: self._unwritten_read(b, table, num_tokens, request))

    # -- their answers -----------------------------------------------------------------------------

    def settle(self, wait: bool = False) -> None:
        """Act on the answers that are in (every answer, waiting for them, with `wait`)."""
        if not self.pending or self.settling:
            return
        # Under the handle's op mutex, as the checks were queued (inside the core's operations):
        # two threads never take the same answer, nor one half-queued.
        with self.pool._mutex:
            self._settle(wait)

    def _settle(self, wait: bool) -> None:
        if self.settling:
            return
        self.settling = True
        try:
            while self.pending:
                host, event, then = self.pending[0]
                if event is not None:
                    if not wait and not event.query():
                        break
                    event.synchronize()
                self.pending.popleft()
                then(host.numpy())
            if self._stamps:
                self._write_stamps()
        finally:
            self.settling = False

    def _canaries_read(self, flags: np.ndarray, ids: list[int], recs: np.ndarray) -> None:
        from kvscope.kernels import fill_guard

        bad = np.flatnonzero(flags)
        if not len(bad):
            return
        blocks = [ids[i] for i in bad.tolist()]
        fill_guard(self.pool.kv, blocks=blocks)
        self.probes.report_guard(blocks, recs[bad])

    def _poison_read(self, counts: np.ndarray, ids: list[int], recs: np.ndarray) -> None:
        for i in np.flatnonzero(counts).tolist():
            rec = recs[i]
            self.probes.block_finding(
                FindingKind.USE_AFTER_FREE,
                ids[i],
                integrity.poison_message(rec, int(counts[i])),
                rec=rec,
                freed_ns=int(rec["access_ns"]),
            )

    def _verify_read(self, got: list[int], ids: list[int], recs: np.ndarray, when: str) -> None:
        pool = self.pool
        for blk, found, want in integrity.changed(ids, got, recs["kv_digest"].tolist()):
            msg = integrity.modified_message(when, found, want, pool.kv, pool.block_size)
            rec = recs[ids.index(blk)]
            self.probes.block_finding(FindingKind.PUBLISHED_BLOCK_MODIFIED, blk, msg, rec=rec)

    def _unwritten_read(self, blank: np.ndarray, table: list[int], num: int, request: str) -> None:
        found = integrity.unwritten_in(blank, table, num, self.pool.block_size)
        self.probes.writes.report_unwritten(found, request)

    def _write_stamps(self) -> None:
        """The digests answered into their records, where the block is still published in the
        generation it was digested in and has no digest of it yet."""
        stamps, self._stamps = self._stamps, []
        ids = np.concatenate([s[0] for s in stamps]).astype(np.int64)
        gens = np.concatenate([s[1] for s in stamps])
        words = np.asarray(
            [integrity.tagged(d, int(g)) for s in stamps for d, g in zip(s[2], s[1])], np.uint64
        )
        pool = self.pool

        def write(t: Any, ids: np.ndarray, gens: np.ndarray, words: np.ndarray) -> None:
            b = pool.view.blocks
            ok = (b["generation"][ids] == gens) & (b["indexed"][ids] == 1)
            ok &= ~integrity.has_digest(b, ids)
            sel = np.flatnonzero(ok)
            # a block digested twice in one generation: its first digest only
            sel = sel[np.unique(ids[sel], return_index=True)[1]]
            if len(sel) == 0:
                return
            pool.store.save(t, ids[sel])
            b["kv_digest"][ids[sel]] = words[sel]
            pool.store.seal(ids[sel])

        # A transaction per CHUNK blocks: the undo journal holds one operation's records.
        for i in range(0, len(ids), CHUNK):
            part = slice(i, i + CHUNK)
            locks = pool.store.shard_locks_for(ids[part])
            pool._run(
                locks, functools.partial(write, ids=ids[part], gens=gens[part], words=words[part])
            )


def _digests(raw: np.ndarray) -> list[int]:
    from kvscope.kernels.digest import fmix64

    return [fmix64(int(r)) for r in raw.tolist()]
