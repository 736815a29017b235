"""The detail view of one finding (enter on the findings panel): its whole message, its blocks,
owner, site and history, wrapped to the screen's width; escape closes it."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from kvscope.allocator.findings import Finding
from kvscope.allocator.layout import BlockState
from kvscope.allocator.process import is_alive
from kvscope.allocator.sites import site_frames
from kvscope.tui.frame import STATE_NAMES, Frame, clock, last_events, op_name, request_of
from kvscope.tui.widgets.inspector import token_list

# Blocks of the finding's request listed before "… (N more)".
NUM_REQUEST_BLOCKS = 64


def _cut(items: list[str], limit: int) -> str:
    """Items joined, the first `limit` of them and how many more when cut."""
    text = ", ".join(items[:limit])
    return text + f", … ({len(items) - limit} more)" if len(items) > limit else text


def _owner(frame: Frame, pid: int, start: int | None, held: bool = True) -> str:
    """`pid N`, and on a live pool whether it is alive (when its start time is known): DEAD
    where it is gone and the block is `held` (allocated: no one will free it), exited where a
    block it once held is free or cached (nothing is lost)."""
    if not pid:
        return "-"
    if frame.live and start is not None:
        gone = "DEAD" if held else "exited"
        return f"pid {pid} ({'alive' if is_alive(pid, start) else gone})"
    return f"pid {pid}"


def _request_blocks(frame: Frame, request: str) -> list[int]:
    """The blocks the live sequence of `request` maps now (none when no sequence has it)."""
    seqs = frame.view.seqs
    for slot in frame.live_slots().tolist():
        if request_of(seqs[slot]) == request:
            return frame.block_table(slot).tolist()
    return []


def describe_finding(frame: Frame, f: Finding) -> Group:
    """Every field of finding `f` (in the pool as `frame` shows it), one labelled row each."""
    view = frame.view
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="bold", justify="right", no_wrap=True)
    grid.add_column(overflow="fold")

    def row(label: str, value: str | Text, style: str = "") -> None:
        grid.add_row(label, value if isinstance(value, Text) else Text(value, style=style))

    row("severity", f.severity, "bold red" if f.severity == "error" else "yellow")
    row("kind", f.kind)
    message = Text(f.message)
    # The findings ring keeps the first bytes of a message (the check's own are whole).
    room = view.findings.dtype["message"].itemsize
    if f.extra.get("source") == "recorded" and len(f.message.encode()) >= room:
        message.append(f" … (the findings ring keeps the first {room} bytes)", style="dim")
    row("message", message)
    row("request", f.request or "-")
    n = frame.num_blocks
    b = f.block if f.block is not None and 0 <= f.block < n else None
    rec = view.blocks[b] if b is not None else None
    start = None
    if rec is not None and f.owner_pid and int(rec["owner_pid"]) == f.owner_pid:
        start = int(rec["owner_start"])
    owner = _owner(frame, f.owner_pid or 0, start)
    row("owner", owner, "bold red" if "DEAD" in owner else "")
    # The site the finding recorded; else the site of its block now.
    site = site_frames(view, f.site_id) if f.site_id >= 0 else []
    if not site and rec is not None:
        site = site_frames(view, int(rec["site"]))
    row("site", site[0] if site else "-")
    for caller in site[1:]:
        row("called from", caller)
    time_ns = int(f.extra.get("time_ns") or 0)
    if f.extra.get("source") == "check":
        row("found by", "the whole-pool check")
    else:
        row(
            "found by",
            "a process, into the findings ring" + (f", at {clock(time_ns)}" if time_ns else ""),
        )
    for key, value in f.extra.items():
        if key not in ("time_ns", "site", "source"):
            row(key, ", ".join(map(str, value)) if isinstance(value, list) else str(value))
    if rec is not None:
        assert b is not None
        state = STATE_NAMES.get(int(rec["state"]), f"? {int(rec['state'])}")
        row(
            "block",
            f"{b}: {state}, refcount {int(rec['refcount'])}, generation "
            f"{int(rec['generation'])}, request {request_of(rec) or '-'}, owner "
            + _owner(
                frame,
                int(rec["owner_pid"]),
                int(rec["owner_start"]),
                held=int(rec["state"]) == BlockState.ALLOCATED,
            ),
        )
        row("tokens", f"{int(rec['num_tokens'])}: {token_list(rec)}")
    elif f.block is not None:
        row("block", f"{f.block} (not a block of this pool: ids run from 0 to {n - 1})", "bold red")
    else:
        row("block", "- (a finding about the pool, not one block)")
    if f.request:
        mapped = _request_blocks(frame, f.request)
        if mapped:
            row("its blocks", _cut([str(x) for x in mapped], NUM_REQUEST_BLOCKS))
    history = Text()
    if b is not None:
        events = last_events(view, view.events.size, block=b)
        for e in events:
            history.append(
                f"{clock(int(e['time_ns']))} pid {int(e['pid'])} {op_name(int(e['op']))}"
                f" gen {int(e['generation'])} {request_of(e)}\n"
            )
        if not len(events):
            history.append(
                "no event of this block recorded (the events probe is off, or its ring has "
                "moved on)",
                style="dim",
            )
    history.rstrip()
    if b is None:
        return Group(grid)
    title = Text(
        f"history of block {b}: every recorded event, oldest first", style="bold underline"
    )
    return Group(grid, Text(""), title, history)


class FindingScreen(ModalScreen[None]):
    """One finding whole; it scrolls (arrows, page up/down), escape closes it."""

    DEFAULT_CSS = """
    FindingScreen { align: center middle; }
    FindingScreen > VerticalScroll { width: 100; max-width: 100%; height: auto;
        max-height: 100%; border: round $accent; background: $surface; padding: 0 1; }
    FindingScreen Static { width: 100%; }
    """
    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("q", "dismiss", "Close", show=False),
    ]

    def __init__(self, frame: Frame, finding: Finding) -> None:
        super().__init__()
        # Worked out now: the frame's buffer is copied into again two frames later.
        self.text = describe_finding(frame, finding)
        self.finding = finding

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="detail") as v:
            where = "" if self.finding.block is None else f" block {self.finding.block}"
            v.border_title = f"finding {self.finding.kind}{where}"
            v.border_subtitle = "escape closes, arrows scroll"
            yield Static(self.text)

    def on_mount(self) -> None:
        self.query_one("#detail").focus()
