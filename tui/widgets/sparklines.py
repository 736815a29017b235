"""Sparklines of utilization, free blocks, allocation rate and prefix hit rate."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Label, Sparkline

from kvscope.tui.frame import Frame

HISTORY = 120


class Trend(Vertical):
    """One labelled sparkline over the last HISTORY samples."""

    DEFAULT_CSS = """
    Trend { width: 1fr; height: 100%; padding: 0 1; }
    Trend Label { width: 100%; height: 1; }
    Trend Sparkline { width: 100%; height: 1fr; min-height: 1; }
    """

    def __init__(self, title: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.title = title
        self.samples: deque[float] = deque(maxlen=HISTORY)

    def compose(self) -> ComposeResult:
        yield Label(self.title)
        yield Sparkline([], summary_function=max)

    def add(self, value: float, text: str) -> None:
        """Append a sample and show `text` as its current value."""
        self.samples.append(value)
        self.query_one(Label).update(f"{self.title} {text}")
        self.query_one(Sparkline).data = list(self.samples)


class Trends(Horizontal):
    """The four trends, fed one sample per frame."""

    DEFAULT_CSS = """
    Trends { height: 3; }
    """

    frame: reactive[Frame | None] = reactive(None, repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._last: tuple[int, int] | None = None

    def compose(self) -> ComposeResult:
        yield Trend("utilization", id="trend-util")
        yield Trend("free blocks", id="trend-free")
        yield Trend("allocs/s", id="trend-rate")
        yield Trend("prefix hits", id="trend-hits")

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None:
            return
        st = frame.stats
        allocs, now = st["num_allocs"], frame.taken_ns
        rate = 0.0
        if self._last is not None and now > self._last[1]:
            rate = max(0.0, (allocs - self._last[0]) / ((now - self._last[1]) / 1e9))
        if self._last is None or now != self._last[1]:
            self._last = (allocs, now)
        self.query_one("#trend-util", Trend).add(st["utilization"], f"{100 * st['utilization']:.1f}%")
        self.query_one("#trend-free", Trend).add(st["num_free"], f"{st['num_free']:,}")
        self.query_one("#trend-rate", Trend).add(rate, f"{rate:,.0f}")
        self.query_one("#trend-hits", Trend).add(
            st["prefix_hit_rate"], f"{100 * st['prefix_hit_rate']:.1f}% of {st['prefix_queries']:,}"
        )
