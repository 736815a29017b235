"""Idle requests (allocator/idle.py): a live request holding blocks that its process has not
served for KVSCOPE_IDLE_REQUEST_S, by its sequence record's `active_ns` (docs/FORMAT.md section
5), said by every reader of a live pool and by `kvscope run` as it lands."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.check import check_view
from kvscope.allocator.checklocks import lock_hold_threshold_s
from kvscope.allocator.errors import PoolError
from kvscope.allocator.findings import FindingKind
from kvscope.allocator.idle import idle_ages, idle_findings, idle_threshold_s
from kvscope.allocator.snapshot import snapshot
from kvscope.allocator.stats import pool_stats
from kvscope.cli import main
from kvscope.errors import UsageError
from kvscope.supervisor import idle_to_say
from kvscope.verbs.run import child_env
from tests.test_run_stop import finish, start_run, wait_for

# Longer than any pause between two adjacent lines of a test, even on a loaded machine, and
# shorter than the sleep that makes a request idle.
IDLE_S = 0.5


def active(pool, seq) -> int:
    return int(pool.view.seqs["active_ns"][seq.slot])


def test_every_call_that_serves_a_sequence_sets_its_active_time_and_reads_do_not(make_pool):
    # GIVEN a sequence just allocated: its active time is now, on CLOCK_MONOTONIC at the tick
    pool = make_pool(num_blocks=32)
    before = time.monotonic_ns()
    seq = pool.allocate("req", list(range(6)))
    assert before - 20_000_000 <= active(pool, seq) <= time.monotonic_ns()
    # WHEN each call that serves it comes after the clock has moved on, THEN it moves on too
    for serve in (
        lambda: pool.append(seq, [7]),
        lambda: pool.mark_computed(seq, 4),
        lambda: pool.set_state(seq, "waiting"),
        lambda: pool.set_state(seq, "running"),
        lambda: pool.fork(seq, "req-child"),
    ):
        was = active(pool, seq)
        time.sleep(0.03)  # (several ticks of the coarse clock)
        serve()
        assert active(pool, seq) > was
    # AND a read of it does not
    was = active(pool, seq)
    time.sleep(0.03)
    pool.slot_mapping(seq, 0, seq.num_tokens)
    pool.stats()
    assert active(pool, seq) == was


def test_a_request_not_served_while_its_process_serves_others_is_idle_request(
    make_pool, probes, monkeypatch
):
    # GIVEN a request left unserved while the process serves five others from start to end,
    # and then a request it keeps serving
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", str(IDLE_S))
    pool = make_pool(num_blocks=64)
    dropped = pool.allocate("dropped", list(range(10)))
    time.sleep(IDLE_S * 2)
    for i in range(5):
        pool.free(pool.allocate(f"other-{i}", [100 + i, 2, 3]))
    served = pool.allocate("served", [9, 8, 7])
    pool.append(served, [6])
    # WHEN a copy of the live pool is checked
    found = check_view(snapshot(pool.view))
    # THEN the first is idle_request, a warning naming it, its block and what its process did
    # meanwhile; the one served just now is not
    (f,) = [f for f in found if f.kind == FindingKind.IDLE_REQUEST]
    assert f.severity == "warning" and f.request == "dropped" and f.owner_pid == os.getpid()
    assert f.block == dropped.block_table[0]
    assert "while 5 other request(s) of the process began and ended ('other-0'" in f.message
    assert f.extra["overtaken"] == 5 and f.extra["state"] == "running"
    assert f.extra["idle_s"] >= IDLE_S
    assert "served" not in [g.request for g in found if g.kind == FindingKind.IDLE_REQUEST]
    # AND pool.check() and the metrics' stats say the same of the live pool
    assert "dropped" in [g.request for g in pool.check() if g.kind == FindingKind.IDLE_REQUEST]
    st = pool_stats(pool.view, now_mono_ns=time.monotonic_ns())
    assert st["idle_requests"] >= 1 and st["max_idle_s"] >= IDLE_S * 2


def test_an_idle_request_of_a_process_that_served_nobody_since_says_so(
    make_pool, probes, monkeypatch
):
    # GIVEN a process whose one request waits, with nothing else ended since
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", str(IDLE_S))
    pool = make_pool()
    pool.allocate("parked", list(range(5)))
    time.sleep(IDLE_S * 2)
    (f,) = idle_findings(snapshot(pool.view))
    # THEN it is said with the other reading: the process is not serving, or holds it on purpose
    assert "no request of the process began and ended since" in f.message
    assert f.extra["overtaken"] == 0


def test_requests_that_ended_before_an_idle_one_began_are_not_served_meanwhile(
    make_pool, probes, monkeypatch
):
    # GIVEN a process that serves three requests from start to end, then admits a fourth and
    # stops serving (a hang), the fourth's active time read off the coarse clock before the
    # three began (a tick behind: here made earlier still, so that the test does not depend on
    # how fast the machine runs them)
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", str(IDLE_S))
    pool = make_pool()
    before = time.monotonic_ns()
    for i in range(3):
        pool.free(pool.allocate(f"r{i}", [10 * i, 2, 3]))
    late = pool.allocate("late", list(range(5)))
    pool.view.seqs["active_ns"][late.slot] = before - 1
    time.sleep(IDLE_S * 2)
    # WHEN it is checked
    (f,) = idle_findings(snapshot(pool.view))
    # THEN the three are not counted as served while it waited (its own allocate came after
    # them): the process served nobody since, a hang's reading, not a dropped request's
    assert f.request == "late" and f.extra["overtaken"] == 0, f.message
    assert "no request of the process began and ended since" in f.message


def test_no_idle_request_in_a_dump_in_a_dead_process_or_with_the_check_off(make_pool, monkeypatch):
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", str(IDLE_S))
    pool = make_pool()
    pool.allocate("parked", list(range(5)))
    time.sleep(IDLE_S * 2)
    snap = snapshot(pool.view)
    # GIVEN the flight recorder off: said, without what the process did meanwhile
    (f,) = idle_findings(snap)
    assert "the flight recorder is off" in f.message
    # a copy that does not say when it was taken (a dump's): nothing
    del snap.taken_mono_ns
    assert idle_findings(snap) == []
    # a process that is not alive: its requests are leaks, not idle
    assert idle_findings(snapshot(pool.view), alive=lambda pid, start: False) == []
    # the check switched off
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", "0")
    assert idle_findings(snapshot(pool.view)) == []
    assert pool_stats(pool.view, now_mono_ns=time.monotonic_ns())["idle_requests"] == 0


def test_a_request_holding_no_block_is_not_idle(make_pool, probes, monkeypatch):
    # GIVEN a preempted request (its blocks went back) that waits a long time
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", str(IDLE_S))
    pool = make_pool(num_blocks=8)
    seq = pool.allocate("pre", list(range(6)))
    pool.set_state(seq, "waiting")
    pool.allocate("big", list(range(4 * 7)))  # (takes every block: preempts the waiting one)
    assert seq.state == "preempted"
    time.sleep(IDLE_S * 2)
    snap = snapshot(pool.view)
    # THEN only the request that holds blocks is said
    assert [f.request for f in idle_findings(snap)] == ["big"]


@pytest.mark.slow
def test_kvscope_run_says_a_request_its_server_dropped_while_the_server_runs(
    tmp_path, pool_name, monkeypatch
):
    # GIVEN a server that drops one request without freeing it and keeps serving others until
    # told to stop
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", "0.5")
    body = (
        "from kvscope.allocator import KVPool, PoolConfig\n"
        f"pool = KVPool.create({pool_name!r}, PoolConfig(num_blocks=32, block_size=4,"
        " num_layers=1, num_kv_heads=1, head_dim=4, dtype='float32'))\n"
        "pool.allocate('dropped', [1, 2, 3, 4, 5])\n"
        "stop = ready + '.stop'\n"
        "i = 0\n"
        "deadline = time.monotonic() + 100\n"
        "while not os.path.exists(stop) and time.monotonic() < deadline:\n"
        "    i += 1\n"
        "    pool.free(pool.allocate(f'r{i}', [i % 97, 2, 3]))\n"
        "    time.sleep(0.002)\n"
    )
    run = start_run(tmp_path, body)
    err_file = tmp_path / "err"
    try:
        # WHEN the server runs on: kvscope run says it while it runs
        wait_for(lambda: "idle_request" in err_file.read_text(), "the idle request to be said")
        (tmp_path / "ready.stop").touch()
        _, err = finish(run, tmp_path)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    # THEN once, as a warning naming the request and the requests served meanwhile
    live = [ln for ln in err.splitlines() if "idle_request" in ln]
    assert len(live) == 1, err
    assert "warning: idle_request" in live[0] and "request 'dropped'" in live[0]
    assert "other request(s) of the process began and ended" in live[0]
    # AND at the exit the request is the leak it became, said once as such
    assert "leak_finished" in err and "request 'dropped'" in err
    assert "(recorded): request 'dropped' (running)" not in err


def test_a_request_the_engine_set_waiting_is_parked_on_purpose_not_idle(make_pool, monkeypatch):
    # GIVEN a request the engine parks with set_state("waiting") (a slow client), and one it
    # forgot running, both unserved for twice the threshold
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", str(IDLE_S))
    pool = make_pool()
    parked = pool.allocate("parked", list(range(5)))
    pool.allocate("forgotten", list(range(5)))
    pool.set_state(parked, "waiting")
    time.sleep(IDLE_S * 2)
    snap = snapshot(pool.view)
    # THEN only the running one is idle_request; the waiting one's age is not counted
    assert [f.request for f in idle_findings(snap)] == ["forgotten"]
    assert np.isnan(idle_ages(snap, snap.taken_mono_ns)[parked.slot])


def test_kvscope_run_says_an_idle_request_once_then_once_more_at_ten_times_then_again_if_it_idles_again():
    again = 10 * 30.0
    state, said = (0.0, 0), []
    # found idle poll after poll: said at 31 s, not at 32..299 s, said again at 300 s, not after
    for idle_s in (31, 32, 150, 299, 300, 301, 900):
        state, say = idle_to_say(state, idle_s, again)
        said.append(say)
    assert said == [True, False, False, False, True, False, False]
    # served, then idle again: a new stretch, said again
    state, say = idle_to_say(state, 31, again)
    assert say and idle_to_say(state, 32, again)[1] is False


def test_every_reader_uses_the_thresholds_the_pools_creator_set_unless_its_own_env_sets_one(
    make_pool, monkeypatch
):
    # GIVEN a pool created by a process that set both thresholds (as `kvscope run` passes the
    # user's to its script)
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", str(IDLE_S))
    monkeypatch.setenv("KVSCOPE_LOCK_HOLD_S", "0.25")
    pool = make_pool()
    pool.allocate("parked", list(range(5)))
    time.sleep(IDLE_S * 2)
    # WHEN a reader that sets neither looks (`kvscope check` or `top` in another shell)
    monkeypatch.delenv("KVSCOPE_IDLE_REQUEST_S")
    monkeypatch.delenv("KVSCOPE_LOCK_HOLD_S")
    snap = snapshot(pool.view)
    # THEN it uses the pool's: the request is idle at the creator's threshold, not at 30 s
    assert idle_threshold_s(snap) == IDLE_S and lock_hold_threshold_s(snap) == 0.25
    assert [f.request for f in idle_findings(snap)] == ["parked"]
    assert pool_stats(pool.view, now_mono_ns=time.monotonic_ns())["idle_requests"] == 1
    # AND a reader whose own environment sets one uses its own
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", "3600")
    assert idle_threshold_s(snap) == 3600 and idle_findings(snap) == []


def test_a_pool_created_without_the_thresholds_records_the_defaults(make_pool, monkeypatch):
    monkeypatch.delenv("KVSCOPE_IDLE_REQUEST_S", raising=False)
    monkeypatch.delenv("KVSCOPE_LOCK_HOLD_S", raising=False)
    pool = make_pool()
    assert int(pool.view.header["idle_request_ms"][0]) == 30_000
    assert int(pool.view.header["lock_hold_ms"][0]) == 1_000
    # (a threshold below a millisecond is kept on, at 1 ms; 0 is off)
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", "0.0001")
    monkeypatch.setenv("KVSCOPE_LOCK_HOLD_S", "0")
    other = make_pool()
    assert int(other.view.header["idle_request_ms"][0]) == 1
    assert int(other.view.header["lock_hold_ms"][0]) == 0


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "1e10"])
def test_a_threshold_that_is_not_seconds_is_refused_in_one_line(
    value, make_pool, tmp_path, monkeypatch, capsys
):
    # GIVEN a pool, and then a malformed threshold in the environment
    pool = make_pool()
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", value)
    message = f"KVSCOPE_IDLE_REQUEST_S must be a number of seconds .* got '{value}'"
    # THEN no pool is created (and nothing is left behind)
    name = f"thr-{os.getpid()}-{value.replace('.', '')}"
    with pytest.raises(PoolError, match=message):
        KVPool.create(name, PoolConfig(num_blocks=8, num_layers=1, num_kv_heads=1, head_dim=8))
    assert not os.path.exists(f"/dev/shm/kvscope.{name}")
    # AND `kvscope run` refuses it before the script starts
    args = type("A", (), {"guard": True, "lockdep": False})()
    with pytest.raises(UsageError, match=message):
        child_env(dict(os.environ), str(tmp_path), args)
    # AND a reading verb says it in one line, exit 2
    assert main(["check", pool.name]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "KVSCOPE_IDLE_REQUEST_S must be" in err


def _child(fn) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(60)
            fn()
            code = 0
        finally:
            os._exit(code)
    return pid


@pytest.mark.slow
def test_a_stopped_process_is_said_stopped_and_one_waiting_for_its_lock_is_not_idle(
    make_pool, monkeypatch
):
    from tests import lockholder

    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", str(IDLE_S))
    pool = make_pool(num_blocks=64)
    r, w = os.pipe()

    def stopped_serving() -> None:  # a request, then SIGSTOP (no lock held)
        p = type(pool).attach(pool.name)
        p.allocate("stopped-req", list(range(10)))
        os.write(w, b"1")
        os.kill(os.getpid(), signal.SIGSTOP)
        p.close()

    def stopped_holding_free() -> None:  # the free lock, then SIGSTOP
        p = type(pool).attach(pool.name)
        lockholder.hold(p, p.FREE)
        os.write(w, b"1")
        os.kill(os.getpid(), signal.SIGSTOP)
        lockholder.let_go(p, p.FREE)
        p.close()

    def waiting() -> None:  # a request, then an allocation that waits for the free lock
        p = type(pool).attach(pool.name)
        p.allocate("waiting-req", list(range(10)))
        os.write(w, b"1")
        os.read(go_r, 1)
        p.allocate("second", list(range(50, 90)))
        p.close()

    go_r, go_w = os.pipe()
    # GIVEN a process stopped while it holds a request, and one whose next allocation waits
    # for the free lock that a third process, stopped, holds
    a = _child(stopped_serving)
    os.read(r, 1)
    c = _child(waiting)
    os.read(r, 1)
    b = _child(stopped_holding_free)
    os.read(r, 1)
    os.write(go_w, b"1")
    try:
        for pid in (a, b):
            os.waitpid(pid, os.WUNTRACED)
        wait_for(
            lambda: int(pool.view.clients["op"][pool.view.clients["pid"] == c][0]),
            "the allocation to wait for the free lock",
        )
        time.sleep(IDLE_S * 2)
        # WHEN a copy of the live pool is checked
        found = {f.request: f for f in idle_findings(snapshot(pool.view))}
        # THEN the stopped process's request is said stopped, with the way to continue it
        assert f"pid {a} is stopped (SIGSTOP or a debugger)" in found["stopped-req"].message
        assert f"kill -CONT {a}" in found["stopped-req"].message
        # AND the waiting one's request is not idle: it waits on the lock's holder
        assert "waiting-req" not in found
    finally:
        for pid in (a, b):
            os.kill(pid, signal.SIGCONT)
        for pid in (a, b, c):
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


@pytest.mark.slow
def test_kvscope_run_says_a_lock_its_stopped_worker_holds_as_it_lands_and_reads_go_on(
    tmp_path, pool_name, monkeypatch
):
    # GIVEN a server whose worker process stops (SIGSTOP) holding the pool's free lock, while
    # the server keeps reading the pool's stats (the probes' check comes due at each read)
    monkeypatch.setenv("KVSCOPE_LOCK_HOLD_S", "0.5")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    body = (
        f"sys.path.insert(0, {repo!r})\n"
        "from kvscope.allocator import KVPool, PoolConfig\n"
        "from tests import lockholder\n"
        f"pool = KVPool.create({pool_name!r}, PoolConfig(num_blocks=32, block_size=4,"
        " num_layers=1, num_kv_heads=1, head_dim=4, dtype='float32'))\n"
        "held = pool.allocate('held', [1, 2, 3, 4, 5])\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    p = KVPool.attach(pool.name)\n"
        "    lockholder.hold(p, p.FREE)\n"
        "    os.write(w, b'1')\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    lockholder.let_go(p, p.FREE)\n"
        "    p.close()\n"
        "    os._exit(0)\n"
        "os.read(r, 1)\n"
        "stop = ready + '.stop'\n"
        "reads = 0\n"
        "deadline = time.monotonic() + 100\n"
        "while not os.path.exists(stop) and time.monotonic() < deadline:\n"
        "    reads += pool.stats()['num_blocks'] == 32\n"
        "    open(ready + '.reads', 'w').write(str(reads))\n"
        "    time.sleep(0.05)\n"
        "os.kill(pid, signal.SIGCONT)\n"
        "os.waitpid(pid, 0)\n"
    )  # (the request 'held' is left held: a leak, so the run writes a dump)
    run = start_run(tmp_path, body, "--hang-after", "1")
    err_file = tmp_path / "err"
    try:
        # WHEN the worker stays stopped: the run says the lock and its holder as it lands,
        # then the stall, while the server's reads go on
        wait_for(lambda: "looks hung" in err_file.read_text(), "the stall to be said")
        time.sleep(2)
        reads = int((tmp_path / "ready.reads").read_text() or 0)
        (tmp_path / "ready.stop").touch()
        _, err = finish(run, tmp_path)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    lines = err.splitlines()
    (held_line,) = [ln for ln in lines if "lock_held_too_long" in ln and "'free'" in ln][:1]
    assert "it is stopped (SIGSTOP or a debugger)" in held_line and "kill -CONT" in held_line
    assert lines.index(held_line) < [i for i, ln in enumerate(lines) if "looks hung" in ln][0]
    assert reads >= 20, err
    # AND the dump's reason says how long the stall lasted, not the threshold it was said at
    (dump,) = [p for p in os.listdir(tmp_path) if p.endswith(".kvd")]
    from kvscope.allocator.dumpread import read_dump_header

    reason = bytes(read_dump_header(str(tmp_path / dump))["reason"]).decode()
    hung = int(reason.split("hung ")[1].split(" s")[0])
    assert hung >= 2, reason
