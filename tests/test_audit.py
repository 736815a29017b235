"""pool.audit_block_table: the table a kernel will read, the whole buffer, against the pool's
own tables (csrc/audit.c on a host table; the example engine's guard-mode call sites)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvscope.allocator import PoolError, faults
from kvscope.allocator.findings import FindingKind

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

KIND = FindingKind.BLOCK_TABLE_MISMATCH.value


def _two(pool):
    """A sequence of 10 tokens (3 blocks of 4) and one of 5 (2 blocks)."""
    a = pool.allocate("a", list(range(10)))
    b = pool.allocate("b", list(range(100, 105)))
    return a, b


def _table(rows, width, *seqs, dtype=np.int32):
    t = np.full((rows, width), -1, dtype=dtype)
    for i, s in enumerate(seqs):
        t[i, : len(s.block_table)] = s.block_table
    return t


@pytest.mark.parametrize("kind", ["int32", "int64", "torch"])
def test_a_true_table_with_padding_rows_has_no_finding(make_pool, kind):
    # GIVEN two sequences and the whole 4x4 buffer a captured kernel reads: their rows, then
    # two padding rows, everything else -1, as numpy int32, int64 or a CPU tensor
    pool = make_pool(32)
    a, b = _two(pool)
    t = _table(4, 4, a, b, dtype=np.int64 if kind == "int64" else np.int32)
    table = torch.from_numpy(t) if kind == "torch" else t
    # WHEN audited THEN nothing is found, in the call or in the ring
    assert pool.audit_block_table(table, rows=[a, b]) == []
    assert pool.findings() == []


def test_a_stale_padding_row_is_one_finding_naming_the_block_it_would_touch(make_pool):
    # GIVEN a buffer whose padding rows keep an earlier, larger batch's rows (b's blocks, and a
    # block of a), with the handle's findings watched
    pool = make_pool(32)
    a, b = _two(pool)
    seen = []
    pool.on_finding = seen.append
    t = _table(4, 4, a, b)
    t[2, :2] = b.block_table
    t[3, 0] = a.block_table[1]
    # WHEN the audit is told only a is live
    found = pool.audit_block_table(t, rows=[a])
    # THEN one finding, about the first bad entry (padding row 1's first entry: b's block),
    # naming its holder, with the count of every bad entry
    assert [f.kind for f in found] == [KIND]
    f = found[0]
    assert f.block == b.block_table[0] and f.request == "b" and f.owner_pid == pool.pid
    assert "padding row 1 entry 0" in f.message and "held by request 'b'" in f.message
    assert "5 bad entries in 3 row(s) of 4x4 (1 live rows)" in f.message
    assert [x.kind for x in seen] == [KIND] and [x.kind for x in pool.findings()] == [KIND]


def test_a_hit_and_a_miss_row_padded_with_zeros_is_caught(make_pool):
    # GIVEN a prefix hit holding 4 blocks and a miss sequence beside it, the table built as
    # [[1, 2, 3, 4], [0, 0, 0, 0]] (block ids as the hit holds them, zeros for the miss)
    pool = make_pool(32)
    hit = pool.allocate("hit", list(range(16)))
    miss = pool.allocate("miss", list(range(200, 203)))
    t = np.array([hit.block_table, [0, 0, 0, 0]], dtype=np.int32)
    # WHEN audited THEN the miss row's entry 0 (block 0, not the block the miss holds) is named
    (f,) = pool.audit_block_table(t, rows=[hit, miss])
    assert "row 1 (request 'miss') entry 0" in f.message
    assert f"holds block {miss.block_table[0]} there" in f.message
    assert f.block == 0
    # AND as a padding row beside the hit alone it is caught too (0 is no padding: block 0)
    other = make_pool(32)
    hit = other.allocate("hit", list(range(16)))
    t = np.array([hit.block_table, [0, 0, 0, 0]], dtype=np.int32)
    (g,) = other.audit_block_table(t, rows=[hit])
    assert g.block == 0 and "padding row 1 entry 0 is block 0" in g.message


def test_entries_past_a_rows_length_must_be_the_padding(make_pool):
    # GIVEN a's table written whole, but the kernel reads only its first 4 tokens (one block)
    pool = make_pool(32)
    a, b = _two(pool)
    t = _table(2, 4, a, b)
    # WHEN audited with those lengths
    (f,) = pool.audit_block_table(t, rows=[a, b], lengths=[4, 5])
    # THEN a's second entry is past its length
    assert "row 0 (request 'a') entry 1, past its 4 tokens" in f.message
    assert f.block == a.block_table[1]
    # AND with the table cut at the length there is nothing (lengths as an array too)
    t[0, 1:] = -1
    assert pool.audit_block_table(t, rows=[a, b], lengths=np.array([4, 5])) == []


def test_live_entries_out_of_order_are_named_with_the_block_the_sequence_holds(make_pool):
    pool = make_pool(32)
    a, b = _two(pool)
    t = _table(2, 4, a, b)
    t[0, [0, 1]] = t[0, [1, 0]]
    (f,) = pool.audit_block_table(t, rows=[a, b])
    assert f"entry 0 is block {a.block_table[1]}" in f.message
    assert f"holds block {a.block_table[0]} there" in f.message
    assert "2 bad entries in 1 row(s)" in f.message


def test_the_same_bad_block_is_reported_once(make_pool):
    # GIVEN a stale padding row audited at every step
    pool = make_pool(32)
    a, b = _two(pool)
    t = _table(3, 4, a, b)
    t[2, 0] = a.block_table[0]
    # WHEN audited twice THEN one finding in the ring (once per kind and block, as every finding)
    assert len(pool.audit_block_table(t, rows=[a, b])) == 1
    assert pool.audit_block_table(t, rows=[a, b]) == []
    assert [f.kind for f in pool.findings()] == [KIND]


def test_bad_arguments_are_one_pool_error_each(make_pool):
    pool = make_pool(32)
    a, b = _two(pool)
    t = _table(2, 4, a, b)
    with pytest.raises(PoolError, match="padding 0 is block 0"):
        pool.audit_block_table(t, rows=[a, b], padding=0)
    with pytest.raises(PoolError, match="3 rows for a table of 2 rows"):
        pool.audit_block_table(t, rows=[a, b, a])
    with pytest.raises(PoolError, match="past the blocks the sequence holds"):
        pool.audit_block_table(t, rows=[a, b], lengths=[10, 9])
    with pytest.raises(PoolError, match="past the table's width"):
        pool.audit_block_table(t[:, :2].copy(), rows=[a, b])
    with pytest.raises(PoolError, match="2-dimensional"):
        pool.audit_block_table(t[0].copy(), rows=[a])
    with pytest.raises(PoolError, match="integers"):
        pool.audit_block_table(t.astype(np.float32), rows=[a, b])
    with pytest.raises(PoolError, match="lengths: 1 for 2 rows"):
        pool.audit_block_table(t, rows=[a, b], lengths=[4])
    pool.free(b)
    with pytest.raises(PoolError, match="already finished"):
        pool.audit_block_table(t, rows=[a, b])
    assert pool.findings() == []


@pytest.fixture
def tiny(pools_made):
    from server.checkpoint import tiny_model

    torch.set_num_threads(1)
    return tiny_model(0)


@pytest.fixture
def pools_made(make_pool):
    return make_pool


def _guard_pool(make_pool, model, num_blocks=48):
    cfg = model.config
    return make_pool(
        num_blocks, block_size=8, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, dtype=model.lm_head.weight.dtype, guard=True,
    )  # fmt: skip


def test_the_step_graphs_padding_rows_are_audited_under_the_fault(make_pool, tiny):
    # GIVEN a guard-mode pool, step graphs over it (on the CPU: their static buffers, eagerly),
    # and a two-row step, then a one-row step with stale-padding-row armed for it
    from server.batch import Batch
    from server.graphs import StepGraphs
    from server.scheduler import Chunk

    pool = _guard_pool(make_pool, tiny)
    graphs = StepGraphs(tiny, pool, max_seqs=4, max_len=40, max_tokens=64, max_chunk=16)
    a = SimpleNamespace(seq=pool.allocate("a", list(range(12))), name="a")
    b = SimpleNamespace(seq=pool.allocate("b", list(range(50, 59))), name="b")
    try:
        assert graphs.forward(Batch([Chunk(a, 0, 12), Chunk(b, 0, 9)], pool, "cpu")) is not None
        assert pool.findings() == []
        faults.configure("stale-padding-row:1")
        # WHEN the one-row step runs through the graphs
        assert graphs.forward(Batch([Chunk(a, 11, 1)], pool, "cpu")) is not None
        # THEN the fault fired once and the audit found b's row left in padding row 1
        assert faults.FIRED[-1] == "stale-padding-row" and not faults.ARMED
        (f,) = pool.findings()
        assert f.kind == KIND and f.request == "b" and "padding row 1 entry 0" in f.message
        # AND the next step resets the padding: nothing more
        assert graphs.forward(Batch([Chunk(a, 11, 1)], pool, "cpu")) is not None
        assert len(pool.findings()) == 1
    finally:
        faults.configure(None)


def test_an_eager_guarded_step_audits_its_group_tables(make_pool, tiny, monkeypatch):
    # GIVEN a guard-mode pool and an eager decode step whose table builder writes a's first
    # block where b's last belongs (a bug planted in the engine)
    from server.batch import Batch
    from server.scheduler import Chunk

    pool = _guard_pool(make_pool, tiny)
    a = SimpleNamespace(seq=pool.allocate("a", list(range(12))), name="a")
    b = SimpleNamespace(seq=pool.allocate("b", list(range(50, 59))), name="b")
    built = Batch.host_tables

    def stale(self, rows, width):
        t = built(self, rows, width)
        t[-1, -1] = a.seq.block_table[0]
        return t

    monkeypatch.setattr(Batch, "host_tables", stale)
    batch = Batch([Chunk(a, 11, 1), Chunk(b, 8, 1)], pool, "cpu")
    # WHEN its decode tables are built for the forward
    tables, _ = batch.decode
    assert tables.shape == (2, 2)
    # THEN the audit names the entry
    (f,) = pool.findings()
    assert f.kind == KIND and "row 1 (request 'b') entry 1 is block" in f.message
    assert f"holds block {b.seq.block_table[1]} there" in f.message


def test_a_table_audit_of_a_host_table_audits_at_expect(make_pool):
    # GIVEN a table audit of a host buffer (nothing to capture: launch does nothing)
    pool = make_pool(32)
    a, b = _two(pool)
    t = _table(4, 4, a, b)
    audit = pool.table_audit(torch.from_numpy(t))
    audit.launch()
    # WHEN the true table is expected THEN nothing is found
    assert audit.expect([a, b]) == [] and audit.settle(wait=True) == []
    # WHEN a padding row takes b's row and the step expects only a
    t[3, :2] = b.block_table
    (f,) = audit.expect([a])
    # THEN the audit of audit_block_table reports it at once
    assert f.kind == KIND and "padding row 1 entry 0" in f.message
    assert [x.kind for x in pool.findings()] == [KIND]


def test_a_table_audit_refuses_a_table_that_is_not_two_dimensional_integers(make_pool):
    pool = make_pool(32)
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2)):
        with pytest.raises(PoolError, match="2-dimensional integer tensor"):
            pool.table_audit(bad)


@pytest.mark.parametrize("sites", [True, False])
def test_a_mismatch_names_the_line_that_audited_the_table(make_pool, monkeypatch, sites):
    # GIVEN a pool whose ownership probe records call sites (as under kvscope run), or not
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1" if sites else "0")
    pool = make_pool(32)
    a, b = _two(pool)
    t = _table(2, 4, a, b)
    t[1, 3] = a.block_table[0]  # (past b's 5 tokens: not the padding)
    # WHEN the table is audited
    (f,) = pool.audit_block_table(t, rows=[a, b])
    # THEN the finding says where the program audited it, where sites are recorded
    here = f"test_audit.py:{sys._getframe().f_lineno - 2} "
    assert ("; audited at " in f.message and here in f.message) is sites
