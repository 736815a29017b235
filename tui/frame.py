"""One snapshot as the panels see it, and the vectorised readings they share."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvscope.allocator.findings import Finding
from kvscope.allocator.layout import BlockState, SegmentView, SeqState

STATE_NAMES = {s.value: s.name.lower() for s in BlockState}
# The block-record fields the block map, the block table and the counts read for every block,
# each copied contiguous (a field read in place strides over the whole 192-byte records).
BLOCK_COLUMNS = ("state", "refcount", "num_tokens")
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


def block_columns(view: SegmentView) -> dict[str, np.ndarray]:
    """BLOCK_COLUMNS of every block of `view`, each contiguous."""
    return {name: np.ascontiguousarray(view.blocks[name]) for name in BLOCK_COLUMNS}


@dataclass
class Frame:
    """A snapshot of the pool plus what every panel derives from it once.

    `columns` holds BLOCK_COLUMNS of every block; `view.blocks` holds the whole records of
    `records` only (None: of every block), the ones the block panel and the block table
    detail (a live pool's other records are not copied).
    """

    view: SegmentView
    stats: dict[str, Any]
    findings: list[Finding]
    taken_ns: int
    copy_ms: float
    torn: bool
    live: bool
    extra: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    records: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.columns:
            self.columns = block_columns(self.view)

    @classmethod
    def of(cls, view: SegmentView, **kw: Any) -> Frame:
        """A frame of `view` as a source returned it (its columns and records)."""
        return cls(
            view=view,
            columns=getattr(view, "columns", {}),
            records=getattr(view, "records", None),
            **kw,
        )

    def has_records(self, ids: Any) -> bool:
        """Whether the whole records of blocks `ids` are in this frame."""
        if self.records is None:
            return True
        ids = np.asarray(ids, np.int64).reshape(-1)
        ids = ids[(ids >= 0) & (ids < self.num_blocks)]
        return bool(np.isin(ids, self.records).all())

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


def cow_candidates(seqs: np.ndarray, slot: int) -> list[tuple[int, int, int]]:
    """(logical block, its physical block, the sibling's physical block) where a live sibling
    that shares every earlier block of sequence `slot` diverges from it: the records
    `cow_positions` compares."""
    s = seqs[slot]
    mine = np.asarray(s["table"][: int(s["num_blocks"])])
    k = len(mine)
    if k == 0:
        return []
    live = np.flatnonzero(seqs["state"] != SeqState.EMPTY)
    # Only a sibling that shares the first block can diverge after it.
    live = live[(live != slot) & (seqs["num_blocks"][live] > 0)]
    live = live[seqs["table"][live, 0] == mine[0]]
    if len(live) == 0:
        return []
    tables = seqs["table"][live, :k]
    lens = seqs["num_blocks"][live].astype(np.int64)
    # The first logical block where each sibling differs from this sequence.
    same = tables == mine[None, :]
    pos = np.where(same.all(axis=1), k, np.argmin(same, axis=1))
    hit = (pos > 0) & (pos < k) & (pos < lens)
    return [
        (int(p), int(mine[p]), int(tables[j, p]))
        for j, p in zip(np.flatnonzero(hit).tolist(), pos[hit].tolist())
    ]


def cow_positions(frame: Frame, slot: int) -> set[int]:
    """Logical blocks of `slot` that look like copy-on-write copies.

    A copy is a private block where this sequence diverges from a sibling that shares every
    earlier block, and whose first token equals the sibling's block at that position.
    """
    blocks = frame.view.blocks
    n = frame.num_blocks
    out: set[int] = set()
    for p, mine_b, theirs in cow_candidates(frame.view.seqs, slot):
        if not (0 <= mine_b < n and 0 <= theirs < n):
            continue
        if (
            int(blocks["refcount"][mine_b]) == 1
            and blocks["num_tokens"][mine_b]
            and (blocks["tokens"][mine_b][0] == blocks["tokens"][theirs][0])
        ):
            out.add(p)
    return out
