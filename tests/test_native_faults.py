"""The 9 injectable faults and the crash points with the C core on: each strikes the operation
it strikes inside the core (which hands nothing back to the Python path for it), and a fault
that says it fired has acted."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable

import pytest

from kvscope.allocator import KVPool, PoolConfig, crash, faults
from kvscope.allocator.crash import CRASH_POINTS
from kvscope.analysis import collect_findings, is_alive
from kvscope.probes import lockdep
from tests.test_crash import _survive_and_reclaim, python_path_hits

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


def striking_op(pool: KVPool, ops: list[Callable[[], object]]) -> tuple[int, int]:
    """Run ops in order: (the index of the one during which a fault fired, how many calls the
    core handed back to the Python path during it)."""
    for i, op in enumerate(ops):
        fired, handed = len(faults.FIRED), pool._native.stats()["fallbacks"]
        op()
        if len(faults.FIRED) > fired:
            return i, pool._native.stats()["fallbacks"] - handed
    return -1, 0


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
    at, handed_back = striking_op(pool, ops)
    for op in ops[at + 1 :]:
        op()
    if fault == "header-scribble":
        pool.verify()
    # THEN the fault fired during an operation the core ran without handing anything back,
    # and its damage is found
    assert at >= 0 and fault in faults.FIRED and fault not in faults.ARMED
    assert handed_back == 0
    assert ACTED[fault] in _kinds(pool), _kinds(pool)


def test_lock_inversion_takes_the_locks_in_reverse_in_the_core(make_pool):
    # GIVEN a pool on its C core (no lockdep), lock-inversion armed for its first opportunity
    pool = make_pool(64, block_size=4)
    faults.configure("lock-inversion:1")
    try:
        # WHEN requests run
        at, handed_back = striking_op(pool, work(pool))
        # THEN it fired in an operation the core ran (its transaction of several locks)
        assert at >= 0 and faults.FIRED[-1] == "lock-inversion" and not faults.ARMED
        assert handed_back == 0
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
    handed = pool._native.stats()["fallbacks"]
    pool.free(seqs[2])
    # THEN it fired at the third, which the core ran, and that request's block stayed held
    assert faults.FIRED[-1] == "leak" and not faults.ARMED
    assert pool._native.stats()["fallbacks"] == handed
    assert pool.stats()["num_allocated"] == 1


def _fired_at(monkeypatch, name: str, native: bool, spec: str) -> int:
    """The index of the operation of `work` during which the armed fault fired, on a pool with
    the light probes and lockdep, with its C core or without."""
    monkeypatch.setenv("KVSCOPE_NATIVE", "1" if native else "0")
    for p in LIGHT:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1")
    pool = KVPool.create(
        name, PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32")
    )
    try:
        assert (pool._native is not None) == native
        lockdep.install(pool, {"KVSCOPE_LOCKDEP": "1", "KVSCOPE_LOCK_HOLD_S": "0"})
        faults.configure(spec)
        return striking_op_index(work(pool))
    finally:
        faults.configure(None)
        lockdep.LOCKDEP.uninstrument(pool)
        pool.close()
        pool.unlink()


def striking_op_index(ops: list[Callable[[], object]]) -> int:
    """Run ops in order up to the one during which a fault fires: its index (-1: none)."""
    for i, op in enumerate(ops):
        fired = len(faults.FIRED)
        op()
        if len(faults.FIRED) > fired:
            return i
    return -1


# (lock-inversion's opportunities are transactions, which the two paths cut differently: an
# allocation with a prefix hit is two on the Python path, one in the core)
@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("fault", sorted(set(ACTED) - {"lock-inversion"} | {"oob-write"}))
def test_a_fault_strikes_the_operation_the_python_path_would(monkeypatch, pool_name, fault, n):
    # GIVEN the same requests on a pool with its C core and one without, a fault armed for
    # its n-th opportunity
    # WHEN they run / THEN it fires during the same operation on both
    core = _fired_at(monkeypatch, pool_name, True, f"{fault}:{n}")
    python = _fired_at(monkeypatch, f"{pool_name}-py", False, f"{fault}:{n}")
    assert core == python >= 0


def test_a_faults_count_is_one_across_the_python_path_and_the_core(make_pool):
    # GIVEN leak armed for its second opportunity, and two requests
    pool = make_pool(64, block_size=4)
    first, second = pool.allocate("first", [1] * 5), pool.allocate("second", [2] * 5)
    faults.configure("leak:2")
    try:
        # WHEN the Python path ends the first (the handle without its hot core for it), then
        # the core the second
        handed = pool._native.stats()["fallbacks"]
        native, pool._native = pool._native, None
        pool.free(first)
        pool._native = native
        assert faults.ARMED == {"leak": 1}
        pool.free(second)
        # THEN the core's release was the second opportunity: it fired there
        assert faults.FIRED[-1] == "leak" and not faults.ARMED
        assert pool._native.stats()["fallbacks"] == handed
        assert pool.stats()["num_allocated"] == 1
    finally:
        faults.configure(None)


def test_oob_write_writes_past_the_block_in_the_core(probed):
    # GIVEN the C core on and oob-write armed for the first append that runs a transaction
    pool = probed
    faults.configure("oob-write:1")
    seq = pool.allocate("r", list(range(9)))
    handed = pool._native.stats()["fallbacks"]
    # WHEN tokens are appended one at a time: three into the last block's room, then one that
    # takes a new block
    for k in range(3):
        pool.append(seq, [k])
    assert faults.ARMED == {"oob-write": 1}
    pool.append(seq, [3])
    # THEN the core ran them all, and fired on the fourth, writing one slot past its new block
    assert faults.FIRED[-1] == "oob-write" and not faults.ARMED
    assert pool._native.stats()["fallbacks"] == handed
    blk = seq.block_table[-1]
    flat = pool.kv.view(pool.kv.shape[0], 2, -1, *pool.kv.shape[4:])
    assert bool((flat[:, :, blk * pool.slots_per_block + pool.block_size] == 1.0).all())
    pool.free(seq)


def _child_fallbacks_at_fire(pool: KVPool, w: int) -> None:
    """In a child: write the core's handed-back count before the release, and again when the
    fault fires (then the process dies)."""
    code = 3
    try:
        child = KVPool.attach(pool.name)
        seq = child.allocate("held", [0, 1, 2, 3, 4])
        child.mark_computed(seq, 4)  # an indexed block: its release takes a shard lock
        faults.ON_FIRE.append(
            lambda name: os.write(w, f"{child._native.stats()['fallbacks']}\n".encode())
        )
        os.write(w, f"{child._native.stats()['fallbacks']}\n".encode())
        faults.configure("kill-holding-lock:1")
        child.free(seq)
    finally:
        os._exit(code)


def test_kill_holding_lock_dies_in_the_core_leaving_a_dead_holder(probed):
    # GIVEN a child process whose pool handle runs on the C core, kill-holding-lock armed
    pool = probed
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child_fallbacks_at_fire(pool, w)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        before, at_fire = f.read().split()
    # THEN it died by SIGKILL holding a pool lock, in a release the core ran (nothing handed
    # back between the call and the fault), and the analyzer names the dead holder
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert before == at_fire
    kinds = {f.kind for f in collect_findings(pool.view, is_alive, None)}
    assert "lock_dead_holder" in kinds, kinds
    # and recovery takes every block back
    pool.reclaim_dead()
    assert pool.check() == [] and pool.stats()["num_allocated"] == 0


def killed_in_child(pool: KVPool, spec: str, body: Callable[[KVPool], object]):
    """Run `body` in a forked child on the C core, attached to `pool`, with the crash point
    `spec` ("point:n") armed: its exit status and the hits its Python path reported
    (python_path_hits: how many were left at each)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            child = KVPool.attach(pool.name)
            assert child._native is not None
            python_path_hits(w, spec.partition(":")[0])
            crash.configure(spec)
            body(child)
        finally:
            os._exit(3)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return status, f.read().split()


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
    # GIVEN a child on the C core with a crash point armed, whose Python path says when it
    # hits it (32 clients: no slot reserve, whose refills are the Python path's)
    pool = make_pool(48, block_size=4, max_clients=32)
    status, python_hits = killed_in_child(pool, f"{point}:1", _random_work)
    # THEN it was killed at the point, by the core (the Python path never hit it), and
    # recovery loses nothing
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point
    assert python_hits == [], python_hits
    _survive_and_reclaim(pool)


def test_a_crash_points_count_is_one_across_the_python_path_and_the_core(make_pool):
    # GIVEN a child with txn.after_locks armed for its second hit, on a pool with slot reserves,
    # whose allocation runs on the Python path (the handle without its hot core), after the
    # core's refill of the slot reserve (a transaction of the core)
    pool = make_pool(48, block_size=4, max_clients=8)

    def body(child: KVPool) -> None:
        child._native = None
        child.allocate("a", [1, 2, 3, 4, 5])

    status, python_hits = killed_in_child(pool, "txn.after_locks:2", body)
    # THEN the core's refill hit it first (two hits left), and the Python path's allocation,
    # the second hit (one left), killed the process
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert python_hits == ["1"]
    _survive_and_reclaim(pool)
