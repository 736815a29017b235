"""The flight recorder's vocabulary (the recorder itself writes from allocator/events.py)."""

from kvscope.allocator.events import OP_NAMES, EventOp, events_for_block, recent_events

__all__ = ["OP_NAMES", "EventOp", "events_for_block", "recent_events"]
