"""Messages between the polling worker, the app and the panels (small dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from kvscope.allocator.findings import Finding
from kvscope.tui.frame import Frame


@dataclass
class FrameReady(Message):
    """The worker took a new snapshot."""

    frame: Frame


@dataclass
class CheckDone(Message):
    """A full consistency check (check_view) finished."""

    findings: list[Finding]
    cost_s: float


@dataclass
class BlockChosen(Message):
    """A panel asks to inspect a block."""

    block: int


@dataclass
class FindingChosen(Message):
    """A panel asks to show a finding whole (the detail view)."""

    finding: Finding


@dataclass
class SequenceChosen(Message):
    """A panel asks to show a sequence (its slot in the sequence table)."""

    slot: int
