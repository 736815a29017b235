"""Scenario: A worker is SIGKILLed while it holds pool locks (kill -9 mid-operation).

kvscope run examples/scenarios/kill_holding_lock.py
"""

import sys

from _scenario import run

sys.exit(run("kill-holding-lock"))
