"""The operation log and `kvscope replay` (docs/REPLAY.md): record a run, replay it to the same
finding at the same operation, shrink it, and run the emitted script to the same finding; a
truncated or edited log is a one-line error."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolConfig, devicechecks, faults
from kvscope.allocator.findings import SEVERITY, FindingKind
from kvscope.allocator.oplog import OplogError, parse_log, read_log
from kvscope.allocator.prefix import fmix64
from kvscope.allocator.probeflags import ProbeFlags
from kvscope.allocator.probing import PoolProbes
from kvscope.allocator.records import OpCode, OpStatus
from kvscope.cli import main
from kvscope.probes.stores import Writers
from kvscope.replay import Session, Shrinker, emit_script, replay
from tests.forking import fork_child, wait_child
from tests.replay_work import (
    CONFIG,
    copy_work,
    lease_work,
    padded_work,
    store_work,
    work,
    worker_work,
)
from tests.scripts import run_script

HERE = Path(__file__).parent
# Every injectable fault replays (stale-padding-row, which strikes an engine's padded block
# table outside the pool, through the recorded audit of that table).
REPLAYABLE = list(faults.FAULTS)
FINDS = {
    "double-free": "double_free",
    "leak": "leak_finished",
    "oob-write": "guard_violation",
    "header-scribble": "header_corrupt",
    "block-scribble": "block_header_corrupt",
    "use-after-free": "use_after_free",
    "refcount-skew": "refcount_mismatch",
    "lock-inversion": "lock_order_cycle",
    "gil-wait": "wait_holds_gil",
    "transfer-after-free": "transfer_after_free",
    "lease-leak": "lease_leak",
    "kill-holding-lock": "lock_dead_holder",
    "foreign-slot": "foreign_slot",
    "stale-padding-row": "block_table_mismatch",
}
# The faults that strike leases: their runs take them (lease_work).
LEASE_FAULTS = {"transfer-after-free", "lease-leak"}
ALL_PROBES = ProbeFlags(
    events=True, ownership=True, guard=True, leaks=True, magic=True, digest=True
)


def record(path: Path, name: str, fault: str | None, n_ops: int = 400) -> None:
    """The workload on a new pool with every probe on (as under `kvscope run`) and `fault`
    armed, recorded into `path` (a lease fault's: lease_work; kill-holding-lock's: worker_work,
    the fault armed in the worker it kills; stale-padding-row's: padded_work, whose padded
    table it strikes; foreign-slot's with every sequence's slot provenance recorded, as
    `kvscope run`'s guard mode does)."""
    faults.configure(fault)
    pool = KVPool.create(name, PoolConfig(**CONFIG, guard=True))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        pool.trace_locks(True)
        if fault == "foreign-slot":
            pool.provenance_sample = 1
        pool.record_ops(str(path))
        run = work
        if fault in LEASE_FAULTS:
            run = lease_work
        elif fault == "kill-holding-lock":
            run = worker_work
        elif fault == "stale-padding-row":
            run = padded_work
        elif fault == "foreign-slot":
            # (swept every step as the example server's guard mode does; seed 2: seed 1's
            # fault strikes a cached block that nothing reads again, so nothing finds it)
            run = lambda pool, n: work(pool, n, seed=2, sweep=True)  # noqa: E731
        try:
            run(pool, n_ops)
        except Exception:
            pass  # (a fault may leave the workload unable to go on: the log has what it did)
        # the per-step check a scheduler runs (the magic probe's own runs every 10 ms: a short
        # run may end before it comes)
        pool.verify()
    finally:
        faults.configure(None)
        pool.close()
        pool.unlink()


@contextlib.contextmanager
def recording(path: Path, name: str) -> Iterator[KVPool]:
    """A new guard-mode pool with every probe on, recording its operations into `path` (the
    probes before the recording: its START lists them, and the replay's free returns blocks
    where the recording's did, as its close compares); closed and unlinked after."""
    pool = KVPool.create(name, PoolConfig(**CONFIG, guard=True))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        pool.record_ops(str(path))
        yield pool
    finally:
        pool.close()
        pool.unlink()


def shrunk_finding(path: Path, kind: str) -> Any:
    """The log at `path` replayed to its first finding, of `kind`, and shrunk."""
    log = read_log(str(path))
    out = replay(log, quiet=True)
    assert out.reason == "finding" and out.got is not None
    assert out.got.found[0][0] == kind
    return Shrinker(log, out).shrink()


def found_at(log) -> tuple[int, str]:
    """The first recorded operation with a finding: its number and first kind."""
    r = next(r for r in log.records if r.found)
    return r.seq, r.found[0][0]


@pytest.mark.parametrize(
    "fault",
    # (half a second to a few seconds each: the fast layer runs a pool fault and a lease's)
    [
        f
        if f in ("refcount-skew", "transfer-after-free")
        else pytest.param(f, marks=pytest.mark.slow)
        for f in REPLAYABLE
    ],
)
def test_each_fault_replays_to_its_finding_shrinks_and_the_script_finds_it(
    fault, tmp_path, pool_name, capsys
):
    path = tmp_path / "run.ops"
    record(path, pool_name, fault)
    log = read_log(str(path))
    seq, kind = found_at(log)
    assert kind == FINDS[fault]
    out = replay(log, quiet=True)
    # the same finding at the same operation, every result before it as recorded
    assert out.reason == "finding", (out.reason, out.diff)
    assert out.record is not None and out.record.seq == seq
    assert out.got is not None and (kind, out.record.found[0][1]) in out.got.found
    # (exit 1 for a finding of severity error; a dead holder's lock is a warning)
    assert out.exit_code == (1 if SEVERITY[FindingKind(kind)] == "error" else 0)
    shrunk = Shrinker(log, out).shrink()
    assert shrunk.kind == kind
    assert 1 <= len(shrunk.ops) <= 50
    script = tmp_path / "repro.py"
    script.write_text(emit_script(shrunk))
    run = run_script(str(script), tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert kind in run.stdout


def test_a_clean_run_replays_to_the_end_with_every_result_equal(tmp_path, pool_name):
    path = tmp_path / "run.ops"
    record(path, pool_name, None, n_ops=300)
    log = read_log(str(path))
    ops = [r for r in log.records if r.op != OpCode.START]
    assert len(ops) > 300
    assert {OpCode(r.op).name for r in ops} >= {
        "ALLOCATE",
        "APPEND",
        "FORK",
        "MARK_COMPUTED",
        "FREE",
        "ABORT",
    }
    out = replay(log)
    assert (out.reason, out.replayed, out.exit_code) == ("end", len(ops), 0)
    # --until N stops after the operation numbered N (the START is number 1)
    assert replay(log, until=ops[10].seq).replayed == 11


def test_a_changed_result_is_a_divergence_at_that_operation(tmp_path, pool_name):
    """A record whose block table is not what the pool gives (as a core with a bug would have
    recorded it) is a divergence there, naming the blocks."""
    path = tmp_path / "run.ops"
    record(path, pool_name, None, n_ops=60)
    log = read_log(str(path))
    victim = next(r for r in log.records if r.op == OpCode.ALLOCATE and r.blocks and r.seq > 5)
    victim.blocks = [victim.blocks[0] + 1, *victim.blocks[1:]]
    out = replay(log)
    assert out.reason == "divergence"
    assert out.record is not None and out.record.seq == victim.seq
    assert "blocks" in out.diff and out.exit_code == 1


@pytest.mark.parametrize("damage", ["truncate", "edit", "empty", "garbage"])
def test_a_damaged_log_is_one_line_exit_2(damage, tmp_path, pool_name, capsys):
    path = tmp_path / "run.ops"
    record(path, pool_name, None, n_ops=40)
    data = bytearray(path.read_bytes())
    log = read_log(str(path))
    r = log.records[5]
    if damage == "truncate":
        data = data[: len(data) - 9]
    elif damage == "edit":
        data[r.offset + 100] ^= 1  # a byte of its request
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(b"not a log at all" * 20)
    path.write_bytes(bytes(data))
    with pytest.raises(OplogError):
        read_log(str(path))
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error: ") and err.count("\n") == 1, err


def test_records_missing_stop_the_replay_there(tmp_path, pool_name, capsys):
    """A whole chunk of records cut out (as a process killed before it wrote its last records
    leaves them missing): the replay runs to the gap and stops there, saying which are
    missing."""
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
    try:
        for i in range(10):  # (a chunk a record)
            pool.free(pool.allocate(f"r{i}", [i, i + 1, i + 2]))
            pool.flush_recording()
    finally:
        pool.close()
        pool.unlink()
    data = bytearray(path.read_bytes())
    r = read_log(str(path)).records[5]
    assert r.op == OpCode.ALLOCATE
    size = int.from_bytes(data[r.offset + 4 : r.offset + 8], "little")
    del data[r.offset : r.offset + size]
    path.write_bytes(bytes(data))
    log = read_log(str(path))
    assert log.gaps == [(r.seq, r.seq + 1)]
    out = replay(log)
    assert (out.reason, out.replayed, out.lost, out.exit_code) == (
        "lost",
        4,
        (r.seq, r.seq + 1),
        1,
    )
    assert main(["replay", str(path)]) == 1
    assert f"operations {r.seq}..{r.seq + 1} are not in the log" in capsys.readouterr().out


def in_a_child(fn: Callable[[], None]) -> None:
    """fn run in a second process: a child forked from this one (a pid of its own, as a
    second program has, without a fresh interpreter's start), which must exit cleanly."""
    assert wait_child(fork_child(lambda: fn() or 0, alarm_s=60)) == 0


def _die_releasing(name: str, path: Path, create: bool) -> int:
    """In a forked child: a handle recording into `path` (attached, or creating the pool) that
    publishes a request's prompt and releases it with kill-holding-lock armed: it dies there,
    holding the locks the release took. The child's pid."""
    pid = os.fork()
    if pid == 0:
        try:
            if create:
                pool = KVPool.create(name, PoolConfig(**CONFIG, record_ops=str(path)))
            else:
                pool = KVPool.attach(name)
                pool.record_ops(str(path))
            s = pool.allocate("held", [0, 1, 2, 3, 4])
            pool.mark_computed(s, 4)  # (a published block: its release takes a shard lock)
            faults.configure("kill-holding-lock:1")
            pool.free(s)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return pid


def _last_report_and_close(log):
    """The log's last record, the handle's close, and the last record before it but the
    close's own REPORTs (a leak_finished for each sequence it found still live)."""
    close = log.records[-1]
    leaks = {("leak_finished",)}
    report = next(
        r
        for r in reversed(log.records[:-1])
        if not (r.op == OpCode.REPORT and {(k,) for k, _ in r.found} <= leaks)
    )
    return report, close


@pytest.mark.slow
def test_a_process_killed_holding_a_lock_replays_in_a_child_that_dies_there(
    tmp_path, pool_name, capsys
):
    """kill-holding-lock in a second process: the log holds the release it died in (status
    error, the fault, the table it was releasing) and the survivor's reclaim (a REPORT of the
    dead holder's locks and blocks); the replay runs the dead process in a child that really
    dies there holding a pool lock, the survivor's reclaim finds the same, the shrunk script
    forks one that dies too."""
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
    try:
        pool.allocate("a", list(range(9)))
        dead = _die_releasing(pool_name, path, create=False)
        pool.reclaim_dead()
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    died = next(r for r in log.records if r.pid == dead and r.op == OpCode.FREE)
    assert (died.status_name, died.fault_names, died.request) == (
        "error",
        ["kill-holding-lock"],
        "held",
    )
    assert len(died.blocks) == 2
    report, close = _last_report_and_close(log)  # (the survivor's reclaim, then its close)
    assert close.op == OpCode.CLOSE
    assert report.op == OpCode.REPORT and report.seq == died.seq + 1
    assert {k for k, _ in report.found} == {"lock_dead_holder", "leak_dead_owner"}
    # the replay's child dies in that release, by SIGKILL, holding a lock
    with Session(log, arm=False) as session:
        for r in log.records:
            if r.op == OpCode.START:
                if r is not log.start:
                    session.attach(r)
                continue
            if r is died:
                faults.ARMED.update({"kill-holding-lock": 1})
            got = session.run(r)
            faults.ARMED.clear()
            if r is died:
                assert got is not None
                assert (got.status, got.fault) == (OpStatus.ERROR, "kill-holding-lock")
                assert got.blocks == died.blocks
                assert "killed by SIGKILL holding pool lock(s)" in got.error, got.error
                break
    out = replay(log, quiet=True)
    assert (out.reason, out.record.seq if out.record else None) == ("finding", report.seq)
    assert out.got is not None and {k for k, _ in out.got.found} >= {"lock_dead_holder"}
    assert out.faults == {died.seq: "kill-holding-lock"}
    shrunk = Shrinker(log, out).shrink()
    assert shrunk.kind == "lock_dead_holder" and died.seq in [r.seq for r in shrunk.ops]
    assert len(shrunk.ops) <= 4
    script = tmp_path / "repro.py"
    script.write_text(emit_script(shrunk))
    run = run_script(str(script), tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"(pid {dead} of the recording) killed by SIGKILL" in run.stdout
    assert "lock_dead_holder" in run.stdout


def test_a_log_whose_creator_the_fault_killed_is_refused(tmp_path, pool_name, capsys):
    """The process that created the pool killed by kill-holding-lock: the replay's pool is
    its own (a child's would go with it): one line, exit 2."""
    path = tmp_path / "run.ops"
    _die_releasing(pool_name, path, create=True)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was killed by the fault it armed" in err, err


@pytest.mark.slow
def test_the_provenance_sweep_is_recorded_and_replays_with_provenance_on(tmp_path, pool_name):
    """Slot provenance on in the recording (START's provenance_sample): foreign-slot fires in
    the replay where it fired, and the sweep that found it (`check_provenance`, a REPORT)
    finds it again; the script turns provenance on and finds it."""
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    try:
        pool.provenance_sample = 1
        pool.record_ops(str(path))
        owner = pool.allocate("owner", list(range(9)))
        pool.mark_computed(owner, 8)
        writer = pool.allocate("writer", list(range(50, 55)))
        faults.configure("foreign-slot:1")
        pool.append(writer, [99])
        faults.configure(None)
        assert [f.kind for f in pool.check_provenance()] == ["foreign_slot"]
    finally:
        faults.configure(None)
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    assert log.start.start is not None and log.start.start["provenance_sample"] == 1
    report, close = _last_report_and_close(log)  # (the sweep's REPORT, then the close)
    assert close.op == OpCode.CLOSE
    assert report.op == OpCode.REPORT and [k for k, _ in report.found] == ["foreign_slot"]
    out = replay(log, quiet=True)
    assert (out.reason, out.record.seq if out.record else None) == ("finding", report.seq)
    shrunk = Shrinker(log, out).shrink()
    script = emit_script(shrunk)
    assert "pool.provenance_sample = 1" in script
    (tmp_path / "repro.py").write_text(script)
    run = run_script("repro.py", tmp_path)
    assert run.returncode == 1 and "foreign_slot" in run.stdout, run.stdout + run.stderr


def test_cli_json_and_a_dump_without_a_log(tmp_path, pool_name, capsys):
    path = tmp_path / "run.ops"
    record(path, pool_name, "leak")
    assert main(["replay", str(path), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["reason"] == "finding" and d["replayed_result"]["found"][0]["kind"] == "leak_finished"
    assert d["recorded"]["blocks"] == d["replayed_result"]["blocks"]
    assert main(["replay", str(tmp_path / "x.kvd")]) == 2
    assert "no operation log" in capsys.readouterr().err


def test_redacted_tokens_replay_to_the_same_finding(tmp_path, pool_name):
    path = tmp_path / "run.ops"
    faults.configure("refcount-skew")
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        pool.record_ops(str(path), redact_key=0x1234_5678_9ABC)
        work(pool, 200)
    finally:
        faults.configure(None)
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    allocs = [r for r in log.records if r.op == OpCode.ALLOCATE]
    assert all(r.redacted and r.request.startswith("h") for r in allocs)
    assert not any(set(r.tokens) <= set(range(1000)) for r in allocs)
    out = replay(log, quiet=True)
    assert out.reason == "finding" and out.got is not None
    assert out.got.found[0][0] == "refcount_mismatch"


def test_recording_off_writes_nothing_and_stop_recording_stops(tmp_path, pool_name):
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    try:
        pool.allocate("a", [1, 2, 3])
        assert not path.exists()
        pool.record_ops(str(path))
        s = pool.allocate("b", [1, 2, 3])
        pool.stop_recording()
        pool.free(s)
    finally:
        pool.close()
        pool.unlink()
    # (a SNAPSHOT after the START: the pool had a history, an allocation not recorded)
    ops = [r.op for r in parse_log(path.read_bytes())]
    assert ops == [OpCode.START, OpCode.SNAPSHOT, OpCode.ALLOCATE]


def test_two_processes_interleave_in_one_order(tmp_path, pool_name):
    """A second process attached to the pool records into the same log; the numbers of both
    interleave in one order and the replay runs both handles in it."""
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    pool.record_ops(str(path))
    try:
        a = pool.allocate("a", [1, 2, 3, 4, 5])
        pool.mark_computed(a, 5)

        def second() -> None:
            p = KVPool.attach(pool_name)
            p.record_ops(str(path))
            s = p.allocate("b", [1, 2, 3, 4, 9])
            p.free(s)
            p.close()

        in_a_child(second)
        c = pool.allocate("c", [1, 2, 3, 4, 7])
        pool.free(c)
        pool.free(a)
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    pids = [r.pid for r in log.records]
    assert len(set(pids)) == 2
    assert [r.seq for r in log.records] == list(range(1, len(log.records) + 1))
    out = replay(log)
    assert (out.reason, out.exit_code) == ("end", 0)


@pytest.mark.parametrize("flush", [False, True], ids=["close", "flush_local"])
def test_what_one_process_returns_changes_the_others_next_allocate_and_replays(
    tmp_path, pool_name, flush
):
    """A second process's close, or its pool.flush_local() before it, returns its local cache of
    free blocks to the pool's free ring, where the creator's next allocate takes them: the log's
    CLOSE (or FLUSH) record lists them, the replay closes (or flushes) that process's handle
    there, and the creator's allocate after it gets the same blocks: the replay runs to the end
    with every result as recorded."""
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    pool.record_ops(str(path))
    try:

        def second() -> None:
            p = KVPool.attach(pool_name)
            p.record_ops(str(path))
            s = p.allocate("child", list(range(100, 120)))
            p.free(s)
            if flush:
                p.flush_local()
            p.close()

        in_a_child(second)
        # every block of the pool: the ring's, and the ones the child returned to it
        every = pool.allocate("every", list(range(1000, 1000 + 4 * CONFIG["num_blocks"])))
        pool.free(every)
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    close = next(r for r in log.records if r.op == OpCode.CLOSE and r.pid != os.getpid())
    returned = next(r for r in log.records if r.op == OpCode.FLUSH) if flush else close
    assert returned.blocks and returned.status == OpStatus.OK  # (its local cache, returned)
    if flush:
        assert returned.op_name == "flush" and close.blocks == []
    taken = next(r for r in log.records if r.op == OpCode.ALLOCATE and r.request == "every")
    assert taken.seq > close.seq and set(returned.blocks) <= set(taken.blocks)
    assert log.records[-1].op == OpCode.CLOSE and log.records[-1].pid == os.getpid()
    out = replay(log)
    assert (out.reason, out.replayed, out.exit_code) == ("end", len(log.ops), 0), out.diff


def record_user_engine(tmp_path: Path, bug: str) -> str:
    """tests/user_engine.py with `bug` under `kvscope run --record-ops ue.ops`, its dump in
    `tmp_path`; the kvscope command's path."""
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    subprocess.run(
        [kvscope, "run", "--record-ops", "ue.ops", "--dump-dir", str(tmp_path),
         str(HERE / "user_engine.py"), f"user-engine-{bug}-{os.getpid()}", bug],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return kvscope


def replayed_by_the_cli(kvscope: str, tmp_path: Path, seq: int, kind: str) -> dict:
    """`kvscope replay ue.ops --json --emit-script repro.py`: the replay stops at operation
    `seq` with a finding, shrinks it to `kind` in at most 10 operations, and the script run alone
    finds `kind`. The replay's JSON."""
    out = subprocess.run(
        [kvscope, "replay", "ue.ops", "--json", "--emit-script", "repro.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    d = json.loads(out.stdout)
    assert (d["reason"], d["operation"]["seq"]) == ("finding", seq)
    assert d["shrunk"]["kind"] == kind and len(d["shrunk"]["operations"]) <= 10
    run = run_script("repro.py", tmp_path)
    assert run.returncode == 1 and kind in run.stdout, run.stdout + run.stderr
    return d


@pytest.mark.slow
def test_kvscope_run_records_the_user_engines_double_free(tmp_path):
    """tests/user_engine.py's double-free bug under `kvscope run --record-ops`: replayed to its
    finding, shrunk to the request's allocate and two frees, and the script finds it."""
    kvscope = record_user_engine(tmp_path, "double-free")
    # the dump has the run's log beside it
    (dump,) = [p.name for p in tmp_path.glob("kvscope-*.kvd")]
    assert (tmp_path / (dump + ".ops")).resolve() == (tmp_path / "ue.ops").resolve()
    out = subprocess.run(
        [kvscope, "replay", dump, "--emit-script", "repro.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "reproduced the recorded run up to a finding" in out.stdout
    assert "shrunk to 3 operation(s) that still find 'double_free'" in out.stdout
    # the timeline of the dump marks where the replay of the log beside it stopped
    out = subprocess.run(
        [kvscope, "timeline", dump, "-o", "t.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    trace = json.loads((tmp_path / "t.json").read_text())
    assert trace["otherData"]["replay"]["found"] == ["double_free"]
    run = run_script("repro.py", tmp_path)
    assert run.returncode == 1 and "double_free" in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "bug",
    ["whole-prompt", "contiguous"],  # (each a store its writers were given)
)
def test_kvscope_run_records_the_user_engines_store_bugs(bug, tmp_path):
    """tests/user_engine.py's stores into blocks their writer must not touch (a prefix hit's
    whole prompt stored over the blocks it shares; slots worked out as if the blocks were
    contiguous), found by the store check, under `kvscope run --record-ops`: replayed to the
    same finding at the same operation, shrunk, and the script finds it."""
    kvscope = record_user_engine(tmp_path, bug)
    log = read_log(str(tmp_path / "ue.ops"))
    seq, kind = found_at(log)
    if bug == "contiguous":
        # (its first prompt's slots worked out without the guard slot: guard mode's finish
        # check finds positions of its own never written, at its free, before the next
        # request's store into a published block)
        first = next(r for r in log.records if r.seq == seq)
        assert (first.op, kind) == (OpCode.FREE, "kv_never_written"), (first.op, kind)
        assert any(log.store_reports().get(r.seq) for r in log.records if r.found)
    else:
        assert log.store_reports().get(seq), "the first finding is not a store check's"
    replayed_by_the_cli(kvscope, tmp_path, seq, kind)


@pytest.mark.slow
def test_kvscope_run_records_the_user_engines_leak_and_the_close_replays(tmp_path):
    """tests/user_engine.py's exception bug (r2's sequences never ended) under `kvscope run
    --record-ops`: its leak_finished, reported as the pool closed, replays as that close (the
    same request held), shrinks about the same request, and the script finds it."""
    record_user_engine(tmp_path, "exception")
    log = read_log(str(tmp_path / "ue.ops"))
    report = next(r for r in log.records if r.op == OpCode.REPORT)
    assert report.request.startswith("r2") and report.found[0][0] == "leak_finished"
    out = replay(log, quiet=True)
    assert (out.reason, out.exit_code) == ("finding", 1), (out.reason, out.diff)
    assert out.record is not None and out.record.seq == report.seq
    shrunk = Shrinker(log, out).shrink()
    assert shrunk.kind == "leak_finished"
    assert {r.request for r in shrunk.ops} <= {"r2", "r2#1"} and report.request in {
        r.request for r in shrunk.ops
    }
    script = tmp_path / "repro.py"
    script.write_text(emit_script(shrunk))
    run = run_script(str(script), tmp_path)
    assert run.returncode == 1 and "leak_finished" in run.stdout and report.request in run.stdout


def test_a_process_that_exits_without_close_leaves_every_record(tmp_path, pool_name):
    """Records still in the core's buffer are written at exit (a program that never closes
    its pool still leaves a whole log)."""
    path = tmp_path / "run.ops"
    (tmp_path / "no_close.py").write_text(
        "from kvscope.allocator import KVPool, PoolConfig\n"
        f"p = KVPool.create({pool_name!r}, PoolConfig(num_blocks=32, block_size=4,"
        f" record_ops={str(path)!r}))\n"
        "s = p.allocate('a', [1, 2, 3]); p.mark_computed(s, 3); p.free(s); p.unlink()\n"
    )
    ran = run_script("no_close.py", tmp_path)
    assert ran.returncode == 0, ran.stderr
    ops = [r.op_name for r in read_log(str(path)).records]
    assert ops == ["start", "allocate", "mark_computed", "free"]


def test_two_threads_on_one_handle_record_their_own_arguments(tmp_path, pool_name):
    """Two threads' operations on one handle: each record holds its own thread's tokens, and
    the log replays to the end in the order the operations returned."""
    import threading

    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    pool.record_ops(str(path))

    def client(base: int) -> None:
        for i in range(150):
            s = pool.allocate(f"t{base}-{i}", [base, i % 7, base + 1, i])
            pool.append(s, [base + 2])
            pool.free(s)

    threads = [threading.Thread(target=client, args=(b,)) for b in (100, 200)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    allocs = [r for r in log.records if r.op == OpCode.ALLOCATE]
    assert len({r.tid for r in allocs}) == 2
    assert all(r.tokens[0] == int(r.request[1:4]) for r in allocs)
    appends = [r for r in log.records if r.op == OpCode.APPEND]
    assert all(r.tokens == [int(r.request[1:4]) + 2] for r in appends)
    out = replay(log)
    assert (out.reason, out.exit_code) == ("end", 0)


SERVE = [
    str(HERE.parent / "examples" / "serve.py"),
    "--requests", "48", "--num-blocks", "32", "--output-len", "64:160", "--rate", "0",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "use-after-free"])
def test_the_example_server_replays_exactly_and_shrinks(fault, tmp_path):
    """examples/serve.py on a pool small enough to preempt, under `kvscope run --record-ops`:
    every result replays as recorded (preemptions, PoolExhausted, resumes included); with a
    fault, its decode loop's appends shrink to a short script that finds it."""
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    inject = ["--inject", fault] if fault else []
    subprocess.run(
        [kvscope, "run", "--record-ops", "s.ops", *inject, *SERVE],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = read_log(str(tmp_path / "s.ops"))
    ops = [r for r in log.records if r.op != OpCode.START]
    out = replay(log, quiet=True)
    if fault is None:
        assert any(r.preempted for r in ops) and any(r.op == OpCode.RESUME for r in ops)
        assert (out.reason, out.replayed) == ("end", len(ops))
        return
    assert out.reason == "finding" and out.got is not None
    assert out.got.found[0][0] == "use_after_free"
    shrunk = Shrinker(log, out).shrink()
    assert len(shrunk.ops) <= 50
    (tmp_path / "repro.py").write_text(emit_script(shrunk))
    run = run_script("repro.py", tmp_path)
    assert run.returncode == 1 and "use_after_free" in run.stdout


def test_timeline_marks_where_the_replay_stopped(tmp_path, pool_name, capsys):
    """`kvscope timeline POOL --ops LOG`: the log replayed, and an instant across the trace at
    the operation the replay reproduced the finding at; a damaged log is one line, exit 2."""
    path = tmp_path / "run.ops"
    faults.configure("refcount-skew")
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, guard=True))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        pool.record_ops(str(path))
        try:
            work(pool, 400)
        except Exception:
            pass
        pool.verify()
        pool.flush_recording()
        seq, kind = found_at(read_log(str(path)))
        out = tmp_path / "t.json"
        assert main(["timeline", pool_name, "-o", str(out), "--ops", str(path)]) == 0
        trace = json.loads(out.read_text())
        marks = [e for e in trace["traceEvents"] if e["name"].startswith("replay ")]
        assert len(marks) == 1 and marks[0]["ph"] == "i"
        assert marks[0]["name"].startswith(f"replay reproduced the finding at operation {seq} ")
        assert trace["otherData"]["replay"]["found"] == [kind]
        assert f"stopped at operation {seq} (finding)" in capsys.readouterr().err
        bad = tmp_path / "bad.ops"
        bad.write_bytes(path.read_bytes()[:-9])
        assert main(["timeline", pool_name, "-o", str(out), "--ops", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvscope: error: ") and err.count("\n") == 1, err
    finally:
        faults.configure(None)
        pool.close()
        pool.unlink()


def _used(view) -> int:
    """Blocks of a pool view that sequences hold."""
    from kvscope.allocator.layout import BlockState

    return int((view.blocks["state"] == int(BlockState.ALLOCATED)).sum())


def test_stepping_through_a_log_gives_the_pool_at_each_operation(tmp_path, pool_name):
    """Stepper.goto(n): the pool a replay makes up to operation n, the same going forward from
    an earlier one or back from a later one; step() moves by operations."""
    from kvscope.replay import Stepper

    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
    used = {}
    try:
        seqs = [pool.allocate(f"r{i}", list(range(i, i + 9))) for i in range(4)]
        for s in seqs[:2]:
            pool.free(s)
        pool.flush_recording()
        for r in read_log(str(path)).records[1:]:
            used[r.seq] = None
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    stepper = Stepper(log)
    try:
        # each operation's pool, forward
        for seq in used:
            stepper.goto(seq)
            used[seq] = _used(stepper.view())
        first, last = min(used), max(used)
        assert used[first] == 3 and used[first + 3] == 12 and used[last] == 6
        # back, and by steps
        stepper.goto(first + 1)
        assert _used(stepper.view()) == used[first + 1]
        stepper.step(2)
        assert stepper.at == first + 3 and _used(stepper.view()) == used[first + 3]
        stepper.step(-3)
        assert stepper.at == first and stepper.record is not None
        assert "allocate r0" in stepper.describe()
        # the pool's number for the operation (the START took one) and its place in the log
        assert stepper.describe().startswith(f"operation {first} (1/")
        stepper.step(1)
        assert f"operation {first + 1} (2/" in stepper.describe()
        stepper.step(-1)
        stepper.step(-1)
        assert stepper.at == 0 and _used(stepper.view()) == 0
        # (the log's last operations: the handle's close, a REPORT of each of the two requests
        # it found still live, then its CLOSE; the pool's blocks are held still)
        stepper.goto(10**9)
        assert stepper.at == stepper.last == last + 3 and stepper.record.op == OpCode.CLOSE
        assert [r.request for r in log.records[-3:-1]] == ["r2", "r3"]
        assert _used(stepper.view()) == used[last]
    finally:
        stepper.close()


def test_top_at_without_a_log_is_one_line_exit_2(tmp_path, capsys):
    assert main(["top", str(tmp_path / "none.kvd"), "--at", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error: ") and err.count("\n") == 1, err
    assert main(["top", str(tmp_path / "none.kvd"), "--at", "-1"]) == 2


@pytest.mark.slow
def test_lease_operations_replay_with_the_recorded_holders_deadlines_and_now(
    tmp_path, pool_name, capsys
):
    """Leases in the log: the take (on a sequence and on block ids, one refused), its release
    (and a second one that ends nothing) and the sweep, with the deadline and now_ns recorded;
    the replay takes each lease with its recorded holder and deadline and sweeps at the recorded
    now_ns, so the lease past its deadline is the same lease_leak at the same operation, one
    nanosecond either side of the deadline, whatever the clock says during the replay."""
    import time

    from kvscope.allocator import PoolError

    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
    deadline = time.monotonic_ns() + 3_600 * 10**9
    try:
        a = pool.allocate("a", [1, 2, 3, 4, 5, 6])
        b = pool.allocate("b", [7, 8, 9])
        a_blocks, b_blocks = list(a.block_table), list(b.block_table)
        la = pool.lease(a, "read", holder="copier-a", deadline_ns=deadline)
        lb = pool.lease(list(b.block_table), "write", holder="copier-b", timeout=None)
        with pytest.raises(PoolError):
            pool.lease([CONFIG["num_blocks"] - 1], "read", holder="nobody")
        assert lb.release() and not pool.lease_release(lb)
        assert pool.expire_leases() == 0  # (the clock's now: an hour before the deadline)
        assert pool.expire_leases(deadline - 1) == 0
        assert pool.expire_leases(deadline) == 1
        la.release()
        pool.free(a)
        pool.free(b)
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    ops = [r for r in log.records if r.op != OpCode.START]
    takes = [r for r in ops if r.op == OpCode.LEASE]
    assert [(r.status, r.lease.mode, r.lease.holder) for r in takes if r.lease] == [
        (0, "read", "copier-a"),
        (0, "write", "copier-b"),
        (2, "read", "nobody"),
    ]
    assert takes[0].request == "a" and takes[0].seq_id >= 0 and takes[1].seq_id == -1
    assert takes[0].lease.deadline_ns == deadline and len(takes[0].lease.generations) == 2
    assert takes[1].blocks == b_blocks and takes[2].blocks == [CONFIG["num_blocks"] - 1]
    releases = [r for r in ops if r.op == OpCode.LEASE_RELEASE]
    assert [r.result for r in releases] == [1, 0, 1]
    sweeps = [r for r in ops if r.op == OpCode.EXPIRE_LEASES]
    assert [(r.arg, r.result) for r in sweeps][1:] == [(deadline - 1, 0), (deadline, 1)]
    assert sweeps[2].found == [("lease_leak", a_blocks[0])]
    out = replay(log, quiet=True)
    assert out.reason == "finding", (out.reason, out.diff)
    assert out.record is not None and out.record.seq == sweeps[2].seq
    assert out.got is not None and out.got.found == sweeps[2].found and out.got.result == 1
    # (and the rest of the run, its release of the leaked lease included, as recorded)
    assert replay(log, until=ops[-1].seq, quiet=True).reason == "finding"
    shrunk = Shrinker(log, out).shrink()
    assert [r.op for r in shrunk.ops] == [OpCode.ALLOCATE, OpCode.LEASE, OpCode.EXPIRE_LEASES]
    script = emit_script(shrunk)
    assert f"pool.lease(s1, 'read', holder='copier-a', deadline_ns={deadline})" in script
    assert f"pool.expire_leases({deadline})" in script
    (tmp_path / "repro.py").write_text(script)
    run = run_script("repro.py", tmp_path)
    assert run.returncode == 1 and "lease_leak" in run.stdout, run.stdout + run.stderr
    assert main(["replay", str(path)]) == 1  # (a lease_leak: severity error)
    text = capsys.readouterr().out
    assert "expire_leases" in text and f"now_ns {deadline}" in text


def test_a_replay_that_takes_another_lease_diverges_there(tmp_path, pool_name):
    """A lease record whose generations are not what the pool gives is a divergence at that
    take (the lease's own results are compared, not only its blocks)."""
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
    try:
        s = pool.allocate("a", [1, 2, 3, 4, 5])
        pool.lease(s, "read", holder="h").release()
        pool.free(s)
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    take = next(r for r in log.records if r.op == OpCode.LEASE)
    assert take.lease is not None
    take.lease.generations = [g + 1 for g in take.lease.generations]
    out = replay(log)
    assert out.reason == "divergence" and out.diff == ["lease"]
    assert out.record is not None and out.record.seq == take.seq


def test_a_fault_fired_on_one_thread_is_marked_in_its_own_record(tmp_path, pool_name):
    """lease-leak strikes an offload thread's release, whose announcement (a print) lets the GIL
    go: another thread's operation that runs then is recorded without the fault's mark, the
    release with it, and the log replays (at the scenario's load this happened by chance)."""
    import threading

    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
    other: list[Any] = []

    def meanwhile(name: str) -> None:
        # (deterministic: the other thread's allocation runs whole inside the announcement)
        def run() -> None:
            try:
                other.append(pool.allocate("other", [9, 9, 9]))
            except Exception as e:  # (the assertion below shows it)
                other.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join()

    faults.configure("lease-leak:1")
    faults.ON_FIRE.append(meanwhile)
    try:
        seq = pool.allocate("a", list(range(10)))
        lease = pool.lease(seq, "read", holder="offloader", timeout=None)
        pool.free(seq)
        done: list[bool] = []
        t = threading.Thread(target=lambda: done.append(lease.release()))
        t.start()
        t.join()
        assert done == [True] and faults.FIRED[-1] == "lease-leak"
        assert len(other) == 1 and not isinstance(other[0], Exception), other
        pool.free(other[0])
    finally:
        faults.ON_FIRE.remove(meanwhile)
        faults.configure(None)
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    marked = [(r.op, r.request) for r in log.records if r.fault]
    assert marked == [(OpCode.LEASE_RELEASE, "a")], marked
    assert replay(log, quiet=True).reason != "divergence"


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario, kind",
    [("transfer_after_free", "transfer_after_free"), ("lease_leak", "lease_leak")],
)
def test_the_lease_scenarios_replay_under_kvscope_run(scenario, kind, tmp_path):
    """examples/scenarios' lease faults under `kvscope run --record-ops` (a receiver thread
    releasing its write lease; the example server's offload thread releasing its read leases,
    its engine sweeping every step on the clock): the log replays to the finding at the
    recorded operation, shrinks, and the script finds it."""
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    script = HERE.parent / "examples" / "scenarios" / f"{scenario}.py"
    subprocess.run(
        [kvscope, "run", "--record-ops", "s.ops", str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = read_log(str(tmp_path / "s.ops"))
    seq, found = found_at(log)
    assert found == kind
    assert any(r.op == OpCode.LEASE for r in log.records)
    assert any(r.op == OpCode.LEASE_RELEASE and r.tid != r.pid for r in log.records)
    out = replay(log, quiet=True)
    # (what differed, where, when it did not: the log kept beside the test's other files)
    why = (out.reason, out.diff, out.record, out.got, str(tmp_path / "s.ops"))
    assert out.reason == "finding" and out.record is not None and out.record.seq == seq, why
    shrunk = Shrinker(log, out).shrink()
    assert shrunk.kind == kind and len(shrunk.ops) <= 50
    (tmp_path / "repro.py").write_text(emit_script(shrunk))
    run = run_script("repro.py", tmp_path)
    assert run.returncode == 1 and kind in run.stdout, run.stdout + run.stderr


# -- the store check's input (STORE records) ---------------------------------------------------


def record_stores(path: Path, name: str, stale: bool, n_steps: int = 60) -> None:
    """tests/replay_work.py's batched engine (store_work: every store told its writers) on a new
    pool with every probe on, recorded into `path`; with `stale`, its stale slot mapping."""
    pool = KVPool.create(name, PoolConfig(**CONFIG, guard=True, record_ops=str(path)))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        store_work(pool, n_steps, stale=stale)
    finally:
        pool.close()
        pool.unlink()


@pytest.mark.slow
def test_a_store_through_a_stale_slot_mapping_replays_to_its_finding_and_shrinks(
    tmp_path, pool_name
):
    """An engine that frees the requests finishing in a step before storing the step's K/V
    through the slot mapping it built for them: the store check's use_after_free, recorded as
    a STORE (the check's input) and its REPORT, replays to the same finding at the same
    operation, shrinks to a few operations, and the script's store finds it."""
    path = tmp_path / "run.ops"
    record_stores(path, pool_name, stale=True)
    log = read_log(str(path))
    seq, kind = found_at(log)
    assert kind == "use_after_free"
    report = next(r for r in log.records if r.seq == seq)
    assert report.op == OpCode.REPORT
    store = max(
        (r for r in log.records if r.op == OpCode.STORE and r.seq < seq), key=lambda r: r.seq
    )
    assert log.store_reports()[seq] == store.seq
    out = replay(log, quiet=True)
    assert out.reason == "finding", (out.reason, out.diff)
    assert out.record is not None and out.record.seq == seq
    assert out.got is not None and out.got.found == report.found
    assert out.exit_code == 1
    shrunk = Shrinker(log, out).shrink()
    assert shrunk.kind == kind
    assert 2 <= len(shrunk.ops) <= 6 and shrunk.ops[-1].op == OpCode.STORE
    text = emit_script(shrunk)
    assert "Writers(pool, [(s1, " in text and ".check(np.array([" in text
    script = tmp_path / "repro.py"
    script.write_text(text)
    run = run_script(str(script), tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "findings: use_after_free" in run.stdout


def test_the_same_engine_without_its_bug_replays_every_store_to_the_end(tmp_path, pool_name):
    """Without the bug every store's check finds nothing, in the recording and the replay; a
    STORE whose slots are edited to land in a finished request's block is a divergence at that
    STORE (the replay's check finds what the recording's did not)."""
    path = tmp_path / "run.ops"
    record_stores(path, pool_name, stale=False)
    log = read_log(str(path))
    stores = [r for r in log.records if r.op == OpCode.STORE]
    assert len(stores) > 20 and not any(r.found for r in log.records)
    out = replay(log)
    assert (out.reason, out.exit_code) == ("end", 0)
    # a decode step's store after some request was freed: its slot moved into that request's
    # first block, published (its prompt's) and kept cached by the prefix index
    freed = next(r for r in log.records if r.op == OpCode.FREE)
    victim = next(r for r in stores if r.seq > freed.seq and len(r.store.spans) == 1)
    victim.store.slots = [freed.blocks[0] * 4] + victim.store.slots[1:]
    out = replay(log)
    assert out.reason == "divergence" and out.diff == ["found"]
    assert out.record is not None and out.record.seq == victim.seq
    assert out.got is not None
    assert out.got.found == [("published_block_modified", freed.blocks[0])]


def test_a_log_with_store_records_reads_back_their_spans_and_slots(tmp_path, pool_name):
    """The reader gives back each store check's spans and slots as the check had them (several
    writers, slots out of order and -1 padding, a sequence's id after a resume), and a store
    checked in two parts (check_blocks at the store, check_slots where its slots are read
    back: a CUDA store's) is two records, the second naming the first; both replay."""
    path = tmp_path / "run.ops"
    # (guard mode's guard slot a slot of its own: the replay writes each store's K/V, and a
    # pool without one keeps the guard probe's canary in the last token slot)
    with recording(path, pool_name) as pool:
        a = pool.allocate("a", list(range(9)))
        b = pool.allocate("b", list(range(50, 56)))
        slots = pool.slot_mapping(b, 0, 6)[::-1] + [-1, -1] + pool.slot_mapping(a, 0, 9)
        spans = [(b, 0, 6), (a, 0, 9)]
        Writers(pool, spans).check(np.array(slots[:6] + slots[8:]))
        Writers(pool, spans).check(np.array(slots))
        w = Writers(pool, [(a, 4, 9)])
        w.check_blocks()
        w.check_slots(np.array(pool.slot_mapping(a, 4, 9)))
        ids = (b.seq_id, a.seq_id)
        pool.free(a)
        pool.free(b)
    log = read_log(str(path))
    stores = [r for r in log.records if r.op == OpCode.STORE]
    assert len(stores) == 4
    want = [(ids[0], 0, 6), (ids[1], 0, 9)]
    assert [r.store.spans for r in stores[:2]] == [want, want]
    assert stores[0].store.slots == slots[:6] + slots[8:] and stores[1].store.slots == slots
    assert [r.store.what for r in stores] == [3, 3, 1, 2]
    assert stores[2].store.slots == [] and stores[3].store.ref == stores[2].seq
    assert stores[3].store.spans == [(ids[1], 4, 9)]
    assert stores[0].request == "b" and stores[0].to_dict()["store"]["spans"][1] == list(want[1])
    # (the reversed slots of b land in its own blocks at other positions: not a finding)
    out = replay(log)
    assert (out.reason, out.exit_code) == ("end", 0)


@pytest.mark.slow
def test_a_shrunk_store_keeps_the_spans_and_slots_of_the_requests_it_still_makes(
    tmp_path, pool_name
):
    """A store of two writers, one of them a request already freed: the shrunk run keeps the
    freed writer's request (its allocate and its free) and the store, the other's gone with
    its span and slots (the store's slots are the recording's, taken in the blocks the shrunk
    run's requests hold: the freed request's, freed). The recording's handle turned its probes
    on after it began recording: the replay and the script check the store all the same."""
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        done = pool.allocate("done", list(range(6)))
        live = pool.allocate("live", list(range(50, 57)))
        stale, mine = pool.slot_mapping(done, 0, 6), pool.slot_mapping(live, 0, 7)
        pool.free(done)
        Writers(pool, [(live, 0, 7), (done, 0, 6)]).check(np.array(mine + stale))
        pool.free(live)
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    out = replay(log)
    assert out.reason == "finding" and out.got is not None
    assert {k for k, _ in out.got.found} == {"use_after_free"}
    shrunk = Shrinker(log, out).shrink()
    assert [(r.op, r.request) for r in shrunk.ops] == [
        (OpCode.ALLOCATE, "done"),
        (OpCode.FREE, "done"),
        (OpCode.STORE, "live"),
    ]
    assert len(shrunk.ops[2].store.spans) == 2  # (the record as it was: the script drops one)
    text = emit_script(shrunk)
    assert f"Writers(pool, [(s1, 0, 6)]).check(np.array({stale!r}))" in text, text
    script = tmp_path / "repro.py"
    script.write_text(text)
    run = run_script(str(script), tmp_path)
    assert run.returncode == 1 and "findings: use_after_free" in run.stdout, run.stdout


def test_with_recording_off_a_store_check_reads_one_attribute_and_composes_no_record(pool_name):
    """Not recording, a store check that finds nothing reads the handle's `recording` once and
    composes no record (its core's one call is the check's own, `store_check`)."""

    class Watched:
        def __init__(self, pool: Any, reads: list[str] | None = None):
            self._pool = pool
            self.reads: list[str] = [] if reads is None else reads

        def __getattr__(self, name: str):
            self.reads.append(name)
            if name == "core":
                return Watched(self._pool.core, self.reads)
            return getattr(self._pool, name)

    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        s = pool.allocate("a", list(range(6)))
        watched = Watched(pool)
        Writers(watched, [(s, 0, 6)]).check(np.array(pool.slot_mapping(s, 0, 6)))
        assert watched.reads.count("recording") == 1 and "oplog_store" not in watched.reads
        assert watched.reads.count("store_check") == 1
        pool.free(s)
    finally:
        pool.close()
        pool.unlink()


def _rechecked(chunk: bytearray) -> bytes:
    """A chunk with its size and check made right for its bytes (as a core would write it)."""
    chunk[4:8] = len(chunk).to_bytes(4, "little")
    chunk[8:16] = bytes(8)
    words = np.frombuffer(bytes(chunk), dtype=np.uint64).tolist()
    total = sum(w * (2 * i + 1) for i, w in enumerate(words)) % 2**64
    chunk[8:16] = fmix64(total).to_bytes(8, "little")
    return bytes(chunk)


def chunk_of(path: Path, op: OpCode) -> tuple[Any, bytes, bytearray]:
    """The first `op` record of a log where a chunk holds it alone, the log before that chunk,
    and the chunk."""
    data = path.read_bytes()
    rec = next(r for r in read_log(str(path)).records if r.op == op)
    size = int.from_bytes(data[rec.offset + 4 : rec.offset + 8], "little")
    chunk = bytearray(data[rec.offset : rec.offset + size])
    assert chunk[48] == op
    return rec, data[: rec.offset], chunk


def refused_in_one_line(path: Path, data: bytes, capsys) -> None:
    """A log of `data` (a chunk that holds what no core writes) is refused by the reader, and
    by `kvscope replay` in one line, exit 2."""
    path.write_bytes(data)
    with pytest.raises(OplogError, match="holds what no core writes"):
        read_log(str(path))
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error: ") and err.count("\n") == 1, err


def test_a_truncated_store_record_is_one_line_exit_2(tmp_path, pool_name, capsys):
    """A STORE record cut short inside its slots (its chunk otherwise whole, its check right)
    is refused in one line, as any record that holds what no core writes; so is a record of an
    operation this reader does not know (as a reader before STORE refuses one)."""
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        s = pool.allocate("a", list(range(40)))
        pool.flush_recording()
        Writers(pool, [(s, 0, 40)]).check(np.array(pool.slot_mapping(s, 0, 40)))
        pool.flush_recording()  # (the STORE alone in the last chunk)
        pool.free(s)
    finally:
        pool.close()
        pool.unlink()
    _, head, chunk = chunk_of(path, OpCode.STORE)
    for damage in ("cut", "unknown"):
        if damage == "cut":
            bad = _rechecked(chunk[:-16])  # (16 of its 40 slots' bytes gone)
        else:
            other = bytearray(chunk)
            other[48] = max(OpCode) + 1
            bad = _rechecked(other)
        refused_in_one_line(path, head + bad, capsys)
    path.write_bytes(head + _rechecked(chunk))  # (the chunk as it was: read)
    assert [r.op for r in read_log(str(path)).records][-1] == OpCode.STORE


@pytest.mark.gpu
def test_a_cuda_stores_slots_are_recorded_where_they_are_read_back(tmp_path, pool_name, probes):
    """A CUDA store's check: its writers' blocks recorded at the store, the slots it reads back
    (at settle_writes) in a second record naming the first; the replay (on a CPU pool) checks
    the same slots to the same finding at the same operation."""
    import torch

    from kvscope.kernels import store_kv
    from kvscope.probes.stores import settle_writes

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = tmp_path / "run.ops"
    pool = KVPool.create(
        pool_name, PoolConfig(**{**CONFIG, "device": "cuda"}, record_ops=str(path))
    )
    try:
        a = pool.allocate("a", list(range(8)))
        b = pool.allocate("b", [1, 2, 3])
        pool.append(a, [7])
        n = len(a.tokens)
        wrong = b.block_table[0] * pool.slots_per_block + 3
        k = torch.randn(1, CONFIG["num_kv_heads"], CONFIG["head_dim"], device="cuda")
        mapping = torch.tensor([wrong], dtype=torch.int64, device="cuda")
        kc, vc = pool.kv[0, 0], pool.kv[0, 1]
        store_kv(
            k,
            -k,
            kc,
            vc,
            mapping,
            block_size=pool.block_size,
            writers=Writers(pool, [(a, n - 1, n)]),
        )
        settle_writes(pool, wait=True)
        block = b.block_table[0]
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    stores = [r for r in log.records if r.op == OpCode.STORE]
    assert [r.store.what for r in stores] == [1, 2]
    assert stores[1].store.ref == stores[0].seq and stores[1].store.slots == [wrong]
    seq, kind = found_at(log)
    assert kind == "unmapped_write"
    out = replay(log)
    assert out.reason == "finding" and out.record is not None and out.record.seq == seq
    assert out.got is not None and out.got.found == [("unmapped_write", block)]


@pytest.mark.slow
def test_kvscope_run_records_a_store_through_a_stale_slot_mapping(tmp_path):
    """tests/replay_work.py's engine with its stale slot mapping under `kvscope run
    --record-ops` (the probes kvscope run turns on): `kvscope replay` reproduces the recorded
    run up to the store check's use_after_free, shrinks it, and the script finds it."""
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    subprocess.run(
        [kvscope, "run", "--record-ops", "run.ops", "--dump-dir", str(tmp_path),
         str(HERE / "replay_work.py"), "60", "stale-mapping"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = subprocess.run(
        [kvscope, "replay", "run.ops", "--emit-script", "repro.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    assert "reproduced the recorded run up to a finding" in out.stdout
    assert "found       use_after_free@" in out.stdout
    assert "that still find 'use_after_free'" in out.stdout
    run = run_script("repro.py", tmp_path)
    assert run.returncode == 1 and "use_after_free" in run.stdout


def record_copies(
    path: Path, name: str, skip: int = -1, tell: bool = True, device: str = "cpu"
) -> None:
    """tests/replay_work.py's engine that samples each request twice (copy_work: its
    copy-on-write copies made with copy_blocks, told the pool with `tell`) on a new guard-mode
    pool with every probe on, recorded into `path`; with `skip`, that request's copy skipped."""
    pool = KVPool.create(
        name, PoolConfig(**{**CONFIG, "device": device}, guard=True, record_ops=str(path))
    )
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        copy_work(pool, skip=skip, tell=tell)
    finally:
        pool.close()
        pool.unlink()


@pytest.mark.slow
def test_a_skipped_copy_replays_to_kv_never_written_at_the_same_free_and_shrinks(
    tmp_path, pool_name
):
    """An engine that skips one copy-on-write copy: guard mode's finish check finds the
    request's positions never written as it is freed, in the free's record. The log holds the
    copies the engine made (a COPY record each, after its append) and where each store wrote;
    the replay writes each store's K/V and makes each copy in its own pool, so the skipped
    copy leaves the same slots unwritten there: the same finding at the same operation. It
    shrinks, and the script (its stores' K/V written, its copies made) finds it."""
    path = tmp_path / "run.ops"
    record_copies(path, pool_name, skip=1)
    log = read_log(str(path))
    seq, kind = found_at(log)
    free = next(r for r in log.records if r.seq == seq)
    assert (free.op, free.request, kind) == (OpCode.FREE, "r1", "kv_never_written")
    given = [r for r in log.records if r.op == OpCode.APPEND and r.copies]
    made = [r for r in log.records if r.op == OpCode.COPY]
    assert len(given) == 4 and len(made) == 3 and log.replays_kv()
    # each COPY follows its append, with its pairs; r1's is missing
    after = {r.seq + 1: r for r in given}
    assert all(c.copies == after[c.seq].copies for c in made)
    assert [after[c.seq].request for c in made] == ["r0", "r3", "r4"]
    out = replay(log)
    assert (out.reason, out.exit_code) == ("finding", 1), (out.reason, out.diff)
    assert out.record is not None and out.record.seq == seq
    assert out.got is not None and out.got.found == free.found
    shrunk = Shrinker(log, out).shrink()
    assert shrunk.kind == kind and len(shrunk.ops) <= 10
    text = emit_script(shrunk)
    assert "write(pool, [" in text, text
    script = tmp_path / "repro.py"
    script.write_text(text)
    run = run_script(str(script), tmp_path)
    assert run.returncode == 1 and "kv_never_written" in run.stdout, run.stdout + run.stderr


def test_the_copies_made_replay_to_the_end_and_are_what_the_replay_needs(tmp_path, pool_name):
    """The same engine making every copy: nothing found, in the recording and the replay, each
    COPY compared as a record (its pairs); the replay's K/V needs them: a log whose COPY
    records are taken out (as a program's that copied without telling the pool, read with its
    K/V replayed all the same) finds the first copied-into block unwritten at its free, a
    divergence. An engine that copies without telling the pool (copy_blocks without `pool=`)
    leaves no COPY record; its log's K/V is not replayed, and it replays to the end."""
    path = tmp_path / "run.ops"
    record_copies(path, pool_name)
    log = read_log(str(path))
    assert not any(r.found for r in log.records)
    assert sum(r.op == OpCode.COPY for r in log.records) == 4 and log.replays_kv()
    out = replay(log)
    assert (out.reason, out.replayed, out.exit_code) == ("end", len(log.ops), 0), out.diff
    # (the records the replay runs, without the COPYs; the log's K/V replayed as read)
    assert log.replays_kv()
    log.records = [r for r in log.records if r.op != OpCode.COPY]
    out = replay(log)
    assert (out.reason, out.diff) == ("divergence", ["found"])
    assert out.record is not None and out.record.op == OpCode.FREE
    assert out.got is not None and {k for k, _ in out.got.found} == {"kv_never_written"}
    told = tmp_path / "untold.ops"
    record_copies(told, pool_name, tell=False)
    log = read_log(str(told))
    assert not any(r.op == OpCode.COPY for r in log.records) and not log.replays_kv()
    out = replay(log)
    assert (out.reason, out.exit_code) == ("end", 0), out.diff


def record_deferred(monkeypatch, record_fn, *args, **kwargs) -> None:
    """`record_fn(*args, **kwargs)` on a pool whose K/V checks go through the core's queue of
    device checks, as a CUDA pool's do (devicechecks.DEFERRED_ON_CPU: answered at once, applied
    at the next settle); the seam off again after it, so that a replay's pool checks the K/V in
    the operation, as a CPU pool's core does."""
    monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", True)
    try:
        record_fn(*args, **kwargs)
    finally:
        monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", False)


def answered_free(log) -> tuple[Any, Any]:
    """A log's one REPORT of a device check's answer, and the free it names."""
    answers = [r for r in log.records if r.answer]
    assert len(answers) == 1, [(r.seq, r.found) for r in answers]
    free = next(r for r in log.records if r.seq == answers[0].src_id)
    return answers[0], free


@pytest.mark.slow
def test_a_skipped_copy_on_a_deferred_check_pool_replays_to_its_answer_at_the_free(
    tmp_path, pool_name, monkeypatch, capsys
):
    """A pool whose finish check is answered at a later settle (a CUDA pool's: here the core's
    device-check queue on a CPU pool): the skipped copy's `kv_never_written` is in no free's
    record but in a REPORT of the check's answer, written where the answer is applied and naming
    the free. The replay's pool finds it in the free; the replay compares the two there and
    stops at the free with the finding, saying where the recording learned it. It shrinks, and
    the script finds it."""
    path = tmp_path / "run.ops"
    record_deferred(monkeypatch, record_copies, path, pool_name, skip=1)
    log = read_log(str(path))
    answer, free = answered_free(log)
    assert (free.op, free.request, free.found) == (OpCode.FREE, "r1", [])
    assert answer.seq > free.seq and {k for k, _ in answer.found} == {"kv_never_written"}
    assert found_at(log) == (answer.seq, "kv_never_written")
    out = replay(log)
    assert (out.reason, out.diff, out.exit_code) == ("finding", [], 1)
    assert out.record is not None and out.record.seq == free.seq
    assert out.got is not None and out.got.found == answer.found == out.record.found
    assert out.answered_at == [answer.seq]
    capsys.readouterr()
    assert main(["replay", str(path), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert (d["reason"], d["operation"]["seq"], d["answered_at"]) == (
        "finding", free.seq, [answer.seq]
    )  # fmt: skip
    assert d["recorded"]["found"] == d["replayed_result"]["found"] != []
    assert main(["replay", str(path)]) == 1
    assert f"applied at a later settle: REPORT {answer.seq}" in capsys.readouterr().out
    shrunk = Shrinker(log, out).shrink()
    assert shrunk.kind == "kv_never_written" and len(shrunk.ops) <= 10
    script = tmp_path / "repro.py"
    script.write_text(emit_script(shrunk))
    run = run_script(str(script), tmp_path)
    assert run.returncode == 1 and "kv_never_written" in run.stdout, run.stdout + run.stderr


def test_a_clean_run_on_a_deferred_check_pool_replays_to_the_end(tmp_path, pool_name, monkeypatch):
    """The same engine making every copy, its checks answered at later settles: nothing found,
    no REPORT of an answer, and the replay runs every record to the end as recorded."""
    path = tmp_path / "run.ops"
    record_deferred(monkeypatch, record_copies, path, pool_name)
    log = read_log(str(path))
    assert not any(r.found for r in log.records) and not log.answer_reports()
    assert sum(r.op == OpCode.COPY for r in log.records) == 4
    out = replay(log)
    assert (out.reason, out.replayed, out.exit_code) == ("end", len(log.ops), 0), out.diff


def test_a_guard_canary_answered_later_replays_to_the_release_that_checked_it(
    tmp_path, pool_name, monkeypatch
):
    """oob-write on a pool whose canary checks are answered at a later settle: the
    guard_violation is a REPORT of the answer naming the release whose check found it; the
    replay's pool finds it in that release, where the replay stops with it."""
    path = tmp_path / "run.ops"
    record_deferred(monkeypatch, record, path, pool_name, "oob-write", n_ops=60)
    log = read_log(str(path))
    answers = [r for r in log.records if r.answer]
    assert answers and {k for k, _ in answers[0].found} == {"guard_violation"}
    freed = next(r for r in log.records if r.seq == answers[0].src_id)
    assert freed.op in (OpCode.FREE, OpCode.ABORT) and not freed.found
    out = replay(log, quiet=True)
    assert (out.reason, out.diff) == ("finding", []), out.diff
    assert out.record is not None and out.record.seq == freed.seq
    assert out.got is not None and out.got.found == answers[0].found
    assert out.answered_at == [answers[0].seq]


def test_a_published_block_changed_outside_the_log_diverges_at_the_hit_that_checked_it(
    tmp_path, pool_name, monkeypatch
):
    """A write into a published block's K/V that no store check saw (not in the log), on a pool
    whose digest checks are answered at a later settle: the digest check of the prefix hit that
    reads the block finds it, in a REPORT of the answer naming that allocate. The replay's K/V
    holds no such write, so its hit finds nothing: a divergence at the allocate, its recorded
    findings the REPORT's (not at the REPORT, after the free that applied it)."""
    path = tmp_path / "run.ops"

    def run() -> None:
        pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
        try:
            pool.probe = PoolProbes(pool, ProbeFlags(digest=True))
            a = pool.allocate("a", list(range(8)))
            pool.mark_computed(a, 8)
            pool.kv[:, :, a.block_table[0]] += 1.0  # (the program's own write)
            b = pool.allocate("b", list(range(8)) + [9])
            assert b.num_cached_tokens == 8
            pool.free(b)
            pool.free(a)
        finally:
            pool.close()
            pool.unlink()

    record_deferred(monkeypatch, run)
    log = read_log(str(path))
    answers = [r for r in log.records if r.answer]
    assert len(answers) == 1 and [k for k, _ in answers[0].found] == ["published_block_modified"]
    hit = next(r for r in log.records if r.seq == answers[0].src_id)
    assert (hit.op, hit.request, hit.found) == (OpCode.ALLOCATE, "b", [])
    # (applied at the settle of b's free, after the allocate)
    assert [r.op for r in log.records if hit.seq < r.seq < answers[0].seq] == []
    out = replay(log)
    assert (out.reason, out.diff) == ("divergence", ["found"])
    assert out.record is not None and out.record.seq == hit.seq
    assert out.record.found == answers[0].found and out.got is not None and out.got.found == []
    assert out.answered_at == [answers[0].seq]


@pytest.mark.gpu
def test_a_skipped_copy_on_a_cuda_pool_replays_to_its_answer_at_the_free(tmp_path, pool_name):
    """The skipped copy on a CUDA pool: the finish check is answered at a later settle, in a
    REPORT naming the free; the replay (a CPU pool) finds it in the free and stops there."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = tmp_path / "run.ops"
    record_copies(path, pool_name, skip=1, device="cuda")
    log = read_log(str(path))
    answer, free = answered_free(log)
    assert (free.op, free.request, free.found) == (OpCode.FREE, "r1", [])
    assert {k for k, _ in answer.found} == {"kv_never_written"}
    out = replay(log)
    assert (out.reason, out.diff) == ("finding", []), out.diff
    assert out.record is not None and out.record.seq == free.seq
    assert out.got is not None and out.got.found == answer.found
    assert out.answered_at == [answer.seq]


def test_a_truncated_copy_record_is_one_line_exit_2(tmp_path, pool_name, capsys):
    """A COPY record cut short inside its pairs (its chunk otherwise whole, its check right) is
    refused in one line, as any record that holds what no core writes."""
    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
    try:
        s = pool.allocate("a", list(range(6)))
        c = pool.fork(s, "b")
        copies = pool.append(s, [7])
        assert copies
        pool.flush_recording()
        pool.copied([a for a, _ in copies] * 8, [b for _, b in copies] * 8)
        pool.flush_recording()  # (the COPY alone in the last chunk)
        pool.free(s)
        pool.free(c)
    finally:
        pool.close()
        pool.unlink()
    copy, head, chunk = chunk_of(path, OpCode.COPY)
    assert copy.copies == copies * 8
    refused_in_one_line(path, head + _rechecked(chunk[:-8]), capsys)  # (8 of its pairs' bytes gone)
    path.write_bytes(head + _rechecked(chunk))  # (the chunk as it was: read)
    assert [r.op for r in read_log(str(path)).records][-1] == OpCode.COPY


@pytest.mark.parametrize("version", [4, 3])
def test_a_version_4_log_is_read_and_an_older_one_refused_in_one_line(
    version, tmp_path, pool_name, capsys
):
    """A log of version 4 (5 without COPY records) is read and replays; one of version 3 is
    refused in one line, exit 2."""
    path = tmp_path / "run.ops"
    record(path, pool_name, "double-free", n_ops=60)
    data = bytearray(path.read_bytes())
    start = read_log(str(path)).start
    size = int.from_bytes(data[start.offset + 4 : start.offset + 8], "little")
    chunk = bytearray(data[start.offset : start.offset + size])
    at = chunk.find(b'"version": 6')
    assert at > 0
    chunk[at : at + 12] = f'"version": {version}'.encode()
    data[start.offset : start.offset + size] = _rechecked(chunk)
    path.write_bytes(bytes(data))
    if version == 4:
        out = replay(read_log(str(path)), quiet=True)
        assert out.reason == "finding" and out.got is not None
        assert out.got.found[0][0] == "double_free"
        return
    with pytest.raises(OplogError, match="log version 3"):
        read_log(str(path))
    capsys.readouterr()  # (the recording's fault announcement)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error: ") and err.count("\n") == 1, err


@pytest.mark.slow
def test_kvscope_run_records_the_user_engines_skipped_copy(tmp_path):
    """tests/user_engine.py's skip-copy bug (r3's first sample goes on without the
    copy-on-write copy it was given) under `kvscope run --record-ops`: guard mode's
    kv_never_written at r3's free is in the log, `kvscope replay` stops at the same operation
    with the same finding, shrinks it, and the script run alone finds the same kind."""
    kvscope = record_user_engine(tmp_path, "skip-copy")
    log = read_log(str(tmp_path / "ue.ops"))
    seq, kind = found_at(log)
    free = next(r for r in log.records if r.seq == seq)
    assert (free.op, free.request, kind) == (OpCode.FREE, "r3", "kv_never_written")
    assert any(r.op == OpCode.COPY for r in log.records)
    d = replayed_by_the_cli(kvscope, tmp_path, seq, kind)
    assert (
        d["replayed_result"]["found"]
        == d["recorded"]["found"]
        == [{"kind": k, "block": b} for k, b in free.found]
    )


def test_replay_of_a_double_free_on_abort_names_the_free_and_no_block_minus_one(
    probes, make_pool, tmp_path, capsys
):
    # GIVEN an engine that frees a request (an int id) after aborting it, recorded
    log = tmp_path / "run.ops"
    pool = make_pool(16, record_ops=str(log))
    seq = pool.allocate(3, np.arange(9))
    pool.abort(seq)
    with pytest.raises(Exception, match="already aborted"):
        pool.free(seq)
    pool.close()
    # WHEN the log is replayed
    assert main(["replay", str(log)]) == 1
    out = capsys.readouterr().out
    # THEN it stops at the free, and the finding on no block reads as its kind alone
    assert "free request '3'" in out
    found = [ln for ln in out.splitlines() if ln.strip().startswith("found")]
    assert found and "double_free" in found[0] and "@-1" not in found[0], out


RECEIVER = """
import sys, torch
from kvscope.allocator import KVPool, PoolConfig
from kvscope.kernels import store_kv
from kvscope.probes.stores import Writers
late = sys.argv[2] == "late"
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=24, block_size=4, num_layers=1,
                     num_kv_heads=1, head_dim=8, dtype="float32"))
def store(seq, start, end):
    k = torch.ones(end - start, 1, 8)
    slots = torch.tensor(pool.slot_mapping(seq, start, end), dtype=torch.int64)
    store_kv(k, -k, pool.kv[0, 0], pool.kv[0, 1], slots, block_size=4,
             writers=Writers(pool, [(seq, start, end)]))
shared = pool.allocate("first", list(range(8)))
store(shared, 0, 8)
pool.mark_computed(shared, 8)
for i in range(12):
    seq = pool.allocate(f"r{i}", list(range(8)) + [100 + i] * 5)
    lease = pool.lease(seq, "write", holder="rx")
    # the transfer: the request's own positions, raw writes (the prefix is shared)
    pool.kv[:, :, seq.block_table[2:], :4] = 1.0 + i
    # a decoded token, stored with its writers (a STORE record)
    pool.append(seq, [7])
    store(seq, 13, 14)
    if late and i == 5:
        pool.free(seq)
        lease.release()
        continue
    lease.release()
    pool.free(seq)
pool.free(shared)
pool.close()
pool.unlink()
"""


@pytest.mark.slow
@pytest.mark.parametrize("late", [False, True])
def test_k_v_received_under_a_write_lease_replays_as_written(tmp_path, pool_name, late):
    """A program that receives a request's K/V under a write lease (a disaggregated prefill's
    transfer into the pages it reserved: raw writes into pool.kv, which the log does not hold)
    and stores its decoded tokens with their writers, under `kvscope run --record-ops`,
    replays to the end: the replay takes the transfer's K/V as written by the lease's release
    (or by its request's release, where that comes first), so guard mode's finish check at
    each free finds what it found in the recording, nothing. A transfer released after its
    request was freed is the recorded transfer_after_free in the replay too."""
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    (tmp_path / "receiver.py").write_text(RECEIVER)
    subprocess.run(
        [kvscope, "run", "--record-ops", "run.ops", "--dump-dir", str(tmp_path), "--fail-on",
         "never", "receiver.py", pool_name, "late" if late else "in-time"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    log = read_log(str(tmp_path / "run.ops"))
    assert log.replays_kv()
    recorded = [k for r in log.records for k, _ in r.found]
    assert recorded == (["transfer_after_free"] if late else [])
    out = replay(log)
    if late:
        assert out.reason == "finding" and out.got is not None
        assert [k for k, _ in out.got.found] == ["transfer_after_free"]
    else:
        assert (out.reason, out.exit_code) == ("end", 0), out.diff


def test_a_shrink_keeps_the_operation_that_found_it_not_another_that_finds_the_kind(
    tmp_path, pool_name
):
    """A store after its request's free (use_after_free at that store) in a run where another
    request's clean store lands, on a fresh pool without the first request, in blocks nobody
    holds: the shrunk run finds the kind at the recorded store, of the request that freed, not
    at the other store (a false reproduction)."""
    path = tmp_path / "run.ops"
    with recording(path, pool_name) as pool:
        a = pool.allocate("a", list(range(8)))
        late = pool.slot_mapping(a, 0, 8)
        b = pool.allocate("b", list(range(50, 58)))
        Writers(pool, [(b, 0, 8)]).check(np.array(pool.slot_mapping(b, 0, 8)))
        pool.free(a)
        Writers(pool, [(a, 0, 8)]).check(np.array(late))  # (the bug: a store after the free)
        pool.free(b)
    shrunk = shrunk_finding(path, "use_after_free")
    stores = [r for r in shrunk.ops if r.op == OpCode.STORE]
    frees = [r for r in shrunk.ops if r.op == OpCode.FREE]
    # the free and the store after it kept, the other request's operations dropped
    assert [r.request for r in frees] == ["a"] and len(stores) == 1
    assert stores[-1] is shrunk.ops[-1] and {r.request for r in shrunk.ops} <= {"a", ""}


def test_a_replays_pools_go_with_its_session_not_at_the_collectors_next_pass(tmp_path, pool_name):
    """A shrink runs a fresh pool per candidate, hundreds of them: each session's pool is let
    go when the session closes (a cycle through the handle's `on_finding` kept every one
    mapped until the cyclic collector ran; one shrink held 24 GB)."""
    import gc
    import weakref

    path = tmp_path / "run.ops"
    record(path, pool_name, None, n_ops=40)
    log = read_log(str(path))
    was = gc.isenabled()
    gc.disable()
    try:
        with Session(log) as session:
            pools = [weakref.ref(h) for h in session.handles.values()]
        del session
        assert pools and all(p() is None for p in pools)
    finally:
        if was:
            gc.enable()


def test_a_store_through_another_requests_table_shrinks_past_the_requests_before_it(
    tmp_path, pool_name
):
    """A store of one request's K/V through another's slot mapping (unmapped_write), after
    requests that took the pool's first blocks: a candidate without them hands the two
    requests other block ids, and the STORE's recorded slots are taken in the blocks their
    requests hold in that run (Session.reloc), so the shrink drops them; the script's store
    is given those slots and finds the same kind."""
    path = tmp_path / "run.ops"
    with recording(path, pool_name) as pool:
        olds = [pool.allocate(f"old{i}", list(range(i * 100, i * 100 + 8))) for i in range(6)]
        a = pool.allocate("a", list(range(1000, 1008)))
        b = pool.allocate("b", list(range(2000, 2008)))
        for s in olds:
            pool.free(s)
        # (the bug: a's K/V stored through b's table)
        Writers(pool, [(a, 0, 8)]).check(np.array(pool.slot_mapping(b, 0, 8)))
        pool.free(a)
        pool.free(b)
    shrunk = shrunk_finding(path, "unmapped_write")
    assert shrunk.kind == "unmapped_write"
    assert [(r.op, r.request) for r in shrunk.ops] == [
        (OpCode.ALLOCATE, "a"),
        (OpCode.ALLOCATE, "b"),
        (OpCode.STORE, "a"),
    ]
    (tmp_path / "repro.py").write_text(emit_script(shrunk))
    run = run_script("repro.py", tmp_path)
    assert run.returncode == 1 and "findings: unmapped_write" in run.stdout, run.stdout + run.stderr


def test_a_log_of_two_pools_replays_the_files_first_and_says_it_skipped_the_other(
    tmp_path, pool_name, capsys
):
    # GIVEN two pools' logs, put one after the other in one file, in both orders
    a, b = tmp_path / "a.ops", tmp_path / "b.ops"
    record(a, f"{pool_name}-a", None, n_ops=30)
    record(b, f"{pool_name}-b", None, n_ops=30)
    for first, second, name, other in ((a, b, "a", "b"), (b, a, "b", "a")):
        both = tmp_path / f"{name}{other}.ops"
        both.write_bytes(first.read_bytes() + second.read_bytes())
        # WHEN it is replayed without --pool
        assert main(["replay", str(both)]) == 0
        out = capsys.readouterr().out
        # THEN the file's first pool is replayed, and the other named as not replayed
        assert f"pool '{pool_name}-{name}'" in out.splitlines()[0]
        assert f"the log also holds pool(s) '{pool_name}-{other}', not replayed" in out


def test_a_dumps_log_of_another_pool_is_one_line_in_replay_and_timeline(
    tmp_path, pool_name, capsys
):
    from kvscope.dumpfile import write_dump

    # GIVEN a dump of one pool beside the log of another (DUMP.ops a link to it)
    theirs = tmp_path / "theirs.ops"
    record(theirs, f"{pool_name}-theirs", None, n_ops=30)
    mine = tmp_path / "mine.ops"
    pool = KVPool.create(f"{pool_name}-mine", PoolConfig(**CONFIG, record_ops=str(mine)))
    try:
        pool.free(pool.allocate("r1", [1, 2, 3]))
        dump = tmp_path / "mine.kvd"
        write_dump(pool, str(dump))
    finally:
        pool.close()
        pool.unlink()
    os.symlink(theirs, str(dump) + ".ops")
    # WHEN it is replayed, or its timeline asked for with it
    for argv in (
        ["replay", str(dump)],
        ["timeline", str(dump), "-o", str(tmp_path / "t.json")],
        ["timeline", str(dump), "-o", str(tmp_path / "t.json"), "--ops", str(theirs)],
    ):
        # THEN one line says whose it is, exit 2, instead of a replay of the other pool
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"no pool '{pool_name}-mine' in the log" in err
    # AND its own log replays
    os.unlink(str(dump) + ".ops")
    os.symlink(mine, str(dump) + ".ops")
    assert main(["replay", str(dump)]) == 0


def test_a_shrunk_leak_of_a_fork_keeps_its_parents_free_so_the_script_blames_the_fork_alone(
    tmp_path, pool_name
):
    """A fork whose parent is freed and which is never freed itself (leak_finished at the
    close, about the fork): the minimal run without the parent's free still finds it, but
    leaves the parent held too, and its script would name both; the parent's free is put back."""
    path = tmp_path / "run.ops"
    with recording(path, pool_name) as pool:
        others = [pool.allocate(f"o{i}", list(range(i * 50, i * 50 + 6))) for i in range(3)]
        parent = pool.allocate("p", list(range(500, 510)))
        pool.fork(parent, "p-s1")  # (the bug: never freed)
        pool.free(parent)
        for s in others:
            pool.free(s)
    log = read_log(str(path))
    out = replay(log, quiet=True)
    assert out.reason == "finding" and out.record is not None
    assert out.record.request == "p-s1"
    shrunk = Shrinker(log, out).shrink()
    assert shrunk.kind == "leak_finished"
    assert [(r.op, r.request) for r in shrunk.ops if r.op != OpCode.REPORT] == [
        (OpCode.ALLOCATE, "p"),
        (OpCode.FORK, "p-s1"),
        (OpCode.FREE, "p"),
    ]
    (tmp_path / "repro.py").write_text(emit_script(shrunk))
    run = run_script("repro.py", tmp_path)
    assert run.returncode == 1 and "findings: leak_finished held: p-s1\n" in run.stdout, (
        run.stdout + run.stderr
    )


def test_an_until_past_the_logs_end_says_so(tmp_path, pool_name, capsys):
    path = tmp_path / "run.ops"
    record(path, pool_name, None, n_ops=30)
    last = read_log(str(path)).records[-1].seq
    assert main(["replay", str(path), "--until", str(last + 1000)]) == 0
    assert f"--until {last + 1000} is past the log's last operation ({last})" in (
        capsys.readouterr().out
    )
    assert main(["replay", str(path), "--until", "3"]) == 0
    assert "is past the log's last operation" not in capsys.readouterr().out


def test_a_closes_leaks_are_each_shown_as_recorded_in_the_blocks_table(tmp_path, pool_name):
    # GIVEN a recording whose close found three requests still held (a REPORT each)
    path = tmp_path / "run.ops"
    with recording(path, pool_name) as pool:
        for i in range(3):
            pool.allocate(f"leaked{i}", list(range(i * 40, i * 40 + 6)))
    log = read_log(str(path))
    out = replay(log, quiet=True)
    assert out.reason == "finding" and out.got is not None
    # THEN every block the replayed close found is shown as the recording found it too, not
    # as missing from the recording (its later REPORTs are the same close's)
    leaked = {b for k, b in out.got.found if k == "leak_finished"}
    assert len(leaked) == 3
    rows = {row["block"]: row for row in out.blocks}
    assert all(rows[b]["recorded"] == rows[b]["replayed"] == "leak_finished" for b in leaked)
