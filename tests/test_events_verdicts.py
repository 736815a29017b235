"""`kvscope events check`: what it says of a stream that is not simply clean or faulty.

Nothing received (exit 2, one line), two publishers interleaved on one rank (one finding, not a
flood of restarts), a file corrupt in its middle against one cut short, the recorder's replay
notes in the text output, and the wording of sequence findings. Streams are built with kvscope's
own encoder (tests/test_events_check.py's `Stream`) and checked through `main([...])`, with the
C record reader and without it where both read the file.
"""

from __future__ import annotations

import json
import struct

import pytest

from kvscope.cli import main
from kvscope.events import checker as checker_module
from kvscope.events.checker import StreamChecker, check_file
from kvscope.events.streamfile import PUBLISHED, StreamFile, StreamWriter
from kvscope.events.walk import walk_file
from tests.test_events_check import Stream, legit

EP = "tcp://127.0.0.1:5557"


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("kvscope: error: ")
    return lines[0]


def both_ways(path: str) -> dict:
    """The report of a file read by the C record reader (where built) and by the Python one,
    which must agree; and the walk behind timeline and report must agree with them."""
    reports = []
    for native in {checker_module._kvevents, None}:
        stream = StreamFile(path)
        try:
            checker = StreamChecker()
            checker.native = native
            checker.feed_file(stream)
            reports.append(checker.report(source=path, truncated=stream.truncated))
        finally:
            stream.close()
    assert all(r == reports[0] for r in reports)
    assert walk_file(path).report == reports[0]
    return reports[0]


def kinds(report: dict) -> dict[str, int]:
    return report["summary"]["findings_by_kind"]


# --- nothing received ----------------------------------------------------------------------


def test_a_file_with_no_batch_is_exit_2_naming_where_it_was_recorded(tmp_path, capsys):
    # GIVEN a recording of an endpoint nothing published on: a header only
    path = str(tmp_path / "empty.kvev")
    StreamWriter(path, {"endpoints": [EP], "replay": [], "topic": "kv"}).close()
    # WHEN checked, as text or JSON THEN one line naming the endpoint and topic, exit 2
    for extra in ([], ["--json"]):
        assert main(["events", "check", path, *extra]) == 2
        line = one_line_error(capsys)
        assert "holds no KV-event batch" in line and EP in line and "'kv'" in line


def test_a_file_of_notes_only_is_exit_2(tmp_path, capsys):
    # GIVEN a recording whose only record is the recorder's note of a failed replay
    path = str(tmp_path / "notes.kvev")
    w = StreamWriter(path, {"endpoints": [EP], "replay": ["tcp://127.0.0.1:6557"], "topic": ""})
    w.note(0, {"note": "replay", "first": 0, "stop": 3, "replayed": 0, "error": "no answer"})
    w.close()
    assert main(["events", "check", path]) == 2
    assert "holds no KV-event batch" in one_line_error(capsys)


def test_a_file_cut_inside_its_first_record_is_exit_2(tmp_path, capsys):
    s = Stream(True, "int")
    legit(s)
    path = s.write(tmp_path / "s.kvev")
    with open(path, "r+b") as f:
        f.truncate(first_record(path) + 20)
    assert main(["events", "check", path]) == 2
    assert "ends inside its first record" in one_line_error(capsys)


def test_a_live_check_that_receives_nothing_is_exit_2(tmp_path, capsys):
    # GIVEN an endpoint nobody publishes on WHEN checked live (a short recording: what it
    # receives is nothing, however long it ran)
    ep = f"ipc://{tmp_path}/nobody"
    assert main(["events", "check", ep, "--topic", "kv", "--seconds", "0.05"]) == 2
    # THEN one line naming the endpoint and topic, no line about a temporary file
    line = one_line_error(capsys)
    assert "no KV-event batch from" in line and ep in line and "'kv'" in line
    assert "wrote" not in line


@pytest.mark.parametrize(
    "flag", [["--seconds", "3"], ["--replay", "tcp://h:6557"], ["--topic", "x"]]
)
def test_live_flags_on_a_file_are_refused(tmp_path, capsys, flag):
    s = Stream(True, "int")
    legit(s)
    path = s.write(tmp_path / "s.kvev")
    assert main(["events", "check", path, *flag]) == 2
    assert "for live endpoints" in one_line_error(capsys)


# --- two publishers on one rank --------------------------------------------------------------


def interleaved(a_from: int, b_from: int, n: int, skew: float = 0.0) -> Stream:
    """Two engines at rank 0 on one endpoint, each with its own seq from `a_from`, `b_from`:
    their batches alternate, each engine's timestamps `skew` apart from the other's."""
    s = Stream(True, "int")
    a, b = Stream(True, "int"), Stream(True, "int")
    for i in range(n):
        a.batch(a.stored([1000 + i], parent=1000 + i - 1 if i else None), seq=a_from + i, ts=i)
        b.batch(
            b.stored([2000 + i], parent=2000 + i - 1 if i else None), seq=b_from + i, ts=i + skew
        )
    for ma, mb in zip(a.messages, b.messages, strict=True):
        s.messages += [ma, mb]
    return s


@pytest.mark.parametrize(
    "a_from,b_from,skew",
    [
        pytest.param(0, 0, 0.5, id="both-from-0"),
        pytest.param(100, 0, 0.5, id="one-restarted"),
        pytest.param(100, 40, -0.5, id="other-clock-behind"),
        pytest.param(40, 100, 0.5, id="other-ahead"),
    ],
)
def test_two_publishers_on_one_rank_are_one_finding(tmp_path, capsys, a_from, b_from, skew):
    # GIVEN two engines' batches interleaved on one (endpoint, topic, rank)
    s = interleaved(a_from, b_from, 60, skew)
    path = s.write(tmp_path / "s.kvev")
    # WHEN checked
    report = both_ways(path)
    rc = main(["events", "check", path])
    out = capsys.readouterr().out
    # THEN one error says so, in place of restarts, reorders and gaps, exit 1
    assert kinds(report) == {"kv_event_interleaved": 1}, kinds(report)
    (f,) = report["findings"]
    assert f["severity"] == "error" and "two publishers share" in f["message"]
    (pub,) = report["publishers"]
    assert pub["interleaved"] and pub["batches"] == 120 and pub["events"] == 120
    assert pub["gaps"] == pub["resets"] == pub["reordered"] == 0
    assert rc == 1 and "two publishers interleaved" in out


def test_a_restart_and_a_late_batch_are_not_two_publishers(tmp_path):
    # GIVEN a publisher that restarts once, and later delivers a batch late and one twice
    s = Stream(True, "int")
    for i in range(30):
        s.batch(s.stored([i + 1]))
    s.batch(s.stored([500]), seq=0)
    for i in range(10):
        s.batch(s.stored([600 + i]))
    s.messages[-3], s.messages[-2] = s.messages[-2], s.messages[-3]
    s.messages.append(s.messages[-1])
    # WHEN checked THEN a restart, a gap, the late batch and the repeated one: no interleaving
    report = both_ways(s.write(tmp_path / "s.kvev"))
    assert kinds(report) == {
        "kv_event_seq_reset": 1,
        "kv_event_gap": 1,
        "kv_event_reorder": 2,
    }, kinds(report)


# --- corrupt, or cut short -------------------------------------------------------------------


def first_record(path: str) -> int:
    """The offset of a file's first record (past its header)."""
    stream = StreamFile(path)
    try:
        return stream.mapping()[1]
    finally:
        stream.close()


def records_at(path: str) -> list[int]:
    """The offset of each record of a whole file."""
    with open(path, "rb") as f:
        buf = f.read()
    pos = first_record(path)
    out = []
    while pos < len(buf):
        out.append(pos)
        nframes = struct.unpack_from("<H", buf, pos + 10)[0]
        pos += 12
        for _ in range(nframes):
            pos += 4 + struct.unpack_from("<I", buf, pos)[0]
    return out


def test_corruption_in_the_middle_is_malformed_not_a_cut(tmp_path, capsys):
    # GIVEN a whole file, one record in its middle with a frame length that runs past the end
    s = Stream(True, "int")
    for i in range(40):
        s.batch(s.stored([i + 1], parent=i or None))
    path = s.write(tmp_path / "s.kvev")
    at, after = records_at(path)[20:22]
    with open(path, "r+b") as f:
        f.seek(at + 12)
        f.write(struct.pack("<I", 0x7FFFFFFF))
    # WHEN checked
    report = both_ways(path)
    rc = main(["events", "check", path])
    out = capsys.readouterr().out
    # THEN not a cut: the bytes of that record skipped and named, every record after read
    s_ = report["summary"]
    assert not s_["truncated"] and s_["batches"] == 39
    assert s_["unread_bytes"] == after - at
    assert kinds(report) == {"kv_event_malformed": 1, "kv_event_gap": 1}, kinds(report)
    bad = next(f for f in report["findings"] if f["kind"] == "kv_event_malformed")
    assert f"from byte {at:,}" in bad["message"] and "corrupt" in bad["message"]
    assert rc == 1 and "cut short" not in out.split("error:")[0]


def test_garbage_at_the_end_is_corrupt_and_a_cut_is_a_cut(tmp_path):
    s = Stream(True, "int")
    legit(s)
    whole = s.write(tmp_path / "whole.kvev")
    with open(whole, "rb") as f:
        data = f.read()
    # GIVEN the file with bytes no recorder writes after it, and the file cut inside its last
    # record
    garbage = tmp_path / "garbage.kvev"
    garbage.write_bytes(data + b"\xff" * 40)
    cut = tmp_path / "cut.kvev"
    cut.write_bytes(data[:-5])
    # WHEN checked THEN the garbage is corrupt (a finding), the cut a cut (none), each naming
    # the bytes unread
    g = both_ways(str(garbage))
    assert not g["summary"]["truncated"] and g["summary"]["unread_bytes"] == 40
    assert kinds(g) == {"kv_event_malformed": 1} and g["summary"]["batches"] == 9
    c = both_ways(str(cut))
    assert c["summary"]["truncated"] and kinds(c) == {}
    assert c["summary"]["unread_bytes"] == len(data) - records_at(whole)[-1] - 5
    assert c["summary"]["batches"] == 8


def test_a_negative_rank_is_malformed(tmp_path):
    # GIVEN a batch whose data-parallel rank is -1 (a garbled payload)
    s = Stream(True, "int")
    s.batch(s.stored([1]))
    s.messages.append(s.enc.message(1, s.enc.payload([s.stored([2], parent=1)], rank=-1)))
    s.batch(s.stored([3], parent=1), seq=2)
    # WHEN checked THEN it is malformed, not a publisher of its own
    report = both_ways(s.write(tmp_path / "s.kvev"))
    assert kinds(report) == {"kv_event_malformed": 1, "kv_event_gap": 1}
    assert [p["rank"] for p in report["publishers"]] == [0]
    assert "rank is -1" in report["findings"][0]["message"]


# --- what the text output says -----------------------------------------------------------------


def test_replay_notes_are_in_the_text_output(tmp_path, capsys):
    # GIVEN a recording whose recorder noted one replay that worked and one that failed
    s = Stream(True, "int")
    legit(s)
    path = str(tmp_path / "s.kvev")
    w = StreamWriter(path, {"endpoints": [EP], "replay": ["tcp://127.0.0.1:6557"], "topic": ""})
    for i, m in enumerate(s.messages):
        w.write(i, PUBLISHED, 0, m)
    replay = {"note": "replay", "replay": "tcp://127.0.0.1:6557"}
    w.note(0, {**replay, "first": 3, "stop": 4, "replayed": 1})
    w.note(0, {**replay, "first": 7, "stop": 9, "replayed": 0, "error": "no answer within 2 s"})
    w.close()
    # WHEN checked as text THEN the replays are summed up and the failure named
    assert main(["events", "check", path]) == 0
    out = capsys.readouterr().out
    assert (
        f"replays for {EP} from tcp://127.0.0.1:6557: 2 request(s), 1 batch(es) replayed,"
        " 1 failed" in out
    )
    assert "seq 7..8 asked: no answer within 2 s" in out
    # AND --json carries them with their endpoint
    assert main(["events", "check", path, "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert [n["endpoint"] for n in notes] == [EP, EP]


def test_sequence_findings_say_what_happened(tmp_path):
    # GIVEN seq 0 then seq 0 again with a later timestamp; a batch delivered twice with the
    # same timestamp; seq 5 and 6..8 lost
    s = Stream(True, "int")
    s.batch(s.stored([1]), seq=0, ts=1)
    s.batch(s.stored([1]), seq=0, ts=2)
    s.batch(s.stored([2], parent=1), seq=1, ts=3)
    s.batch(s.stored([3], parent=2), seq=2, ts=4)
    s.messages.append(s.messages[-1])
    s.batch(s.stored([4]), seq=3, ts=5)
    s.batch(s.stored([5]), seq=4, ts=6)
    s.batch(s.stored([6]), seq=6, ts=7)
    s.batch(s.stored([7]), seq=10, ts=8)
    report = check_file(s.write(tmp_path / "s.kvev"))
    msgs = [f["message"] for f in report["findings"]]
    # THEN a restart says the seq repeated, the duplicate its equal timestamp, a gap its seqs
    assert "seq 0 repeated with a later timestamp: the publisher restarted" in msgs[0]
    assert "seq 2 repeated, with the same timestamp (delivered twice; not applied)" in msgs[1]
    assert "seq 5 lost: seq jumped from 4 to 6" in msgs[2]
    assert "seq 7..9 (3 batches) lost: seq jumped from 6 to 10" in msgs[3]
    (pub,) = report["publishers"]
    assert pub["incomplete_because"] == "4 batch(es) lost (seq 5, 7..9)"


def test_top_events_without_a_terminal_names_events_check(tmp_path, capsys):
    # GIVEN a recorded stream, and stdin and stdout that are not terminals (pytest's capture)
    s = Stream(True, "int")
    legit(s)
    path = s.write(tmp_path / "s.kvev")
    # WHEN top --events would draw THEN one line naming the text command for a stream
    assert main(["top", "--events", path]) == 2
    line = one_line_error(capsys)
    assert "top --events draws in a terminal" in line
    assert "kvscope events check FILE" in line and "analyze" not in line


# --- the engine's pool size ----------------------------------------------------------------


def test_more_blocks_stored_than_the_pool_holds_is_over_capacity(tmp_path, capsys):
    # GIVEN a stream that stores 6 blocks and removes 2 (a fork that evicts without publishing
    # BlockRemoved), from an engine whose pool holds 3
    s = Stream(False, "int")
    s.batch(s.stored([1, 2, 3]))
    s.batch(s.removed([3]), s.removed([2]))
    s.batch(s.stored([4, 5, 6]))
    path = s.write(tmp_path / "s.kvev")
    # WHEN checked with the pool's size
    rc = main(["events", "check", path, "--num-blocks", "3"])
    out = capsys.readouterr().out
    # THEN one kv_event_over_capacity naming the peak and the pool, exit 1
    assert rc == 1
    assert "kv_event_over_capacity" in out
    assert "4 block(s) stored at once (medium GPU) in a pool of 3" in out
    report = check_file(path, num_blocks=3)
    assert kinds(report) == {"kv_event_over_capacity": 1}
    assert report["summary"]["num_blocks"] == 3
    # AND with a pool big enough, or no size given, the same stream is healthy
    assert check_file(path, num_blocks=4)["healthy"]
    assert check_file(path)["healthy"]


def test_a_pool_size_that_is_not_a_number_of_blocks_is_one_line(tmp_path, capsys):
    s = Stream(False, "int")
    s.batch(s.stored([1]))
    path = s.write(tmp_path / "s.kvev")
    for bad in ("0", "-3", "many"):
        assert main(["events", "check", path, "--num-blocks", bad]) == 2
        assert "--num-blocks" in one_line_error(capsys)
