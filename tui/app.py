"""TopApp: the live (or dump) view of one pool, and `run_top`, the entry the CLI calls."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.reactive import reactive
from textual.widgets import Footer
from textual.worker import get_current_worker

from kvscope.allocator.dumpfile import write_dump
from kvscope.allocator.errors import PoolError
from kvscope.allocator.findings import Finding
from kvscope.allocator.findingset import Origin, checked_findings, merge, recorded_findings
from kvscope.allocator.layout import (
    SegmentView,
)
from kvscope.allocator.snapshot import snapshot
from kvscope.allocator.stats import pool_stats
from kvscope.tui.detail import FindingScreen
from kvscope.tui.frame import Frame, block_columns
from kvscope.tui.help import GotoScreen, HelpScreen
from kvscope.tui.messages import (
    BlockChosen,
    CheckDone,
    FindingChosen,
    FrameReady,
    SequenceChosen,
)
from kvscope.tui.source import ReplaySource, Source, open_source
from kvscope.tui.widgets.blockmap import BlockMap
from kvscope.tui.widgets.events import EventTail
from kvscope.tui.widgets.findings import FindingsPanel
from kvscope.tui.widgets.header import PoolHeader
from kvscope.tui.widgets.inspector import BlockInspector
from kvscope.tui.widgets.locks import LocksPanel
from kvscope.tui.widgets.script import ScriptOutput, ScriptPanel
from kvscope.tui.widgets.sequences import BlockTableView, SequenceList
from kvscope.tui.widgets.sparklines import Trends

# A full check_view may use at most 1/CHECK_SHARE of the TUI's time (large pools check less often).
CHECK_SHARE = 25
# How often the script panel of `kvscope run --live` looks for new output.
SCRIPT_EVERY_S = 0.2


class TopApp(App[int]):
    """`kvscope top`: header, block map, sequences, block table, inspector, events, findings, locks, trends."""

    CSS_PATH = "top.tcss"
    TITLE = "kvscope top"
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    BINDINGS = [
        Binding("question_mark", "help", "Help"),
        Binding("g", "goto_block", "Block"),
        Binding("r", "goto_request", "Request"),
        Binding("p,space", "toggle_pause", "Pause"),
        Binding("d", "dump", "Dump"),
        Binding("c", "check", "Check"),
        Binding("left_square_bracket", "step(-1)", "Back"),
        Binding("right_square_bracket", "step(1)", "Forward"),
        Binding("left_curly_bracket", "step(-100)", show=False),
        Binding("right_curly_bracket", "step(100)", show=False),
        Binding("q", "quit", "Quit"),
    ]
    KEY_HELP = [
        ("?", "this help"),
        ("g", "go to a block by id"),
        ("r", "go to a request (request id or sequence id)"),
        ("p / space", "pause or resume the live refresh"),
        ("d", "write a dump of the pool to the current directory"),
        ("c", "run a full consistency check now"),
        ("[ / ]", "one recorded operation back / forward (top --at)"),
        ("{ / }", "a hundred recorded operations back / forward"),
        ("q", "quit"),
    ]
    # Actions of a live pool only: a dump does not change, is already a dump, and was checked
    # once when it was opened.
    LIVE_ONLY = {"toggle_pause": "p / space", "dump": "d", "check": "c"}

    frame: reactive[Frame | None] = reactive(None, repaint=False)
    selected_block: reactive[int] = reactive(-1, repaint=False)
    selected_seq: reactive[int] = reactive(-1, repaint=False)
    paused: reactive[bool] = reactive(False, repaint=False)

    def __init__(
        self,
        source: Source,
        *,
        hz: float = 10.0,
        check_every_s: float = 2.0,
        script: ScriptOutput | None = None,
        stop: threading.Event | None = None,
        gpu: Any = None,
    ) -> None:
        super().__init__()
        # NVML's reading of the GPU a live pool lives on (`gpu_reader`), shown in the header
        # beside the pool's KV bytes; None for a dump or a pool on the CPU.
        self.gpu = gpu
        # Set by `kvscope run --live` when a stop signal reaches it (its terminal hung up, a
        # service manager's SIGTERM): the TUI closes, as a plain `kvscope top` would die.
        self.stop = stop
        if not hz > 0:
            raise PoolError(f"refresh rate must be positive, got {hz} Hz")
        self.source = source
        self.script = script
        self._script_status = "running"
        self.hz = hz
        self.check_every_s = check_every_s
        self.checked: list[Finding] = []
        self.num_frames = 0
        self.num_checks = 0
        self._consumed = threading.Event()
        self._consumed.set()
        self._wake = threading.Event()
        self._check_now = False
        self._ring_head = -1
        self._ring: list[Finding] = []
        # Where the findings come from besides the segment (its KV data, its dump header), as
        # every reader assembles them (kvscope.allocator.findingset).
        dump = getattr(source, "path", None) if hasattr(source, "dump_header") else None
        self._origin = (
            Origin.live(source.name, getattr(source, "trust_owner", False))
            if source.live
            else Origin.of_dump(dump, source.dump_header)  # type: ignore[attr-defined]
            if dump
            else Origin()
        )

    def _origin_now(self) -> Origin:
        """Where the findings come from now: a live pool whose files were unlinked (its
        program closed and removed it while top watched) is the mapped segment alone, since
        the data file at its name is gone or another pool's: checking that file would report
        the pool's KV data missing."""
        unlinked = getattr(self.source, "unlinked", None)
        if unlinked is not None and unlinked():
            return Origin()
        return self._origin

    def compose(self) -> ComposeResult:
        yield PoolHeader(id="header")
        with Horizontal(id="main"):
            yield BlockMap(id="blockmap")
            with Vertical(id="right"):
                yield SequenceList(id="sequences")
                yield BlockTableView(id="blocktable")
        with Horizontal(id="bottom"):
            yield BlockInspector(id="inspector")
            yield EventTail(id="events")
            yield FindingsPanel(id="findings")
            yield LocksPanel(id="locks")
        if self.script is not None:
            yield ScriptPanel(self.script, id="script")
        yield Trends(id="trends")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(BlockMap).focus()
        self._show_mode()
        if self.script is not None:
            self.screen.add_class("-with-script")
            self.set_interval(SCRIPT_EVERY_S, self._script_state)
        if self.stop is not None:
            self.set_interval(SCRIPT_EVERY_S, self._stop_requested)
        self.poll()

    def _stop_requested(self) -> None:
        if self.stop is not None and self.stop.is_set():
            self.exit(0)

    # -- the worker -------------------------------------------------------------------------

    def take_frame(self) -> Frame:
        """Read one snapshot and derive what every panel shares (runs in the worker)."""
        t0 = time.perf_counter()
        # (the block panel and the block table show these records field by field)
        view = self.source.read(self.selected_block, self.selected_seq)
        copy_ms = (time.perf_counter() - t0) * 1e3
        head = int(view.h["findings_head"])
        if head != self._ring_head:
            self._ring_head, self._ring = head, recorded_findings(view)
        findings = merge(self._ring, self.checked)
        return Frame.of(
            view,
            stats=pool_stats(view, getattr(view, "columns", None)),
            findings=findings,
            taken_ns=time.time_ns() if self.source.live else getattr(self.source, "taken_ns", 0),
            copy_ms=copy_ms,
            torn=bool(getattr(view, "torn", False)),
            live=self.source.live,
            extra={"gpu": self.gpu.read()} if self.gpu is not None else {},
        )

    def _check(self, view: SegmentView) -> float:
        t0 = time.perf_counter()
        if not getattr(view, "torn", False):
            try:
                self.checked = checked_findings(view, self._origin_now()).findings
            except PoolError:
                pass  # the pool went away while its KV data was checked: the next frame says so
        cost = time.perf_counter() - t0
        self.post_message(CheckDone(self.checked, cost))
        return cost

    @work(thread=True, exclusive=True, group="poll")
    def poll(self) -> None:
        """Take a snapshot every 1/hz seconds (never a lock); a full check every few seconds."""
        worker = get_current_worker()
        period = 1.0 / self.hz
        next_check = 0.0
        live = self.source.live
        if not live:
            self.post_message(FrameReady(self.take_frame()))
            self._check(self.source.read_full())
            return
        while not worker.is_cancelled:
            t0 = time.monotonic()
            if not self.paused or not self.num_frames:
                # Wait until the app has taken the previous frame: no backlog, and the buffer
                # the app shows is never the one being written.
                if not self._consumed.wait(timeout=0.5):
                    continue
                self._consumed.clear()
                if t0 >= next_check or self._check_now:
                    self._check_now = False
                    cost = self._check(self.source.read_full())
                    next_check = time.monotonic() + max(self.check_every_s, CHECK_SHARE * cost)
                self.post_message(FrameReady(self.take_frame()))
            self._wake.wait(max(0.0, t0 + period - time.monotonic()))
            self._wake.clear()

    # -- messages ---------------------------------------------------------------------------

    def on_frame_ready(self, message: FrameReady) -> None:
        self.num_frames += 1
        self.frame = message.frame
        # The worker copies the next frame once this one is on screen, so the copy and the
        # panels' work do not take turns at the GIL: a copy kept waiting for it outlasts the
        # pool's quiet moments and is tried again.
        self.call_after_refresh(self._consumed.set)

    def on_check_done(self, message: CheckDone) -> None:
        self.num_checks += 1
        if self.frame is not None and not self.source.live:
            self.frame = Frame(
                **{**self.frame.__dict__, "findings": merge(self._ring, self.checked)}
            )

    def watch_frame(self, frame: Frame | None) -> None:
        try:
            panels = self._panels()
        except NoMatches:
            # a frame that lands while the screen is still being built or already torn down
            return
        for panel in panels:
            panel.frame = frame

    def watch_selected_block(self, block: int) -> None:
        if not self.is_running:
            return  # (read before the app runs: a frame taken by a caller of its own)
        # A live frame holds the records of the blocks shown when it was taken: the next one,
        # with this block's, is taken now rather than at the next tick.
        self._wake.set()
        self.query_one(BlockMap).selected_block = block
        self.query_one(BlockInspector).selected_block = block

    def watch_selected_seq(self, slot: int) -> None:
        if not self.is_running:
            return
        self._wake.set()
        self.query_one(SequenceList).selected_seq = slot
        self.query_one(BlockTableView).selected_seq = slot

    def watch_paused(self) -> None:
        self._show_mode()

    def _script_state(self) -> None:
        """New output in the script panel; in the header whether the script still runs, and a
        notification once when it ends (on a timer: a paused view still follows the script)."""
        assert self.script is not None
        self.query_one(ScriptPanel).refresh_output()
        status = self.script.status()
        if status != self._script_status:
            self._script_status = status
            self._show_mode()
            self.notify(f"the script {status}; q quits", timeout=10)

    def _panels(self) -> list:
        return [
            self.query_one(PoolHeader),
            self.query_one(BlockMap),
            self.query_one(SequenceList),
            self.query_one(BlockTableView),
            self.query_one(BlockInspector),
            self.query_one(EventTail),
            self.query_one(FindingsPanel),
            self.query_one(LocksPanel),
            self.query_one(Trends),
        ]

    def _show_mode(self) -> None:
        stepper = getattr(self.source, "stepper", None)
        if stepper is not None:
            mode = f"replay {getattr(self.source, 'path', '')} at {stepper.describe()}"
        elif not self.source.live:
            mode = f"dump {getattr(self.source, 'path', '')}"
        elif self.paused:
            mode = "PAUSED (p resumes)"
        else:
            mode = f"live {self.hz:g} Hz"
        if self.script is not None:
            mode += "  script " + self._script_status.replace("exited with status", "exit")
        self.query_one(PoolHeader).mode = mode

    def on_block_chosen(self, message: BlockChosen) -> None:
        self.selected_block = message.block

    def on_finding_chosen(self, message: FindingChosen) -> None:
        frame = self.frame
        if frame is None:
            return
        block = message.finding.block
        if block is not None and not frame.has_records([block]):
            # The live frame holds the records of the blocks on show: the finding's block is
            # read in a fresh consistent copy of the pool.
            view = snapshot(self.source.view)
            frame = replace(frame, view=view, columns=block_columns(view), records=None)
        self.push_screen(FindingScreen(frame, message.finding))

    def on_sequence_chosen(self, message: SequenceChosen) -> None:
        self.selected_seq = message.slot
        if self.frame is not None:
            table = self.frame.block_table(message.slot)
            if len(table):
                self.selected_block = int(table[0])

    # -- actions ----------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """On a dump, the live-only actions are neither offered (footer) nor run."""
        if action in self.LIVE_ONLY and not self.source.live:
            return False
        if action == "step" and not hasattr(self.source, "step"):
            return False
        return True

    def action_help(self) -> None:
        """Show every key binding that applies, and the block map's legend."""
        hidden = set() if self.source.live else set(self.LIVE_ONLY.values())
        if not hasattr(self.source, "step"):
            hidden |= {"[ / ]", "{ / }"}
        self.push_screen(HelpScreen([kh for kh in self.KEY_HELP if kh[0] not in hidden]))

    def action_step(self, delta: int) -> None:
        """Step through the recorded operations (a ReplaySource): the pool after the operation
        `delta` from the one shown, its panels and its check redone."""
        step = getattr(self.source, "step", None)
        if step is None:
            return
        step(delta)
        self._ring_head = -1
        self.checked = []
        self._show_mode()
        self.poll()

    def action_toggle_pause(self) -> None:
        """Pause or resume the live refresh."""
        self.paused = not self.paused
        self._wake.set()

    def action_check(self) -> None:
        """Run check_view on the next frame."""
        self._check_now = True
        self._wake.set()
        self.notify("checking the whole pool")

    def action_goto_block(self) -> None:
        """Ask for a block id and inspect it."""
        self.push_screen(GotoScreen("block"), self.goto_block)

    def action_goto_request(self) -> None:
        """Ask for a request id and show its sequence."""
        self.push_screen(GotoScreen("request"), self.goto_request)

    def goto_block(self, text: str | None) -> None:
        """Select block `text` (a decimal id, optionally '#'- or 'b'-prefixed)."""
        if not text or self.frame is None:
            return
        digits = text.lstrip("#bB")
        n = self.frame.num_blocks
        if not digits.isdigit() or not 0 <= int(digits) < n:
            self.notify(f"no block {text!r}: block ids run from 0 to {n - 1}", severity="error")
            return
        self.selected_block = int(digits)
        self.query_one(BlockMap).focus()

    def goto_request(self, text: str | None) -> None:
        """Select the sequence whose request id (or else sequence id, or else a prefix) is `text`."""
        if not text or self.frame is None:
            return
        seqs = self.frame.view.seqs
        live = self.frame.live_slots()
        requests = [bytes(r).decode(errors="replace") for r in seqs["request"][live]]
        slot = next((int(s) for s, r in zip(live, requests) if r == text), None)
        if slot is None and text.isdigit():
            hit = live[seqs["seq_id"][live] == int(text)]
            slot = int(hit[0]) if len(hit) else None
        if slot is None:
            slot = next((int(s) for s, r in zip(live, requests) if r.startswith(text)), None)
        if slot is None:
            self.notify(f"no live request {text!r}", severity="error")
            return
        self.post_message(SequenceChosen(slot))
        self.query_one(SequenceList).focus()

    def action_dump(self) -> None:
        """Write a dump of the pool (a fresh consistent snapshot) next to where top was started."""
        name = self.source.name or "pool"
        path = os.path.abspath(f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.kvd")
        self.write_dump(path)

    @work(thread=True, group="dump")
    def write_dump(self, path: str) -> None:
        """Write the dump off the UI thread and say where it went."""
        try:
            view = snapshot(self.source.view) if self.source.live else self.source.read_full()
            write_dump(view, path, reason="kvscope top: d pressed")
        except (OSError, PoolError) as e:
            self.call_from_thread(self.notify, f"dump failed: {e}", severity="error")
            return
        self.call_from_thread(self.notify, f"dump written to {path}")

    async def action_quit(self) -> None:
        """Stop polling and exit."""
        self._wake.set()
        self.exit(0)


def gpu_reader(source: Source) -> Any:
    """A `GpuMemoryReader` of the GPU a live pool's KV data is on; None for a dump (its GPU's
    memory now says nothing about the moment it was taken) or a pool on the CPU."""
    if not source.live:
        return None
    device = bytes(source.view.h["device"]).rstrip(b"\0").decode(errors="replace")
    if not device.startswith("cuda"):
        return None
    # imports the pool's package (and torch): only for a pool on a GPU
    from kvscope.probes.nvml import GpuMemoryReader

    return GpuMemoryReader(device)


def run_top(
    target: str,
    *,
    hz: float = 10.0,
    script: ScriptOutput | None = None,
    stop: threading.Event | None = None,
    stepper: Any = None,
) -> int:
    """Show the TUI on a live pool (by name) or a dump (by path); returns the exit code.

    `script`: the output and state of the script `kvscope run --live` runs (a log panel);
    `stop`: closes the TUI when set (a stop signal reached `kvscope run --live`); `stepper`: a
    replay of the operation log `target` stepped through (kvscope.replay.Stepper, at its first
    operation shown), with [ and ].
    """
    source: Source = ReplaySource(stepper, target) if stepper is not None else open_source(target)
    gpu = None
    try:
        gpu = gpu_reader(source)
        app = TopApp(source, hz=hz, script=script, stop=stop, gpu=gpu)
        app.run()
    finally:
        if gpu is not None:
            gpu.close()
        source.close()
    return app.return_code or 0
