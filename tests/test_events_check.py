"""`kvscope events check`: clean streams pass, each planted fault is exactly its finding.

Streams are built with kvscope's own encoder (kvscope/events/wire.py) in both encodings (tagged
maps, vLLM >= 0.24; positional arrays, vLLM <= 0.23) and both hash kinds (64-bit ints, 32-byte
digests), written as recorded-stream files, and checked through `main([...])`.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from kvscope.cli import main
from kvscope.events.checker import check_file
from kvscope.events.streamfile import PUBLISHED, StreamFile, StreamWriter
from kvscope.events.wire import Encoder, as_tuple, decode_payload, split_message

BS = 16
ENCODINGS = [
    pytest.param(True, "int", id="maps-int"),
    pytest.param(True, "bytes", id="maps-bytes"),
    pytest.param(False, "int", id="arrays-int"),
    pytest.param(False, "bytes", id="arrays-bytes"),
]


class Stream:
    """A stream under construction: batches of events, each a published message."""

    def __init__(self, maps: bool, hashes: str):
        self.enc = Encoder(maps=maps)
        self.kind = hashes
        self.messages: list[list[bytes]] = []
        self.seq = 0
        self.ts = 1000.0

    def h(self, n: int):
        """Block hash number n, as the stream's hash kind."""
        if self.kind == "bytes":
            return hashlib.sha256(str(n).encode()).digest()
        return (n * 0x9E3779B97F4A7C15) % 2**64

    def tokens(self, n: int, count: int = BS) -> list[int]:
        return [n * 100 + i for i in range(count)]

    def stored(self, ns: list[int], parent: int | None = None, bs: int = BS, tokens=None):
        toks = tokens if tokens is not None else sum((self.tokens(n, bs) for n in ns), [])
        p = None if parent is None else self.h(parent)
        return self.enc.stored([self.h(n) for n in ns], p, toks, bs, group=0)

    def removed(self, ns: list[int]):
        return self.enc.removed([self.h(n) for n in ns], group=0)

    def batch(self, *events, seq: int | None = None, ts: float | None = None) -> None:
        self.seq = self.seq if seq is None else seq
        self.ts = self.ts + 1 if ts is None else ts
        payload = self.enc.payload(list(events), rank=0, ts=self.ts)
        self.messages.append(self.enc.message(self.seq, payload))
        self.seq += 1

    def write(self, path) -> str:
        w = StreamWriter(str(path), {"endpoints": ["tcp://127.0.0.1:5557"], "topic": ""})
        for i, m in enumerate(self.messages):
            w.write(10**18 + i, PUBLISHED, 0, m)
        w.close()
        return str(path)


def legit(s: Stream) -> None:
    """Everything a checker must not flag: copies stored and removed once each, a prefix hit
    re-reported without its parent ("full" mode), a clear, and stores after it."""
    s.batch(s.stored([1, 2, 3]))
    s.batch(s.stored([4], parent=3))
    # a second request computed the same prompt: a second physical copy of each block
    s.batch(s.stored([1, 2, 3]))
    # "full" report mode: a prefix hit on 1, 2 re-emitted with no parent
    s.batch(s.stored([1, 2]))
    s.batch(s.removed([4]), s.removed([3]), s.removed([3]))
    s.batch(s.stored([5], parent=2))
    s.batch(s.enc.cleared())
    s.batch(s.stored([1, 2]), s.stored([6], parent=2))
    s.batch(s.removed([6]), s.removed([2]), s.removed([1]))


def check(path) -> tuple[int, dict]:
    return main(["events", "check", str(path)]), check_file(str(path))


@pytest.mark.parametrize("maps,hashes", ENCODINGS)
def test_a_clean_stream_has_no_finding(tmp_path, maps, hashes, capsys):
    # GIVEN a stream with every legitimate oddity, in one encoding
    s = Stream(maps, hashes)
    legit(s)
    # WHEN it is checked
    rc, report = check(s.write(tmp_path / "s.kvev"))
    # THEN it is healthy, no finding, and the accounting adds up
    assert rc == 0
    assert report["findings"] == []
    pub = report["publishers"][0]
    assert (pub["first_seq"], pub["last_seq"], pub["batches"]) == (0, 8, 9)
    assert pub["complete"] and pub["gaps"] == pub["resets"] == 0
    # 1,2 twice + re-emit + 5 left before the clear; nothing after the last removals
    assert pub["blocks_stored"] == 0 and pub["peak_blocks_stored"] == 9
    assert "health: HEALTHY" in capsys.readouterr().out


def fault_cases():
    """(id, builder, kind, exit code): each plants one fault after a clean prefix."""

    def remove_unstored(s):
        s.batch(s.stored([1]))
        s.batch(s.removed([9]))

    def removed_twice(s):
        s.batch(s.stored([1]), s.stored([2], parent=1))
        s.batch(s.removed([2]), s.removed([2]))

    def conflict(s):
        s.batch(s.stored([1]))
        s.batch(s.stored([1], tokens=s.tokens(7)))

    def unknown_parent(s):
        s.batch(s.stored([1]))
        s.batch(s.stored([2], parent=8))

    def after_clear_remove(s):
        s.batch(s.stored([1]))
        s.batch(s.enc.cleared())
        s.batch(s.removed([1]))

    def after_clear_parent(s):
        s.batch(s.stored([1]))
        s.batch(s.enc.cleared())
        s.batch(s.stored([2], parent=1))

    def token_count(s):
        s.batch(s.stored([1, 2], tokens=s.tokens(1, 20)))

    def partial_reappeared(s):
        # a full block X, then the partial block P after it (8 of 16 tokens) promoted to the
        # full block F: P removed, F stored under X with P's tokens first; then P again
        s.batch(s.stored([1]))
        full = s.tokens(3)
        s.batch(s.stored([2], parent=1, bs=8, tokens=full[:8]))
        s.batch(s.removed([2]), s.stored([3], parent=1, tokens=full))
        s.batch(s.stored([2], parent=1, bs=8, tokens=full[:8]))

    def lost_batch(s):
        s.batch(s.stored([1]))
        s.batch(s.stored([2], parent=1))  # lost below
        s.batch(s.removed([2]), s.stored([3], parent=2))
        del s.messages[-2]

    def restarted(s):
        s.batch(s.stored([1]))
        s.batch(s.stored([2], parent=1))
        s.batch(s.stored([1]), seq=0)
        s.batch(s.removed([1]))

    def reordered(s):
        s.batch(s.stored([1]))
        s.batch(s.stored([2], parent=1))
        s.batch(s.stored([3], parent=2))
        s.messages[-2], s.messages[-1] = s.messages[-1], s.messages[-2]

    return [
        pytest.param(remove_unstored, "kv_event_remove_unstored", 1, id="remove-unstored"),
        pytest.param(removed_twice, "kv_event_remove_unstored", 1, id="removed-twice"),
        pytest.param(conflict, "kv_event_store_conflict", 1, id="store-conflict"),
        pytest.param(unknown_parent, "kv_event_unknown_parent", 1, id="unknown-parent"),
        pytest.param(after_clear_remove, "kv_event_after_clear", 1, id="after-clear-remove"),
        pytest.param(after_clear_parent, "kv_event_after_clear", 1, id="after-clear-parent"),
        pytest.param(token_count, "kv_event_token_count", 1, id="token-count"),
        pytest.param(partial_reappeared, "kv_event_partial_reappeared", 1, id="partial-again"),
        pytest.param(lost_batch, "kv_event_gap", 1, id="lost-batch"),
        pytest.param(restarted, "kv_event_seq_reset", 0, id="restarted-publisher"),
        # seq 9, 10, 12, 11: 11 is missing when 12 arrives, then arrives late
        pytest.param(reordered, ["kv_event_gap", "kv_event_reorder"], 1, id="reordered"),
    ]


@pytest.mark.parametrize("maps,hashes", ENCODINGS)
@pytest.mark.parametrize("plant,kind,code", fault_cases())
def test_each_planted_fault_is_exactly_its_finding(tmp_path, maps, hashes, plant, kind, code):
    # GIVEN a clean stream followed by one planted fault
    s = Stream(maps, hashes)
    legit(s)
    plant(s)
    # WHEN it is checked
    rc, report = check(s.write(tmp_path / "s.kvev"))
    # THEN exactly that finding, naming the batch, seq and publisher, with the exit code
    assert [f["kind"] for f in report["findings"]] == (kind if isinstance(kind, list) else [kind])
    f = report["findings"][0]
    assert f["extra"]["publisher"] == "tcp://127.0.0.1:5557 rank 0"
    assert f["extra"]["batch"] >= 9 and f["extra"]["seq"] is not None
    assert rc == code


def test_a_finding_names_the_hash_and_the_events_that_led_to_it(tmp_path):
    # GIVEN a hash removed once more than it was stored
    s = Stream(True, "int")
    s.batch(s.stored([1]), s.stored([2], parent=1))
    s.batch(s.removed([2]))
    s.batch(s.removed([2]))
    # WHEN checked
    _, report = check(s.write(tmp_path / "s.kvev"))
    # THEN the finding names the hash and both removals, batch and seq
    (f,) = report["findings"]
    assert f["extra"]["hash"] == str(s.h(2))
    assert [(e["batch"], e["seq"], e["type"]) for e in f["events"]] == [
        (1, 1, "BlockRemoved"),
        (2, 2, "BlockRemoved"),
    ]


def test_after_a_lost_batch_its_blocks_are_not_reported(tmp_path):
    # GIVEN a stream whose batch storing block 2 was lost, then 2 is removed
    s = Stream(True, "int")
    s.batch(s.stored([1]))
    s.batch(s.stored([2], parent=1))
    s.batch(s.removed([2]))
    del s.messages[1]
    # WHEN checked
    _, report = check(s.write(tmp_path / "s.kvev"))
    # THEN the gap is reported, the removal only counted as unverifiable
    assert [f["kind"] for f in report["findings"]] == ["kv_event_gap"]
    assert report["summary"]["unverifiable"] == 1
    assert not report["publishers"][0]["complete"]


def test_a_recording_that_joined_late_reports_no_unknown_block(tmp_path):
    # GIVEN a stream recorded from seq 5 on, removing blocks stored before
    s = Stream(False, "int")
    s.batch(s.removed([1]), s.stored([3], parent=2), seq=5)
    # WHEN checked THEN no finding: what it could not verify is counted
    rc, report = check(s.write(tmp_path / "s.kvev"))
    assert rc == 0 and report["findings"] == []
    assert report["summary"]["unverifiable"] == 2


def test_ranks_are_separate_publishers(tmp_path):
    # GIVEN two ranks interleaved on one endpoint, each with its own seq from 0
    s = Stream(True, "int")
    for seq in range(3):
        for rank in (0, 1):
            payload = s.enc.payload([s.stored([10 * rank + seq])], rank=rank, ts=seq)
            s.messages.append(s.enc.message(seq, payload))
    # WHEN checked THEN two publishers, three batches each, no gap
    rc, report = check(s.write(tmp_path / "s.kvev"))
    assert rc == 0 and report["findings"] == []
    assert [(p["rank"], p["batches"], p["blocks_stored"]) for p in report["publishers"]] == [
        (0, 3, 3),
        (1, 3, 3),
    ]


def test_json_output_and_a_truncated_file(tmp_path, capsys):
    # GIVEN a clean stream file cut inside its last record
    s = Stream(True, "int")
    legit(s)
    path = s.write(tmp_path / "s.kvev")
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 3)
    # WHEN checked with --json
    rc = main(["events", "check", path, "--json"])
    out = json.loads(capsys.readouterr().out)
    # THEN the object has its keys, the truncation is said, the records before it checked
    assert rc == 0 and out["schema"] == 1 and out["healthy"] is True
    assert out["summary"]["truncated"] is True and out["summary"]["batches"] == 8


def test_a_malformed_message_is_a_finding(tmp_path):
    # GIVEN a message whose payload is not msgpack, and one with an unknown event tag
    s = Stream(True, "int")
    s.batch(s.stored([1]))
    s.messages.append([b"", (1).to_bytes(8, "big"), b"\xc1not msgpack"])
    s.messages.append([b"", (2).to_bytes(8, "big"), s.enc.payload([{"type": "BlockMoved"}])])
    # WHEN checked THEN two malformed findings, exit 1
    rc, report = check(s.write(tmp_path / "s.kvev"))
    assert [f["kind"] for f in report["findings"]] == ["kv_event_malformed"] * 2
    assert rc == 1


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["events", "check", "/nonexistent.kvev"], "no such file"),
        (["events", "check"], "the following arguments are required"),
        (["events", "record", "tcp://127.0.0.1:1", "-o", "/nonexistent-dir/x"], "cannot write"),
        (["events", "record", "nonsense://x", "-o", "x"], "cannot subscribe"),
        (["events", "record", "tcp://127.0.0.1:1", "-o", "x", "--seconds", "0"], "positive"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, needle, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and err.startswith("kvscope: error:")


def test_a_file_that_is_not_a_stream_is_exit_2(tmp_path, capsys):
    p = tmp_path / "x.kvev"
    p.write_bytes(b"hello world, not a stream")
    assert main(["events", "check", str(p)]) == 2
    assert "not a recorded event stream" in capsys.readouterr().err


def test_decoding_both_encodings_gives_the_same_events():
    # GIVEN one batch in maps and in arrays
    out = []
    for maps in (True, False):
        s = Stream(maps, "int")
        s.batch(s.stored([1, 2]), s.removed([1]), s.enc.cleared())
        topic, seq, payload = split_message(s.messages[0])
        ts, rank, events = decode_payload(payload)
        out.append((ts, rank, [as_tuple(e) for e in events]))
    # THEN the decoded batches are equal
    assert out[0] == out[1]
    assert [e[0] for e in out[0][2]] == [0, 1, 2]
    assert out[0][2][0][3] == s.tokens(1) + s.tokens(2)


def test_the_file_keeps_every_frame(tmp_path):
    s = Stream(True, "bytes")
    legit(s)
    path = s.write(tmp_path / "s.kvev")
    f = StreamFile(path)
    assert [frames for _, _, _, frames in f.records()] == s.messages
    f.close()
