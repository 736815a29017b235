"""The 9 injectable faults and the crash points with the C core on: an armed fault or crash point
hands the operations it could strike to the Python path (where the fault sites are), the handle
keeps its C core for the others, and a fault that says it fired has acted."""

from __future__ import annotations

import os
import random
import signal

import pytest

from kvscope.allocator import KVPool, PoolConfig, crash, faults
from kvscope.allocator.crash import CRASH_POINTS
from kvscope.analysis import collect_findings, is_alive
from kvscope.probes import lockdep
from tests.test_crash import _survive_and_reclaim

LIGHT = ("EVENTS", "OWNERSHIP", "LEAKS", "MAGIC")


@pytest.fixture
def probed(monkeypatch, pool_name):
    """A pool with the light probes on and its C core, closed and unlinked afterwards."""
    for p in LIGHT:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1")
    pool = KVPool.create(
        pool_name,
        PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"),
    )
    lockdep.install(pool, {"KVSCOPE_LOCKDEP": "1", "KVSCOPE_LOCK_HOLD_S": "0"})
    assert pool._native is not None
    yield pool
    faults.configure(None)
    lockdep.LOCKDEP.uninstrument(pool)
    pool.close()
    pool.unlink()


def work(pool: KVPool) -> list:
    """Four requests behind one published first block (the later three hit it, so an
    allocation takes the seqs and index locks together), one-token appends (blocks fill and
    new ones are taken), a free."""
    seqs = [pool.allocate("req-0", [0, 1, 2, 3, 0, 5, 6, 7, 8])]
    pool.mark_computed(seqs[0], 4)
    seqs += [pool.allocate(f"req-{i}", [0, 1, 2, 3, i, 5, 6, 7, 8]) for i in range(1, 4)]
    for k in range(6):
        for s in seqs:
            pool.append(s, [k])
    for s in seqs:
        pool.free(s)
    return seqs


def _kinds(pool: KVPool) -> set[str]:
    return {f.kind for f in pool.findings()} | {f.kind for f in pool.check()}


# fault -> what shows it acted (a finding kind, or a check on the pool)
ACTED = {
    "double-free": "double_free",
    "leak": "leak_finished",
    "header-scribble": "header_corrupt",
    "block-scribble": "block_header_corrupt",
    "use-after-free": "use_after_free",
    "refcount-skew": "refcount_mismatch",
    "lock-inversion": "lock_order_cycle",
}


@pytest.mark.parametrize("fault", sorted(ACTED))
def test_a_fault_fires_and_acts_while_the_core_runs_the_rest(probed, fault):
    # GIVEN a pool on its C core with the light probes, and one fault armed for its first
    # opportunity
    pool = probed
    faults.configure(f"{fault}:1")
    before = pool._native.stats()["native_ops"]
    # WHEN requests run
    work(pool)
    if fault == "header-scribble":
        pool.verify()
    # THEN the fault fired, its damage is found, and the operations it could not strike ran
    # in the C core meanwhile
    assert fault in faults.FIRED and fault not in faults.ARMED
    assert ACTED[fault] in _kinds(pool), _kinds(pool)
    assert pool._native.stats()["native_ops"] > before


def test_oob_write_writes_past_the_block(probed):
    # GIVEN the C core on and oob-write armed (found by guard mode, which keeps a pool in
    # Python: here the write itself is checked)
    pool = probed
    faults.configure("oob-write:1")
    seq = pool.allocate("r", list(range(9)))
    before = pool._native.stats()["native_ops"]
    for k in range(4):
        pool.append(seq, [k])
    # THEN it fired on the append that took a new block, and wrote one slot past it
    assert "oob-write" in faults.FIRED
    blk = seq.block_table[-1]
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    assert bool((flat[:, :, blk * pool.slots_per_block + pool.block_size] == 1.0).all())
    # and the appends into the last block's room stayed in the core
    assert pool._native.stats()["native_ops"] > before
    pool.free(seq)


def test_kill_holding_lock_leaves_a_dead_holder(probed):
    # GIVEN a child process whose pool handle runs on the C core, kill-holding-lock armed
    pool = probed
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            child = KVPool.attach(pool.name)
            faults.configure("kill-holding-lock:1")
            work(child)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    # THEN it died by SIGKILL holding a pool lock, which the analyzer names
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    kinds = {f.kind for f in collect_findings(pool.view, is_alive, None)}
    assert "lock_dead_holder" in kinds, kinds
    # and recovery takes every block back
    pool.reclaim_dead()
    assert pool.check() == [] and pool.stats()["num_allocated"] == 0


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_point_fires_with_the_core_on(make_pool, point):
    # GIVEN a child on the C core with a crash point armed
    pool = make_pool(48, block_size=4, max_clients=8)
    pid = os.fork()
    if pid == 0:
        try:
            child = KVPool.attach(pool.name)
            assert child._native is not None
            crash.configure(f"{point}:1")
            rng = random.Random(1)
            live: list = []
            for i in range(300):
                if not live or rng.random() < 0.3:
                    s = child.allocate(f"c{i}", [rng.randrange(5) for _ in range(9)])
                    child.mark_computed(s, s.num_tokens)
                    live.append(s)
                elif rng.random() < 0.6:
                    child.append(live[rng.randrange(len(live))], [rng.randrange(5)])
                elif rng.random() < 0.5 and len(live) < 6:
                    live.append(child.fork(live[rng.randrange(len(live))], f"f{i}"))
                else:
                    child.free(live.pop(rng.randrange(len(live))))
            child.evict(4)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    # THEN it was killed at the point, and recovery loses nothing
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
    _survive_and_reclaim(pool)
