"""Scenario: A block is released twice: the second release finds it already free.

kvscope run examples/scenarios/double_free.py
"""

import sys

from _scenario import run

sys.exit(run("double-free"))
