"""The whole-pool check's report: findings capped per kind, and who maps a block.

Every part of the check (check.py) adds to one `CheckReport`; per kind, only the first
`MAX_PER_KIND` blocks become findings and the rest are counted into one more, so a pool with a
million bad blocks costs no more than one with fifty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.layout import BlockState, SegmentView

# Per kind, at most this many per-block findings; the rest are summarised in one more.
MAX_PER_KIND = 50

Alive = Callable[[int, int], bool]
# (pid, request) a finding about a block names instead of the block's own record.
Who = Callable[[int], tuple[int | None, str | None]]


def state_name(value: int) -> str:
    """A block state's name, or the number a corrupt record holds."""
    return BlockState(value).name if value < len(BlockState) else f"state {value}"


class CheckReport:
    """The findings of one check, per-block ones capped at MAX_PER_KIND per kind."""

    def __init__(self, view: SegmentView):
        self.view = view
        self.out: list[Finding] = []
        self.counts: dict[str, int] = {}

    def block(
        self, kind: FindingKind, b: int, message: str, who: Who | None = None, **extra: Any
    ) -> None:
        """A finding about block b (counted only, past the cap)."""
        n = self.counts.get(kind.value, 0)
        self.counts[kind.value] = n + 1
        if n < MAX_PER_KIND:
            blocks = self.view.blocks
            # The owner is the block's own record, unless `who` names the sequence at fault.
            pid, req = who(b) if who is not None else (None, None)
            own = bytes(blocks["request"][b]).decode(errors="replace") or None
            self.out.append(
                Finding(
                    kind.value,
                    message,
                    block=int(b),
                    owner_pid=pid or int(blocks["owner_pid"][b]) or None,
                    request=req or own,
                    extra=extra,
                )
            )

    def blocks(
        self,
        kind: FindingKind,
        ids: np.ndarray,
        message: Callable[[int], str],
        who: Who | None = None,
    ) -> None:
        """A finding for each block of ids, up to the cap."""
        # Only the first MAX_PER_KIND become findings: count the rest without a Python loop.
        room = max(0, MAX_PER_KIND - self.counts.get(kind.value, 0))
        for b in ids[:room].tolist():
            self.block(kind, b, message(b), who)
        if len(ids) > room:
            self.counts[kind.value] = self.counts.get(kind.value, 0) + len(ids) - room

    def add(self, f: Finding) -> None:
        """A finding about the pool rather than one block."""
        self.out.append(f)

    def finish(self) -> list[Finding]:
        """Every finding, then one per kind that passed the cap saying how many more."""
        for kind, n in self.counts.items():
            if n > MAX_PER_KIND:
                self.out.append(
                    Finding(
                        kind, f"{n - MAX_PER_KIND} more {kind} findings not listed ({n} in all)"
                    )
                )
        return self.out


def _mapped(seqs: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The block ids the tables of seqs[rows] map, in row order, and the row of each."""
    tables = seqs["table"][rows]
    used = np.arange(tables.shape[1]) < seqs["num_blocks"][rows][:, None]
    return tables[used].astype(np.int64), np.nonzero(used)[0]


def mapper(seqs: np.ndarray, rows: np.ndarray) -> Who:
    """(pid, request) of the first sequence of seqs[rows] whose block table maps a block:
    who still uses a block that should not be used any more."""
    found: list[tuple[np.ndarray, np.ndarray]] = []

    def who(blk: int) -> tuple[int | None, str | None]:
        # The tables are gathered once, at the first question: most checks ask none.
        if not found:
            found.append(_mapped(seqs, rows))
        ids, row_of = found[0]
        hit = np.flatnonzero(ids == blk)
        if len(hit) == 0:
            return None, None
        s = int(rows[row_of[hit[0]]])
        return int(seqs["owner_pid"][s]), bytes(seqs["request"][s]).decode(errors="replace")

    return who


def table_refs(seqs: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
    """References to each block from the block tables of seqs[rows], in one bincount."""
    t, _ = _mapped(seqs, rows)
    return np.bincount(t[(t >= 0) & (t < n)], minlength=n)
