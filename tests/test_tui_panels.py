"""kvscope top: every panel reachable by keyboard, the help's legend, newest events first, the
actions a dump offers, and the script panel of `kvscope run --live` (Pilot)."""

from __future__ import annotations

import pytest

from kvscope.allocator.snapshot import snapshot
from kvscope.tui.app import TopApp
from kvscope.tui.help import HelpScreen
from kvscope.tui.source import LiveSource, ViewSource
from kvscope.tui.widgets.events import EventTail
from kvscope.tui.widgets.header import PoolHeader
from kvscope.tui.widgets.inspector import BlockInspector
from kvscope.tui.widgets.script import ScriptPanel
from tests.test_tui_app import frozen_view, populate, settle, sync

# Each runs the Textual app (a pilot): the slow layer, as README says.
pytestmark = pytest.mark.slow

PANELS = {"blockmap", "sequences", "blocktable", "inspector", "events", "findings", "locks"}


@pytest.fixture
def dump_app(make_pool):
    pool = make_pool(64, events=True)
    populate(pool)
    return TopApp(ViewSource(frozen_view(pool), name="tui-test"))


@sync
async def test_tab_reaches_every_panel(dump_app):
    # GIVEN top on a dump at 80x24
    async with dump_app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, dump_app)
        # WHEN tab is pressed over and over THEN every panel takes the focus in turn
        seen = set()
        for _ in range(2 * len(PANELS)):
            seen.add(dump_app.focused.id if dump_app.focused else None)
            await pilot.press("tab")
        assert PANELS <= seen


@sync
async def test_inspector_takes_focus_and_scrolls_to_its_last_fields(dump_app):
    async with dump_app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, dump_app)
        await pilot.press("g", "2", "enter")
        await pilot.pause(0.1)
        inspector = dump_app.query_one(BlockInspector)
        lines = inspector._shown[1].splitlines()
        # GIVEN a block whose fields do not fit the panel (checksum and events are below)
        checksum = next(i for i, ln in enumerate(lines) if "checksum" in ln)
        assert checksum >= inspector.scrollable_content_region.height
        # WHEN tab brings the focus to the inspector and end is pressed
        while dump_app.focused is not inspector:
            await pilot.press("tab")
        await pilot.press("end")
        await pilot.pause(0.1)
        # THEN it has scrolled down to its last line, and home brings it back
        assert inspector.scroll_y == inspector.max_scroll_y > 0
        assert inspector.scroll_y + inspector.scrollable_content_region.height > checksum
        await pilot.press("home")
        await pilot.pause(0.1)
        assert inspector.scroll_y == 0
        await pilot.press("pagedown")
        await pilot.pause(0.1)
        assert inspector.scroll_y > 0


@sync
async def test_events_are_listed_newest_first(dump_app):
    async with dump_app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, dump_app)
        tail = dump_app.query_one(EventTail)
        # GIVEN a pool whose recorder holds several events THEN the first row is the newest
        times = [int(e["time_ns"]) for e in tail.events]
        assert len(times) > 3
        assert times == sorted(times, reverse=True)
        assert "newest first" in str(tail.border_title)


@sync
async def test_a_dump_offers_no_pause_dump_or_check(dump_app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    async with dump_app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, dump_app)
        # THEN the footer offers neither Pause, Dump nor Check
        shown = {b.binding.description for b in dump_app.screen.active_bindings.values()}
        assert {"Help", "Quit"} <= shown
        assert not shown & {"Pause", "Dump", "Check"}
        # AND their keys do nothing
        await pilot.press("p", "d")
        await pilot.pause(0.2)
        assert not dump_app.paused
        assert not list(tmp_path.glob("*.kvd"))
        # AND the help does not list them
        await pilot.press("question_mark")
        await pilot.pause(0.05)
        help_text = str(dump_app.screen.query_one("#help").query("Static").first().render())
        assert "pause" not in help_text and "write a dump" not in help_text


@sync
async def test_a_live_pool_offers_pause_dump_and_check(make_pool):
    pool = make_pool(64)
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, app)
        shown = {b.binding.description for b in app.screen.active_bindings.values()}
        assert {"Pause", "Dump", "Check"} <= shown


@sync
async def test_help_has_a_legend_of_the_block_map(dump_app):
    async with dump_app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, dump_app)
        await pilot.press("question_mark")
        await pilot.pause(0.05)
        assert isinstance(dump_app.screen, HelpScreen)
        legend = dump_app.screen.query_one("#legend").render()
        text = str(legend)
        for word in ("allocated", "cached", "local", "quarantined", "free", "refcount 1, 2, 3, 4+"):
            assert word in text
        for glyph in ("·", "░", "▒", "▓", "█", "✖", "◆"):
            assert glyph in text
        # AND the help scrolls when it is taller than the screen
        scroll = dump_app.screen.query_one("#help")
        assert scroll.max_scroll_y > 0
        await pilot.press("end")
        await pilot.pause(0.05)
        assert scroll.scroll_y == scroll.max_scroll_y


class FakeScript:
    """A script that has printed two lines and runs until `returncode` is set."""

    def __init__(self) -> None:
        self.version = 1
        self.returncode: int | None = None
        self.lines = [("stdout", "serving 64 requests"), ("stderr", "warning: slow")]

    @property
    def pid(self) -> int:
        return 4242

    def status(self) -> str:
        return "running" if self.returncode is None else f"exited with status {self.returncode}"

    def tail(self) -> list[tuple[str, str]]:
        return list(self.lines)


@sync
async def test_script_panel_shows_output_and_the_exit(make_pool):
    # GIVEN top under `kvscope run --live` on a running script
    pool = make_pool(64)
    script = FakeScript()
    app = TopApp(ViewSource(snapshot(pool.view)), script=script)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        await pilot.pause(0.3)
        panel = app.query_one(ScriptPanel)
        # THEN its output is in the panel and the header says it runs
        assert [panel._row_of(i)[0][1] for i in range(panel.num_rows)] == [
            "serving 64 requests",
            "warning: slow",
        ]
        assert "script running" in app.query_one(PoolHeader).mode
        # WHEN it prints more and exits THEN both show
        script.lines.append(("stdout", "done"))
        script.version += 1
        script.returncode = 3
        for _ in range(40):
            await pilot.pause(0.05)
            if "exit" in app.query_one(PoolHeader).mode:
                break
        assert "script exit 3" in app.query_one(PoolHeader).mode
        assert "exited with status 3" in str(panel.border_title)
        assert panel.num_rows == 3 and panel.cursor == 2


@sync
async def test_a_stop_request_closes_the_tui(make_pool):
    # GIVEN top as `kvscope run --live` shows it, with the stop event of its stopper
    import threading

    pool = make_pool(64, events=True)
    populate(pool)
    stop = threading.Event()
    app = TopApp(ViewSource(frozen_view(pool), name="tui-test"), stop=stop)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        assert app.is_running
        # WHEN a stop signal reaches kvscope (the event is set) THEN the TUI exits by itself
        stop.set()
        for _ in range(50):
            await pilot.pause(0.05)
            if not app.is_running:
                break
        assert not app.is_running
