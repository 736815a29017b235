"""The whole-pool check's report: findings capped per kind, and who maps a block.

Every part of the check (check.py) adds to one `CheckReport`; per kind, only the first
`MAX_PER_KIND` blocks become findings and the rest are counted into one more, so a pool with a
million bad blocks costs no more than one with fifty.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
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


# The record fields the check compares for every block: all in the first words of a record.
CHECKED_FIELDS = ("magic", "state", "indexed", "refcount", "owner_client", "checksum")


def record_heads(b: np.ndarray) -> np.ndarray:
    """The first words of every block record, up to the last of CHECKED_FIELDS, copied into one
    contiguous array in one pass, with those words' fields at their offsets (so the identity
    words `block_checksums` reads are there too)."""
    fields = b.dtype.fields
    assert fields is not None
    size = max(fields[f][1] + fields[f][0].itemsize for f in CHECKED_FIELDS)
    size = -(-size // 8) * 8
    inside = [f for f in b.dtype.names or () if fields[f][1] + fields[f][0].itemsize <= size]
    dtype = np.dtype(
        {
            "names": inside,
            "formats": [fields[f][0] for f in inside],
            "offsets": [fields[f][1] for f in inside],
            "itemsize": size,
        }
    )
    # Copied as opaque bytes (one memcpy per record; a structured copy goes field by field).
    raw = np.ndarray((len(b),), np.dtype(f"V{size}"), buffer=b, strides=(b.dtype.itemsize,))
    return np.ascontiguousarray(raw).view(dtype)


@dataclass(frozen=True)
class Columns:
    """The block-record fields the check compares, copied contiguous once: a field read in
    place strides over the whole 192-byte records, a pass over every block for each use."""

    heads: np.ndarray
    state: np.ndarray
    refcount: np.ndarray  # int64
    indexed: np.ndarray
    owner_client: np.ndarray

    @classmethod
    def of(cls, b: np.ndarray) -> Columns:
        heads = record_heads(b)
        return cls(
            heads,
            np.ascontiguousarray(heads["state"]),
            heads["refcount"].astype(np.int64),
            np.ascontiguousarray(heads["indexed"]),
            np.ascontiguousarray(heads["owner_client"]),
        )


class CheckReport:
    """The findings of one check, per-block ones capped at MAX_PER_KIND per kind, and the block
    columns every part of the check reads."""

    def __init__(self, view: SegmentView):
        self.view = view
        self.cols = Columns.of(view.blocks)
        self.out: list[Finding] = []
        self.counts: dict[str, int] = {}
        # per kind, the (owner pid, request) of each finding past the cap and how many
        self.unlisted: dict[str, Counter[tuple[int, str]]] = {}

    def block(
        self, kind: FindingKind, b: int, message: str, who: Who | None = None, **extra: Any
    ) -> None:
        """A finding about block b (counted only, past the cap)."""
        n = self.counts.get(kind.value, 0)
        self.counts[kind.value] = n + 1
        blocks = self.view.blocks
        # The owner is the block's own record, unless `who` names the sequence at fault.
        pid, req = who(b) if who is not None else (None, None)
        own = bytes(blocks["request"][b]).decode(errors="replace") or None
        f = Finding(
            kind.value,
            message,
            block=int(b),
            owner_pid=pid or int(blocks["owner_pid"][b]) or None,
            request=req or own,
            extra=extra,
        )
        if n < MAX_PER_KIND:
            self.out.append(f)
        else:
            self._unlist(f)

    def blocks(
        self,
        kind: FindingKind,
        ids: np.ndarray,
        message: Callable[[int], str],
        who: Who | None = None,
        extra: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        """A finding for each block of ids, up to the cap (`extra`: each one's extra keys)."""
        # Only the first MAX_PER_KIND become findings: count the rest without a Python loop.
        room = max(0, MAX_PER_KIND - self.counts.get(kind.value, 0))
        for b in ids[:room].tolist():
            self.block(kind, b, message(b), who, **(extra(b) if extra is not None else {}))
        if len(ids) > room:
            self.counts[kind.value] = self.counts.get(kind.value, 0) + len(ids) - room
            # (whose they are, from the blocks' own records: one pass, no loop per block)
            rest = ids[room:]
            blocks = self.view.blocks
            pairs, n = np.unique(
                np.rec.fromarrays([blocks["owner_pid"][rest], blocks["request"][rest]]),
                return_counts=True,
            )
            tally = self.unlisted.setdefault(kind.value, Counter())
            for (pid, req), k in zip(pairs.tolist(), n.tolist()):
                tally[(int(pid), bytes(req).decode(errors="replace"))] += int(k)

    def _unlist(self, f: Finding) -> None:
        """Count a finding past the cap by its owner and request."""
        tally = self.unlisted.setdefault(f.kind, Counter())
        tally[(f.owner_pid or 0, f.request or "")] += 1

    def add(self, f: Finding) -> None:
        """A finding about the pool rather than one block."""
        self.out.append(f)

    def capped(self, f: Finding) -> None:
        """A finding of a kind that may repeat for every record of a table: counted with the
        per-block ones of its kind, and past the cap only counted."""
        n = self.counts.get(f.kind, 0)
        self.counts[f.kind] = n + 1
        if n < MAX_PER_KIND:
            self.out.append(f)
        else:
            self._unlist(f)

    def finish(self) -> list[Finding]:
        """Every finding, then one per kind that passed the cap saying how many more, its
        `not_listed` the owner pid, request and count of each of them."""
        for kind, n in self.counts.items():
            if n > MAX_PER_KIND:
                tally = self.unlisted.get(kind, Counter())
                self.out.append(
                    Finding(
                        kind,
                        not_listed_message(kind, n - MAX_PER_KIND, n),
                        extra={"not_listed": [[p, r, k] for (p, r), k in sorted(tally.items())]},
                    )
                )
        return self.out


def not_listed_message(kind: str, more: int, total: int) -> str:
    """The message of the finding that stands for the findings of `kind` past the cap."""
    return f"{more} more {kind} findings not listed ({total} in all)"


@dataclass(frozen=True)
class TableEntries:
    """Every used entry of the block tables of seqs[rows], in row order: the block it maps and
    the row (an index into `rows`) it belongs to."""

    block: np.ndarray
    row: np.ndarray

    @classmethod
    def of(cls, seqs: np.ndarray, rows: np.ndarray) -> TableEntries:
        """Gathers only the used entries (a row's first num_blocks, at most its table's width):
        the tables of a pool are mostly empty, and a full copy of them costs more than this."""
        width = seqs["table"].shape[1]
        counts = np.minimum(seqs["num_blocks"][rows].astype(np.int64), width)
        row = np.repeat(np.arange(len(rows)), counts)
        starts = np.cumsum(counts) - counts
        col = np.arange(len(row)) - np.repeat(starts, counts)
        return cls(seqs["table"][rows[row], col].astype(np.int64), row)

    def refs(self, n: int) -> np.ndarray:
        """References to each of n blocks (ids outside [0, n) are ranges.py's findings)."""
        t = self.block
        return np.bincount(t[(t >= 0) & (t < n)], minlength=n)

    def subset(self, keep: np.ndarray) -> TableEntries:
        """The entries of the rows `keep` (a mask over the rows) marks, renumbered as rows of
        rows[keep]."""
        sel = keep[self.row]
        renumber = np.cumsum(keep) - 1
        return TableEntries(self.block[sel], renumber[self.row[sel]])


def mapper(seqs: np.ndarray, rows: np.ndarray, entries: TableEntries | None = None) -> Who:
    """(pid, request) of the first sequence of seqs[rows] whose block table maps a block:
    who still uses a block that should not be used any more."""
    index: list[tuple[np.ndarray, np.ndarray, TableEntries]] = []
    known: dict[int, tuple[int | None, str | None]] = {}

    def who(blk: int) -> tuple[int | None, str | None]:
        if blk in known:
            return known[blk]
        # Sorted once, at the first question (most checks ask none): then each is a search.
        if not index:
            e = entries if entries is not None else TableEntries.of(seqs, rows)
            order = np.argsort(e.block, kind="stable")
            index.append((e.block[order], order, e))
        keys, order, e = index[0]
        i = int(np.searchsorted(keys, blk))
        if i == len(keys) or keys[i] != blk:
            known[blk] = (None, None)
        else:
            # stable: among equal blocks the first entry, so the first row that maps it
            s = int(rows[e.row[order[i]]])
            known[blk] = (
                int(seqs["owner_pid"][s]),
                bytes(seqs["request"][s]).decode(errors="replace"),
            )
        return known[blk]

    return who
