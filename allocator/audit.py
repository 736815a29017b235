"""The block-table audit's two halves: a table in host memory is compared by the C core in one
call (csrc/audit.c), from the records of the sequences its rows belong to; a table on a CUDA
pool's device is compared there, by one launch (kernels/audit.py) against the expected table
the core writes from the same records, and its answer is read back behind the work queued
after it (no host wait) and reported at the next audit (or `settle(wait=True)`) through the
core's `report`, so every finding of the audit reaches the ring through the core.

A `TableAudit` (`KVPool.table_audit`) is the same audit of one static table that a CUDA graph
replays: its comparison is captured with the forward that reads the table, and each step only
writes the expected table and queues its upload (no launch of its own)."""

from __future__ import annotations

from collections.abc import Sequence as Sequence_
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvscope.allocator.errors import PoolError
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


def check_table(table: torch.Tensor) -> None:
    """A tensor table must be two-dimensional integers: a PoolError otherwise."""
    if table.dim() != 2 or table.dtype.is_floating_point or table.dtype == torch.bool:
        raise PoolError(
            f"table: expected a 2-dimensional integer tensor, got {table.dim()} "
            f"dimension(s) of {table.dtype}"
        )


# Audits of one table shape in flight at once: a slot's buffers are written again only once
# the audit that used them RING audits before is answered (long since, behind a step each).
RING = 4


class _Slot:
    """One audit's buffers: the expected table (page-locked, and on the device: a TableAudit's
    slots share its static one), the device's answer (likewise) and its page-locked copy, the
    event after them, and what the finding needs."""

    def __init__(
        self, shape: tuple[int, int], device: torch.device, dev: Any = None, answer: Any = None
    ) -> None:
        self.host = torch.empty(shape, dtype=torch.int32, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(shape, dtype=torch.int32, device=device) if dev is None else dev
        self.answer = torch.empty(4, dtype=torch.int64, device=device) if answer is None else answer
        self.back = torch.empty(4, dtype=torch.int64, pin_memory=True)
        self.done = torch.cuda.Event()
        # the rows' sequences (their request ids read only for a finding)
        self.rows: list[Any] = []
        self.sentinel = -1
        self.pending = False

    def requests(self) -> list[str]:
        return [str(s.request_id) for s in self.rows]


class DeviceAudits:
    """A CUDA pool's audits: for each table shape a ring of buffers, and the launches whose
    answers are on their way to the host, oldest first."""

    def __init__(self, pool: PoolHandle) -> None:
        self.pool = pool
        self._rings: dict[tuple[int, int], tuple[list[_Slot], list[int]]] = {}
        self._pending: list[_Slot] = []
        # the table audits a graph replays (their last expected table's answer is collected
        # by a waiting settle)
        self.tables: list[TableAudit] = []

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
        self.expect(slot, rows, lengths, sentinel)
        audit_table(table if table.is_contiguous() else table.contiguous(), slot.dev, slot.answer)
        slot.back.copy_(slot.answer, non_blocking=True)
        slot.done.record()
        self.queue(slot)

    def expect(
        self, slot: _Slot, rows: Sequence_[Any], lengths: Any, sentinel: int, staging: Any = None
    ) -> None:
        """The expected table of `rows` written by the core into the slot, its upload queued
        (with `staging`, a numpy view of the page-locked buffer a caller uploads to the slot's
        device table with its own transfer: written there instead, no upload queued; the
        slot's own copy is made only where its answer is read after a later expect:
        TableAudit.collect)."""
        with self.pool.op_mutex:
            out = slot.host_np if staging is None else staging
            self.pool.core.audit_table(self.pool, None, rows, lengths, sentinel, out)
        if staging is None:
            slot.dev.copy_(slot.host, non_blocking=True)
        slot.rows = list(rows)
        slot.sentinel = sentinel

    def settle(self, wait: bool = False, upto: _Slot | None = None) -> list[Finding]:
        """Report the answers that are back (all of them with `wait`; those up to `upto`'s,
        waited for); the findings."""
        if wait:
            for audit in self.tables:
                audit.collect()
        out = []
        while self._pending:
            slot = self._pending[0]
            if not (wait or upto is not None or slot.done.query()):
                break
            self._pending.pop(0)
            slot.done.synchronize()
            slot.pending = False
            finding = self.answer(slot, slot.back.tolist())
            if finding is not None:
                out.append(finding)
            if slot is upto:
                break
        for f in out:
            self.pool.report(f)
        return out

    def answer(
        self, slot: _Slot, words: Sequence_[int], expected: np.ndarray | None = None
    ) -> Finding | None:
        """The finding of a slot's answer (its 4 words, on the host; `expected`: the table it
        was compared with, where not the slot's own copy), None when the table was the
        expected one."""
        bad, first, found, bad_rows = (int(x) for x in words[:4])
        if not bad:
            return None
        table = slot.host_np if expected is None else expected
        return self._finding(table, slot.requests(), slot.sentinel, bad, first, found, bad_rows)

    def pending(self) -> bool:
        """Whether any answer is on its way to the host."""
        return bool(self._pending)

    def queue(self, slot: _Slot) -> None:
        """A slot whose answer's copy is queued: reported once it is back."""
        slot.pending = True
        self._pending.append(slot)

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


class TableAudit:
    """The audit of one static table a CUDA graph reads (`KVPool.table_audit`): `launch` is the
    comparison, called where the forward that reads the table is captured (it becomes part of
    the graph: no launch of its own at a replay); `expect` writes the expected table of the
    step about to replay and queues its upload. The answer of a replay is copied back when the
    next step's `expect` (or a waiting settle) is called, behind that replay, and reported when
    it is back. With a table in host memory there is nothing to capture: `launch` does
    nothing and `expect` is `audit_block_table`.

    A caller that moves buffers between host and device at every step anyway (the example
    server's step graphs) can carry the audit's too, saving a copy and its bookkeeping each:
    `expected=(staging, device)`, the expected table's page-locked host buffer and the device
    buffer the comparison reads (both int32 of the table's shape), which the caller uploads
    after each `expect` with its own transfer; `answer`, the device buffer (int64 [4]) the
    comparison writes, which the caller copies back behind the replay with its own readback
    and hands over, once on the host, to `answered` (with the token `replayed` gave).
    """

    def __init__(
        self, pool: Any, table: Any, padding: int, expected: Any = None, answer: Any = None
    ) -> None:
        self.pool = pool
        self.padding = padding
        self.cuda = isinstance(table, torch.Tensor) and table.is_cuda
        if isinstance(table, torch.Tensor):
            check_table(table)
        self.table = table
        if not self.cuda:
            return
        if not table.is_contiguous():
            raise PoolError("table: a graph's static table must be contiguous")
        shape = (int(table.shape[0]), int(table.shape[1]))
        # the graph's static buffers: the expected table it reads, the answer it writes
        # (the caller's, where it moves them itself)
        self.staging: np.ndarray | None = None
        if expected is None:
            self.expected = torch.full(shape, padding, dtype=torch.int32, device=table.device)
        else:
            staging, self.expected = expected
            _check_buffer("expected", self.expected, torch.int32, shape, table.device)
            _check_buffer("the expected table's staging", staging, torch.int32, shape, None)
            self.staging = staging.numpy()
        if answer is None:
            self.answer = torch.zeros(4, dtype=torch.int64, device=table.device)
        else:
            _check_buffer("answer", answer, torch.int64, (4,), table.device)
            self.answer = answer
        self.slots = [_Slot(shape, table.device, self.expected, self.answer) for _ in range(RING)]
        self.turn = 0
        # the slot whose expected table the graph replayed (or is about to): its answer not yet
        # copied back
        self.replaying: _Slot | None = None
        self.audits: DeviceAudits = pool.device_audits()
        self.audits.tables.append(self)

    def launch(self) -> None:
        """The comparison of the table with the expected one into the answer (on CUDA; captured
        with the forward, or run eagerly where the forward is)."""
        if self.cuda:
            from kvscope.kernels.audit import audit_table

            audit_table(self.table, self.expected, self.answer)

    def expect(self, rows: Sequence_[Any], lengths: Any = None) -> list[Finding]:
        """Before the next replay: the expected table of `rows` (live sequences of the pool's
        handle, reading `lengths` tokens each; as `audit_block_table`) written and its upload
        queued (with `expected`: written into the staging buffer, for the caller's upload).
        The findings reported by this call (an earlier replay's answer that is back; with a
        host table, this table's)."""
        if not self.cuda:
            return self.pool.audit_block_table(self.table, rows, lengths, self.padding)
        # (each test below skips a call in the common case, a caller handing every answer
        # over: nothing to collect, nothing pending; the step's host time is made of such calls)
        if self.replaying is not None:
            self.collect()
        slot = self.slots[self.turn % RING]
        self.turn += 1
        audits = self.audits
        if slot.pending:
            audits.settle(upto=slot)
        found = audits.settle() if audits.pending() else []
        if not isinstance(lengths, list):
            lengths = host_array(lengths, "lengths")
        audits.expect(slot, rows, lengths, self.padding, self.staging)
        self.replaying = slot
        return found

    def replayed(self) -> int:
        """The token of the replay whose expected table the last `expect` wrote (0: none whose
        answer is still to take), for a caller that copies the answer back itself, behind the
        replay (`answer`), to hand to `answered`."""
        return self.turn if self.replaying is not None else 0

    def answered(self, token: int, words: Any) -> list[Finding]:
        """The answer of the replay `token` names (`replayed`), copied to the host by the
        caller behind that replay and waited for (its 4 int64 words): reported now; the
        findings. Nothing when it is no longer the one to take (an `expect` or a waiting
        settle since collected it with a copy of its own, which reports it)."""
        slot = self.replaying
        if slot is None or token != self.turn:
            return []
        self.replaying = None
        if not words[0]:
            return []  # (no bad entry, every step but a broken one's: one word read)
        # (the staging buffer holds that replay's expected table still: no expect since)
        finding = self.audits.answer(slot, words, self.staging)
        if finding is None:
            return []
        self.audits.pool.report(finding)
        return [finding]

    def settle(self, wait: bool = False) -> list[Finding]:
        """Report the answers that are back (with `wait`: the last replay's too, waited for);
        the findings."""
        if not self.cuda:
            return []
        return self.audits.settle(wait=wait)

    def collect(self) -> None:
        """The last replay's answer (not handed over by the caller: `answered`): its copy to
        the host queued (behind that replay)."""
        slot = self.replaying
        if slot is None:
            return
        self.replaying = None
        if self.staging is not None:
            # (its expected table kept for the answer's finding: the next expect writes over
            # the staging buffer)
            np.copyto(slot.host_np, self.staging)
        slot.back.copy_(self.answer, non_blocking=True)
        slot.done.record()
        self.audits.queue(slot)


def _check_buffer(
    what: str, t: Any, dtype: torch.dtype, shape: tuple[int, ...], device: Any
) -> None:
    """A caller's buffer of a TableAudit: a contiguous tensor of `dtype` and `shape`, on
    `device` (None: page-locked host memory); a PoolError otherwise."""
    where = "page-locked host memory" if device is None else str(device)
    ok = isinstance(t, torch.Tensor) and t.dtype == dtype and tuple(t.shape) == shape
    ok = ok and t.is_contiguous()
    ok = ok and (t.is_pinned() if device is None else t.device == device)
    if not ok:
        raise PoolError(
            f"table_audit: {what} must be a contiguous {dtype} tensor of shape {list(shape)} "
            f"in {where}"
        )
