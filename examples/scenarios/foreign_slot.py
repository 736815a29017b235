"""Scenario: A late store writes one request's K/V into a slot of another request's published
block (caught by slot provenance: at the next prefix hit on it, or the guard-mode sweep).

Under `kvscope run` (guard mode) the pool records every sequence's slot provenance: the
request, position and token each slot was handed out to write. With the fault, one decode
step's write also lands in a slot of a published block its request does not hold, as an
offload connector's store under a stale key does: the block's tokens say one thing, the slot's
K/V another. The example server's guard-mode sweep of each step's sequences, or the next prefix
hit on that block, reports it as foreign_slot, naming the request that reads the slot and the
one that wrote it.

kvscope run examples/scenarios/foreign_slot.py
"""

import os
import sys

from _scenario import run

# (kvscope run sets it in guard mode; outside it, every sequence's slots recorded too)
os.environ.setdefault("KVSCOPE_PROVENANCE_SAMPLE", "1")
sys.exit(run("foreign-slot"))
