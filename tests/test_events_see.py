"""`kvscope timeline` and `kvscope report` of a recorded KV-event stream.

Streams are built with kvscope's own encoder (the helpers of tests/test_events_check.py): a
clean one with every legitimate oddity, and ones with planted faults. The trace is checked
against the Trace Event Format as a pool's is (tests/test_timeline.py's check_trace).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time

import pytest

from kvscope.cli import main
from kvscope.events.wire import hash_text
from tests.test_events_check import Stream, legit
from tests.test_timeline import check_trace


def clean(tmp_path, maps: bool = True, hashes: str = "int") -> tuple[Stream, str]:
    s = Stream(maps, hashes)
    legit(s)
    return s, s.write(tmp_path / "clean.kvev")


def faulty(tmp_path) -> tuple[Stream, str]:
    """A clean stream, then a removal of a hash never stored and a lost batch."""
    s = Stream(True, "int")
    legit(s)
    s.batch(s.stored([1]), s.stored([2], parent=1))
    s.batch(s.removed([9]))
    s.batch(s.stored([3], parent=2))  # lost below
    s.batch(s.stored([4], parent=2))
    del s.messages[-2]
    return s, s.write(tmp_path / "faulty.kvev")


def timeline(path: str, out) -> tuple[int, dict]:
    rc = main(["timeline", path, "-o", str(out)])
    return rc, json.loads(out.read_text()) if rc == 0 else {}


def by_track(trace: dict) -> dict[tuple[int, int], str]:
    names = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] in ("process_name", "thread_name"):
            names[(e["pid"], e["tid"])] = e["args"]["name"]
    return names


@pytest.mark.parametrize("maps,hashes", [(True, "int"), (False, "bytes")])
def test_a_clean_stream_gives_its_tracks(tmp_path, maps, hashes, capsys):
    # GIVEN a clean stream (copies, a prefix hit re-reported, a clear, stores after it)
    s, path = clean(tmp_path, maps, hashes)
    # WHEN drawn as a trace
    rc, trace = timeline(path, tmp_path / "t.json")
    # THEN exit 0, a valid trace with the publisher, its counters and a slice per stay
    assert rc == 0
    events = check_trace(trace)
    names = by_track(trace)
    assert any(n == "publisher tcp://127.0.0.1:5557 rank 0" for n in names.values())
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"cache", "stores", "totals"}
    blocks = [e for e in events if e["ph"] == "X" and e["cat"] == "block"]
    # hashes 1, 2, 3, 4, 5 before the clear; 1, 2, 6 after it
    assert len(blocks) == 8
    ends = sorted(e["args"]["end"] for e in blocks)
    assert ends.count("AllBlocksCleared") == 3 and ends.count("removed") == 5
    h1 = next(e for e in blocks if e["args"]["hash"] == hash_text(s.h(1)))
    # 1 stored again twice before the clear (a second copy, the re-reported hit)
    assert h1["args"]["stored_again"] == 2 and h1["args"]["max_copies"] == 3
    assert [e["name"] for e in events if e["ph"] == "i"] == ["AllBlocksCleared"]
    last = [e for e in events if e["ph"] == "C" and e["name"] == "cache"][-1]
    assert last["args"] == {"block copies": 0, "hashes": 0}
    od = trace["otherData"]
    assert od["healthy"] is True and od["findings"] == 0 and od["batches"] == 9
    assert "1 publisher(s), 9 batch(es), 8 block slice(s), 0 finding(s)" in capsys.readouterr().err


def test_planted_faults_are_instants_at_their_batch(tmp_path):
    # GIVEN a stream with a removal of a hash never stored and a lost batch
    s, path = faulty(tmp_path)
    # WHEN drawn
    rc, trace = timeline(path, tmp_path / "t.json")
    # THEN exit 0 (as a pool's timeline), both findings on the publisher at their batch's time
    assert rc == 0
    events = check_trace(trace)
    found = [e for e in events if e["ph"] == "i" and e["cat"] == "finding"]
    assert sorted(e["name"] for e in found) == ["kv_event_gap", "kv_event_remove_unstored"]
    pub_pid = next(pid for (pid, _), n in by_track(trace).items() if n.startswith("publisher "))
    for e in found:
        assert e["pid"] == pub_pid and e["s"] == "p" and e["args"]["severity"] == "error"
    gap = next(e for e in found if e["name"] == "kv_event_gap")
    # seen at the batch after the lost one (ts 1012): the 12th record, ts 1013
    assert gap["args"]["batch"] == 11 and gap["ts"] == (1013 - 1001) * 1e6
    assert trace["otherData"]["healthy"] is False
    assert trace["otherData"]["findings_by_kind"] == {
        "kv_event_gap": 1,
        "kv_event_remove_unstored": 1,
    }


def test_a_restart_closes_the_publishers_blocks(tmp_path):
    s = Stream(True, "int")
    s.batch(s.stored([1]))
    s.batch(s.stored([2], parent=1))
    s.batch(s.stored([1]), seq=0)
    rc, trace = timeline(s.write(tmp_path / "s.kvev"), tmp_path / "t.json")
    events = check_trace(trace)
    blocks = sorted(
        (e["args"]["stored_batch"], e["args"]["end"])
        for e in events
        if e["ph"] == "X" and e["cat"] == "block"
    )
    assert blocks == [
        (0, "publisher restarted"),
        (1, "publisher restarted"),
        (2, "still stored at the end of the stream"),
    ]
    assert {e["name"] for e in events if e["ph"] == "i"} == {
        "publisher restarted",
        "kv_event_seq_reset",
    }


def test_timeline_to_stdout_and_refusals(tmp_path, capsys):
    _, path = clean(tmp_path)
    assert main(["timeline", path, "-o", "-"]) == 0
    trace = json.loads(capsys.readouterr().out)
    check_trace(trace)
    # a pool's --history makes no sense for a stream: one line, exit 2
    assert main(["timeline", path, "-o", str(tmp_path / "t.json"), "--history", "h"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error:") and err.count("\n") == 1
    # a directory as output is refused before anything is read
    assert main(["timeline", path, "-o", str(tmp_path)]) == 2
    assert "not a regular file" in capsys.readouterr().err


def test_a_truncated_stream_file_draws_what_it_holds(tmp_path):
    _, path = clean(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 3)
    rc, trace = timeline(path, tmp_path / "t.json")
    assert rc == 0 and trace["otherData"]["batches"] == 8
    check_trace(trace)


def report(path: str, out) -> tuple[int, str]:
    rc = main(["report", path, "-o", str(out)])
    return rc, out.read_text() if rc == 0 else ""


SECTIONS = [
    "<h2>Stream</h2>",
    "<h2>Publishers</h2>",
    "<h2>Over time</h2>",
    "<h2>Stores and removals per hash</h2>",
    "<h2>Prefix tree</h2>",
    "<h2>Findings",
]


def test_a_clean_stream_report_has_its_sections(tmp_path, capsys):
    # GIVEN a clean stream WHEN reported
    s, path = clean(tmp_path)
    rc, page = report(path, tmp_path / "r.html")
    # THEN exit 0, every section in order, healthy, no finding, nothing fetched or run
    assert rc == 0
    at = [page.index(h) for h in SECTIONS]
    assert at == sorted(at)
    assert "HEALTHY, no findings" in page and "<h2>Findings</h2><p class=ok>none</p>" in page
    assert "<script" not in page and "http" not in page.replace("http://", "")
    assert page.count("<svg") >= 4  # three charts over time and the stays histogram
    # the prefix tree: 1 -> 2 -> {3 -> 4, 5}, and 6 under 2 after the clear; one root
    assert "6 hash(es) ever stored, 1 root(s)" in page
    # hash 1 was stored 4 times in 2 stays (before and after the clear)
    row = page[page.index(hash_text(s.h(1))[:16]) :]
    assert row.split("<td class=n>")[1:3] == ["4</td>", "2</td>"]
    assert "9 batch(es), 0 finding(s)" in capsys.readouterr().err


def test_a_faulty_stream_report_lists_its_findings(tmp_path):
    s, path = faulty(tmp_path)
    rc, page = report(path, tmp_path / "r.html")
    # exit 0 as for a pool's report; the findings with their events
    assert rc == 0
    assert "UNHEALTHY: 2 finding(s)" in page and "<h2>Findings (2)</h2>" in page
    assert "<b>kv_event_gap</b>" in page and "<b>kv_event_remove_unstored</b>" in page
    assert f"BlockRemoved of {hash_text(s.h(9))}, never stored" in page
    assert "gaps (batches lost)</td><td>1 (1)" in page


def test_report_refusals(tmp_path, capsys):
    _, path = clean(tmp_path)
    assert main(["report", path, "-o", str(tmp_path)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert main(["report", path, "-o", str(tmp_path / "r.html"), "--history", "h"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvscope: error:") and err.count("\n") == 1
    assert not (tmp_path / "r.html").exists()
    # a file with no stream magic is not taken for a stream: the pool path refuses it
    bad = tmp_path / "x.kvev"
    bad.write_bytes(b"KVSEVTS0 not quite")
    assert main(["report", str(bad), "-o", str(tmp_path / "r.html")]) == 2


# --- kvscope top --events: the live view, driven with Textual's Pilot ------------------------


def sync(fn):
    """Run an async Pilot test with asyncio.run (no pytest plugin needed)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


def text(app, selector: str) -> str:
    return str(app.query_one(selector).render())


def rows(app, selector: str) -> list[list[str]]:
    table = app.query_one(selector)
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


@pytest.mark.slow
@sync
async def test_top_events_replays_a_file(tmp_path):
    # GIVEN the faulty stream, replayed 4 records per refresh
    from kvscope.events.top import EventsApp, FileFeed

    s, path = faulty(tmp_path)
    app = EventsApp(FileFeed(path, per_tick=4), hz=0.01)
    async with app.run_test(size=(140, 40)) as pilot:
        # WHEN refreshed until the file is replayed whole (the first refresh was at mount)
        while not app.feed.done:
            app.tick()
        await pilot.pause()
        # THEN the cache, the publisher's accounting, the tree and both findings
        assert text(app, "#summary").startswith("UNHEALTHY (replayed whole): 1 publisher(s)")
        assert "2 finding(s)" in text(app, "#summary")
        ((pub, now, peak, hashes, *_rest, gaps, restarts),) = rows(app, "#publishers")
        assert pub == "tcp://127.0.0.1:5557 rank 0" and (now, peak, gaps) == ("3", "9", "1")
        assert hashes == "3" and restarts == "0"
        assert "ever stored" in text(app, "#tree")
        kinds = [r[1] for r in rows(app, "#findings")]
        assert kinds == ["kv_event_remove_unstored", "kv_event_gap"]
        await pilot.press("q")


@sync
async def test_top_events_follows_a_live_publisher(tmp_path):
    # GIVEN a local publisher of our own encoder (XPUB: it sees the subscription arrive)
    import zmq

    from kvscope.events.top import EventsApp, ZmqFeed

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        s = Stream(True, "int")
        legit(s)
        s.batch(s.removed([9]))
        app = EventsApp(ZmqFeed([f"tcp://127.0.0.1:{port}"]), hz=0.01)
        async with app.run_test(size=(140, 40)) as pilot:
            assert pub.poll(10_000), "the view never subscribed"
            pub.recv()  # the subscription
            for m in s.messages:
                pub.send_multipart(m)
            # WHEN refreshed until every batch arrived (a condition, not a duration)
            deadline = time.monotonic() + 10
            while app.walk.num_records < len(s.messages) and time.monotonic() < deadline:
                app.tick()
                await asyncio.sleep(0.01)
            app.tick()
            await pilot.pause()
            # THEN the clean part shows no finding, the planted removal one
            assert app.walk.num_records == len(s.messages)
            assert text(app, "#summary").startswith("UNHEALTHY: 1 publisher(s)")
            assert [r[1] for r in rows(app, "#findings")] == ["kv_event_remove_unstored"]
            await pilot.press("q")
    finally:
        ctx.destroy(linger=0)


def test_top_events_refusals(tmp_path, capsys):
    _, path = clean(tmp_path)
    assert main(["top", "demo", "--events", path]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["top"]) == 2
    assert "--events" in capsys.readouterr().err
    assert main(["top", "--events", path, "tcp://127.0.0.1:1"]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.mark.parametrize("hashes", ["int", "bytes"])
def test_top_events_tree_shows_a_root_hash_whole_or_marked_cut(hashes):
    from kvscope.events.streamfile import PUBLISHED
    from kvscope.events.top import tree_lines
    from kvscope.events.walk import StreamWalk
    from kvscope.events.wire import hash_text

    # GIVEN a publisher's one chain of two blocks (an int hash of 20 digits, or a digest)
    s = Stream(True, hashes)
    s.batch(s.stored([1]), s.stored([2], parent=1))
    walk = StreamWalk(["tcp://127.0.0.1:5557"])
    for i, frames in enumerate(s.messages):
        walk.feed(i + 1, PUBLISHED, 0, frames)
    # WHEN the tree is drawn
    (root,) = [ln for ln in tree_lines(walk) if "(root " in ln]
    shown = root.split()[0]
    full = hash_text(s.h(1))
    # THEN a 64-bit hash is shown whole (a cut one would pass for another); a digest is cut,
    # its end marked
    if hashes == "int":
        assert shown == full, root
    else:
        assert shown.endswith("…") and full.startswith(shown[:-1]), root
