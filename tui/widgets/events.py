"""The event tail: the newest events of every process's flight-recorder ring."""

from __future__ import annotations

import numpy as np
from textual.reactive import reactive

from kvscope.tui.frame import Frame, clock, last_events, op_name, request_of
from kvscope.tui.messages import BlockChosen
from kvscope.tui.widgets import retitle
from kvscope.tui.widgets.rows import Row, RowsView

TAIL = 200


class EventTail(RowsView):
    """Newest event first; empty until the events probe records some. The cursor stays on its
    event as newer ones arrive above it (on the top row, it follows the newest)."""

    COLUMNS = [("time", 12), ("pid", 7), ("op", 10), ("block", 7), ("gen", 5), ("request", 0)]

    frame: reactive[Frame | None] = reactive(None, repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "events"
        self.empty_text = "no events recorded (the events probe is off)"
        self.events: np.ndarray | None = None
        self._newest = -1

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        ev = last_events(frame.view, TAIL)
        newest = int(ev["time_ns"][-1]) if len(ev) else 0
        if newest == self._newest and len(ev) == (0 if self.events is None else len(self.events)):
            return
        arrived = int((ev["time_ns"] > self._newest).sum()) if self._newest >= 0 else 0
        self._newest = newest
        # Newest first: row i is the i-th newest event.
        ev = ev[::-1]
        self.events = ev
        keep = self.num_rows > 0 and self.cursor > 0

        def row_of(i: int) -> Row:
            e = ev[i]
            return (
                (
                    clock(int(e["time_ns"])),
                    str(int(e["pid"])),
                    op_name(int(e["op"])),
                    str(int(e["block"])),
                    str(int(e["generation"])),
                    request_of(e),
                ),
                None,
            )

        retitle(self, f"events ({len(ev)}, newest first)" if len(ev) else "events")
        self.set_rows(len(ev), row_of)
        if keep and len(ev):
            self.cursor = min(len(ev) - 1, self.cursor + arrived)

    def on_rows_view_chosen(self, event: RowsView.Chosen) -> None:
        event.stop()
        if self.events is not None and int(self.events[event.index]["block"]) >= 0:
            self.post_message(BlockChosen(int(self.events[event.index]["block"])))
