"""Guard mode's kernel violations in the example server: a step's error buffer brought to the
host behind the step (`ErrorCopy`), and each access the kernels skipped reported as a finding
(`report`)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvscope import kernels
from kvscope.allocator import Finding, FindingKind

from .batch import Batch
from .hostcopy import HostCopy


class ErrorCopy:
    """Guard mode: a step's error buffer copied to the host behind its forward.

    The copy is queued behind the forward's launch and waited for once the step's sampled
    tokens are read back, which waits for the forward anyway: reading it at once would stop the
    host until the GPU is done, so none of the step's host work would overlap the forward.

    A step the graphs ran brings back its whole readback (graphs.Readback) in one copy, queued
    at `flush` rather than at `start`: the engine writes a greedy step's sampled tokens into the
    readback first (`picks`), so that they come back in the same copy, one copy and one event
    a step fewer for the host to queue. The engine flushes before it queues any other copy to
    the host (`take(copied=True)` counts on the error buffer's copy being queued before the copy
    it waited for).
    """

    def __init__(self, device: torch.device) -> None:
        self.copy = HostCopy(device)
        self.host: Tensor | None = None
        # the host buffer and its numpy view (the count is read at every step: numpy's index
        # costs the host a tenth of a tensor's)
        self.counted: tuple[Tensor | None, Any] = (None, None)
        # the step whose copy is under way (None: nothing to report)
        self.batch: Batch | None = None
        # a graph step's readback (graphs.Readback) copied whole, and the views of it made
        # once: its error buffer, the audit's answer words and the picks' words (numpy)
        self.whole: tuple[Tensor | None, Tensor | None, Any, Any] = (None, None, None, None)
        # the audit and the token of the answer the copy under way brings back (None: none)
        self.answering: tuple[Any, int] | None = None
        # the readback of the step started whose copy is not queued yet (`flush`)
        self.held: Any = None

    def start(self, batch: Batch) -> None:
        """Take on the error buffer `batch`'s kernels write (the last one taken): its copy
        queued now; of a graph step, the readback that holds it, the block-table audit's answer
        with it, queued at `flush`."""
        assert self.batch is None, "the last step's violations were not taken"
        self.answering = None
        if batch.readback is None:
            self.host = self.copy.start(batch.guard["errors"])
        else:
            readback, token = batch.readback
            self.held = readback
            if token and readback.answer_at >= 0:
                self.answering = (readback.audit, token)
        self.batch = batch

    def picks(self, count: int) -> Tensor | None:
        """Where `count` sampled tokens (int64) join the held readback's copy, on the device
        (None: no copy held, or no room): the caller writes them there, then calls `flush`."""
        readback = self.held
        if readback is None or not 0 < count <= readback.max_picks:
            return None
        return readback.picks[:count]

    def flush(self) -> Any:
        """Queue the held readback's copy (nothing when none is held); the numpy int64 view of
        its picks' words on the host (None: nothing queued, or no room for picks), read once
        the copy is done (`wait`)."""
        readback = self.held
        if readback is None:
            return None
        self.held = None
        whole = self.copy.start(readback.buffer)
        if self.whole[0] is not whole:
            words = whole.numpy()
            at, picks_at = readback.answer_at, readback.picks_at
            answer = words[at : at + 8].view(np.int64) if at >= 0 else None
            picks = words[picks_at:].view(np.int64) if picks_at >= 0 else None
            self.whole = (whole, whole[: readback.errors], answer, picks)
        self.host = self.whole[1]
        return self.whole[3]

    def wait(self) -> None:
        """Until the last copy queued is on the host."""
        self.copy.wait()

    def take(self, copied: bool = False) -> tuple[Batch, list[dict[str, Any]]] | None:
        """The step whose copy is under way and its violations (once copied), or None. The
        block-table audit's answer that came back with them is handed to the audit, which
        reports a finding at once. `copied`: the caller waited for a copy it queued on the
        same stream after the error buffer's (the step's sampled tokens): no wait of its
        own."""
        if self.held is not None:
            self.flush()  # (a step whose copy was never flushed: queued now, waited for)
            copied = False
        batch, self.batch = self.batch, None
        if batch is None or self.host is None:
            return None
        if not copied:
            self.copy.wait()
        if self.answering is not None:
            audit, token = self.answering
            self.answering = None
            audit.answered(token, self.whole[2])
        if self.counted[0] is not self.host:
            self.counted = (self.host, self.host.numpy())
        if not self.counted[1][0]:
            return batch, []  # (nothing recorded: the common case, read without decoding)
        return batch, kernels.decode_errors(self.host)


def report(cache: Any, batch: Batch, violations: list[dict[str, Any]]) -> None:
    """Guard mode: each out-of-bounds or freed-block access the kernels skipped is a finding."""
    probe = getattr(cache, "probe", None)
    if probe is None:
        return  # (a pool without probes: nowhere to report)
    for v in violations:
        blk = int(v["physical_block"])
        kind = (
            FindingKind.USE_AFTER_FREE
            if v["kind"] == "not_allocated"
            else FindingKind.OUT_OF_BOUNDS
        )
        message = (
            f"a kernel was asked to touch block {blk} ({v['kind']}, logical block "
            f"{v['logical_block']}, slot {v['slot']}); the access was skipped"
        )
        # Named after the request of this batch whose block table holds the block (the
        # one using it), not after the block's last owner.
        tables = zip(batch.chunks, batch.tables, strict=True)
        user = next((c.stream.name for c, table in tables if blk in table), None)
        block = blk if 0 <= blk < cache.config.num_blocks else None
        probe.report(Finding(kind, message, block=block, owner_pid=os.getpid(), request=user))
