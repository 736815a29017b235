"""The undo journal: old bytes saved before every segment write, rolled back after a crash.

One journal per client (attached process), in its client record. An operation saves the old
bytes of everything it is about to change, changes it, then commits by setting the entry count
to zero (one aligned 4-byte store). A process that dies mid-operation leaves a non-empty
journal; recovery copies the saved bytes back, newest first.
"""

from __future__ import annotations

import struct

import numpy as np

from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import (
    CLIENT_DTYPE,
    HEADER_CHECKSUM_BYTES,
    JOURNAL_BYTES,
    JOURNAL_ENTRIES,
    JOURNAL_ENTRY_DTYPE,
    SegmentView,
)

# One journal entry {offset u8, length u4, data_off u4, op u8}, and a u4 count.
_ENTRY = struct.Struct("<QIIQ")
_U4 = struct.Struct("<I")
assert _ENTRY.size == JOURNAL_ENTRY_DTYPE.itemsize
# The header's immutable fields and their checksum: no operation ever journals them.
HEADER_SEALED_BYTES = HEADER_CHECKSUM_BYTES + 8


class JournalFull(PoolError):
    """An operation's writes outgrow the undo journal (it is rolled back).

    `evicting`: the cached blocks the operation was evicting when it ran out of room. The
    runner (runner.py) then evicts that many in transactions of their own, sized to the
    journal, and runs the operation again; with none, the error stands.
    """

    def __init__(self, message: str, evicting: int = 0):
        super().__init__(message)
        self.evicting = evicting


class Journal:
    """The undo journal of one client record."""

    def __init__(self, view: SegmentView, client: int):
        self.raw = view.raw
        self.entries = view.clients["journal"][client]
        self.e_offset = self.entries["offset"]
        self.e_length = self.entries["length"]
        self.e_data = self.entries["data_off"]
        self.e_op = self.entries["op"]
        self.data = view.clients["journal_data"][client]
        self.entry_words = self.entries.view(np.uint64)
        self._count_field = view.clients["journal_count"][client : client + 1]
        self._used_field = view.clients["journal_used"][client : client + 1]
        self.count = int(self._count_field[0])
        self.used = int(self._used_field[0])
        self.op = 0
        # Cached blocks the open operation evicts (eviction.py), for `JournalFull`.
        self.evicting = 0
        # Why the last rollback was refused (see `problem`), or None.
        self.skipped: str | None = None
        # The one-range save is the hot path: plain byte copies and struct stores on the
        # mapping, no numpy scalars (a dump's bytes are never journaled into).
        base = view.offsets["clients"] + client * CLIENT_DTYPE.itemsize
        fields = CLIENT_DTYPE.fields
        self.mv = memoryview(view.buf)
        self.entries_at = base + fields["journal"][1]
        self.data_at = base + fields["journal_data"][1]
        self.count_at = base + fields["journal_count"][1]
        self.used_at = base + fields["journal_used"][1]

    def fits(self, n_entries: int, n_bytes: int) -> bool:
        """True if `n_entries` more entries holding `n_bytes` more bytes fit."""
        return self.count + n_entries <= JOURNAL_ENTRIES and self.used + n_bytes <= JOURNAL_BYTES

    def _room(self, n_entries: int, n_bytes: int) -> None:
        if self.count + n_entries > JOURNAL_ENTRIES or self.used + n_bytes > JOURNAL_BYTES:
            raise JournalFull(
                f"operation too large for the undo journal ({self.count + n_entries} entries, "
                f"{self.used + n_bytes} bytes); use smaller batches",
                self.evicting,
            )

    def save(self, offset: int, length: int) -> None:
        """Save `length` old bytes at segment `offset` before they are overwritten."""
        n, used = self.count, self.used
        if n + 1 > JOURNAL_ENTRIES or used + length > JOURNAL_BYTES:
            self._room(1, length)
        mv = self.mv
        _ENTRY.pack_into(mv, self.entries_at + _ENTRY.size * n, offset, length, used, self.op)
        d = self.data_at + used
        mv[d : d + length] = mv[offset : offset + length]
        self.used = used + length
        self.count = n + 1
        _U4.pack_into(mv, self.used_at, used + length)
        # The count is written last: an entry exists only once its bytes are saved.
        _U4.pack_into(mv, self.count_at, n + 1)

    def save_records(self, array: np.ndarray, base: int, ids: np.ndarray) -> None:
        """Save whole records `array[ids]` of a section starting at segment offset `base`."""
        k = len(ids)
        if k == 0:
            return
        size = array.dtype.itemsize
        self._room(k, k * size)
        n, used = self.count, self.used
        # Entry words: offset; length | data_off << 32; op.
        e = self.entry_words[3 * n : 3 * (n + k)].reshape(k, 3)
        e[:, 0] = np.asarray(ids, np.uint64) * np.uint64(size) + np.uint64(base)
        e[:, 1] = (
            np.arange(used, used + k * size, size, dtype=np.uint64) << np.uint64(32)
        ) | np.uint64(size)
        e[:, 2] = self.op
        rows = array.view(np.uint8).reshape(len(array), size)
        np.take(rows, ids, axis=0, out=self.data[used : used + k * size].reshape(k, size))
        self.used = used + k * size
        self.count = n + k
        self._used_field[0] = self.used
        self._count_field[0] = self.count

    def commit(self) -> None:
        """Forget the saved bytes: the operation's writes stand."""
        if self.count or self.used:
            self._count_field[0] = 0
            self._used_field[0] = 0
        self.count = self.used = 0
        self.evicting = 0

    def problem(self) -> str | None:
        """Why this journal cannot be rolled back safely (a count past its capacity, an entry
        outside the segment or over the sealed header, saved bytes past its data), or None."""
        n, used = int(self._count_field[0]), int(self._used_field[0])
        if n > JOURNAL_ENTRIES:
            return f"it claims {n} entries, it holds at most {JOURNAL_ENTRIES}"
        if used > JOURNAL_BYTES:
            return f"it claims {used} saved bytes, it holds at most {JOURNAL_BYTES}"
        ents = self.entries[:n]
        offs = ents["offset"].astype(object)
        lens = ents["length"].astype(np.int64)
        data = ents["data_off"].astype(np.int64)
        size = len(self.raw)
        for i in range(n):
            off, length, d = int(offs[i]), int(lens[i]), int(data[i])
            if off + length > size:
                return f"entry {i} restores bytes [{off}, {off + length}) outside the {size}-byte segment"
            if off < HEADER_SEALED_BYTES:
                return f"entry {i} restores bytes at {off}, inside the sealed header"
            if d + length > used:
                return f"entry {i}'s saved bytes [{d}, {d + length}) run past the journal's {used} bytes"
        return None

    def rollback(self) -> int:
        """Restore every saved range, newest first; return how many ranges were restored.

        A journal that `problem` rejects is not applied at all (`skipped` says why) and is
        cleared: its writes stand, and a check reports what they left.
        """
        n = int(self._count_field[0])
        self.skipped = self.problem()
        if self.skipped is not None:
            n = 0
        ents = self.entries[:n]
        offs, lens, data_offs = (
            ents["offset"].tolist(),
            ents["length"].tolist(),
            ents["data_off"].tolist(),
        )
        for i in range(n - 1, -1, -1):
            off, length, d = offs[i], lens[i], data_offs[i]
            self.raw[off : off + length] = self.data[d : d + length]
        self._count_field[0] = 0
        self._used_field[0] = 0
        self.count = self.used = 0
        self.evicting = 0
        return n
