"""kvscope.allocator: the shared paged KV pool.

from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create("demo", PoolConfig(num_blocks=1024))
seq = pool.allocate("req-1", prompt_tokens)
copies = pool.append(seq, [next_token])
pool.free(seq)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscope.allocator import crash
    from kvscope.allocator.config import PoolConfig
    from kvscope.allocator.crash import CRASH_POINTS
    from kvscope.allocator.errors import HandleInherited, LockDeadlock, PoolError, PoolExhausted
    from kvscope.allocator.findings import Finding, FindingKind
    from kvscope.allocator.layout import BlockState, SeqState
    from kvscope.allocator.lease import Lease
    from kvscope.allocator.pool import KVPool
    from kvscope.allocator.sequence import Sequence

# Each public name and the module it lives in, imported on first use (PEP 562): the pool
# imports torch, and the CLI's reading verbs, which need only the layout and numpy, must
# start without it.
_WHERE = {
    "CRASH_POINTS": "crash",
    "crash": None,
    "BlockState": "layout",
    "Finding": "findings",
    "FindingKind": "findings",
    "HandleInherited": "errors",
    "KVPool": "pool",
    "Lease": "lease",
    "LockDeadlock": "errors",
    "PoolConfig": "config",
    "PoolError": "errors",
    "PoolExhausted": "errors",
    "SeqState": "layout",
    "Sequence": "sequence",
}

__all__ = [
    "CRASH_POINTS",
    "BlockState",
    "Finding",
    "FindingKind",
    "HandleInherited",
    "KVPool",
    "Lease",
    "LockDeadlock",
    "PoolConfig",
    "PoolError",
    "PoolExhausted",
    "SeqState",
    "Sequence",
    "crash",
]
assert sorted(__all__) == sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _WHERE[name]
    if module is None:
        value: Any = importlib.import_module(f"{__name__}.{name}")
    else:
        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
