"""Child processes for the many-process tests: a function run in a forked child, its exit code."""

from __future__ import annotations

import os
import signal
import traceback
from collections.abc import Callable


def fork_child(fn: Callable[[], int], alarm_s: int) -> int:
    """Run fn in a child process; its pid. The child's exit code is fn's result, 1 on an
    exception, and SIGALRM kills it if it is stuck past alarm_s."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.alarm(alarm_s)
        code = fn()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def wait_child(pid: int) -> int:
    """The exit code of a child (negative: the signal that killed it)."""
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def killed_after(fn: Callable[[], object]) -> int:
    """Fork a child that runs fn and then waits, holding what fn returned (its pool handle);
    kill it with SIGKILL once fn is done (a process dead at a moment the test chose); its pid."""
    r, w = os.pipe()

    def work() -> int:
        os.close(r)
        held = fn()
        os.write(w, b"x")
        signal.pause()
        del held
        return 0

    pid = fork_child(work, alarm_s=60)
    os.close(w)
    assert os.read(r, 1) == b"x"
    os.close(r)
    os.kill(pid, signal.SIGKILL)
    assert wait_child(pid) == -signal.SIGKILL
    return pid
