"""Scenario: A reference is taken twice, so the refcount disagrees with the tables.

kvscope run examples/scenarios/refcount_skew.py
"""

import sys

from _scenario import run

sys.exit(run("refcount-skew"))
