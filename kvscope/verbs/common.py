"""What `report` and `timeline` share: their NAME|FILE and --history arguments, and when the
view they show was taken. (Both write their file as a dump is written: allocator/dumpfile.py's
`check_target` and `write_atomic`.)"""

from __future__ import annotations

import argparse
import os

from kvscope.target import Target


def add_target_and_history(parser: argparse.ArgumentParser) -> None:
    """The positional NAME|FILE and the --history FILE of a verb that writes a pool's story."""
    parser.add_argument("target", metavar="NAME|FILE", help="a pool name or a dump file")
    parser.add_argument(
        "--history",
        metavar="FILE",
        help="the pool's history (default: FILE.history.json beside a dump)",
    )


def taken_ns(t: Target, target: str) -> int:
    """When the view was taken: a dump's time, a raw segment file's mtime, 0 for a live pool."""
    if t.dump_header is not None:
        return int(t.dump_header["created_ns"])
    if os.path.isfile(target):
        return int(os.stat(target).st_mtime_ns)
    return 0
