"""What `report` and `timeline` share: their NAME|FILE and --history arguments, when the view
they show was taken, and the one-line error for an output file that cannot be written."""

from __future__ import annotations

import argparse
import os

from kvscope.errors import UsageError
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


def output_error(path: str, e: OSError) -> UsageError:
    """The one-line error for an output file that cannot be written."""
    return UsageError(f"cannot write {path}: {e.strerror or e}")
