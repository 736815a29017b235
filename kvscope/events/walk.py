"""A recorded stream walked for drawing: the checker's findings plus what happened to each hash.

    walk = walk_file("engine.kvev")
    walk.report            # the checker's report, as `events check --json` prints it
    walk.series[pub]       # the publisher's cache over time (one sample per batch)
    walk.lives             # each hash's stay in a cache: stored ... removed, cleared, restarted
    walk.parents[pub, ck]  # the prefix tree: hash -> parent hash, per (medium, group)

`StreamWalk` is the checker (checker.py) fed event by event, so its multiset of stored hashes,
its handling of restarts and reordered batches and its findings are the ones drawn. A hash's
life starts when a store finds no copy of it stored and ends when its last copy is removed,
when `AllBlocksCleared` drops it, or when its publisher restarts. A store of a hash that is
already stored is counted as stored again: another physical copy, or, in vLLM's "full" report
mode, a prefix hit re-reported; the stream does not tell the two apart. Times are the
publisher's batch timestamps (ns), or the receive time where a batch carries none.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from kvscope.events.checker import Publisher, StreamChecker
from kvscope.events.streamfile import StreamFile
from kvscope.events.wire import CLEARED, REMOVED, STORED

# Lives kept whole (each is counted), and nodes of the prefix tree kept, per stream.
MAX_LIVES = 20_000
MAX_TREE_NODES = 200_000
# Samples kept per publisher: past this, neighbours are merged (the peak kept).
MAX_SAMPLES = 4_000

PubKey = tuple[int, bytes, Any]


@dataclass
class Life:
    """One stay of a hash in one (medium, group) of one publisher's cache."""

    pub: PubKey
    cache: tuple[Any, Any]
    hash: Any
    parent: Any
    block_size: int
    start_ns: int
    batch: int
    seq: int
    end_ns: int | None = None
    end: str = ""
    end_batch: int | None = None
    stored_again: int = 0
    max_copies: int = 1


@dataclass
class Series:
    """A publisher's cache, one sample per batch: parallel lists (merged past MAX_SAMPLES)."""

    time_ns: list[int] = field(default_factory=list)
    copies: list[int] = field(default_factory=list)
    peak: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)
    again: list[int] = field(default_factory=list)

    def add(self, t: int, copies: int, hashes: int, counts: list[int]) -> None:
        self.time_ns.append(t)
        self.copies.append(copies)
        self.peak.append(copies)
        self.hashes.append(hashes)
        for name, v in zip(("stored", "removed", "new", "again"), counts):
            getattr(self, name).append(v)
        if len(self.time_ns) >= 2 * MAX_SAMPLES:
            self._merge()

    def _merge(self) -> None:
        # Pairs become one sample: the later one's values, the higher of the two peaks.
        peak = [max(a, b) for a, b in zip(self.peak[0::2], self.peak[1::2])]
        for name in ("time_ns", "copies", "hashes", "stored", "removed", "new", "again"):
            setattr(self, name, getattr(self, name)[1::2])
        self.peak = peak


class StreamWalk(StreamChecker):
    """The checker, keeping each hash's lives, the prefix tree and the caches over time."""

    # every event through `_apply`, which the walk watches
    native = None

    def __init__(self, endpoints: list[str] | None = None):
        super().__init__(endpoints)
        self.lives: list[Life] = []
        self.lives_omitted = 0
        self.open: dict[tuple[Any, ...], Life] = {}
        self.parents: dict[tuple[PubKey, tuple[Any, Any]], dict[Any, Any]] = {}
        self.tree_omitted = 0
        self._tree_nodes = 0
        self.series: dict[PubKey, Series] = {}
        self.hits: dict[PubKey, list[int]] = {}  # [new stores, stored again]
        self.clears: list[tuple[PubKey, int, int]] = []  # (publisher, time, batch)
        self.resets: list[tuple[PubKey, int, int]] = []
        # the time of each record, by its index (a finding's batch)
        self.record_ns: array[int] = array("q")
        self.first_ns = 0
        self.last_ns = 0
        self._now = 0
        self._keys: dict[int, PubKey] = {}

    # --- feeding -------------------------------------------------------------------------

    def feed(self, recv_ns: int, source: int, endpoint: int, frames: list[Any]) -> None:
        self._now = self.last_ns or recv_ns
        before = len(self.publishers)
        counts_before = {k: p.counts["batches"] for k, p in self.publishers.items()}
        super().feed(recv_ns, source, endpoint, frames)
        self.record_ns.append(self._now)
        if len(self.publishers) != before:
            for k, p in self.publishers.items():
                self._keys.setdefault(id(p), k)
        for k, p in self.publishers.items():
            if p.counts["batches"] != counts_before.get(k, 0):
                hits = self.hits.setdefault(k, [0, 0])
                hashes = sum(len(c.copies) for c in p.caches.values())
                self.series.setdefault(k, Series()).add(
                    self._now, p.live, hashes, [p.counts["stored"], p.counts["removed"], *hits]
                )

    def _sequence(self, pub: Publisher, seq: int, ts: float, batch: int) -> bool:
        t = int(ts * 1e9) if ts > 0 else self._now
        self._now = t
        if not self.first_ns or t < self.first_ns:
            self.first_ns = t
        self.last_ns = max(self.last_ns, t)
        resets = pub.counts["resets"]
        ok = super()._sequence(pub, seq, ts, batch)
        if pub.interleaved:
            # two publishers interleaved: nothing of theirs is drawn from here on
            self._close_all(self._key(pub), t, batch, "publishers interleaved")
        elif pub.counts["resets"] != resets:
            key = self._key(pub)
            self.resets.append((key, t, batch))
            self._close_all(key, t, batch, "publisher restarted")
        return ok

    def _key(self, pub: Publisher) -> PubKey:
        key = self._keys.get(id(pub))
        if key is None:
            for k, p in self.publishers.items():
                if p is pub:
                    key = self._keys[id(pub)] = k
                    break
        assert key is not None
        return key

    def _apply(self, pub: Publisher, seq: int, batch: int, events: list[Any]) -> None:
        key = self._key(pub)
        hits = self.hits.setdefault(key, [0, 0])
        t = self._now
        for ev in events:
            kind = ev.KIND
            if kind == CLEARED:
                super()._apply(pub, seq, batch, [ev])
                self.clears.append((key, t, batch))
                self._close_all(key, t, batch, "AllBlocksCleared")
                continue
            ck = (ev.medium, ev.group_idx)
            cache = pub.caches.get(ck)
            hashes = ev.block_hashes
            before = [0 if cache is None else cache.copies.get(h, 0) for h in hashes]
            super()._apply(pub, seq, batch, [ev])
            copies = pub.caches[ck].copies
            if kind == STORED:
                prev = ev.parent_block_hash
                tree = self.parents.setdefault((key, ck), {})
                for h, b in zip(hashes, before):
                    if h not in tree:
                        if self._tree_nodes < MAX_TREE_NODES:
                            tree[h] = prev
                            self._tree_nodes += 1
                        else:
                            self.tree_omitted += 1
                    elif tree[h] is None and prev is not None:
                        tree[h] = prev
                    if b == 0:
                        hits[0] += 1
                        self._open(key, ck, h, prev, ev.block_size, t, batch, seq)
                    else:
                        hits[1] += 1
                        life = self.open.get((key, ck, h))
                        if life is not None:
                            life.stored_again += 1
                            life.max_copies = max(life.max_copies, copies.get(h, 0))
                    prev = h
            elif kind == REMOVED:
                for h, b in zip(hashes, before):
                    if b and not copies.get(h):
                        self._close((key, ck, h), t, batch, "removed")

    def _open(self, key, ck, h, parent, bs, t, batch, seq) -> None:
        if len(self.lives) >= MAX_LIVES:
            self.lives_omitted += 1
            return
        life = Life(key, ck, h, parent, bs, t, batch, seq)
        self.lives.append(life)
        self.open[(key, ck, h)] = life

    def _close(self, k: tuple[Any, ...], t: int, batch: int, why: str) -> None:
        life = self.open.pop(k, None)
        if life is not None:
            life.end_ns, life.end, life.end_batch = t, why, batch

    def _close_all(self, key: PubKey, t: int, batch: int, why: str) -> None:
        for k in [k for k in self.open if k[0] == key]:
            self._close(k, t, batch, why)

    # --- reading -------------------------------------------------------------------------

    def batch_ns(self, batch: Any) -> int:
        """The time of the record with index `batch` (a finding's), or the stream's end."""
        if type(batch) is int and 0 <= batch < len(self.record_ns):
            return self.record_ns[batch]
        return self.last_ns

    def publisher_name(self, key: PubKey) -> str:
        """How findings name the publisher."""
        return self.publishers[key].name()


@dataclass
class Walked:
    """A walked stream file: the walk, the checker's report and the file's header."""

    walk: StreamWalk
    report: dict[str, Any]
    header: dict[str, Any]
    path: str


def walk_file(path: str) -> Walked:
    """Walk a recorded stream (a UsageError when it is none)."""
    stream = StreamFile(path)
    try:
        walk = StreamWalk()
        walk.feed_file(stream)
        report = walk.report(source=path, truncated=stream.truncated)
        return Walked(walk, report, dict(stream.header), path)
    finally:
        stream.close()
