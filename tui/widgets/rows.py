"""RowsView: a light, virtual table (Line API) that formats only the rows on screen."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

# A row: its cells (one string per column) and an optional Rich style for the whole row.
Row = tuple[tuple[str, ...], str | None]
ROWS_STEP = 64


class RowsView(ScrollView, can_focus=True):
    """A scrolling table with a fixed header line and a cursor; rows come from `row_of(i)`."""

    DEFAULT_CSS = """
    RowsView { height: 1fr; scrollbar-size-vertical: 1; scrollbar-size-horizontal: 0; }
    """
    BINDINGS = [
        Binding("up", "cursor(-1)", "Up", show=False),
        Binding("down", "cursor(1)", "Down", show=False),
        Binding("pageup", "cursor(-10)", "Page up", show=False),
        Binding("pagedown", "cursor(10)", "Page down", show=False),
        Binding("enter", "choose", "Choose", show=False),
    ]
    # Column labels and widths; the last column takes the remaining width.
    COLUMNS: list[tuple[str, int]] = []

    cursor: reactive[int] = reactive(0, repaint=False)

    @dataclass
    class Chosen(Message):
        """Enter (or a click) on a row."""

        view: RowsView
        index: int

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.num_rows = 0
        self._row_of: Callable[[int], Row] = lambda i: ((), None)
        self._strips: dict[int, Strip] = {}
        # The widget's own style (from CSS, through every ancestor: costly to work out), once
        # per repaint rather than once per line.
        self._base_style: Style | None = None
        self.empty_text = ""
        # The rows on screen at the last set_rows, from row `_shown_top`, of `_shown_rows`.
        self._shown: list[Row] = []
        self._shown_top = 0
        self._shown_rows = -1
        self._shown_rows_known = False
        # The content width and scroll offset, worked out once per repaint (render_lines).
        self._width = 0
        self._top = 0

    def set_rows(self, num_rows: int, row_of: Callable[[int], Row]) -> None:
        """Show `num_rows` rows, row i formatted on demand by `row_of(i)`."""
        self.num_rows = num_rows
        self._row_of = row_of
        if num_rows != self._shown_rows:
            self._shown_rows = num_rows
            self._update_virtual_size()
            if self.cursor >= num_rows:
                self.cursor = max(0, num_rows - 1)
        # Repaint only the lines whose row changed (most frames of a large pool change rows
        # that are scrolled away, or none): Textual's cost is per line repainted.
        top = int(self.scroll_offset.y)
        shown = [row_of(i) for i in range(top, min(num_rows, top + self.size.height))]
        if top != self._shown_top or not self._shown_rows_known:
            self._shown, self._shown_top, self._shown_rows_known = shown, top, True
            self._forget()
            self.refresh()
            return
        old = self._shown
        if shown == old:
            return
        self._shown = shown
        width = self.size.width
        for k in range(max(len(old), len(shown))):
            if k < len(old) and k < len(shown) and old[k] == shown[k]:
                continue
            i = top + k
            self._strips.pop(2 * i, None)
            self._strips.pop(2 * i + 1, None)
            # (line 0 is the column header; with no rows, line 1 says so)
            self.refresh(Region(0, k + 1, width, 1))

    def _cells(self, cells: tuple[str, ...], width: int) -> str:
        out = []
        used = 0
        for k, (_, w) in enumerate(self.COLUMNS):
            text = cells[k] if k < len(cells) else ""
            if k == len(self.COLUMNS) - 1:
                w = max(0, width - used)
            # A cut cell ends in an ellipsis, so a reader knows there is more.
            out.append((text if len(text) <= w else text[: w - 1] + "…").ljust(w) if w else "")
            used += w + 1
        return " ".join(out)[:width].ljust(width)

    def _update_virtual_size(self) -> None:
        # Grow the scroll range in steps: a new virtual size means a new layout of the screen.
        visible = self.size.height
        need = self.num_rows + 1
        height = -(-need // ROWS_STEP) * ROWS_STEP if visible and need > visible else 0
        if self.virtual_size.height != height:
            self.virtual_size = Size(self.size.width, height)

    def _forget(self) -> None:
        """Drop the formatted lines (and the style they were drawn with)."""
        self._strips.clear()
        self._base_style = None

    @property
    def base_style(self) -> Style:
        """The widget's Rich style, worked out once per repaint."""
        if self._base_style is None:
            self._base_style = self.rich_style
        return self._base_style

    def on_resize(self, event: events.Resize) -> None:
        self._forget()
        self._shown_rows_known = False
        self._update_virtual_size()

    def render_lines(self, crop: Region) -> list[Strip]:
        # (the width and offset are properties that walk the layout: once per repaint, not
        # once per line)
        self._width = self.scrollable_content_region.width
        self._top = int(self.scroll_offset.y)
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        width = self._width
        if y == 0:
            head = tuple(label for label, _ in self.COLUMNS)
            return Strip(
                [
                    Segment(
                        self._cells(head, width), self.base_style + Style(bold=True, underline=True)
                    )
                ]
            )
        i = self._top + y - 1
        if i >= self.num_rows:
            if i == 0 and self.empty_text:
                return Strip([Segment(self.empty_text[:width].ljust(width), Style(dim=True))])
            return Strip.blank(width, self.base_style)
        key = i * 2 + (i == self.cursor)
        strip = self._strips.get(key)
        if strip is None or strip.cell_length != width:
            cells, style = self._row_of(i)
            rs = self.base_style + Style.parse(style) if style else self.base_style
            if i == self.cursor and self.has_focus:
                rs = rs + Style(reverse=True)
            elif i == self.cursor:
                rs = rs + Style(underline=True)
            strip = Strip([Segment(self._cells(cells, width), rs)])
            self._strips[key] = strip
        return strip

    def watch_scroll_y(self, old: float, new: float) -> None:
        self._shown_rows_known = False
        super().watch_scroll_y(old, new)

    def watch_cursor(self, old: int, new: int) -> None:
        self._strips.pop(old * 2 + 1, None)
        self._strips.pop(new * 2 + 1, None)
        top = int(self.scroll_offset.y)
        rows_visible = max(1, self.scrollable_content_region.height - 1)
        if new < top:
            self.scroll_to(y=new, animate=False)
        elif new >= top + rows_visible:
            self.scroll_to(y=new - rows_visible + 1, animate=False)
        self.refresh()

    def on_focus(self) -> None:
        self._forget()
        self.refresh()

    def on_blur(self) -> None:
        self._forget()
        self.refresh()

    def action_cursor(self, delta: int) -> None:
        """Move the cursor."""
        if self.num_rows:
            self.cursor = min(max(0, self.cursor + delta), self.num_rows - 1)
            self.cursor_moved()

    def cursor_moved(self) -> None:
        """Hook: the user moved the cursor."""

    def action_choose(self) -> None:
        """Post Chosen for the cursor row."""
        if self.num_rows:
            self.post_message(self.Chosen(self, self.cursor))

    def on_click(self, event: events.Click) -> None:
        i = int(self.scroll_offset.y) + event.y - 1
        if event.y >= 1 and 0 <= i < self.num_rows:
            self.cursor = i
            self.cursor_moved()
            self.post_message(self.Chosen(self, i))
