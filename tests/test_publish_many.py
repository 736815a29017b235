"""`pool.mark_computed_many(seqs, num_tokens)`, a step's publications in one call (docs/POOL.md):
it publishes, records and finds what `mark_computed` of each sequence in turn does, and a
probed pool whose K/V the core does not map (a CUDA pool, marked `gpu`; a CPU pool through the
same queue of device checks, "cpu-queued": the tests' seam DEFERRED_ON_CPU) checks every block
it published in one launch. Each scenario runs on two pools made alike, one publishing with
the batch, the other with separate calls, and compares what they end with."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvscope.allocator import KVPool, PoolError, Sequence, devicechecks
from kvscope.allocator.oplog import read_log
from kvscope.allocator.records import OpCode
from kvscope.replay import replay

BS = 4


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "cpu", "cpu-queued"])
def where(request, monkeypatch):
    """A CUDA pool, a CPU pool's core on its bytes, or a CPU pool through the queue."""
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", request.param == "cpu-queued")
    return request.param


@pytest.fixture(params=["guard", "digest"])
def probes(request, monkeypatch):
    """Guard mode with slot provenance (the publications hash their slots), and the digest
    probe with it (a digest and the slots' hashes in one check)."""
    monkeypatch.setenv("KVSCOPE_DIGEST", "1" if request.param == "digest" else "0")
    return request.param


def probed(make_pool, where: str, **kw) -> KVPool:
    pool = make_pool(64, device=where.split("-")[0], guard=True, max_blocks_per_seq=96, **kw)
    pool.provenance_sample = 1
    return pool


def launched(pool: KVPool) -> int:
    stats = pool.core.device_stats()
    return 0 if stats is None else stats["launched"]


def prompts() -> list[list[int]]:
    """A step's three streams: 2.5 blocks, 3.25 blocks, and the first one's prompt grown by a
    block (its first two blocks' keys are the first's: not published again)."""
    a = list(range(10))
    return [a, list(range(100, 113)), a + list(range(50, 54))]


def written(pool: KVPool, seqs: list[Sequence]) -> None:
    """Each sequence's K/V stored: random values, the same in every pool made alike."""
    g = torch.Generator().manual_seed(3)
    for seq in seqs:
        for b in seq.block_table:
            shape = pool.kv[:, :, b, :BS].shape
            pool.kv[:, :, b, :BS] = torch.randn(shape, generator=g).to(pool.kv.device)


def publish(pool: KVPool, seqs: list[Sequence], counts: list[int], batched: bool) -> list[int]:
    if batched:
        return pool.mark_computed_many(seqs, counts)
    return [pool.mark_computed(s, n) for s, n in zip(seqs, counts, strict=True)]


def state(pool: KVPool, seqs: list[Sequence]) -> dict:
    """What the publications left, once every check's answer is applied: each sequence's blocks'
    records (published, key, digest) and their slots' K/V hashes, and the findings."""
    pool.verify()
    blocks = pool.view.blocks
    # (a finding's message names its caller's line: a batch's and a loop's differ there)
    out: dict = {
        "findings": sorted(
            (f.kind, f.block, f.request, re.sub(r" at \S+ \S+ \(", " at (", f.message))
            for f in pool.findings()
        )
    }
    for seq in seqs:
        ids = np.asarray(seq.block_table)
        out[seq.request_id] = {
            "published": seq.num_published,
            "indexed": blocks["indexed"][ids].tolist(),
            "key": blocks["prefix_hash"][ids].tolist(),
            "digest": blocks["kv_digest"][ids].tolist(),
            "kv_hash": [pool.view.provenance[b]["kv_hash"].tolist() for b in seq.block_table],
        }
    return out


def alike(make_pool, where: str, scenario: Callable[[KVPool, bool], object]) -> tuple:
    """The scenario on two pools made alike, batched and not: what each returned and left."""
    got = []
    for batched in (True, False):
        pool = probed(make_pool, where)
        got.append(scenario(pool, batched))
    return tuple(got)


def test_a_batch_publishes_what_separate_calls_do_in_one_launch(make_pool, where, probes):
    def scenario(pool: KVPool, batched: bool):
        seqs = [pool.allocate(f"r{i}", p) for i, p in enumerate(prompts())]
        written(pool, seqs)
        before = launched(pool)
        # WHEN a step's three streams publish (the third's first two blocks are the first's)
        done = publish(pool, seqs, [10, 13, 14], batched)
        return done, launched(pool) - before, state(pool, seqs)

    (done, launches, batch), (each, separate, calls) = alike(make_pool, where, scenario)
    # THEN the batch published what the calls did, with the same records, digests and hashes
    assert done == each == [2, 3, 1]
    assert batch == calls
    assert batch["r0"]["indexed"] == [1, 1, 0] and batch["r2"]["indexed"] == [0, 0, 1, 0]
    assert batch["findings"] == []
    assert all(all(h) for h in batch["r1"]["kv_hash"][:3])
    if probes == "digest":
        assert all(batch["r1"]["digest"][:3])
    # AND through the queue, its checks were one launch, the calls' one each
    assert (launches, separate) == ((1, 3) if where != "cpu" else (0, 0))


@pytest.mark.parametrize("hit", ["prefix hit", "sweep"])
def test_a_block_written_after_the_batch_published_it_is_found_as_after_calls(
    make_pool, where, probes, hit
):
    def scenario(pool: KVPool, batched: bool):
        seqs = [pool.allocate(f"r{i}", p) for i, p in enumerate(prompts())]
        written(pool, seqs)
        publish(pool, seqs, [10, 13, 14], batched)
        pool.verify()
        # WHEN one element of slot 2 of r1's second block is written after its publication,
        # then a request hits r1's prompt (or the sweep reads r1's slots)
        pool.kv[0, 1, seqs[1].block_table[1], 2, 0, 0] += 1.0
        if hit == "prefix hit":
            pool.allocate("hitter", prompts()[1])
        else:
            pool.check_provenance([seqs[1]])
        return seqs[1].block_table[1], state(pool, seqs)["findings"]

    (block, batch), (_, calls) = alike(make_pool, where, scenario)
    # THEN the same findings, about that block: its slot's foreign_slot, and with the digest
    # probe at a prefix hit its digest's published_block_modified
    assert batch == calls
    kinds = {(kind, b) for kind, b, _, _ in batch}
    want = {("foreign_slot", block)}
    if probes == "digest" and hit == "prefix hit":
        want.add(("published_block_modified", block))
    assert kinds == want


def test_a_sequence_refused_in_the_batch_stops_it_there(make_pool, where, probes):
    def scenario(pool: KVPool, batched: bool):
        seqs = [pool.allocate(f"r{i}", p) for i, p in enumerate(prompts())]
        written(pool, seqs)
        pool.free(seqs[1])
        before = launched(pool)
        # WHEN the second of three is one already freed
        with pytest.raises(PoolError, match="'r1' was already finished"):
            publish(pool, seqs, [10, 13, 14], batched)
        return launched(pool) - before, state(pool, [seqs[0], seqs[2]])

    (launches, batch), (separate, calls) = alike(make_pool, where, scenario)
    # THEN the call raises the refusal: the first is published and checked, the third is not
    # looked at, as a loop of calls leaves them
    assert batch == calls
    assert batch["r0"]["published"] == 2 and batch["r2"]["published"] == 0
    assert all(all(h) for h in batch["r0"]["kv_hash"][:2])
    if probes == "digest":
        assert all(batch["r0"]["digest"][:2])
    assert (launches, separate) == ((1, 1) if where != "cpu" else (0, 0))


def test_a_batch_larger_than_a_quarter_of_the_ring_is_checked_in_pieces(
    make_pool, monkeypatch, probes
):
    # GIVEN a queue whose ring holds 1024 words (a check of 128 blocks takes 896 of them)
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", True)
    monkeypatch.setattr(devicechecks, "RING_WORDS", 1024)
    pool = make_pool(320, guard=True, max_blocks_per_seq=96)
    pool.provenance_sample = 1
    seqs = [pool.allocate(f"r{i}", list(range(1000 * i, 1000 * i + 80 * BS))) for i in range(3)]
    written(pool, seqs)
    before = launched(pool)
    # WHEN a batch publishes 240 blocks
    assert pool.mark_computed_many(seqs, [80 * BS] * 3) == [80] * 3
    # THEN they were checked in two launches, every block's slots hashed (and digested)
    assert launched(pool) - before == 2
    got = state(pool, seqs)
    assert got["findings"] == []
    for seq in seqs:
        assert all(all(h) for h in got[seq.request_id]["kv_hash"])
        assert probes == "guard" or all(got[seq.request_id]["digest"])


def test_bad_arguments_are_refused_before_anything_is_published(make_pool):
    pool = make_pool(16)
    a = pool.allocate("a", list(range(8)))
    with pytest.raises(PoolError, match="2 sequences but 1 token counts"):
        pool.mark_computed_many([a, a], [8])
    with pytest.raises(TypeError, match="an integer"):
        pool.mark_computed_many([a], ["8"])
    assert a.num_published == 0
    # (any iterables: a generator is read into a list)
    assert pool.mark_computed_many((s for s in [a]), iter([8])) == [2]
    assert pool.mark_computed_many([], []) == []


def test_a_batch_records_each_publication_as_calls_do_and_replays(make_pool, tmp_path, probes):
    def scenario(pool: KVPool, batched: bool):
        path = tmp_path / f"{batched}.ops"
        pool.record_ops(str(path))
        seqs = [pool.allocate(f"r{i}", p) for i, p in enumerate(prompts())]
        written(pool, seqs)
        publish(pool, seqs, [10, 13, 14], batched)
        pool.free(seqs[1])
        with pytest.raises(PoolError):
            publish(pool, seqs, [12, 16, 17], batched)
        pool.stop_recording()
        return read_log(str(path))

    batch, calls = alike(make_pool, "cpu", scenario)

    def ops(log) -> list[tuple]:
        return [
            (r.op_name, r.status_name, r.seq_id, r.arg, r.result, r.request, r.blocks, r.found)
            for r in log.records
            if r.op != OpCode.START
        ]

    # THEN one MARK_COMPUTED record per sequence published, the refused one's too, as the
    # calls write them; and the log replays to its end
    assert ops(batch) == ops(calls)
    published = [(r[1], r[5], r[4]) for r in ops(batch) if r[0] == "mark_computed"]
    assert published == [
        ("ok", "r0", 2), ("ok", "r1", 3), ("ok", "r2", 1), ("ok", "r0", 0), ("refused", "r1", 0)
    ]  # fmt: skip
    # (the refused publication of a sequence already freed is the program's use_after_free,
    # recorded with it: the replay finds it there, and nothing before it)
    assert ops(batch)[-1][-1] == [("use_after_free", -1)]
    out = replay(batch, quiet=True)
    assert out.reason == "finding" and out.record.request == "r1", out
    assert out.got.found == [("use_after_free", -1)] and not out.diff
