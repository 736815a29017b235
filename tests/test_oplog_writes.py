"""How the operation log reaches the disk (docs/REPLAY.md, csrc/oplog.c): a recording process
composes records into a chunk and writes whole chunks, when one fills and at once after a
record that says something happened; a process killed loses at most the records still in its
chunk, and what it wrote reads as a whole log (the space the core reserves past the log's end
is not part of it)."""

from __future__ import annotations

import resource
import signal
import struct
from pathlib import Path

import pytest

from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.errors import PoolError
from kvscope.allocator.oplog import read_log
from kvscope.allocator.records import OPLOG_CHUNK_MAGIC, OpCode
from tests.forking import fork_child, killed_after, wait_child

CONFIG = dict(num_blocks=64, block_size=16, num_layers=1, num_kv_heads=1, head_dim=8)
# The chunk a recording handle composes (csrc/oplog.c OPLOG_OUT): a chunk written because it
# filled is within a record of it.
CHUNK = 256 * 1024
ROUNDS = 4000  # (about 2.5 chunks of records: an allocate, 8 one-token appends, a free each)


def work(pool: KVPool, rounds: int) -> None:
    for i in range(rounds):
        seq = pool.allocate(f"r{i}", [i % 50_000 + k for k in range(8)])
        for k in range(8):
            pool.append(seq, [(i * 8 + k) % 50_000])
        pool.free(seq)


def chunks(path: Path) -> list[int]:
    """The sizes of the chunks of a log file, in file order (the whole file is chunks)."""
    data = path.read_bytes()
    sizes, at = [], 0
    while at < len(data):
        magic, size = struct.unpack_from("<II", data, at)
        assert magic == OPLOG_CHUNK_MAGIC and size % 8 == 0 and size > 0
        sizes.append(size)
        at += size
    assert at == len(data)
    return sizes


def recorded(path: Path, name: str, rounds: int) -> KVPool:
    pool = KVPool.create(name, PoolConfig(**CONFIG, record_ops=str(path)))
    work(pool, rounds)
    return pool


@pytest.mark.slow
def test_a_killed_process_loses_only_the_records_in_its_chunk(tmp_path, pool_name):
    """A process killed while recording: the log on disk is whole chunks, every one after the
    START's written because it filled, holding the run's records from its START without a gap;
    the records lost are the last ones, fewer than a chunk holds, and those kept are the same
    operations a run that closed its pool recorded first."""
    killed_log, closed_log = tmp_path / "killed.ops", tmp_path / "closed.ops"
    killed_after(lambda: recorded(killed_log, pool_name, ROUNDS))
    KVPool.attach(pool_name).unlink()  # (the killed process's pool)
    pool = recorded(closed_log, pool_name + "-c", ROUNDS)
    pool.close()
    pool.unlink()

    sizes = chunks(killed_log)
    assert len(sizes) >= 3  # (START's, then at least two that filled)
    assert all(CHUNK - 1024 < s <= CHUNK for s in sizes[1:])
    killed, closed = read_log(str(killed_log)), read_log(str(closed_log))
    assert killed.gaps == [] and closed.gaps == []
    # (its START, the operations, its close)
    assert len(closed.records) == 2 + 10 * ROUNDS and closed.records[-1].op == OpCode.CLOSE
    lost = len(closed.records) - len(killed.records)
    # (a record here is at least 8 bytes: fewer than a chunk's worth lost, and some were)
    assert 0 < lost < CHUNK // 8
    assert chunks(closed_log)[-1] <= CHUNK
    same = [(r.op, r.seq_id, r.tokens, r.blocks) for r in killed.records[1:]]
    assert same == [(r.op, r.seq_id, r.tokens, r.blocks) for r in closed.records[1 : len(same) + 1]]


def test_a_record_that_says_something_happened_is_on_disk_at_once(tmp_path, pool_name):
    """A refused operation's record is written with the records before it at once: a process
    killed after it leaves the log up to that record, the plain appends after it (still in
    its chunk) lost."""
    path = tmp_path / "run.ops"

    def run() -> KVPool:
        pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
        work(pool, 3)
        seq = pool.allocate("twice", [1, 2, 3])
        pool.free(seq)
        try:
            pool.free(seq)
        except PoolError:
            pass
        kept = pool.allocate("after", [4, 5, 6])
        for k in range(20):
            pool.append(kept, [k])
        return pool

    killed_after(run)
    KVPool.attach(pool_name).unlink()
    log = read_log(str(path))
    ops = [(r.op_name, r.status_name) for r in log.records]
    assert ops[-3:] == [("allocate", "ok"), ("free", "ok"), ("free", "refused")]
    assert len(ops) == 1 + 3 * 10 + 3
    assert log.gaps == []


def test_the_log_is_exactly_its_chunks_after_close(tmp_path, pool_name):
    """Closing writes the last chunk; the file is its chunks and nothing after them (no space
    reserved past its end shows in it), START first."""
    path = tmp_path / "run.ops"
    pool = recorded(path, pool_name, 300)
    pool.close()
    pool.unlink()
    sizes = chunks(path)
    assert sum(sizes) == path.stat().st_size
    log = read_log(str(path))
    # (its START, the operations, its close)
    assert log.records[0].op == OpCode.START and len(log.records) == 2 + 10 * 300


def test_records_a_failed_write_lost_are_counted_in_a_lost_record(tmp_path, pool_name):
    """A write of a chunk that fails (the file at its size limit) loses its records, and the
    plain appends held behind it; the next record written is a LOST counting every number
    missing before it, and the records after it follow without a gap."""
    path = tmp_path / "run.ops"

    def run() -> int:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        pool = KVPool.create(pool_name, PoolConfig(**CONFIG, record_ops=str(path)))
        pool.flush_recording()
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size, hard))
        work(pool, ROUNDS // 2)  # (more than a chunk: its write fails)
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        work(pool, 2)
        pool.close()
        pool.unlink()
        return 0

    assert wait_child(fork_child(run, alarm_s=60)) == 0
    log = read_log(str(path))
    start, lost = log.records[:2]
    assert start.op == OpCode.START and lost.op == OpCode.LOST
    assert lost.arg == lost.seq - start.seq - 1 > 1000
    assert log.gaps == [(start.seq + 1, lost.seq - 1)]
    after = log.records[2:]
    assert [r.seq for r in after] == list(range(lost.seq + 1, lost.seq + 1 + len(after)))
    assert len(after) > 20 and [r.op for r in after[-2:]] == [OpCode.FREE, OpCode.CLOSE]
