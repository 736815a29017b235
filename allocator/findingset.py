"""Every finding about one pool, assembled one way for every reader.

`analyze`, `check`, `report`, `timeline`, `top`, `kvscope run`'s verdict and the exporters all
read a pool's findings through `pool_findings`: the findings ring (what the probes recorded as
it happened), the whole-pool check (allocator/check.py), the K/V data checks
(allocator/integrity.py, when the pool's data can be read) and the data file's own findings (a
CPU pool's KV file missing or cut short), with one de-duplication rule (`merge`):

    origin = Origin.live("demo")             # or Origin.of_dump(path, dump_header)
    found = pool_findings(view, origin).findings

A reader that reads the ring more often than it checks the whole pool (the TUI) keeps the
checked part (`checked_findings`) and merges each newer ring into it with the same `merge`.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kvscope.allocator.check import check_header, check_view
from kvscope.allocator.checkreport import not_listed_message
from kvscope.allocator.findings import Finding, FindingKind, readable_findings
from kvscope.allocator.integrity import check_kv, seen_apart, seen_together
from kvscope.allocator.kvread import KVData, for_dump, for_live
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.process import is_alive
from kvscope.allocator.segment import data_path

Alive = Callable[[int, int], bool]


@dataclass
class Origin:
    """Where a segment view came from, for what the segment alone does not tell: who counts as
    alive, and where the pool's KV data lies. `name`: a live pool; `dump`: a dump file (with
    its header); neither: a copy read from nowhere else (no data checks)."""

    name: str | None = None
    dump: str | None = None
    dump_header: np.void | None = None
    # A live pool's KV data file, and how its records are read again, when it is not at its
    # name's place (a pool a run's script unlinked, renamed aside until the run ends).
    data_file: str | None = None
    again: Callable[[], SegmentView] | None = None
    trust_owner: bool = False
    alive: Alive = is_alive
    # The KV data when the reader already holds it (read once, not again by `kv`).
    data: KVData | None = None

    @classmethod
    def live(
        cls,
        name: str,
        trust_owner: bool = False,
        data_file: str | None = None,
        again: Callable[[], SegmentView] | None = None,
    ) -> Origin:
        return cls(name=name, trust_owner=trust_owner, data_file=data_file, again=again)

    @classmethod
    def of_dump(cls, path: str, dump_header: np.void | None) -> Origin:
        from kvscope.allocator.dumpread import alive_for

        alive = alive_for(dump_header) if dump_header is not None else is_alive
        return cls(dump=os.fspath(path), dump_header=dump_header, alive=alive)

    def kv(self, view: SegmentView) -> KVData | None:
        """The pool's KV data for the data checks (None when no data check applies)."""
        if self.data is not None:
            return self.data
        if self.dump is not None:
            return for_dump(self.dump, view, self.dump_header)
        if self.name is not None:
            return for_live(self.name, view, self.data_file, self.trust_owner, self.again)
        return None

    def files(self, view: SegmentView) -> list[Finding]:
        """What is wrong with the files around a live pool's segment (its KV data file)."""
        if self.name is None:
            return []
        return data_file_findings(self.data_file or data_path(self.name), view)


@dataclass
class PoolFindings:
    """A pool's findings, and the KV data the data checks read (None: none applies)."""

    findings: list[Finding]
    kv: KVData | None = None


def data_file_findings(path: str, view: SegmentView) -> list[Finding]:
    """A CPU pool's KV data file that is missing, not a regular file, or shorter than its
    geometry: every process that touches the missing part dies of SIGBUS."""
    h = view.h
    if bytes(h["device"]).decode(errors="replace").strip("\0") != "cpu":
        return []
    need = int(h["data_bytes"])
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        problem = "is missing"
    else:
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_size < need:
            problem = f"holds {st.st_size} bytes but the pool's geometry needs {need}"
        else:
            return []
    return [
        Finding(
            FindingKind.OUT_OF_BOUNDS,
            f"the pool's KV data file {path} {problem}: a process that reads or writes the"
            " missing part of the KV tensor dies of SIGBUS, and no process can attach",
            extra={"path": path, "data_bytes": need},
        )
    ]


def finding_key(f: Finding) -> tuple[str, int | None, int | None]:
    """What makes two findings one: the same kind about the same block and the same owner."""
    return (f.kind, f.block, f.owner_pid)


def said_key(f: Finding) -> tuple:
    """What makes two findings one said twice: the same kind, block, owner, request and words
    (two processes' checks that found the same overwritten poison; `kvscope run`'s live line
    and its last read of the same finding)."""
    return (*finding_key(f), f.request, f.message)


def merge(recorded: list[Finding], checked: list[Finding]) -> list[Finding]:
    """The one de-duplication rule. The ring's findings are kept (they carry the moment each
    happened), but one that says what an earlier one said (`said_key`), and a
    `published_block_modified` that says the same change of the same block was seen somewhere
    else too (another process's check: the first names every place, `extra["seen_at"]`); a checked finding that
    repeats one of them (`finding_key`), or says what an earlier checked one said, is dropped, and so is a `leak_dead_owner` or a checked `leak_finished`
    about a request whose process reported it as `leak_finished` at its exit or its close (one
    cause: the process ended, or let go of the pool, holding it). A
    corrupt header leaves only the header's findings: nothing else in the segment, its ring
    included, can be trusted."""
    if any(f.kind == FindingKind.HEADER_CORRUPT for f in checked):
        return [f for f in checked if f.kind == FindingKind.HEADER_CORRUPT]
    seen = {finding_key(f) for f in recorded}
    said_recorded: set[tuple] = set()
    finished = {
        (f.owner_pid, f.request)
        for f in recorded
        if f.kind == FindingKind.LEAK_FINISHED and f.request
    }
    out: list[Finding] = []
    # (one change of a published block seen by several processes' checks: one finding naming
    # every place it was seen, the first's moment)
    places: dict[tuple, tuple[int, list[str]]] = {}
    for f in recorded:
        key = said_key(f)
        if key in said_recorded:
            continue
        said_recorded.add(key)
        apart = seen_apart(f.message) if f.kind == FindingKind.PUBLISHED_BLOCK_MODIFIED else None
        if apart is not None:
            words, place = apart
            first = places.setdefault((*finding_key(f), f.request, words), (len(out), []))
            first[1].append(place)
            if len(first[1]) > 1:
                continue
        out.append(f)
    for (*_, words), (at, saw) in places.items():
        if len(saw) > 1:
            out[at] = replace(
                out[at],
                message=seen_together(words, saw),
                extra={**out[at].extra, "seen_at": saw},
            )
    # Checked findings repeat each other only when they say the same thing: two locks one
    # stopped process holds are two findings about no block.
    said: set[tuple] = set()
    for f in checked:
        leak = f.kind in (FindingKind.LEAK_DEAD_OWNER, FindingKind.LEAK_FINISHED)
        if leak and (f.owner_pid, f.request) in finished:
            continue
        if leak and "not_listed" in f.extra:
            # (the check's count of those past its cap: the same rule, by their owners)
            left = _not_listed_left(f, finished, sum(g.kind == f.kind for g in out))
            if left is None:
                continue
            f = left
        same = (finding_key(f), f.request, f.extra.get("lock"), f.message)
        if finding_key(f) in seen or same in said:
            continue
        said.add(same)
        out.append(f)
    return out


def _not_listed_left(f: Finding, finished: set[tuple], listed: int) -> Finding | None:
    """The check's finding that counts its findings of a leak kind past the cap, less those
    whose request's process reported it as `leak_finished` (None when that is all of them);
    `listed`: how many of the kind are kept."""
    left = [e for e in f.extra["not_listed"] if (e[0] or None, e[1] or None) not in finished]
    more = sum(e[2] for e in left)
    if not more:
        return None
    return replace(
        f,
        message=not_listed_message(f.kind, more, listed + more),
        extra={**f.extra, "not_listed": left},
    )


def recorded_findings(view: SegmentView) -> list[Finding]:
    """The findings ring, oldest first, each marked `source: recorded` (empty when the header
    or the ring is scribbled over: the check reports what the blocks show)."""
    if check_header(view):
        return []
    recorded = readable_findings(view)
    # What `kvscope check --repair` answered (KVPool.clear_repaired) is no longer a finding.
    recorded = [f for f in recorded if not f.extra.pop("repaired", False)]
    for f in recorded:
        f.extra["source"] = "recorded"
    return recorded


def checked_findings(view: SegmentView, origin: Origin) -> PoolFindings:
    """The whole-pool check, the K/V data checks and the data file's findings, each marked
    `source: check`, and the KV data read for them."""
    checked = check_view(view, alive=origin.alive)
    if any(f.kind == FindingKind.HEADER_CORRUPT for f in checked):
        kv = None  # its geometry cannot be trusted to lay out the data
    else:
        kv = origin.kv(view)
        if kv is not None and kv.bits is not None:
            for f in check_kv(view, kv.bits, again=kv.again):
                f.extra["kv_data"] = True  # (read from the K/V, which a dump may not carry)
                checked.append(f)
        checked += origin.files(view)
    for f in checked:
        f.extra["source"] = "check"
    return PoolFindings(checked, kv)


def pool_findings(view: SegmentView, origin: Origin | None = None) -> PoolFindings:
    """Every finding about the pool `view` is a consistent copy of, from wherever `origin`
    says it came (default: a copy of nothing else: the ring and the whole-pool check), and
    the KV data its data checks read."""
    checked = checked_findings(view, origin if origin is not None else Origin())
    return PoolFindings(merge(recorded_findings(view), checked.findings), checked.kv)
