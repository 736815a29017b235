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


# Audits of one table shape in flight at once: a slot's buffers are written again only once
# the audit that used them RING audits before is answered (long since, behind a step each).
RING = 4


class _Slot:
    """One audit's buffers: the expected table (page-locked, and on the device), the device's
    answer and its page-locked copy, the event after them, and what the finding needs."""

    def __init__(self, shape: tuple[int, int], device: torch.device) -> None:
        self.host = torch.empty(shape, dtype=torch.int32, pin_memory=True)
        self.dev = torch.empty(shape, dtype=torch.int32, device=device)
        self.answer = torch.empty(4, dtype=torch.int64, device=device)
        self.back = torch.empty(4, dtype=torch.int64, pin_memory=True)
        self.done = torch.cuda.Event()
        self.requests: list[str] = []
        self.sentinel = -1
        self.pending = False


class DeviceAudits:
    """A CUDA pool's audits: for each table shape a ring of buffers, and the launches whose
    answers are on their way to the host, oldest first."""

    def __init__(self, pool: PoolHandle) -> None:
        self.pool = pool
        self._rings: dict[tuple[int, int], tuple[list[_Slot], list[int]]] = {}
        self._pending: list[_Slot] = []

    def launch(self, table: torch.Tensor, rows: Sequence_[Any], lengths: Any, sentinel: int):
        """The expected table written by the core, uploaded, compared by one launch, the
        answer's copy to the host queued behind it: nothing waited for."""
        from kvscope.kernels.audit import audit_table

        shape = (int(table.shape[0]), int(table.shape[1]))
        ring = self._rings.get(shape)
        if ring is None:
            ring = self._rings[shape] = ([_Slot(shape, table.device) for _ in range(RING)], [0])
        slots, turn = ring
        slot = slots[turn[0] % RING]
        turn[0] += 1
        if slot.pending:
            self.settle(upto=slot)
        with self.pool.op_mutex:
            self.pool.core.audit_table(self.pool, None, rows, lengths, sentinel, slot.host.numpy())
        slot.dev.copy_(slot.host, non_blocking=True)
        audit_table(table if table.is_contiguous() else table.contiguous(), slot.dev, slot.answer)
        slot.back.copy_(slot.answer, non_blocking=True)
        slot.done.record()
        slot.requests = [str(s.request_id) for s in rows]
        slot.sentinel = sentinel
        slot.pending = True
        self._pending.append(slot)

    def settle(self, wait: bool = False, upto: _Slot | None = None) -> list[Finding]:
        """Report the answers that are back (all of them with `wait`; those up to `upto`'s,
        waited for); the findings."""
        out = []
        while self._pending:
            slot = self._pending[0]
            if not (wait or upto is not None or slot.done.query()):
                break
            self._pending.pop(0)
            slot.done.synchronize()
            slot.pending = False
            bad, first, found, bad_rows = (int(x) for x in slot.back.tolist())
            if bad:
                expected = slot.host.numpy()
                out.append(
                    self._finding(
                        expected, slot.requests, slot.sentinel, bad, first, found, bad_rows
                    )
                )
            if slot is upto:
                break
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
