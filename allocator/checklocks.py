"""The whole-pool check's locks: a pool lock whose holder died, or that a live process has held
too long (from the lock records, with the holder's state)."""

from __future__ import annotations

import numpy as np

from kvscope.allocator.checkreport import Alive
from kvscope.allocator.findings import ERROR, WARNING, Finding, FindingKind
from kvscope.allocator.header import threshold_s
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.probeflags import LOCK_HOLD_ENV
from kvscope.allocator.process import is_alive, process_state


def lock_hold_threshold_s(view: SegmentView) -> float:
    """How long a pool lock may be held before it is a stall (`lock_held_too_long`; seconds,
    0: never): `KVSCOPE_LOCK_HOLD_S` where this process sets it, else the value the pool's
    creator recorded (the lock watchdog's default, 1 s, unless it set the variable;
    probes/watchdog.py; tests/test_pool_snapshots.py compares the two)."""
    return threshold_s(view, LOCK_HOLD_ENV)


def holder_advice(pid: int, state: str) -> str:
    """What a lock held too long by process `pid`, in `state` (process.process_state), asks for."""
    if state == "stopped":
        return (
            f"it is stopped (SIGSTOP or a debugger): every process that needs the lock waits"
            f" until it continues (kill -CONT {pid})"
        )
    if state == "zombie":
        return "it is exiting"
    return f"it is {state or 'gone'}: do not block, sleep or compute long while holding a pool lock"


def held_severity(state: str) -> str:
    """A `lock_held_too_long`'s severity by its holder's state: an error where the holder is
    stopped (the pool is wedged until it continues), else the kind's warning."""
    return ERROR if state == "stopped" else WARNING


def lock_named(message: str) -> str:
    """The pool lock a lock finding's message names (`pool lock 'free' ...`); '' for none."""
    return message.partition("pool lock '")[2].partition("'")[0]


def lock_findings(
    view: SegmentView, alive: Alive = is_alive, now_mono_ns: int | None = None
) -> list[Finding]:
    """From the lock records: a lock whose holder died (`lock_dead_holder`), and on a live copy
    (one that carries the monotonic time it was taken, `taken_mono_ns`, or a live pool read at
    `now_mono_ns`) a lock a live process has held longer than `KVSCOPE_LOCK_HOLD_S`
    (`lock_held_too_long`), with the holder's state.

    A record's `acquired_ns` is the holder's CLOCK_MONOTONIC, comparable with this host's
    clock while it has not rebooted; a dump does not say when it was taken on that clock, so
    stalls are reported on live pools only.
    """
    out = []
    locks = view.locks
    taken_ns = now_mono_ns if now_mono_ns is not None else getattr(view, "taken_mono_ns", None)
    limit_ns = int(lock_hold_threshold_s(view) * 1e9)
    for i in np.flatnonzero(locks["holder_pid"] != 0).tolist():
        pid = int(locks["holder_pid"][i])
        name = bytes(locks["name"][i]).decode(errors="replace")
        if not alive(pid, int(locks["holder_start"][i])):
            out.append(
                Finding(
                    FindingKind.LOCK_DEAD_HOLDER,
                    f"pool lock {name!r} is held by pid {pid}, which died holding it; the next process to take it rolls back its journal",
                    owner_pid=pid,
                    extra={"lock": name},
                )
            )
            continue
        held_ns = (taken_ns or 0) - int(locks["acquired_ns"][i])
        if taken_ns is None or limit_ns <= 0 or int(locks["seq"][i]) % 2 == 0 or held_ns < limit_ns:
            continue
        state = process_state(pid)
        why = holder_advice(pid, state)
        out.append(
            Finding(
                FindingKind.LOCK_HELD_TOO_LONG,
                f"pool lock {name!r} held {held_ns / 1e9:.1f} s so far by pid {pid} thread {int(locks['holder_tid'][i])}; {why}",
                owner_pid=pid,
                # (a stopped holder wedges every process that needs the lock until it is
                # continued: an error; one that is slow about it, a warning)
                severity=held_severity(state),
                extra={"lock": name, "held_s": round(held_ns / 1e9, 3), "holder_state": state},
            )
        )
    return out
