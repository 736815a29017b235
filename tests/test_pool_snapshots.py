"""Lock-free snapshots of a pool whose processes died, stopped, or stall it: consistent copies,
and stalls reported from the lock records."""

from __future__ import annotations

import inspect
import json
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable

import numpy as np
import pytest

from kvscope.allocator import KVPool, crash
from kvscope.allocator.check import check_view
from kvscope.allocator.layout import DUMP_HEADER_DTYPE, DUMP_TORN
from kvscope.allocator.probeflags import DEFAULT_LOCK_HOLD_S
from kvscope.allocator.snapshot import snapshot
from kvscope.cli import main
from kvscope.dumpfile import write_dump
from kvscope.probes.watchdog import Watchdog
from tests import lockholder
from tests.journals import journal_save

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def _fork(fn: Callable[[], None]) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:
        signal.alarm(60)
        fn()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _analyze(capsys, name: str, verb: str = "analyze") -> dict:
    main([verb, name, "--json"])
    return json.loads(capsys.readouterr().out)


def test_a_death_mid_operation_does_not_tear_later_snapshots(make_pool, tmp_path):
    # GIVEN a process killed inside an operation (holding locks, its counter odd)
    pool = make_pool(32)

    def die_inside() -> None:
        p = KVPool.attach(pool.name)
        crash.configure("txn.before_commit")
        p.allocate("doomed", PROMPT)

    pid = _fork(die_inside)
    assert os.waitpid(pid, 0)[1] & 0x7F == signal.SIGKILL
    c = int(np.flatnonzero(pool.view.clients["pid"] == pid)[0])
    assert int(pool.view.clients["seq"][c]) % 2 == 1
    # WHEN the pool is copied, before and after it is reclaimed
    before = snapshot(pool.view)
    pool.reclaim_dead()
    path = write_dump(pool.name, tmp_path / "idle.kvd")
    # THEN no copy is torn: the dead process's half-done allocation is shown rolled back, as
    # recovery leaves it (only warnings: it died holding a lock and blocks), and recovery
    # evened the dead process's counter
    assert before.torn is False
    assert {f.kind for f in check_view(before)} <= {"lock_dead_holder", "leak_dead_owner"}
    assert int(pool.view.clients["seq"][c]) % 2 == 0
    dh = np.fromfile(path, DUMP_HEADER_DTYPE, 1)[0]
    assert not int(dh["flags"]) & DUMP_TORN
    assert pool.check() == []


def test_the_stall_default_is_the_watchdogs():
    default = inspect.signature(Watchdog).parameters["threshold_s"].default
    assert default == DEFAULT_LOCK_HOLD_S


def _half_free(p: KVPool, seq) -> Callable[[], None]:
    """What a free stopped half way leaves, as the C core's transaction writes it: the locks
    held (seqs, the index shards, free), the client's counter odd, each block record saved in
    the client's undo journal before its refcount drops. Returns its rollback."""
    view, c = p.view, p.client
    locks = [p.SEQS, *p.SHARDS, p.FREE]
    for i in locks:
        lockholder.hold(p, i)
    cl = view.clients
    cl["seq"][c] += 1
    size, base = view.blocks.dtype.itemsize, view.offsets["blocks"]
    saved: list[tuple[int, int]] = []
    for k, b in enumerate(seq.block_table):
        off = base + b * size
        journal_save(p, off, size)
        saved.append((off, k * size))
        view.blocks["refcount"][b] -= 1

    def rollback() -> None:
        for off, at in reversed(saved):
            view.raw[off : off + size] = cl["journal_data"][c][at : at + size]
        cl["journal_count"][c] = 0
        cl["journal_used"][c] = 0
        cl["seq"][c] += 1
        for i in reversed(locks):
            lockholder.let_go(p, i)

    return rollback


def _stopped_mid_free(name: str, ready_w: int) -> None:
    """Attach, then stop inside a free holding seqs, the index shards and free, with half its
    writes made; when continued, roll it back and free properly."""
    p = KVPool.attach(name)
    seq = p.allocate("stalled", PROMPT)
    p.mark_computed(seq, len(PROMPT))
    rollback = _half_free(p, seq)
    os.write(ready_w, b"1")
    os.kill(os.getpid(), signal.SIGSTOP)
    rollback()
    p.free(seq)
    p.close()


@pytest.mark.slow
@pytest.mark.parametrize("verb", ["analyze", "check"])
def test_a_stopped_lock_holder_is_a_finding_and_copies_stay_consistent(
    make_pool, capsys, monkeypatch, verb
):
    # GIVEN a process stopped (SIGSTOP) half way through a free, holding three pool locks
    monkeypatch.setenv("KVSCOPE_LOCK_HOLD_S", "0.2")
    pool = make_pool(32)
    r, w = os.pipe()
    pid = _fork(lambda: _stopped_mid_free(pool.name, w))
    os.read(r, 1)
    os.waitpid(pid, os.WUNTRACED)
    try:
        # ... for longer than KVSCOPE_LOCK_HOLD_S
        time.sleep(0.3)
        # WHEN the live pool is analyzed (or checked), and listed
        rep = _analyze(capsys, pool.name, verb)
        main(["ls", "--json"])
        (listed,) = [r for r in json.loads(capsys.readouterr().out) if r["name"] == pool.name]
    finally:
        os.kill(pid, signal.SIGCONT)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    # THEN the copy is consistent: the half-done free is rolled back in it, so no error but
    # the stall's
    assert rep["pool"]["consistent"] is True
    stalls = [f for f in rep["findings"] if f["kind"] == "lock_held_too_long"]
    assert [f for f in rep["findings"] if f not in stalls and f["severity"] == "error"] == []
    # ... and each lock it holds is a lock_held_too_long naming it and its state: an error,
    # the holder being stopped (the pool is wedged until it continues), so not healthy
    assert {f["lock"] for f in stalls} >= {"seqs", "free"}
    for f in stalls:
        assert f["severity"] == "error" and f["owner_pid"] == pid
        assert f["holder_state"] == "stopped" and f["held_s"] >= 0.2
        assert f"kill -CONT {pid}" in f["message"]
    assert rep["healthy"] is False
    # ... and the stopped process is alive, and stopped, in the owners and in the listing
    assert rep["summary"]["processes"]["stopped"] == [pid]
    (owner,) = [o for o in rep["summary"]["blocks_by_owner"] if o["pid"] == pid]
    assert owner["alive"] is True and owner["stopped"] is True
    assert listed["owners_stopped"] == [pid] and pid in listed["owners_alive"]
    # ... and once it continues, nothing is left
    assert pool.check() == []


def _stopped_holding_free(name: str, ready_w: int) -> None:
    """Attach, take the free lock and stop (SIGSTOP) holding it; when continued, let go."""
    p = KVPool.attach(name)
    lockholder.hold(p, p.FREE)
    os.write(ready_w, b"1")
    os.kill(os.getpid(), signal.SIGSTOP)
    lockholder.let_go(p, p.FREE)
    p.close()


@pytest.mark.slow
def test_a_read_under_the_probes_does_not_wait_on_a_stopped_lock_holder(
    make_pool, probes, monkeypatch
):
    # GIVEN the probes `kvscope run` turns on (the magic probe's check, with conservation,
    # comes due between operations) and another process stopped holding the free lock
    pool = make_pool(32)
    r, w = os.pipe()
    pid = _fork(lambda: _stopped_holding_free(pool.name, w))
    os.read(r, 1)
    os.waitpid(pid, os.WUNTRACED)
    reads: list[int] = []

    def read() -> None:
        for _ in range(5):
            time.sleep(0.03)  # (past the check's 10 ms interval: it is due at each read)
            reads.append(pool.stats()["num_blocks"])

    reader = threading.Thread(target=read, daemon=True)
    try:
        # WHEN this process reads the pool's stats several times
        reader.start()
        reader.join(10)
        # THEN every read returns, as it does without the probes (none waits for the lock)
        assert not reader.is_alive() and reads == [32] * 5
    finally:
        os.kill(pid, signal.SIGCONT)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        reader.join(10)
    # AND once the holder lets go, the check runs again: the pool is whole
    time.sleep(0.03)
    pool.stats()
    assert pool.check() == []


@pytest.mark.slow
def test_a_dump_says_nothing_about_stalls(make_pool, tmp_path, monkeypatch, capsys):
    # GIVEN a dump taken while a lock was held for a long time (its clock is not the reader's)
    monkeypatch.setenv("KVSCOPE_LOCK_HOLD_S", "0.05")
    pool = make_pool(32)
    lockholder.hold(pool, pool.FREE)
    try:
        time.sleep(0.1)
        path = write_dump(pool, tmp_path / "held.kvd")
        live = snapshot(pool.view)
    finally:
        lockholder.let_go(pool, pool.FREE)
    # WHEN it is analyzed THEN no stall is reported from it (the live copy did report one)
    from kvscope.allocator.check import lock_findings

    assert [f.kind for f in lock_findings(live)] == ["lock_held_too_long"]
    rep = _analyze(capsys, str(path))
    assert not [f for f in rep["findings"] if f["kind"] == "lock_held_too_long"]
