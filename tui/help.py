"""The `?` help screen and the go-to prompt."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from kvscope.allocator.layout import BlockState
from kvscope.tui.widgets.blockmap import FILL_GLYPHS, MARKED_BG, STATE_COLOURS

PANEL_KEYS = [
    ("tab / shift+tab", "move between panels (every panel takes focus)"),
    ("arrows", "move the cursor (block map: one cell; tables: one row; block: scroll)"),
    ("pgup / pgdn", "a page up or down in a table or the block panel"),
    ("home / end", "top or bottom of the block panel"),
    ("enter / click", "inspect the block or show the sequence under the cursor"),
    ("enter (findings)", "the finding whole: message, blocks, owner, site, history; escape"),
]


def legend() -> Text:
    """The block map's colours, shades and glyphs, each drawn as the map draws it."""
    t = Text()
    t.append("block map\n", style="bold underline")
    for state in BlockState:
        shades = STATE_COLOURS[state]
        t.append(f"{state.name.lower():>12} ")
        for colour in shades if len(set(shades)) > 1 else shades[:1]:
            # A free block shows as a dot; a block in use fills its cell.
            t.append(FILL_GLYPHS[0] if state == BlockState.FREE else "█", style=colour)
            t.append(" ")
        if len(set(shades)) > 1:
            t.append(" refcount 1, 2, 3, 4+ (brighter: more sharing)")
        t.append("\n")
    t.append(f"{'fill':>12} ")
    t.append(" ".join(FILL_GLYPHS), style="green3")
    t.append("  share of a cell's blocks in use, when a cell holds several blocks\n")
    t.append(f"{'finding':>12} ")
    t.append("✖", style=f"bright_white on {MARKED_BG}")
    t.append(" ")
    t.append("█", style=f"green3 on {MARKED_BG}")
    t.append("  red background: a block with a finding\n")
    t.append(f"{'selected':>12} ")
    t.append("◆", style="reverse")
    t.append("  reverse video: the block under the cursor\n")
    t.append(
        "The colour is the most common state other than free among a cell's blocks; the title"
        " says how many blocks one cell holds.",
        style="dim",
    )
    return t


class HelpScreen(ModalScreen[None]):
    """Every key binding of the app and of the panels, and the block map's legend (scrolls)."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 76; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $surface; padding: 0 1; }
    """
    BINDINGS = [
        Binding("escape", "dismiss", "Close"),
        Binding("question_mark", "dismiss", "Close"),
        Binding("q", "dismiss", "Close"),
    ]

    def __init__(self, bindings: list[tuple[str, str]]) -> None:
        super().__init__()
        self.bindings = bindings

    def compose(self) -> ComposeResult:
        lines = [f"[b]{key:>15}[/b]  {text}" for key, text in [*self.bindings, *PANEL_KEYS]]
        with VerticalScroll(id="help") as v:
            v.border_title = "kvscope top: keys"
            v.border_subtitle = "arrows scroll"
            yield Static("\n".join(lines))
            yield Static(legend(), id="legend")
            yield Static("[dim]escape, ? or q closes this help[/dim]")

    def on_mount(self) -> None:
        self.query_one("#help").focus()


class GotoScreen(ModalScreen[str | None]):
    """One line of input: a block id, or a request id (or sequence id)."""

    DEFAULT_CSS = """
    GotoScreen { align: center middle; }
    GotoScreen > Vertical { width: 60; max-width: 100%; height: auto; border: round $accent;
        background: $surface; padding: 0 1; }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def compose(self) -> ComposeResult:
        with Vertical() as v:
            v.border_title = f"go to {self.what}"
            yield Input(placeholder=f"{self.what} id", id="goto")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        """Close without going anywhere."""
        self.dismiss(None)
