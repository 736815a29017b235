"""dump, analyze, check and ls through main([...]) on real pools."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvscope import analysis
from kvscope.allocator import PoolError
from kvscope.allocator.segment import segment_path
from kvscope.cli import main
from kvscope.dumpfile import read_dump, read_dump_data
from tests.scenarios import published_before_written


def analyze_json(capsys, target: str, *extra: str) -> tuple[int, dict]:
    code = main(["analyze", target, "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_dump_of_healthy_pool_analyzes_healthy(capsys, make_pool, tmp_path):
    # GIVEN a pool with a live sequence
    pool = make_pool(32)
    pool.allocate("req-1", list(range(9)))
    out = tmp_path / "p.kvd"
    # WHEN it is dumped and analyzed
    assert main(["dump", pool.name, "-o", str(out)]) == 0
    code, rep = analyze_json(capsys, str(out))
    # THEN the dump is private, the report has docs/CLI.md's keys and says healthy
    assert os.stat(out).st_mode & 0o777 == 0o600
    assert code == 0
    assert set(rep) >= {"pool", "healthy", "summary", "findings"}
    assert rep["healthy"] is True and rep["findings"] == []
    assert rep["pool"]["name"] == pool.name
    assert rep["pool"]["geometry"]["num_blocks"] == 32
    assert rep["summary"]["blocks_by_state"]["allocated"] == 3
    assert rep["summary"]["blocks_by_owner"][0]["pid"] == os.getpid()


def test_analyze_names_the_corrupted_block_and_its_request(capsys, make_pool, tmp_path):
    # GIVEN a pool where a block's refcount was changed behind the allocator's back
    pool = make_pool(32)
    seq = pool.allocate("req-7", list(range(9)))
    victim = seq.block_table[1]
    pool.view.blocks["refcount"][victim] = 5
    out = tmp_path / "p.kvd"
    assert main(["dump", pool.name, "-o", str(out)]) == 0
    # WHEN analyzed, as text and as JSON
    assert main(["analyze", str(out)]) == 1
    text = capsys.readouterr().out
    code, rep = analyze_json(capsys, str(out))
    # THEN the report is unhealthy and names the block, its owner and its request
    assert code == 1 and rep["healthy"] is False
    assert "UNHEALTHY" in text and f"block {victim}" in text and "req-7" in text
    f = next(f for f in rep["findings"] if f["block"] == victim)
    assert f["severity"] == "error" and f["owner_pid"] == os.getpid() and f["request"] == "req-7"


def test_analyze_live_pool_by_name_and_narrowed(capsys, make_pool):
    pool = make_pool(32)
    seq = pool.allocate("req-a", list(range(5)))
    pool.allocate("req-b", list(range(5)))
    code, rep = analyze_json(capsys, pool.name, "--block", str(seq.block_table[0]))
    assert code == 0
    assert rep["block"]["mapped_by"] == ["req-a"] and rep["block"]["state"] == "allocated"
    code, rep = analyze_json(capsys, pool.name, "--request", "req-b")
    assert rep["request"]["sequences"][0]["num_tokens"] == 5


def test_analyze_of_a_request_nothing_names_is_an_error(capsys, make_pool):
    # GIVEN a pool with an error finding, and a request that finished (freed) with its events
    pool = make_pool(32)
    seq = pool.allocate("req-a", list(range(9)))
    pool.view.blocks["refcount"][seq.block_table[0]] = 5
    done = pool.allocate("req-done", list(range(100, 109)))
    pool.free(done)
    # WHEN it is analyzed for a request id nothing in the pool names (a typo)
    code = main(["analyze", pool.name, "--request", "req-A"])
    err = capsys.readouterr().err
    # THEN that is one line and exit 2, not "health: OK" for a pool with an error
    assert code == 2 and err.count("\n") == 1
    assert "no request 'req-A' in this pool" in err
    # AND a request that finished, which its block records still name, is narrowed to
    code, rep = analyze_json(capsys, pool.name, "--request", "req-done")
    assert code == 0 and rep["request"]["sequences"] == []


def test_analyze_shows_the_last_events_of_a_block(capsys, make_pool, tmp_path, monkeypatch):
    # GIVEN a flight recorder showing block 3 freed twice in the same generation
    pool = make_pool(32)
    seq = pool.allocate("req-e", list(range(16)))
    blk = seq.block_table[0]
    pool.view.blocks["refcount"][blk] = 3  # something the check reports on that block
    ev = pool.view.events[pool.client]
    for i, op in enumerate([1, 2, 2]):
        ev[i]["time_ns"], ev[i]["pid"], ev[i]["op"] = 1000 + i, os.getpid(), op
        ev[i]["block"], ev[i]["generation"], ev[i]["request"] = blk, 1, b"req-e"
    monkeypatch.setattr(analysis, "op_names", lambda: {1: "alloc", 2: "free"})
    # WHEN analyzed
    code, rep = analyze_json(capsys, pool.name)
    # THEN the finding carries those events and the second free as the first bad event
    f = next(f for f in rep["findings"] if f["block"] == blk)
    assert [e["op"] for e in f["events"]] == ["alloc", "free", "free"]
    assert f["first_bad_event"]["time_ns"] == 1002
    assert main(["analyze", pool.name]) == 1
    assert "first bad event" in capsys.readouterr().out


def test_redacted_dump_hides_tokens_but_keeps_equal_prefixes_equal(capsys, make_pool, tmp_path):
    # GIVEN two sequences with the same prompt, and one with another
    pool = make_pool(32)
    a = pool.allocate("a", [11, 12, 13, 14, 15, 16])
    b = pool.allocate("b", [11, 12, 13, 14, 15, 16])
    c = pool.allocate("c", [11, 12, 13, 99, 15, 16])
    out = tmp_path / "r.kvd"
    # WHEN dumped with --redact
    assert main(["dump", pool.name, "-o", str(out), "--redact"]) == 0
    view, dh = read_dump(out)
    tok = view.blocks["tokens"]
    # THEN no token id survives, equal prefixes look equal, different ones differ from there on
    assert not np.isin(tok[a.block_table], [11, 12, 13, 14, 15, 16, 99]).any()
    assert (tok[a.block_table] == tok[b.block_table]).all()
    assert (tok[c.block_table[0], :3] == tok[a.block_table[0], :3]).all()
    assert (tok[c.block_table[0], 3:] != tok[a.block_table[0], 3:]).all()
    assert int(dh["flags"]) & 2
    code, rep = analyze_json(capsys, str(out))
    assert code == 0 and rep["pool"]["dump"]["redacted"] is True


def test_dump_with_data_carries_the_kv_tensor(make_pool, tmp_path):
    pool = make_pool(16)
    pool.kv.view(-1)[:100] = 7.0
    out = tmp_path / "d.kvd"
    assert main(["dump", pool.name, "-o", str(out), "--with-data"]) == 0
    view, dh = read_dump(out)
    data = read_dump_data(out, dh)
    assert data is not None
    assert bytes(data) == pool.kv.contiguous().view(-1).numpy().tobytes()


def test_raw_copy_of_a_segment_is_analyzed_like_a_dump(capsys, make_pool, tmp_path):
    pool = make_pool(16)
    pool.allocate("r", [1, 2, 3])
    copy = tmp_path / "copy.seg"
    shutil.copyfile(segment_path(pool.name), copy)
    code, rep = analyze_json(capsys, str(copy))
    assert code == 0 and rep["summary"]["blocks_by_state"]["allocated"] == 1


def test_ls_lists_pools_with_owners(capsys, make_pool):
    pool = make_pool(16)
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    assert pool.name in out and "1 alive" in out
    assert main(["ls", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[pool.name]["owners_alive"] == [os.getpid()]


DIE_HOLDING = textwrap.dedent(
    """
    import os, signal, sys
    from kvscope.allocator import KVPool
    pool = KVPool.attach(sys.argv[1])
    pool.allocate("doomed", list(range(10)))
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


@pytest.mark.slow
def test_check_repair_reclaims_a_dead_owners_blocks(capsys, make_pool):
    # GIVEN a process that died holding blocks of the pool
    pool = make_pool(32)
    r = subprocess.run([sys.executable, "-c", DIE_HOLDING, pool.name])
    assert r.returncode == -signal.SIGKILL
    # WHEN checked THEN the leak is a warning naming the dead pid (exit 0)
    assert main(["check", pool.name, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {f["kind"] for f in rep["findings"]} == {"leak_dead_owner"}
    assert rep["summary"]["processes"]["dead"]
    # WHEN repaired THEN it says what it reclaimed and the pool is clean again
    assert main(["check", pool.name, "--repair"]) == 0
    cap = capsys.readouterr()
    assert "reclaimed" in cap.err and "from 1 dead process" in cap.err
    assert "health: OK - no findings" in cap.out
    assert pool.stats()["num_allocated"] == 0


@pytest.mark.slow
def test_check_unlink_removes_an_unused_pool(capsys, pool_name):
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from kvscope.allocator import KVPool, PoolConfig; "
            "KVPool.create(sys.argv[1], PoolConfig(num_blocks=8, block_size=4, head_dim=8, num_layers=1)).close()",
            pool_name,
        ],
        check=True,
    )
    assert main(["check", pool_name, "--unlink"]) == 0
    assert not os.path.exists(segment_path(pool_name))


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["analyze", "--help"]])
def test_help_exits_0(capsys, argv):
    assert main(argv) == 0
    assert "usage" in capsys.readouterr().out


def test_shared_blocks_released_by_each_holder_are_no_bad_event(make_pool, monkeypatch):
    # GIVEN a published prompt block shared by a fork and by a later prefix hit, each released
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(32)
    seq = pool.allocate("a", list(range(9)))
    pool.mark_computed(seq, 9)
    kid = pool.fork(seq, "a.1")
    blk = seq.block_table[0]
    pool.free(seq)
    pool.free(kid)
    again = pool.allocate("b", list(range(9)))
    assert again.block_table[0] == blk
    pool.free(again)
    events = analysis.block_events(pool.view, [blk])[blk]
    assert [e["op"] for e in events] == [
        "allocate",
        "publish",
        "fork",
        "free",
        "free",
        "prefix_hit",
        "free",
    ]
    # THEN no event is a bad one; WHEN the last release is repeated THEN that one is
    assert analysis.first_bad_event(events, int(pool.view.blocks["generation"][blk])) is None
    twice = [*events, dict(events[-1], time_ns=events[-1]["time_ns"] + 1)]
    assert analysis.first_bad_event(twice, int(pool.view.blocks["generation"][blk])) == twice[-1]


def published_by_owner(make_pool, monkeypatch):
    """A 32-block pool with the events and digest probes, and "owner"'s prompt of 9 tokens, its
    first block's K/V written and published: (pool, owner's sequence)."""
    for name in ("EVENTS", "DIGEST"):
        monkeypatch.setenv(f"KVSCOPE_{name}", "1")
    pool = make_pool(32)
    seq = pool.allocate("owner", list(range(9)))
    pool.kv[:, :, seq.block_table[0], :4] = 1.0
    pool.mark_computed(seq, 9)
    return pool, seq


def test_a_modified_published_block_names_the_requests_that_mapped_it_since(
    capsys, make_pool, monkeypatch, tmp_path
):
    # GIVEN a prompt block published by "owner", hit by "a" and "b" (and forked by "b"), one of
    # which writes into it; it is found at b's release
    pool, seq = published_by_owner(make_pool, monkeypatch)
    a = pool.allocate("a", list(range(8)) + [70])
    b = pool.allocate("b", list(range(8)) + [80])
    kid = pool.fork(b, "b.1")
    blk = seq.block_table[0]
    assert a.block_table[0] == b.block_table[0] == blk
    pool.kv[0, 0, blk, 1] = 2.0  # (someone's write into the shared block)
    pool.free(kid)
    pool.free(b)
    late = pool.allocate("late", list(range(8)) + [90])  # (after the finding: no suspect)
    # WHEN analyzed
    code, rep = analyze_json(capsys, pool.name)
    # THEN the finding lists who mapped the block in that generation before it was found, and
    # its message names the publisher as such
    f = next(f for f in rep["findings"] if f["kind"] == "published_block_modified")
    assert f["block"] == blk and f["request"] == "owner"
    assert f["mapped_since_published"] == ["a", "b", "b.1"]
    assert "since request 'owner' published it" in f["message"]
    assert main(["analyze", pool.name]) == 1
    assert "mapped since its publication by 'a', 'b', 'b.1'" in capsys.readouterr().out
    # AND the HTML report names them too
    assert main(["report", pool.name, "-o", str(tmp_path / "r.html")]) == 0
    html = (tmp_path / "r.html").read_text()
    assert "mapped since its publication by</th><td>&#x27;a&#x27;, &#x27;b&#x27;" in html
    for s in (late, a, seq):
        pool.free(s)


def test_a_modified_published_block_names_who_held_it_since_its_last_intact_check(
    capsys, make_pool, monkeypatch, tmp_path
):
    # GIVEN a prompt block published by "owner" (then freed), hit and freed by "c" (its hit
    # and its release verify the digest), then hit by "b", which writes into it; it is found
    # at b's release
    pool, seq = published_by_owner(make_pool, monkeypatch)
    blk = seq.block_table[0]
    pool.free(seq)
    pool.free(pool.allocate("c", list(range(8)) + [60]))
    b = pool.allocate("b", list(range(8)) + [80])
    assert b.block_table[0] == blk
    pool.kv[0, 0, blk, 1] = 2.0  # (b's write into the block it hit)
    pool.free(b)
    # WHEN analyzed
    code, rep = analyze_json(capsys, pool.name)
    # THEN besides everyone who mapped it since its publication, the finding names b's hit as
    # the last check that found it intact, and b alone as holding it from then
    f = next(f for f in rep["findings"] if f["kind"] == "published_block_modified")
    assert f["block"] == blk and f["mapped_since_published"] == ["c", "b"]
    assert (f["intact_at"]["op"], f["intact_at"]["request"]) == ("prefix_hit", "b")
    assert f["held_since_intact"] == ["b"]
    assert main(["analyze", pool.name]) == 1
    assert "K/V intact at the prefix hit of 'b' (pid" in capsys.readouterr().out
    # AND the HTML report says the same
    assert main(["report", pool.name, "-o", str(tmp_path / "r.html")]) == 0
    html = (tmp_path / "r.html").read_text()
    assert "written after its last intact check</th><td>prefix hit of &#x27;b&#x27;" in html
    assert "held since by &#x27;b&#x27;</td>" in html


def test_the_text_shows_the_events_that_led_to_a_finding_not_the_blocks_later_life(
    capsys, make_pool, monkeypatch
):
    # GIVEN a published block hit by "a", written into, found at the next prefix hit, then hit
    # and released by many more requests (more than the text shows)
    pool, seq = published_by_owner(make_pool, monkeypatch)
    a = pool.allocate("a", list(range(8)) + [60])
    pool.kv[0, 0, seq.block_table[0], 1] = 2.0  # ("a"'s write into the block it hit)
    pool.free(pool.allocate("finder", list(range(8)) + [70]))
    for i in range(12):
        pool.free(pool.allocate(f"later-{i}", list(range(8)) + [80 + i]))
    # WHEN analyzed as text
    assert main(["analyze", pool.name]) == 1
    text = capsys.readouterr().out
    # THEN the finding's events end at the hit that found it and say how many came after
    lines = text[text.index("published_block_modified") :].splitlines()
    part = "\n".join([lines[0], *itertools.takewhile(lambda ln: ln.startswith("    "), lines[1:])])
    assert "events up to the finding, of its" in part and "after it; --json lists" in part
    assert "prefix_hit  gen 1  arg 0 request 'a'" in part and "later-" not in part
    pool.free(a)
    pool.free(seq)


def test_a_block_published_before_its_kv_names_who_read_it_unwritten(
    capsys, make_pool, monkeypatch, tmp_path
):
    # GIVEN an engine that publishes a prompt before writing its K/V (mark_computed at the
    # first chunk of a chunked prefill): "reader" hits the blank block, then the publisher
    # writes it, and "late"'s hit finds the change
    for name in ("EVENTS", "DIGEST"):
        monkeypatch.setenv(f"KVSCOPE_{name}", "1")
    pool = make_pool(32)
    seq, reader, blk = published_before_written(pool)
    late = pool.allocate("late", list(range(8)) + [90])
    # WHEN analyzed
    code, rep = analyze_json(capsys, pool.name)
    # THEN the finding names the request that read it unwritten, whose hit is the first bad
    # event, and the publisher as the writer (no list of suspects)
    f = next(f for f in rep["findings"] if f["kind"] == "published_block_modified")
    assert f["block"] == blk and f["request"] == "early"
    assert f["message"].startswith("published before its K/V was written")
    assert f["read_unwritten"] == ["reader"]
    assert (f["first_bad_event"]["op"], f["first_bad_event"]["request"]) == (
        "prefix_hit",
        "reader",
    )
    assert "mapped_since_published" not in f
    assert main(["analyze", pool.name]) == 1
    out = capsys.readouterr().out
    assert "read before its K/V was written by 'reader'" in out
    assert "its publisher 'early' wrote it after mark_computed" in out
    assert main(["report", pool.name, "-o", str(tmp_path / "r.html")]) == 0
    assert (
        "read before its K/V was written by</th><td>&#x27;reader"
        in (tmp_path / "r.html").read_text()
    )
    for s in (late, reader, seq):
        pool.free(s)


def test_findings_come_in_the_order_things_went_wrong_with_every_event(
    capsys, make_pool, probes, tmp_path
):
    # GIVEN a small pool whose block 0 went round many times, then a leak (leak_finished,
    # recorded first), then a double free (recorded after it)
    from kvscope.allocator import faults

    pool = make_pool(4)
    for i in range(12):
        pool.free(pool.allocate(f"warm-{i}", [1, 2, 3]))
    faults.configure("leak:1")
    pool.free(pool.allocate("first", [1, 2, 3]))
    faults.configure("double-free:1")
    second = pool.allocate("second", [4, 5, 6])
    pool.free(second)
    faults.configure(None)
    # WHEN analyzed
    code, rep = analyze_json(capsys, pool.name)
    # THEN the finding that went wrong first comes first (not the kinds' alphabetical order)
    kinds = [f["kind"] for f in rep["findings"]]
    assert kinds.index("leak_finished") < kinds.index("double_free"), kinds
    times = [analysis.moment(f) for f in rep["findings"]]
    known = [t for t in times if t is not None]
    assert known == sorted(known) and times[: len(known)] == known
    # AND a finding lists every event the recorder holds of its block, not the last 8
    leak = next(f for f in rep["findings"] if f["kind"] == "leak_finished")
    ev = pool.view.events.reshape(-1)
    held = int(((ev["time_ns"] != 0) & (ev["block"] == leak["block"])).sum())
    assert len(leak["events"]) == held > 8
    # AND the text shows the last 8 and says how many there are
    assert main(["analyze", pool.name]) == 1
    assert f"last 8 of its {held} recorded events (--json lists every one)" in (
        capsys.readouterr().out
    )
    # AND the HTML report lists them all, in the same order of findings
    assert main(["report", pool.name, "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert f"every recorded event of block {leak['block']} ({held})" in page
    assert page.index("<b>leak_finished</b>") < page.index("<b>double_free</b>")


def test_a_requests_focus_lists_its_life_from_the_flight_recorder(capsys, make_pool):
    # GIVEN a request that took two blocks and was aborted, then released again (refused)
    pool = make_pool(32, events=True)
    seq = pool.allocate("req-t", list(range(7)))
    blocks = list(seq.block_table)
    pool.abort(seq)
    with pytest.raises(PoolError):
        pool.free(seq)
    # WHEN analyzed for it, as JSON and as text
    code, rep = analyze_json(capsys, pool.name, "--request", "req-t")
    # THEN its events tell its life, block by block: the allocation and the abort that ended it
    ops = [(e["op"], e["block"]) for e in rep["request"]["events"]]
    assert [("allocate", b) for b in blocks] == [o for o in ops if o[0] == "allocate"]
    assert [("abort", b) for b in blocks] == [o for o in ops if o[0] == "abort"]
    main(["analyze", pool.name, "--request", "req-t"])
    text = capsys.readouterr().out
    assert "blocks allocated in its name: none" in text and "blocks_stamped" not in text
    assert f"abort  block {blocks[0]}  gen" in text
