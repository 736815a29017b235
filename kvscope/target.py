"""Resolving what a verb looks at: a dump file or a live pool, read without becoming a client."""

from __future__ import annotations

import argparse
import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvscope.allocator.dumpread import alive_for, read_dump
from kvscope.allocator.errors import PoolError
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.process import is_alive
from kvscope.allocator.segment import (
    TRUST_ENV,
    check_name,
    data_path,
    open_existing,
    release,
    segment_path,
    view_of,
)
from kvscope.allocator.snapshot import snapshot
from kvscope.analysis import Alive, collect_findings

if TYPE_CHECKING:
    # kvread reads a live pool again through this module.
    from kvscope.kvread import KVData


@dataclass
class Target:
    """A consistent copy of a segment, where it came from, and who counts as alive in it."""

    view: SegmentView
    dump_header: np.void | None
    alive: Alive
    title: str
    # Findings about the files around a live segment (its KV data file), not in the segment.
    extra: list[Finding] = field(default_factory=list)

    def findings(self, kv: KVData | None = None) -> list[Finding] | None:
        """Every finding (with `kv`, the data checks' too), when there is more than the
        segment's own (else None: the analysis collects those itself)."""
        return collect_findings(self.view, self.alive, kv) + self.extra if self.extra else None


def data_file_findings(name: str, view: SegmentView) -> list[Finding]:
    """A CPU pool's KV data file that is missing, not a regular file, or shorter than its
    geometry: every process that touches the missing part dies of SIGBUS."""
    h = view.h
    if bytes(h["device"]).decode(errors="replace") != "cpu":
        return []
    need, path = int(h["data_bytes"]), data_path(name)
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


def add_trust_owner(parser: argparse.ArgumentParser) -> None:
    """The --trust-owner flag of every verb that opens a pool by name."""
    parser.add_argument(
        "--trust-owner",
        action="store_true",
        help=f"open a pool that another user owns (or everyone may write); also {TRUST_ENV}=1",
    )


def read_live(name: str, trust_owner: bool = False) -> SegmentView:
    """A seqlock-consistent copy of the live pool `name` (takes no lock, writes nothing)."""
    check_name(name)
    mf = open_existing(segment_path(name), name, trust_owner)
    try:
        return snapshot(view_of(mf))
    finally:
        release(mf)


def looks_like_path(target: str) -> bool:
    """True for what must be a file: an existing path, a path with a separator or a .kvd name."""
    return os.path.lexists(target) or os.sep in target or target.endswith(".kvd")


def open_target(target: str, trust_owner: bool = False) -> Target:
    """A dump file when target names one, else the live pool of that name."""
    if looks_like_path(target):
        view, dh = read_dump(target)
        return Target(view, dh, alive_for(dh), f"dump {target} of pool")
    try:
        check_name(target)
    except PoolError:
        raise PoolError(f"{target!r} is neither a dump file nor a pool name") from None
    return live_target(target, trust_owner)


def live_target(name: str, trust_owner: bool = False) -> Target:
    """The live pool `name`: a consistent copy, with what is wrong with its data file."""
    view = read_live(name, trust_owner)
    return Target(view, None, is_alive, "live pool", data_file_findings(name, view))
