"""Resolving what a verb looks at: a dump file or a live pool, read without becoming a client."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import numpy as np

from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.process import is_alive
from kvscope.allocator.segment import (
    TRUST_ENV,
    check_name,
    open_existing,
    release,
    segment_path,
    view_of,
)
from kvscope.allocator.snapshot import snapshot
from kvscope.analysis import Alive
from kvscope.dumpfile import alive_for, read_dump


@dataclass
class Target:
    """A consistent copy of a segment, where it came from, and who counts as alive in it."""

    view: SegmentView
    dump_header: np.void | None
    alive: Alive
    title: str


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
    return Target(read_live(target, trust_owner), None, is_alive, "live pool")
