"""Replaying a log that does not start at the pool's creation (docs/REPLAY.md "Starting from a
snapshot"): a recording begun on a pool with a history replays from the SNAPSHOT after its
START to the same finding as a recording of the same run from the pool's creation; a bounded
log (record_ops(limit=), `kvscope run --record-ops-limit`) wraps, and replays from the
checkpoint it keeps; a damaged snapshot record is one line, exit 2."""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.allocator import KVPool, PoolConfig, PoolError, checkpoint, faults
from kvscope.allocator.oplog import OplogError, read_log
from kvscope.allocator.prefix import fmix64
from kvscope.allocator.probing import PoolProbes
from kvscope.allocator.records import OpCode
from kvscope.cli import main
from kvscope.replay import replay
from tests.forking import fork_child, wait_child
from tests.replay_work import CONFIG, work
from tests.test_replay import ALL_PROBES, in_a_child

HERE = Path(__file__).parent
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def history(pool: KVPool) -> dict:
    """A pool's first life: live sequences (one forked, one waiting), prefix-published blocks
    and a hit on them, a lease held, and a seeded workload's frees and aborts around them."""
    a = pool.allocate("a", PROMPT + [1, 2])
    pool.mark_computed(a, len(a.tokens))
    b = pool.allocate("b", PROMPT + [3])  # (a hit on a's published blocks)
    c = pool.fork(a, "c")
    pool.set_state(b, "waiting")
    lease = pool.lease(b, "read", holder="kv-sender")
    work(pool, 120, seed=3)
    return {"a": a, "b": b, "c": c, "lease": lease}


def later(pool: KVPool, live: dict) -> None:
    """What follows: operations on the sequences and the lease of `history` (by their ids in
    the log), a new request hitting the published prefix, and a double free (the fault, armed
    at the next free)."""
    a, b, c, lease = live["a"], live["b"], live["c"], live["lease"]
    pool.append(a, [4, 5, 6])
    pool.append(c, [7])  # (copy on write: c shares a's last block)
    lease.release()
    pool.set_state(b, "running")
    pool.append(b, [8, 9])
    d = pool.allocate("d", PROMPT + [10])
    pool.free(c)
    work(pool, 60, seed=4)
    faults.configure("double-free:1")
    try:
        pool.free(d)
    finally:
        faults.configure(None)
    pool.free(a)
    pool.free(b)


def run(path: Path, name: str, midlife: bool, limit: int = 0, n_work: int = 0) -> None:
    """`history` then `later` on a new pool with every probe on, recorded into `path` from its
    creation, or (`midlife`) from between the two; `n_work` more workload steps before `later`
    (a bounded log's wraps)."""
    pool = KVPool.create(name, PoolConfig(**CONFIG, guard=True))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        pool.trace_locks(True)
        if not midlife:
            pool.record_ops(str(path), limit=limit)
        live = history(pool)
        if midlife:
            pool.record_ops(str(path), limit=limit)
        if n_work:
            work(pool, n_work, seed=5)
        later(pool, live)
        pool.verify()
    finally:
        faults.configure(None)
        pool.close()
        pool.unlink()


def finding(log) -> tuple:
    """The first recorded operation with a finding, as what it did: (op, request, seq id,
    blocks, findings)."""
    r = next(r for r in log.records if r.found)
    return r.op_name, r.request, r.seq_id, r.blocks, r.found


def test_a_recording_begun_mid_life_replays_to_the_finding_of_one_from_creation(
    tmp_path, pool_name
):
    whole, mid = tmp_path / "whole.ops", tmp_path / "mid.ops"
    run(whole, pool_name, midlife=False)
    run(mid, pool_name + "m", midlife=True)
    log_whole, log_mid = read_log(str(whole)), read_log(str(mid))
    assert log_whole.snapshot is None
    # the mid-life log starts from its snapshot: the START, then a SNAPSHOT of the pool
    assert log_mid.snapshot is not None and log_mid.start.op == OpCode.SNAPSHOT
    seqs = log_mid.snapshot.view().seqs
    live = {bytes(r).rstrip(b"\0") for r in seqs["request"][seqs["state"] != 0]}
    assert {b"a", b"b", b"c"} <= live
    assert any(log_mid.snapshot.view().leases["state"] != 0)  # (b's lease, held in it)
    assert finding(log_mid) == finding(log_whole)
    assert [k for k, _ in finding(log_mid)[4]] == ["double_free"]
    outs = [replay(log, quiet=True) for log in (log_whole, log_mid)]
    for log, out in zip((log_whole, log_mid), outs):
        at = next(r for r in log.records if r.found)
        assert out.reason == "finding", (out.reason, out.diff, out.record and out.record.to_dict())
        assert out.record is not None and out.record.seq == at.seq
        assert out.got is not None and sorted(out.got.found) == sorted(at.found)
    # the mid-life replay ran only what came after the snapshot
    assert outs[1].replayed < outs[0].replayed


@pytest.mark.slow
def test_a_mid_life_recording_of_an_attached_process_replays(tmp_path, pool_name):
    """A process attached to a pool nobody recorded records its own operations: the snapshot
    holds the creator's sequences too (its client record taken over by a handle of the
    replay's), and the attached process's live sequence is freed after it."""
    path = tmp_path / "att.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    try:
        keep = pool.allocate("creator's", PROMPT)
        pool.mark_computed(keep, len(PROMPT))

        def attached() -> None:
            p = KVPool.attach(pool_name)
            s = p.allocate("mine", [11, 12, 13, 14, 15, 16, 17, 18, 5])
            p.record_ops(str(path))
            t = p.allocate("hit", [11, 12, 13, 14, 15, 16, 17, 18, 6])
            p.append(s, [1, 2, 3])
            p.free(s)
            p.free(t)
            with pytest.raises(PoolError):
                p.free(s)
            p.close()

        in_a_child(attached)
        pool.free(keep)
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    assert log.snapshot is not None
    assert len(checkpoint.attached(log.snapshot)) == 2  # (the creator's and its own)
    ops = log.ops
    assert [r.op_name for r in ops] == ["allocate", "append", "free", "free", "free", "close"]
    assert ops[0].result == 8  # (a hit on the creator's published blocks, restored)
    assert [r.status_name for r in ops[2:]] == ["ok", "ok", "refused", "ok"]
    out = replay(log, quiet=True)
    assert (out.reason, out.replayed, out.exit_code) == ("end", len(ops), 0), out.diff


LIMIT = 64 * 1024


@pytest.mark.slow
def test_a_bounded_log_wraps_and_replays_from_its_checkpoint_to_the_same_finding(
    tmp_path, pool_name
):
    whole, ring = tmp_path / "whole.ops", tmp_path / "ring.ops"
    run(whole, pool_name, midlife=False, n_work=30000)
    run(ring, pool_name + "r", midlife=False, limit=LIMIT, n_work=30000)
    st = os.stat(ring)
    # the file's older bytes are a hole: what it holds on disk is bounded (two checkpoints'
    # distance, a chunk written past the second, the 1 MiB the core reserves ahead)
    assert st.st_size > 4 * LIMIT
    assert st.st_blocks * 512 <= 2 * LIMIT + 256 * 1024 + (1 << 20) + 64 * 1024
    log = read_log(str(ring))
    assert log.dropped > 0  # (the ring wrapped: the file begins with a hole)
    assert log.snapshot is not None and log.snapshot.meta["ring"]["limit"] == LIMIT
    assert finding(log) == finding(read_log(str(whole)))
    out = replay(log, quiet=True)
    at = next(r for r in log.records if r.found)
    assert out.reason == "finding", (out.reason, out.diff)
    assert out.record is not None and out.record.seq == at.seq
    assert out.got is not None and sorted(out.got.found) == sorted(at.found)


@pytest.mark.slow
def test_kvscope_run_with_a_bounded_log_replays_the_late_double_free(tmp_path):
    """`kvscope run --record-ops --record-ops-limit` on tests/replay_work.py's late double free
    (a request held through the workload, then freed twice): the log wrapped, and `kvscope
    replay` starts at its checkpoint (the request adopted from it) and stops at the finding."""
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    done = subprocess.run(
        [kvscope, "run", "--record-ops", "k.ops", "--record-ops-limit", "64K", "--dump-dir",
         str(tmp_path), str(HERE / "replay_work.py"), "30000", "late-double-free"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "double_free" in done.stdout + done.stderr, done.stderr
    out = subprocess.run(
        [kvscope, "replay", "k.ops"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert re.search(
        r"started from a bounded log's checkpoint at operation \d+; the ring "
        r"wrapped: the file's first \d+ bytes were dropped",
        out.stdout,
    ), out.stdout
    assert "reproduced the recorded run up to a finding" in out.stdout
    assert re.search(r"free request 'victim'", out.stdout) and "double_free" in out.stdout
    # a snapshot-started log is not shrunk: one line, exit 2
    out = subprocess.run(
        [kvscope, "replay", "k.ops", "--shrink"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "not shrunk" in out.stderr


def test_bad_limits_are_one_line_errors(tmp_path, capsys, monkeypatch):
    # (a script that exists, and must not run: each refusal comes before it starts)
    (tmp_path / "x.py").write_text("raise SystemExit('the script must not run')\n")
    monkeypatch.chdir(tmp_path)
    for argv, words in (
        (["run", "--record-ops-limit", "1M", "x.py"], "give one"),
        (["run", "--record-ops", "l.ops", "--record-ops-limit", "lots", "x.py"], "not a size"),
        (["run", "--record-ops", "l.ops", "--record-ops-limit", "1K", "x.py"], "at least"),
        (
            ["run", "--record-ops", "l.ops", "--redact", "--record-ops-limit", "1M", "x.py"],
            "redact",
        ),
        (["run", "--redact", "x.py"], "--redact hashes what --record-ops FILE records"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvscope: error: ") and err.count("\n") == 1, err
        assert words in err, err


def test_a_redacted_recording_writes_no_snapshot_and_a_bounded_one_is_refused(tmp_path, pool_name):
    path = tmp_path / "red.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    try:
        pool.allocate("a", PROMPT)
        with pytest.raises(PoolError, match="not redacted"):
            pool.record_ops(str(path), redact_key=7, limit=LIMIT)
        pool.record_ops(str(path), redact_key=7)
        pool.allocate("b", PROMPT)
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    assert log.snapshot is None
    assert main(["replay", str(path)]) == 2


def _reseal(data: bytearray, at: int) -> None:
    """The check of the chunk at `at` written again (csrc/oplog.c record_check), as a hand
    edit that knows the format would."""
    (size,) = struct.unpack_from("<I", data, at + 4)
    struct.pack_into("<Q", data, at + 8, 0)
    words = struct.unpack_from(f"<{size // 8}Q", data, at)
    h = sum(w * (2 * i + 1) for i, w in enumerate(words)) & (2**64 - 1)
    struct.pack_into("<Q", data, at + 8, fmix64(h))


@pytest.mark.parametrize("damage", ["truncate", "bytes", "version", "geometry"])
def test_a_damaged_snapshot_record_is_one_line_exit_2(damage, tmp_path, pool_name, capsys):
    path = tmp_path / "mid.ops"
    run(path, pool_name, midlife=True)
    log = read_log(str(path))
    at = log.start.offset  # (the SNAPSHOT's chunk)
    data = bytearray(path.read_bytes())
    (size,) = struct.unpack_from("<I", data, at + 4)
    payload = data.index(b"KVSS", at)
    if damage == "truncate":
        data = data[: at + size // 2]
    elif damage == "bytes":
        (n,) = struct.unpack_from("<I", data, payload + 4)
        data[payload + 8 + n] ^= 0x55  # (its compressed bytes' first: not zlib's any more)
        _reseal(data, at)
    elif damage == "version":
        i = data.index(b'"version": 1', payload)
        data[i + 11 : i + 12] = b"7"
        _reseal(data, at)
    else:
        i = data.index(b'"blocks": ', payload)  # (the offsets: another geometry's)
        j = data.index(b",", i)
        data[j - 1 : j] = b"9" if data[j - 1 : j] != b"9" else b"8"
        _reseal(data, at)
    path.write_bytes(bytes(data))
    capsys.readouterr()  # (the recording's fault announcement)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error: ") and err.count("\n") == 1, err
    if damage != "truncate":
        assert "snapshot" in err, err
    with pytest.raises((OplogError, PoolError)):
        replay(read_log(str(path)))


@pytest.mark.slow
def test_two_processes_bound_one_log_and_it_replays_from_the_others_checkpoint(tmp_path, pool_name):
    """The creator and an attached process record into one bounded log, one after the other
    (the second wraps it: its checkpoints, the file before them dropped); the replay starts at
    the checkpoint the attached process wrote, the creator's handle taking over its client
    record from the snapshot, and runs both to the end with every result as recorded."""
    path = tmp_path / "two.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG))
    try:
        pool.record_ops(str(path), limit=LIMIT)
        held = pool.allocate("held", [1, 2, 3, 4, 5])
        work(pool, 20000, seed=1)
        r, w = os.pipe()

        def attached() -> None:
            p = KVPool.attach(pool_name)
            p.record_ops(str(path), limit=LIMIT)
            s = p.allocate("child", [9, 9, 9, 9, 9, 9])
            work(p, 40000, seed=2)
            p.append(s, [1])
            p.free(s)
            os.write(w, str(p.checkpoints).encode())
            # (its close a CLOSE record: the local cache it returns, which the creator's
            # allocations after it take, returned there in the replay too)
            p.close()

        child = fork_child(lambda: attached() or 0, alarm_s=120)
        os.close(w)
        assert wait_child(child) == 0
        checkpoints = int(os.read(r, 64))
        os.close(r)
        assert checkpoints >= 2
        work(pool, 1000, seed=3)
        pool.free(held)
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    assert log.dropped > 0 and log.snapshot is not None
    assert log.start.pid == child  # (the attached process's checkpoint)
    assert {r.pid for r in log.ops} == {child, os.getpid()}
    assert [r.pid for r in log.ops if r.op == OpCode.CLOSE] == [child, os.getpid()]
    out = replay(log, quiet=True)
    assert (out.reason, out.replayed, out.exit_code) == ("end", len(log.ops), 0), out.diff


def _record_with_a_pause(path: Path, name: str, redact_key: int = 0) -> int:
    """The pool's creator records from its creation, stops recording, runs operations
    unrecorded (a free and an allocate, which change what the next allocate gets), then
    records into the same file again and runs operations on sequences of both parts. The
    number of its second START."""
    pool = KVPool.create(name, PoolConfig(**CONFIG))
    try:
        pool.record_ops(str(path), redact_key)
        a = pool.allocate("a", PROMPT + [1, 2])
        b = pool.allocate("b", [21, 22, 23, 24, 25])
        pool.stop_recording()
        pool.free(a)  # (unrecorded: its blocks go back to the handle's local cache)
        c = pool.allocate("c", [31, 32, 33, 34, 35, 36, 37, 38, 39])
        restart = int(pool.view.h["op_seq"]) + 1  # (the START's number)
        pool.record_ops(str(path), redact_key)
        d = pool.allocate("d", [41, 42, 43, 44, 45, 46, 47, 48, 49])
        pool.append(b, [26, 27, 28, 29])
        pool.free(c)
        pool.free(b)
        pool.free(d)
    finally:
        pool.close()
        pool.unlink()
    return restart


def test_a_recording_restarted_after_unrecorded_operations_replays_from_its_snapshot(
    tmp_path, pool_name
):
    """Operations a handle ran while it did not record take no number (the log shows no gap):
    its second START says so (`unrecorded`), a SNAPSHOT of the pool follows it, and the replay
    starts there, not at the creation the records before it do not lead from, and runs to the
    end with every result as recorded."""
    path = tmp_path / "pause.ops"
    restart = _record_with_a_pause(path, pool_name)
    log = read_log(str(path))
    assert not log.gaps  # (nothing in the numbers shows the unrecorded operations)
    starts = [r for r in parse_records(path) if r.op == OpCode.START]
    assert [s.seq for s in starts] == [1, restart]
    assert starts[1].start["unrecorded"] and starts[1].start["history"]
    assert not starts[0].start["unrecorded"]
    assert log.snapshot is not None and log.start.seq == restart + 1
    assert [r.op_name for r in log.ops] == ["allocate", "append", "free", "free", "free", "close"]
    out = replay(log, quiet=True)
    assert (out.reason, out.replayed, out.exit_code) == ("end", len(log.ops), 0), out.diff


def test_a_redacted_recording_restarted_after_unrecorded_operations_stops_there(
    tmp_path, pool_name, capsys
):
    """The same, redacted: no snapshot can follow the second START (it would hold the
    tokens), so the replay runs from the pool's creation and stops at that START, in one line
    that says operations before it are not in the log, exit 1."""
    path = tmp_path / "pause.ops"
    restart = _record_with_a_pause(path, pool_name, redact_key=1234)
    log = read_log(str(path))
    assert log.snapshot is None and log.breaks == [restart]
    out = replay(log, quiet=True)
    assert (out.reason, out.replayed, out.unrecorded, out.exit_code) == ("lost", 2, restart, 1)
    assert main(["replay", str(path)]) == 1
    assert (
        f"operations the pool ran before operation {restart} are not in the log"
        in capsys.readouterr().out
    )


def parse_records(path: Path) -> list:
    from kvscope.allocator.oplog import parse_log

    return parse_log(path.read_bytes())


def test_a_recording_begun_after_a_prompt_was_stored_writes_no_kv_in_its_replay(
    tmp_path, pool_name
):
    """A recording begun after a request's prompt K/V was stored (its snapshot holds no K/V):
    the request forked, its copy-on-write copy made and told to the pool, two tokens of both
    samples stored, both freed, nothing found. Its replay from the snapshot writes no K/V (else
    the prompt's slots, stored before the snapshot, would be unwritten at the free beside the
    tokens' written ones: a kv_never_written the recording did not find) and replays to the
    end."""
    import numpy as np
    import torch

    from kvscope.kernels import copy_blocks, store_kv
    from kvscope.probes.stores import Writers

    path = tmp_path / "run.ops"
    pool = KVPool.create(pool_name, PoolConfig(**CONFIG, guard=True))
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)

        def store(seq, start: int, end: int) -> None:
            k = torch.full((end - start, CONFIG["num_kv_heads"], CONFIG["head_dim"]), 0.5)
            slots = torch.tensor(pool.slot_mapping(seq, start, end), dtype=torch.int64)
            writers = Writers(pool, [(seq, start, end)])
            store_kv(k, -k, pool.kv[0, 0], pool.kv[0, 1], slots, block_size=4, writers=writers)

        s = pool.allocate("a", list(range(6)))
        store(s, 0, 6)
        pool.record_ops(str(path))
        c = pool.fork(s, "b")
        for token in (9, 10):
            for q in (s, c):
                copies = pool.append(q, [token])
                if copies:
                    pairs = torch.from_numpy(np.array(copies))
                    copy_blocks(pool.kv, pairs[:, 0], pairs[:, 1], pool=pool)
                store(q, len(q.tokens) - 1, len(q.tokens))
        pool.free(s)
        pool.free(c)
    finally:
        pool.close()
        pool.unlink()
    log = read_log(str(path))
    assert log.snapshot is not None and any(r.op == OpCode.COPY for r in log.records)
    assert not any(r.found for r in log.records) and not log.replays_kv()
    out = replay(log)
    assert (out.reason, out.exit_code) == ("end", 0), (out.reason, out.diff)
