"""Who writes a store: the requests whose K/V a `store_kv` call writes, and the check, under the
probes, of where that K/V lands (docs/PROBES.md, "The writer named at the store").

    from kvscope.probes.stores import Writers

    writers = Writers(pool, [(seq, start, end)])  # positions [start, end) of seq, in slot order
    store_kv(k, v, k_cache, v_cache, slots, block_size=bs, writers=writers)

With the pool's probes on, the first store of each slot mapping a `Writers` is given checks it
once (every layer's store of one step is one check), and reports at the write, naming the
writing request and the line that called the store:

- the blocks that hold the written positions, from the writer's block table: one the prefix
  index holds (`published_block_modified`), or one that is not allocated (`use_after_free`);
- the slot mapping against those positions' slots: a slot elsewhere lands in a block the writer
  does not map (`unmapped_write`), or one published or freed (the two kinds above).

The first part reads the host's block tables and block records only, on CPU and CUDA pools
alike. The second reads the slots: at once from a CPU tensor, a list or a numpy array; from a
CUDA tensor through a copy to page-locked host memory queued behind the store, read once the GPU
is past it at the pool's next checked store (or `settle_writes`), so no store waits for the GPU.
With the probes off a check is one attribute test. (`store_kv` only calls `writers.check` with
its slot mapping: kvscope.kernels imports nothing of the pool.)
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.records import BlockState
from kvscope.allocator.sites import caller_site

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool
    from kvscope.allocator.sequence import Sequence

# A position outside the writer's block table: no slot of it is expected.
_NOWHERE = -2


class Writers:
    """The writing requests of a store, in slot-mapping order: `spans` of (sequence, start,
    end), each the positions [start, end) of the sequence."""

    def __init__(self, pool: KVPool | Any, spans: Iterable[tuple[Sequence, int, int]]):
        self.pool = pool
        self.spans = [(seq, int(start), int(end)) for seq, start, end in spans]
        self.num_tokens = sum(end - start for _, start, end in self.spans)
        # (id, version) of the slot mapping last checked: one check per mapping, not per layer
        self._checked: tuple[int, int] | None = None

    def check(self, slot_mapping: Any) -> None:
        """Under the probes, check the store of `slot_mapping` (once per mapping) and report."""
        probe = getattr(self.pool, "probe", None)
        if probe is None:
            return
        key = (id(slot_mapping), getattr(slot_mapping, "_version", 0))
        if key == self._checked:
            return
        self._checked = key
        _checks_of(self.pool).check(self, slot_mapping)


def settle_writes(pool: KVPool | Any, wait: bool = False) -> None:
    """Read the slot checks of the pool's CUDA stores that the GPU is past (all, with `wait`)."""
    checks = _CHECKS.get(pool)
    if checks is not None:
        checks.settle(wait)


class _Written:
    """What one store wrote, as the host knew it at the store: the writers' names and block
    tables, the expected slot of each token, the line that called the store."""

    def __init__(self, writers: Writers, spb: int, bs: int, site: str):
        self.names = [str(seq.request_id) for seq, _, _ in writers.spans]
        self.tables = [np.asarray(seq.block_table, np.int64) for seq, _, _ in writers.spans]
        self.ends = np.cumsum([end - start for _, start, end in writers.spans], dtype=np.int64)
        expected = []
        for (_, start, end), table in zip(writers.spans, self.tables, strict=True):
            pos = np.arange(start, end, dtype=np.int64)
            logical = pos // bs
            inside = logical < len(table)
            slots = np.full(len(pos), _NOWHERE, np.int64)
            slots[inside] = table[logical[inside]] * spb + pos[inside] % bs
            expected.append(slots)
        self.expected = np.concatenate(expected) if expected else np.zeros(0, np.int64)
        self.site = site

    def writer(self, token: int) -> int:
        """The index of the span that token `token` of the store belongs to."""
        return int(np.searchsorted(self.ends, token, side="right"))


class _PoolChecks:
    """The store checks of one pool handle, and its CUDA stores' slot copies not yet read."""

    def __init__(self, pool: KVPool | Any):
        self.pool = pool
        self.pending: list[tuple[torch.Tensor, torch.cuda.Event, _Written]] = []

    def check(self, writers: Writers, slot_mapping: Any) -> None:
        pool = self.pool
        if self.pending:
            self.settle()
        bs, spb = int(pool.block_size), int(pool.slots_per_block)
        if isinstance(slot_mapping, torch.Tensor) and slot_mapping.device.type != "cpu":
            written = _Written(writers, spb, bs, caller_site())
            for i, blk in self._positions(written):
                self._report(written, i, blk, mapped=True)
            host = torch.empty(slot_mapping.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(slot_mapping, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(slot_mapping.device))
            self.pending.append((host, done, written))
            return
        if isinstance(slot_mapping, torch.Tensor):
            slots = slot_mapping.numpy()
        else:
            slots = np.asarray(slot_mapping)
        written = _Written(writers, spb, bs, "")
        found = self._positions(written)
        if not found and np.array_equal(slots, written.expected):
            return  # (the common case: nothing found, the site never looked up)
        written.site = caller_site()
        for i, blk in found:
            self._report(written, i, blk, mapped=True)
        self._slots(written, slots.astype(np.int64, copy=False))

    def settle(self, wait: bool = False) -> None:
        """Compare the copied slots of the CUDA stores the GPU is past (all, with `wait`)."""
        while self.pending:
            host, done, written = self.pending[0]
            if not wait and not done.query():
                return
            done.synchronize()
            self.pending.pop(0)
            self._slots(written, host.numpy())

    def _positions(self, written: _Written) -> list[tuple[int, int]]:
        """(writer, block) of each block holding written positions that the prefix index
        holds or that is not allocated."""
        recs, spb = self.pool.view.blocks, int(self.pool.slots_per_block)
        found = []
        lo = 0
        for i, hi in enumerate(written.ends.tolist()):
            mine = written.expected[lo:hi]
            lo = hi
            ids = np.unique(mine[mine >= 0] // spb)
            hit = ids[(recs["state"][ids] != BlockState.ALLOCATED) | (recs["indexed"][ids] == 1)]
            found += [(i, blk) for blk in hit.tolist()]
        return found

    def _slots(self, written: _Written, slots: np.ndarray) -> None:
        """Tokens whose slot is not their position's: where each one landed."""
        slots = slots.reshape(-1)
        if len(slots) != len(written.expected):
            return  # (a store whose writers do not cover its tokens: nothing to compare)
        spb, num_blocks = int(self.pool.slots_per_block), len(self.pool.view.blocks)
        wrong = np.flatnonzero((slots != written.expected) & (slots != -1))
        seen: set[tuple[int, int]] = set()
        for token in wrong.tolist():
            blk = int(slots[token]) // spb
            if not 0 <= blk < num_blocks:
                continue  # (outside the tensor: guard mode's kernels report it)
            i = written.writer(token)
            if (i, blk) in seen:
                continue
            seen.add((i, blk))
            self._report(written, i, blk, mapped=bool((written.tables[i] == blk).any()))

    def _report(self, written: _Written, i: int, blk: int, mapped: bool) -> None:
        """A finding about request i of the store writing into block blk."""
        rec = self.pool.view.blocks[blk].copy()
        state, owner = int(rec["state"]), bytes(rec["request"]).decode(errors="replace")
        pid = int(rec["owner_pid"])
        who, site = written.names[i][:32], written.site
        me = os.getpid()
        head = f"request {who!r} stored K/V into block {blk} at {site}"
        extra = {"write_site": site, "block_request": owner, "block_pid": pid}
        if state not in (BlockState.ALLOCATED, BlockState.CACHED):
            message = f"{head}: the block is free (last held by request {owner!r}, pid {pid})"
            f = Finding(FindingKind.USE_AFTER_FREE, message, blk, me, who, extra=extra)
        elif rec["indexed"] == 1:
            message = f"{head}: published by request {owner!r} (pid {pid}), shared by prefix hits"
            f = Finding(FindingKind.PUBLISHED_BLOCK_MODIFIED, message, blk, me, who, extra=extra)
        elif not mapped:
            message = f"{head}, which it does not map (held by request {owner!r}, pid {pid})"
            f = Finding(FindingKind.UNMAPPED_WRITE, message, blk, me, who, extra=extra)
        else:
            return  # (its own block at another position: not one of the checked kinds)
        probe = self.pool.probe
        assert probe is not None
        probe.report(f, rec=rec)


_CHECKS: weakref.WeakKeyDictionary[Any, _PoolChecks] = weakref.WeakKeyDictionary()


def _checks_of(pool: KVPool | Any) -> _PoolChecks:
    checks = _CHECKS.get(pool)
    if checks is None:
        checks = _CHECKS[pool] = _PoolChecks(pool)
    return checks
