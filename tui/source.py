"""Where the TUI's snapshots come from: a live pool (read-only mapping) or a dump file.

Both kinds yield `SegmentView`s, so every widget reads a live pool and a dump the same way.

    source = open_source("demo")          # a pool name, or a path to a dump
    view = source.read(block, slot)       # a copy of what the TUI displays
    view.columns["state"]                 # every block's state (and refcount, num_tokens)
    full = source.read_full()             # a consistent copy of everything (for check_view)
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from kvscope.allocator.dumpread import read_dump
from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import (
    DUMP_TORN,
    HEADER_DTYPE,
    RING_HEADER_DTYPE,
    SegmentView,
    SeqState,
)
from kvscope.allocator.segment import (
    check_name,
    open_file,
    segment_path,
    validate_bytes,
)
from kvscope.allocator.snapshot import Seqlock, copy_segment, mark_taken
from kvscope.tui.frame import BLOCK_COLUMNS, block_columns, cow_candidates

# Sections the panels show, copied whole; `blocks` column by column (BLOCK_COLUMNS, and the
# records the panels detail), `seqs` row by row (live rows only), `events` ring by ring (only
# what each ring gained), and the prefix index, the free ring's body and the client journals
# are not copied at all. PLAIN_SECTIONS are copied outside the consistent piece (see read).
SHOWN_SECTIONS = ("blocks", "sites", "locks", "lockgraph", "findings")
PLAIN_SECTIONS = ("sites", "lockgraph")
# A whole-segment copy (for check_view) gives up after this many tries; the check then waits.
FULL_TRIES = 3


class Source(Protocol):
    """Something that yields snapshots of one pool."""

    name: str
    live: bool
    view: SegmentView

    def read(self, block: int = -1, slot: int = -1) -> SegmentView:
        """A copy of the sections the panels show: `columns` (BLOCK_COLUMNS of every block, each
        contiguous), and the whole records of `block` and of the blocks sequence `slot`'s block
        table shows (their ids `records`, None when every record is there) consistent with
        the small sections."""
        ...

    def read_full(self) -> SegmentView:
        """A consistent copy of the whole segment."""
        ...

    def close(self) -> None:
        """Release the mapping or file."""
        ...


def _field_offset(dtype: np.dtype, name: str) -> int:
    """Offset of field `name` in a structured record of the segment."""
    fields = dtype.fields
    assert fields is not None, "a segment record is a structured dtype"
    return int(fields[name][1])


def _section_bounds(view: SegmentView, name: str) -> tuple[int, int]:
    off = view.offsets
    names = list(off)
    start = off[name]
    return start, off[names[names.index(name) + 1]]


class Snapshotter:
    """Consistent copies of a mapped segment into buffers it reuses (no allocation per tick).

    `read()` copies only what the panels show (of the block records, the columns the map and
    the counts draw, and the records the panels detail), `read_full()` everything; neither
    takes a lock.
    `read_full()` checks the seqlock around the whole copy, so it is consistent across sections;
    `read()` around all but the block records (see there). A view returned by `read()` stays valid until `read()` has been called twice more (two
    buffers alternate); the TUI consumes each frame before it asks for the next.
    """

    def __init__(self, view: SegmentView, tries: int = 20):
        self.view = view
        self.tries = tries
        end = view.offsets["end"]
        # np.zeros maps zero pages lazily: sections never copied cost no memory.
        self._bufs = [np.zeros(end, np.uint8) for _ in range(2)]
        self._views = [SegmentView(b, view.layout) for b in self._bufs]
        self._live_rows: list[np.ndarray] = [np.zeros(0, np.int64) for _ in range(2)]
        nblocks = len(view.blocks)
        self._columns = [
            {name: np.zeros(nblocks, view.blocks.dtype[name]) for name in BLOCK_COLUMNS}
            for _ in range(2)
        ]
        # Per buffer, each client's (attach time, event head) its event ring was copied at:
        # only rings that changed since are copied again, and of those only the new events.
        self._ring_at = [np.full((len(view.clients), 2), -1, np.int64) for _ in range(2)]
        self._turn = 0
        self._full: np.ndarray | None = None
        self._blocks = _section_bounds(view, "blocks")
        # Copied as they are (site texts and the lock graph only grow), and in the consistent
        # piece (see read).
        self._plain = [_section_bounds(view, s) for s in PLAIN_SECTIONS]
        self._bounds = [
            _section_bounds(view, s)
            for s in SHOWN_SECTIONS
            if s != "blocks" and s not in PLAIN_SECTIONS
        ]
        self._bounds.append((0, HEADER_DTYPE.itemsize))
        ring = view.offsets["ring"]
        self._bounds.append((ring, ring + RING_HEADER_DTYPE.itemsize))
        # The lease section's header and per-block counts; its records only while one is held.
        leases = view.offsets["leases"]
        self._bounds.append((leases, leases + view.layout.lease_records_at))
        self._lease_records = (leases + view.layout.lease_records_at, view.offsets["end"])
        self._seqlock = Seqlock(view)

    @property
    def num_retries(self) -> int:
        """Copies retried because a writer was inside an operation (the seqlock's count)."""
        return self._seqlock.num_retries

    def _consistent(self, copy: Callable[[], None], dst: np.ndarray) -> bool:
        """Run `copy()` into dst at a quiet moment of the seqlock (allocator/snapshot.py, the
        one reader); False if there was none in `tries` attempts."""
        return self._seqlock.copy_between(copy, self.tries, undo_into=dst)

    def read(self, block: int = -1, slot: int = -1) -> SegmentView:
        """What the panels show: the block columns the map and the counts draw in one plain
        copy, then the small sections and the records the panels detail in one piece under
        the seqlock.

        Of the block records (17 MB on a 100k-block pool) only the columns in BLOCK_COLUMNS
        are copied, contiguous, into `view.columns`; those, the live sequence rows, the site
        texts and the lock graph are copied without waiting for a quiet moment: a busy pool
        changes its counters every few microseconds, so a copy that long would keep being
        tried again. Each record and row is copied as it is at that instant; one caught in the
        middle of an operation can show, for one frame, its new state beside its old refcount
        (a row its new token count beside its old block count), which the map, the list and
        the counts take as it comes. The small sections (header, ring header, locks, client
        records, the events each ring gained since this buffer last copied it, findings), the
        row of sequence `slot` and the whole records of `block`, of the blocks in `slot`'s
        table and of the blocks its siblings diverge from it at (`cow_candidates`: what the
        block panel and the block table show field by field) are then copied together in one
        consistent piece; those records' ids are `view.records` (the other records in
        `view.blocks` are not copied: stale). `torn` is set when that piece never found a
        quiet moment in `tries` attempts (its last copy is kept).
        """
        i = self._turn
        self._turn ^= 1
        view, mine, dst = self.view, self._views[i], self._bufs[i]
        src = view.raw
        c0 = view.offsets["clients"]
        csize = view.clients.dtype.itemsize
        chead = _field_offset(view.clients.dtype, "journal")
        nclients = len(view.clients)
        sdt = view.seqs.dtype
        s0, ssize, shead = view.offsets["seqs"], sdt.itemsize, _field_offset(sdt, "table")
        nseqs = len(view.seqs)
        b0, b1 = self._blocks
        rec = view.blocks.dtype.itemsize
        nblocks = (b1 - b0) // rec
        src_recs = src[b0:b1].reshape(nblocks, rec)
        dst_recs = dst[b0:b1].reshape(nblocks, rec)
        columns = self._columns[i]
        for name in BLOCK_COLUMNS:
            np.copyto(columns[name], view.blocks[name])
        for a, b in self._plain:
            dst[a:b] = src[a:b]
        # Forget rows this buffer held last time, then copy the live ones.
        mine.seqs["state"][self._live_rows[i]] = SeqState.EMPTY
        live = np.flatnonzero(view.seqs["state"] != SeqState.EMPTY)
        width = shead
        if len(live):
            width += 4 * int(view.seqs["num_blocks"][live].max(initial=0))
        width = min(width, ssize)
        # Each live row's first `width` bytes as one item: a gather of whole items is one copy
        # per row (indexing rows and a slice of bytes copies byte by byte).
        rows = np.dtype(f"V{width}")
        np.ndarray((nseqs,), rows, dst, s0, (ssize,))[live] = np.ndarray(
            (nseqs,), rows, src, s0, (ssize,)
        )[live]
        self._live_rows[i] = live
        chosen = 0 <= slot < nseqs
        siblings = cow_candidates(mine.seqs, slot) if chosen else []
        row = slice(s0 + slot * ssize, s0 + (slot + 1) * ssize)

        def small() -> None:
            for a, b in self._bounds:
                dst[a:b] = src[a:b]
            dst[c0 : c0 + csize * nclients].reshape(nclients, csize)[:, :chead] = src[
                c0 : c0 + csize * nclients
            ].reshape(nclients, csize)[:, :chead]
            self._copy_events(i)
            if view.lease_header["active"][0]:
                a, b = self._lease_records
                dst[a:b] = src[a:b]
            shown = [block]
            if chosen:
                dst[row] = src[row]
                if mine.seqs["state"][slot] != SeqState.EMPTY:
                    table = mine.seqs["table"][slot]
                    shown += table[: min(len(table), int(mine.seqs["num_blocks"][slot]))].tolist()
                    shown += [theirs for _, _, theirs in siblings]
            ids = np.unique(np.asarray(shown, np.int64))
            ids = ids[(ids >= 0) & (ids < nblocks)]
            dst_recs[ids] = src_recs[ids]
            mine.records = ids  # type: ignore[attr-defined]

        ok = self._consistent(small, dst)
        mine.columns = columns  # type: ignore[attr-defined]
        mine.torn = not ok  # type: ignore[attr-defined]
        mark_taken(mine)
        return mine

    def _copy_events(self, i: int) -> None:
        """Copy into buffer i the events each client's ring gained since buffer i last copied
        it (the whole ring when its client attached again or it wrapped past that point)."""
        clients, events, mine = self.view.clients, self.view.events, self._views[i].events
        cap = events.shape[1]
        at = np.stack(
            [clients["attached_ns"].astype(np.int64), clients["event_head"].astype(np.int64)],
            axis=1,
        )
        held = self._ring_at[i]
        for c in np.flatnonzero((at != held).any(axis=1)).tolist():
            (attached, head), (was_attached, was_head) = at[c].tolist(), held[c].tolist()
            if attached == was_attached and 0 <= head - was_head < cap:
                pos = np.arange(was_head, head) % cap
                mine[c, pos] = events[c, pos]
            else:
                mine[c] = events[c]
        held[:] = at

    def read_full(self) -> SegmentView:
        """Every byte of the segment (what check_view needs); reuses one buffer."""
        if self._full is None:
            self._full = np.zeros(self.view.offsets["end"], np.uint8)
        torn = not copy_segment(self.view, self._full, self._seqlock, FULL_TRIES)
        out = SegmentView(self._full, self.view.layout)
        out.torn = torn  # type: ignore[attr-defined]
        mark_taken(out)
        return out


class LiveSource:
    """A pool on this host, mapped read-only: the TUI never writes to it and takes no lock."""

    live = True

    def __init__(self, name: str, trust_owner: bool = False):
        check_name(name)
        path = segment_path(name)
        # As every reader opens a pool: no symlink followed, no FIFO blocked on, another
        # user's (or a world-writable) file refused unless trusted (KVSCOPE_TRUST_OWNER=1).
        fd = open_file(path, name, trust_owner=trust_owner, writable=False)
        try:
            st = os.fstat(fd)
            size = st.st_size
            layout = validate_bytes(os.pread(fd, HEADER_DTYPE.itemsize, 0), size, path)
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.name = name
        self.path = path
        # The file mapped: once the name is unlinked (or names another pool) its files are not
        # this pool's any more, though the mapping still reads it (`unlinked`).
        self._file = (st.st_dev, st.st_ino)
        self.view = SegmentView(self._mm, layout)
        self._snap = Snapshotter(self.view)

    def unlinked(self) -> bool:
        """True once the pool's name no longer names the segment mapped here: `pool.unlink()`
        removed its files (or a new pool of that name replaced them)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self._file

    def read(self, block: int = -1, slot: int = -1) -> SegmentView:
        return self._snap.read(block, slot)

    def read_full(self) -> SegmentView:
        return self._snap.read_full()

    def close(self) -> None:
        # Numpy views may still reference the map; the OS unmaps it at exit then.
        try:
            self._mm.close()
        except BufferError:
            pass


class ViewSource:
    """A fixed SegmentView (tests, or a dump already read by the caller)."""

    live = False

    def __init__(self, view: SegmentView, name: str = ""):
        self.view = view
        self.name = name or bytes(view.h["name"]).decode(errors="replace")
        if not hasattr(view, "torn"):
            view.torn = False  # type: ignore[attr-defined]
        # Every record is there; the columns are read out once.
        view.records = None  # type: ignore[attr-defined]
        view.columns = block_columns(view)  # type: ignore[attr-defined]

    def read(self, block: int = -1, slot: int = -1) -> SegmentView:
        return self.view

    def read_full(self) -> SegmentView:
        return self.view

    def close(self) -> None:
        pass


class DumpSource(ViewSource):
    """A dump file: the same view on every tick."""

    def __init__(self, path: str):
        self.path = path
        # a dump (dump header + segment) or a bare segment image
        view, self.dump_header = read_dump(path)
        name = bytes(view.h["name"]).decode(errors="replace") or os.path.basename(path)
        self.taken_ns = 0 if self.dump_header is None else int(self.dump_header["created_ns"])
        torn = self.dump_header is not None and int(self.dump_header["flags"]) & DUMP_TORN
        view.torn = bool(torn)  # type: ignore[attr-defined]
        super().__init__(view, name)


class ReplaySource(ViewSource):
    """A pool's operation log stepped through (`kvscope top DUMP|LOG --at N`): the pool a replay
    of the log makes up to an operation (`stepper`: kvscope.replay.Stepper, moved to the first
    operation shown already), the same view until `step` or `goto` moves it."""

    def __init__(self, stepper: Any, path: str):
        self.stepper = stepper
        self.path = path
        self.dump_header = None
        r = stepper.record
        self.taken_ns = 0 if r is None else r.time_ns
        super().__init__(stepper.view())

    def goto(self, n: int) -> None:
        self.stepper.goto(n)
        self._show()

    def step(self, delta: int) -> None:
        self.stepper.step(delta)
        self._show()

    def _show(self) -> None:
        view = self.stepper.view()
        view.torn = False  # type: ignore[attr-defined]
        view.records = None  # type: ignore[attr-defined]
        view.columns = block_columns(view)  # type: ignore[attr-defined]
        self.view = view
        r = self.stepper.record
        self.taken_ns = 0 if r is None else r.time_ns

    def close(self) -> None:
        self.stepper.close()


def open_source(target: str) -> Source:
    """A dump when `target` is an existing file, else the live pool of that name (PoolError if neither).

    Anything at that path is read as a dump, as `kvscope analyze` reads it, so a directory or a
    FIFO is refused as what it is (read_dump's one line), not as a missing file."""
    if os.path.lexists(target):
        return DumpSource(target)
    if os.sep in target or target.endswith(".kvd"):
        raise PoolError(f"no such dump file: {target}")
    return LiveSource(target)
