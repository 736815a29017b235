"""Named crash points: `KVSCOPE_CRASH_AT=<point>[:<n>]` exits abruptly the n-th time a point is hit.

Used by the crash-consistency tests (and by users testing their own recovery). The process dies
with SIGKILL: no cleanup, no atexit, exactly like an OOM kill. The points are in the C core's
operations (csrc/faults.c), which counts down `ARMED` in place.
"""

from __future__ import annotations

import os
import sys
from array import array

# Every point, in the order an operation reaches them; tests iterate over this list.
CRASH_POINTS: list[str] = []


def _register(*names: str) -> None:
    for n in names:
        if n not in CRASH_POINTS:
            CRASH_POINTS.append(n)


_register(
    "txn.after_locks",
    "blocks.after_local_pop",
    "blocks.after_ring_pop",
    "blocks.after_evict",
    "blocks.after_records",
    "blocks.after_release_records",
    "blocks.after_ring_push",
    "seqs.after_claim",
    "seqs.after_table",
    "seqs.after_release",
    "seqs.after_prefix_key",
    "prefix.after_hit",
    "prefix.after_insert",
    "txn.before_commit",
)

# [the armed point's place in CRASH_POINTS plus one (0: none), hits left before it fires]: one
# count for the whole process, which the C core (handed it once: native.py) counts down in place.
ARMED = array("q", [0, 0])


def configure(spec: str | None) -> None:
    """Arm a crash point from a `<point>[:<n>]` spec (None disarms)."""
    if not spec:
        ARMED[0], ARMED[1] = 0, 0
        return
    name, _, n = spec.partition(":")
    if name not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {name!r}; known: {', '.join(CRASH_POINTS)}")
    ARMED[0], ARMED[1] = CRASH_POINTS.index(name) + 1, int(n or 1)


def _from_env() -> None:
    try:
        configure(os.environ.get("KVSCOPE_CRASH_AT"))
    except ValueError as e:
        print(f"kvscope: KVSCOPE_CRASH_AT ignored: {e}", file=sys.stderr)


_from_env()
