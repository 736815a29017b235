"""kvscope top: panels and key bindings, driven with Textual's Pilot."""

from __future__ import annotations

import asyncio
import functools
import os
from types import SimpleNamespace

import numpy as np
import pytest
from textual.geometry import Region

from kvscope.allocator import KVPool, PoolError
from kvscope.allocator.findings import Finding
from kvscope.allocator.layout import block_checksums, header_checksum
from kvscope.allocator.snapshot import snapshot
from kvscope.allocator.stats import pool_stats
from kvscope.tui.app import TopApp, gpu_reader
from kvscope.tui.help import HelpScreen
from kvscope.tui.source import LiveSource, ViewSource, open_source
from kvscope.tui.widgets.blockmap import BlockMap, cell_codes
from kvscope.tui.widgets.findings import FindingsPanel
from kvscope.tui.widgets.inspector import BlockInspector
from kvscope.tui.widgets.sequences import BlockTableView, SequenceList

# Each runs the Textual app (a pilot): the slow layer, as README says.
pytestmark = pytest.mark.slow


def sync(fn):
    """Run an async Pilot test with asyncio.run (no pytest plugin needed)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))

    return wrapper


# A pid no process has (pid_max is at most 2**22), so owners read as dead and stay stable.
FROZEN_PID = 4_194_303


def populate(pool: KVPool) -> None:
    """Three sequences: req-a, req-b forked from it with a copy-on-write, req-c; one finding."""
    a = pool.allocate("req-a", list(range(10)))
    pool.mark_computed(a, 10)
    b = pool.fork(a, "req-b")
    pool.append(b, [99])
    pool.allocate("req-c", list(range(100, 120)))
    pool.report(Finding("leak_orphan", "block 7 has no sequence; free it", block=7))


def frozen_view(pool: KVPool):
    """A snapshot of `pool` with pids, times and lock timings fixed (for stable screenshots)."""
    view = snapshot(pool.view)
    view.header["name"] = b"tui-snapshot"
    view.header["checksum"] = header_checksum(view.raw)
    b = view.blocks
    used = b["owner_pid"] != 0
    b["owner_pid"][used] = FROZEN_PID
    b["owner_start"][:] = 0
    b["alloc_ns"][:] = 0
    b["access_ns"][:] = 0
    b["checksum"][:] = block_checksums(b, np.arange(len(b)))
    s = view.seqs
    s["owner_pid"][s["owner_pid"] != 0] = FROZEN_PID
    s["created_ns"][:] = 0
    s["active_ns"][:] = 0
    # (which prefix-index lock shard a run takes varies with the pool: no counts either)
    for f in ("wait_ns", "hold_ns", "max_hold_ns", "acquired_ns", "num_acquires", "num_contended"):
        view.locks[f][:] = 0
    view.findings["time_ns"][:] = 0
    view.findings["owner_pid"][:] = 0
    view.clients["pid"][:] = FROZEN_PID
    return view


async def settle(pilot, app: TopApp) -> None:
    """Wait until the app shows a frame and, for a dump, its check is done."""
    for _ in range(100):
        await pilot.pause(0.05)
        if app.num_frames and (app.source.live or app.num_checks):
            break
    await pilot.pause(0.05)


@pytest.fixture
def dump_app(make_pool):
    pool = make_pool(64)
    populate(pool)
    return TopApp(ViewSource(frozen_view(pool), name="tui-test"))


@sync
async def test_panels_show_the_pool(dump_app):
    # GIVEN a dump of a pool with three sequences and a finding
    async with dump_app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, dump_app)
        # THEN the sequences list, the findings and the block map show them
        seqs = dump_app.query_one(SequenceList)
        assert seqs.num_rows == 3
        assert [seqs._row_of(i)[0][1] for i in range(3)] == ["req-a", "req-b", "req-c"]
        kinds = [f.kind for f in dump_app.query_one(FindingsPanel).findings]
        assert "leak_orphan" in kinds
        assert "leak_dead_owner" in kinds  # from the full check: the frozen owner is dead
        assert "blocks (64)" in str(dump_app.query_one(BlockMap).border_title)


@sync
async def test_goto_request_shows_shared_and_cow_blocks(dump_app):
    async with dump_app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, dump_app)
        # WHEN r, a request id and enter are typed
        await pilot.press("r", *"req-b", "enter")
        await pilot.pause(0.1)
        # THEN its block table marks the two shared blocks and the copy-on-write copy
        table = dump_app.query_one(BlockTableView)
        marks = [table._row_of(i)[0][5] for i in range(table.num_rows)]
        assert marks == ["shared x2", "shared x2", "cow copy"]
        assert dump_app.selected_block == table.table[0]


@sync
async def test_goto_block_fills_the_inspector(dump_app):
    async with dump_app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, dump_app)
        await pilot.press("g", "7", "enter")
        await pilot.pause(0.1)
        inspector = dump_app.query_one(BlockInspector)
        assert dump_app.selected_block == 7
        assert "block 7" in str(inspector.border_title)
        text = inspector._shown[1]
        for field in (
            "refcount",
            "generation",
            "owner",
            "request",
            "site",
            "checksum",
            "last events",
        ):
            assert field in text
        # AND a bad id is refused without moving
        await pilot.press("g", *"999", "enter")
        await pilot.pause(0.1)
        assert dump_app.selected_block == 7


@sync
async def test_help_opens_and_closes(dump_app):
    async with dump_app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, dump_app)
        await pilot.press("question_mark")
        await pilot.pause(0.05)
        assert isinstance(dump_app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.pause(0.05)
        assert not isinstance(dump_app.screen, HelpScreen)


@sync
async def test_d_writes_a_dump_that_top_opens(make_pool, tmp_path, monkeypatch):
    # GIVEN top on a live pool with three sequences
    monkeypatch.chdir(tmp_path)
    pool = make_pool(64)
    populate(pool)
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        # WHEN d is pressed THEN a dump is written that top opens as a dump
        await pilot.press("d")
        for _ in range(100):
            await pilot.pause(0.05)
            if list(tmp_path.glob("*.kvd")):
                break
    (path,) = tmp_path.glob("*.kvd")
    source = open_source(str(path))
    assert source.live is False
    assert pool_stats(source.read())["num_sequences"] == 3


@sync
async def test_q_quits_with_zero(dump_app):
    async with dump_app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, dump_app)
        await pilot.press("q")
    assert dump_app.return_code == 0


@sync
async def test_live_pool_refreshes_and_pauses(make_pool):
    # GIVEN a live pool watched by top at 20 Hz
    pool = make_pool(64)
    pool.allocate("first", list(range(8)))
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, app)
        seqs = app.query_one(SequenceList)
        assert seqs.num_rows == 1
        # WHEN the pool's user allocates another sequence, THEN the list follows
        pool.allocate("second", list(range(8)))
        for _ in range(40):
            await pilot.pause(0.05)
            if seqs.num_rows == 2:
                break
        assert seqs.num_rows == 2
        # WHEN paused, THEN new sequences do not show until resumed
        await pilot.press("p")
        await pilot.pause(0.2)
        frames = app.num_frames
        pool.allocate("third", list(range(8)))
        await pilot.pause(0.3)
        assert app.paused and app.num_frames == frames and seqs.num_rows == 2
        await pilot.press("p")
        for _ in range(40):
            await pilot.pause(0.05)
            if seqs.num_rows == 3:
                break
        assert seqs.num_rows == 3


@sync
async def test_a_pool_unlinked_while_watched_is_not_missing_its_data(make_pool):
    # GIVEN top on a live CPU pool whose program then closes it and removes its files, as a
    # server does when it stops (the mapping top reads stays)
    pool = make_pool(64)
    populate(pool)
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, app)
        pool.close()
        pool.unlink()
        # WHEN a full check runs after the unlink
        checks = app.num_checks
        await pilot.press("c")
        for _ in range(100):
            await pilot.pause(0.05)
            if app.num_checks > checks:
                break
        assert app.num_checks > checks
        # THEN the pool's findings are the segment's: its KV data file, unlinked with it, is
        # not reported missing (it is no longer the pool's to check)
        kinds = {f.kind for f in app.checked}
        assert "out_of_bounds" not in kinds, [f.message for f in app.checked]
        assert app.is_running


def test_live_source_is_read_only_and_takes_no_lock(make_pool):
    pool = make_pool(64)
    populate(pool)
    before = pool.view.locks["num_acquires"].copy()
    source = LiveSource(pool.name)
    view = source.read()
    # The mapping itself refuses writes.
    assert not source.view.blocks.flags.writeable
    # (of the block records, the TUI copies the columns the map and the counts read)
    assert pool_stats(view, view.columns)["num_sequences"] == 3
    assert pool_stats(view, view.columns)["num_allocated"] == pool.stats()["num_allocated"]
    assert not view.torn
    full = source.read_full()
    assert bytes(full.raw[:64]) == bytes(pool.view.raw[:64])
    # No lock was taken by reading (the acquire counters did not move).
    assert np.array_equal(pool.view.locks["num_acquires"], before)


def test_bad_target_is_one_clear_pool_error(tmp_path):
    with pytest.raises(PoolError, match="no pool named"):
        open_source("no-such-pool-xyz")
    junk = tmp_path / "junk.kvd"
    junk.write_bytes(b"not a dump at all")
    with pytest.raises(PoolError, match="not a kvscope dump"):
        open_source(str(junk))
    with pytest.raises(PoolError, match="no such dump file"):
        open_source(str(tmp_path / "missing.kvd"))


def test_top_of_a_directory_or_fifo_says_what_it_is(tmp_path):
    # `kvscope top DIR` said "no such dump file: DIR", though DIR exists; analyze says what it is
    with pytest.raises(PoolError, match="is a directory, not a dump file"):
        open_source(str(tmp_path))
    fifo = tmp_path / "pipe.kvd"
    os.mkfifo(fifo)
    with pytest.raises(PoolError) as err:
        open_source(str(fifo))
    assert "no such dump file" not in str(err.value)


def test_block_map_groups_large_pools_without_losing_findings():
    # GIVEN 100,000 blocks on 1,000 cells, one allocated block with refcount 3 and a finding
    n, cells = 100_000, 1_000
    state = np.zeros(n, np.uint8)
    refcount = np.zeros(n, np.int32)
    marked = np.zeros(n, bool)
    state[12_345], refcount[12_345] = 1, 3
    marked[99_999] = True
    codes = cell_codes(state, refcount, marked, group=100, num_cells=cells)
    # THEN its cell is coloured allocated and shaded for refcount 3, and the finding is marked
    assert codes[123] & 7 == 1 and codes[123] >> 3 & 3 == 2
    assert codes[999] >> 8 & 1
    assert (codes[:123] & 7 == 0).all()


def test_run_top_rejects_a_missing_pool():
    from kvscope.tui import run_top

    with pytest.raises(PoolError):
        run_top("no-such-pool-xyz")


@pytest.fixture(autouse=True)
def _no_stray_dumps():
    yield
    assert not [p for p in os.listdir(".") if p.startswith("tui-test-") and p.endswith(".kvd")]


@sync
async def test_top_shows_the_gpu_memory_beside_a_gpu_pool_s_bytes(make_pool):
    # GIVEN a live pool watched by top with the NVML reading of its GPU (a fake NVML: one
    # 80 GiB GPU with 60 GiB used)
    from kvscope.probes.nvml import GpuMemoryReader
    from kvscope.tui.widgets.header import PoolHeader
    from tests.test_otel_nvml import FakeNvml

    pool = make_pool(64)
    gpu = GpuMemoryReader("cuda:0", nvml=FakeNvml())
    app = TopApp(LiveSource(pool.name), hz=20, gpu=gpu)
    async with app.run_test(size=(200, 48)) as pilot:
        await settle(pilot, app)
        # THEN the header shows the GPU's memory and the pool's KV bytes against it
        text = app.query_one(PoolHeader)._text
        kv = int(pool.view.h["data_bytes"]) / 2**30
        assert f"GPU 0 NVIDIA H200 60.0/80.0 GiB used, KV data {kv:.2f} GiB" in text
    gpu.close()


def test_top_reads_a_gpu_only_for_a_live_pool_on_one(make_pool):
    # GIVEN a live pool on the CPU and a dump, THEN top reads no GPU for them
    pool = make_pool(64)
    assert gpu_reader(LiveSource(pool.name)) is None
    assert gpu_reader(ViewSource(frozen_view(pool), name="d")) is None
    # AND for a live pool whose header says cuda:1, it reads that GPU
    source = SimpleNamespace(live=True, view=SimpleNamespace(h={"device": b"cuda:1\0\0"}))
    reader = gpu_reader(source)
    assert reader is not None and reader.device == "cuda:1"
    reader.close()


@sync
async def test_a_live_pool_shows_the_chosen_sequence_and_block_whole(make_pool):
    # GIVEN top on a live pool (whose frames copy whole only the records on show)
    pool = make_pool(64)
    populate(pool)
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, app)
        # WHEN a request is chosen
        await pilot.press("r", *"req-b", "enter")
        table = app.query_one(BlockTableView)
        for _ in range(40):
            await pilot.pause(0.05)
            if table.num_rows == 3:
                break
        # THEN its block table marks the shared blocks and the copy-on-write copy, and the
        # block panel shows its first block's record as the pool holds it
        marks = [table._row_of(i)[0][5] for i in range(table.num_rows)]
        assert marks == ["shared x2", "shared x2", "cow copy"]
        b = table.table[0]
        inspector = app.query_one(BlockInspector)
        for _ in range(40):
            await pilot.pause(0.05)
            if inspector._shown[0] == b:
                break
        assert f"generation {int(pool.view.blocks[b]['generation'])}" in inspector._shown[1]
        assert "refcount 2" in inspector._shown[1]


def _screen_lines(widget) -> list[str]:
    """The widget's lines as the compositor gets them (its styles cache included)."""
    size = widget.outer_size
    strips = widget.render_lines(Region(0, 0, size.width, size.height))
    return ["".join(seg.text for seg in strip) for strip in strips]


@sync
async def test_a_row_that_changes_is_repainted(make_pool):
    # GIVEN top on a live pool, its sequence list on screen
    pool = make_pool(64)
    pool.allocate("first", list(range(8)))
    seq = pool.allocate("second", list(range(8)))
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, app)
        seqs = app.query_one(SequenceList)
        (line,) = [x for x in _screen_lines(seqs) if "second" in x]
        assert " 8 " in line
        # WHEN one sequence grows
        pool.append(seq, list(range(8, 13)))
        for _ in range(40):
            await pilot.pause(0.05)
            (line,) = [x for x in _screen_lines(seqs) if "second" in x]
            if " 13 " in line:
                break
        # THEN its line shows the new token count, and the other line is unchanged
        assert " 13 " in line
        (other,) = [x for x in _screen_lines(seqs) if "first" in x]
        assert " 8 " in other


def _cell_codes_by_cell(state, refcount, marked, group, num_cells):
    """cell_codes one cell at a time (what the vectorised one must equal)."""
    out = []
    n = len(state)
    for c in range(num_cells):
        blocks = range(c * group, min(n, (c + 1) * group))
        if not len(blocks):
            out.append(-1)
            continue
        st = [min(int(state[b]), 4) for b in blocks]
        used = sum(s != 0 for s in st)
        counts = [st.count(s) for s in range(5)]
        colour = 1 + int(np.argmax(counts[1:])) if used else 0
        shade = min(max(max(int(refcount[b]) for b in blocks) - 1, 0), 3)
        if not used:
            fill = 0
        elif group == 1:
            fill = 4
        else:
            fill = min(4, 1 + min(3, int(used / len(blocks) * 4)))
        mark = int(any(marked[b] for b in blocks))
        out.append(colour | shade << 3 | fill << 5 | mark << 8)
    return out


@pytest.mark.parametrize(
    "n,group,cells", [(1000, 7, 150), (999, 10, 100), (64, 1, 80), (50, 3, 17)]
)
def test_block_map_cells_count_each_cell_s_blocks(n, group, cells):
    # GIVEN random block states, refcounts and findings
    rng = np.random.default_rng(n)
    state = rng.integers(0, 6, n).astype(np.uint8)
    state[rng.random(n) < 0.5] = 0
    refcount = rng.integers(0, 6, n).astype(np.int32)
    marked = rng.random(n) < 0.01
    # WHEN the map's cells are worked out THEN each is what its own blocks say
    codes = cell_codes(state, refcount, marked, group, cells)
    assert codes.tolist() == _cell_codes_by_cell(state, refcount, marked, group, cells)


@sync
async def test_top_at_steps_through_the_recorded_operations(tmp_path):
    """`kvscope top LOG --at N`: the pool after operation N, `]` and `[` one operation forward
    and back (the header says which), the panels following."""
    from kvscope.allocator import PoolConfig
    from kvscope.allocator.layout import BlockState
    from kvscope.allocator.oplog import read_log
    from kvscope.replay import Stepper
    from kvscope.tui.source import ReplaySource

    path = tmp_path / "run.ops"
    name = f"tui-at-{os.getpid()}"
    pool = KVPool.create(name, PoolConfig(num_blocks=32, block_size=4, record_ops=str(path)))
    try:
        a = pool.allocate("req-a", list(range(10)))  # operation 2: 3 blocks
        pool.allocate("req-b", list(range(20, 28)))  # operation 3: 2 more
        pool.free(a)  # operation 4
    finally:
        pool.close()  # operation 5: its report of req-b, still live (a leak); 6: the close
        pool.unlink()
    stepper = Stepper(read_log(str(path)))
    stepper.goto(3)
    app = TopApp(ReplaySource(stepper, str(path)))

    def held() -> int:
        cols = app.frame.columns
        return int((cols["state"] == int(BlockState.ALLOCATED)).sum())

    async def shown(pilot) -> None:
        """Until the frame on screen is of the step's view (the worker's, after a key)."""
        for _ in range(400):
            await pilot.pause(0.02)
            if app.frame is not None and app.frame.view is app.source.view:
                return

    async with app.run_test(size=(120, 36)) as pilot:
        await settle(pilot, app)
        header = app.query_one("#header")
        assert "operation 3 (2/5 in the log): allocate req-b" in header.mode and held() == 5
        await pilot.press("right_square_bracket")
        await shown(pilot)
        assert "operation 4 (3/5 in the log): free req-a" in header.mode and held() == 2
        # (the creator's close: req-b's blocks still held in the pool it leaves)
        await pilot.press("right_square_bracket")
        await shown(pilot)
        assert "operation 5 (4/5 in the log): report req-b found leak_finished" in header.mode
        await pilot.press("right_square_bracket")
        await shown(pilot)
        assert "operation 6 (5/5 in the log): close" in header.mode and held() == 2
        await pilot.press("left_square_bracket", "left_square_bracket", "left_square_bracket")
        await pilot.press("left_square_bracket")
        await shown(pilot)
        assert "operation 2 (1/5 in the log): allocate req-a" in header.mode and held() == 3
        await pilot.press("q")
    app.source.close()


@sync
async def test_top_s_header_counts_the_pool_exhausted_raised(make_pool):
    # GIVEN a live pool whose process caught a PoolExhausted (no finding, nothing held now)
    from kvscope.allocator import PoolExhausted
    from kvscope.tui.widgets.header import PoolHeader

    pool = make_pool(16, local_cache_size=0)
    held = pool.allocate("held", list(range(40)))
    with pytest.raises(PoolExhausted):
        pool.allocate("big", list(range(100, 140)))
    pool.free(held)
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(200, 48)) as pilot:
        await settle(pilot, app)
        # THEN the header says so beside the pool's usage
        assert "procs 1  PoolExhausted 1  " in app.query_one(PoolHeader)._text


@sync
async def test_top_s_header_says_each_probe_on_or_off_in_words(make_pool):
    # GIVEN a live pool made outside `kvscope run`, every probe off (analyze: "guard off, ...")
    from kvscope.tui.widgets.header import PoolHeader

    pool = make_pool(16)
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(200, 48)) as pilot:
        await settle(pilot, app)
        # THEN the header's plain text says they are off (not only a dim strike-through style)
        assert "probes: guard off, events off, lockdep off" in app.query_one(PoolHeader)._text


@sync
async def test_top_s_header_accounts_for_every_block_and_says_when_it_was_read(make_pool):
    # GIVEN a live pool with blocks allocated, cached, in a local cache, quarantined and free
    from kvscope.tui.frame import clock
    from kvscope.tui.widgets.header import PoolHeader
    from tests.test_ls import every_state

    pool = make_pool(16)
    lease = every_state(pool)
    app = TopApp(LiveSource(pool.name), hz=20)
    async with app.run_test(size=(240, 48)) as pilot:
        await settle(pilot, app)
        text = app.query_one(PoolHeader)._text
        # THEN the header's counts add up to the pool's 16 blocks (2 + 9 + 1 + 1 + 3)
        assert "used 2 (12.5%)  free 9  cached 1  local 1  quarantined 3  seqs 1" in text
        # AND it says when the snapshot it shows was read, to the millisecond
        assert f"read {clock(app.frame.taken_ns)}" in text
    lease.release()


@sync
async def test_one_frame_s_numbers_come_from_its_own_snapshot(make_pool):
    # GIVEN top showing a live frame of a pool with one sequence
    from kvscope.tui.frame import Frame
    from kvscope.tui.widgets.header import PoolHeader
    from kvscope.tui.widgets.sparklines import Trends

    pool = make_pool(16)
    pool.allocate("one", list(range(4)))
    app = TopApp(ViewSource(snapshot(pool.view)))

    def frame_of(taken_ns: int) -> Frame:
        view = snapshot(pool.view)
        return Frame(
            view=view,
            stats=pool_stats(view),
            findings=[],
            taken_ns=taken_ns,
            copy_ms=0.0,
            torn=False,
            live=True,
        )

    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, app)
        t0 = 10**18
        app.frame = frame_of(t0)
        await pilot.pause(0.05)
        sampled = len(app.query_one(Trends).samples[0])
        # WHEN the next frame, a tenth of a second later, has two more sequences
        pool.allocate("two", list(range(100, 108)))
        pool.allocate("three", list(range(200, 212)))
        app.frame = frame_of(t0 + 100_000_000)
        await pilot.pause(0.05)
        # THEN the header, the sequences panel's title and rows, and the trends' labels all
        # say that frame's numbers (the sparklines themselves sample twice a second)
        header = app.query_one(PoolHeader)._text
        seqs = app.query_one(SequenceList)
        labels = app.query_one(Trends).labels
        assert "37.5%" in header and "seqs 3 " in header
        assert str(seqs.border_title) == "sequences (3)" and seqs.num_rows == 3
        assert labels[0] == "utilization 37.5%"
        assert labels[1] == f"free blocks {app.frame.stats['num_free']}"
        assert len(app.query_one(Trends).samples[0]) == sampled


@sync
async def test_the_sequences_say_how_long_each_request_has_gone_unserved(make_pool, monkeypatch):
    # GIVEN a copy of a live pool taken 45 s after one request was last served and 2 s after
    # another, idle requests said past 30 s
    monkeypatch.setenv("KVSCOPE_IDLE_REQUEST_S", "30")
    pool = make_pool(64)
    parked = pool.allocate("parked", list(range(8)))
    busy = pool.allocate("busy", list(range(8)))
    view = snapshot(pool.view)
    view.seqs["active_ns"][parked.slot] = view.taken_mono_ns - 45 * 10**9
    view.seqs["active_ns"][busy.slot] = view.taken_mono_ns - 2 * 10**9
    app = TopApp(ViewSource(view, name=pool.name))
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, app)
        lines = _screen_lines(app.query_one(SequenceList))
    # THEN each row says it in its idle column, and the request past the threshold is a warning
    (p,) = [x for x in lines if "parked" in x]
    (b,) = [x for x in lines if "busy" in x]
    assert " 45s " in p and " 2s " in b, lines
    assert "idle_request" in [f.kind for f in app.frame.findings]
