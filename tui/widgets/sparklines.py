"""Sparklines of utilization, free blocks, allocation rate and prefix hit rate (one Line-API widget)."""

from __future__ import annotations

from collections import deque

import numpy as np
from rich.segment import Segment
from rich.style import Style
from textual.geometry import Region
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from kvscope.tui.frame import Frame

HISTORY = 240
# On a live pool a sample every half second (two minutes of history): the panel repaints
# whole with each sample, and more often shows nothing a reader could follow.
EVERY_NS = 500_000_000
BARS = " ▁▂▃▄▅▆▇█"
TITLES = ("utilization", "free blocks", "allocs/s", "prefix hits")
COLOURS = ("green3", "dodger_blue1", "yellow3", "magenta")


class Trends(Widget):
    """Four labelled sparklines side by side; the newest sample is on the right."""

    DEFAULT_CSS = """
    Trends { height: 3; }
    """

    frame: reactive[Frame | None] = reactive(None, repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._last: tuple[int, int] | None = None
        self._rate = 0.0
        self.samples: list[deque[float]] = [deque(maxlen=HISTORY) for _ in TITLES]
        self.labels = [t for t in TITLES]
        self._strips: dict[int, Strip] = {}

    def add(
        self, values: tuple[float, float, float, float], texts: tuple[str, str, str, str]
    ) -> None:
        """Append one sample to each trend and show `texts` as their current values."""
        for q, v in zip(self.samples, values):
            q.append(float(v))
        self.labels = _labels(texts)
        self._strips.clear()
        self.refresh()

    def relabel(self, texts: tuple[str, str, str, str]) -> None:
        """Show `texts` as the trends' current values without a new sample (only the label
        line is repainted, and only when it changed)."""
        labels = _labels(texts)
        if labels != self.labels:
            self.labels = labels
            self._strips.pop(0, None)
            self.refresh(Region(0, 0, self.content_size.width, 1))

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        st = frame.stats
        # The labels say this frame's values, as the header does (the same snapshot): on a
        # live pool the sparklines take a sample every EVERY_NS, the labels follow every frame
        # (allocs/s, a rate, is the one over the last sample's interval).
        sample = not (
            frame.live and self._last is not None and frame.taken_ns - self._last[1] < EVERY_NS
        )
        if sample:
            allocs, now = st["num_allocs"], frame.taken_ns
            rate = 0.0
            if self._last is not None and now > self._last[1]:
                rate = max(0.0, (allocs - self._last[0]) / ((now - self._last[1]) / 1e9))
            if self._last is None or now != self._last[1]:
                self._last = (allocs, now)
            self._rate = rate
        texts = (
            f"{100 * st['utilization']:.1f}%",
            f"{st['num_free']:,}",
            f"{self._rate:,.0f}",
            f"{100 * st['prefix_hit_rate']:.1f}% of {st['prefix_queries']:,}",
        )
        if sample:
            self.add((st["utilization"], st["num_free"], self._rate, st["prefix_hit_rate"]), texts)
        else:
            self.relabel(texts)

    def on_resize(self) -> None:
        self._strips.clear()
        self.refresh()

    def _column(self, k: int, width: int, rows: int) -> list[str]:
        """The sparkline of trend k as `rows` strings of `width` cells, top row first."""
        data = np.asarray(self.samples[k], dtype=np.float64)[-width:]
        if len(data) == 0:
            return [" " * width] * rows
        lo, hi = float(data.min()), float(data.max())
        span = hi - lo
        # Height in eighths of a cell; a flat line sits at the bottom row, one eighth high.
        level = np.ones(len(data)) * 1 if span == 0 else 1 + (data - lo) / span * (rows * 8 - 1)
        level = level.astype(np.int64)
        out = []
        for r in range(rows - 1, -1, -1):
            cell = np.clip(level - r * 8, 0, 8)
            out.append("".join(BARS[c] for c in cell.tolist()).rjust(width))
        return out

    def render_line(self, y: int) -> Strip:
        width = self.content_size.width
        height = self.content_size.height
        strip = self._strips.get(y)
        if strip is not None and strip.cell_length == width:
            return strip
        n = len(TITLES)
        col = max(1, width // n)
        segs: list[Segment] = []
        for k in range(n):
            w = col if k < n - 1 else width - col * (n - 1)
            inner = max(1, w - 2)
            if y == 0:
                segs.append(
                    Segment(" " + self.labels[k][:inner].ljust(inner) + " ", Style(bold=True))
                )
            else:
                line = self._column(k, inner, max(1, height - 1))[y - 1]
                segs.append(Segment(" " + line + " ", Style(color=COLOURS[k])))
        strip = Strip(segs, width)
        self._strips[y] = strip
        return strip


def _labels(texts: tuple[str, str, str, str]) -> list[str]:
    """Each trend's title with its current value."""
    return [f"{t} {x}" for t, x in zip(TITLES, texts)]
