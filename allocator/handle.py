"""A pool handle as the modules below pool.py see it: what lifecycle.py, native.py, probing.py,
devicechecks.py and faults.py use of a KVPool (its public members only; what
the core shares with the handle, the handle hands to native.core_for), as a Protocol. They take
a handle typed by it, so that none of them imports pool.py, which imports them (no import cycle,
typing imports included: tests/test_imports.py). KVPool is the one class that has it."""

from __future__ import annotations

import threading
import weakref
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
    # The mapping's op mutex: held by whatever calls the core outside an operation of KVPool's.
    op_mutex: threading.RLock

    def __init__(
        self,
        name: str,
        mf: Any,
        view: SegmentView,
        kv: torch.Tensor,
        created: bool,
        client: int = -1,
    ): ...

    # the handle's C core (native.Native)
    @property
    def core(self) -> Any: ...

    @property
    def closed(self) -> bool: ...

    def deliver_findings(self) -> None: ...

    def report(self, finding: Finding) -> None: ...

    def close(self) -> None: ...

    def unlink(self) -> None: ...


class OwnerRef:
    """A member holding the pool handle that owns the object (its probes, its K/V checks'
    queue, its store checks) weakly: `self.pool = pool` stores a weak reference and `self.pool`
    reads the handle back. The handle holds the object, so a strong reference back would be a
    cycle, which keeps a closed pool's segment mapped until the cyclic collector runs (a
    program that creates and closes pools, a shrink's thousand candidates)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}_ref"

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, self.slot)()

    def __set__(self, obj: object, handle: Any) -> None:
        setattr(obj, self.slot, weakref.ref(handle))
