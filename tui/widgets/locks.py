"""The locks panel: each pool lock's holder, hold time and contention, then lock-order edges."""

from __future__ import annotations

import time

from textual.reactive import reactive

from kvscope.tui.frame import Frame
from kvscope.tui.widgets import retitle
from kvscope.tui.widgets.rows import Row, RowsView

# A live pool's lock counters move with every operation: the panel shows them twice a second,
# as fast as they can be read, and repaints less often than the panels that follow the cursor.
EVERY_NS = 500_000_000


def _us(ns: float) -> str:
    return f"{ns / 1e3:.1f}" if ns < 1e7 else f"{ns / 1e6:.0f}ms"


class LocksPanel(RowsView):
    """Held locks in bold; a hold time only on a live pool (the holder's monotonic clock)."""

    COLUMNS = [
        ("lock", 9),
        ("holder", 14),
        ("acq", 8),
        ("cont", 6),
        ("wait us", 8),
        ("hold us", 8),
        ("max us", 0),
    ]

    frame: reactive[Frame | None] = reactive(None, repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "locks"
        self._taken_ns = -EVERY_NS

    def watch_frame(self, frame: Frame | None) -> None:
        if frame is None or (frame.live and frame.taken_ns - self._taken_ns < EVERY_NS):
            return
        self._taken_ns = frame.taken_ns
        locks = frame.view.locks
        used = int(frame.view.h["lockgraph_used"])
        edges = frame.view.lockgraph[: min(used, len(frame.view.lockgraph))]
        now = time.perf_counter_ns()
        rows: list[Row] = []
        for r in locks:
            n = int(r["num_acquires"])
            pid = int(r["holder_pid"])
            held = ""
            if pid:
                held = f"pid {pid}"
                if frame.live and int(r["acquired_ns"]):
                    held += f" {_us(max(0, now - int(r['acquired_ns'])))}"
            cont = int(r["num_contended"])
            rows.append(
                (
                    (
                        bytes(r["name"]).decode(errors="replace"),
                        held or "-",
                        str(n),
                        f"{100 * cont / n:.0f}%" if n else "-",
                        _us(int(r["wait_ns"]) / cont) if cont else "-",
                        _us(int(r["hold_ns"]) / n) if n else "-",
                        _us(int(r["max_hold_ns"])) if n else "-",
                    ),
                    "bold yellow" if pid else None,
                )
            )
        for e in edges:
            src, dst = (bytes(e[k]).decode(errors="replace") for k in ("src", "dst"))
            site = bytes(e["site"]).decode(errors="replace")
            rows.append(((f"{src}->{dst}", f"pid {int(e['pid'])}", site), "cyan"))
        retitle(self, f"locks ({len(locks)}, {len(edges)} order edges)")
        self.set_rows(len(rows), rows.__getitem__)
