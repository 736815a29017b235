"""A pool handle as the modules below pool.py see it: what lifecycle.py, native.py, probing.py,
writes.py, devicechecks.py, sites.py and faults.py use of a KVPool, as a Protocol. They take a
handle typed by it, so that none of them imports pool.py, which imports them (no import cycle,
typing imports included: tests/test_imports.py). KVPool is the one class that has it."""

from __future__ import annotations

import threading
from array import array
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvscope.allocator.findings import Finding
    from kvscope.allocator.layout import SegmentView
    from kvscope.allocator.locks import LockTable


class PoolHandle(Protocol):
    """One process's handle on a pool (KVPool)."""

    name: str
    view: SegmentView
    kv: torch.Tensor
    block_size: int
    slots_per_block: int
    pid: int
    start: int
    client: int
    locks: LockTable
    # lock indices: the sequence table's, the free ring's, the index shards'
    SEQS: int
    FREE: int
    SHARDS: list[int]
    guard_sample: int
    # its PoolProbes (probing.py), or None
    probe: Any
    kv_events: Any
    reclaimed_at_attach: list[dict[str, Any]]
    # the C core (native.core_for) and what the handle shares with it (KVPool.__init__)
    _core: Any
    _mf: Any
    _mutex: threading.RLock
    _overdue: array
    _probe_bits: array
    _found: list[int]
    _uid: int
    _closed: bool

    def __init__(self, name: str, mf: Any, view: SegmentView, kv: torch.Tensor, created: bool): ...

    def _bind(self, client: int) -> None: ...

    def _check_process(self) -> None: ...

    def _hand_findings(self) -> None: ...

    def report(self, finding: Finding) -> None: ...

    def close(self) -> None: ...

    def unlink(self) -> None: ...
