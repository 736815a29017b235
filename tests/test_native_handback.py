"""An exception raised in a handback of the C core (its K/V work done in Python, on a CUDA pool or
under KVSCOPE_NATIVE_KV) reaches the caller as itself, and the operation leaves the pool as it
was."""

from __future__ import annotations

import pytest

from kvscope.allocator import KVPool, PoolConfig, devicechecks, writes

BS = 4


def _pool(name: str) -> KVPool:
    return KVPool.create(
        name,
        PoolConfig(
            num_blocks=32, max_seqs=256, block_size=BS, num_layers=1, num_kv_heads=1,
            head_dim=4, dtype="float32",
        ),
    )  # fmt: skip


def _written(pool: KVPool, rid: str, tokens: list[int]):
    seq = pool.allocate(rid, tokens)
    for blk in seq.block_table:
        pool.kv[:, :, blk, :BS] = 1.0  # token slots only: the guard slot keeps its canary
    return seq


@pytest.mark.parametrize("mode", ["python", "deferred"])
@pytest.mark.parametrize("op", ["stamp", "verify", "canary", "poison"])
def test_a_handbacks_exception_reaches_the_caller(pool_name, monkeypatch, op, mode):
    # GIVEN guard mode and the digest in the C core, handing its K/V work back to Python, and a
    # handback that raises on `op`
    for probe in ("GUARD", "DIGEST"):
        monkeypatch.setenv(f"KVSCOPE_{probe}", "1")
    monkeypatch.setenv("KVSCOPE_NATIVE_KV", mode)
    # (the handback itself: not the core's own queue of checks, which calls no Python)
    monkeypatch.setattr(devicechecks, "CORE_CHECKS", False)
    real = writes.WriteProbes.native_kv

    def native_kv(self, name, ids):
        if name.startswith(op):
            raise RuntimeError(f"boom in {name}")
        return real(self, name, ids)

    monkeypatch.setattr(writes.WriteProbes, "native_kv", native_kv)
    pool = _pool(pool_name)
    try:
        assert pool._native is not None
        a = _written(pool, "a", list(range(9)))
        # WHEN the operation that hands `op` back runs
        before = pool.stats()
        with pytest.raises(RuntimeError, match=f"boom in {op}"):
            if op == "stamp":
                pool.mark_computed(a, 8)
            else:
                pool.mark_computed(a, 8)
                pool.verify()
                before = pool.stats()
                if op == "verify":
                    pool.allocate("b", list(range(9)))  # a prefix hit verifies a's blocks
                else:
                    pool.free(a)  # canary scan, then poison
        # THEN it raised the handback's own exception (not a SystemError), and the operation
        # left the pool as it was
        after = pool.stats()
        for key in ("num_allocated", "num_sequences", "num_free", "num_cached"):
            assert after[key] == before[key], key
        monkeypatch.setattr(writes.WriteProbes, "native_kv", real)
        assert pool.check() == []
    finally:
        pool.close()
        pool.unlink()
