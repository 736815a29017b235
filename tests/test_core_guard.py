"""Guard mode (in full and sampled) and the digest probe in the C core: with K/V written as an
engine would and hostile writes planted (past a block's end, into a freed block, into a published
block, a write skipped), each is found, the same way whether the core reads a CPU pool's bytes or
goes through its own queue of checks a CUDA pool uses (its answers read later and applied by the
core: on a CPU pool through the tests' seam devicechecks.DEFERRED_ON_CPU); the core's digest is
the kernels', and its queue keeps its contract."""

from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest
import torch

from kvscope.allocator import KVPool, PoolConfig, PoolExhausted, devicechecks, integrity
from kvscope.allocator.layout import BlockState
from kvscope.kernels import block_digests
from kvscope.kernels.digest import fmix64_reference, int_view
from kvscope.probes import lockdep, watchdog
from tests.kernels_cases import slot_digests

LIGHT = ("EVENTS", "OWNERSHIP", "LEAKS", "MAGIC", "LOCKDEP")
# The slot mapping's guard slot: the last of each block.
BS = 4


def _tagged(digest: int, generation: int) -> int:
    """A `kv_digest` word (docs/FORMAT.md): the digest's high half over the block's generation."""
    return ((digest >> 32) << 32) | (generation & 0xFFFF_FFFF)


def _pool(
    name: str, dtype: str = "float32", layers: int = 2, device: str = "cpu", events: int = 256
) -> KVPool:
    pool = KVPool.create(
        name,
        PoolConfig(
            device=device,
            num_blocks=48,
            block_size=BS,
            num_layers=layers,
            num_kv_heads=2,
            head_dim=3,
            dtype=dtype,
            local_cache_size=3,
            num_shards=2,
            max_clients=4,
            max_seqs=64,
            event_capacity=events,
        ),
    )
    watchdog.install(pool, {"KVSCOPE_LOCKDEP": "1", "KVSCOPE_LOCK_HOLD_S": "0"})
    return pool


def _write(pool: KVPool, seq, first: int, skip: int = -1) -> None:
    """The engine's K/V writes for positions [first, len(tokens)) of seq (but `skip`)."""
    for pos in range(first, len(seq.tokens)):
        if pos != skip:
            blk = seq.block_table[pos // BS]
            pool.kv[:, :, blk, pos % BS] = float(seq.tokens[pos] % 7 + 1) + pos / 64


def _plant(pool: KVPool, live: list, kind: str, rng: random.Random) -> None:
    """One hostile K/V write."""
    b = pool.view.blocks
    ids = np.arange(len(b))
    if kind == "past_end" and live:
        seq = live[rng.randrange(len(live))]
        if seq.block_table:
            blk = seq.block_table[rng.randrange(len(seq.block_table))]
            pool.kv[0, 1, blk, BS, 0, 1] = 3.0  # the guard slot
    elif kind == "after_free":
        freed = ids[b["poisoned"] == 1]
        if len(freed):
            pool.kv[1, 0, int(freed[rng.randrange(len(freed))]), 1, 1, 0] = 5.0
    elif kind == "published":
        pub = ids[b["indexed"] == 1]
        if len(pub):
            pool.kv[0, 0, int(pub[rng.randrange(len(pub))]), 0, 0, 2] = -2.0


def _step(pool: KVPool, live: list, rng: random.Random, i: int, systems: list, skip: bool) -> None:
    """One random operation, K/V written as an engine does (copies first; with `skip`, an
    append's first new position is not written): prompts sharing system prefixes, decode steps,
    publication, forks (copy-on-write), frees and aborts, in a pool small enough to evict."""
    r = rng.random()
    try:
        if r < 0.25 or not live:
            own = [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            seq = pool.allocate(f"r{i}", (rng.choice(systems) if r < 0.18 else []) + own)
            _write(pool, seq, seq.num_cached_tokens)
            live.append(seq)
            return
        seq = live[rng.randrange(len(live))]
        if r < 0.65:
            first = len(seq.tokens)
            more = [rng.randrange(50) for _ in range(1 if r < 0.58 else rng.randrange(2, 7))]
            for src, dst in pool.append(seq, more):
                pool.kv[:, :, dst, :BS] = pool.kv[:, :, src, :BS]
            _write(pool, seq, first, skip=first if skip else -1)
        elif r < 0.78:
            pool.mark_computed(seq, seq.num_tokens)
        elif r < 0.83:
            live.append(pool.fork(seq, f"f{i}"))
        else:
            live.remove(seq)
            (pool.free if r < 0.93 else pool.abort)(seq)
    except PoolExhausted:
        pool.free(live.pop(0))


# The time a block was freed, in a use_after_free message, is each pool's own.
_WHEN = re.compile(r"at \d{4}-\d\d-\d\d [\d:.]+")


def _findings(pool: KVPool) -> list[tuple]:
    return [(f.kind, f.block, _WHEN.sub("at T", f.message), f.request) for f in pool.findings()]


# what each plant (and a skipped write) is found as
PLANTED = {"guard_violation", "use_after_free", "published_block_modified", "kv_never_written"}


@pytest.mark.parametrize(
    "sample,deferred,dtype,quarantine",
    [
        (0, False, "float32", 0),
        (0, False, "float16", 0),
        (3, False, "bfloat16", 0),
        (0, False, "float32", 6),
        (0, True, "float16", 0),
        (0, True, "bfloat16", 0),
        (3, True, "bfloat16", 0),
        (3, True, "float32", 0),
        (0, True, "float32", 6),
        (0, True, "float16", 6),
    ],
    ids=["guard-cpu-fp32", "guard-cpu-fp16", "sampled3-cpu-bf16", "quarantine6-cpu-fp32",
         "guard-deferred-fp16", "guard-deferred-bf16", "sampled3-deferred-bf16",
         "sampled3-deferred-fp32", "quarantine6-deferred-fp32", "quarantine6-deferred-fp16"],
)  # fmt: skip
def test_hostile_writes_in_a_random_run_are_found(
    pool_name, monkeypatch, sample, deferred, dtype, quarantine
):
    # GIVEN every probe `kvscope run` switches on (guard in full or sampled, digest; with a
    # quarantine count or not), on a CPU pool's bytes or through the core's queue
    for p in LIGHT:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1")
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    monkeypatch.setenv("KVSCOPE_GUARD_SAMPLE", str(sample))
    monkeypatch.setenv("KVSCOPE_QUARANTINE", str(quarantine))
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", deferred)
    pool = _pool(pool_name, dtype, events=4096 if deferred else 256)
    assert pool._core.stats()["kv_direct"] == (not deferred)
    rng = random.Random(5)
    systems = [[rng.randrange(50) for _ in range(9)] for _ in range(3)]
    live: list = []
    try:
        # WHEN random operations run, K/V written, hostile writes planted now and then
        for i in range(300):
            r = rng.random()
            if r < 0.06:
                _plant(pool, live, ("past_end", "after_free", "published")[int(r / 0.02)], rng)
            _step(pool, live, rng, i, systems, skip=rng.random() < 0.02)
        pool.verify()
        # THEN the plants were found (a write past a block's end: when its release is guarded),
        # and nothing else was
        kinds = {f[0] for f in _findings(pool)}
        assert {"use_after_free", "published_block_modified"} <= kinds <= PLANTED, kinds
        assert sample or "guard_violation" in kinds, kinds
    finally:
        _close(pool)


# -- each finding, planted once --------------------------------------------------------------


def _probed(name: str, monkeypatch, deferred: bool = False, device: str = "cpu") -> KVPool:
    """A pool with guard mode and the digest, its core on the bytes (or with `deferred`,
    through its own queue of checks, answered later as a CUDA pool's are)."""
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", deferred)
    for p in LIGHT:
        monkeypatch.setenv(f"KVSCOPE_{p}", "0")
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    return _pool(name, device=device)


def _close(*pools: KVPool) -> None:
    for pool in pools:
        lockdep.LOCKDEP.uninstrument(pool)
        pool.close()
        pool.unlink()


def _found(pool: KVPool, scenario) -> list[tuple]:
    """The findings of a scenario, once every answer is in (in the order they were found;
    answers read later come in another order: sorted), the pool closed after."""
    try:
        scenario(pool)
        pool.verify()
        return sorted(_findings(pool))
    finally:
        _close(pool)


def _written(pool: KVPool, rid: str, tokens: list[int]):
    seq = pool.allocate(rid, tokens)
    _write(pool, seq, 0)
    return seq


def _past_end(pool: KVPool) -> int:
    seq = _written(pool, "a", list(range(7)))
    blk = seq.block_table[0]
    pool.kv[1, 0, blk, BS] = 1.0  # the first block's guard slot
    pool.free(seq)
    return blk


def _after_free(pool: KVPool) -> int:
    seq = _written(pool, "a", list(range(8)))
    freed = list(seq.block_table)
    pool.free(seq)
    pool.kv[0, 1, freed[1], 2] = 9.0  # written after its release
    # the ring hands freed blocks out again in order: take them all
    for i in range(12):
        _written(pool, f"b{i}", [100 + i] * 15)
    return freed[1]


def _published(pool: KVPool) -> int:
    seq = _written(pool, "a", list(range(9)))
    pool.mark_computed(seq, 9)
    if pool.kv.is_cuda:
        # the step done on the GPU (an engine's token readback waits for it): the digests of
        # what it published are in by the next operation
        torch.cuda.synchronize()
    pool.kv[0, 0, seq.block_table[0], 1] = 4.0  # a published block, written again
    _written(pool, "b", list(range(9)))  # its prefix hit verifies it
    return seq.block_table[0]


def _skipped(pool: KVPool) -> int:
    seq = pool.allocate("a", list(range(6)))
    _write(pool, seq, 0, skip=2)
    pool.append(seq, [6])
    _write(pool, seq, 6)
    blk = seq.block_table[0]
    pool.free(seq)
    return blk


# each bad write and the finding kind it must produce, about the block it returns, naming
# request "a"
PLANTS = [
    (_past_end, "guard_violation"),
    (_after_free, "use_after_free"),
    (_published, "published_block_modified"),
    (_skipped, "kv_never_written"),
]
PLANT_IDS = ["past-end", "after-free", "published", "skipped"]


# how the C core reaches the K/V besides a CPU pool's bytes: with the answers read later (a CUDA
# pool's way), through its own queue of checks, with a ring of the default size or one small
# enough to fill (the oldest answers are then read first, inside the operation, and applied at
# the next settle)
WAYS = {"deferred": 0, "deferred-small-ring": 160}


@pytest.mark.parametrize("scenario,kind", PLANTS, ids=PLANT_IDS)
def test_each_planted_write_is_found(pool_name, monkeypatch, scenario, kind):
    # GIVEN guard mode and the digest, the core on a CPU pool's bytes
    pool = _probed(pool_name, monkeypatch)
    blocks: list[int] = []
    # WHEN the bad write happens
    found = _found(pool, lambda p: blocks.append(scenario(p)))
    # THEN it is reported, about its block and the request that wrote it
    assert (kind, blocks[0], "a") in {(k, b, r) for k, b, _, r in found}, found


@pytest.mark.parametrize("scenario,kind", PLANTS, ids=PLANT_IDS)
@pytest.mark.parametrize("way", list(WAYS))
def test_each_planted_write_is_found_the_same_way_through_the_queue(
    pool_name, monkeypatch, scenario, kind, way
):
    # GIVEN guard mode and the digest, the core on a CPU pool's bytes, and the core through
    # its queue of checks (with a ring of the default size, or a small one)
    direct = _found(_probed(f"{pool_name}-direct", monkeypatch), scenario)
    if WAYS[way]:
        monkeypatch.setattr(devicechecks, "RING_WORDS", WAYS[way])
    pool = _probed(pool_name, monkeypatch, deferred=True)
    assert pool.probe.later is not None and pool._core.device_stats() is not None
    # WHEN the same bad write happens on both
    # THEN both report it with the same kind, block, message and request
    assert _found(pool, scenario) == direct
    assert kind in [f[0] for f in direct]


def test_a_full_ring_reads_its_oldest_answers_first_and_mixes_none_up(pool_name, monkeypatch):
    # GIVEN the core's queue with a ring of 40 words (a digest of one block takes three: its
    # id, its answer and its generation) and its answers held back (no settle)
    monkeypatch.setattr(devicechecks, "RING_WORDS", 40)
    pool = _probed(pool_name, monkeypatch, True)
    try:
        later = pool.probe.later
        monkeypatch.setattr(later, "settling", True)
        seqs = []
        ops = pool._core.stats()["native_ops"]
        for i in range(12):
            # WHEN twelve requests publish a block each (more than the ring holds)
            seq = _written(pool, f"r{i}", [7 * i + j for j in range(BS + 1)])
            pool.mark_computed(seq, BS)
            seqs.append(seq)
        published = [s.block_table[0] for s in seqs]
        # THEN the oldest answers were read to make room, none applied inside an operation
        assert not integrity.has_digest(pool.view.blocks, np.asarray(published)).any()
        stats = pool._core.device_stats()
        assert stats["launched"] == 12 and stats["unapplied"] > 0 and stats["waiting"] < 12
        # (and the core ran every allocation and publication)
        assert pool._core.stats()["native_ops"] == ops + 24
        # WHEN the answers are settled THEN each block's record holds its own digest
        monkeypatch.setattr(later, "settling", False)
        later.settle(wait=True)
        b = pool.view.blocks
        want = block_digests(pool.kv, published, BS)
        assert b["kv_digest"][published].tolist() == [
            _tagged(d, int(b["generation"][blk])) for d, blk in zip(want, published)
        ]
        assert later.waiting() == 0 and pool.check() == [] and pool.findings() == []
    finally:
        _close(pool)


@pytest.mark.gpu
@pytest.mark.parametrize("scenario,kind", PLANTS, ids=PLANT_IDS)
def test_each_planted_write_is_found_on_a_cuda_pool(pool_name, monkeypatch, scenario, kind):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # GIVEN guard mode and the digest on a CUDA pool (the core's checks launched by itself and
    # answered later), and on a CPU pool (the core on its bytes)
    direct = _found(_probed(f"{pool_name}-cpu", monkeypatch), scenario)
    pool = _probed(pool_name, monkeypatch, device="cuda")
    core: dict[str, int] = {}

    def run(pool: KVPool) -> None:
        scenario(pool)
        core.update(pool._core.device_stats())

    # WHEN the same bad write happens on both
    found = _found(pool, run)
    # THEN the core launched the checks of its operations (none failed), and both report the
    # bad write the same way
    assert core["launched"] > 0 and core["broken"] == 0, core
    assert kind in [f[0] for f in found], found
    assert found == direct


def _burst_held_back(pool, monkeypatch, tag: str, token: int) -> list[int]:
    """Six prompts of four full blocks each published and freed while the digests' answers are
    held back (a GPU still busy); the blocks."""
    many: list[int] = []
    monkeypatch.setattr(pool.probe.later, "settling", True)
    for i in range(6):
        s = _written(pool, f"{tag}{i}", [token + i] * 17)
        pool.mark_computed(s, 16)
        many += s.block_table[:4]
        pool.free(s)
    monkeypatch.setattr(pool.probe.later, "settling", False)
    return many


def test_deferred_digests_reach_the_records_of_blocks_still_published(pool_name, monkeypatch):
    # GIVEN the C core with its answers read later (a CUDA pool's way: in the core's own queue
    # of checks)
    pool = _probed(pool_name, monkeypatch, True)
    try:
        pool.free(_written(pool, "warm-up", [1, 2, 3]))
        ops = pool._core.stats()["native_ops"]
        # WHEN a request is written and published
        seq = _written(pool, "a", list(range(9)))
        pool.mark_computed(seq, 9)
        # THEN the core ran it without the digests, which the next operation writes into the
        # records: the kernel's digests, tagged with the generation
        assert pool._core.stats()["native_ops"] == ops + 2
        published = seq.block_table[:2]
        b = pool.view.blocks
        assert (b["kv_digest"][published] == 0).all()
        assert pool.probe.later.waiting() == 1
        pool.free(seq)
        assert b["kv_digest"][published].tolist() == [
            _tagged(d, int(b["generation"][blk]))
            for d, blk in zip(block_digests(pool.kv, published, BS), published)
        ]
        # WHEN a block is published, and evicted before its digest's answer is read (a GPU still
        # busy: the answers held back)
        seq = _written(pool, "b", [50 + i for i in range(5)])
        monkeypatch.setattr(pool.probe.later, "settling", True)
        pool.mark_computed(seq, 5)
        blk = seq.block_table[0]
        pool.free(seq)
        assert pool.evict(48) >= 1 and pool.view.blocks["indexed"][blk] == 0
        monkeypatch.setattr(pool.probe.later, "settling", False)
        pool.verify()
        # THEN the late digest is not written into the record of what the block is now
        assert pool.view.blocks["kv_digest"][blk] == 0
        assert pool.check() == [] and pool.findings() == []
        # WHEN more digests wait than one transaction's journal holds (a burst of prompts)
        many = _burst_held_back(pool, monkeypatch, "c", 200)
        pool.verify()
        # THEN the core writes every one
        assert integrity.has_digest(pool.view.blocks, np.asarray(many)).all()
        assert pool.probe.later.waiting() == 0 and pool.check() == []
    finally:
        _close(pool)


def test_answers_of_a_program_that_never_frees_do_not_pile_up(pool_name, monkeypatch):
    # GIVEN the C core with its answers read later (in its own queue), and room for three
    # answers waiting
    monkeypatch.setattr(devicechecks, "MAX_PENDING", 3)
    pool = _probed(pool_name, monkeypatch, True)
    try:
        later = pool.probe.later
        seq = _written(pool, "long", list(range(9)))
        # WHEN one request grows and publishes block after block, with no allocation or free
        most = 0
        for i in range(9, 9 + 12 * BS):
            pool.append(seq, [i])
            _write(pool, seq, i)
            pool.mark_computed(seq, i + 1)
            most = max(most, later.waiting())
        # THEN the answers are taken as they pile up: never more than one past the bound, and
        # every published block but those whose answers still wait has its digest, with no free
        published = seq.block_table[: (len(seq.tokens)) // BS]
        assert most <= 4 and len(published) >= 12
        have = integrity.has_digest(pool.view.blocks, np.asarray(published))
        assert have[:-4].all() and (~have).sum() <= later.waiting()
        pool.free(seq)
        assert pool.check() == [] and pool.findings() == []
    finally:
        _close(pool)


def test_a_clean_guarded_request_runs_in_the_core(pool_name, monkeypatch):
    # GIVEN guard mode and the digest on the C core
    pool = _probed(pool_name, monkeypatch)
    try:
        pool.free(_written(pool, "warm-up", [1, 2, 3]))
        ops = pool._core.stats()["native_ops"]
        # WHEN a request is allocated, written, published and freed
        seq = _written(pool, "a", list(range(9)))
        published, private = np.asarray(seq.block_table[:2]), seq.block_table[-1]
        pool.mark_computed(seq, 9)
        pool.free(seq)
        # THEN the core ran all three operations; its private block was quarantined and
        # poisoned, its published blocks cached with their digests, and nothing was found
        assert pool._core.stats()["native_ops"] == ops + 3
        b = pool.view.blocks
        assert b["state"][private] == BlockState.QUARANTINED and b["poisoned"][private] == 1
        assert torch.isnan(pool.kv[:, :, private, :BS]).all()
        assert (b["state"][published] == BlockState.CACHED).all()
        assert integrity.has_digest(b, published).all()
        assert pool.findings() == [] and pool.check() == []
    finally:
        _close(pool)


@pytest.mark.parametrize("deferred", [False, True], ids=["cpu", "deferred"])
def test_the_cores_never_written_check_names_each_block_and_position(
    pool_name, monkeypatch, deferred
):
    # GIVEN guard mode on the C core (on the bytes, or through its queue) and a request of three
    # blocks whose K/V is written but for a few positions, in two of its blocks
    pool = _probed(pool_name, monkeypatch, deferred)
    try:
        seq = pool.allocate("a", list(range(11)))
        skipped = {1, 2, 4, 6, 8}
        for pos in range(11):
            if pos not in skipped:
                blk = seq.block_table[pos // BS]
                pool.kv[:, :, blk, pos % BS] = 1.0
        table = list(seq.block_table)
        # each block's unwritten positions of the first 10, as the message says them: all of
        # them from the first to the last, one, or some of those between
        want = [
            (table[0], "positions 1-2"),
            (table[1], "2 positions between 4 and 6"),
            (table[2], "position 8"),
        ]
        # WHEN it finishes
        pool.free(seq)
        pool.verify()
        # THEN the core reports each block and its unwritten positions, naming the request
        got = [f for f in pool.findings() if f.kind == "kv_never_written"]
        assert [(f.block, f.request) for f in got] == [(blk, "a") for blk, _ in want]
        for f, (_, positions) in zip(got, want):
            assert f.message == integrity.UNWRITTEN_MESSAGE.format(request="a", positions=positions)
    finally:
        _close(pool)


@pytest.mark.parametrize("deferred", [False, True], ids=["cpu", "deferred"])
def test_a_block_taken_out_of_the_cache_holds_the_poison(pool_name, monkeypatch, deferred):
    # GIVEN guard mode, a finished request's three published blocks cached, and every free
    # block held, so that the next blocks handed out are evicted
    pool = _probed(pool_name, monkeypatch, deferred)
    try:
        old = _written(pool, "old", list(range(12)))
        pool.mark_computed(old, 12)
        cached = list(old.block_table)
        pool.free(old)
        free = pool.stats()["num_free"] + pool.stats()["num_local"]
        filler = _written(pool, "filler", [1000 + i for i in range(free * BS)])
        assert pool.stats()["num_free"] + pool.stats()["num_local"] == 0
        # WHEN a request takes two blocks out of the cache, pool.evict sends the third to the
        # free list, and the request's engine writes all but one of the positions the finish
        # check reads (a store that went elsewhere)
        new = pool.allocate("new", [500, 501, 502, 503, 504])
        assert set(new.block_table) < set(cached)
        assert pool.evict(1) == 1
        assert pool.stats()["num_cached"] == 0 and pool.stats()["num_free"] == 1
        pool.verify()
        # THEN the evicted blocks hold the poison, not the old request's K/V
        for blk in cached:
            assert torch.isnan(pool.kv[:, :, blk, :BS]).all()
        assert pool.check() == []  # (the one on the free list poisoned, as a freed block is)
        _write(pool, new, 0, skip=1)
        unwritten = new.block_table[0]
        pool.free(new)
        pool.free(filler)
        # and the position never written is a kv_never_written finding about its block; the
        # block on the free list is handed out again with no finding
        again = pool.allocate("again", [900 + i for i in range(4 * BS)])
        pool.free(again)
        pool.verify()
        got = [(f.kind, f.block, f.request) for f in pool.findings()]
        assert got == [("kv_never_written", unwritten, "new")]
        assert pool.check() == []
    finally:
        _close(pool)


# -- the digest, computed by the core ---------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize(
    "bs,layers,heads,dim",
    # rows of 1, 6, 112, 128, 256 and 432 elements (16-bit ones in chunks of 128, and the rest);
    # slot provenance's slot pass (16-bit slots of 8 to 128 elements) over a block of 6 slots
    # and over slots of 128 elements, the most it takes
    [
        (1, 1, 1, 1),
        (4, 2, 2, 3),
        (16, 3, 1, 7),
        (16, 1, 1, 8),
        (16, 1, 2, 8),
        (16, 2, 3, 9),
        (6, 2, 1, 8),
        (4, 1, 16, 8),
    ],
)
@pytest.mark.parametrize("fill", ["random", "lowest", "highest"])
@pytest.mark.parametrize("provenance", [0, 1], ids=["", "provenance"])
def test_the_cores_digest_is_the_kernels(
    pool_name, monkeypatch, dtype, bs, layers, heads, dim, fill, provenance
):
    # GIVEN a CPU pool of random K/V bits (NaNs, negative and odd values included); with slot
    # provenance, whose slot hashes a 16-bit pool's digest pass takes with the digest
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    monkeypatch.setenv("KVSCOPE_PROVENANCE_SAMPLE", str(provenance))
    monkeypatch.setenv("KVSCOPE_DIGEST", str(provenance))
    pool = KVPool.create(
        pool_name,
        PoolConfig(
            num_blocks=9,
            max_seqs=8,
            max_blocks_per_seq=8,
            block_size=bs,
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=dim,
            dtype=dtype,
        ),
    )
    try:
        bits = int_view(pool.kv)
        gen = torch.Generator().manual_seed(bs * 100 + layers)
        hi = 256 if bits.dtype == torch.uint8 else 1 << (8 * bits.element_size() - 1)
        lo = 0 if bits.dtype == torch.uint8 else -hi
        bits.copy_(torch.randint(lo, hi, bits.shape, generator=gen).to(bits.dtype))
        if fill != "random":  # every element the lowest or the highest integer of its width
            bits.fill_(lo if fill == "lowest" else hi - 1)
        ids = [0, 8, 3, 3, 5]
        # WHEN the core and kernels/digest.py digest the same blocks THEN they agree bit for bit
        assert pool._core.digests(ids) == block_digests(pool.kv, ids, bs)
        if provenance:
            # and WHEN a request's blocks are published (digest and slot hashes in one pass
            # where the pool's elements allow) THEN the records hold the digests and each
            # slot's hash, as kernels/digest.py and the slots' own sums give them
            seq = pool.allocate("p", list(range(3 * bs)))
            assert pool.mark_computed(seq, 3 * bs) == 3
            full = seq.block_table
            want = [(d >> 32) for d in block_digests(pool.kv, full, bs)]
            got = [int(pool.view.blocks["kv_digest"][b]) >> 32 for b in full]
            assert got == want
            slots = fmix64_reference(torch.tensor(slot_digests(pool.kv, full, bs)))
            slots = (((slots >> 32) & 0xFFFFFFFF) | 1).tolist()
            assert [[int(h) for h in pool.view.provenance[b]["kv_hash"]] for b in full] == slots
            pool.free(seq)
    finally:
        pool.close()
        pool.unlink()


@pytest.mark.parametrize("dtype", ["float16", "float8_e4m3fn"])
def test_a_write_into_the_last_bytes_of_a_guard_slot_is_found(pool_name, monkeypatch, dtype):
    # GIVEN guard mode on a CPU pool whose slots are not a whole number of 8-byte words (2
    # heads of 3: 12 bytes, or 6), whose checks compare their last bytes one by one
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", False)
    for p in LIGHT:
        monkeypatch.setenv(f"KVSCOPE_{p}", "0")
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    pool = _pool(pool_name, dtype=dtype)
    try:
        seq = _written(pool, "a", list(range(7)))
        blk = seq.block_table[0]
        # WHEN only the last element of a block's guard slot is written over
        pool.kv[1, 1, blk, BS, 1, 2] = 1.0
        pool.free(seq)
        # THEN its release finds it (the release's own check: no verify() scan here)
        assert ("guard_violation", blk, "a") in {(k, b, r) for k, b, _, r in _findings(pool)}
    finally:
        _close(pool)


# -- the canary checks a CUDA pool defers ----------------------------------------------------


def test_guard_flags_agree_with_the_scan(pool_name, monkeypatch):
    from kvscope.kernels.guard import guard_flags, guard_scan

    # GIVEN a guarded CPU pool with three guard slots written over
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    pool = _pool(pool_name, "bfloat16")
    try:
        pool.kv[0, 1, 5, BS, 1, 2] = 1.0
        pool.kv[1, 0, 9, BS, 0, 0] = 2.0
        pool.kv[1, 1, 40, BS] = 0.0
        ids = [3, 5, 9, 40, 47]
        # WHEN the flags are taken THEN they mark exactly the blocks the scan finds
        flags = guard_flags(pool.kv, ids).tolist()
        assert [b for b, f in zip(ids, flags) if f] == guard_scan(pool.kv, ids) == [5, 9, 40]
    finally:
        _close(pool)


def test_a_deferred_canary_check_reports_as_a_direct_one(pool_name, monkeypatch):
    # GIVEN the C core on a CPU pool's bytes, and with its answers read later (a CUDA pool's
    # way); each with a write past the end of a request's block
    direct = _probed(f"{pool_name}-direct", monkeypatch)
    deferred = _probed(pool_name, monkeypatch, deferred=True)
    pools = (deferred, direct)
    try:
        assert deferred.probe.later is not None
        for pool in pools:
            pool.free(_written(pool, "warm-up", [1, 2, 3]))
            _past_end(pool)
        # WHEN the request is released THEN the core ran it and nothing is reported yet, while
        # the direct check reported at once
        assert deferred._core.stats()["native_ops"] >= 2
        assert _findings(deferred) == [] and _findings(direct) != []
        # WHEN the pool is verified THEN the same finding comes, and the canary is whole again
        deferred.verify()
        assert _findings(deferred) == _findings(direct)
        assert deferred.verify() == [] and deferred.probe.later.waiting() == 0
        # WHEN another request writes past its end and is freed THEN its answer is read at the
        # next free (or abort), before that one's own operation
        for pool in pools:
            _past_end(pool)
            pool.free(_written(pool, "next", [5, 6, 7]))
        assert _findings(deferred) == _findings(direct) and len(_findings(direct)) == 2
    finally:
        _close(deferred, direct)


def test_the_cores_own_queue_of_checks_keeps_its_contract(pool_name, monkeypatch):
    # GIVEN a handle whose C core queues its checks of the K/V itself (answered later)
    pool = _probed(pool_name, monkeypatch, True)
    try:
        later = pool.probe.later
        core = pool._core
        assert core.device_stats()["waiting"] == 0
        # WHEN nothing waits THEN there is nothing to take
        assert core.device_take(pool, True, -1) is None
        # WHEN a request is published and its digests wait
        seq = _written(pool, "a", list(range(9)))
        monkeypatch.setattr(later, "settling", True)
        pool.mark_computed(seq, 9)
        assert later.waiting() == 1 and core.device_stats()["launched"] >= 1
        # THEN the core refuses to be configured again while they wait
        with pytest.raises(RuntimeError, match="still wait"):
            core.device_checks(None)
        # WHEN they are taken THEN the core writes them into the records itself: the kernel's
        # digests (kernels/digest.py), tagged with the generation, and nothing is returned
        b = pool.view.blocks
        published = seq.block_table[:2]
        assert not integrity.has_digest(b, np.asarray(published)).any()
        assert core.device_take(pool, True, -1) is None
        assert b["kv_digest"][published].tolist() == [
            _tagged(d, int(b["generation"][blk]))
            for d, blk in zip(block_digests(pool.kv, published, BS), published)
        ]
        assert later.waiting() == 0
        # (a configuration that is not one leaves the last in place)
        with pytest.raises(TypeError):
            core.device_checks(3)
        with pytest.raises(KeyError):
            core.device_checks({"cuda": False})
        assert core.device_stats() is not None
        monkeypatch.setattr(later, "settling", False)
        # WHEN a check is queued from Python THEN the core's queue takes it
        with pool.op_mutex:
            core.device_queue("verify", published, "a test")
            with pytest.raises(ValueError, match="no check"):
                core.device_queue("unwritten", published, None)
        assert later.waiting() == 1
        pool.verify()
        assert later.waiting() == 0 and pool.findings() == []
        # WHEN the core's checks are switched off THEN an operation that needs one says so, and
        # leaves the pool as it was
        core.device_checks(None)
        assert core.device_stats() is None
        with pytest.raises(RuntimeError, match="not configured"):
            pool.free(seq)
        assert pool.check() == []
    finally:
        _close(pool)


def test_a_probe_set_again_takes_over_the_cores_waiting_checks(pool_name, monkeypatch):
    # GIVEN a handle whose C core queues its checks, with a published request's digests
    # still waiting in the core's queue
    pool = _probed(pool_name, monkeypatch, True)
    try:
        seq = _written(pool, "a", list(range(9)))
        monkeypatch.setattr(pool.probe.later, "settling", True)
        pool.mark_computed(seq, 9)
        assert pool._core.device_stats()["waiting"] == 1
        # WHEN the probes are set on the handle again (a new PoolProbes)
        from kvscope.allocator.probing import PoolProbes

        pool.probe = PoolProbes(pool, pool.probe.flags)
        # THEN the new probe took the waiting answers (the digests are in the records) and
        # configured the core's queue for itself, which goes on working
        later = pool.probe.later
        assert later.core is pool._core and later.waiting() == 0
        assert pool._core.device_stats() is not None
        assert integrity.has_digest(pool.view.blocks, np.asarray(seq.block_table[:2])).all()
        pool.free(seq)
        assert pool.verify() == [] and pool.check() == []
    finally:
        _close(pool)


@pytest.mark.parametrize("how", ["take", "check"])
def test_a_write_after_free_names_the_process_that_freed_it_after_a_refill(
    pool_name, monkeypatch, how
):
    """A block another process freed (quarantined, poisoned) and wrote into after, then taken
    by this process's refill into its own local cache (its record's owner then this process):
    the finding names the process that freed it, whether this process's take or the whole-pool
    check (the block still in the local cache) finds it."""
    from tests.forking import fork_child, wait_child

    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    pool = _pool(pool_name)
    try:
        # GIVEN a worker that allocates, writes, frees, and writes into a freed block after
        def worker() -> int:
            mine = KVPool.attach(pool_name)
            seq = _written(mine, "w", list(range(8)))
            freed = list(seq.block_table)
            mine.free(seq)
            mine.kv[0, 1, freed[0], 2] = 9.0
            mine.close()
            return 0

        child = fork_child(worker, alarm_s=60)
        assert wait_child(child) == 0
        b = pool.view.blocks
        poisoned = [int(x) for x in np.flatnonzero(b["poisoned"] == 1)]
        assert poisoned and all(int(b["owner_pid"][x]) == child for x in poisoned)
        # WHEN this process takes blocks until its refills reach them (its local cache holds 3)
        # or, with the block refilled but not taken yet, the whole pool is checked
        n = 0
        while how == "take" and not [f for f in pool.findings() if f.kind == "use_after_free"]:
            pool.allocate(f"b{n}", [100 + n] * 3)
            n += 1
            assert n < 48
        if how == "check":
            while int(b["state"][poisoned[0]]) != BlockState.LOCAL:
                pool.allocate(f"b{n}", [100 + n] * 3)
                n += 1
                assert n < 48
            assert int(b["owner_pid"][poisoned[0]]) == os.getpid()
        found = pool.findings() if how == "take" else pool.check()
        # THEN the write after free names the worker that freed the block, not this process
        uaf = [f for f in found if f.kind == "use_after_free"]
        assert uaf and {f.owner_pid for f in uaf} == {child}, [f.line() for f in uaf]
        assert all(f"pid {child} request 'w' freed it" in f.message for f in uaf)
    finally:
        _close(pool)
