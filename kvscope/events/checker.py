"""The invariants of a KV-event stream (`kvscope events check`, docs/EVENTS.md "Checks").

A `StreamChecker` is fed the records of a recorded stream in order and keeps, per publisher
(endpoint, topic, data-parallel rank), the sequence numbers it has seen and, per (medium,
group) of that publisher, the multiset of block hashes stored now: a hash counts once per
`BlockStored` that named it and loses one per `BlockRemoved`, since an engine stores a hash
once per physical copy and removes it once per copy. What breaks an invariant becomes a
`Finding` in kvscope's vocabulary (the `kv_event_*` kinds of allocator/findings.py) naming the
batch (the record's index in the file), its seq, the hash and the events that led to it.

Where kvscope/csrc/kvevents.c is built (`kvscope._kvevents`), it reads each batch's payload
and applies the events no check can fire on to the same dicts, up to the first event where one
might; the checker applies the rest. Without it the checker decodes with msgspec and applies
every event itself, with the same result.

A publisher whose stream was not seen from its seq 0 or from an `AllBlocksCleared` (the
recording joined late, a batch was lost) has blocks the checker never saw stored: a removal or
a parent it does not know is then counted as unverifiable, not reported.
"""

from __future__ import annotations

import gc
import json
import struct
from collections.abc import Iterable
from typing import Any

from kvscope.allocator.findings import ERROR, Finding, FindingKind
from kvscope.events.streamfile import NOTE, PUBLISHED, REPLAYED, StreamFile
from kvscope.events.wire import (
    CLEARED,
    KIND_NAMES,
    REMOVED,
    STORED,
    WireError,
    decode_payload,
    hash_text,
    num_tokens,
    split_message,
    tokens,
)

try:
    from kvscope import _kvevents  # type: ignore[attr-defined]
except ImportError:  # built by setup.py where a C compiler was found
    _kvevents = None

# A msgpack array's header when it holds 16 to 65535 items: 0xdc, then the count.
_ARRAY16 = struct.Struct(">BH").unpack_from

# At most this many findings of one kind are kept whole (each is counted).
MAX_FINDINGS_PER_KIND = 200

# Two publishers interleaved on one (endpoint, topic, rank): the seq goes from one of two
# sequences to the other and back this many times, each within SWITCH_WINDOW batches of the
# one before. (A restart leaves its old sequence for good, a batch late or twice goes back once.)
INTERLEAVED_SWITCHES = 3
SWITCH_WINDOW = 64

# Cache-spec kinds whose stored chains skip blocks (a sliding window's dropped blocks, a
# Mamba group's masked ones): their parents and token counts are not checked.
_CHAINED_SPECS = (None, "full_attention")


# A BlockStored as the cache keeps it, one tuple shared by its hashes:
# (parent, block_size, token_ids, block_hashes, seq, batch)
_Stored = tuple[Any, int, Any, list[Any], int, int]


class _Removals:
    """hash -> (seq, batch) of the removal of its last copy, for the findings that name it.

    Every removal of a last copy is appended to `log` (hash, then (seq, batch)); the log is
    indexed only when a hash is looked up, which only a check about to fire does. A healthy
    stream is never looked up: a dict of every hash ever removed, growing for the whole
    stream, cost a quarter of a check's time.
    """

    __slots__ = ("log", "index")

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.index: dict[Any, tuple[int, int]] = {}

    def _indexed(self) -> dict[Any, tuple[int, int]]:
        log = self.log
        if log:
            # the later removal of a hash replaces the earlier
            self.index.update(zip(log[0::2], log[1::2]))
            log.clear()
        return self.index

    def __setitem__(self, h: Any, at: tuple[int, int]) -> None:
        self.log += (h, at)

    def __contains__(self, h: Any) -> bool:
        return h in self._indexed()

    def __getitem__(self, h: Any) -> tuple[int, int]:
        return self._indexed()[h]

    def as_dict(self) -> dict[Any, tuple[int, int]]:
        """Every hash removed, with its last removal."""
        return self._indexed()


class _Cache:
    """One (medium, group) of one publisher: the multiset of hashes stored now."""

    __slots__ = ("copies", "stored", "removed_at", "cleared", "full_size", "retired", "superseded")

    def __init__(self) -> None:
        # hash -> live copies
        self.copies: dict[Any, int] = {}
        # hash -> the BlockStored of its oldest live copy (_block() finds the hash's own
        # parent and tokens in it)
        self.stored: dict[Any, _Stored] = {}
        # hash -> (seq, batch) of the removal of its last copy
        self.removed_at = _Removals()
        # hash -> (seq, batch) of the AllBlocksCleared that dropped it
        self.cleared: dict[Any, tuple[int, int]] = {}
        # the largest block_size stored: a smaller one is a partial block
        self.full_size = 0
        # parent -> [(partial hash, its tokens, seq, batch)] of partial blocks removed
        self.retired: dict[Any, list[tuple[Any, tuple[int, ...], int, int]]] = {}
        # partial hash -> (full hash that superseded it, seq, batch)
        self.superseded: dict[Any, tuple[Any, int, int]] = {}

    def clear(self, at: tuple[int, int]) -> None:
        """AllBlocksCleared at (seq, batch): every stored hash dropped, remembered as cleared."""
        self.cleared = dict.fromkeys(self.copies, at)
        self.copies.clear()
        self.stored.clear()
        self.retired.clear()
        self.superseded.clear()


def _block(info: _Stored, h: Any) -> tuple[Any, ...]:
    """(parent, block_size, token_ids, first token, seq, batch) of block `h` of a BlockStored."""
    parent, bs, toks, hashes, seq, batch = info
    i = hashes.index(h)
    return hashes[i - 1] if i else parent, bs, toks, i * bs, seq, batch


class Publisher:
    """One publisher's sequence and accounting, and its caches since its last restart."""

    def __init__(self, endpoint: str, topic: bytes, rank: int | None):
        self.endpoint = endpoint
        self.topic = topic
        self.rank = rank
        self.next_seq: int | None = None
        self.first_seq: int | None = None
        self.last_ts = 0.0
        self.first_ts = 0.0
        # Every block stored since the checker's first view of it was seen stored.
        self.complete = False
        self.incomplete_because = ""
        self.caches: dict[tuple[Any, Any], _Cache] = {}
        self.counts = dict.fromkeys(
            (
                "batches",
                "events",
                "stored",
                "removed",
                "cleared",
                "gaps",
                "missing_batches",
                "resets",
                "reordered",
                "replayed",
                "unverifiable",
            ),
            0,
        )
        # block copies stored now, and the most there were after any event
        self.live = 0
        self.peak_stored = 0
        # Since the last restart or clear: the first few seq ranges lost (first, last), the
        # ranges and the batches lost (for what is not verifiable).
        self.lost: list[tuple[int, int]] = []
        self.lost_ranges = 0
        self.lost_batches = 0
        # Two sequences interleaved: the next seq of the sequence the stream last left (a
        # restart's old one, a late batch's), the times it continued, the batch count at the
        # last of those, and whether the publisher was found two publishers interleaved.
        self.other_next: int | None = None
        self.switches = 0
        self.switched_at = 0
        self.interleaved = False
        # the events of the batches not applied as reordered
        self.skipped_events = 0
        # Its findings kept, and the number it was reported of each kind (those kept and not).
        self.findings: list[Finding] = []
        self.reported: dict[str, int] = {}

    def cache(self, ck: tuple[Any, Any]) -> _Cache:
        """The cache of (medium, group) `ck`, made empty on its first event."""
        cache = self.caches.get(ck)
        if cache is None:
            cache = self.caches[ck] = _Cache()
        return cache

    def name(self) -> str:
        topic = f" topic {self.topic.decode(errors='replace')!r}" if self.topic else ""
        rank = "" if self.rank is None else f" rank {self.rank}"
        return f"{self.endpoint}{topic}{rank}"

    def lost_text(self) -> str:
        """The batches lost, by seq: `seq 7`, `seq 7..9`, the first few ranges and a count."""
        ranges = [f"{a}" if a == b else f"{a}..{b}" for a, b in self.lost]
        more = self.lost_ranges - len(ranges)
        text = ", ".join(ranges) + (f" and {more} more range(s)" if more > 0 else "")
        return f"{self.lost_batches} batch(es) lost (seq {text})"

    def forget_lost(self) -> None:
        """A restart or a clear: what was lost before no longer makes anything unverifiable."""
        self.lost = []
        self.lost_ranges = self.lost_batches = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "topic": self.topic.decode(errors="replace"),
            "rank": self.rank,
            "first_seq": self.first_seq,
            "last_seq": None if self.next_seq is None else self.next_seq - 1,
            "interleaved": self.interleaved,
            "first_ts": self.first_ts,
            "last_ts": self.last_ts,
            **self.counts,
            "blocks_stored": self.live,
            "peak_blocks_stored": self.peak_stored,
            "complete": self.complete,
            "incomplete_because": self.incomplete_because or None,
        }


def _event(
    kind: int, seq: int, batch: int, h: Any = None, parent: Any = None, what: str = ""
) -> dict[str, Any]:
    e: dict[str, Any] = {"batch": batch, "seq": seq, "type": KIND_NAMES[kind]}
    if h is not None:
        e["hash"] = hash_text(h)
    if parent is not None:
        e["parent"] = hash_text(parent)
    if what:
        e["what"] = what
    return e


class StreamChecker:
    """Checks a stream's records fed in order; `report()` gives the result."""

    # The compiled fast path (None: msgspec and `_apply` for every event). A subclass that
    # watches `_apply` event by event (walk.StreamWalk) sets None.
    native: Any = _kvevents

    def __init__(self, endpoints: list[str] | None = None, num_blocks: int | None = None):
        self._endpoints = endpoints or []
        # The engine's pool size (`events check --num-blocks`): more blocks stored at once is
        # a stream that misses removals (_over_capacity, once, at the report).
        self.num_blocks = num_blocks
        self._capacity_checked = False
        self.publishers: dict[tuple[int, bytes, int | None], Publisher] = {}
        self.findings: list[Finding] = []
        self.finding_counts: dict[str, int] = {}
        self.num_records = 0
        self.num_malformed = 0
        self.num_events = 0
        self.notes: list[dict[str, Any]] = []
        self._last_topic: dict[int, bytes] = {}
        # Bytes of a recorded file not read as records (feed_file): cut short, or corrupt.
        self.unread_bytes = 0

    # --- findings ------------------------------------------------------------------------

    def _report(
        self,
        kind: FindingKind,
        message: str,
        pub: Publisher | None,
        seq: int | None,
        batch: int,
        h: Any = None,
        events: list[dict[str, Any]] | None = None,
        cache_key: tuple[Any, Any] | None = None,
    ) -> None:
        n = self.finding_counts.get(kind.value, 0)
        self.finding_counts[kind.value] = n + 1
        if pub is not None:
            pub.reported[kind.value] = pub.reported.get(kind.value, 0) + 1
        if n >= MAX_FINDINGS_PER_KIND:
            return
        extra: dict[str, Any] = {"batch": batch, "seq": seq}
        if pub is not None:
            extra["publisher"] = pub.name()
            extra["rank"] = pub.rank
        if h is not None:
            extra["hash"] = hash_text(h)
        if cache_key is not None:
            extra["medium"], extra["group"] = cache_key
        where = f"batch {batch}" + ("" if seq is None else f" (seq {seq})")
        who = f" from {pub.name()}" if pub is not None else ""
        finding = Finding(
            kind=kind,
            message=f"{where}{who}: {message}",
            events=events or [],
            extra=extra,
        )
        self.findings.append(finding)
        if pub is not None:
            pub.findings.append(finding)

    # --- feeding -------------------------------------------------------------------------

    def _endpoint(self, i: int) -> str:
        return self._endpoints[i] if 0 <= i < len(self._endpoints) else f"endpoint {i}"

    def feed_file(self, stream: StreamFile) -> None:
        """Every record of a recorded stream, in order; a stretch of the file that does not
        parse as records (corrupt) is a `kv_event_malformed` finding."""
        self._endpoints = stream.endpoints
        if self.native is None:
            for recv_ns, source, endpoint, frames in stream.records():
                self.feed(recv_ns, source, endpoint, frames)
        else:
            # The compiled path reads the records itself: a published batch of a publisher
            # seen before, with its next seq, is applied as feed() would apply it
            # (_apply_rest for what it leaves); any other record goes to feed(). It stops at
            # a record that runs past the end of the file, which the file skips or ends at.
            buf, first = stream.mapping()
            end = len(buf)
            pos: int | None = first
            while pos is not None and pos < end:
                pos, stopped = self.native.feed_records(self, buf, pos)
                if stopped:
                    pos = stream.skip(pos, self.num_records)
        self.unread_bytes += stream.unread_bytes
        for offset, size, before in stream.corrupt:
            self.num_malformed += 1
            if offset + size < len(stream.mapping()[0]):
                what = f"skipped to the next whole record, at byte {offset + size:,}"
            else:
                what = "up to the end of the file"
            self._report(
                FindingKind.KV_EVENT_MALFORMED,
                f"{size:,} byte(s) of the file from byte {offset:,} do not parse as records:"
                f" the file is corrupt there, not cut short ({what})",
                None,
                None,
                before,
            )

    def _apply_rest(self, pub: Publisher, seq: int, batch: int, payload: bytes, done: int):
        """The events of a batch from index `done` on, which the compiled path left."""
        self._apply(pub, seq, batch, decode_payload(payload)[2][done:])

    def feed_all(self, records: Iterable[tuple[int, int, int, list[bytes]]]) -> None:
        """Records (recv_ns, source, endpoint, frames) in order."""
        for recv_ns, source, endpoint, frames in records:
            self.feed(recv_ns, source, endpoint, frames)

    def feed(self, recv_ns: int, source: int, endpoint: int, frames: list[Any]) -> None:
        """One record: a published or replayed message, or a recorder's note."""
        batch = self.num_records
        self.num_records += 1
        if source == NOTE:
            try:
                note = json.loads(bytes(frames[0]))
                self.notes.append({"batch": batch, "endpoint": self._endpoint(endpoint), **note})
            except (ValueError, IndexError, TypeError):
                pass
            return
        native = self.native
        events: list[Any] | None = None
        try:
            if source != PUBLISHED and source != REPLAYED:
                raise WireError(f"a record of unknown source {source} (the file is corrupt)")
            topic, seq, payload = split_message(frames)
            if len(frames) == 2:
                # a replay reply of vLLM <= 0.25 names no topic: the endpoint's last one
                topic = self._last_topic.get(endpoint, b"")
            else:
                self._last_topic[endpoint] = topic
            head = native.scan(payload) if native is not None else None
            if head is None:
                ts, rank, events = decode_payload(payload)
                num = len(events)
            else:
                ts, rank, num = head
            if rank is not None and rank < 0:
                raise WireError(f"its data-parallel rank is {rank}")
        except WireError as e:
            self.num_malformed += 1
            self._report(
                FindingKind.KV_EVENT_MALFORMED,
                f"a message from {self._endpoint(endpoint)} that is no KV-event batch: {e}",
                None,
                None,
                batch,
            )
            return
        key = (endpoint, topic, rank)
        pub = self.publishers.get(key)
        if pub is None:
            pub = self.publishers[key] = Publisher(self._endpoint(endpoint), topic, rank)
        if source == REPLAYED:
            pub.counts["replayed"] += 1
        if pub.interleaved or not self._sequence(pub, seq, ts, batch):
            if pub.interleaved:
                # two publishers' batches, told apart by nothing: counted, not checked
                pub.counts["batches"] += 1
                pub.counts["events"] += num
                self.num_events += num
            else:
                pub.skipped_events += num
            return
        pub.counts["batches"] += 1
        pub.counts["events"] += num
        self.num_events += num
        if events is None:
            done, pub.live, pub.peak_stored, num_stored, num_removed = native.apply(
                payload, pub.caches, seq, batch, pub.live, pub.peak_stored
            )
            pub.counts["stored"] += num_stored
            pub.counts["removed"] += num_removed
            if done == num:
                return
            events = decode_payload(payload)[2][done:]
        self._apply(pub, seq, batch, events)

    def _sequence(self, pub: Publisher, seq: int, ts: float, batch: int) -> bool:
        """Account for `seq`; False for a batch that must not be applied (reordered, or the
        publisher found two publishers interleaved)."""
        nxt = pub.next_seq
        if nxt is None:
            pub.first_seq = seq
            pub.first_ts = ts
            pub.complete = seq == 0
            if seq:
                pub.incomplete_because = f"the stream was recorded from seq {seq}, not 0"
        elif seq != nxt:
            # the sequence the stream last left continues: a second publisher, unless it
            # stays the once
            if seq == pub.other_next:
                if pub.counts["batches"] - pub.switched_at > SWITCH_WINDOW:
                    pub.switches = 0
                pub.switches += 1
                pub.switched_at = pub.counts["batches"]
                if pub.switches >= INTERLEAVED_SWITCHES:
                    self._interleaved(pub, seq, batch)
                    return False
            if seq > nxt:
                if seq == pub.other_next:
                    pub.other_next = nxt
                self._gap(pub, seq, nxt, batch)
            else:
                return self._went_back(pub, seq, nxt, ts, batch)
        pub.next_seq = seq + 1
        pub.last_ts = ts
        return True

    def _gap(self, pub: Publisher, seq: int, nxt: int, batch: int) -> None:
        missing = seq - nxt
        pub.counts["gaps"] += 1
        pub.counts["missing_batches"] += missing
        if len(pub.lost) < 5:
            pub.lost.append((nxt, seq - 1))
        pub.lost_ranges += 1
        pub.lost_batches += missing
        pub.complete = False
        pub.incomplete_because = pub.lost_text()
        lost = f"seq {nxt}" if missing == 1 else f"seq {nxt}..{seq - 1} ({missing} batches)"
        self._report(
            FindingKind.KV_EVENT_GAP,
            f"{lost} lost: seq jumped from {nxt - 1} to {seq} (a subscriber's index now"
            " misses their stores and removals)",
            pub,
            seq,
            batch,
        )

    def _went_back(self, pub: Publisher, seq: int, nxt: int, ts: float, batch: int) -> bool:
        """A seq below the next one: a restart (to 0, or with a later timestamp), else a batch
        late or twice (not applied)."""
        went = f"seq {seq} repeated" if seq == nxt - 1 else f"seq went back from {nxt - 1} to {seq}"
        if ts > pub.last_ts:
            when = "a later timestamp"
        elif ts == pub.last_ts:
            when = "the same timestamp"
        else:
            when = "an earlier timestamp"
        if seq == 0 or ts > pub.last_ts:
            pub.counts["resets"] += 1
            self._report(
                FindingKind.KV_EVENT_SEQ_RESET,
                f"{went} with {when}: the publisher restarted (its prefix cache starts empty;"
                " a subscriber must drop what it indexed from it)",
                pub,
                seq,
                batch,
            )
            pub.caches = {}
            pub.live = 0
            pub.forget_lost()
            pub.complete = seq == 0
            pub.incomplete_because = (
                "" if seq == 0 else f"after a restart the stream resumed at seq {seq}"
            )
            pub.other_next = nxt
            pub.next_seq = seq + 1
            pub.last_ts = ts
            return True
        pub.counts["reordered"] += 1
        if seq == nxt - 1 and ts == pub.last_ts:
            what = "delivered twice"
        else:
            what = "reordered or repeated"
            # where the late batch's sequence would go on
            pub.other_next = seq + 1
        self._report(
            FindingKind.KV_EVENT_REORDER,
            f"seq {seq} arrived after seq {nxt - 1} with {when} ({what}; not applied)"
            if seq != nxt - 1
            else f"{went}, with {when} ({what}; not applied)",
            pub,
            seq,
            batch,
        )
        return False

    def _interleaved(self, pub: Publisher, seq: int, batch: int) -> None:
        """Two publishers on one (endpoint, topic, rank), their seqs interleaved: what the
        mix made the checker report is withdrawn, and one finding says it; their batches
        are counted from here on, not checked (nothing tells them apart)."""
        withdrawn = sum(pub.reported.values())
        gone = {id(f) for f in pub.findings}
        self.findings[:] = [f for f in self.findings if id(f) not in gone]
        for kind, n in pub.reported.items():
            left = self.finding_counts[kind] - n
            if left > 0:
                self.finding_counts[kind] = left
            else:
                del self.finding_counts[kind]
        pub.findings = []
        pub.reported = {}
        # the batches the mix made look reordered were theirs: counted
        pub.counts["batches"] += pub.counts["reordered"]
        pub.counts["events"] += pub.skipped_events
        self.num_events += pub.skipped_events
        for k in ("gaps", "missing_batches", "resets", "reordered", "unverifiable"):
            pub.counts[k] = 0
        pub.caches = {}
        pub.live = 0
        pub.forget_lost()
        pub.interleaved = True
        pub.complete = False
        pub.incomplete_because = "two publishers' batches interleaved"
        pub.next_seq = None
        self._report(
            FindingKind.KV_EVENT_INTERLEAVED,
            "seq alternates between two sequences (from one to the other and back"
            f" {pub.switches} times, the last at seq {seq}): two publishers share this"
            " endpoint, topic and data-parallel rank (two engines at one DP rank on one port?);"
            " their batches cannot be told apart, so they are counted from here on, not checked"
            + (f" ({withdrawn} finding(s) of the mixed stream withdrawn)" if withdrawn else ""),
            pub,
            seq,
            batch,
        )

    def _apply(self, pub: Publisher, seq: int, batch: int, events: list[Any]) -> None:
        """A batch's events, in order, on the publisher's caches.

        The common case stays on a fast path: a BlockStored goes hash by hash while no check
        can fire (a hash not stored, not cleared, not a superseded partial block, whose parent
        is no retired partial block's: one copy of it); at the first hash where one might,
        `_store_checked` takes over and checks the rest. A BlockRemoved of a stored hash
        takes a copy away; one of a hash not stored goes to `_removed_unstored`. The token
        count and the parent are checked on every BlockStored.
        """
        counts = pub.counts
        live = pub.live
        peak = pub.peak_stored
        at = (seq, batch)
        num_stored = num_removed = 0
        # the cache of the event before (a batch's events keep to one (medium, group)), and
        # its dicts
        cache: Any = None
        medium: Any = None
        group: Any = None
        for ev in events:
            kind = ev.KIND
            if kind == CLEARED:
                counts["cleared"] += 1
                live = 0
                for c in pub.caches.values():
                    c.clear(at)
                pub.complete = True
                pub.incomplete_because = ""
                pub.forget_lost()
                cache = None
                continue
            if cache is None or ev.medium != medium or ev.group_idx != group:
                medium = ev.medium
                group = ev.group_idx
                ck = (medium, group)
                cache = pub.cache(ck)
                copies = cache.copies
                stored = cache.stored
                removed_log = cache.removed_at.log
                cleared = cache.cleared
                retired = cache.retired
                superseded = cache.superseded
                full_size = cache.full_size
            hashes = ev.block_hashes
            if kind == STORED:
                parent = ev.parent_block_hash
                bs = ev.block_size
                toks = ev.token_ids
                num = len(hashes)
                num_stored += num
                live += num
                if live > peak:
                    peak = live
                if bs > full_size:
                    full_size = cache.full_size = bs
                # the token count, from the list's msgpack header: 0xdc and a 16-bit count
                # for 16 to 65535 tokens
                head, n = _ARRAY16(toks) if len(toks) > 2 else (0, 0)
                if head != 0xDC:
                    n = num_tokens(toks)
                if n != bs * num and n and bs:
                    self._token_count(pub, ck, seq, batch, ev, n)
                if parent is not None and parent not in copies:
                    chained = ev.kv_cache_spec_kind in _CHAINED_SPECS
                    self._unknown_parent(pub, cache, ck, seq, batch, parent, hashes, chained)
                info = (parent, bs, toks, hashes, seq, batch)
                special = cleared or superseded or retired
                for i, h in enumerate(hashes):
                    if h in copies or special and self._may_fire(cache, info, i):
                        self._store_checked(pub, cache, ck, info, i)
                        break
                    copies[h] = 1
                    stored[h] = info
            else:
                num_removed += len(hashes)
                for h in hashes:
                    c = copies.pop(h, 0)
                    if c == 1:
                        # its last copy
                        live -= 1
                        removed_log.append(h)
                        removed_log.append(at)
                        info = stored.pop(h)
                        if info[1] < full_size:
                            self._retire(cache, h, info, seq, batch)
                    elif c:
                        live -= 1
                        copies[h] = c - 1
                    else:
                        self._removed_unstored(pub, cache, ck, seq, batch, h)
        counts["stored"] += num_stored
        counts["removed"] += num_removed
        pub.live = live
        pub.peak_stored = peak

    @staticmethod
    def _may_fire(cache: _Cache, info: _Stored, i: int) -> bool:
        # Hash i of a BlockStored, not stored: a check may fire on it if it was cleared, if it
        # is a superseded partial block, or if its parent is a retired partial block's.
        parent, _, _, hashes, _, _ = info
        prev = hashes[i - 1] if i else parent
        return hashes[i] in cache.cleared or hashes[i] in cache.superseded or prev in cache.retired

    def _store_checked(self, pub, cache, ck, info, first) -> None:
        """A BlockStored's hashes from the one at `first` on, each checked: stored again, a
        superseded partial block stored again, a full block superseding a retired partial
        one; a cleared hash stored again is no longer cleared."""
        parent, bs, toks, hashes, seq, batch = info
        copies = cache.copies
        prev = hashes[first - 1] if first else parent
        start = first * bs
        for h in hashes[first:]:
            c = copies.get(h)
            if c is None:
                copies[h] = 1
                cache.stored[h] = info
                if h in cache.cleared:
                    del cache.cleared[h]
                if h in cache.superseded:
                    self._partial_again(pub, cache, ck, seq, batch, h)
            else:
                copies[h] = c + 1
                self._stored_again(pub, cache, ck, seq, batch, h, prev, bs, toks, start)
            if prev in cache.retired:
                self._supersede(cache, prev, h, toks, start, bs, seq, batch)
            prev = h
            start += bs

    def _retire(self, cache: _Cache, h: Any, info: _Stored, seq: int, batch: int) -> None:
        # The last copy of a partial block removed: a full block with its parent may
        # supersede it.
        parent, bs, toks, start, _, _ = _block(info, h)
        if num_tokens(toks) > 0:
            ptoks = tuple(tokens(toks)[start : start + bs])
            cache.retired.setdefault(parent, []).append((h, ptoks, seq, batch))

    # --- the invariants, where one may be broken -----------------------------------------

    def _token_count(self, pub, ck, seq, batch, ev, n) -> None:
        # `n` token ids, not block_size for each hash; a group whose chains skip blocks only
        # has to cover its hashes with whole blocks
        hashes = ev.block_hashes
        bs = ev.block_size
        want = bs * len(hashes)
        if n != want if ev.kv_cache_spec_kind in _CHAINED_SPECS else (n < want or n % bs):
            h = hashes[0] if hashes else None
            self._report(
                FindingKind.KV_EVENT_TOKEN_COUNT,
                f"BlockStored of {len(hashes)} block(s) of block_size {bs} carries"
                f" {n} token ids ({want} expected)",
                pub,
                seq,
                batch,
                h,
                [_event(STORED, seq, batch, h, ev.parent_block_hash)],
                ck,
            )

    def _unknown_parent(self, pub, cache, ck, seq, batch, parent, hashes, chained) -> None:
        if parent in cache.cleared:
            cseq, cbatch = cache.cleared[parent]
            self._report(
                FindingKind.KV_EVENT_AFTER_CLEAR,
                f"BlockStored names parent {hash_text(parent)}, dropped by the"
                f" AllBlocksCleared of batch {cbatch} (seq {cseq}) and not stored since",
                pub,
                seq,
                batch,
                parent,
                [
                    _event(CLEARED, cseq, cbatch),
                    _event(STORED, seq, batch, hashes[0] if hashes else None, parent),
                ],
                ck,
            )
        elif pub.complete and chained:
            events = []
            if parent in cache.removed_at:
                rseq, rbatch = cache.removed_at[parent]
                events.append(_event(REMOVED, rseq, rbatch, parent, what="its last copy removed"))
            events.append(_event(STORED, seq, batch, hashes[0] if hashes else None, parent))
            gone = " (its last copy was removed before)" if len(events) > 1 else ""
            self._report(
                FindingKind.KV_EVENT_UNKNOWN_PARENT,
                f"BlockStored names parent {hash_text(parent)}, which is not stored{gone}:"
                " a subscriber cannot attach the chain",
                pub,
                seq,
                batch,
                parent,
                events,
                ck,
            )
        else:
            pub.counts["unverifiable"] += 1

    def _removed_unstored(self, pub, cache, ck, seq, batch, h) -> None:
        if h in cache.cleared:
            cseq, cbatch = cache.cleared[h]
            self._report(
                FindingKind.KV_EVENT_AFTER_CLEAR,
                f"BlockRemoved of {hash_text(h)}, dropped by the AllBlocksCleared of batch"
                f" {cbatch} (seq {cseq}) and not stored since",
                pub,
                seq,
                batch,
                h,
                [_event(CLEARED, cseq, cbatch), _event(REMOVED, seq, batch, h)],
                ck,
            )
        elif pub.complete:
            events = []
            if h in cache.removed_at:
                rseq, rbatch = cache.removed_at[h]
                events.append(_event(REMOVED, rseq, rbatch, h, what="its last copy removed"))
            events.append(_event(REMOVED, seq, batch, h))
            what = "removed again after its last copy" if len(events) > 1 else "never stored"
            self._report(
                FindingKind.KV_EVENT_REMOVE_UNSTORED,
                f"BlockRemoved of {hash_text(h)}, {what}",
                pub,
                seq,
                batch,
                h,
                events,
                ck,
            )
        else:
            pub.counts["unverifiable"] += 1

    def _stored_again(self, pub, cache, ck, seq, batch, h, parent, bs, toks, start) -> None:
        # Another copy, or a prefix hit re-reported ("full" report mode): the same block.
        # A copy whose tokens or parent differ is a hash committed over other contents.
        old_parent, old_bs, old_tokens, old_start, old_seq, old_batch = _block(cache.stored[h], h)
        diff = ""
        if parent is not None and old_parent is not None and parent != old_parent:
            diff = f"parent {hash_text(parent)}, stored before with parent {hash_text(old_parent)}"
        elif bs == old_bs and num_tokens(toks) > 0 and num_tokens(old_tokens) > 0:
            if tokens(toks)[start : start + bs] != tokens(old_tokens)[old_start : old_start + bs]:
                diff = "other token ids than the copy stored before"
        elif bs != old_bs and num_tokens(toks) > 0 and num_tokens(old_tokens) > 0:
            diff = f"block_size {bs}, stored before with block_size {old_bs}"
        if diff:
            self._report(
                FindingKind.KV_EVENT_STORE_CONFLICT,
                f"BlockStored of {hash_text(h)} while stored, with {diff}",
                pub,
                seq,
                batch,
                h,
                [
                    _event(STORED, old_seq, old_batch, h, old_parent, "stored"),
                    _event(STORED, seq, batch, h, parent, "stored again"),
                ],
                ck,
            )

    def _supersede(self, cache, parent, h, toks, start, bs, seq, batch) -> None:
        # A full block stored under the parent of a retired partial block, whose tokens begin
        # with the partial's: the partial hash is superseded by it.
        if num_tokens(toks) <= 0:
            return
        block = tuple(tokens(toks)[start : start + bs])
        keep = []
        for p, ptoks, _pseq, _pbatch in cache.retired[parent]:
            if len(ptoks) < len(block) and block[: len(ptoks)] == ptoks:
                cache.superseded[p] = (h, seq, batch)
            else:
                keep.append((p, ptoks, _pseq, _pbatch))
        if keep:
            cache.retired[parent] = keep
        else:
            del cache.retired[parent]

    def _partial_again(self, pub, cache, ck, seq, batch, h) -> None:
        full, fseq, fbatch = cache.superseded[h]
        if not cache.copies.get(full):
            del cache.superseded[h]
            return
        events = []
        if h in cache.removed_at:
            rseq, rbatch = cache.removed_at[h]
            events.append(_event(REMOVED, rseq, rbatch, h, what="partial block retired"))
        events.append(_event(STORED, fseq, fbatch, full, what="full block superseding it"))
        events.append(_event(STORED, seq, batch, h, what="partial hash stored again"))
        self._report(
            FindingKind.KV_EVENT_PARTIAL_REAPPEARED,
            f"partial block hash {hash_text(h)} stored again after the full block"
            f" {hash_text(full)} (batch {fbatch}, seq {fseq}) superseded it, which is still"
            " stored",
            pub,
            seq,
            batch,
            h,
            events,
            ck,
        )

    # --- the result ----------------------------------------------------------------------

    def _over_capacity(self) -> None:
        """With the engine's pool size: each publisher (not two interleaved) that had more
        block copies stored at once in one medium than the pool has blocks. Counted per
        medium (a CPU offload tier is a pool of its own), the groups of a medium together (one
        pool serves them); with one medium, its peak over the stream."""
        if self.num_blocks is None or self._capacity_checked:
            return
        self._capacity_checked = True
        for pub in self.publishers.values():
            if pub.interleaved:
                continue
            by_medium: dict[Any, int] = {}
            for (medium, _group), cache in pub.caches.items():
                by_medium[medium] = by_medium.get(medium, 0) + sum(cache.copies.values())
            if len(by_medium) == 1:
                (only,) = by_medium
                by_medium[only] = max(by_medium[only], pub.peak_stored)
            for medium, n in by_medium.items():
                if n <= self.num_blocks:
                    continue
                where = "" if medium is None else f" (medium {medium})"
                self._report(
                    FindingKind.KV_EVENT_OVER_CAPACITY,
                    f"{n:,} block(s) stored at once{where} in a pool of {self.num_blocks:,}"
                    " (--num-blocks): the stream misses BlockRemoved events (an eviction or a"
                    " free the engine did not publish), or the engine restarted without"
                    " AllBlocksCleared and went on counting seq; an index built from it holds"
                    " hashes the engine no longer has",
                    pub,
                    None if pub.next_seq is None else pub.next_seq - 1,
                    pub.counts["batches"],
                    cache_key=(medium, None),
                )

    def report(self, source: str = "", truncated: bool = False) -> dict[str, Any]:
        """The object `events check --json` prints (docs/CLI.md)."""
        self._over_capacity()
        pubs = [p.to_dict() for p in self.publishers.values()]
        total = {k: sum(p[k] for p in pubs) for k in ("batches", "stored", "removed", "cleared")}
        summary: dict[str, Any] = {
            "records": self.num_records,
            "publishers": len(pubs),
            "events": self.num_events,
            **total,
            **{
                k: sum(p[k] for p in pubs)
                for k in (
                    "gaps",
                    "missing_batches",
                    "resets",
                    "reordered",
                    "replayed",
                    "unverifiable",
                )
            },
            "malformed": self.num_malformed,
            "truncated": truncated,
            "unread_bytes": self.unread_bytes,
            "num_blocks": self.num_blocks,
            "findings_by_kind": dict(sorted(self.finding_counts.items())),
        }
        return {
            "source": source,
            "healthy": not any(f.severity == ERROR for f in self.findings),
            "summary": summary,
            "publishers": pubs,
            "notes": self.notes,
            "findings": [f.to_dict() for f in self.findings],
        }


def check_file(path: str, num_blocks: int | None = None) -> dict[str, Any]:
    """The check of a recorded stream, as `events check --json` prints it (`num_blocks`: the
    engine's pool size, for `kv_event_over_capacity`)."""
    stream = StreamFile(path)
    # The checker makes no reference cycles: the cyclic collector would only rescan the
    # objects a long stream keeps (a tenth of the check's time).
    collecting = gc.isenabled()
    gc.disable()
    try:
        checker = StreamChecker(num_blocks=num_blocks)
        checker.feed_file(stream)
        return checker.report(source=path, truncated=stream.truncated)
    finally:
        if collecting:
            gc.enable()
        stream.close()
