"""The writer named at the store (probes/stores.py): a `store_kv` given its `Writers` reports a
write into a published block, a freed block or a block the writer does not map, naming the
writing request and the line that called the store; a correct store is no finding."""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
import torch

from kvscope.allocator import KVPool, PoolConfig
from kvscope.kernels import store_kv
from kvscope.probes.stores import Writers, settle_writes
from tests.forking import fork_child, wait_child

BS = 4
PROMPT = list(range(100, 110))  # two full blocks and a partial one


def store(pool: KVPool, slots, writers: Writers | None) -> int:
    """Every layer's store of one step (K = V = ones); the line of the store_kv call."""
    # (on a CUDA pool: from page-locked memory, as an engine uploads it; no copy that waits)
    host = torch.tensor(slots, dtype=torch.int64)
    if pool.kv.is_cuda:
        host = host.pin_memory()
    mapping = host.to(pool.kv.device, non_blocking=True)
    kv = torch.ones(len(slots), pool.config.num_kv_heads, pool.config.head_dim,
                    dtype=pool.kv.dtype, device=pool.kv.device)  # fmt: skip
    for layer in range(pool.config.num_layers):
        store_kv(kv, kv, pool.kv[layer, 0], pool.kv[layer, 1], mapping, block_size=BS, writers=writers)  # fmt: skip
    return STORE_LINE


STORE_LINE = inspect.getsourcelines(store)[1] + 10


def prefill(pool: KVPool, rid: str, start: int | None = None):
    """Admit a request, store its uncached positions (from `start` when given), publish."""
    seq = pool.allocate(rid, PROMPT)
    first = seq.num_cached_tokens if start is None else start
    end = len(seq.tokens)
    store(pool, pool.slot_mapping(seq, first, end), Writers(pool, [(seq, first, end)]))
    pool.mark_computed(seq, end)
    return seq


def found(pool: KVPool) -> list:
    return [f for f in pool.findings() if f.kind != "leak_finished"]


@pytest.fixture
def pool(make_pool, probes):
    return make_pool(32, num_layers=2)


def test_a_request_that_hit_the_prefix_and_stores_its_whole_prompt_is_named(pool):
    # GIVEN a request that computed and published the shared prefix
    first = prefill(pool, "publisher")
    # WHEN a second request hits it, then stores its whole prompt (the cached blocks too)
    second = prefill(pool, "hitter", start=0)
    # THEN one finding per shared block, named by the writer and the store's line, with the
    # line that called the engine's store helper (the prefill, where the slots were worked
    # out: the frames outside kvscope, up to three)
    shared = first.block_table[:2]
    assert second.block_table[:2] == shared
    (a, b) = found(pool)
    assert {a.block, b.block} == set(shared)
    for f in (a, b):
        assert f.kind == "published_block_modified" and f.request == "hitter"
        at = f"at tests/test_store_writers.py:{STORE_LINE} store <- tests/test_store_writers.py:"
        assert at in f.message and " prefill" in f.message, f.message
        assert "published by request 'publisher'" in f.message


def test_the_same_requests_storing_only_what_they_computed_are_no_finding(pool):
    # GIVEN the same two requests WHEN each stores only its uncached positions, then decodes
    first = prefill(pool, "publisher")
    second = prefill(pool, "hitter")
    for seq in (first, second):
        pool.append(seq, [7])
        n = len(seq.tokens)
        store(pool, pool.slot_mapping(seq, n - 1, n), Writers(pool, [(seq, n - 1, n)]))
    # THEN nothing is reported, and the pool's own check agrees
    assert found(pool) == [] and pool.check() == []


def test_a_slot_in_a_block_of_another_request_is_an_unmapped_write(pool):
    # GIVEN two requests with their own partial last blocks
    first = prefill(pool, "a")
    other = pool.allocate("b", [1, 2, 3])
    # WHEN a's next position is stored into b's block (a slot worked out wrongly)
    pool.append(first, [7])
    n = len(first.tokens)
    wrong = other.block_table[0] * pool.slots_per_block + 3
    line = store(pool, [wrong], Writers(pool, [(first, n - 1, n)]))
    # THEN the writer, not b, is named, at the store's line
    (f,) = found(pool)
    assert (f.kind, f.block, f.request) == ("unmapped_write", other.block_table[0], "a")
    assert f"test_store_writers.py:{line} " in f.message and "request 'b'" in f.message


def test_an_unmapped_write_names_the_sequence_that_maps_the_block_not_its_allocator(pool):
    # GIVEN a request forked once, whose shared partial block the parent's append copied
    parent = pool.allocate("p", [1, 2, 3])
    child = pool.fork(parent, "p/s1")
    shared = parent.block_table[0]
    stale = list(parent.block_table)
    assert pool.append(parent, [7]) == [(shared, parent.block_table[0])]
    # WHEN the parent stores its new token through the table from before the append
    store(pool, [stale[0] * pool.slots_per_block + 3], Writers(pool, [(parent, 3, 4)]))
    # THEN the block is named as held by the fork that maps it, not by the parent, which
    # allocated it (its record's request) and no longer maps it
    (f,) = found(pool)
    assert (f.kind, f.block, f.request) == ("unmapped_write", shared, "p")
    assert f"held by request 'p/s1', pid {os.getpid()})" in f.message
    assert child.block_table == [shared]
    # AND a block no live sequence maps says so, naming the request that allocated it
    gone = pool.allocate("gone", [4, 5, 6])
    kept = gone.block_table[0]
    pool.view.blocks["refcount"][kept] += 1  # a leaked reference keeps it allocated
    pool.free(gone)
    store(pool, [kept * pool.slots_per_block + 3], Writers(pool, [(child, 3, 4)]))
    (g,) = [x for x in found(pool) if x.block == kept and x.kind == "unmapped_write"]
    assert "no live sequence maps it; allocated by request 'gone'" in g.message


def test_an_unmapped_write_into_a_forks_sibling_names_the_sibling_sequence(pool):
    # GIVEN a request sampled twice under its own id (forks sharing it), whose shared partial
    # block the parent's append copied
    parent = pool.allocate("p", [1, 2, 3])
    child = pool.fork(parent, "p")
    shared = parent.block_table[0]
    stale = list(parent.block_table)
    pool.append(parent, [7])
    # WHEN the parent stores its new token through the table from before the append
    store(pool, [stale[0] * pool.slots_per_block + 3], Writers(pool, [(parent, 3, 4)]))
    # THEN the holder is named as the request's other sequence, not as the request itself
    (f,) = found(pool)
    assert (f.kind, f.block, f.request) == ("unmapped_write", shared, "p")
    assert "which this sequence does not map (held by another sequence of the request," in (
        f.message
    ), f.message
    assert f"seq {child.seq_id}: a fork's sibling" in f.message, f.message


def _engine_step(pool: KVPool, slots, writers: Writers) -> int:
    """An engine's own step calling its store helper; the line of that call."""
    store(pool, slots, writers)
    return inspect.currentframe().f_lineno - 1


def test_with_a_stack_depth_the_store_names_its_callers(make_pool, probes, monkeypatch):
    # GIVEN stacks recorded (KVSCOPE_STACK_DEPTH=2) and a's next slot worked out into b's block
    monkeypatch.setenv("KVSCOPE_STACK_DEPTH", "2")
    pool = make_pool(32, num_layers=2)
    a, b = pool.allocate("a", [1, 2, 3]), pool.allocate("b", [4, 5, 6])
    pool.append(a, [7])
    wrong = b.block_table[0] * pool.slots_per_block + 3
    # WHEN the engine's step stores through its store helper
    line = _engine_step(pool, [wrong], Writers(pool, [(a, 3, 4)]))
    # THEN the finding names the store's line and the step's that called it
    (f,) = found(pool)
    assert f.kind == "unmapped_write"
    assert (
        f"at tests/test_store_writers.py:{STORE_LINE} store <- "
        f"tests/test_store_writers.py:{line} _engine_step, which"
    ) in f.message
    # AND the line a CUDA store keeps for its read-back check is composed the same way
    text, at, here = _caller()
    assert text == (
        f"tests/test_store_writers.py:{at} _site <- tests/test_store_writers.py:{here} _caller"
    )


def _site() -> tuple[str, int]:
    from kvscope.allocator.sites import caller_stack

    return caller_stack(2), inspect.currentframe().f_lineno


def _caller() -> tuple[str, int, int]:
    text, at = _site()
    return text, at, inspect.currentframe().f_lineno - 1


def test_a_write_through_a_table_kept_after_free_is_a_use_after_free_of_the_writer(pool):
    # GIVEN a request that was freed, its table kept by the engine
    seq = pool.allocate("gone", [1, 2, 3])
    blk = seq.block_table[0]
    slot = blk * pool.slots_per_block + 3
    pool.free(seq)
    # WHEN a late token is stored through the kept table
    store(pool, [slot], Writers(pool, [(seq, 3, 4)]))
    # THEN the write is named by its writer
    (f,) = found(pool)
    assert (f.kind, f.block, f.request) == ("use_after_free", blk, "gone")
    assert "the block is free" in f.message


def test_one_check_per_step_not_per_layer(pool, monkeypatch):
    # GIVEN a request's store over both layers with one Writers
    seq = pool.allocate("r", PROMPT)
    checked = []
    from kvscope.probes import stores

    real = stores._PoolChecks.check
    monkeypatch.setattr(stores._PoolChecks, "check", lambda *a: checked.append(real(*a)))
    # WHEN it is stored
    store(pool, pool.slot_mapping(seq, 0, 10), Writers(pool, [(seq, 0, 10)]))
    # THEN the slots were checked once
    assert len(checked) == 1


def test_without_the_probes_the_writers_cost_one_attribute_test(make_pool, monkeypatch):
    # GIVEN a pool without probes
    for name in ("LEAKS", "MAGIC", "EVENTS", "OWNERSHIP", "DIGEST", "RUN_DIR"):
        monkeypatch.delenv(f"KVSCOPE_{name}", raising=False)
    pool = make_pool(32)
    assert pool.probe is None
    first = prefill(pool, "publisher")
    # WHEN the whole-prompt store happens THEN no finding is recorded at the store
    prefill(pool, "hitter", start=0)
    assert pool.findings() == [] and first.block_table


@pytest.mark.gpu
def test_on_a_cuda_pool_the_writer_is_named_and_no_store_waits(pool_name, probes):
    # GIVEN a CUDA pool with the probes
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool = KVPool.create(
        pool_name,
        PoolConfig(num_blocks=32, block_size=BS, num_layers=2, num_kv_heads=2, head_dim=16,
                   dtype="float16", device="cuda"),
    )  # fmt: skip
    try:
        first = prefill(pool, "publisher")
        other = pool.allocate("b", [1, 2, 3])
        # WHEN, under torch's sync debug mode, one request stores its whole prompt and another
        # stores a token into b's block through a device slot mapping
        torch.cuda.set_sync_debug_mode("error")
        try:
            prefill(pool, "hitter", start=0)
            pool.append(first, [7])
            n = len(first.tokens)
            wrong = other.block_table[0] * pool.slots_per_block + 3
            store(pool, [wrong], Writers(pool, [(first, n - 1, n)]))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        settle_writes(pool, wait=True)
        got = {(f.kind, f.block, f.request) for f in found(pool)}
        # THEN the published blocks name the hitter at once, the slot check names the writer
        assert got == {
            ("published_block_modified", first.block_table[0], "hitter"),
            ("published_block_modified", first.block_table[1], "hitter"),
            ("unmapped_write", other.block_table[0], "publisher"),
        }
    finally:
        pool.close()
        pool.unlink()


# -- the core's check (csrc/stores.c store_check) ------------------------------------------------


def test_the_core_writes_the_finding_with_the_writer_and_counts_it_once(pool):
    # GIVEN request a's next slot worked out into b's block
    a, b = pool.allocate("a", [1, 2, 3]), pool.allocate("b", [4, 5, 6])
    pool.append(a, [7])
    blk = b.block_table[0]
    wrong = np.array([blk * pool.slots_per_block + 3], np.int64)
    # WHEN the core checks that store twice (its blocks and its slots)
    with pool.op_mutex:
        counts = [pool.core.store_check([(a, 3, 4)], wrong, None, "here.py:1 f", 3) for _ in "ab"]
    # THEN one finding, in the ring, naming the writer and this process, in the probe's words
    assert counts == [1, 0]
    (f,) = found(pool)
    assert (f.kind, f.block, f.request, f.owner_pid) == ("unmapped_write", blk, "a", os.getpid())
    assert f.message == (
        f"request 'a' stored K/V into block {blk} at here.py:1 f, which it does not map "
        f"(held by request 'b', pid {os.getpid()})"
    )
    assert pool.core.first_report("unmapped_write", blk) is False


def test_the_core_compares_the_slots_with_the_tables_kept_at_the_store(pool):
    # GIVEN a request's table as a store saw it, and the request freed since
    seq = pool.allocate("gone", [1, 2, 3])
    kept = [list(seq.block_table)]
    slot = np.array([kept[0][0] * pool.slots_per_block + 2], np.int64)
    pool.free(seq)
    seq.block_table.clear()
    with pool.op_mutex:
        # WHEN the slots alone are checked against the kept table THEN they are its position's
        assert pool.core.store_check([(seq, 2, 3)], slot, kept, "x.py:1 f", 2) == 0
        # WHEN its blocks are THEN the block is free
        assert pool.core.store_check([(seq, 2, 3)], None, kept, "x.py:1 f", 1) == 1
    (f,) = found(pool)
    assert (f.kind, f.block, f.request) == ("use_after_free", kept[0][0], "gone")


def test_a_malformed_store_check_is_a_type_error(pool):
    seq = pool.allocate("a", [1, 2, 3])
    with pytest.raises(TypeError, match=r"each span is \(seq, start, end\)"):
        pool.core.store_check([(seq, 0)], None, None, None, 1)
    with pytest.raises(TypeError, match="slots are int64"):
        pool.core.store_check([(seq, 0, 3)], np.zeros(3, np.int32), None, None, 2)
    with pytest.raises(TypeError, match="site is None or a str"):
        pool.core.store_check([(seq, 0, 3)], None, None, 5, 1)


def test_a_stores_two_parts_name_the_line_of_the_store_and_keep_its_tables(pool):
    # GIVEN a's store checked at the store (a CUDA store's first part), a freed since
    a, b = pool.allocate("a", [1, 2, 3]), pool.allocate("b", [4, 5, 6])
    pool.append(a, [7])
    right = a.block_table[0] * pool.slots_per_block + 3
    wrong = b.block_table[0] * pool.slots_per_block + 3
    good, bad = Writers(pool, [(a, 3, 4)]), Writers(pool, [(a, 3, 4)])
    good.check_blocks()
    bad.check_blocks()
    line = inspect.currentframe().f_lineno - 1
    pool.free(a)
    # WHEN their slots are read back: a's own slot, then one in b's block
    good.check_slots([right])
    bad.check_slots([wrong])
    # THEN only the second is a finding, named at the line of its first part
    (f,) = found(pool)
    assert (f.kind, f.block, f.request) == ("unmapped_write", b.block_table[0], "a")
    assert f"test_store_writers.py:{line} " in f.message


def test_a_recorded_check_is_a_store_record_then_the_core_s_report(make_pool, probes, tmp_path):
    # GIVEN a pool recording its operations, a's next slot worked out into b's block
    from kvscope.allocator.oplog import read_log
    from kvscope.allocator.records import OpCode

    path = tmp_path / "run.ops"
    pool = make_pool(32, record_ops=str(path))
    a, b = pool.allocate("a", [1, 2, 3]), pool.allocate("b", [4, 5, 6])
    pool.append(a, [7])
    blk = b.block_table[0]
    # WHEN that store is checked
    store(pool, [blk * pool.slots_per_block + 3], Writers(pool, [(a, 3, 4)]))
    pool.close()
    # THEN the log holds its STORE, then one REPORT of the finding, naming the writer
    log = read_log(str(path))
    at = next(i for i, r in enumerate(log.records) if r.op == OpCode.STORE)
    stored, reported = log.records[at], log.records[at + 1]
    assert stored.store.spans == [(a.seq_id, 3, 4)] and stored.store.what == 3
    assert reported.op == OpCode.REPORT and reported.request == "a"
    assert reported.found == [("unmapped_write", blk)]
    assert log.store_reports() == {reported.seq: stored.seq}


def test_a_use_after_free_names_the_pid_that_freed_the_block_not_the_cache_that_took_it(
    make_pool, probes
):
    # GIVEN a request freed by this process into the shared free ring (its local cache full,
    # every other block held)
    pool = make_pool(16, local_cache_size=1)
    seq = pool.allocate("gone", list(range(12)))
    table = list(seq.block_table)
    hold = pool.allocate("hold", list(range(100, 144)))
    pool.free(seq)
    # ... whose blocks another process's allocation took into its local cache, one of them
    # allocated, the other still in the cache until that process detached

    def other() -> int:
        p = KVPool.attach(pool.name)
        p.free(p.allocate("other", [1000]))
        p.close()
        return 0

    child = fork_child(other, alarm_s=60)
    assert wait_child(child) == 0
    blocks = pool.view.blocks
    (cached,) = [
        b for b in table if blocks["owner_pid"][b] == child and blocks["generation"][b] == 1
    ]
    # WHEN the freed request stores through its kept table into that block
    store(pool, [cached * pool.slots_per_block], Writers(pool, [(seq, 0, 1)]))
    # THEN the finding names this process as the block's last holder, not the other one
    (f,) = [f for f in found(pool) if f.block == cached]
    assert f.kind == "use_after_free"
    assert f.message.endswith(f"(last held by request 'gone', pid {os.getpid()})")
    pool.free(hold)


def test_a_store_into_a_block_never_allocated_says_so(pool):
    # GIVEN a pool none of whose blocks was ever allocated, and a request's kept table
    seq = pool.allocate("late", [1, 2, 3])
    pool.free(seq)
    never = next(b for b in range(pool.config.num_blocks) if pool.view.blocks["generation"][b] == 0)
    # WHEN its store goes through a wrong slot into a block nobody ever held
    store(pool, [never * pool.slots_per_block], Writers(pool, [(seq, 0, 1)]))
    # THEN the finding says the block was never allocated (no holder, no pid)
    (f,) = [f for f in found(pool) if f.block == never]
    assert f.kind == "use_after_free" and f.message.endswith("the block is free (never allocated)")


def test_a_prefix_published_before_its_store_and_hit_meanwhile_names_the_requests_that_read_it(
    pool, capsys, tmp_path
):
    import json

    from kvscope.cli import main
    from kvscope.dumpfile import write_dump

    # GIVEN a publisher that publishes its prompt at admission, before its prefill stores it
    # (the bug), a request that hits the published blocks meanwhile, then the publisher's store
    first = pool.allocate("publisher", PROMPT)
    pool.mark_computed(first, len(PROMPT))
    reader = pool.allocate("reader", [*PROMPT[:8], 999])
    assert reader.block_table[:2] == first.block_table[:2]
    store(pool, pool.slot_mapping(first, 0, len(PROMPT)), Writers(pool, [(first, 0, len(PROMPT))]))
    # WHEN the pool's dump is analyzed
    dump = str(tmp_path / "early.kvd")
    write_dump(pool, dump)
    main(["analyze", dump, "--json"])
    rep = json.loads(capsys.readouterr().out)
    main(["analyze", dump, "--request", "reader", "--json"])
    narrowed = json.loads(capsys.readouterr().out)
    # THEN the cause is the early publication, naming the request that took the blocks before
    # they were written, not "while no other request mapped them"
    causes = " ".join(rep.get("likely_causes", []))
    assert "blocks published before their K/V was written, and taken by prefix hits" in causes
    assert "taken by 'reader'" in causes and "while no other request mapped them" not in causes
    assert all(
        f["mapped_since_published"] == ["reader"]
        for f in rep["findings"]
        if f["kind"] == "published_block_modified"
    )
    # AND the reader's own report lists those blocks' findings (what it read)
    assert {f["block"] for f in narrowed["findings"]} >= set(first.block_table[:2])
