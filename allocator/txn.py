"""Txn: one allocator operation — its locks (taken in order), its journal and its commit hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvscope.allocator.crash import crash_point
from kvscope.allocator.journal import Journal
from kvscope.allocator.locks import DeadHolder, LockTable

if TYPE_CHECKING:
    import numpy as np


class Escalate(Exception):
    """The operation needs locks it does not hold; it is rolled back and retried with them."""

    def __init__(self, locks: set[int]):
        super().__init__(f"needs locks {sorted(locks)}")
        self.locks = locks


class Txn:
    """Context manager: lock in order, journal every write, commit or roll back, unlock."""

    def __init__(
        self, locks: LockTable, journal: Journal, client_seq: np.ndarray, held: set[int] | list[int]
    ):
        self.lock_table = locks
        self.journal = journal
        self.client_seq = client_seq
        # Locks are taken in the one documented order (a list keeps a caller's order: the
        # lock-inversion fault).
        self.held = list(held) if isinstance(held, list) else sorted(held)
        self.held_set = set(held)
        self.after_commit: list[Callable[[], None]] = []
        # Side effects outside the segment (KV poisoning) that must not happen if the operation
        # is rolled back: run at commit, while the locks are still held.
        self.before_commit: list[Callable[[], None]] = []

    def need(self, *locks: int) -> None:
        """Escalate unless every named lock is held."""
        missing = set(locks) - self.held_set
        if missing:
            raise Escalate(self.held_set | missing)

    def __enter__(self) -> Txn:
        # Odd while this process writes outside locks too: lock-free readers retry.
        self.client_seq[0] += 1
        taken: list[int] = []
        try:
            for i in self.held:
                self.lock_table.acquire(i)
                taken.append(i)
        except BaseException:
            for i in reversed(taken):
                self.lock_table.release(i)
            self.client_seq[0] += 1
            raise
        self.journal.op += 1
        if self.held:
            crash_point("txn.after_locks")
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            for fn in self.before_commit:
                fn()
            crash_point("txn.before_commit")
            self.journal.commit()
        else:
            self.journal.rollback()
        for i in reversed(self.held):
            self.lock_table.release(i)
        self.client_seq[0] += 1
        if exc_type is None:
            for fn in self.after_commit:
                fn()


__all__ = ["DeadHolder", "Escalate", "Txn"]
