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

    The copy is queued right after the forward's launch and waited for once the step's sampled
    tokens are read back, which waits for the forward anyway: reading it at once would stop the
    host until the GPU is done, so none of the step's host work would overlap the forward.
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
        # once: its error buffer and the audit's answer words (numpy)
        self.whole: tuple[Tensor | None, Tensor | None, Any] = (None, None, None)
        # the audit and the token of the answer the copy under way brings back (None: none)
        self.answering: tuple[Any, int] | None = None

    def start(self, batch: Batch) -> None:
        """Queue the copy of the error buffer `batch`'s kernels write (the last one taken); of
        a graph step, the readback that holds it, the block-table audit's answer with it."""
        assert self.batch is None, "the last step's violations were not taken"
        self.answering = None
        if batch.readback is None:
            self.host = self.copy.start(batch.guard["errors"])
        else:
            readback, token = batch.readback
            whole = self.copy.start(readback.buffer)
            if self.whole[0] is not whole:
                at = readback.answer_at
                words = whole.numpy()[at : at + 8].view(np.int64) if at >= 0 else None
                self.whole = (whole, whole[: readback.errors], words)
            self.host = self.whole[1]
            if token and self.whole[2] is not None:
                self.answering = (readback.audit, token)
        self.batch = batch

    def take(self, copied: bool = False) -> tuple[Batch, list[dict[str, Any]]] | None:
        """The step whose copy is under way and its violations (once copied), or None. The
        block-table audit's answer that came back with them is handed to the audit, which
        reports a finding at once. `copied`: the caller waited for a copy it queued on the
        same stream after `start` (the step's sampled tokens): no wait of its own."""
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
