"""Scenario: Something overwrites the pool's segment header.

kvscope run examples/scenarios/header_scribble.py
"""

import sys

from _scenario import run

sys.exit(run("header-scribble"))
