"""Every reader shows the lease table: `analyze` (text and JSON `summary.leases`), `report`'s
page, `timeline`'s lease slices, `top`'s block panel, and a redacted dump hides its requests."""

from __future__ import annotations

import json
import time

from kvscope.allocator.snapshot import snapshot
from kvscope.cli import main
from kvscope.timeline import build_trace
from kvscope.tui.frame import Frame
from kvscope.tui.widgets.inspector import describe_block


def leased_pool(make_pool):
    """A pool with one released write lease and one read lease held on a freed request."""
    pool = make_pool(16, events=True)
    a = pool.allocate("req-a", list(range(10)))
    with pool.lease(a, "write", holder="kv-receiver"):
        pass
    b = pool.allocate("req-b", list(range(100, 110)))
    held = pool.lease(b, "read", holder="offloader")
    blocks = list(b.block_table)
    pool.free(b)
    return pool, held, blocks


def test_analyze_lists_the_leases_held_and_counts_them(make_pool, capsys):
    pool, held, blocks = leased_pool(make_pool)
    assert main(["analyze", pool.name, "--json"]) == 0
    ls = json.loads(capsys.readouterr().out)["summary"]["leases"]
    assert {k: ls[k] for k in ("held", "quarantined", "taken", "released", "late", "leaked")} == {
        "held": 1,
        "quarantined": 3,
        "taken": 2,
        "released": 1,
        "late": 0,
        "leaked": 0,
    }
    (row,) = ls["list"]
    assert row["holder"] == "offloader" and row["mode"] == "read" and row["request"] == "req-b"
    assert row["blocks"] == blocks and row["id"] == held.lease_id
    assert main(["analyze", pool.name]) == 0
    text = capsys.readouterr().out
    assert "leases\n  held 1 (quarantining 3 freed block(s))" in text
    assert "read lease 2 holder 'offloader'" in text and "request 'req-b'" in text


def test_the_report_page_has_a_lease_section(make_pool, tmp_path, capsys):
    pool, held, blocks = leased_pool(make_pool)
    out = tmp_path / "r.html"
    assert main(["report", pool.name, "-o", str(out)]) == 0
    page = out.read_text()
    assert "<h2>Leases</h2>" in page and "offloader" in page


def test_the_timeline_has_a_slice_per_lease(make_pool):
    pool, held, blocks = leased_pool(make_pool)
    trace = build_trace(snapshot(pool.view), end_ns=time.time_ns())
    leases = [e for e in trace["traceEvents"] if e.get("cat") == "lease"]
    assert sorted(e["name"] for e in leases) == ["read lease", "write lease"]
    read = next(e for e in leases if e["name"] == "read lease")
    assert read["args"]["end"] == "still held at the end of the trace"
    assert read["args"]["holder"] == "offloader" and read["args"]["blocks"] == sorted(blocks)
    write = next(e for e in leases if e["name"] == "write lease")
    assert "end" not in write["args"] and write["args"]["request"] == "req-a"


def test_tops_block_panel_names_a_blocks_lease(make_pool):
    pool, held, blocks = leased_pool(make_pool)
    view = snapshot(pool.view)
    frame = Frame(view=view, stats={}, findings=[], taken_ns=0, copy_ms=0, torn=False, live=False)
    text = describe_block(frame, blocks[0]).plain
    assert "leased 1: read by 'offloader'" in text
    assert "leased" not in describe_block(frame, 15).plain


def test_a_redacted_dump_hides_a_leases_request(make_pool, tmp_path, capsys):
    pool, held, blocks = leased_pool(make_pool)
    out = tmp_path / "red.kvd"
    assert main(["dump", pool.name, "-o", str(out), "--redact"]) == 0
    assert b"req-b" not in out.read_bytes()
    held.release()


def test_tops_snapshot_copies_the_lease_section(make_pool):
    from kvscope.allocator.lease import lease_rows
    from kvscope.tui.source import Snapshotter

    pool, held, blocks = leased_pool(make_pool)
    view = Snapshotter(pool.view).read()
    assert int(view.lease_header["active"][0]) == 1
    assert int(view.lease_counts[blocks[0]]) == 1
    assert [r["holder"] for r in lease_rows(view)] == ["offloader"]
