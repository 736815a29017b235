"""The findings panel: the pool's findings ring plus the latest full check."""

from __future__ import annotations

from textual.reactive import reactive

from kvscope.allocator.findings import Finding
from kvscope.tui.frame import Frame
from kvscope.tui.messages import BlockChosen, FindingChosen
from kvscope.tui.widgets import retitle
from kvscope.tui.widgets.rows import Row, RowsView


class FindingsPanel(RowsView):
    """Every finding, errors in red; enter on one opens it whole (the detail view) and inspects
    its block. The message follows the kind in the widest column; a cut one ends in `…`."""

    COLUMNS = [("sev", 4), ("block", 6), ("finding", 0)]

    frame: reactive[Frame | None] = reactive(None, repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "findings"
        self.empty_text = "no findings"
        self.findings: list[Finding] = []

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        found = frame.findings
        if found == self.findings:
            return
        self.findings = list(found)
        errors = sum(f.severity == "error" for f in found)
        retitle(
            self,
            f"findings ({errors} errors, {len(found) - errors} warnings)" if found else "findings",
        )

        def row_of(i: int) -> Row:
            f = self.findings[i]
            sev = "ERR" if f.severity == "error" else "warn"
            return (
                (sev, "" if f.block is None else str(f.block), f"{f.kind}: {f.message}"),
                "bold red" if f.severity == "error" else "yellow",
            )

        self.set_rows(len(self.findings), row_of)

    def on_rows_view_chosen(self, event: RowsView.Chosen) -> None:
        event.stop()
        f = self.findings[event.index]
        if f.block is not None:
            self.post_message(BlockChosen(f.block))
        self.post_message(FindingChosen(f))
