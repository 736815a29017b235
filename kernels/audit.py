"""Block-table audit on the device: a table a kernel will read against the expected one.

`audit_table(table, expected, answer)` compares two `[rows, width]` integer tables on the
device in one launch of one program (it walks the rows a tile at a time: a step's table is a
few thousand entries, and one program needs no answer buffer zeroed first) and writes into
`answer` (int64 `[4]`): the number of entries that differ, the flat index of the first one
(`rows * width` when none), the value the table holds there (0 when none) and the number of
rows with a difference. The expected table comes from the pool's C core (csrc/audit.c writes
it from the sequences' records); allocator/audit.py reads the answer back behind the step and
reports what it shows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend, reference

ANSWER_FIELDS = ("bad", "first", "found", "bad_rows")


@triton.jit
def _audit_kernel(
    table_ptr, expected_ptr, answer_ptr, rows, width,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    total = rows * width
    cols = tl.arange(0, BLOCK_W)
    bad = tl.full([], 0, tl.int64)
    bad_rows = tl.full([], 0, tl.int64)
    first = tl.full([], 0, tl.int64) + total
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        mask = (r[:, None] < rows) & (cols[None, :] < width)
        flat = r[:, None].to(tl.int64) * width + cols[None, :]
        got = tl.load(table_ptr + flat, mask=mask, other=0).to(tl.int64)
        want = tl.load(expected_ptr + flat, mask=mask, other=0).to(tl.int64)
        diff = mask & (got != want)
        bad += tl.sum(diff.to(tl.int64))
        bad_rows += tl.sum((tl.sum(diff.to(tl.int32), axis=1) > 0).to(tl.int64))
        first = tl.minimum(first, tl.min(tl.where(diff, flat, total)))
    found = tl.load(table_ptr + first, mask=first < total, other=0).to(tl.int64)
    tl.store(answer_ptr, bad)
    tl.store(answer_ptr + 1, first)
    tl.store(answer_ptr + 2, found)
    tl.store(answer_ptr + 3, bad_rows)


def audit_table(table: torch.Tensor, expected: torch.Tensor, answer: torch.Tensor) -> None:
    """Compare `table` with `expected` (both `[rows, width]`, contiguous, on one device; any
    integer dtypes) into `answer` (int64 `[4]`, ANSWER_FIELDS); one launch, no host wait."""
    assert table.dim() == 2 and table.shape == expected.shape, (table.shape, expected.shape)
    assert table.is_contiguous() and expected.is_contiguous()
    assert answer.dtype == torch.int64 and answer.numel() >= 4
    if not backend.use_triton(table):
        reference.audit_table_ref(table, expected, answer)
        return
    rows, width = table.shape
    block_w = triton.next_power_of_2(max(width, 1))
    block_r = max(1, min(triton.next_power_of_2(max(rows, 1)), 4096 // block_w))
    _audit_kernel[(1,)](table, expected, answer, rows, width, BLOCK_R=block_r, BLOCK_W=block_w)
