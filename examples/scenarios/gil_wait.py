"""Scenario: The pool's core waits for a lock holding the GIL (a thread of this process that
holds the lock could never let it go: caught by lockdep, which sees the GIL).

kvscope run examples/scenarios/gil_wait.py
"""

import sys

from _scenario import run

sys.exit(run("gil-wait"))
