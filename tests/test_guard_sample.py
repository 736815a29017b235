"""Sampled guard mode (`PoolConfig.guard_sample`, KVSCOPE_GUARD_SAMPLE=N): one allocation in N is
guarded, poisoned and quarantined on release; the others take the C core's fast path."""

from __future__ import annotations

import numpy as np

from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.layout import BlockState


def sampled_pool(name: str, every: int) -> KVPool:
    """A small CPU pool in sampled guard mode, one allocation in `every`."""
    config = PoolConfig(
        num_blocks=64,
        block_size=4,
        head_dim=8,
        num_layers=1,
        dtype="float32",
        max_clients=4,
        guard_sample=every,
    )
    return KVPool.create(name, config)


def _guarded_releases(pool: KVPool, n: int) -> list[bool]:
    """For n requests in turn: whether their release poisoned and quarantined their blocks."""
    out = []
    for i in range(n):
        seq = pool.allocate(f"r{i}", [i, i + 1, i + 2, i + 3, i + 4, i + 5])
        blocks = list(seq.block_table)
        pool.kv[:, :, blocks, : pool.block_size] = 1.0  # its K/V (slots start poisoned)
        pool.free(seq)
        b = pool.view.blocks
        poisoned = bool((b["poisoned"][blocks] == 1).all())
        quarantined = bool((b["state"][blocks] == BlockState.QUARANTINED).all())
        nan = bool(np.isnan(pool.kv[:, :, blocks, : pool.block_size].float().numpy()).all())
        assert poisoned == quarantined == nan, (i, poisoned, quarantined, nan)
        out.append(poisoned)
    return out


def test_one_allocation_in_n_is_guarded(pool_name):
    # GIVEN a pool in sampled guard mode, one allocation in 4
    pool = sampled_pool(pool_name, 4)
    try:
        assert pool.config.guard and pool.guard_sample == 4
        # WHEN eight requests run one after the other
        guarded = _guarded_releases(pool, 8)
        # THEN the first and the fifth were guarded (poisoned, quarantined), the rest not,
        # and those ran in the C core
        assert guarded == [True, False, False, False, True, False, False, False]
        assert pool._core.stats()["native_ops"] >= 6
        assert pool.check() == []
    finally:
        pool.close()
        pool.unlink()


def test_a_sampled_write_past_the_block_is_caught_at_release(pool_name):
    # GIVEN sampled guard mode and a write into the guard slot of a guarded request's block
    pool = sampled_pool(pool_name, 2)
    try:
        seq = pool.allocate("guarded", list(range(6)))
        blk = seq.block_table[-1]
        flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
        flat[:, :, blk * pool.slots_per_block + pool.block_size] = 1.0
        # WHEN it is released THEN the canary check at its release reports it
        pool.free(seq)
        assert [f.kind for f in pool.findings()] == ["guard_violation"]
    finally:
        pool.close()
        pool.unlink()


def test_the_environment_samples_every_handle(pool_name, monkeypatch):
    # GIVEN guard mode with KVSCOPE_GUARD_SAMPLE=3 in the environment
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    monkeypatch.setenv("KVSCOPE_GUARD_SAMPLE", "3")
    pool = KVPool.create(
        pool_name,
        PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"),
    )
    try:
        # WHEN six requests run THEN the first and the fourth are guarded
        assert _guarded_releases(pool, 6) == [True, False, False, True, False, False]
    finally:
        pool.close()
        pool.unlink()
