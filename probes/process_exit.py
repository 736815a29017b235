"""Exit handlers that run in every process of a run, multiprocessing children included.

`atexit` alone misses most multiprocessing children: a child started with fork or forkserver
ends with `os._exit` right after its target returns, so its atexit handlers never run. A spawn
child does run them (it ends with `sys.exit`). `at_exit(func)` registers `func` both ways and
runs it once per process:

    at_exit(check_leaks)   # at interpreter exit, and at the end of each multiprocessing child
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import util as mp_util

# Below every multiprocessing finalizer of the standard library (queues, pools, managers use
# -5 to 10): the exit checks see the process after its own cleanup.
EXIT_PRIORITY = -100


class _Token:
    """The object register_after_fork holds (weakly) for our callbacks: alive as long as we are."""


_TOKEN = _Token()


def at_exit(func: Callable[[], None]) -> None:
    """Run `func` once when this process exits, and once when each multiprocessing child does."""
    once = _once(func)
    atexit.register(once)
    # Called in the child at the start of Process._bootstrap, after it has cleared the
    # finalizers it inherited; the finalizer then runs in util._exit_function when the target
    # returns or raises, before os._exit.
    mp_util.register_after_fork(
        _TOKEN, lambda _: mp_util.Finalize(None, once, exitpriority=EXIT_PRIORITY)
    )
    if multiprocessing.parent_process() is not None:
        # Registered from inside a multiprocessing child's target (a worker that imports
        # kvscope there): its after-fork callbacks have run already, so the finalizer now,
        # which runs as the target returns or raises (with the exception still in hand).
        mp_util.Finalize(None, once, exitpriority=EXIT_PRIORITY)


def _once(func: Callable[[], None]) -> Callable[[], None]:
    # A spawn child runs both the finalizer and atexit; a forked child inherits `ran_in`.
    ran_in = [0]

    def run() -> None:
        if ran_in[0] == os.getpid():
            return
        ran_in[0] = os.getpid()
        func()

    return run
