"""Checks of a CUDA pool's K/V whose answers are read later, so that no operation waits for the
GPU: the C core's handbacks (writes.WriteProbes.native_kv) on a CUDA pool, and on a CPU pool
under `KVSCOPE_NATIVE_KV=deferred` (the tests' way to run this code without a GPU).

Where the handle runs on the C core, the core launches the checks of its own operations itself
(csrc/devchecks.c: no call into Python per check) through the kernel this module compiled and
checked, with its own ring and queue, and `settle` takes their answers from it
(`device_take`); this module's queue is the reference, and takes what the core does not: a
request's unwritten slots (writes.finished), a check the core's queue or ring has no room for,
every check where the core's launch did not give Triton's answer.

A check is launched on the current stream, where it runs after every write enqueued before it
and before every write enqueued after it, so it sees the K/V as the operation did. Where Triton
runs (a CUDA pool), a check is one launch of kernels/checks.py: its block ids are written into
`ring`, a page-locked int64 buffer the kernel reads directly, and it writes its answer (flags,
counts, digests) there too; the checks launched between two `settle`s share one event recorded
after them. (Elsewhere, and for a check too large for the ring, torch ops compute the answer
and copy it back, each with its event.) `settle()` takes the answers the GPU is past, oldest
first, and acts on them: a finding, reported with the block's record as the operation saw it,
or a digest written into the record of the block it was taken of (stamps.py: in a transaction
of its own under the block's shard lock, only while the block is still published in the same generation:
until then the block has no digest and is not verified). `settle(wait=True)` waits for every
answer.

`settle` runs between operations only: at a request's allocation, free or abort, at the end of
an append or publication where more than MAX_PENDING answers wait, and, waiting, at
`pool.verify()`, `pool.check()` and close. A finding is therefore reported at the first of those
after the GPU produced its answer, not inside the operation that launched the check.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvscope.allocator import corechecks, integrity
from kvscope.allocator.findings import FindingKind
from kvscope.allocator.prefix import fmix64
from kvscope.allocator.stamps import write_stamps

if TYPE_CHECKING:
    import torch

    from kvscope.allocator.probing import PoolProbes

# Answers waiting past this many are taken at the end of the operation that queued the last
# (pool.append, mark_computed: a program that publishes but never allocates or frees would pile
# them up), the oldest waited for where the GPU is that far behind.
MAX_PENDING = 4096
# int64 words of the buffer the checks' block ids and answers go through (kernels/checks.py):
# 512 KiB of page-locked memory per handle. A check that needs more than a quarter of it (a
# release of a sequence of thousands of blocks) takes the torch ops instead.
RING_WORDS = 1 << 16
# whether a handle's C core launches its checks itself (corechecks.py; tests set False for this
# module's queue)
CORE_CHECKS = True


class _Answer:
    """One launched check: where its answer is, whether the GPU is past it, what to do with it."""

    __slots__ = ("answer", "done", "event", "span", "then")

    def __init__(self, answer: Any, done: bool, then: Callable[[np.ndarray], None] | None):
        # a host tensor (torch ops), a (start, stop) slice of the ring, or the answer read out
        self.answer = answer
        self.done = done
        self.event: Any = None  # a CUDA event recorded after the check (shared by a batch)
        self.span: tuple[int, int] | None = None  # the ring words it holds until done
        self.then = then


class DeviceChecks:
    """The checks of one pool handle whose answers are still on the GPU (or not yet read)."""

    def __init__(self, probes: PoolProbes):
        from kvscope.kernels import backend

        self.probes = probes
        self.pool = probes.pool
        self.cuda = self.pool.kv.device.type == "cuda"
        self.pending: deque[_Answer] = deque()
        # launched since the last event was recorded, on `_open_stream` (CUDA)
        self._open: list[_Answer] = []
        self._open_stream: Any = None
        self._open_raw = 0
        # digests answered, to be written into their records: (block, generation, the
        # record's kv_digest word)
        self._stamps: list[tuple[int, int, int]] = []
        self.settling = False
        # the ring: ids in, answers out, through kernels/checks.py (where Triton runs)
        self.ring: torch.Tensor | None = None
        self._ring_np: np.ndarray | None = None
        self._checks: Any = None
        self._head = 0
        if backend.use_triton(self.pool.kv):
            import torch

            from kvscope.kernels.checks import Checks

            ring = torch.zeros(RING_WORDS, dtype=torch.int64)
            self.ring = ring.pin_memory() if self.cuda else ring
            self._ring_np = self.ring.numpy()
            self._checks = Checks(self.pool.kv, self.ring, self.pool.block_size)
        # the C core this handle's checks are configured in (csrc/devchecks.c), or None
        self.core: Any = None
        if self.cuda:
            self._warm_up()
        if CORE_CHECKS and self.pool._native is not None:
            # the core launches the checks of its own operations itself where it can
            corechecks.configure(self, MAX_PENDING)

    def _warm_up(self) -> None:
        """Compile (or load) each check as the handle opens: a kernel's first launch in a
        process loads it (Triton's, from its cache: a tenth of a second or more), which would
        otherwise stall the first operation that needs it, mid-serving."""
        import torch

        from kvscope.kernels import checks

        kv, flags = self.pool.kv, self.probes.flags
        modes = [checks.DIGEST] if flags.digest else []
        if flags.guard and integrity.has_guard(self.pool.view):
            modes.append(checks.CANARY)
        if flags.guard and integrity.can_poison(kv):
            modes += [checks.COUNTS, checks.POISON]
        if self._checks is not None:
            self._checks.warm_up(modes)
        torch.cuda.synchronize(kv.device)

    def _live_core(self) -> Any:
        """The core the checks are configured in, while the handle still runs on it (a handle
        sent to the Python path for good has none: its checks are this module's)."""
        if self.core is not None and self.pool._native is None:
            self.core = None
        return self.core

    def waiting(self) -> int:
        """How many checks' answers have not been acted on (this module's and the core's)."""
        stats = self.core.device_stats() if self.core is not None else None
        return len(self.pending) + (stats["waiting"] if stats else 0)

    # -- launching ---------------------------------------------------------------------------------

    def _launch(self, mode: int, ids: list[int], then: Callable[[np.ndarray], None] | None) -> bool:
        """Check `mode` (kernels/checks.py) of blocks `ids` through the ring, `then(answer)` once
        it is in; False where the ring cannot take it (no Triton, or too many blocks)."""
        from kvscope.kernels import checks

        n = len(ids)
        words = checks.answer_words(mode, n, self.pool.block_size)
        if self.ring is None or n + words > RING_WORDS // 4:
            return False
        span = self._take(n + words)
        at = span[0]
        assert self._ring_np is not None
        self._ring_np[at : at + n] = ids
        stream = checks.raw_stream(self.pool.kv.device) if self.cuda else None
        self._checks.launch(mode, at, n, at + n, stream)
        entry = _Answer((at + n, at + n + words), not self.cuda, then)
        entry.span = span
        self._queue(entry, stream)
        return True

    def _take(self, words: int) -> tuple[int, int]:
        """A slice of the ring of `words` free words (rounded up to a multiple of two: every
        slice starts 16-byte aligned), waiting for the oldest checks holding the ring where it
        is full."""
        words += words & 1
        while True:
            tail = next((e.span[0] for e in self.pending if e.span is not None), None)
            head = self._head
            start = None
            if tail is None:
                start = 0
            elif head > tail:  # in use: [tail, head)
                if head + words <= RING_WORDS:
                    start = head
                elif words < tail:
                    start = 0
            elif head + words < tail:  # in use: [tail, end) and [0, head)
                start = head
            if start is not None:
                self._head = start + words
                return start, self._head
            self._finish(next(e for e in self.pending if e.span is not None))

    def _queue(self, entry: _Answer, stream: int | None = None) -> None:
        if self.cuda and not entry.done:
            import torch

            from kvscope.kernels.checks import raw_stream

            # the stream the check went to (its raw handle), its object once per batch
            if stream is None:
                stream = raw_stream(self.pool.kv.device)
            if self._open and stream != self._open_raw:
                self._cover()
            if not self._open:
                self._open_stream = torch.cuda.current_stream(self.pool.kv.device)
                self._open_raw = stream
            self._open.append(entry)
        self.pending.append(entry)
        if len(self.pending) > MAX_PENDING:
            self.pool._overdue[0] = 1  # (the word the pool's append reads)

    def _cover(self) -> None:
        """One event after the checks launched since the last one (each check's own event
        would cost the host as much as its launch)."""
        if not self._open:
            return
        import torch

        event = torch.cuda.Event()
        event.record(self._open_stream)
        for entry in self._open:
            entry.event = event
        self._open.clear()

    def _finish(self, entry: _Answer) -> None:
        """Wait for one check's answer and take it out of the ring."""
        if not entry.done:
            if entry.event is None:
                self._cover()
            entry.event.synchronize()
            entry.done = True
        entry.answer = self._read(entry)
        entry.span = None

    def _read(self, entry: _Answer) -> np.ndarray:
        answer = entry.answer
        if isinstance(answer, tuple):
            assert self._ring_np is not None
            return self._ring_np[answer[0] : answer[1]].copy()
        if isinstance(answer, np.ndarray):
            return answer
        return answer.numpy()

    def _later(self, answer: torch.Tensor, then: Callable[[np.ndarray], None]) -> None:
        """Copy `answer` (the torch ops' way) to the host without waiting; `then(host array)`
        once it is there."""
        if not self.cuda:
            self._queue(_Answer(answer, True, then))
            return
        import torch

        host = torch.empty(answer.shape, dtype=answer.dtype, pin_memory=True)
        host.copy_(answer, non_blocking=True)
        self._queue(_Answer(host, False, then))

    # -- the checks --------------------------------------------------------------------------------

    def canaries(self, ids: list[int]) -> None:
        """Released blocks' guard slots (kernels/guard.py guard_flags)."""
        from kvscope.kernels import checks
        from kvscope.kernels.guard import guard_flags

        recs = self.pool.view.blocks[ids].copy()

        def then(flags: np.ndarray) -> None:
            self._canaries_read(flags, ids, recs)

        if not self._launch(checks.CANARY, ids, then):
            self._later(guard_flags(self.pool.kv, ids), then)

    def poison(self, ids: list[int]) -> None:
        """Blocks about to be handed out again: their poison must be intact (use_after_free)."""
        from kvscope.kernels import checks

        recs = self.pool.view.blocks[ids].copy()
        bs = self.pool.block_size

        def then(counts: np.ndarray) -> None:
            self._poison_read(counts, ids, recs)

        def per_block(slots: np.ndarray) -> None:
            then(slots.reshape(len(ids), bs).sum(1))

        if not self._launch(checks.COUNTS, ids, per_block):
            self._later(integrity.unpoisoned_counts(self.pool.kv, np.asarray(ids), bs), then)

    def fill(self, ids: list[int]) -> None:
        """Poison (NaN) into released blocks' token slots (integrity.poison)."""
        from kvscope.kernels import checks

        if not self._launch(checks.POISON, ids, None):
            integrity.poison(self.pool.kv, ids, self.pool.block_size)

    def stamp(self, ids: list[int]) -> None:
        """Blocks just published: their digests, for their records."""
        gens = self.pool.view.blocks["generation"][ids].tolist()

        def then(raw: np.ndarray) -> None:
            for blk, gen, digest in zip(ids, gens, _digests(raw)):
                self._stamps.append((blk, gen, integrity.tagged(digest, gen)))

        self._digest(ids, then)

    def verify(self, ids: list[int], when: str) -> None:
        """Published blocks (with a digest of their generation): unchanged since."""
        recs = self.pool.view.blocks[ids].copy()
        self._digest(ids, lambda r: self._verify_read(_digests(r), ids, recs, when))

    def _digest(self, ids: list[int], then: Callable[[np.ndarray], None]) -> None:
        from kvscope.kernels import checks
        from kvscope.kernels.digest import raw_digests

        if not self._launch(checks.DIGEST, ids, then):
            self._later(raw_digests(self.pool.kv, ids, self.pool.block_size), then)

    def unwritten(self, table: list[int], num_tokens: int, request: str) -> None:
        """A finished request's token slots still poisoned (kv_never_written)."""
        from kvscope.kernels import checks

        bs = self.pool.block_size
        n = min(len(table), -(-num_tokens // bs))
        if n <= 0:
            return  # (a one-token request: no position whose K/V had to be written)
        core = self._live_core()
        if core is not None and core.device_unwritten(table[:n], num_tokens, request):
            return  # (queued by the core, read with its other checks)

        def then(blank: np.ndarray) -> None:
            self._unwritten_read(blank, table, num_tokens, request)

        if not self._launch(checks.COUNTS, table[:n], lambda c: then(c.reshape(n, bs) == 0)):
            self._later(integrity.blank_slots(self.pool.kv, table[:n], bs), then)

    # -- their answers -----------------------------------------------------------------------------

    def settle(self, wait: bool = False, most: int | None = None) -> None:
        """Act on the answers that are in (every answer, waiting for them, with `wait`; the
        oldest, waiting for them, until no more than `most` are left)."""
        if self.settling or (not self.pending and self.core is None):
            return
        # Under the handle's op mutex, as the checks were queued (inside the core's operations):
        # two threads never take the same answer, nor one half-queued.
        with self.pool._mutex:
            self._settle(wait, most)

    def settle_overdue(self) -> None:
        """Between operations, where more than MAX_PENDING answers wait: `settle`, waiting for
        the oldest where the GPU is still that far behind."""
        self.settle(most=MAX_PENDING)

    def _settle(self, wait: bool, most: int | None = None) -> None:
        if self.settling:
            return
        self.settling = True
        try:
            if self._live_core() is not None:
                corechecks.take(self, wait, most)
            self._cover()
            while self.pending:
                entry = self.pending[0]
                if not entry.done:
                    behind = most is not None and len(self.pending) > most
                    if not wait and not behind and not entry.event.query():
                        break
                    entry.event.synchronize()
                    entry.done = True
                answer = self._read(entry)
                self.pending.popleft()
                if entry.then is not None:
                    entry.then(answer)
            if self._stamps:
                stamps, self._stamps = self._stamps, []
                write_stamps(self.pool, stamps)
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
            rec = recs[ids.index(blk)]
            msg = integrity.modified_message(when, found, want, pool.kv, pool.block_size, rec)
            self.probes.block_finding(FindingKind.PUBLISHED_BLOCK_MODIFIED, blk, msg, rec=rec)

    def _unwritten_read(self, blank: np.ndarray, table: list[int], num: int, request: str) -> None:
        found = integrity.unwritten_in(blank, table, num, self.pool.block_size)
        self.probes.writes.report_unwritten(found, request)


def _digests(raw: np.ndarray) -> list[int]:
    return fmix64(np.asarray(raw, np.int64)).tolist()
