"""What KVPool's mixins use of the pool and of each other, declared once for type checkers.

KVPool (pool.py) is SequenceOps (seqops.py) with AppendOps (append.py), ReserveOps
(reserve.py) and ReleaseOps (release.py) mixed in; each mixin's `self` is always a KVPool. The
mixins derive from `PoolSurface` while type checking and from `object` at run time:

    if TYPE_CHECKING:
        from .surface import PoolSurface
    else:
        PoolSurface = object

so nothing here exists in a running pool. The attributes are set by `KVPool.__init__` (`probe`
is a property there); every method is defined by KVPool or one of the mixins, which is where
its docstring is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .blocks import BlockStore
    from .layout import SegmentView
    from .probing import PoolProbes
    from .sequence import SeqTable, Sequence
    from .txn import Txn

T = TypeVar("T")


class PoolSurface(Protocol):
    # pool.py: the segment and its parts
    name: str
    view: SegmentView
    kv: torch.Tensor
    store: BlockStore
    seqtab: SeqTable
    block_size: int
    slots_per_block: int
    # pool.py: this process and its client record
    pid: int
    start: int
    client: int
    _uid: int
    # pool.py: lock ids
    FREE: int
    SEQS: int
    SHARDS: list[int]
    probe: PoolProbes | None
    _seqs: dict[int, Sequence]
    _native: Any | None
    _guarded: set[int]
    _guard_every: int

    # pool.py
    def _check_process(self) -> None: ...

    def _run(self, locks: set[int], fn: Callable[[Txn], T]) -> T: ...

    def _guards(self, slot: int) -> bool: ...

    def _sample_guard(self) -> bool: ...

    def _count(self, t: Txn, field: str, n: int = 1) -> None: ...

    def _site(self) -> int: ...

    # seqops.py
    def _own(self, seq: Sequence) -> None: ...

    def _key(self, chain: list[int], j: int) -> int: ...

    # reserve.py
    def _take(
        self, t: Txn, n: int, request: bytes, exclude: int = -1, site: int = -1
    ) -> np.ndarray: ...

    def _take_locks(self, n: int) -> set[int]: ...

    def _fill(self, ids: list[int], first_pos: int, tokens: list[int]) -> None: ...

    # release.py
    def _release_blocks(
        self,
        t: Txn,
        seq: Sequence,
        keep: int,
        *,
        skip: tuple[int, ...] = (),
        keep_table: bool = False,
    ) -> np.ndarray: ...
