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

While the handle records its operations (docs/REPLAY.md), each check's input is a STORE record
of the log, written by the core before the check reports: the spans (the writers' seq ids and
positions) and the slots it compared (a CUDA store's: one record at the store, its writers'
blocks, and one where its slots are read back, the slots). Not recording, that costs one
attribute test. `check_blocks` and `check_slots` are the check's two parts on their own (what a
CUDA store does at the store and at the read-back; a replay and its script call them).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.oplog import STORE_BLOCKS, STORE_SLOTS
from kvscope.allocator.records import BlockState
from kvscope.allocator.sites import caller_site

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool
    from kvscope.allocator.sequence import Sequence

# A position outside the writer's block table: no slot of it is expected.
_NOWHERE = -2
_ALLOCATED, _CACHED = int(BlockState.ALLOCATED), int(BlockState.CACHED)


class Writers:
    """The writing requests of a store, in slot-mapping order: `spans` of (sequence, start,
    end), each the positions [start, end) of the sequence."""

    def __init__(self, pool: KVPool | Any, spans: Iterable[tuple[Sequence, int, int]]):
        self.pool = pool
        self.spans = spans if isinstance(spans, list) else list(spans)
        # (id, version) of the slot mapping last checked: one check per mapping, not per layer
        self._checked: tuple[int, int] | None = None
        # what check_blocks saw, for check_slots
        self._written: _Written | None = None

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

    def check_blocks(self) -> None:
        """Under the probes, the check's first part alone: the blocks that hold the written
        positions, from the writers' block tables now, which it keeps for `check_slots` (what
        `check` does at a CUDA store)."""
        if getattr(self.pool, "probe", None) is not None:
            _checks_of(self.pool).blocks(self)

    def check_slots(self, slots: Any) -> None:
        """Under the probes, the check's second part alone: `slots` (the slot mapping, on the
        host) against the positions' slots in the tables `check_blocks` kept (none: the tables
        now): what `check` does where a CUDA store's slots are read back."""
        if getattr(self.pool, "probe", None) is not None:
            _checks_of(self.pool).slots(self, np.asarray(slots).astype(np.int64, copy=False))


def settle_writes(pool: KVPool | Any, wait: bool = False) -> None:
    """Read the slot checks of the pool's CUDA stores that the GPU is past (all, with `wait`)."""
    checks = _CHECKS.get(pool)
    if checks is not None:
        checks.settle(wait)


class _Written:
    """What one store wrote, as the host knew it at the store: the writers and their block
    tables (copied when the answer comes later), the expected slot of each token, the line that
    called the store."""

    def __init__(self, writers: Writers, spb: int, bs: int, site: str, keep: bool = False):
        spans = writers.spans
        self.spans = spans
        self.tables = [list(seq.block_table) for seq, _, _ in spans] if keep else None
        self.site = site
        self.recorded = -1  # the number of the STORE record of its blocks' check (-1: none)
        try:
            # Every span's slots in one comprehension: a step of many single tokens costs no
            # call per request (a position past its table raises and takes the long way).
            self.expected = np.array(
                [
                    seq.block_table[p // bs] * spb + p % bs
                    for seq, start, end in spans
                    for p in range(start, end)
                ],
                np.int64,
            )
        except IndexError:
            self.expected = self._outside(spb, bs)

    def _outside(self, spb: int, bs: int) -> np.ndarray:
        """The expected slots when some position lies past its writer's table (none for it)."""
        out = []
        for seq, start, end in self.spans:
            table = seq.block_table
            out += [
                table[p // bs] * spb + p % bs if p // bs < len(table) else _NOWHERE
                for p in range(start, end)
            ]
        return np.array(out, np.int64)

    def writer(self, token: int) -> int:
        """The index of the span that token `token` of the store belongs to."""
        ends = np.cumsum([end - start for _, start, end in self.spans])
        return int(np.searchsorted(ends, token, side="right"))

    def name(self, i: int) -> str:
        """Writer i's request id."""
        return str(self.spans[i][0].request_id)

    def maps(self, i: int, blk: int) -> bool:
        """Whether writer i's block table (as the store saw it) holds block blk."""
        table = self.spans[i][0].block_table if self.tables is None else self.tables[i]
        return blk in table


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
            written = self._blocks(writers, spb, bs)
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
        if getattr(pool, "recording", None):
            _record(pool, writers.spans, slots, STORE_BLOCKS | STORE_SLOTS, -1)
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
            self._read_back(written, host.numpy())

    def blocks(self, writers: Writers) -> None:
        """Writers.check_blocks."""
        bs, spb = int(self.pool.block_size), int(self.pool.slots_per_block)
        writers._written = self._blocks(writers, spb, bs)

    def slots(self, writers: Writers, slots: np.ndarray) -> None:
        """Writers.check_slots."""
        written = writers._written
        if written is None:
            bs, spb = int(self.pool.block_size), int(self.pool.slots_per_block)
            written = _Written(writers, spb, bs, caller_site(), keep=True)
        self._read_back(written, slots)

    def _blocks(self, writers: Writers, spb: int, bs: int) -> _Written:
        """The check's first part, at the store: recorded (its spans), then the blocks that
        hold the written positions reported; the tables kept for the slots."""
        written = _Written(writers, spb, bs, caller_site(), keep=True)
        if getattr(self.pool, "recording", None):
            written.recorded = _record(self.pool, writers.spans, None, STORE_BLOCKS, -1)
        for i, blk in self._positions(written):
            self._report(written, i, blk, mapped=True)
        return written

    def _read_back(self, written: _Written, slots: np.ndarray) -> None:
        """The check's second part, where the slots are read: recorded (the spans and the
        slots read, naming the record of its first part), then compared."""
        if getattr(self.pool, "recording", None):
            _record(self.pool, written.spans, slots, STORE_SLOTS, written.recorded)
        self._slots(written, slots)

    def _positions(self, written: _Written) -> list[tuple[int, int]]:
        """(writer, block) of each block holding written positions that the prefix index
        holds or that is not allocated."""
        recs, spb = self.pool.view.blocks, int(self.pool.slots_per_block)
        expected = written.expected
        inside = expected >= 0
        ids = np.where(inside, expected // spb, 0)
        bad = inside & ((recs["state"][ids] != _ALLOCATED) | (recs["indexed"][ids] == 1))
        if not bad.any():
            return []
        found: dict[tuple[int, int], None] = {}
        for token in np.flatnonzero(bad).tolist():
            found[(written.writer(token), int(ids[token]))] = None
        return list(found)

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
            self._report(written, i, blk, mapped=written.maps(i, blk))

    def _report(self, written: _Written, i: int, blk: int, mapped: bool) -> None:
        """A finding about request i of the store writing into block blk."""
        rec = self.pool.view.blocks[blk].copy()
        state, owner = int(rec["state"]), bytes(rec["request"]).decode(errors="replace")
        pid = int(rec["owner_pid"])
        who, site = written.name(i)[:32], written.site
        me = os.getpid()
        head = f"request {who!r} stored K/V into block {blk} at {site}"
        extra = {"write_site": site, "block_request": owner, "block_pid": pid}
        if state not in (_ALLOCATED, _CACHED):
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


def _record(pool: KVPool | Any, spans: list, slots: Any, what: int, ref: int) -> int:
    """A store check's input as a STORE record of the handle's operation log (the core writes
    it): the spans as (seq id, start, end), the slots it compared (None: none yet). The
    record's number (0: not written)."""
    ids = np.array(
        [(int(seq.seq_id), int(start), int(end)) for seq, start, end in spans], np.int64
    ).reshape(-1, 3)
    flat = np.empty(0, np.int64) if slots is None else np.asarray(slots, np.int64).reshape(-1)
    return int(pool.core.oplog_store(ids, np.ascontiguousarray(flat), what, ref))


def _checks_of(pool: KVPool | Any) -> _PoolChecks:
    checks = _CHECKS.get(pool)
    if checks is None:
        checks = _CHECKS[pool] = _PoolChecks(pool)
    return checks
