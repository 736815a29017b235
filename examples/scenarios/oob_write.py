"""Scenario: A KV write runs one slot past the end of a block (caught by guard mode).

kvscope run examples/scenarios/oob_write.py
"""

import sys

from _scenario import run

sys.exit(run("oob-write"))
