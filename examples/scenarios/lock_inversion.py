"""Scenario: An operation takes two pool locks in the opposite order (a deadlock waiting to happen).

kvscope run examples/scenarios/lock_inversion.py
"""

import sys

from _scenario import run

sys.exit(run("lock-inversion"))
