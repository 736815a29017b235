"""`kvscope events check`: the checker's fast path and its detailed checks give the same findings.

The checker applies a batch's events with the cache of the event before bound, and a
BlockStored goes hash by hash on a fast path until a check may fire, where the detailed path
takes over for the rest of the event (kvscope/events/checker.py). These tests plant what makes
the path change inside one event or one batch: a hash stored again after new ones, a duplicate
hash, two caches interleaved, a clear between events, a partial block retired and superseded
within a batch. The walk behind `timeline` and `report` feeds the checker one event at a time,
so its report must equal the checker's on any stream, which random streams check.

Where kvscope._kvevents is built, the checker reads each payload and applies the events no
check fires on in C, up to the first event where one may (kvscope/csrc/kvevents.c); random
streams of both encodings and both hash kinds, full of planted faults and of values the C
reader leaves to msgspec, give the same report and the same caches with it and without it.
"""

from __future__ import annotations

import hashlib
import random
import struct
from typing import Any

import msgpack
import pytest

from kvscope.events import checker as checker_module
from kvscope.events.checker import StreamChecker
from kvscope.events.streamfile import NOTE, PUBLISHED, REPLAYED, StreamFile, StreamWriter
from kvscope.events.walk import StreamWalk
from kvscope.events.wire import Encoder, WireError, decode_payload, tokens
from tests.test_events_check import BS, Stream, check


def kinds(report: dict) -> list[str]:
    return [f["kind"] for f in report["findings"]]


def test_a_hash_stored_again_after_new_ones_in_one_event(tmp_path):
    # GIVEN a chain 1, 2, 3 stored, then one event storing 4 (new), 2 (again, other tokens), 5
    s = Stream(True, "int")
    s.batch(s.stored([1, 2, 3]))
    toks = s.tokens(4) + s.tokens(9) + s.tokens(5)
    s.batch(s.stored([4, 2, 5], parent=3, tokens=toks))
    # WHEN checked
    _, report = check(s.write(tmp_path / "s.kvev"))
    # THEN one conflict on 2, naming the event of its first copy; every hash counted
    (f,) = report["findings"]
    assert f["kind"] == "kv_event_store_conflict" and f["extra"]["hash"] == str(s.h(2))
    assert [(e["batch"], e["what"]) for e in f["events"]] == [(0, "stored"), (1, "stored again")]
    assert "parent" in f["message"]
    assert report["publishers"][0]["blocks_stored"] == 6


def test_a_block_stored_again_is_compared_with_its_own_place_in_its_first_event(tmp_path):
    # GIVEN a chain 1, 2, 3 stored in one event, then 2, 3 re-reported under 1 with the same
    # tokens, then 3 again under 2 with another block's tokens
    s = Stream(True, "int")
    s.batch(s.stored([1, 2, 3]))
    s.batch(s.stored([2, 3], parent=1))
    s.batch(s.stored([3], parent=2, tokens=s.tokens(2)))
    # WHEN checked THEN only the last is a conflict: block 3's tokens are its own, not block 2's
    _, report = check(s.write(tmp_path / "s.kvev"))
    (f,) = report["findings"]
    assert f["kind"] == "kv_event_store_conflict" and f["extra"]["hash"] == str(s.h(3))
    assert "other token ids" in f["message"] and f["extra"]["batch"] == 2


def test_a_hash_twice_in_one_event_is_two_copies(tmp_path):
    # GIVEN one BlockStored naming a hash twice, then three removals of it
    s = Stream(True, "int")
    s.batch(s.stored([1, 1]))
    s.batch(s.removed([1]), s.removed([1]))
    clean = s.write(tmp_path / "clean.kvev")
    s.batch(s.removed([1]))
    # WHEN checked THEN two copies are removed cleanly, the third removal is reported
    _, report = check(clean)
    assert report["findings"] == [] and report["publishers"][0]["peak_blocks_stored"] == 2
    _, report = check(s.write(tmp_path / "s.kvev"))
    assert kinds(report) == ["kv_event_remove_unstored"]
    assert "removed again" in report["findings"][0]["message"]


def test_two_caches_interleaved_in_one_batch(tmp_path):
    # GIVEN one batch whose events alternate between the GPU and the CPU medium
    s = Stream(True, "int")
    e = s.enc
    s.batch(
        e.stored([s.h(1)], None, s.tokens(1), BS, medium="GPU", group=0),
        e.stored([s.h(1)], None, s.tokens(1), BS, medium="CPU", group=0),
        e.stored([s.h(2)], s.h(1), s.tokens(2), BS, medium="GPU", group=0),
        e.removed([s.h(1)], medium="CPU", group=0),
        # its parent was stored on the CPU and removed there: unknown on the CPU
        e.stored([s.h(3)], s.h(1), s.tokens(3), BS, medium="CPU", group=0),
        e.removed([s.h(2)], medium="GPU", group=0),
    )
    # WHEN checked
    _, report = check(s.write(tmp_path / "s.kvev"))
    # THEN each medium kept its own multiset: one unknown parent, on the CPU
    (f,) = report["findings"]
    assert f["kind"] == "kv_event_unknown_parent" and f["extra"]["medium"] == "CPU"
    assert "its last copy was removed before" in f["message"]
    assert report["publishers"][0]["blocks_stored"] == 2


def test_a_clear_between_events_of_one_batch(tmp_path):
    # GIVEN 1, 2, 3 stored; then in one batch: 3 removed, a clear, 1 stored again, 2
    # removed, 1 removed twice
    s = Stream(True, "int")
    s.batch(s.stored([1, 2, 3]))
    s.batch(
        s.removed([3]),
        s.enc.cleared(),
        s.stored([1]),
        s.removed([2]),
        s.removed([1]),
        s.removed([1]),
    )
    # WHEN checked
    _, report = check(s.write(tmp_path / "s.kvev"))
    # THEN the removal of 2 refers to a block from before the clear; 1, stored since, was
    # removed once too often
    after, again = report["findings"]
    assert after["kind"] == "kv_event_after_clear" and after["extra"]["hash"] == str(s.h(2))
    assert [e["type"] for e in after["events"]] == ["AllBlocksCleared", "BlockRemoved"]
    assert again["kind"] == "kv_event_remove_unstored" and again["extra"]["hash"] == str(s.h(1))
    assert report["publishers"][0]["blocks_stored"] == 0


def test_a_partial_block_superseded_within_one_batch(tmp_path):
    # GIVEN in one batch: X, its partial block P (8 of 16 tokens), P removed, the full block
    # F under X beginning with P's tokens, and P stored again
    s = Stream(False, "bytes")
    full = s.tokens(3)
    s.batch(
        s.stored([1]),
        s.stored([2], parent=1, bs=8, tokens=full[:8]),
        s.removed([2]),
        s.stored([3], parent=1, tokens=full),
        s.stored([2], parent=1, bs=8, tokens=full[:8]),
    )
    # WHEN checked THEN P's reappearance is reported with the three events that led to it
    _, report = check(s.write(tmp_path / "s.kvev"))
    (f,) = report["findings"]
    assert f["kind"] == "kv_event_partial_reappeared" and f["extra"]["hash"] == s.h(2).hex()
    assert [e["what"] for e in f["events"]] == [
        "partial block retired",
        "full block superseding it",
        "partial hash stored again",
    ]


def random_stream(
    rng: random.Random, hashes: str = "int"
) -> list[tuple[int, int, int, list[bytes]]]:
    """A short stream of random batches, faults of every kind likely among them."""
    enc = Encoder(maps=rng.random() < 0.5)
    records = []
    seqs = [0, 0]
    names: list[Any] = list(range(1, rng.randrange(4, 24)))
    if hashes == "bytes":
        names = [hashlib.sha256(str(n).encode()).digest() for n in names]
    elif hashes == "signed":
        # SGLang's: the first 64 bits, signed
        names = [
            struct.unpack(">q", hashlib.sha256(str(n).encode()).digest()[:8])[0] for n in names
        ]
    for i in range(rng.randrange(1, 30)):
        rank = rng.randrange(2)
        events = []
        for _ in range(rng.randrange(8)):
            medium, group = rng.choice(["GPU", "GPU", "CPU"]), rng.choice([0, 0, 1])
            r = rng.random()
            if r < 0.5:
                hs = [rng.choice(names) for _ in range(rng.randrange(4))]
                bs = rng.choice([16, 16, 8])
                parent = rng.choice([None, None, *names[:6]])
                # a block's tokens depend on its parent and its place: a partial block (8)
                # begins like the full block (16) at the same place, and is superseded by it
                bases = [rng.randrange(2) * 1000 for _ in hs]
                toks = [b + j for b in bases for j in range(bs)]
                if rng.random() < 0.1:
                    toks = toks[:-1]
                events.append(enc.stored(hs, parent, toks, bs, medium, group))
            elif r < 0.93:
                hs = [rng.choice(names) for _ in range(rng.randrange(3))]
                events.append(enc.removed(hs, medium, group))
            else:
                events.append(enc.cleared())
        if rng.random() < 0.1:
            # a partial block retired, superseded by its full block, and stored again
            medium, group = rng.choice(["GPU", "CPU"]), rng.choice([0, 1])
            x, p, f = rng.sample(names, 3)
            events += [
                enc.stored([x], None, list(range(16)), 16, medium, group),
                enc.stored([p], x, list(range(8)), 8, medium, group),
                enc.removed([p], medium, group),
                enc.stored([f], x, list(range(16)), 16, medium, group),
                enc.stored([p], x, list(range(8)), 8, medium, group),
            ]
        seq = seqs[rank] + (rng.random() < 0.05) - 2 * (rng.random() < 0.05)
        seq = 0 if seq < 0 or rng.random() < 0.03 else seq
        seqs[rank] = seq + 1
        payload = enc.payload(events, rank=rank, ts=i - 50 * (rng.random() < 0.03))
        records.append((i, PUBLISHED, 0, enc.message(seq, payload)))
        if rng.random() < 0.05:
            # delivered twice: not applied again
            records.append((i, PUBLISHED, 0, enc.message(seq, payload)))
    return records


def some_streams(fast: int, full: int) -> pytest.MarkDecorator:
    """A random test's number of streams: `fast` in the fast layer, all `full` in the slow one
    (what it counts over them scales with the number)."""
    return pytest.mark.parametrize("n_streams", [fast, pytest.param(full, marks=pytest.mark.slow)])


@pytest.mark.slow
@some_streams(50, 150)
def test_the_walk_one_event_at_a_time_agrees_with_the_checker_on_random_streams(n_streams):
    # GIVEN random streams full of faults
    found: set[str] = set()
    for n in range(n_streams):
        records = random_stream(random.Random(n))
        # WHEN the checker applies them a batch at a time and the walk an event at a time
        checker, walk = StreamChecker(["e"]), StreamWalk(["e"])
        checker.feed_all(records)
        walk.feed_all(records)
        # THEN their reports are equal: findings, their events, the accounting
        assert checker.report() == walk.report(), f"stream {n}"
        found.update(checker.finding_counts)
    assert found >= {
        "kv_event_remove_unstored",
        "kv_event_store_conflict",
        "kv_event_unknown_parent",
        "kv_event_after_clear",
        "kv_event_token_count",
        "kv_event_gap",
        "kv_event_seq_reset",
    }


# Values the C reader leaves to msgspec (the batch goes the checker's Python way), or must read
# as msgspec does: each replaces one event's field, or is added to an event or a batch.
ODD_VALUES: list[Any] = [
    None,
    1.5,
    True,
    "GPU",
    "gp\u00fc",
    b"\x01",
    [1, 2],
    {"a": 1},
    msgpack.ExtType(5, b"ab"),
    2**64 - 1,
    -(2**63),
    7,
]


def odd_stream(rng: random.Random) -> list[tuple[int, int, int, list[bytes]]]:
    """A random stream whose events carry odd values: other types where the checker reads a
    field, unknown fields, trailing items, events that are no KV event, payloads cut short."""
    records = random_stream(rng, rng.choice(["int", "bytes", "signed"]))
    out = []
    for recv_ns, source, endpoint, (topic, seq, payload) in records:
        batch = msgpack.unpackb(payload, strict_map_key=False)
        for ev in batch[1]:
            if rng.random() < 0.15:
                value = rng.choice(ODD_VALUES)
                if type(ev) is dict:
                    key = rng.choice(
                        ["medium", "group_idx", "block_size", "parent_block_hash", "lora_id", "x"]
                    )
                    ev[key] = value
                elif len(ev) > 2:
                    i = rng.randrange(2, len(ev) + 1)
                    if i < len(ev):
                        ev[i] = value
                    else:
                        ev.append(value)
        if rng.random() < 0.05:
            batch.append(rng.choice(ODD_VALUES))
        if rng.random() < 0.03:
            batch[1].append(rng.choice([["BlockGone", [1]], {"type": "BlockStored"}, 5]))
        data = msgpack.packb(batch, use_bin_type=True)
        if rng.random() < 0.03:
            data = data[: rng.randrange(len(data))]
        r = rng.random()
        if r < 0.05:
            # a replay reply of vLLM <= 0.25: no topic frame
            out.append((recv_ns, REPLAYED, endpoint, [seq, data]))
        elif r < 0.1:
            out.append((recv_ns, REPLAYED, endpoint, [topic, seq, data]))
        elif r < 0.13:
            out.append((recv_ns, NOTE, endpoint, [b'{"note": "replay", "filled": 1}']))
        elif r < 0.15:
            out.append((recv_ns, source, 1, [b"other", seq, data]))
        elif r < 0.17:
            out.append((recv_ns, source, endpoint, [topic, seq[:7], data]))
        else:
            out.append((recv_ns, source, endpoint, [topic, seq, data]))
    return out


def write(path: Any, records: list, cut: int | None = None) -> str:
    """The records as a recorded-stream file (cut short to `cut` bytes past its header)."""
    w = StreamWriter(str(path), {"endpoints": ["e", "f"], "topic": ""})
    start = w._f.tell()
    for recv_ns, source, endpoint, frames in records:
        w.write(recv_ns, source, endpoint, frames)
    w.close()
    if cut is not None:
        with open(path, "r+b") as f:
            f.truncate(start + cut)
    return str(path)


def check_path(path: str, native: Any) -> tuple[dict, dict]:
    """The report of a recorded stream read by `feed_file`, and the caches it left."""
    stream = StreamFile(path)
    try:
        checker = StreamChecker()
        checker.native = native
        checker.feed_file(stream)
        return checker.report(source=path, truncated=stream.truncated), caches(checker)
    finally:
        stream.close()


def caches(checker: StreamChecker) -> dict:
    """Every cache's state, in a form that compares: copies in their order, the rest by key."""
    out = {}
    for key, pub in checker.publishers.items():
        for ck, c in pub.caches.items():
            stored = {
                h: (info[0], info[1], tokens(info[2]), list(info[3]), info[4], info[5])
                for h, info in c.stored.items()
            }
            out[key, ck] = (
                list(c.copies.items()),
                stored,
                c.removed_at.as_dict(),
                c.cleared,
                c.full_size,
                c.retired,
                c.superseded,
            )
    return out


class CountingNative:
    """The C fast path, counting the events it applied and the batches it left in part."""

    def __init__(self, native: Any):
        self.native = native
        self.applied = 0
        self.left = 0
        self.declined = 0

    def scan(self, payload: bytes) -> Any:
        head = self.native.scan(payload)
        self.declined += head is None
        self._num = None if head is None else head[2]
        return head

    def apply(self, *args: Any) -> Any:
        out = self.native.apply(*args)
        self.applied += out[0]
        self.left += out[0] < self._num
        return out

    def feed_records(self, checker: StreamChecker, *args: Any) -> Any:
        before = checker.num_events
        out = self.native.feed_records(checker, *args)
        self.applied += checker.num_events - before
        return out


native_only = pytest.mark.skipif(
    checker_module._kvevents is None, reason="kvscope._kvevents is not built (no C compiler)"
)


def check_both_ways(records, native, what: str) -> StreamChecker:
    """Check records with the C fast path (`native`) and without it; assert the two leave the
    same report and the same caches; the checker that used the fast path."""
    fast = StreamChecker(["e"])
    fast.native = native
    slow = StreamChecker(["e"])
    slow.native = None
    fast.feed_all(records)
    slow.feed_all(records)
    assert fast.report() == slow.report(), what
    assert caches(fast) == caches(slow), what
    return fast


@native_only
@some_streams(40, 100)
@pytest.mark.parametrize("hashes", ["int", "bytes", "signed"])
def test_the_c_fast_path_agrees_with_the_python_checker_on_random_streams(hashes, n_streams):
    # GIVEN random streams full of faults, in both encodings (random_stream picks one)
    counting = CountingNative(checker_module._kvevents)
    found: set[str] = set()
    for n in range(n_streams):
        records = random_stream(random.Random(n), hashes)
        # WHEN checked with the C fast path and without it (the walk, event by event, agrees
        # with the latter: the test above), THEN the reports and caches are equal
        fast = check_both_ways(records, counting, f"stream {n}")
        found.update(fast.finding_counts)
    # and the C path did apply events, and left batches to the checker where a check fired
    assert counting.applied > 2 * n_streams and counting.left > n_streams // 2, vars(counting)
    assert found >= {
        "kv_event_remove_unstored",
        "kv_event_store_conflict",
        "kv_event_unknown_parent",
        "kv_event_after_clear",
        "kv_event_token_count",
        "kv_event_gap",
        "kv_event_seq_reset",
        "kv_event_reorder",
        "kv_event_partial_reappeared",
    }, sorted(found)


@pytest.mark.slow
@native_only
@some_streams(70, 200)
def test_the_c_fast_path_agrees_on_odd_values_and_malformed_payloads(n_streams):
    # GIVEN random streams whose events carry values of other types, unknown fields, trailing
    # items, events that are none, payloads cut short
    counting = CountingNative(checker_module._kvevents)
    for n in range(n_streams):
        records = odd_stream(random.Random(n))
        # WHEN checked with the C fast path and without it THEN the same report (malformed
        # batches among the findings), the same caches
        check_both_ways(records, counting, f"stream {n}")
    half = n_streams // 2
    assert counting.declined > half and counting.applied > half, vars(counting)


@native_only
def test_the_c_reader_takes_only_payloads_msgspec_reads_the_same():
    # GIVEN payloads of random events, then the same with bytes flipped, cut or appended
    native = checker_module._kvevents
    rng = random.Random(7)
    payloads = [r[3][-1] for n in range(60) for r in odd_stream(random.Random(n)) if r[1] != NOTE]
    taken = 0
    for n in range(3000):
        data = bytearray(rng.choice(payloads))
        for _ in range(rng.randrange(3)):
            if data and rng.random() < 0.7:
                data[rng.randrange(len(data))] = rng.randrange(256)
            else:
                data += bytes([rng.randrange(256)])
        data = bytes(data)
        # WHEN the C reader scans one
        head = native.scan(data)
        if head is None:
            continue
        taken += 1
        # THEN msgspec reads it too, to the same timestamp, rank and number of events
        try:
            ts, rank, events = decode_payload(data)
        except WireError as e:
            raise AssertionError(f"payload {n}: scan took what msgspec rejects: {e}") from None
        assert (ts, rank, len(events)) == (head[0], head[1], head[2]) or (
            ts != ts and head[0] != head[0]
        ), f"payload {n}"
    assert taken > 500


@native_only
@some_streams(50, 150)
def test_the_c_record_reader_agrees_on_recorded_files(tmp_path, n_streams):
    # GIVEN recorded-stream files of random streams (published, replayed with and without a
    # topic, notes, a second endpoint, odd values, malformed payloads), some cut short
    counting = CountingNative(checker_module._kvevents)
    rng = random.Random(11)
    truncated = 0
    for n in range(n_streams):
        records = odd_stream(random.Random(n)) if n % 2 else random_stream(random.Random(n))
        size = sum(12 + sum(4 + len(f) for f in r[3]) for r in records)
        cut = rng.randrange(size) if rng.random() < 0.2 else None
        path = write(tmp_path / f"{n}.kvev", records, cut)
        # WHEN it is checked with the compiled record reader and with the Python one
        fast, fast_caches = check_path(path, counting)
        slow, slow_caches = check_path(path, None)
        # THEN the reports (truncation included) and the caches are the same
        assert fast == slow, f"stream {n}"
        assert fast_caches == slow_caches, f"stream {n}"
        truncated += slow["summary"]["truncated"]
    # (a cut file in about one in five; events applied by the C reader, about 40 a stream)
    assert 15 * truncated > n_streams and 3 * counting.applied > 20 * n_streams, (
        truncated,
        vars(counting),
    )
