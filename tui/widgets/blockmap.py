"""BlockMap: one cell per block (or per group of blocks), coloured by state, shaded by refcount."""

from __future__ import annotations

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Region
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from kvscope.allocator.layout import BlockState
from kvscope.tui.frame import Frame
from kvscope.tui.messages import BlockChosen
from kvscope.tui.widgets import retitle

# Colour per state, darkest to brightest for refcount 0-1, 2, 3, 4+.
STATE_COLOURS = {
    BlockState.FREE: ("grey30", "grey30", "grey30", "grey30"),
    BlockState.ALLOCATED: ("green4", "green3", "chartreuse1", "bright_white"),
    BlockState.CACHED: ("dodger_blue2", "dodger_blue1", "deep_sky_blue1", "bright_white"),
    BlockState.LOCAL: ("dark_cyan", "cyan", "cyan", "cyan"),
    BlockState.QUARANTINED: ("magenta", "magenta", "magenta", "magenta"),
}
# Glyph by the fraction of non-free blocks in a cell (a single free block shows as '·').
FILL_GLYPHS = ("·", "░", "▒", "▓", "█")
NUM_STATES = len(BlockState)
MARKED_BG = "red3"


def cell_codes(
    state: np.ndarray, refcount: np.ndarray, marked: np.ndarray, group: int, num_cells: int
) -> np.ndarray:
    """One small integer per cell: state | shade << 3 | fill << 5 | marked << 8 (vectorised:
    the blocks as a (cell, group) array, one pass per state and one max per cell)."""
    n = len(state)
    # Cells past the last block are blank; only cells holding blocks are counted.
    num_real = min(num_cells, -(-n // group))
    size = num_real * group
    k = min(n, size)
    # The last cell's missing blocks count as no state at all.
    flat = np.full(size, NUM_STATES, np.uint8)
    np.minimum(state[:k], NUM_STATES - 1, out=flat[:k])
    st = flat.reshape(num_real, group)
    counts = np.empty((num_real, NUM_STATES), np.int64)
    for s in range(NUM_STATES):
        counts[:, s] = (st == s).sum(axis=1, dtype=np.int64)
    real = np.minimum(group, n - np.arange(num_real) * group)
    used = real - counts[:, BlockState.FREE]
    # Colour: the most common state other than free, when any block of the cell is in use.
    busy = 1 + np.argmax(counts[:, 1:], axis=1)
    colour = np.where(used > 0, busy, BlockState.FREE)
    rc = np.zeros(size, np.int64)
    rc[:k] = refcount[:k]
    rc = rc.reshape(num_real, group).max(axis=1)
    shade = np.clip(rc - 1, 0, 3)
    if group == 1:
        fill = np.where(used > 0, 4, 0)
    else:
        frac = used / real
        fill = np.where(used > 0, 1 + np.minimum(3, (frac * 4).astype(np.int64)), 0)
        fill = np.minimum(fill, 4)
    mark = np.zeros(num_real, np.int64)
    cells = np.unique(np.flatnonzero(marked[:k]) // group)
    mark[cells] = 1
    code = np.full(num_cells, -1, np.int64)
    code[:num_real] = colour | shade << 3 | fill << 5 | mark << 8
    return code


class BlockMap(Widget, can_focus=True):
    """The pool at a glance; arrows move the cursor, enter inspects the block under it."""

    DEFAULT_CSS = """
    BlockMap { height: 1fr; min-height: 3; }
    """
    BINDINGS = [
        Binding("left", "move(-1, 0)", "Left", show=False),
        Binding("right", "move(1, 0)", "Right", show=False),
        Binding("up", "move(0, -1)", "Up", show=False),
        Binding("down", "move(0, 1)", "Down", show=False),
        Binding("enter", "choose", "Inspect", show=False),
    ]

    frame: reactive[Frame | None] = reactive(None, repaint=False)
    selected_block: reactive[int] = reactive(-1, repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.group = 1
        self._codes = np.zeros((0, 0), np.int64)
        self._strips: dict[int, Strip] = {}
        self._styles: dict[int, tuple[str, Style]] = {}
        self.border_title = "blocks"

    def _geometry(self, n: int) -> tuple[int, int, int]:
        w, h = max(1, self.content_size.width), max(1, self.content_size.height)
        group = max(1, -(-n // (w * h)))
        return w, h, group

    def _recompute(self) -> None:
        frame = self.frame
        if frame is None:
            return
        n = frame.num_blocks
        w, h, group = self._geometry(n)
        marked = np.zeros(n, bool)
        ids = [f.block for f in frame.findings if f.block is not None and 0 <= f.block < n]
        marked[ids] = True
        cols = frame.columns
        codes = cell_codes(cols["state"], cols["refcount"], marked, group, w * h)
        sel = self.selected_block
        if 0 <= sel < n:
            codes[sel // group] |= 1 << 9
        codes = codes.reshape(h, w)
        changed: list[int] | range = range(h)
        if self._codes.shape == codes.shape and group == self.group:
            changed = np.flatnonzero((self._codes != codes).any(axis=1)).tolist()
        else:
            self._strips.clear()
        self._codes, self.group = codes, group
        retitle(self, f"blocks ({n:,}" + (f", 1 cell = {group} blocks)" if group > 1 else ")"))
        for y in changed:
            self._strips.pop(y, None)
            self.refresh(Region(0, y, w, 1))

    def watch_frame(self) -> None:
        self._recompute()

    def watch_selected_block(self) -> None:
        self._recompute()

    def on_resize(self, event: events.Resize) -> None:
        self._recompute()

    def _style(self, code: int) -> tuple[str, Style]:
        got = self._styles.get(code)
        if got is None:
            if code < 0:
                got = (" ", Style())
            else:
                state, shade, fill = code & 7, code >> 3 & 3, code >> 5 & 7
                colour = STATE_COLOURS[BlockState(state)][shade]
                glyph = FILL_GLYPHS[fill]
                style = Style(color=colour)
                if code >> 8 & 1:
                    style += Style(bgcolor=MARKED_BG, color="bright_white")
                    glyph = "✖" if fill == 0 else glyph
                if code >> 9 & 1:
                    style += Style(reverse=True, blink=False)
                    glyph = glyph if glyph != "·" else "◆"
                got = (glyph, style)
            self._styles[code] = got
        return got

    def render_line(self, y: int) -> Strip:
        if y >= self._codes.shape[0]:
            return Strip.blank(self.content_size.width)
        strip = self._strips.get(y)
        if strip is None:
            row = self._codes[y]
            # Runs of equal codes become one segment each.
            cuts = np.flatnonzero(np.diff(row)) + 1
            starts = [0, *cuts.tolist()]
            ends = [*cuts.tolist(), len(row)]
            segs = []
            for a, b in zip(starts, ends):
                glyph, style = self._style(int(row[a]))
                segs.append(Segment(glyph * (b - a), style))
            strip = Strip(segs, len(row))
            self._strips[y] = strip
        return strip

    def action_move(self, dx: int, dy: int) -> None:
        """Move the cursor by one cell."""
        frame = self.frame
        if frame is None:
            return
        n = frame.num_blocks
        w = max(1, self._codes.shape[1] if self._codes.size else 1)
        cell = max(0, self.selected_block) // self.group
        cell = min(max(0, cell + dx + dy * w), (n - 1) // self.group)
        self.post_message(BlockChosen(cell * self.group))

    def action_choose(self) -> None:
        """Inspect the block under the cursor."""
        self.post_message(BlockChosen(max(0, self.selected_block)))

    def on_click(self, event: events.Click) -> None:
        if self.frame is None or not self._codes.size:
            return
        off = event.get_content_offset(self)
        if off is None:
            return
        cell = off.y * self._codes.shape[1] + off.x
        block = cell * self.group
        if block < self.frame.num_blocks:
            self.post_message(BlockChosen(block))
