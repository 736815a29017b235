"""Consistent lock-free copies of a live segment: the seqlock reader, the one the pool, the verbs
and the TUI use.

Every pool lock and every client record has a counter that is odd while its writer is inside an
operation (docs/FORMAT.md sections 7 and 8). A copy is consistent when it was taken between two
equal readings of the counters with no live writer inside an operation. Counters of detached
records do not count. A process that died inside an operation never finishes it, and one that
stays inside one operation for the whole copy (a long operation, a stopped process) does not
change it meanwhile: both are rolled back in the copy from their undo journals, so the copy
shows the pool as recovery leaves it, and neither a death nor a stall makes every copy torn.

    seqlock = Seqlock(view)
    ok = seqlock.copy_between(lambda: np.copyto(dst, view.raw), tries=20)  # one copy
    snap = snapshot(view)          # the whole segment, `snap.torn` False when consistent
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvscope.allocator.layout import (
    HEADER_CHECKSUM_BYTES,
    JOURNAL_BYTES,
    JOURNAL_ENTRIES,
    ClientState,
    SegmentView,
    block_checksums,
    block_words,
)
from kvscope.allocator.process import is_alive

# The header's immutable fields and their checksum: no operation ever journals them.
HEADER_SEALED_BYTES = HEADER_CHECKSUM_BYTES + 8


def journal_problem(view: SegmentView, client: int) -> str | None:
    """Why client `client`'s journal cannot be rolled back safely (a count past its capacity,
    an entry outside the segment or over the sealed header, saved bytes past its data), or
    None (csrc/recovery.c journal_problem is the core's twin)."""
    cl = view.clients
    n, used = int(cl["journal_count"][client]), int(cl["journal_used"][client])
    if n > JOURNAL_ENTRIES:
        return f"it claims {n} entries, it holds at most {JOURNAL_ENTRIES}"
    if used > JOURNAL_BYTES:
        return f"it claims {used} saved bytes, it holds at most {JOURNAL_BYTES}"
    ents = cl["journal"][client][:n]
    offs = ents["offset"].tolist()
    lens = ents["length"].tolist()
    data = ents["data_off"].tolist()
    size = len(view.raw)
    for i in range(n):
        off, length, d = offs[i], lens[i], data[i]
        if off + length > size:
            return (
                f"entry {i} restores bytes [{off}, {off + length}) outside the {size}-byte segment"
            )
        if off < HEADER_SEALED_BYTES:
            return f"entry {i} restores bytes at {off}, inside the sealed header"
        if d + length > used:
            return (
                f"entry {i}'s saved bytes [{d}, {d + length}) run past the journal's {used} bytes"
            )
    return None


class Seqlock:
    """The segment's counters as a reader sees them (takes no lock, writes nothing)."""

    def __init__(self, view: SegmentView):
        self.view = view
        self.num_locks = len(view.locks)
        self.num_retries = 0
        # Writers found dead stay dead.
        self._dead: set[tuple[int, int]] = set()
        cf = view.clients.dtype.fields
        self._c0, self._csize = view.offsets["clients"], view.clients.dtype.itemsize
        self._jcount, self._jused = cf["journal_count"][1], cf["journal_used"][1]

    def _gone(self, pid: int, start: int) -> bool:
        key = (pid, start)
        if key in self._dead:
            return True
        if pid and not is_alive(pid, start):
            self._dead.add(key)
            return True
        return False

    def _counters(self) -> np.ndarray:
        return np.concatenate([self.view.locks["seq"], self.view.clients["seq"]])

    def quiet(self, undo: bool = False) -> tuple[np.ndarray, list[int]] | None:
        """The counters now, or None while a live writer is inside an operation.

        With `undo`, the attached clients inside an operation (odd counter, alive or dead) are
        listed instead, to be rolled back in the copy; None then only when a live process holds
        a lock outside an operation of its own record (recovery, say: its writes are in no
        journal)."""
        v = self.view
        counters = self._counters()
        odd = np.flatnonzero(counters % 2)
        busy: list[int] = []
        nl = self.num_locks
        for k in odd.tolist():
            if k >= nl:
                c = k - nl
                if int(v.clients["state"][c]) != ClientState.ATTACHED:
                    continue
                if undo:
                    busy.append(c)
                elif not self._gone(int(v.clients["pid"][c]), int(v.clients["start"][c])):
                    return None
                continue
            pid = int(v.locks["holder_pid"][k])
            if pid and self._gone(pid, int(v.locks["holder_start"][k])):
                continue
            # No holder yet (or already none): a live process is taking or leaving it.
            if not undo or not pid:
                return None
            # Held inside an operation of a live client (its writes are in its journal).
            c = int(v.locks["holder_client"][k])
            if not (0 <= c < len(v.clients)) or int(v.clients["pid"][c]) != pid:
                return None
            if counters[nl + c] % 2 == 0:
                return None
        return counters, busy

    def copy_between(
        self,
        copy: Callable[[], None],
        tries: int,
        undo_into: np.ndarray | None = None,
        verify: Callable[[], bool] | None = None,
    ) -> bool:
        """Run `copy()` between two equal readings of the counters that show no live writer
        inside an operation; False if there was none in `tries` attempts (the last copy is
        kept).

        With `undo_into` (the whole-segment buffer `copy` writes), a writer inside an operation
        does not make the copy torn as long as it stays inside that one operation through the
        copy (a long operation, a stopped process) or never comes back (a process that died
        in it): its journal, read after the copy, is rolled back in the copy, which then shows
        the pool as before that operation, as recovery would leave it. `verify`, when given,
        is asked after a copy and False makes it try again.
        """
        jcount = self.view.clients["journal_count"]
        for attempt in range(tries):
            got = self.quiet(undo=undo_into is not None)
            if got is None:
                self.num_retries += 1
                time.sleep(0.0001 * min(attempt + 1, 10))
                continue
            before, busy = got
            counts = jcount.copy()
            copy()
            for c in busy:
                assert undo_into is not None
                self._undo(c, undo_into, int(counts[c]))
            if np.array_equal(before, self._counters()) and (verify is None or verify()):
                return True
            self.num_retries += 1
        return False

    def _undo(self, c: int, dst: np.ndarray, count_before: int) -> None:
        """Roll client c's journal back in the copy dst, newest entry first.

        Its entries as of now (an entry below the count is complete: its bytes were saved
        before the count grew), or as of before the copy when there were more then: a writer
        that rolls back its own operation, or a reclaimer rolling back a dead one's, zeroes
        the count only after restoring, and leaves the entries in place until the writer's
        next operation (which changes its counter, and the copy is taken again).
        """
        cl = self.view.clients
        if journal_problem(self.view, c) is not None:
            # Recovery will not apply a journal it cannot trust (its writes stand): nor does this.
            return
        n = min(max(int(cl["journal_count"][c]), count_before), len(cl["journal"][c]))
        entries = cl["journal"][c][:n].copy()
        data = cl["journal_data"][c].copy()
        end = len(dst)
        for e in entries[::-1]:
            off, length, at = int(e["offset"]), int(e["length"]), int(e["data_off"])
            if off + length <= end and at + length <= len(data):
                dst[off : off + length] = data[at : at + length]
        rec = self._c0 + c * self._csize
        dst[rec + self._jcount : rec + self._jcount + 4] = 0
        dst[rec + self._jused : rec + self._jused + 4] = 0


def _state_ranges(view: SegmentView) -> list[tuple[int, int]]:
    """Byte ranges of everything a check reads (the client records without their journals, and
    neither the site texts nor the event rings): what must be copied at one quiet moment."""
    off = view.offsets
    c0 = off["clients"]
    size = view.clients.dtype.itemsize
    head = view.clients.dtype.fields["journal"][1]
    out = [(0, off["sites"]), (off["locks"], c0)]
    out += [(c0 + i * size, c0 + i * size + head) for i in range(len(view.clients))]
    out.append((off["lockgraph"], off["end"]))
    return out


def copy_segment(view: SegmentView, dst: np.ndarray, seqlock: Seqlock, tries: int) -> bool:
    """Copy the whole segment into `dst` (uint8, the segment's size); True when what a check
    reads is consistent.

    Everything is copied once, then what a check reads is copied again at a quiet moment (no
    live writer inside an operation, or only ones that stay inside one through the copy or
    died in it, rolled back in it): the journals of live clients are empty then (or rolled
    back), and those of dead ones do not change until recovery (which empties them under every
    lock, and evens the counter), so the first copy of their bytes stands; the site texts and
    event rings only grow. A block record that fails its checksum in the copy but not in the
    pool was caught half way through one of the stores an append makes outside any operation
    (its prefix key and checksum, docs/FORMAT.md crash rule 5): the copy is taken again.
    """
    src = view.raw
    np.copyto(dst, src)
    ranges = _state_ranges(view)

    def copy() -> None:
        for a, b in ranges:
            dst[a:b] = src[a:b]

    return seqlock.copy_between(copy, tries, undo_into=dst, verify=_whole_records(view, dst))


def _whole_records(view: SegmentView, dst: np.ndarray) -> Callable[[], bool]:
    """A copy's check that no block record in it was caught half way through one of the
    stores an append makes outside any operation (copy_segment)."""
    copied = SegmentView(dst, view.layout).blocks
    ids = np.arange(len(copied), dtype=np.int64)

    def whole_records() -> bool:
        bad = ids[block_checksums(copied, ids) != copied["checksum"]]
        return not len(bad) or bool(
            (block_words(copied)[bad] == block_words(view.blocks)[bad]).all()
        )

    return whole_records


def metadata_ranges(view: SegmentView) -> list[tuple[int, int]]:
    """Byte ranges of the pool's metadata a replay starts from (allocator/checkpoint.py): the
    header, blocks, free ring, prefix index, sequence table and site table, the client records
    without their journals (local caches, counters), the lock-order graph, findings ring, LRU
    list and leases. Not the locks (their mutexes are the pool's own), the event rings, the slot
    provenance, nor the K/V bytes."""
    off = view.offsets
    c0 = off["clients"]
    size = view.clients.dtype.itemsize
    head = view.clients.dtype.fields["journal"][1]
    out = [(0, off["locks"])]
    out += [(c0 + i * size, c0 + i * size + head) for i in range(len(view.clients))]
    out.append((off["lockgraph"], off["provenance"]))
    return out


def copy_metadata(view: SegmentView, tries: int = 200) -> tuple[np.ndarray, int] | None:
    """A consistent copy of the pool's metadata (metadata_ranges, into a buffer of the
    segment's size, the rest zeros) and the header's op_seq it was taken at: no live writer
    inside an operation (or one rolled back in the copy, as copy_between does) and no operation
    number taken while it was copied. None after `tries` attempts.

    Lock-free, as every reader's copy (no pool lock taken, so a process stopped holding one
    stops no recording): an operation's number is taken as it returns, after its transaction,
    so the caller takes the snapshot's own number by compare-and-swap from the op_seq returned
    (csrc/oplog.c oplog_snapshot), which fails, and the copy is taken again, where any number
    was taken since."""
    dst = np.zeros(view.offsets["end"], np.uint8)
    src = view.raw
    ranges = metadata_ranges(view)
    header = view.header
    seen = [0]

    def copy() -> None:
        seen[0] = int(header["op_seq"][0])
        for a, b in ranges:
            dst[a:b] = src[a:b]

    whole = _whole_records(view, dst)

    def verify() -> bool:
        return int(header["op_seq"][0]) == seen[0] and whole()

    if not Seqlock(view).copy_between(copy, tries, undo_into=dst, verify=verify):
        return None
    return dst, seen[0]


def snapshot(view: SegmentView, tries: int = 200) -> SegmentView:
    """A copy of the segment in which no live writer is mid-operation (`torn` False); after
    `tries` attempts, the last copy (`torn` True)."""
    out = bytearray(view.offsets["end"])
    ok = copy_segment(view, np.frombuffer(out, np.uint8), Seqlock(view), tries)
    snap = SegmentView(out, view.layout)
    snap.torn = not ok  # type: ignore[attr-defined]
    mark_taken(snap)
    return snap


def mark_taken(view: SegmentView) -> None:
    """A copy of a live pool says when it was taken: on the clock of the lock records'
    `acquired_ns` and the sequence records' `active_ns` (the check's stalls and idle
    requests), and on the flight recorder's (idle.py: what a process did since a request was
    last served). A dump's view says neither."""
    view.taken_mono_ns = time.monotonic_ns()  # type: ignore[attr-defined]
    view.taken_wall_ns = time.time_ns()  # type: ignore[attr-defined]
