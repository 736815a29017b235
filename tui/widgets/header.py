"""The header: pool, device, geometry, probes, health and the refresh state."""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from kvscope.allocator.layout import Flag
from kvscope.tui.frame import Frame, clock


def _s(v: bytes) -> str:
    return bytes(v).rstrip(b"\0").decode(errors="replace")


def usage(st: dict) -> str:
    """Where every block of the pool is, from one snapshot's `pool_stats`: the allocated ones
    (and their share, `utilization`), then free and cached, and the blocks in processes' local
    caches and quarantined (guard mode, or freed while leased) when there are any: the counts
    shown add up to the pool's size."""
    out = (
        f"used {st['num_allocated']:,} ({100 * st['utilization']:.1f}%)"
        f"  free {st['num_free']:,}  cached {st['num_cached']:,}"
    )
    if st["num_local"]:
        out += f"  local {st['num_local']:,}"
    if st["num_quarantined"]:
        out += f"  quarantined {st['num_quarantined']:,}"
    return out


class PoolHeader(Widget):
    """Two lines: what the pool is, and how it is doing."""

    DEFAULT_CSS = """
    PoolHeader { height: 2; background: $panel; padding: 0 1; }
    """

    frame: reactive[Frame | None] = reactive(None, repaint=False)
    mode: reactive[str] = reactive("", repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._text = ""
        self._lines: list[Strip] = []
        self._style = Style()

    def watch_frame(self) -> None:
        self._show()

    def watch_mode(self) -> None:
        self._show()

    def _show(self) -> None:
        frame = self.frame
        if frame is None:
            return
        h = frame.view.h
        st = frame.stats
        t = Text()
        t.append(f"{_s(h['name'])}", style="bold")
        t.append(f"  {_s(h['device'])} {_s(h['dtype'])}  ")
        t.append(
            f"{int(h['num_blocks']):,} blocks x {int(h['block_size'])} tokens, "
            f"{int(h['num_layers'])}L {int(h['num_kv_heads'])}H {int(h['head_dim'])}D  "
        )
        flags = int(h["flags"])
        # on or off in words, as `kvscope analyze` says it: a probe that is off must not read as
        # on where the terminal (or a copy of the screen) drops the dim strike-through style
        t.append("probes: ")
        for i, flag in enumerate(Flag):
            on = bool(flags & flag)
            sep = ", " if i < len(Flag) - 1 else "  "
            t.append(
                f"{(flag.name or '').lower()} {'on' if on else 'off'}",
                style="bold green" if on else "dim",
            )
            t.append(sep)
        t.append("\n")
        errors = sum(f.severity == "error" for f in frame.findings)
        warnings = len(frame.findings) - errors
        if errors:
            t.append(f" {errors} errors ", style="bold white on red")
        elif warnings:
            t.append(f" {warnings} warnings ", style="bold black on yellow")
        else:
            t.append(" healthy ", style="bold black on green")
        if errors and warnings:
            t.append(f" {warnings} warnings", style="yellow")
        mode_style = "bold reverse" if "paused" in self.mode.lower() else "bold"
        # (a short mode next, "live 10 Hz", "PAUSED (p resumes)": a line longer than the terminal is
        # cut at its right edge; a dump's path or a replay's step goes last)
        first = len(self.mode) <= 32
        if first:
            t.append("  ")
            t.append(self.mode, style=mode_style)
        t.append(f"  {usage(st)}  seqs {st['num_sequences']}  procs {st['num_clients']}  ")
        if st["num_exhausted"]:
            # (a caught PoolExhausted leaves no finding: the count is its only trace here)
            t.append(f"PoolExhausted {st['num_exhausted']:,}  ", style="bold red")
        held = int(frame.view.lease_header["active"][0])
        if held:
            quarantined = int(frame.view.lease_header["quarantined"][0])
            t.append(f"leases {held} ({quarantined} quarantined)  ", style="cyan")
        if not first:
            t.append(self.mode, style=mode_style)
        gpu = frame.extra.get("gpu")
        if gpu:
            data = int(h["data_bytes"])
            share = data / gpu["total"] if gpu["total"] else 0.0
            t.append(
                f"  GPU {gpu['index']} {gpu['name']} {gpu['used'] / 2**30:.1f}/"
                f"{gpu['total'] / 2**30:.1f} GiB used, KV data {data / 2**30:.2f} GiB "
                f"({share:.1%})"
            )
        if frame.torn:
            t.append("  torn snapshot", style="bold red")
        if frame.taken_ns:
            # when the snapshot shown was read (a dump: when it was taken), to line it up with
            # what another reader printed
            word = "read" if frame.live else "taken"
            t.append(f"  {word} {clock(int(frame.taken_ns))}", style="dim")
        if t.plain != self._text:
            self._text = t.plain
            segments = t.render(self.app.console)
            self._lines = [Strip(line) for line in Segment.split_lines(segments)]
            # (the widget's style, worked out through its ancestors, once per change)
            self._style = self.rich_style
            self.refresh()

    def render_line(self, y: int) -> Strip:
        width = self.content_size.width
        if y < len(self._lines):
            return self._lines[y].crop_extend(0, width, self._style)
        return Strip.blank(width, self._style)
