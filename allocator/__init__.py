"""kvscope.allocator: the shared paged KV pool.

from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create("demo", PoolConfig(num_blocks=1024))
seq = pool.allocate("req-1", prompt_tokens)
copies = pool.append(seq, [next_token])
pool.free(seq)
"""

from kvscope.allocator import crash
from kvscope.allocator.config import PoolConfig
from kvscope.allocator.crash import CRASH_POINTS
from kvscope.allocator.errors import LockDeadlock, PoolError, PoolExhausted
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.layout import BlockState, SeqState
from kvscope.allocator.pool import KVPool
from kvscope.allocator.sequence import Sequence

__all__ = [
    "CRASH_POINTS",
    "crash",
    "BlockState",
    "Finding",
    "FindingKind",
    "KVPool",
    "LockDeadlock",
    "PoolConfig",
    "PoolError",
    "PoolExhausted",
    "SeqState",
    "Sequence",
]
