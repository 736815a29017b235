"""Crash consistency: a SIGKILL at any crash point loses no block, and survivors keep serving."""

from __future__ import annotations

import os
import random
import signal
import time
import traceback

import numpy as np
import pytest

from kvscope.allocator import CRASH_POINTS, BlockState, KVPool, PoolExhausted, crash

BS = 4
NUM_BLOCKS = 48
PROMPTS = [[7] * 8 + [1, 2], [7] * 8 + [3], [9] * 4 + [5, 6, 7]]


def _work(pool: KVPool, rng: random.Random, steps: int) -> None:
    """Real work touching every operation: shared prefixes, CoW, eviction, preemption."""
    live = []
    for i in range(steps):
        r = rng.random()
        try:
            if len(live) > 8:
                pool.free(live.pop(0))
            elif r < 0.3 or not live:
                s = pool.allocate(
                    f"c{i}",
                    rng.choice(PROMPTS) + [rng.randrange(9) for _ in range(rng.randrange(6))],
                )
                pool.mark_computed(s, s.num_tokens)
                live.append(s)
            elif r < 0.55:
                s = rng.choice(live)
                if s.state != "preempted":
                    pool.append(s, [rng.randrange(9) for _ in range(rng.randrange(1, 6))])
            elif r < 0.65:
                src = rng.choice(live)
                if src.state != "preempted":
                    live.append(pool.fork(src, f"f{i}"))
            elif r < 0.75:
                s = rng.choice(live)
                if s.state != "preempted":
                    pool.set_state(s, "waiting")
            elif r < 0.8:
                pool.evict(rng.randrange(1, 4))
            else:
                pool.free(live.pop(rng.randrange(len(live))))
        except PoolExhausted:
            if live:
                pool.free(live.pop(0))


def _child(name: str, point: str | None, seed: int, steps: int) -> None:
    code = 0
    try:
        pool = KVPool.attach(name)
        crash.configure(point)
        _work(pool, random.Random(seed), steps)
        # Not reached when the crash point fires: the child leaves its blocks held.
        crash.configure(None)
        code = 3 if point else 0
    except BaseException:
        traceback.print_exc()
        code = 4
    os._exit(code)


def _survive_and_reclaim(pool: KVPool) -> None:
    """Survivor keeps serving; check shows only dead-owner leaks (and the seqs lock, held by a
    process killed in its slot reserve's refill or trim, which a survivor with a reserve of its
    own may not take before it reclaims); reclaim restores every block."""
    rng = random.Random(1)
    _work(pool, rng, 20)
    findings = pool.check()
    kinds = {
        f.kind
        for f in findings
        if not (f.kind == "lock_dead_holder" and f.extra.get("lock") == "seqs")
    }
    assert kinds <= {"leak_dead_owner"}, [f.line() for f in findings]
    pool.reclaim_dead()
    assert pool.check() == []
    seqs = pool.view.seqs
    assert set(seqs["owner_client"][seqs["reserved"] == 1].tolist()) <= {pool.client}
    st = pool.stats()
    live_blocks = {b for s in pool.live().values() for b in s.block_table}
    owned = np.flatnonzero(pool.view.blocks["state"] == BlockState.ALLOCATED)
    assert set(owned.tolist()) == live_blocks
    assert st["num_free"] + st["num_local"] + st["num_cached"] + st["num_allocated"] == NUM_BLOCKS
    for s in pool.live().values():
        pool.free(s)
    assert pool.check() == []


# 64 slots and 32 possible processes: every claim takes the seqs lock; with 8, each process
# keeps a reserve of slots (allocator/sequence.py) that crashes must not lose either.
@pytest.mark.slow
@pytest.mark.parametrize("max_clients", [32, 8], ids=["table", "slot-reserve"])
def test_every_crash_point_loses_no_block(make_pool, capsys, max_clients):
    pool = make_pool(
        NUM_BLOCKS, block_size=BS, local_cache_size=2, num_shards=2, max_clients=max_clients
    )
    trials = 0
    for point in CRASH_POINTS:
        for n in (1, 3, 7):
            pid = os.fork()
            if pid == 0:
                _child(pool.name, f"{point}:{n}", seed=n + len(point), steps=400)
            _, status = os.waitpid(pid, 0)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"{point}:{n} was not reached (exit {os.waitstatus_to_exitcode(status)})"
            )
            _survive_and_reclaim(pool)
            trials += 1
    with capsys.disabled():
        print(
            f"\ncrash test: {len(CRASH_POINTS)} crash points, {trials} trials, every one recovered"
        )


@pytest.mark.slow
def test_random_sigkills_under_load_lose_nothing(make_pool):
    # GIVEN 3 workers doing random operations on one pool
    pool = make_pool(NUM_BLOCKS * 2, block_size=BS, local_cache_size=2, num_shards=2, max_seqs=256)
    rng = random.Random(7)

    def spawn(seed: int) -> int:
        pid = os.fork()
        if pid == 0:
            _child(pool.name, None, seed, steps=10**9)
        return pid

    workers = [spawn(i) for i in range(3)]
    # WHEN the parent SIGKILLs a random worker at random moments 50 times, restarting it
    for k in range(50):
        time.sleep(rng.uniform(0.005, 0.05))
        i = rng.randrange(3)
        os.kill(workers[i], signal.SIGKILL)
        os.waitpid(workers[i], 0)
        workers[i] = spawn(100 + k)
        if k % 5 == 4:
            pool.reclaim_dead()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    # THEN after reclaiming, check() is clean and no block is lost
    pool.reclaim_dead()
    assert pool.check() == []
    st = pool.stats()
    assert st["num_allocated"] == 0
    assert st["num_free"] + st["num_local"] + st["num_cached"] == NUM_BLOCKS * 2
    assert st["num_allocs"] > 1000, "the workers did little real work"
    dead_holders = [f for f in pool.findings() if f.kind == "lock_dead_holder"]
    print(
        f"stress: 50 kills, {st['num_allocs']} allocations, {len(dead_holders)} locks recovered from dead holders"
    )
