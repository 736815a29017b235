"""The lock watchdog's stack of a holder: the program's own line, not the standard library's
or kvscope's frames it waits in."""

import threading

from kvscope.probes.watchdog import thread_stack


def test_a_thread_waiting_in_a_condition_is_shown_at_the_programs_wait():
    cond, started = threading.Condition(), threading.Event()

    def holder():
        with cond:
            started.set()
            cond.wait(30)  # the program's line the stack ends at

    t = threading.Thread(target=holder)
    t.start()
    try:
        started.wait(30)
        with cond:  # (the holder is inside wait once it let the condition's lock go)
            stack = thread_stack(t.ident)
            cond.notify()
    finally:
        t.join(30)
    assert stack[-1].startswith("test_watchdog_stack.py:") and stack[-1].endswith(" holder")
