"""Txn: one allocator operation — its locks (taken in order), its journal and its commit hooks."""

from __future__ import annotations

import struct
from collections.abc import Callable

from kvscope.allocator.crash import crash_point
from kvscope.allocator.journal import Journal
from kvscope.allocator.layout import CLIENT_DTYPE, SegmentView
from kvscope.allocator.locks import DeadHolder, LockTable

_U8 = struct.Struct("<Q")


class ClientSeq:
    """The `seq` field of this process's client record: odd while it is inside an operation.

    Only the owner writes it (the Python path and the C core, native.py), so each bump reads
    the field and stores it plus one.
    """

    def __init__(self, view: SegmentView, client: int):
        self.mv = memoryview(view.buf)
        self.at = (
            view.offsets["clients"] + client * CLIENT_DTYPE.itemsize + CLIENT_DTYPE.fields["seq"][1]
        )

    def bump(self) -> None:
        """Advance the counter by one (odd: entering, even: leaving)."""
        _U8.pack_into(self.mv, self.at, _U8.unpack_from(self.mv, self.at)[0] + 1)


class Escalate(Exception):
    """The operation needs locks it does not hold; it is rolled back and retried with them."""

    def __init__(self, locks: set[int]):
        super().__init__(f"needs locks {sorted(locks)}")
        self.locks = locks


def _runs(locks: list[int]) -> list[list[int]]:
    """Ascending lock indices split into runs of consecutive ones."""
    runs: list[list[int]] = []
    for i in locks:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class Txn:
    """Context manager: lock in order, journal every write, commit or roll back, unlock."""

    def __init__(
        self, locks: LockTable, journal: Journal, client_seq: ClientSeq, held: set[int] | list[int]
    ):
        self.lock_table = locks
        self.journal = journal
        self.client_seq = client_seq
        # Locks are taken in the one documented order (a list keeps a caller's order: the
        # lock-inversion fault).
        self.held = list(held) if isinstance(held, list) else sorted(held)
        self.held_set = held if isinstance(held, set) else set(held)
        # Runs of consecutive locks (the index shards, say) take one OFD lock each; a caller's
        # own order is kept lock by lock.
        self.runs = _runs(self.held) if not isinstance(held, list) else [[i] for i in self.held]
        self.after_commit: list[Callable[[], object]] = []
        # Side effects outside the segment (KV poisoning) that must not happen if the operation
        # is rolled back: run at commit, while the locks are still held.
        self.before_commit: list[Callable[[], object]] = []
        # Python-side state changed with the segment's (this process's slot reserve): undone,
        # newest first, when the transaction rolls back.
        self.after_rollback: list[Callable[[], None]] = []

    def need(self, *locks: int) -> None:
        """Escalate unless every named lock is held."""
        for i in locks:
            if i not in self.held_set:
                raise Escalate(self.held_set | set(locks))

    def __enter__(self) -> Txn:
        # Odd while this process writes outside locks too: lock-free readers retry.
        self.client_seq.bump()
        lt = self.lock_table
        taken: list[int] = []
        try:
            for run in self.runs:
                if len(run) > 1:
                    lt.acquire_run(run)
                    taken += run
                    continue
                for i in run:
                    lt.acquire(i)
                    taken.append(i)
        except BaseException:
            for i in reversed(taken):
                self.lock_table.release(i)
            self.client_seq.bump()
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
            for fn in reversed(self.after_rollback):
                fn()
        for run in reversed(self.runs):
            self.lock_table.release_run(run)
        self.client_seq.bump()
        if exc_type is None:
            for fn in self.after_commit:
                fn()


__all__ = ["ClientSeq", "DeadHolder", "Escalate", "Txn"]
