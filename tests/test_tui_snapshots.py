"""kvscope top screenshots at 80x24 and 160x48 (pytest-textual-snapshot; --snapshot-update to accept)."""

from __future__ import annotations

import pytest

from kvscope.tui.app import TopApp
from kvscope.tui.source import ViewSource
from tests.test_tui_app import frozen_view, populate, settle

# Each runs the Textual app (a pilot): the slow layer, as README says.
pytestmark = pytest.mark.slow

pytest.importorskip("pytest_textual_snapshot")


@pytest.fixture
def frozen_app(make_pool):
    pool = make_pool(64)
    populate(pool)
    return TopApp(ViewSource(frozen_view(pool), name="tui-snapshot"))


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_top_screen(snap_compare, frozen_app, size):
    async def run_before(pilot) -> None:
        await settle(pilot, frozen_app)

    assert snap_compare(frozen_app, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_top_screen_request_selected(snap_compare, frozen_app, size):
    async def run_before(pilot) -> None:
        await settle(pilot, frozen_app)
        await pilot.press("r", *"req-b", "enter")
        await pilot.pause(0.1)

    assert snap_compare(frozen_app, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_top_help_with_the_legend(snap_compare, frozen_app, size):
    async def run_before(pilot) -> None:
        await settle(pilot, frozen_app)
        await pilot.press("question_mark")
        await pilot.pause(0.1)

    assert snap_compare(frozen_app, terminal_size=size, run_before=run_before)


def test_top_with_the_script_panel(snap_compare, make_pool):
    # The view `kvscope run --live` shows: the script's output and its exit under the pool.
    from tests.test_tui_panels import FakeScript

    pool = make_pool(64)
    populate(pool)
    script = FakeScript()
    script.returncode = 0
    app = TopApp(ViewSource(frozen_view(pool), name="tui-snapshot"), script=script)

    async def run_before(pilot) -> None:
        await settle(pilot, app)
        await pilot.pause(0.4)

    assert snap_compare(app, terminal_size=(100, 32), run_before=run_before)
