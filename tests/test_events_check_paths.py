"""`kvscope events check`: the checker's fast path and its detailed checks give the same findings.

The checker applies a batch's events with the cache of the event before bound, and a
BlockStored goes hash by hash on a fast path until a check may fire, where the detailed path
takes over for the rest of the event (kvscope/events/checker.py). These tests plant what makes
the path change inside one event or one batch: a hash stored again after new ones, a duplicate
hash, two caches interleaved, a clear between events, a partial block retired and superseded
within a batch. The walk behind `timeline` and `report` feeds the checker one event at a time,
so its report must equal the checker's on any stream, which random streams check.
"""

from __future__ import annotations

import random

from kvscope.events.checker import StreamChecker
from kvscope.events.streamfile import PUBLISHED
from kvscope.events.walk import StreamWalk
from kvscope.events.wire import Encoder
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


def random_stream(rng: random.Random) -> list[tuple[int, int, int, list[bytes]]]:
    """A short stream of random batches, faults of every kind likely among them."""
    enc = Encoder(maps=rng.random() < 0.5)
    records = []
    seqs = [0, 0]
    names = list(range(1, rng.randrange(4, 24)))
    for i in range(rng.randrange(1, 30)):
        rank = rng.randrange(2)
        events = []
        for _ in range(rng.randrange(8)):
            medium, group = rng.choice(["GPU", "GPU", "CPU"]), rng.choice([0, 0, 1])
            r = rng.random()
            if r < 0.5:
                hashes = [rng.choice(names) for _ in range(rng.randrange(4))]
                bs = rng.choice([16, 16, 8])
                parent = rng.choice([None, None, *names[:6]])
                toks = [rng.randrange(2) * 1000 + h * 10 + j for h in hashes for j in range(bs)]
                if rng.random() < 0.1:
                    toks = toks[:-1]
                events.append(enc.stored(hashes, parent, toks, bs, medium, group))
            elif r < 0.93:
                hashes = [rng.choice(names) for _ in range(rng.randrange(3))]
                events.append(enc.removed(hashes, medium, group))
            else:
                events.append(enc.cleared())
        seq = seqs[rank] + (rng.random() < 0.05) - 2 * (rng.random() < 0.05)
        seq = 0 if seq < 0 or rng.random() < 0.03 else seq
        seqs[rank] = seq + 1
        payload = enc.payload(events, rank=rank, ts=i - 50 * (rng.random() < 0.03))
        records.append((i, PUBLISHED, 0, enc.message(seq, payload)))
    return records


def test_the_walk_one_event_at_a_time_agrees_with_the_checker_on_random_streams():
    # GIVEN random streams full of faults
    found: set[str] = set()
    for n in range(150):
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
