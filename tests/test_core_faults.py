"""The 9 injectable faults and the crash points in the C core: each strikes the operation its
n-th opportunity falls in, a fault that says it fired has acted, and a process killed at a crash
point loses nothing."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable

import pytest

from kvscope.allocator import KVPool, PoolConfig, crash, faults
from kvscope.allocator.crash import CRASH_POINTS
from kvscope.analysis import collect_findings, is_alive
from kvscope.probes import lockdep, watchdog
from tests.test_crash import _survive_and_reclaim

LIGHT = ("EVENTS", "OWNERSHIP", "LEAKS", "MAGIC")


@pytest.fixture
def probed(monkeypatch, pool_name):
    """A pool with the light probes and lockdep on, closed and unlinked afterwards."""
    for p in LIGHT:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1")
    pool = KVPool.create(
        pool_name,
        PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"),
    )
    watchdog.install(pool, {"KVSCOPE_LOCKDEP": "1", "KVSCOPE_LOCK_HOLD_S": "0"})
    yield pool
    faults.configure(None)
    lockdep.LOCKDEP.uninstrument(pool)
    pool.close()
    pool.unlink()


def work(pool: KVPool) -> list[Callable[[], object]]:
    """Four requests behind one published first block (the later three hit it, so an
    allocation takes the seqs and index locks together), one-token appends (blocks fill and
    new ones are taken), a free: one call per pool operation, in order."""
    seqs: list = []
    ops: list[Callable[[], object]] = [
        lambda: seqs.append(pool.allocate("req-0", [0, 1, 2, 3, 0, 5, 6, 7, 8])),
        lambda: pool.mark_computed(seqs[0], 4),
    ]
    for i in range(1, 4):
        ops.append(lambda i=i: seqs.append(pool.allocate(f"req-{i}", [0, 1, 2, 3, i, 5, 6, 7, 8])))
    for k in range(6):
        ops += [lambda j=j, k=k: pool.append(seqs[j], [k]) for j in range(4)]
    ops += [lambda j=j: pool.free(seqs[j]) for j in range(4)]
    return ops


def striking_op(ops: list[Callable[[], object]]) -> int:
    """Run ops in order up to the one during which a fault fires: its index (-1: none)."""
    for i, op in enumerate(ops):
        fired = len(faults.FIRED)
        op()
        if len(faults.FIRED) > fired:
            return i
    return -1


def _kinds(pool: KVPool) -> set[str]:
    return {f.kind for f in pool.findings()} | {f.kind for f in pool.check()}


# fault -> what shows it acted (a finding kind)
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
def test_a_fault_fires_in_the_core_and_acts(probed, fault):
    # GIVEN a pool on its C core with the light probes, and one fault armed for its first
    # opportunity
    pool = probed
    faults.configure(f"{fault}:1")
    # WHEN requests run
    ops = work(pool)
    at = striking_op(ops)
    for op in ops[at + 1 :]:
        op()
    if fault == "header-scribble":
        pool.verify()
    # THEN the fault fired during an operation, and its damage is found
    assert at >= 0 and fault in faults.FIRED and fault not in faults.ARMED
    assert ACTED[fault] in _kinds(pool), _kinds(pool)


def test_lock_inversion_takes_the_locks_in_reverse_in_the_core(make_pool):
    # GIVEN a pool (no lockdep), lock-inversion armed for its first opportunity
    pool = make_pool(64, block_size=4)
    faults.configure("lock-inversion:1")
    try:
        # WHEN requests run
        at = striking_op(work(pool))
        # THEN it fired in an operation of the core (its transaction of several locks)
        assert at >= 0 and faults.FIRED[-1] == "lock-inversion" and not faults.ARMED
    finally:
        faults.configure(None)


def test_a_fault_strikes_at_its_nth_opportunity_counted_in_the_core(probed):
    # GIVEN leak armed for its third opportunity (a release of a block only its request holds)
    pool = probed
    faults.configure("leak:3")
    seqs = [pool.allocate(f"r{i}", [i, 9, 9, 9, i]) for i in range(3)]
    # WHEN three requests end, in the core
    for s in seqs[:2]:
        pool.free(s)
    assert faults.ARMED == {"leak": 1} and "leak" not in faults.FIRED[-1:]
    pool.free(seqs[2])
    # THEN it fired at the third, and that request's block stayed held
    assert faults.FIRED[-1] == "leak" and not faults.ARMED
    assert pool.stats()["num_allocated"] == 1


# fault -> the operations of `work` during which its first and its fourth opportunity come: a
# block taken by an allocation (the four allocations, not the publication between them); an
# append that takes a new block (each request's fourth one-token append); a release (the frees)
STRIKES = {
    "refcount-skew": (0, 4),
    "block-scribble": (17, 20),
    "header-scribble": (17, 20),
    "oob-write": (17, 20),
    "double-free": (29, 32),
    "leak": (29, 32),
    "use-after-free": (29, 32),
}


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("fault", sorted(STRIKES))
def test_a_fault_strikes_the_operation_its_nth_opportunity_falls_in(probed, fault, n):
    # GIVEN the light probes and lockdep, a fault armed for its n-th opportunity
    faults.configure(f"{fault}:{n}")
    # WHEN the requests run / THEN it fires during the operation of its n-th opportunity
    assert striking_op(work(probed)) == STRIKES[fault][n > 1]


def test_oob_write_writes_past_the_block_in_the_core(probed):
    # GIVEN the C core on and oob-write armed for the first append that runs a transaction
    pool = probed
    faults.configure("oob-write:1")
    seq = pool.allocate("r", list(range(9)))
    # WHEN tokens are appended one at a time: three into the last block's room, then one that
    # takes a new block
    for k in range(3):
        pool.append(seq, [k])
    assert faults.ARMED == {"oob-write": 1}
    pool.append(seq, [3])
    # THEN it fired on the fourth, writing one slot past its new block
    assert faults.FIRED[-1] == "oob-write" and not faults.ARMED
    blk = seq.block_table[-1]
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    assert bool((flat[:, :, blk * pool.slots_per_block + pool.block_size] == 1.0).all())
    pool.free(seq)


def _die_holding_a_lock(pool: KVPool) -> None:
    """In a child: release a published sequence (its release takes a shard lock) with
    kill-holding-lock armed (the process dies there)."""
    try:
        child = KVPool.attach(pool.name)
        seq = child.allocate("held", [0, 1, 2, 3, 4])
        child.mark_computed(seq, 4)  # an indexed block: its release takes a shard lock
        faults.configure("kill-holding-lock:1")
        child.free(seq)
    finally:
        os._exit(3)


def test_kill_holding_lock_dies_in_the_core_leaving_a_dead_holder(probed):
    # GIVEN a child process attached to the pool, kill-holding-lock armed
    pool = probed
    pid = os.fork()
    if pid == 0:
        _die_holding_a_lock(pool)
    _, status = os.waitpid(pid, 0)
    # THEN it died by SIGKILL holding a pool lock, and the analyzer names the dead holder
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    kinds = {f.kind for f in collect_findings(pool.view, is_alive, None)}
    assert "lock_dead_holder" in kinds, kinds
    # and recovery takes every block back
    pool.reclaim_dead()
    assert pool.check() == [] and pool.stats()["num_allocated"] == 0


def killed_in_child(pool: KVPool, spec: str, body: Callable[[KVPool], object]) -> int:
    """Run `body` in a forked child attached to `pool`, with the crash point `spec`
    ("point:n") armed: its exit status."""
    pid = os.fork()
    if pid == 0:
        try:
            child = KVPool.attach(pool.name)
            crash.configure(spec)
            body(child)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    return status


def _random_work(child: KVPool) -> None:
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


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_point_fires_in_the_core(make_pool, point):
    # GIVEN a child with a crash point armed (32 clients: no slot reserve)
    pool = make_pool(48, block_size=4, max_clients=32)
    status = killed_in_child(pool, f"{point}:1", _random_work)
    # THEN it was killed at the point, and recovery loses nothing
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
    _survive_and_reclaim(pool)
