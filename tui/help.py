"""The `?` help screen and the go-to prompt."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

PANEL_KEYS = [
    ("tab / shift+tab", "move between panels"),
    ("arrows", "move the cursor (block map: one cell; tables: one row)"),
    ("enter / click", "inspect the block or show the sequence under the cursor"),
]


class HelpScreen(ModalScreen[None]):
    """Every key binding of the app and of the panels."""

    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 64; max-width: 100%; height: auto; max-height: 100%;
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
        with Vertical() as v:
            v.border_title = "kvscope top: keys"
            yield Static("\n".join(lines))
            yield Static("[dim]escape, ? or q closes this help[/dim]")


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
