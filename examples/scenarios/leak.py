"""Scenario: A request ends but one of its blocks is never returned to the pool.

kvscope run examples/scenarios/leak.py
"""

import sys

from _scenario import run

sys.exit(run("leak"))
