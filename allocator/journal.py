"""The undo journal as a reader sees it: whether one can be trusted to roll back.

One journal per client (attached process), in its client record. The C core saves the old bytes
of everything an operation is about to change, changes it, then commits by setting the entry
count to zero (csrc/journal.c). A process that dies mid-operation leaves a non-empty journal;
recovery copies the saved bytes back, newest first (csrc/recovery.c), and the seqlock reader
does the same in its copy (snapshot.py). Neither applies a journal `problem` rejects.
"""

from __future__ import annotations

from kvscope.allocator.layout import (
    HEADER_CHECKSUM_BYTES,
    JOURNAL_BYTES,
    JOURNAL_ENTRIES,
    SegmentView,
)

# The header's immutable fields and their checksum: no operation ever journals them.
HEADER_SEALED_BYTES = HEADER_CHECKSUM_BYTES + 8


def problem(view: SegmentView, client: int) -> str | None:
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
