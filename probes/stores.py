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

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvscope.allocator.handle import OwnerRef
from kvscope.allocator.oplog import STORE_BLOCKS, STORE_SLOTS
from kvscope.allocator.sites import caller_stack, stack_depth

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool
    from kvscope.allocator.sequence import Sequence


class Writers:
    """The writing requests of a store, in slot-mapping order: `spans` of (sequence, start,
    end), each the positions [start, end) of the sequence."""

    def __init__(self, pool: KVPool | Any, spans: Iterable[tuple[Sequence, int, int]]):
        self.pool = pool
        self.spans = spans if isinstance(spans, list) else list(spans)
        # (id, version) of the slot mapping last checked: one check per mapping, not per layer
        self._checked: tuple[int, int] | None = None
        # what check_blocks saw, for check_slots
        self.written: _Written | None = None

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
            _checks_of(self.pool).slots(self, np.asarray(slots))


def settle_writes(pool: KVPool | Any, wait: bool = False) -> None:
    """Read the slot checks of the pool's CUDA stores that the GPU is past (all, with `wait`)."""
    checks = _CHECKS.get(pool)
    if checks is not None:
        checks.settle(wait)


class _Written:
    """What one CUDA store wrote, as the host knew it at the store: the writers, their block
    tables (copied: the slots are compared later), the line that called the store."""

    def __init__(self, writers: Writers, site: str):
        self.spans = writers.spans
        self.tables = [list(seq.block_table) for seq, _, _ in self.spans]
        self.site = site
        self.recorded = -1  # the number of the STORE record of its blocks' check (-1: none)


class _PoolChecks:
    """The store checks of one pool handle, and its CUDA stores' slot copies not yet read. The
    check itself is the C core's (`store_check`: csrc/stores.c), which writes its findings into
    the ring; they are handed to `on_finding` here."""

    # (`_CHECKS` holds this as its key's value: a strong reference would keep every pool a
    # process ever checked a store of mapped, its segment included)
    pool = OwnerRef()

    def __init__(self, pool: KVPool | Any):
        self.pool = pool
        self.pending: list[tuple[torch.Tensor, torch.cuda.Event, _Written]] = []

    def check(self, writers: Writers, slot_mapping: Any) -> None:
        pool = self.pool
        if self.pending:
            self.settle()
        if isinstance(slot_mapping, torch.Tensor) and slot_mapping.device.type != "cpu":
            written = self._blocks(writers)
            host = torch.empty(slot_mapping.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(slot_mapping, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(slot_mapping.device))
            self.pending.append((host, done, written))
            return
        if isinstance(slot_mapping, torch.Tensor):
            slot_mapping = slot_mapping.numpy()
        slots = _int64(slot_mapping)
        if getattr(pool, "recording", None):
            _record(pool, writers.spans, slots, STORE_BLOCKS | STORE_SLOTS, -1)
        # (the line that called the store is looked up by the core at a finding only)
        self._core_check(writers.spans, slots, None, None, STORE_BLOCKS | STORE_SLOTS)

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
        writers.written = self._blocks(writers)

    def slots(self, writers: Writers, slots: np.ndarray) -> None:
        """Writers.check_slots."""
        written = writers.written
        if written is None:
            written = _Written(writers, caller_stack(stack_depth()))
        self._read_back(written, slots)

    def _blocks(self, writers: Writers) -> _Written:
        """The check's first part, at the store: recorded (its spans), then the blocks that
        hold the written positions checked; the tables and the store's line kept for the
        slots."""
        written = _Written(writers, caller_stack(stack_depth()))
        if getattr(self.pool, "recording", None):
            written.recorded = _record(self.pool, writers.spans, None, STORE_BLOCKS, -1)
        self._core_check(written.spans, None, written.tables, written.site, STORE_BLOCKS)
        return written

    def _read_back(self, written: _Written, slots: np.ndarray) -> None:
        """The check's second part, where the slots are read: recorded (the spans and the
        slots read, naming the record of its first part), then compared with the positions'
        slots in the tables kept at the store."""
        slots = _int64(slots)
        if getattr(self.pool, "recording", None):
            _record(self.pool, written.spans, slots, STORE_SLOTS, written.recorded)
        self._core_check(written.spans, slots, written.tables, written.site, STORE_SLOTS)

    def _core_check(
        self,
        spans: list,
        slots: np.ndarray | None,
        tables: list | None,
        site: str | None,
        what: int,
    ) -> None:
        """The core's check (what: STORE_BLOCKS, STORE_SLOTS or both), its findings delivered."""
        pool = self.pool
        with pool.op_mutex:
            found = pool.core.store_check(spans, slots, tables, site, what)
        if found:
            pool.deliver_findings()


def _int64(slots: Any) -> np.ndarray:
    """A slot mapping (a numpy array, a list) as the flat C-contiguous int64 array the core
    reads (no copy when it is one)."""
    return np.ascontiguousarray(np.asarray(slots), dtype=np.int64).reshape(-1)


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
