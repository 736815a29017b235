"""Crash recovery is the C core's (allocator/csrc/recovery.c): a lock a dead process held is
recovered, its unfinished operation rolled back and said once, a dead process's long sequences
are reclaimed a transaction at a time, and close() detaches."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import numpy as np
import pytest

from kvscope.allocator import KVPool
from kvscope.allocator.layout import BlockState, ClientState
from tests import lockholder
from tests.forking import fork_child, wait_child
from tests.journals import journal_save

CHILD_ALARM_S = 30


def _die_inside_an_operation(name: str) -> int:
    """Attach, hold a sequence, then take the free lock and half-write the free ring's count
    (journaled first, as an operation does) and die there."""
    p = KVPool.attach(name)
    p.allocate("dead-req", list(range(10)))
    lockholder.hold(p, p.FREE)
    at = p.view.offsets["ring"] + p.view.ring_header.dtype.fields["count"][1]
    journal_save(p, at, 4)
    p.view.ring_header["count"] = 0
    os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_a_dead_holder_is_recovered_by_the_core(make_pool):
    # GIVEN a handle
    pool = make_pool(64)
    seen = []
    pool.on_finding = seen.append
    # ... and a process that died holding the free lock in the middle of an operation
    pid = fork_child(lambda: _die_inside_an_operation(pool.name), CHILD_ALARM_S)
    assert wait_child(pid) == -signal.SIGKILL
    assert int(pool.view.ring_header["count"][0]) == 0
    # WHEN this handle allocates (it meets the dead holder)
    seq = pool.allocate("after", [1, 2, 3, 4, 5])
    # THEN the dead process's write was rolled back, and the lock said to have been held by it,
    # in the findings ring and to the callback, once
    assert int(pool.view.locks["holder_pid"][pool.FREE]) == 0
    said = [f for f in pool.findings() if f.kind == "lock_dead_holder"]
    assert len(said) == 1 and said[0].owner_pid == pid
    assert said[0].message == (
        f"pid {pid} died holding pool lock 'free'; its unfinished operation was rolled back"
    )
    assert [(f.kind, f.extra) for f in seen] == [("lock_dead_holder", {"lock": "free"})]
    # AND once the dead process is reclaimed nothing is lost
    pool.free(seq)
    totals = pool.reclaim_dead()
    assert totals["processes"] == 1 and totals["sequences"] == 1
    assert pool.check() == []
    st = pool.stats()
    assert st["num_allocated"] == 0
    assert st["num_free"] + st["num_local"] + st["num_cached"] == 64


def test_a_dead_process_with_sequences_of_hundreds_of_blocks_is_reclaimed(make_pool):
    # GIVEN a prefix of 200 blocks this process published and still holds
    pool = make_pool(1024, block_size=4, max_blocks_per_seq=512)
    prefix = list(range(800))
    mine = pool.allocate("mine", prefix)
    pool.mark_computed(mine, len(prefix))

    def hold(p: KVPool) -> None:
        # 400 blocks: the 200 shared with the prefix (a hit) and 200 of its own, and a fork
        # sharing all 400
        p.fork(p.allocate("long", prefix + list(range(5000, 5800))), "long-fork")

    pid = _killed_holding(pool.name, hold)
    assert int((pool.view.blocks["state"] == BlockState.ALLOCATED).sum()) == 400
    c = pool.view.clients
    (dead,) = np.flatnonzero(c["pid"] == pid).tolist()
    cached = int(c["local_count"][dead])
    # WHEN a survivor reclaims it (more than a transaction's worth of blocks per sequence)
    done: list[dict] = []
    totals = pool.reclaim_dead(done)
    # THEN both sequences are released, its 200 blocks and its local cache freed, the shared
    # prefix keeps only this process's reference, and the dead process's record is detached
    assert totals == {"processes": 1, "sequences": 2, "blocks": 200 + cached}
    (d,) = done
    assert d["pid"] == pid and d["detached"] and d["sequences"] == 2
    rc = pool.view.blocks["refcount"][np.asarray(mine.block_table)]
    assert (rc == 1).all()
    assert np.flatnonzero(c["state"] == ClientState.ATTACHED).tolist() == [pool.client]
    assert [f.kind for f in pool.findings()] == ["leak_dead_owner"]
    assert pool.check() == []
    pool.free(mine)
    st = pool.stats()
    assert st["num_allocated"] == 0
    assert st["num_free"] + st["num_local"] + st["num_cached"] == 1024


def test_close_returns_the_cache_and_reserve_and_detaches(make_pool):
    # GIVEN a handle with a local cache and a slot reserve
    pool = make_pool(64, max_seqs=64, max_clients=2)
    other = KVPool.attach(pool.name)
    other.free(other.allocate("r", [1, 2, 3]))
    assert int(other.view.clients["local_count"][other.client]) > 0
    allocs = int(pool.view.clients["num_allocs"][other.client])
    # WHEN it closes (the core's detach)
    other.close()
    # THEN its record is detached, its counters folded into the header, nothing cached or
    # reserved is left behind
    c, seqs = pool.view.clients, pool.view.seqs
    assert c["state"][other.client] == ClientState.DETACHED
    assert allocs == 1 and int(pool.view.header["num_allocs"][0]) == allocs
    assert int(c["local_count"][other.client]) == 0
    assert not (pool.view.blocks["state"] == BlockState.LOCAL).any()
    assert not ((seqs["reserved"] == 1) & (seqs["owner_client"] == other.client)).any()
    assert pool.check() == []


def _killed_holding(name: str, hold: Callable[[KVPool], None]) -> int:
    """Fork a process that attaches to `name` and runs `hold` on its handle, and SIGKILL it once
    it has: its pid."""
    r, w = os.pipe()

    def holder() -> int:
        hold(KVPool.attach(name))
        os.write(w, b"1")
        signal.pause()
        return 0

    pid = fork_child(holder, CHILD_ALARM_S)
    os.read(r, 1)
    os.close(r)
    os.close(w)
    os.kill(pid, signal.SIGKILL)
    assert wait_child(pid) == -signal.SIGKILL
    return pid


def _hold_and_die(name: str) -> None:
    """Kill a process once it holds sequences (one shared with a fork, one published)."""

    def hold(p: KVPool) -> None:
        for i in range(3):
            seq = p.allocate(f"held-{i}", list(range(100 * i, 100 * i + 30)))
            p.mark_computed(seq, 16)
        p.fork(seq, "held-fork")

    _killed_holding(name, hold)


@pytest.mark.slow
def test_a_reclaimer_killed_at_any_journal_save_loses_nothing(make_pool):
    # GIVEN a pool, and for each trial a process killed holding sequences
    pool = make_pool(256, max_clients=8)
    for n in (1, 2, 3, 5, 8, 13, 21, 34, 55):
        _hold_and_die(pool.name)

        # WHEN a reclaimer is killed at its n-th journal save (inside the core's reclaim)
        def reclaimer(n: int = n) -> int:
            p = KVPool.attach(pool.name)
            p._core.set_crash_at(n)
            p.reclaim_dead()
            return 0

        assert wait_child(fork_child(reclaimer, CHILD_ALARM_S)) == -signal.SIGKILL
        # THEN the next reclaim (here) rolls the reclaimer's step back and finishes the job
        pool.reclaim_dead()
        assert pool.check() == []
        st = pool.stats()
        assert st["num_allocated"] == 0
        assert st["num_free"] + st["num_local"] + st["num_cached"] == 256


@pytest.mark.slow
@pytest.mark.parametrize("hits", [1, 2, 4])
def test_an_attach_killed_while_it_reclaims_a_borrowed_record_loses_nothing(make_pool, hits):
    from kvscope.allocator import crash

    # GIVEN a client table full of this process and one killed holding sequences
    pool = make_pool(256, max_clients=2)
    _hold_and_die(pool.name)
    assert (pool.view.clients["state"] == ClientState.ATTACHED).all()

    # WHEN a process attaching is killed inside its reclaim of the dead one's record (at the
    # hits-th table write of its steps: the record's journal holds its unfinished step)
    def attacher() -> int:
        crash.configure(f"seqs.after_table:{hits}")
        KVPool.attach(pool.name)
        return 0

    assert wait_child(fork_child(attacher, CHILD_ALARM_S)) == -signal.SIGKILL
    # THEN a survivor's reclaim rolls that step back and reclaims the record's dead owner
    assert pool.reclaim_dead()["processes"] == 1
    assert pool.check() == []
    st = pool.stats()
    assert st["num_allocated"] == 0
    assert st["num_free"] + st["num_local"] + st["num_cached"] == 256
    # AND the next attach takes the record
    KVPool.attach(pool.name).close()
