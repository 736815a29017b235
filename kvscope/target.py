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
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.segment import TRUST_ENV, check_name


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


def live_target(name: str, trust_owner: bool = False) -> Target:
    """The live pool `name`: a consistent copy, its findings read with its data file."""
    view = read_live(name, trust_owner)
    return Target(view, None, Origin.live(name, trust_owner), "live pool")
