"""kvscope top's detail view of a finding (enter on the findings panel), and the lists the
panels cut saying so. Pilot, and SVG snapshots at 80x24 and 160x48."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from rich.console import Console

from kvscope.allocator.findings import Finding
from kvscope.tui.app import TopApp
from kvscope.tui.detail import FindingScreen, describe_finding
from kvscope.tui.frame import Frame, request_of
from kvscope.tui.source import LiveSource, ViewSource
from kvscope.tui.widgets.findings import FindingsPanel
from kvscope.tui.widgets.inspector import describe_block
from tests.test_tui_app import FROZEN_PID, frozen_view, populate, settle, sync

# Each runs the Textual app (a pilot): the slow layer, as README says.
pytestmark = pytest.mark.slow

# Longer than the findings panel is wide at any size, shorter than the ring's 200 bytes.
LONG = (
    "block 3 was published by request 'req-a' and its K/V changed after publication; the "
    "requests that mapped it since are listed by kvscope analyze; the writer is one of them"
)


def plain(renderable, width: int = 100) -> str:
    """What a renderable shows on a terminal `width` columns wide, as plain text."""
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(renderable)
    return out.getvalue()


@pytest.fixture
def utc(monkeypatch):
    """Clock times in UTC, so the times the screenshots show are the same everywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def detail_app(make_pool, utc):
    """A frozen pool whose block 3 has a long finding and a history of events."""
    pool = make_pool(64, events=True)
    populate(pool)
    pool.report(Finding("published_block_modified", LONG, block=3, request="req-c"))
    view = frozen_view(pool)
    ev = view.events
    used = ev["time_ns"] != 0
    # Recorded times and pids fixed, in the order they were recorded.
    order = np.argsort(ev["time_ns"][used], kind="stable")
    times = np.empty(len(order), np.uint64)
    times[order] = 1_700_000_000_000_000_000 + np.arange(len(order)) * 1_000_000
    ev["time_ns"][used] = times
    ev["pid"][used] = FROZEN_PID
    return TopApp(ViewSource(view, name="tui-snapshot"))


def long_row(panel: FindingsPanel) -> int:
    """The row of the long finding."""
    return [f.message for f in panel.findings].index(LONG)


async def open_detail(pilot, app: TopApp) -> None:
    """Enter on the long finding."""
    await settle(pilot, app)
    panel = app.query_one(FindingsPanel)
    panel.focus()
    panel.cursor = long_row(panel)
    await pilot.press("enter")
    await pilot.pause(0.2)


@sync
async def test_enter_on_a_finding_shows_it_whole_and_escape_closes_it(detail_app):
    app = detail_app
    async with app.run_test(size=(160, 48)) as pilot:
        # GIVEN the findings panel, whose row cuts the long message and says so
        await settle(pilot, app)
        panel = app.query_one(FindingsPanel)
        row = panel._cells(panel._row_of(long_row(panel))[0], panel.size.width)
        assert row.rstrip().endswith("…") and LONG not in row
        # WHEN enter is pressed on that finding
        await open_detail(pilot, app)
        # THEN the detail view shows its whole message, its block, owner and history
        assert isinstance(app.screen, FindingScreen)
        text = " ".join(plain(app.screen.text).split())
        assert " ".join(LONG.split()) in text
        assert "block 3: allocated" in text
        assert f"owner pid {FROZEN_PID}" in text
        assert "history of block 3" in text and "allocate" in text
        # ... the block panel behind it inspects that block
        assert app.selected_block == 3
        # WHEN escape is pressed THEN the main screen is back
        await pilot.press("escape")
        await pilot.pause(0.1)
        assert not isinstance(app.screen, FindingScreen)


def test_the_detail_lists_the_requests_blocks_and_says_how_many_it_leaves_out(make_pool):
    # GIVEN a request that maps 80 blocks, and a finding about it
    pool = make_pool(96, block_size=1)
    pool.allocate("big", list(range(80)))
    view = frozen_view(pool)
    frame = Frame(view=view, stats={}, findings=[], taken_ns=0, copy_ms=0, torn=False, live=False)
    f = Finding("leak_finished", "request 'big' finished holding its blocks", request="big")
    # WHEN the detail view describes it
    text = " ".join(plain(describe_finding(frame, f)).split())
    # THEN it lists the first 64 of the request's blocks and says how many more there are
    assert "its blocks 0, 1, 2" in text
    assert "… (16 more)" in text
    assert "a finding about the pool, not one block" in text


def test_the_block_panel_says_how_many_tokens_it_leaves_out(make_pool):
    # GIVEN a block holding 12 tokens
    pool = make_pool(8, block_size=16)
    pool.allocate("req", list(range(100, 112)))
    view = frozen_view(pool)
    frame = Frame(view=view, stats={}, findings=[], taken_ns=0, copy_ms=0, torn=False, live=False)
    b = int(view.seqs["table"][0][0])
    # WHEN the block panel describes it THEN it shows 8 of them and says 4 more
    text = describe_block(frame, b).plain
    assert "tokens 12: [100, 101, 102, 103, 104, 105, 106, 107, … (4 more)]" in text
    # ... and the detail view of a finding about it shows them all
    f = Finding("leak_orphan", "block has no sequence", block=b)
    assert "111]" in plain(describe_finding(frame, f))


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_top_finding_detail(snap_compare, detail_app, size):
    pytest.importorskip("pytest_textual_snapshot")

    async def run_before(pilot) -> None:
        await open_detail(pilot, detail_app)

    assert snap_compare(detail_app, terminal_size=size, run_before=run_before)


@sync
async def test_the_detail_of_a_live_pool_reads_the_finding_s_block_whole(make_pool):
    # GIVEN top on a live pool (whose frames copy whole only the records on show) and a
    # finding about block 3, which is not on show
    pool = make_pool(64)
    populate(pool)
    pool.report(Finding("published_block_modified", LONG, block=3, request="req-c"))
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(160, 48)) as pilot:
        # WHEN enter is pressed on that finding
        await open_detail(pilot, app)
        # THEN the detail view shows block 3's record as the pool holds it
        assert isinstance(app.screen, FindingScreen)
        text = " ".join(plain(app.screen.text).split())
        rec = pool.view.blocks[3]
        assert (
            f"block 3: allocated, refcount {int(rec['refcount'])}, generation "
            f"{int(rec['generation'])}, request {request_of(rec)}" in text
        )


def test_a_gone_owner_is_dead_where_it_holds_the_block_and_exited_where_it_is_cached(make_pool):
    from kvscope.allocator.snapshot import snapshot

    # GIVEN a live pool with a published block freed (cached) and a block still held, both
    # recorded as a process's that has exited (a pid of no process: its start time kept)
    pool = make_pool(32)
    gone = pool.allocate("gone", list(range(8)))
    pool.mark_computed(gone, 8)
    cached = gone.block_table[0]
    pool.free(gone)
    held = pool.allocate("held", [1, 2, 3]).block_table[0]
    view = snapshot(pool.view)
    for b in (cached, held):
        view.blocks["owner_pid"][b] = 2**22 + 1  # (above pid_max: no such process)
    frame = Frame(view=view, stats={}, findings=[], taken_ns=0, copy_ms=0, torn=False, live=True)
    # THEN the held block's owner is DEAD (no one frees it), the cached one's only exited
    assert f"pid {2**22 + 1} client" in describe_block(frame, cached).plain
    assert "(exited)" in describe_block(frame, cached).plain
    assert "(DEAD)" in describe_block(frame, held).plain
