"""The operation runner: every Python-path operation of a pool is a function run in a
transaction (txn.py) under this handle's mutex, retried with more locks when it asks for them
(`Escalate`), after the core recovered a lock whose holder died (`DeadHolder`), and after the C
core evicted ahead the blocks whose eviction outgrew its undo journal (`JournalFull`); a full pool's
`PoolExhausted` leaves it with the counts of the pool as the rollback left it. `KVPool._run`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kvscope.allocator import eviction, faults
from kvscope.allocator.errors import PoolExhausted
from kvscope.allocator.journal import JournalFull
from kvscope.allocator.locks import DeadHolder
from kvscope.allocator.reserve import exhausted
from kvscope.allocator.txn import Escalate, Txn

if TYPE_CHECKING:
    from kvscope.allocator.pool import KVPool

T = TypeVar("T")


def run(pool: KVPool, locks: set[int], fn: Callable[[Txn], T]) -> T:
    """Run fn in a transaction, escalating locks and recovering dead holders as needed."""
    pool._check_process()
    with pool._mutex:
        busy = pool._busy
        busy[0] += 1
        try:
            while True:
                try:
                    order: set[int] | list[int] = locks
                    invert = (
                        faults.ARMED and len(locks) > 1 and faults.opportunity("lock-inversion")
                    )
                    if invert:
                        order = sorted(locks, reverse=True)
                    with Txn(pool.locks, pool.journal, pool._client_seq, order) as t:
                        if invert:
                            # Announced once the locks are taken in the wrong order.
                            faults.fired("lock-inversion")
                        return fn(t)
                except Escalate as e:
                    locks = e.locks
                except JournalFull as e:
                    # Rolled back: evict its blocks ahead (own transactions), then run it again.
                    eviction.evict_ahead(pool, e)
                except DeadHolder:
                    # The core recovers it (csrc/recovery.c: every lock, the dead clients'
                    # journals rolled back, a lock_dead_holder finding handed on by the
                    # operation's _hand_findings), then the transaction runs again.
                    pool._core.recover()
                except PoolExhausted as e:
                    # Rolled back: what is free, cached and held with the operation undone
                    raise exhausted(pool, e.needed) from None
        finally:
            busy[0] -= 1
