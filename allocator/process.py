"""Process identity: a pid plus its start time, so a reused pid is not mistaken for its holder."""

from __future__ import annotations

import os
import time

_START_CACHE: dict[int, int] = {}


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat from the third (the state letter) on; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    return stat[stat.rindex(b")") + 2 :].split()


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); 0 if gone."""
    fields = _stat(pid)
    return 0 if fields is None else int(fields[19])


def my_identity() -> tuple[int, int]:
    """(pid, start time) of this process, cached per pid so a forked child recomputes it."""
    pid = os.getpid()
    if pid not in _START_CACHE:
        _START_CACHE[pid] = start_time(pid)
    return pid, _START_CACHE[pid]


def is_alive(pid: int, start: int) -> bool:
    """True while the process that had this pid and start time still runs (zombies count as dead)."""
    fields = _stat(pid) if pid > 0 else None
    if fields is None or fields[0] == b"Z":
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
    fields = _stat(pid)
    if fields is None:
        return ""
    return _STATES.get(fields[0], fields[0].decode(errors="replace"))


def is_stopped(pid: int) -> bool:
    """True while the process is stopped (SIGSTOP or a debugger): alive, serving nothing until
    it is continued."""
    return process_state(pid) == "stopped"


def now_ns() -> int:
    """Wall-clock time in nanoseconds (comparable across processes)."""
    return time.time_ns()


def mapping(paths: list[str]) -> list[int]:
    """The pids of the processes (of those this user may look at) that map any of `paths` now
    (/proc/PID/maps): who still uses a pool's files, whatever the pool's format."""
    # (a line's pathname is its last field: matched whole, so that pool 'a' is not in use by
    # whoever maps pool 'ab')
    wanted = {p.encode() for p in paths}
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", "rb") as f:
                maps = f.read()
        except OSError:
            continue
        if any(line.split(maxsplit=5)[5:] == [w] for line in maps.splitlines() for w in wanted):
            out.append(int(entry))
    return sorted(out)
