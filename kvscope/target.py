"""Resolving what a verb looks at: a dump file or a live pool, read without becoming a client."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import numpy as np

from kvscope.allocator import kvread
from kvscope.allocator.dumpread import read_dump
from kvscope.allocator.errors import PoolError
from kvscope.allocator.findingset import Alive, Origin, PoolFindings, pool_findings
from kvscope.allocator.layout import ClientState, SegmentView
from kvscope.allocator.process import is_alive
from kvscope.allocator.segment import TRUST_ENV, check_name, segment_path


@dataclass
class Target:
    """A consistent copy of a segment, where it came from, and who counts as alive in it."""

    view: SegmentView
    dump_header: np.void | None
    origin: Origin
    title: str

    @property
    def alive(self) -> Alive:
        return self.origin.alive

    def findings(self) -> PoolFindings:
        """Every finding about the pool (kvscope.allocator.findingset, as every reader reads
        them), and the KV data its data checks read."""
        return pool_findings(self.view, self.origin)


def add_trust_owner(parser: argparse.ArgumentParser) -> None:
    """The --trust-owner flag of every verb that opens a pool by name."""
    parser.add_argument(
        "--trust-owner",
        action="store_true",
        help=f"open a pool that another user owns (or everyone may write); also {TRUST_ENV}=1",
    )


def read_live(name: str, trust_owner: bool = False) -> SegmentView:
    """A seqlock-consistent copy of the live pool `name` (takes no lock, writes nothing)."""
    return kvread.read_live(check_name(name), trust_owner)


def looks_like_path(target: str) -> bool:
    """True for what must be a file: an existing path, a path with a separator or a .kvd name."""
    return os.path.lexists(target) or os.sep in target or target.endswith(".kvd")


def open_target(target: str, trust_owner: bool = False) -> Target:
    """A dump file when target names one, else the live pool of that name."""
    if looks_like_path(target):
        view, dh = read_dump(target)
        return Target(view, dh, Origin.of_dump(target, dh), f"dump {target} of pool")
    try:
        check_name(target)
    except PoolError:
        raise PoolError(f"{target!r} is neither a dump file nor a pool name") from None
    return live_target(target, trust_owner)


def _attached(clients: np.ndarray) -> set[tuple[int, int]]:
    """The (pid, start) of the processes these client records hold attached."""
    on = np.flatnonzero(clients["state"] == ClientState.ATTACHED).tolist()
    return {(int(clients["pid"][c]), int(clients["start"][c])) for c in on}


class AliveAtCopy:
    """Who counts as alive in a copy (`view`) of the live pool `name`: a process alive now, or
    one the copy shows attached that the pool no longer holds attached (it detached cleanly
    after the copy was taken, its server shutting down: alive in the copy, not a dead owner of
    what the copy shows it holding). The pool's client records are read again once, at the
    first such process found gone."""

    def __init__(self, name: str, view: SegmentView, trust_owner: bool = False):
        self.name, self.trust_owner = name, trust_owner
        self.in_copy = _attached(view.clients)
        self._now: set[tuple[int, int]] | None = None

    def __call__(self, pid: int, start: int) -> bool:
        if is_alive(pid, start):
            return True
        if (pid, start) not in self.in_copy:
            return False
        if self._now is None:
            try:
                self._now = _attached(read_live(self.name, self.trust_owner).clients)
            except PoolError:
                self._now = set()  # (gone too: removed_meanwhile says so)
        return (pid, start) not in self._now and os.path.exists(segment_path(self.name))


def live_target(name: str, trust_owner: bool = False) -> Target:
    """The live pool `name`: a consistent copy, its findings read with its data file."""
    view = read_live(name, trust_owner)
    origin = Origin.live(name, trust_owner)
    origin.alive = AliveAtCopy(name, view, trust_owner)
    return Target(view, None, origin, "live pool")


def removed_meanwhile(name: str) -> None:
    """PoolError (one line) when the live pool `name` was removed while it was read (its
    server shut down, unlinking it): what the copy showed of its processes and files is no
    longer true of anything, so nothing is reported."""
    if not os.path.exists(segment_path(name)):
        raise PoolError(
            f"pool {name!r} was removed while it was read (its processes shut down and unlinked"
            " it): nothing to report; read it while it is up, or dump it (kvscope dump)"
        )
