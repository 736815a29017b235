"""Checks of a probed pool whose K/V the core does not map (a CUDA pool, marked `gpu`; a CPU
pool through the same queue of device checks, "cpu-queued": the tests' seam DEFERRED_ON_CPU)
that one operation makes of the same blocks are one launch, and find what a CPU pool's core,
checking the bytes in the operation, finds: a prefix hit's digest check and its slots'
provenance check (the digest probe and slot provenance both on: csrc/devchecks.c
dev_hit_check); a guarded release's canary check and poison fill (dev_release_check)."""

from __future__ import annotations

import pytest
import torch

from kvscope.allocator import KVPool, devicechecks

BS = 4


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "cpu-queued"])
def where(request) -> str:
    return request.param


def launched(pool: KVPool) -> int:
    stats = pool.core.device_stats()
    return 0 if stats is None else stats["launched"]


def hit(make_pool, monkeypatch, where: str, scribble: bool) -> tuple[KVPool, int]:
    """Request 'owner' publishes two blocks of written K/V (a third, partial one not);
    `scribble`: a slot of its first block written after that; then request 'hitter' allocates
    the same prompt (a hit of the two blocks). The pool, and the checks the hitter's
    allocation launched."""
    monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", where == "cpu-queued")
    pool = make_pool(64, device=where.split("-")[0], guard=True, block_size=BS)
    pool.provenance_sample = 1
    prompt = list(range(2 * BS + 2))
    owner = pool.allocate("owner", prompt)
    full = owner.block_table[:2]
    shape = pool.kv[:, :, full, :BS].shape
    values = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    pool.kv[:, :, full, :BS] = values.to(pool.kv.device, pool.kv.dtype)
    assert pool.mark_computed(owner, 2 * BS) == 2
    pool.verify()  # (the digests and slot hashes of a queued check land with its answer)
    assert pool.findings() == []
    if scribble:
        pool.kv[0, 1, full[0], 3] += 1.0
    before = launched(pool)
    hitter = pool.allocate("hitter", prompt)
    checks = launched(pool) - before
    assert hitter.block_table[:2] == full
    pool.verify()
    return pool, checks


def found(pool: KVPool) -> list[tuple]:
    return sorted((f.kind, f.block, f.request, f.message) for f in pool.findings())


@pytest.mark.parametrize("scribble", [False, True])
def test_a_prefix_hit_checks_digests_and_slots_in_one_launch(
    make_pool, monkeypatch, where, scribble
):
    # GIVEN a published prompt (one of whose slots' K/V was written since, `scribble`)
    # WHEN another request hits it
    pool, checks = hit(make_pool, monkeypatch, where, scribble)
    # THEN its allocation launched one check: the hit's, digests and slots together (its new
    # block, never freed, has no poison to check)
    assert checks == 1
    # AND it finds what a CPU pool's core finds at the hit, in the same words: nothing, or the
    # changed block's published_block_modified and the changed slot's foreign_slot
    reference, _ = hit(make_pool, monkeypatch, "cpu", scribble)
    assert found(pool) == found(reference)
    kinds = sorted(f.kind for f in pool.findings())
    assert kinds == (["foreign_slot", "published_block_modified"] if scribble else [])


def release(make_pool, monkeypatch, where: str, scribble: bool) -> tuple[KVPool, list, int]:
    """Guard mode: request 'r' holds three blocks, every token slot written; `scribble`: the
    guard slot of its second block written over; then it is freed. The pool, its blocks, and
    the checks the free launched."""
    monkeypatch.setenv("KVSCOPE_DIGEST", "0")
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", where == "cpu-queued")
    pool = make_pool(64, device=where.split("-")[0], guard=True, block_size=BS)
    seq = pool.allocate("r", list(range(3 * BS)))
    ids = list(seq.block_table)
    pool.kv[:, :, ids, :BS] = 1.0
    if scribble:
        pool.kv[0, 1, ids[1], BS, 0, 0] = 0.5
    before = launched(pool)
    pool.free(seq)
    checks = launched(pool) - before
    pool.verify()
    return pool, ids, checks


@pytest.mark.parametrize("scribble", [False, True])
def test_a_guarded_release_checks_canaries_and_fills_in_one_launch(
    make_pool, monkeypatch, where, scribble
):
    # GIVEN a guarded request's written blocks (one's guard slot written over, `scribble`)
    # WHEN it is freed
    pool, ids, checks = release(make_pool, monkeypatch, where, scribble)
    # THEN its free launched two checks: the finish check of its slots, and its blocks'
    # canaries and poison fill together
    assert checks == 2
    # AND every token slot of its blocks holds the poison, their guard slots the canary again
    assert torch.isnan(pool.kv[:, :, ids, :BS]).all()
    # AND it finds what a CPU pool's core finds: nothing, or that block's guard_violation
    reference, _, _ = release(make_pool, monkeypatch, "cpu", scribble)
    assert found(pool) == found(reference)
    assert [(f.kind, f.block) for f in pool.findings()] == (
        [("guard_violation", ids[1])] if scribble else []
    )
    # (the canary is a NaN: its bits compared)
    guards = pool.kv[:, :, ids, BS].cpu().view(torch.int32)
    assert torch.equal(guards, reference.kv[:, :, ids, BS].cpu().view(torch.int32))
