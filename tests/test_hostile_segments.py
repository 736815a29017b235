"""Values in a segment that no allocator writes: each is a finding of the right kind, or a
one-line refusal, never an exception. The cases issue #15 found, one by one (the seeded fuzz
test, tests/test_fuzz_hostile.py, covers the rest)."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest

from kvscope.allocator import KVPool
from kvscope.allocator.checksums import block_checksums, header_checksum
from kvscope.allocator.layout import DUMP_HEADER_DTYPE, HEADER_DTYPE
from kvscope.allocator.segment import segment_path
from kvscope.cli import main
from kvscope.dumpfile import write_dump
from tests.journals import journal_save


def findings(capsys, target: str, *extra: str) -> tuple[int, list[dict]]:
    code = main(["analyze", target, "--json", *extra])
    return code, json.loads(capsys.readouterr().out)["findings"]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvscope: error: "), err
    return lines[0]


def reseal(pool) -> None:
    """Recompute every block checksum, as someone who knows the format would."""
    b = pool.view.blocks
    b["checksum"] = block_checksums(b, np.arange(len(b), dtype=np.int64))


def test_local_cache_entry_outside_the_pool(capsys, make_pool):
    pool = make_pool(32)
    pool.view.clients["local_count"][pool.client] = 2
    pool.view.clients["local"][pool.client, :2] = [10**6, -3]
    code, fs = findings(capsys, pool.name)
    assert code == 1
    assert any(f["kind"] == "free_list_corrupt" and "outside the pool" in f["message"] for f in fs)
    pool.view.clients["local_count"][pool.client] = 0


def test_free_ring_head_near_2_to_the_64(capsys, make_pool):
    pool = make_pool(32)
    pool.view.ring_header["head"] = 2**64 - 1
    code, fs = findings(capsys, pool.name)
    assert code == 1 and any(f["kind"] == "free_list_corrupt" for f in fs)
    pool.view.ring_header["head"] = 0


def test_block_state_outside_the_enum_behind_a_valid_checksum(capsys, make_pool):
    pool = make_pool(32)
    pool.view.blocks["state"][5] = 9
    reseal(pool)
    code, fs = findings(capsys, pool.name)
    assert code == 1
    (f,) = [f for f in fs if f["kind"] == "block_header_corrupt"]
    assert f["block"] == 5 and "state 9" in f["message"]


def test_block_table_entry_outside_the_pool(capsys, make_pool):
    pool = make_pool(32)
    seq = pool.allocate("req-oob", list(range(9)))
    pool.view.seqs["table"][seq.slot, 1] = 4000
    code, fs = findings(capsys, pool.name)
    assert code == 1
    (f,) = [f for f in fs if f["kind"] == "out_of_bounds"]
    assert f["request"] == "req-oob" and "block 4000" in f["message"]


@pytest.mark.parametrize(
    "field, value",
    [("num_shards", 2**31), ("num_blocks", 2**32 - 1), ("block_size", 2**31 - 1),
     ("max_blocks_per_seq", 2**31), ("index_capacity", 2**32 - 1)],
)  # fmt: skip
def test_huge_geometry_behind_a_valid_checksum_is_refused_at_once(capsys, make_pool, tmp_path, field, value):  # fmt: skip
    # GIVEN a dump and a raw segment copy whose header holds a huge field, resealed
    pool = make_pool(32)
    write_dump(pool, tmp_path / "p.kvd")
    raw = bytearray((tmp_path / "p.kvd").read_bytes())
    seg = memoryview(raw)[DUMP_HEADER_DTYPE.itemsize :]
    h = np.frombuffer(seg, HEADER_DTYPE, 1)
    h[field] = value
    h["checksum"] = header_checksum(np.frombuffer(seg, np.uint8))
    (tmp_path / "p.kvd").write_bytes(raw)
    (tmp_path / "p.seg").write_bytes(bytes(seg))
    # WHEN the raw copy is analyzed THEN one line names the field, promptly (no 2 GB list
    # of lock names)
    t0 = time.monotonic()
    assert main(["analyze", str(tmp_path / "p.seg")]) == 2
    assert field in one_line_error(capsys)
    assert time.monotonic() - t0 < 10
    # WHEN the dump is THEN it is laid out from the header it saved intact, and the changed
    # field is a header_corrupt finding
    code, fs = findings(capsys, str(tmp_path / "p.kvd"))
    assert code == 1 and [(f["kind"], f["field"]) for f in fs] == [("header_corrupt", field)]


def test_header_corrupt_names_the_field_with_the_bytes_found_and_expected(capsys, make_pool, tmp_path):  # fmt: skip
    # GIVEN a dump of a pool whose num_blocks was overwritten (the dump header keeps the
    # header as last seen intact)
    pool = make_pool(32)
    intact = pool.view.raw[:256].tobytes()
    pool.view.header["num_blocks"] = 999
    write_dump(pool, tmp_path / "p.kvd", header_prefix=intact)
    pool.view.header["num_blocks"] = 32
    # WHEN analyzed
    code, fs = findings(capsys, str(tmp_path / "p.kvd"))
    # THEN header_corrupt names num_blocks, what it holds and what it should
    (f,) = fs
    assert code == 1 and f["kind"] == "header_corrupt"
    assert f["field"] == "num_blocks" and f["offset"] == HEADER_DTYPE.fields["num_blocks"][1]
    assert f["found"] == (999).to_bytes(4, "little").hex()
    assert f["expected"] == (32).to_bytes(4, "little").hex()
    assert "num_blocks (byte 16) is 999" in f["message"] and "expected 32" in f["message"]


def test_repair_skips_a_dead_clients_journal_pointing_outside_the_segment(capsys, make_pool):
    # GIVEN a process that died mid-operation, whose journal entry was then pointed outside
    pool = make_pool(32, max_clients=4)
    pid = os.fork()
    if pid == 0:
        child = KVPool.attach(pool.name)
        child.allocate("req-dead", list(range(6)))
        journal_save(child, child.view.offsets["blocks"], 8)
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    c = pool.view.clients
    dead = int(np.flatnonzero((c["pid"] == pid) & (c["state"] == 1))[0])
    c["journal"][dead, 0]["offset"] = 2**40
    # WHEN it is repaired
    code = main(["check", pool.name, "--repair"])
    err = capsys.readouterr().err
    # THEN the journal is skipped and said to be, the rest is reclaimed, nothing raised
    assert "skipped the undo journal of dead pid" in err and "outside the" in err
    assert "reclaimed" in err and "Traceback" not in err
    assert code in (0, 1)


def test_repair_refuses_a_pool_whose_dead_process_maps_blocks_outside_it(capsys, make_pool):
    pool = make_pool(32, max_clients=4)
    pid = os.fork()
    if pid == 0:
        KVPool.attach(pool.name).allocate("req-dead", list(range(6)))
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    s = int(np.flatnonzero(pool.view.seqs["owner_pid"] == pid)[0])
    pool.view.seqs["table"][s, 0] = 10**6
    assert main(["check", pool.name, "--repair"]) == 2
    assert "cannot be repaired safely" in one_line_error(capsys)


def test_segment_files_with_huge_geometry_are_refused_by_check(capsys, make_pool):
    pool = make_pool(32)
    name = pool.name
    pool.close()
    with open(segment_path(name), "r+b") as f:
        raw = bytearray(f.read(HEADER_DTYPE.itemsize))
        h = np.frombuffer(raw, HEADER_DTYPE, 1)
        h["num_shards"] = 2**31
        h["checksum"] = header_checksum(np.frombuffer(raw, np.uint8))
        f.seek(0)
        f.write(raw)
    assert main(["check", name]) == 2
    assert "num_shards is 2147483648" in one_line_error(capsys)


def test_a_cuda_ipc_handle_is_read_as_plain_data_only():
    # GIVEN a handle blob as the creator writes it (plain tuples, ints, bytes, bools) and one
    # that names code, as a tampered segment could
    import io
    import pickle

    from kvscope.allocator.errors import PoolError
    from kvscope.allocator.kvdata import _PlainUnpickler

    handle = ((0, b"\x01" * 64, 4096, 0, b"ref", 8, b"\x02" * 64, True), 0)
    assert _PlainUnpickler(io.BytesIO(pickle.dumps(handle))).load() == handle
    # WHEN the tampered one is read THEN nothing is called: one PoolError
    with pytest.raises(PoolError, match="names posix.system"):
        _PlainUnpickler(io.BytesIO(pickle.dumps((os.system, ("true",))))).load()
