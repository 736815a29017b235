"""The live sequences and the selected sequence's block table (logical -> physical)."""

from __future__ import annotations

import math

from textual.reactive import reactive

from kvscope.allocator.idle import idle_ages, idle_threshold_s
from kvscope.tui.frame import SEQ_STATE_NAMES, STATE_NAMES, Frame, cow_positions, request_of
from kvscope.tui.messages import BlockChosen, SequenceChosen
from kvscope.tui.widgets import retitle
from kvscope.tui.widgets.rows import Row, RowsView

SEQ_STYLES = {
    "running": None,
    "waiting": "yellow",
    "preempted": "yellow",
    "finished": "dim",
    "aborted": "red",
}


class SequenceList(RowsView):
    """One row per live sequence; moving the cursor shows its block table."""

    COLUMNS = [
        ("slot", 5),
        ("request", 16),
        ("pid", 7),
        ("state", 9),
        ("tokens", 7),
        ("blocks", 6),
        ("idle", 5),
    ]

    frame: reactive[Frame | None] = reactive(None, repaint=False)
    selected_seq: reactive[int] = reactive(-1, repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "sequences"
        self.empty_text = "no live sequences"
        self.slots: list[int] = []

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        self.slots = frame.live_slots().tolist()
        seqs = frame.view.seqs
        # (how long since its process last served each: a live pool's copy says when it was
        # taken; a dump's does not)
        now = getattr(frame.view, "taken_mono_ns", None)
        ages = idle_ages(frame.view, now) if now is not None else None
        limit = idle_threshold_s(frame.view)

        def row_of(i: int) -> Row:
            s = seqs[self.slots[i]]
            state = SEQ_STATE_NAMES.get(int(s["state"]), str(int(s["state"])))
            age = math.nan if ages is None else float(ages[self.slots[i]])
            idle = 0 < limit <= age
            return (
                (
                    str(self.slots[i]),
                    request_of(s),
                    str(int(s["owner_pid"])),
                    state,
                    str(int(s["num_tokens"])),
                    str(int(s["num_blocks"])),
                    age_text(age),
                ),
                "bold red" if idle else SEQ_STYLES.get(state),
            )

        # The count of the rows shown, from this frame as the header's `seqs` is (a new title
        # repaints the whole panel, but only when the count changed: when rows did too).
        retitle(self, f"sequences ({len(self.slots)})")
        self.set_rows(len(self.slots), row_of)
        self._place_cursor()

    def watch_selected_seq(self) -> None:
        self._place_cursor()

    def _place_cursor(self) -> None:
        if self.selected_seq in self.slots:
            self.cursor = self.slots.index(self.selected_seq)

    def cursor_moved(self) -> None:
        if self.slots:
            self.post_message(SequenceChosen(self.slots[self.cursor]))

    def on_rows_view_chosen(self, event: RowsView.Chosen) -> None:
        event.stop()
        self.cursor_moved()


def age_text(s: float) -> str:
    """Seconds as a sequence row's `idle` shows them: 42s, 7m, 3h (below 100 of each unit);
    `-` unknown (a dump, a sequence holding no block)."""
    if math.isnan(s):
        return "-"
    if s < 100:
        return f"{max(s, 0):.0f}s"
    return f"{s // 60:.0f}m" if s < 6000 else f"{s // 3600:.0f}h"


class BlockTableView(RowsView):
    """The selected sequence's block table; shared blocks and copy-on-write copies marked."""

    COLUMNS = [
        ("logical", 7),
        ("physical", 8),
        ("ref", 4),
        ("state", 9),
        ("tokens", 6),
        ("mark", 10),
    ]

    frame: reactive[Frame | None] = reactive(None, repaint=False)
    selected_seq: reactive[int] = reactive(-1, repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "block table"
        self.empty_text = "select a sequence"
        self.table: list[int] = []

    def watch_frame(self) -> None:
        self._show()

    def watch_selected_seq(self) -> None:
        self._show()

    def _show(self) -> None:
        frame, slot = self.frame, self.selected_seq
        if frame is None or slot < 0 or int(frame.view.seqs["state"][slot]) == 0:
            self.table = []
            retitle(self, "block table")
            self.set_rows(0, lambda i: ((), None))
            return
        table = frame.block_table(slot)
        if not frame.has_records(table):
            # A sequence chosen since this frame was taken: its records come with the next.
            return
        self.table = table.tolist()
        cols = frame.columns
        cows = cow_positions(frame, slot)
        n = frame.num_blocks
        retitle(self, f"block table of {request_of(frame.view.seqs[slot])!r}")

        def row_of(i: int) -> Row:
            b = self.table[i]
            if not 0 <= b < n:
                return ((str(i), str(b), "", "", "", "BAD ID"), "bold red")
            ref = int(cols["refcount"][b])
            mark, style = "", None
            if i in cows:
                mark, style = "cow copy", "magenta"
            elif ref > 1:
                mark, style = f"shared x{ref}", "cyan"
            state = STATE_NAMES.get(int(cols["state"][b]), "?")
            if state != "allocated":
                mark, style = f"{state}!", "bold red"
            return (
                (str(i), str(b), str(ref), state, str(int(cols["num_tokens"][b])), mark),
                style,
            )

        self.set_rows(len(self.table), row_of)

    def cursor_moved(self) -> None:
        if self.table:
            self.post_message(BlockChosen(self.table[self.cursor]))

    def on_rows_view_chosen(self, event: RowsView.Chosen) -> None:
        event.stop()
        self.cursor_moved()
