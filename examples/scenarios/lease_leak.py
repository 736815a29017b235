"""Scenario: An offload's read lease is never released: its request's blocks stay quarantined.

The example server with `--offload` copies each finished request's K/V to host memory on a
background thread under a read lease, freeing the request at once (the lease keeps its freed
blocks from other requests until the copy is done). With the fault, one copy's completion never
releases its lease (a "finished sending" that never came): the lease outlives its request, and
the pool reports it as lease_leak, naming the offload thread, when the server closes the pool.

kvscope run examples/scenarios/lease_leak.py
"""

import sys

from _scenario import run

sys.exit(run("lease-leak", "--offload"))
