"""Named crash points: `KVSCOPE_CRASH_AT=<point>[:<n>]` exits abruptly the n-th time a point is hit.

Used by the crash-consistency tests (and by users testing their own recovery). The process dies
with SIGKILL: no cleanup, no atexit, exactly like an OOM kill.
"""

from __future__ import annotations

import os
import signal
import sys

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

# The armed point (the C core reads `_target` to keep off while one is armed: native.py).
_target: str | None = None
_count = 0


def configure(spec: str | None) -> None:
    """Arm a crash point from a `<point>[:<n>]` spec (None disarms)."""
    global _target, _count
    if not spec:
        _target, _count = None, 0
        return
    name, _, n = spec.partition(":")
    if name not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {name!r}; known: {', '.join(CRASH_POINTS)}")
    _target, _count = name, int(n or 1)


def _from_env() -> None:
    try:
        configure(os.environ.get("KVSCOPE_CRASH_AT"))
    except ValueError as e:
        print(f"kvscope: KVSCOPE_CRASH_AT ignored: {e}", file=sys.stderr)


def crash_point(name: str) -> None:
    """Die here if this point is armed and its count is reached."""
    global _count
    if _target is None or name != _target:
        return
    _count -= 1
    if _count <= 0:
        os.kill(os.getpid(), signal.SIGKILL)


_from_env()
