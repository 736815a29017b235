"""Scenario: A shorter step's padded block table keeps the rows of an earlier, larger batch
(caught by the block-table audit in guard mode).

kvscope run examples/scenarios/stale_padding_row.py
"""

import sys

from _scenario import run

# the step graphs' static buffers (on the CPU they run eagerly): the padded table the fault needs
sys.exit(run("stale-padding-row", "--cuda-graphs"))
