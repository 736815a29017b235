"""Each process's reserve of sequence slots: claimed in batches under the seqs lock, used and
returned without it, given back at close and by recovery after a kill -9."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolExhausted, SeqState
from kvscope.allocator.sequence import slot_batch

# max_seqs // (4 * max_clients) = 2 slots per batch, at most 4 in a reserve.
CONFIG = dict(max_seqs=64, max_clients=8)


def _reserved(pool: KVPool, client: int | None = None) -> list[int]:
    seqs = pool.view.seqs
    mine = (seqs["reserved"] == 1) & (seqs["state"] == SeqState.EMPTY)
    if client is not None:
        mine &= seqs["owner_client"] == client
    return np.flatnonzero(mine).tolist()


def _core_reserve(pool: KVPool) -> list[int]:
    """The slots of this process's reserve, as the core holds them (the next claim's last)."""
    return list(pool._core.reserve_state()[0])


def _seqs_acquires(pool: KVPool) -> int:
    return int(pool.view.locks["num_acquires"][pool.SEQS])


def test_reserved_slots_serve_allocate_and_free_without_the_seqs_lock(make_pool):
    # GIVEN a pool whose table is large enough for per-process reserves
    pool = make_pool(64, **CONFIG)
    assert slot_batch(64, 8) == 2
    # WHEN a first sequence is allocated and freed
    pool.free(pool.allocate("a", [1, 2, 3]))
    # THEN its slot went back to this process's reserve: no sequence, a clean check
    assert len(_reserved(pool, pool.client)) == 2
    assert pool.stats()["num_sequences"] == 0
    assert pool.check() == []
    # AND later allocations, forks and frees take no seqs lock while the reserve lasts
    before = _seqs_acquires(pool)
    for i in range(10):
        s = pool.allocate(f"r{i}", [i, 1, 2])
        pool.free(pool.fork(s, f"f{i}"))
        pool.free(s)
    assert _seqs_acquires(pool) == before
    assert pool.check() == []


def test_the_c_core_runs_every_allocation_and_free_as_the_reserve_empties_and_fills(make_pool):
    # GIVEN a pool with per-process reserves of 2 slots (at most 4)
    pool = make_pool(64, **CONFIG)
    ops = pool._core.stats()["native_ops"]
    # WHEN more sequences are live at once than a reserve holds, then all are freed, twice
    for _ in range(2):
        live = [pool.allocate(f"r{i}", [i, 1, 2]) for i in range(7)]
        live.append(pool.fork(live[0], "f"))
        for s in live:
            pool.free(s)
    # THEN each refill and each give-back ran as a transaction of its own under the seqs
    # lock, and the core ran every allocation, fork and free
    assert pool._core.stats()["native_ops"] == ops + 2 * (7 + 1 + 8)
    assert len(_reserved(pool, pool.client)) <= 4
    assert pool.stats()["num_sequences"] == 0
    assert pool.check() == []


def test_sequence_ids_stay_unique_and_increasing_across_refills(make_pool):
    # GIVEN a pool with reserves of 2 slots
    pool = make_pool(64, **CONFIG)
    # WHEN more sequences live at once than a reserve holds
    live = [pool.allocate(f"s{i}", [i]) for i in range(9)]
    ids = [s.seq_id for s in live]
    # THEN every sequence has its own id, in allocation order, and its own slot
    assert ids == sorted(set(ids))
    assert len({s.slot for s in live}) == 9
    for s in live:
        pool.free(s)
    # AND the reserve keeps at most twice a batch; the rest went back to the table
    assert len(_reserved(pool, pool.client)) == 4
    assert pool.check() == []


def test_the_reserve_is_the_cores_and_the_segment_agrees(make_pool):
    # GIVEN a pool with reserves
    pool = make_pool(64, **CONFIG)
    # WHEN sequences come and go, more at once than a reserve holds
    live = [pool.allocate(f"s{i}", [i, 1]) for i in range(5)]
    for s in live[:3]:
        pool.free(s)
    live.append(pool.fork(live[3], "f"))
    # THEN the reserve the core holds is what the table marks reserved by this process
    assert sorted(_core_reserve(pool)) == _reserved(pool, pool.client)
    assert 0 < len(_core_reserve(pool)) <= 4
    for s in live[3:]:
        pool.free(s)
    assert sorted(_core_reserve(pool)) == _reserved(pool, pool.client)
    assert pool.check() == []


def test_a_rolled_back_claim_leaves_the_reserve_and_the_ids_as_they_were(make_pool):
    # GIVEN a full pool (8 blocks held) whose reserve holds slots
    pool = make_pool(8, **CONFIG)
    held = pool.allocate("held", list(range(32)))
    state = pool._core.reserve_state()
    reserve = _core_reserve(pool)
    assert reserve
    # WHEN an allocation claims a slot, then finds no block (rolled back)
    with pytest.raises(PoolExhausted):
        pool.allocate("more", [1, 2, 3])
    # THEN the reserve and its ids are as they were, and the next sequence gets the id the
    # failed one had taken
    assert pool._core.reserve_state() == state
    slot = held.slot
    pool.free(held)
    assert _core_reserve(pool) == [*reserve, slot]
    s = pool.allocate("next", [1, 2, 3])
    assert s.slot == slot and s.seq_id == held.seq_id + 1
    pool.free(s)
    assert pool.check() == []


def test_close_gives_the_reserve_back_to_the_table(make_pool):
    # GIVEN a second process that used (and so reserved) sequence slots, then detached
    pool = make_pool(64, **CONFIG)
    pid = os.fork()
    if pid == 0:
        other = KVPool.attach(pool.name)
        other.free(other.allocate("x", [1, 2]))
        code = 0 if _reserved(other, other.client) else 5
        other.close()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    # THEN no slot is left reserved by it and the pool checks clean
    assert _reserved(pool) == []
    assert pool.check() == []


def test_a_killed_process_reserve_is_returned_by_reclaim_dead(make_pool):
    # GIVEN a process that filled its reserve (and holds a live sequence), then was killed -9
    pool = make_pool(64, **CONFIG)
    pid = os.fork()
    if pid == 0:
        other = KVPool.attach(pool.name)
        for i in range(3):
            other.free(other.allocate(f"x{i}", [1, 2, i]))
        other.allocate("held", [5, 6, 7])
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    dead = [c for c in range(8) if int(pool.view.clients["pid"][c]) == pid][0]
    assert _reserved(pool, dead)
    # WHEN this process keeps working: the dead reserve is not used, check shows only the dead owner
    s = pool.allocate("mine", [9, 9])
    assert s.slot not in _reserved(pool, dead)
    assert {f.kind for f in pool.check()} <= {"leak_dead_owner"}
    # AND the dead process is reclaimed
    totals = pool.reclaim_dead()
    # THEN its sequence, its blocks and every reserved slot are back
    assert totals["sequences"] == 1
    assert _reserved(pool, dead) == []
    pool.free(s)
    assert pool.check() == []
    assert pool.stats()["num_sequences"] == 0


def test_check_reports_a_slot_reserved_by_a_detached_process(make_pool):
    # GIVEN an empty slot marked reserved by a client record nobody is attached to
    pool = make_pool(64, **CONFIG)
    pool.view.seqs["reserved"][40] = 1
    pool.view.seqs["owner_client"][40] = 7
    # WHEN the pool is checked
    findings = pool.check()
    # THEN the lost slot is reported
    assert [f.kind for f in findings] == ["free_list_corrupt"]
    assert "reserved" in findings[0].message


def test_small_tables_keep_no_reserve(make_pool):
    # GIVEN a table too small for reserves (64 slots, 32 possible processes)
    pool = make_pool(64, max_seqs=64)
    # WHEN a sequence comes and goes
    pool.free(pool.allocate("a", [1]))
    # THEN every claim went through the seqs lock and nothing is reserved
    assert _reserved(pool) == []
    assert pool.check() == []
