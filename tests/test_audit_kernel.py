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


@pytest.mark.gpu
def test_a_table_audit_captured_in_a_cuda_graph_reports_a_replays_bad_table(make_pool):
    # GIVEN a CUDA pool, two sequences, a static device table and a CUDA graph that captured
    # the table audit's comparison beside a kernel reading the table
    pool = make_pool(32, device="cuda")
    a = pool.allocate("a", list(range(10)))
    b = pool.allocate("b", list(range(100, 105)))
    table = torch.full((4, 4), -1, dtype=torch.int32, device="cuda")
    audit = pool.table_audit(table)
    out = torch.zeros((), dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        audit.launch()
        out.copy_(table.sum())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        audit.launch()
        out.copy_(table.sum())

    def step(rows, fill):
        table.fill_(-1)
        fill(table)
        found = audit.expect(rows)
        graph.replay()
        return found

    def true_rows(t):
        t[0, :3] = torch.tensor(a.block_table)
        t[1, :2] = torch.tensor(b.block_table)

    # WHEN three true steps replay THEN nothing is found
    for _ in range(3):
        assert step([a, b], true_rows) == []
    assert audit.settle(wait=True) == []

    # WHEN a step's padding row keeps b's row while only a is live
    def stale(t):
        true_rows(t)
        t[3, :2] = t[1, :2]
        t[1] = -1

    step([a], stale)
    # THEN the replay's answer, reported when back, names the padding row and b's block
    found = audit.settle(wait=True)
    assert [f.kind for f in found] == ["block_table_mismatch"]
    assert found[0].block == b.block_table[0] and found[0].request == "b"
    assert "padding row 3 entry 0" in found[0].message
    # AND a true step after it finds nothing more
    step([a, b], true_rows)
    assert audit.settle(wait=True) == [] and len(pool.findings()) == 1


@pytest.mark.gpu
def test_a_table_audit_on_the_callers_buffers_reports_the_answer_it_is_handed(make_pool):
    # GIVEN a CUDA pool, two sequences, a static device table, and a table audit whose
    # expected table the caller uploads from its page-locked staging buffer, and whose answer
    # is part of a buffer the caller copies back itself
    from kvscope.allocator import PoolError

    pool = make_pool(32, device="cuda")
    a = pool.allocate("a", list(range(10)))
    b = pool.allocate("b", list(range(100, 105)))
    table = torch.full((4, 4), -1, dtype=torch.int32, device="cuda")
    staging = torch.zeros((4, 4), dtype=torch.int32).pin_memory()
    expected = torch.zeros((4, 4), dtype=torch.int32, device="cuda")
    back = torch.zeros(6, dtype=torch.int64, device="cuda")
    host = torch.zeros(6, dtype=torch.int64).pin_memory()
    audit = pool.table_audit(table, expected=(staging, expected), answer=back[2:])

    def true_rows(t):
        t[0, :3] = torch.tensor(a.block_table)
        t[1, :2] = torch.tensor(b.block_table)

    def stale(t):
        true_rows(t)
        t[3, :2] = t[1, :2]
        t[1] = -1

    def step(rows, fill, hand_over=True):
        table.fill_(-1)
        fill(table)
        before = audit.expect(rows)
        # (the caller's upload, the replay's comparison, the caller's readback behind it)
        expected.copy_(staging, non_blocking=True)
        token = audit.replayed()
        audit.launch()
        host.copy_(back, non_blocking=True)
        torch.cuda.synchronize()
        return before, (audit.answered(token, host.numpy()[2:]) if hand_over else token)

    # WHEN true steps run, their answers handed over THEN nothing is found, nothing pends, and
    # expect wrote the expected table where the caller uploads it
    for _ in range(3):
        assert step([a, b], true_rows) == ([], [])
    assert staging[0, :3].tolist() == a.block_table and staging[3].tolist() == [-1] * 4
    assert not pool.device_audits().pending() and audit.settle(wait=True) == []
    # WHEN a step's padding row keeps b's row while only a is live
    _, found = step([a], stale)
    # THEN the answer handed over is reported at once, naming the padding row and b's block
    assert [f.kind for f in found] == ["block_table_mismatch"]
    assert found[0].block == b.block_table[0] and found[0].request == "b"
    assert "padding row 3 entry 0" in found[0].message
    assert [f.kind for f in pool.findings()] == ["block_table_mismatch"]
    # WHEN a stale step's answer is not handed over before the next expect
    _, token = step([a], stale, hand_over=False)
    before, late = step([a, b], true_rows)
    # THEN the audit copied it back itself and reports it (at that expect, if back by then,
    # or at the settle), and the late token takes nothing
    assert audit.answered(token, host.numpy()[2:]) == [] and late == []
    reported = before + audit.settle(wait=True)
    assert [f.kind for f in reported] == ["block_table_mismatch"]
    # AND a caller's buffer of the wrong kind is refused
    with pytest.raises(PoolError, match="staging"):
        pool.table_audit(table, expected=(expected, expected))
    with pytest.raises(PoolError, match="answer"):
        pool.table_audit(table, answer=back[:2])


@pytest.mark.gpu
def test_cuda_step_graphs_audit_a_stale_padding_row_in_the_replay(make_pool):
    # GIVEN a guard-mode CUDA pool, the tiny model's step graphs captured over it, and a
    # two-row step, then a one-row step with stale-padding-row armed for it
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from server.batch import Batch
    from server.checkpoint import tiny_model
    from server.graphs import StepGraphs
    from server.scheduler import Chunk

    from kvscope.allocator import faults

    model = tiny_model(0).to(device="cuda", dtype=torch.float16).fuse()
    cfg = model.config
    pool = make_pool(
        48, block_size=8, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=torch.float16, guard=True, device="cuda",
    )  # fmt: skip
    graphs = StepGraphs(model, pool, max_seqs=4, max_len=40, max_tokens=64, max_chunk=16)
    assert graphs.audit is not None
    a = SimpleNamespace(seq=pool.allocate("a", list(range(12))), name="a")
    b = SimpleNamespace(seq=pool.allocate("b", list(range(50, 59))), name="b")
    try:
        assert graphs.forward(Batch([Chunk(a, 0, 12), Chunk(b, 0, 9)], pool, "cuda")) is not None
        faults.configure("stale-padding-row:1")
        # WHEN the one-row step replays its graph
        assert graphs.forward(Batch([Chunk(a, 11, 1)], pool, "cuda")) is not None
        assert graphs.num_replays == 2
        # THEN the captured audit's answer names b's row left in padding row 1
        found = graphs.audit.settle(wait=True)
        assert [f.kind for f in found] == ["block_table_mismatch"]
        assert found[0].request == "b" and "padding row 1 entry 0" in found[0].message
    finally:
        faults.configure(None)
