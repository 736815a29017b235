"""Crash recovery, the reading half: which clients are dead, what they left, what their own exit
already said. The writing half (rolling back dead processes' journals, recovering locks dead
processes held, reclaiming a dead client step by step, detaching a client at close) is the C
core's, csrc/recovery.c, which `KVPool.reclaim_dead`, `KVPool.close`, an attach to a full client
table and `kvscope check --repair` call (lifecycle.py).

What is found here without locks is a hint: by the time a reclaimer acts on it another may have
reclaimed a record, and a new process attached into it. So the core runs every step of a
reclaim under every pool lock and first re-verifies that the record still belongs to the same
dead process (csrc/recovery.c `still_dead`: state, pid, start time, attach generation, and
the process gone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvscope.allocator.findings import FindingKind, readable_findings
from kvscope.allocator.layout import BlockState, ClientState, SegmentView, SeqState
from kvscope.allocator.process import is_alive


@dataclass(frozen=True)
class DeadClient:
    """A client record and the identity of the dead process attached in it when it was found."""

    client: int
    pid: int
    start: int
    # The record's attach generation (`attached_ns`, strictly increasing per record): the
    # core's reclaim acts only while the record still holds this same identity and the
    # process is gone (csrc/recovery.c still_dead).
    generation: int


def find_dead(view: SegmentView, me: int = -1) -> list[DeadClient]:
    """Client records still marked attached whose process is gone (a hint: re-verify under
    the locks before acting on one)."""
    c = view.clients
    out = []
    for i in np.flatnonzero(c["state"] == ClientState.ATTACHED).tolist():
        pid, start = int(c["pid"][i]), int(c["start"][i])
        if i != me and not is_alive(pid, start):
            out.append(DeadClient(i, pid, start, int(c["attached_ns"][i])))
    return out


def dead_owners(view: SegmentView) -> list[dict[str, Any]]:
    """For each dead client: pid, its live sequences and the blocks it holds."""
    out = []
    b = view.blocks
    seqs = view.seqs
    for c in (d.client for d in find_dead(view)):
        mine = np.flatnonzero((seqs["owner_client"] == c) & (seqs["state"] != SeqState.EMPTY))
        held = np.flatnonzero(
            (b["owner_client"] == c)
            & ((b["state"] == BlockState.ALLOCATED) | (b["state"] == BlockState.LOCAL))
        )
        out.append(
            {
                "client": c,
                "pid": int(view.clients["pid"][c]),
                "sequences": [bytes(seqs["request"][s]).decode(errors="replace") for s in mine],
                "blocks": held.tolist(),
            }
        )
    return out


def said_at_exit(view: SegmentView) -> set[int]:
    """Processes whose own exit (or pool close) recorded what they still held (leak_finished):
    reclaiming it afterwards is the same cause, not a second finding. Nothing when the ring is
    scribbled over (a record of no known kind): it says nothing then."""
    return {
        f.owner_pid
        for f in readable_findings(view)
        if f.kind == FindingKind.LEAK_FINISHED and f.owner_pid is not None
    }
