"""The block-table audit's two halves: a table in host memory is compared by the C core in one
call (csrc/audit.c), from the records of the sequences its rows belong to; a table on a CUDA
pool's device is compared there, by one launch (kernels/audit.py) against the expected table
the core writes from the same records, and its answer is read back behind the work queued
after it (no host wait) and reported at the next audit (or `settle(wait=True)`) through the
core's `report`, so every finding of the audit reaches the ring through the core."""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvscope.allocator.findings import Finding, FindingKind

if TYPE_CHECKING:
    from kvscope.allocator.handle import PoolHandle


def host_array(a: Any, what: str) -> Any:
    """A host table or lengths as the core reads them: a numpy array (a CPU tensor's own
    memory, a list made an array), or None."""
    if a is None:
        return None
    if isinstance(a, torch.Tensor):
        if a.is_cuda:
            return a.cpu().numpy()
        return np.ascontiguousarray(a.numpy())
    if isinstance(a, np.ndarray):
        return np.ascontiguousarray(a)
    return a if what == "lengths" else np.asarray(a, dtype=np.int64)


class DeviceAudits:
    """A CUDA pool's audits in flight: the expected table's page-locked and device buffers (one
    pair per shape), and each launch's answer on its way to the host."""

    def __init__(self, pool: PoolHandle) -> None:
        self.pool = pool
        self._buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # (answer in page-locked memory, its event, the rows' requests, the expected table)
        self._pending: list[tuple[torch.Tensor, Any, list[str], np.ndarray, int]] = []

    def launch(self, table: torch.Tensor, rows: Sequence_[Any], lengths: Any, sentinel: int):
        from kvscope.kernels.audit import audit_table

        shape = (int(table.shape[0]), int(table.shape[1]))
        bufs = self._buffers.get(shape)
        if bufs is None:
            host = torch.empty(shape, dtype=torch.int32, pin_memory=True)
            bufs = self._buffers[shape] = (host, torch.empty_like(host, device=table.device))
        host, dev = bufs
        # the last upload from `host` must be done before the core writes it again
        if self._pending:
            self._pending[-1][1].synchronize()
        with self.pool.op_mutex:
            self.pool.core.audit_table(self.pool, None, rows, lengths, sentinel, host.numpy())
        dev.copy_(host, non_blocking=True)
        answer = torch.empty(4, dtype=torch.int64, device=table.device)
        audit_table(table if table.is_contiguous() else table.contiguous(), dev, answer)
        back = torch.empty(4, dtype=torch.int64, pin_memory=True)
        back.copy_(answer, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        requests = [str(s.request_id) for s in rows]
        self._pending.append((back, done, requests, host.numpy().copy(), sentinel))

    def settle(self, wait: bool = False) -> list[Finding]:
        """Report the answers that are back (all of them with `wait`); the findings."""
        out = []
        while self._pending and (wait or self._pending[0][1].query()):
            back, done, requests, expected, sentinel = self._pending.pop(0)
            done.synchronize()
            bad, first, found, bad_rows = (int(x) for x in back.tolist())
            if bad:
                out.append(self._finding(expected, requests, sentinel, bad, first, found, bad_rows))
        for f in out:
            self.pool.report(f)
        return out

    def _finding(
        self, expected: np.ndarray, requests: list[str], sentinel: int,
        bad: int, first: int, found: int, bad_rows: int,
    ) -> Finding:  # fmt: skip
        """csrc/audit.c's finding, in its words, from a device answer."""
        rows, width = expected.shape
        row, col = divmod(first, width)
        want = int(expected[row, col])
        blocks = self.pool.view.blocks
        nb = len(blocks)
        block = found if 0 <= found < nb else want if 0 <= want < nb else None
        owner = request = None
        what = f"{found} (no block of the pool)"
        if block is not None:
            rec = blocks[block]
            owner = int(rec["owner_pid"]) or None
            request = bytes(rec["request"]).decode(errors="replace") or None
        if 0 <= found < nb:
            held = bytes(blocks[found]["request"]).decode(errors="replace")
            what = f"block {found} (held by " + (f"request '{held}')" if held else "no request)")
        counts = f"{bad} bad entries in {bad_rows} row(s) of {rows}x{width}"
        live = len(requests)
        if row >= live:
            msg = (
                f"block table padding row {row} entry {col} is {what}, not the padding "
                f"{sentinel}: a padded lane reads or writes that block; {counts} ({live} live rows)"
            )
        elif want == sentinel:
            msg = (
                f"block table row {row} (request '{requests[row]}') entry {col}, past its "
                f"tokens, is {what}, not the padding {sentinel}; {counts}"
            )
        else:
            msg = (
                f"block table row {row} (request '{requests[row]}') entry {col} is {what}, but "
                f"the sequence holds block {want} there; {counts}"
            )
        return Finding(
            FindingKind.BLOCK_TABLE_MISMATCH, msg, block=block, owner_pid=owner, request=request
        )
