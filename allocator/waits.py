"""Published lock waits and the wait-for cycles they show (deadlock detection for pool locks).

Nothing detects a deadlock between processes waiting on each other's pool lock mutexes
(mutex.py). So a process about to wait for pool locks publishes which ones in its
client record (`op`, docs/FORMAT.md section 8), and clears it once it has them. Taking locks in
the one documented order can never close a cycle, so only a thread that waits for a lock below
one it holds (a lock-order inversion) has to look: it waits in slices, and between slices
follows holder -> the locks it waits for -> their holders ... through the lock records and the
published waits; a path that comes back to a lock it holds itself is a deadlock, and it raises
LockDeadlock instead of waiting forever.
"""

from __future__ import annotations

from kvscope.allocator.layout import CLIENT_DTYPE, SegmentView
from kvscope.allocator.process import is_alive

# Offset of the published wait in a client record (the record's `op` field).
WAIT_AT = CLIENT_DTYPE.fields["op"][1]


def wait_word(first: int, last: int) -> int:
    """The published wait for locks first..last (0 means not waiting)."""
    return (first + 1) | ((last + 1) << 32)


def waited_locks(word: int) -> range:
    """The locks a published wait names (empty for 0)."""
    if not word:
        return range(0)
    return range((word & 0xFFFF_FFFF) - 1, word >> 32)


def find_cycle(view: SegmentView, pid: int, tid: int, want: range) -> list[str] | None:
    """The wait-for path from locks `want` back to a lock thread (pid, tid) holds, one line per
    process on it; None when there is none (waiting ends by itself)."""
    locks, clients = view.locks, view.clients
    names = [bytes(n).decode() for n in locks["name"]]

    def path(want: range, seen: frozenset[int]) -> list[str] | None:
        for j in want:
            holder = int(locks["holder_pid"][j])
            if not holder:
                continue
            if holder == pid:
                if seen and int(locks["holder_tid"][j]) == tid:
                    return []
                continue
            c = int(locks["holder_client"][j])
            if c in seen or not 0 <= c < len(clients) or int(clients["pid"][c]) != holder:
                continue
            if not is_alive(holder, int(locks["holder_start"][j])):
                continue
            nxt = waited_locks(int(clients["op"][c]))
            if not len(nxt):
                continue
            rest = path(nxt, seen | {c})
            if rest is not None:
                waits = "/".join(repr(names[k]) for k in nxt)
                return [f"pid {holder} holds {names[j]!r} and waits for {waits}", *rest]
        return None

    return path(want, frozenset())
