"""Scenario: A request's blocks are freed while its block table is still in use.

kvscope run examples/scenarios/use_after_free.py
"""

import sys

from _scenario import run

sys.exit(run("use-after-free"))
