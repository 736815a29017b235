"""Process identity: a pid plus its start time, so a reused pid is not mistaken for its holder."""

from __future__ import annotations

import os
import threading
import time

_START_CACHE: dict[int, int] = {}


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])


def my_identity() -> tuple[int, int]:
    """(pid, start time) of this process, cached per pid so a forked child recomputes it."""
    pid = os.getpid()
    if pid not in _START_CACHE:
        _START_CACHE[pid] = start_time(pid)
    return pid, _START_CACHE[pid]


def is_alive(pid: int, start: int) -> bool:
    """True while the process that had this pid and start time still runs (zombies count as dead)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":
        return False
    return start == 0 or int(fields[19]) == start


# /proc/PID/stat state letters, as words.
_STATES = {
    b"R": "running",
    b"S": "sleeping",
    b"D": "in uninterruptible sleep",
    b"T": "stopped",
    b"t": "stopped",
    b"Z": "zombie",
    b"X": "zombie",
    b"I": "idle",
}


def process_state(pid: int) -> str:
    """What a process is doing now (`running`, `sleeping`, `stopped`, ...); '' if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    letter = stat[stat.rindex(b")") + 2 :].split()[0]
    return _STATES.get(letter, letter.decode(errors="replace"))


def now_ns() -> int:
    """Wall-clock time in nanoseconds (comparable across processes)."""
    return time.time_ns()


def thread_id() -> int:
    """Native id of the calling thread."""
    return threading.get_native_id()
