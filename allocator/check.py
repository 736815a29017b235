"""Whole-pool consistency check over a segment view (a live snapshot or a dump), vectorised.

`check_view` runs every invariant of docs/FORMAT.md, part by part: the header (here), the
block records (checkrecords.py), the free ring and local caches (checkfree.py), references,
refcounts, leaks and the prefix index (checkrefs.py), the sequence tables (ranges.py), the
leases (checkleases.py) and the locks (checklocks.py); the findings are capped per kind
(checkreport.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.allocator.checkfree import check_free_count, check_local_caches, check_ring
from kvscope.allocator.checkleases import check_leases
from kvscope.allocator.checklocks import lock_findings
from kvscope.allocator.checkrecords import check_records
from kvscope.allocator.checkrefs import (
    check_index,
    check_orphans,
    check_refcounts,
    check_reserves,
    check_states,
    dead_owners,
)
from kvscope.allocator.checkreport import (
    MAX_PER_KIND,
    Alive,
    CheckReport,
    TableEntries,
)
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.geometry import geometry_problem
from kvscope.allocator.header import header_corruption
from kvscope.allocator.idle import idle_findings
from kvscope.allocator.layout import (
    FORMAT_VERSION,
    HEADER_DTYPE,
    POOL_MAGIC,
    SegmentView,
    SeqState,
    header_checksum,
)
from kvscope.allocator.process import is_alive
from kvscope.allocator.ranges import check_tables

__all__ = [
    "check_header",
    "check_view",
    "lock_findings",
]


def check_header(view: SegmentView, intact: bytes | None = None) -> list[Finding]:
    """Magic, version and checksum of the header; a changed field is named, with the bytes
    found and expected (against the layout the segment was opened with, and `intact`, the
    header's first bytes as last seen intact, when known)."""
    h = view.h
    magic_ok = int(h["magic"]) == POOL_MAGIC
    version_ok = int(h["version"]) == FORMAT_VERSION
    raw = np.asarray(view.raw[: HEADER_DTYPE.itemsize]).tobytes()
    if intact is None:
        intact = getattr(view, "intact_header", None)
    # Even a header that checks can disagree with the layout it was read with (a dump laid
    # out from its saved copy) or with that copy: someone resealed it.
    diff = header_corruption(raw, getattr(view, "layout", None), intact)
    if diff is None and magic_ok and version_ok and header_checksum(view.raw) == int(h["checksum"]):
        return []
    extra: dict[str, Any] = {}
    if diff is not None:
        text = diff.pop("text")
        extra = diff
    elif not magic_ok:
        text = f"header magic is {int(h['magic']):#018x}, expected {POOL_MAGIC:#018x}"
    elif not version_ok:
        text = f"format version {int(h['version'])}, expected {FORMAT_VERSION}"
    else:
        problem = geometry_problem(h)
        text = (
            f"header checksum {int(h['checksum']):#x} does not match its contents"
            f" ({header_checksum(view.raw):#x}): "
            + (
                problem
                or "a field with no saved copy to compare (name, creator, dtype, ...) changed"
            )
        )
    return [
        Finding(
            FindingKind.HEADER_CORRUPT,
            f"{text}: something outside the allocator overwrote the pool's header",
            extra=extra,
        )
    ]


def check_view(view: SegmentView, alive: Alive = is_alive) -> list[Finding]:
    """Every invariant of docs/FORMAT.md; returns findings (empty when healthy)."""
    head = check_header(view)
    if head:
        return head
    r = CheckReport(view)
    n = len(view.blocks)
    corrupt = check_records(r)
    in_ring, count = check_ring(r, view)
    # References from live sequences.
    seqs = view.seqs
    live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
    check_tables(r.add, seqs, live, n, MAX_PER_KIND)
    entries = TableEntries.of(seqs, live)
    refs = entries.refs(n)
    dead = dead_owners(r, live, entries, alive)
    check_states(r, live, entries, refs, in_ring, corrupt)
    check_local_caches(r, dead.owned, corrupt)
    check_reserves(r, view)
    check_orphans(r, live)
    check_refcounts(r, refs, dead, corrupt)
    check_index(r, corrupt)
    check_free_count(r, in_ring, count)
    check_leases(r, corrupt, alive)
    for f in lock_findings(view, alive):
        r.add(f)
    for f in idle_findings(view, alive):
        r.capped(f)
    return r.finish()
