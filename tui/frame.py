"""One snapshot as the panels see it, and the vectorised readings they share."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvscope.allocator.findings import Finding
from kvscope.allocator.layout import BlockState, SegmentView, SeqState

STATE_NAMES = {s.value: s.name.lower() for s in BlockState}
SEQ_STATE_NAMES = {s.value: s.name.lower() for s in SeqState}


def _event_op_names() -> dict[int, str]:
    # The probes own the event op codes; until they exist, ops show as numbers.
    try:
        from kvscope.probes import events  # type: ignore[attr-defined]
    except ImportError:
        return {}
    ops = getattr(events, "EventOp", None) or getattr(events, "Op", None)
    if ops is None:
        return {}
    return {int(o): o.name.lower() for o in ops}


EVENT_OP_NAMES = _event_op_names()


@dataclass
class Frame:
    """A snapshot of the pool plus what every panel derives from it once."""

    view: SegmentView
    stats: dict[str, Any]
    findings: list[Finding]
    taken_ns: int
    copy_ms: float
    torn: bool
    live: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return int(self.view.h["num_blocks"])

    def live_slots(self) -> np.ndarray:
        """Slots of the sequence table in use, in slot order."""
        return np.flatnonzero(self.view.seqs["state"] != SeqState.EMPTY)

    def block_table(self, slot: int) -> np.ndarray:
        """Physical block of each logical block of the sequence in `slot`."""
        s = self.view.seqs[slot]
        return np.asarray(s["table"][: int(s["num_blocks"])])


def request_of(rec: np.void) -> str:
    """The request id stored in a block or sequence record."""
    return bytes(rec["request"]).decode(errors="replace")


def clock(time_ns: int) -> str:
    """Wall-clock time of day with milliseconds."""
    if not time_ns:
        return "-"
    t = datetime.datetime.fromtimestamp(time_ns / 1e9)
    return t.strftime("%H:%M:%S.") + f"{t.microsecond // 1000:03d}"


def ago(time_ns: int, now_ns: int) -> str:
    """How long before `now_ns`, in a short unit."""
    if not time_ns:
        return "-"
    s = max(0, now_ns - time_ns) / 1e9
    if s < 1:
        return f"{s * 1e3:.0f}ms ago"
    if s < 120:
        return f"{s:.1f}s ago"
    return f"{s / 60:.0f}m ago"


def last_events(view: SegmentView, limit: int, block: int | None = None) -> np.ndarray:
    """The newest `limit` events of every client ring (of one block when given), oldest first."""
    ev = view.events.reshape(-1)
    t = ev["time_ns"]
    mask = t != 0
    if block is not None:
        mask &= ev["block"] == block
    idx = np.flatnonzero(mask)
    if len(idx) > limit:
        idx = idx[np.argpartition(t[idx], len(idx) - limit)[len(idx) - limit :]]
    idx = idx[np.argsort(t[idx], kind="stable")]
    return ev[idx]


def op_name(op: int) -> str:
    """Name of an event op code."""
    return EVENT_OP_NAMES.get(op, f"op{op}")


def cow_positions(frame: Frame, slot: int) -> set[int]:
    """Logical blocks of `slot` that look like copy-on-write copies.

    A copy is a private block where this sequence diverges from a sibling that shares every
    earlier block, and whose first token equals the sibling's block at that position.
    """
    seqs = frame.view.seqs
    mine = frame.block_table(slot)
    if len(mine) == 0:
        return set()
    live = frame.live_slots()
    live = live[(live != slot) & (seqs["num_blocks"][live] > 0)]
    if len(live) == 0:
        return set()
    k = len(mine)
    tables = seqs["table"][live, :k]
    lens = seqs["num_blocks"][live].astype(np.int64)
    # The first logical block where each sibling differs from this sequence.
    same = tables == mine[None, :]
    pos = np.where(same.all(axis=1), k, np.argmin(same, axis=1))
    blocks = frame.view.blocks
    out: set[int] = set()
    for j, p in zip(
        np.flatnonzero((pos > 0) & (pos < k) & (pos < lens)),
        pos[(pos > 0) & (pos < k) & (pos < lens)],
    ):
        p = int(p)
        mine_b, theirs = int(mine[p]), int(tables[j, p])
        if (
            int(blocks["refcount"][mine_b]) == 1
            and blocks["num_tokens"][mine_b]
            and (blocks["tokens"][mine_b][0] == blocks["tokens"][theirs][0])
        ):
            out.add(p)
    return out
