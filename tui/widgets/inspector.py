"""The block inspector: every header field of one block, its owner, site and last events."""

from __future__ import annotations

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.widgets import Static

from kvscope.allocator.layout import BLOCK_MAGIC, BlockState, SeqState, block_checksums
from kvscope.allocator.lease import lease_rows
from kvscope.allocator.process import is_alive
from kvscope.allocator.sites import site_frames
from kvscope.tui.frame import STATE_NAMES, Frame, clock, last_events, op_name, request_of
from kvscope.tui.widgets import retitle

NUM_EVENTS = 6
NUM_TOKENS = 8


def token_list(rec: np.void, limit: int | None = None) -> str:
    """A block's tokens as a list, the first `limit` of them and how many more when cut."""
    n = min(int(rec["num_tokens"]), len(rec["tokens"]))
    shown = n if limit is None else min(n, limit)
    text = str(np.asarray(rec["tokens"])[:shown].tolist())
    return text[:-1] + f", … ({n - shown} more)]" if shown < n else text


def describe_block(frame: Frame, b: int) -> Text:
    """A field-per-line description of block `b` in `frame`."""
    view = frame.view
    out = Text()
    if not 0 <= b < frame.num_blocks:
        return Text("move the cursor in the block map, or press g to go to a block", style="dim")
    rec = view.blocks[b]

    def line(label: str, value: object, style: str = "") -> None:
        out.append(f"{label:>11} ", style="bold")
        out.append(f"{value}\n", style=style)

    magic = int(rec["magic"])
    line("block", b)
    line(
        "magic",
        f"{magic:#010x}" + ("" if magic == BLOCK_MAGIC else "  BAD"),
        "" if magic == BLOCK_MAGIC else "bold red",
    )
    line("state", STATE_NAMES.get(int(rec["state"]), f"? {int(rec['state'])}"))
    line("refcount", int(rec["refcount"]))
    leases = int(frame.view.lease_counts[b])
    if leases:
        holders = [r for r in lease_rows(frame.view) if b in r["blocks"]]
        who = ", ".join(f"{r['mode']} by {r['holder']!r} pid {r['pid']}" for r in holders[:3])
        line("leased", f"{leases}: {who}", "cyan")
    line("generation", int(rec["generation"]))
    line("indexed", bool(rec["indexed"]))
    line("poisoned", bool(rec["poisoned"]))
    pid = int(rec["owner_pid"])
    alive = ""
    if pid and frame.live:
        # (gone while the block is held: no one frees it; a free or cached block's last
        # owner that exited lost nothing)
        gone = " (DEAD)" if int(rec["state"]) == BlockState.ALLOCATED else " (exited)"
        alive = " (alive)" if is_alive(pid, int(rec["owner_start"])) else gone
    line(
        "owner",
        f"pid {pid} client {int(rec['owner_client'])}{alive}" if pid else "-",
        "bold red" if "DEAD" in alive else "",
    )
    line("request", request_of(rec) or "-")
    line("allocated", clock(int(rec["alloc_ns"])))
    line("accessed", clock(int(rec["access_ns"])))
    site = int(rec["site"])
    frames = site_frames(view, site)
    line("site", frames[0] if frames else (f"site {site}" if site >= 0 else "-"))
    for caller in frames[1:]:
        line("called from", caller)
    line("tokens", f"{int(rec['num_tokens'])}: {token_list(rec, NUM_TOKENS)}")
    line("prefix hash", f"{int(rec['prefix_hash']):#018x}")
    line("parent hash", f"{int(rec['parent_hash']):#018x}")
    ok = int(block_checksums(view.blocks, np.array([b]))[0]) == int(rec["checksum"])
    line(
        "checksum",
        f"{int(rec['checksum']):#018x}" + ("" if ok else "  MISMATCH"),
        "" if ok else "bold red",
    )
    live = frame.live_slots()
    seqs = view.seqs
    lens = seqs["num_blocks"][live].astype(np.int64)
    width = int(lens.max(initial=0))
    tables = seqs["table"][live, :width]
    hit = ((tables == b) & (np.arange(width)[None, :] < lens[:, None])).any(axis=1)
    users = live[hit].tolist()
    names = ", ".join(
        f"{request_of(seqs[s])}[{SeqState(int(seqs['state'][s])).name.lower()}]" for s in users[:4]
    )
    line("used by", names + (f" +{len(users) - 4}" if len(users) > 4 else "") if users else "-")
    events = last_events(view, NUM_EVENTS, block=b)
    num_events = int(((view.events["block"] == b) & (view.events["time_ns"] != 0)).sum())
    cut = f" (the last {len(events)} of {num_events})" if num_events > len(events) else ""
    out.append(f"last events{cut}\n", style="bold underline")
    if len(events) == 0:
        out.append("  none recorded\n", style="dim")
    for e in events:
        out.append(
            f"  {clock(int(e['time_ns']))} pid {int(e['pid'])} {op_name(int(e['op']))} gen {int(e['generation'])} {request_of(e)}\n"
        )
    return out


class BlockInspector(VerticalScroll, can_focus=True):
    """Shows the selected block; follows the block map cursor and the tables' choices.

    It takes focus (tab) and scrolls (arrows, page up/down, home/end), so that the fields past
    the panel's height (checksum, sequences, events) can be read on any terminal.
    """

    DEFAULT_CSS = """
    BlockInspector { height: 1fr; scrollbar-size-vertical: 1; }
    BlockInspector > Static { height: auto; }
    """

    frame: reactive[Frame | None] = reactive(None, repaint=False)
    selected_block: reactive[int] = reactive(-1, repaint=False)

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "block"
        self._shown: tuple[int, str] = (-2, "")

    def compose(self) -> ComposeResult:
        yield Static("")

    def _show(self) -> None:
        frame, b = self.frame, self.selected_block
        if frame is None or not frame.has_records([b]):
            # A block chosen since this frame was taken: its record comes with the next.
            return
        retitle(self, f"block {b}" if b >= 0 else "block")
        text = describe_block(frame, b)
        key = (b, text.plain)
        if key != self._shown and self.is_mounted:
            if b != self._shown[0]:
                self.scroll_home(animate=False)
            self._shown = key
            self.query_one(Static).update(text)

    def watch_frame(self) -> None:
        self._show()

    def watch_selected_block(self) -> None:
        self._show()
