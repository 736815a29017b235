"""The allocator-side probes: flight recorder, ownership sites, the exit leak summary."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvscope.allocator.events import events_for_block, recent_events
from kvscope.allocator.sites import site_text


def test_flight_recorder_keeps_each_blocks_last_events(make_pool, monkeypatch):
    # GIVEN a pool with the events probe on
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(16)
    # WHEN a block is allocated, shared by a fork, copied on write and freed
    seq = pool.allocate("r1", [1, 2, 3, 4, 5])
    child = pool.fork(seq, "r2")
    ((src, dst),) = pool.append(child, [6])
    pool.free(child)
    pool.free(seq)
    # THEN its last events come back in order, with pid, request and generation
    ops = [e["op"] for e in events_for_block(pool.view, src)]
    assert ops == ["allocate", "fork", "cow", "free"]
    assert {e["pid"] for e in events_for_block(pool.view, src)} == {os.getpid()}
    assert events_for_block(pool.view, src)[0]["request"] == "r1"
    assert [e["op"] for e in events_for_block(pool.view, dst)] == ["allocate", "free"]
    assert len(recent_events(pool.view, 3)) == 3


def test_an_abort_is_recorded_as_abort_and_a_free_as_free(make_pool, monkeypatch):
    # GIVEN a pool with the events probe on, one short and one long sequence (released in chunks)
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(200)
    done = pool.allocate("done", [1, 2, 3, 4, 5])
    gone = pool.allocate("gone", list(range(600)))
    # WHEN one is freed and the other aborted
    pool.free(done)
    pool.abort(gone)
    # THEN the release events say which
    ops = {
        e["request"]: e["op"] for e in recent_events(pool.view, 400) if e["op"] in ("free", "abort")
    }
    assert ops == {"done": "free", "gone": "abort"}


def test_ownership_records_the_first_frame_outside_kvscope(make_pool, monkeypatch):
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    pool = make_pool(16)
    seq = pool.allocate("r", [1, 2, 3])  # this line is the allocation site
    text = site_text(pool.view, int(pool.view.blocks["site"][seq.block_table[0]]))
    assert text is not None and "test_probes.py:" in text and "test_ownership_records" in text
    pool.free(seq)


LEAKY = """
import sys
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=32, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
def serve_one(i):
    return pool.allocate(f"req-{i}", list(range(9)))
kept = [serve_one(i) for i in range(3)]  # never freed
"""


@pytest.mark.slow
def test_exit_summary_names_leaked_blocks_by_allocation_site(tmp_path, pool_name):
    # GIVEN a script that leaves three requests' blocks allocated at exit
    script = tmp_path / "leaky.py"
    script.write_text(LEAKY)
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    # WHEN it runs under kvscope
    out = subprocess.run(
        [kvscope, "run", "--dump-dir", str(tmp_path), str(script), pool_name],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # THEN a LeakSanitizer-style summary counts them and names where they were allocated
    assert "LEAK SUMMARY" in out.stderr, out.stderr
    line = next(x for x in out.stderr.splitlines() if "LEAK SUMMARY" in x)
    assert "9 blocks" in line and "3 request(s)" in line
    assert "leaky.py:6 serve_one" in out.stderr


def test_a_leak_summary_is_one_write_so_processes_sharing_stderr_do_not_interleave(
    make_pool, monkeypatch
):
    # GIVEN a pool with a request still held, the leaks probe on, and stderr recording writes
    import io

    from kvscope.child import held, leak_summary

    monkeypatch.setenv("KVSCOPE_LEAKS", "1")
    pool = make_pool(16)
    pool.allocate("kept", list(range(9)))
    writes: list[str] = []

    class Recording(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

    monkeypatch.setattr("sys.stderr", Recording())
    # WHEN its summary is printed
    leak_summary(pool, held(pool), "when the pool was closed")
    # THEN it is one write of whole lines (a second process's write lands after its newline)
    (text,) = writes
    assert "LEAK SUMMARY" in text and text.count("\n") >= 2 and text.endswith("\n")
