"""Scenario: Something overwrites a block's header record.

kvscope run examples/scenarios/block_scribble.py
"""

import sys

from _scenario import run

sys.exit(run("block-scribble"))
