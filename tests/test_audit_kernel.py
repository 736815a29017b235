"""kernels/audit.py: the block-table audit's one launch, against its torch reference (the
Triton cases run on CPU under TRITON_INTERPRET=1, through test_kernels_interpreter.py, and on
CUDA); a CUDA pool's audit end to end (GPU only)."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels.reference import audit_table_ref
from tests.kernels_cases import TRITON_TARGETS


def _cases():
    g = torch.Generator().manual_seed(0)
    expected = torch.randint(0, 50, (9, 5), generator=g, dtype=torch.int32)
    expected[6:] = -1
    same = expected.clone()
    one = expected.clone()
    one[7, 2] = 13  # a padding row's entry
    many = expected.clone()
    many[1, 4] = -1
    many[3, 0] += 1
    many[3, 1] += 1
    many[8, :] = 0
    # (table, expected, answer: bad, first, found, bad rows)
    return [
        (same, expected, [0, 45, 0, 0]),
        (one, expected, [1, 37, 13, 1]),
        (many, expected, [8, 9, -1, 3]),
        (many.long(), expected, [8, 9, -1, 3]),
    ]


def test_the_reference_answers():
    for table, expected, want in _cases():
        answer = torch.empty(4, dtype=torch.int64)
        audit_table_ref(table, expected, answer)
        assert answer.tolist() == want


@pytest.mark.parametrize("device", TRITON_TARGETS)
@pytest.mark.parametrize("rows,width", [(9, 5), (1, 1), (130, 72), (3, 300)])
def test_the_kernel_agrees_with_the_reference(monkeypatch, device, rows, width):
    # GIVEN tables of several shapes (one row, more rows than one tile, wide rows), some equal
    # to the expected one and some with scattered differences, on the Triton backend
    from kvscope.kernels.audit import audit_table

    monkeypatch.setenv("KVSCOPE_KERNELS", "triton")
    g = torch.Generator().manual_seed(rows * 1000 + width)
    expected = torch.randint(-1, 500, (rows, width), generator=g, dtype=torch.int32)
    tables = [expected.clone()]
    bad = expected.clone().view(-1)
    for i in torch.randint(0, rows * width, (5,), generator=g).tolist():
        bad[i] += 7
    tables.append(bad.view(rows, width))
    if rows > 1:
        tail = expected.clone()
        tail[-1, -1] = -5
        tables.append(tail)
    for table in tables:
        want = torch.empty(4, dtype=torch.int64)
        audit_table_ref(table, expected, want)
        # WHEN the kernel compares them (one launch)
        answer = torch.full((4,), 99, dtype=torch.int64, device=device)
        audit_table(table.to(device), expected.to(device), answer)
        # THEN its answer is the reference's, with no buffer zeroed first
        assert answer.cpu().tolist() == want.tolist()


@pytest.mark.gpu
def test_a_cuda_pools_audit_reports_a_stale_padding_row(make_pool):
    # GIVEN a CUDA pool, two sequences and a device table whose padding row keeps b's blocks
    pool = make_pool(32, device="cuda")
    a = pool.allocate("a", list(range(10)))
    b = pool.allocate("b", list(range(100, 105)))
    table = torch.full((4, 4), -1, dtype=torch.int32)
    table[0, :3] = torch.tensor(a.block_table)
    table[1, :2] = torch.tensor(b.block_table)
    dev = table.cuda()
    # WHEN the true table is audited, then one with b's row left in a padding row
    assert pool.audit_block_table(dev, rows=[a, b], wait=True) == []
    dev[3, :2] = dev[1, :2]
    found = pool.audit_block_table(dev, rows=[a, b], wait=True)
    # THEN the device's answer is reported through the core, in the host audit's words
    assert [f.kind for f in found] == ["block_table_mismatch"]
    assert found[0].block == b.block_table[0] and found[0].request == "b"
    assert "padding row 3 entry 0" in found[0].message
    assert [f.kind for f in pool.findings()] == ["block_table_mismatch"]
