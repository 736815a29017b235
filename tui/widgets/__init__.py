"""The panels of `kvscope top`, one per module, and what they share."""

from __future__ import annotations

from textual.content import Content
from textual.widget import Widget


def retitle(widget: Widget, title: str) -> None:
    """Show `title` (plain text, never markup) in widget's border; a title set again unchanged
    repaints nothing (setting `border_title` repaints the whole widget)."""
    if widget.__dict__.get("_title_shown") != title:
        widget.__dict__["_title_shown"] = title
        widget.border_title = Content(title)
