"""`kvscope events record`: replays that do not stall the recording, endpoints checked up front.

The recorder is fed through its relay API (`Recorder.on_message`) or runs on a thread against a
ZMQ publisher of this test's own (an XPUB, so the subscription is awaited before anything is
sent) and a ROUTER standing in for the engine's replay socket, which answers only when the test
says so. Replay deadlines run on a clock of the test's own: no assertion depends on how long
anything takes (a wait has a bound, which only a failure reaches).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq

from kvscope.cli import main
from kvscope.events import recorder as recorder_module
from kvscope.events.checker import check_file
from kvscope.events.recorder import Recorder
from kvscope.events.streamfile import NOTE, PUBLISHED, REPLAYED, StreamFile
from kvscope.events.wire import END_SEQ
from tests.test_events_check import Stream

# A bound on waiting for a condition (a failure, never a pace).
BOUND_S = 30.0


def messages(n: int, base: int = 0) -> list[list[bytes]]:
    """Batches seq 0..n-1 of one publisher, each storing one block under the one before (block
    hashes base + 1, base + 2, ...)."""
    s = Stream(True, "int")
    for i in range(n):
        s.batch(s.stored([base + i + 1], parent=(base + i) if i else None))
    return s.messages


def contents(path: str) -> list[tuple[int, int | None]]:
    """(source, seq) of each record of a recorded file (seq None for a note)."""
    f = StreamFile(path)
    try:
        return [
            (src, None if src == NOTE else int.from_bytes(bytes(fr[-2]), "big"))
            for _, src, _, fr in f.records()
        ]
    finally:
        f.close()


def notes(path: str) -> list[dict]:
    f = StreamFile(path)
    try:
        return [json.loads(bytes(fr[0])) for _, src, _, fr in f.records() if src == NOTE]
    finally:
        f.close()


def until(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_unanswered_replay_holds_nothing_up_and_is_given_up_once(tmp_path, zmq_ctx):
    # GIVEN a replay socket that takes requests and answers none
    replay = f"ipc://{tmp_path}/replay"
    router = zmq_ctx.socket(zmq.ROUTER)
    router.bind(replay)
    clock = Clock()
    warned: list[str] = []
    path = str(tmp_path / "r.kvev")
    rec = Recorder(
        [f"ipc://{tmp_path}/pub"], path, replay=[replay], warn=warned.append, clock=clock
    )
    m = messages(8)
    try:
        # WHEN seq 1 is lost: seq 2 asks the replay socket for it
        rec.on_message(0, m[0], 1)
        rec.on_message(0, m[2], 2)
        # THEN the request went out (from seq 0, the last recorded: a restart's check), and the
        # recorder did not wait for its answer: it is still in flight (its 2 s have not passed
        # on the test's clock)
        assert router.poll(int(BOUND_S * 1000)), "no replay request arrived"
        _identity, empty, start = router.recv_multipart()
        assert (empty, int.from_bytes(start, "big")) == (b"", 0)
        assert rec.replays_in_flight == 1
        # AND the messages after it are taken meanwhile, waiting behind it (the file keeps
        # the endpoint's order)
        rec.on_message(0, m[3], 3)
        rec.on_message(0, m[4], 4)
        assert rec.waiting == 3 and rec.stats.messages == 1
        # WHEN its time passes unanswered
        clock.now = recorder_module.REPLAY_TIMEOUT_S + 1
        rec.on_message(0, m[5], 5)
        # THEN the replay socket is given up on, said once, and what waited is written
        assert rec.replays_in_flight == 0 and rec.waiting == 0
        assert len(warned) == 1 and replay in warned[0] and "did not answer" in warned[0]
        # AND a later gap asks nothing of it
        rec.on_message(0, m[7], 7)
        assert rec.replays_in_flight == 0 and len(warned) == 1
    finally:
        rec.close()
    # THEN the file holds every batch received, in order, the failed replay's note where it
    # ended, and the recorder's counts are the file's
    assert contents(path) == [
        (PUBLISHED, 0),
        (NOTE, None),
        (PUBLISHED, 2),
        (PUBLISHED, 3),
        (PUBLISHED, 4),
        (PUBLISHED, 5),
        (PUBLISHED, 7),
    ]
    (note,) = notes(path)
    assert note["replayed"] == 0 and "no answer within 2 s" in note["error"]
    st = rec.stats
    assert (st.messages, st.events, st.gaps, st.missing, st.unfilled, st.filled) == (
        6,
        6,
        2,
        2,
        2,
        0,
    )
    assert st.dead_replay == [replay]


def test_the_subscription_is_read_while_a_replay_is_in_flight(tmp_path, zmq_ctx):
    # GIVEN a publisher, a replay socket the test answers by hand, and a recorder running on
    # a thread (its replay deadline far off: only a failure reaches it)
    pub_ep, replay = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    pub = zmq_ctx.socket(zmq.XPUB)
    pub.bind(pub_ep)
    router = zmq_ctx.socket(zmq.ROUTER)
    router.bind(replay)
    path = str(tmp_path / "r.kvev")
    rec = Recorder([pub_ep], path, replay=[replay], replay_timeout_s=10 * BOUND_S)
    thread = threading.Thread(target=rec.run)
    thread.start()
    m = messages(5)
    try:
        assert pub.poll(int(BOUND_S * 1000)), "the recorder never subscribed"
        pub.recv()
        # WHEN seq 1 is lost on the way and the rest published
        for i in (0, 2, 3, 4):
            pub.send_multipart(m[i])
        assert router.poll(int(BOUND_S * 1000)), "no replay request arrived"
        identity, _, start = router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        # THEN while the request is unanswered the recorder still reads its subscription:
        # seq 2, 3 and 4 arrive and wait behind the replay
        until(lambda: rec.waiting == 3, "the batches after the gap were read")
        assert rec.replays_in_flight == 1
        # WHEN the replay socket answers as vLLM's (>= 0.26): from the batch asked for (the one
        # recorded, not written again), then the end marker
        router.send_multipart([identity, b"", *m[0]])
        router.send_multipart([identity, b"", *m[1]])
        router.send_multipart([identity, b"", b"", END_SEQ, b""])
        until(lambda: rec.replays_in_flight == 0 and rec.waiting == 0, "the replay ended")
    finally:
        rec.stop()
        thread.join(BOUND_S)
    assert not thread.is_alive()
    # THEN the replayed batch is written before the batch that revealed the gap, and the
    # recording checks clean
    assert contents(path) == [
        (PUBLISHED, 0),
        (REPLAYED, 1),
        (NOTE, None),
        (PUBLISHED, 2),
        (PUBLISHED, 3),
        (PUBLISHED, 4),
    ]
    report = check_file(path)
    assert report["healthy"] and report["findings"] == []
    assert report["summary"]["replayed"] == 1 and report["summary"]["gaps"] == 0
    assert (rec.stats.messages, rec.stats.filled, rec.stats.unfilled) == (5, 1, 0)


def test_a_restart_faster_than_the_reconnect_is_a_restart_not_a_gap(tmp_path, zmq_ctx, capsys):
    # GIVEN a recorder that has recorded seq 0..2 of a publisher, which then restarts and
    # publishes seq 0..5 of a new sequence before the subscriber is back (its first batches
    # missed: the next one the recorder sees is the new sequence's seq 6)
    replay = f"ipc://{tmp_path}/replay"
    router = zmq_ctx.socket(zmq.ROUTER)
    router.bind(replay)
    path = str(tmp_path / "r.kvev")
    rec = Recorder([f"ipc://{tmp_path}/pub"], path, replay=[replay], replay_timeout_s=BOUND_S)
    old, new = messages(3), messages(8, base=100)
    try:
        for i in range(3):
            rec.on_message(0, old[i], i)
        rec.on_message(0, new[6], 6)
        # WHEN the replay socket, asked from seq 2, answers with the new sequence's seq 2
        assert router.poll(int(BOUND_S * 1000)), "no replay request arrived"
        identity, _, start = router.recv_multipart()
        assert int.from_bytes(start, "big") == 2
        router.send_multipart([identity, b"", *new[2]])
        until(lambda: rec.service() or router.poll(0), "the request from the new sequence's start")
        # THEN it is a restart, and the new sequence is asked for from its start
        identity, _, start = router.recv_multipart()
        assert int.from_bytes(start, "big") == 0
        for i in range(6):
            router.send_multipart([identity, b"", *new[i]])
        router.send_multipart([identity, b"", b"", END_SEQ, b""])
        until(
            lambda: rec.service() or (rec.replays_in_flight == 0 and rec.waiting == 0),
            "the replay ended",
        )
    finally:
        rec.close()
    # AND the file holds the old sequence, then the new one from its start, replayed, then
    # what revealed it: no gap, one restart, and the check says so without an error
    assert contents(path) == [
        *[(PUBLISHED, i) for i in range(3)],
        (NOTE, None),
        *[(REPLAYED, i) for i in range(6)],
        (NOTE, None),
        (PUBLISHED, 6),
    ]
    assert [n["note"] for n in notes(path)] == ["restart", "replay"]
    st = rec.stats
    assert (st.gaps, st.missing, st.resets, st.filled, st.unfilled) == (0, 0, 1, 6, 0)
    report = check_file(path)
    assert report["summary"]["gaps"] == 0, report["summary"]
    assert [f["kind"] for f in report["findings"]] == ["kv_event_seq_reset"], report["findings"]
    capsys.readouterr()
    main(["events", "check", path])
    out = capsys.readouterr().out
    assert "the publisher restarted after seq 2 (the replay of a gap sent another batch 2)" in out


def test_two_publishers_on_one_rank_are_said_once_and_not_followed(tmp_path):
    # GIVEN two engines at rank 0 on one port: seq 0 0 1 1 2 2 ...
    warned: list[str] = []
    path = str(tmp_path / "r.kvev")
    rec = Recorder([f"ipc://{tmp_path}/pub"], path, warn=warned.append)
    a, b = messages(6), messages(6)
    try:
        for i in range(6):
            rec.on_message(0, a[i], 2 * i)
            rec.on_message(0, b[i], 2 * i + 1)
    finally:
        rec.close()
    # THEN the recorder says so once, and counts no gap and few restarts
    assert rec.stats.interleaved == 1 and rec.stats.messages == 12
    assert len(warned) == 1 and "interleave" in warned[0]
    assert rec.stats.gaps == 0 and rec.stats.resets <= 1


def test_the_last_line_counts_what_the_file_holds(tmp_path, capsys, monkeypatch):
    # GIVEN a recording (its messages fed through the relay API) with a gap and no replay
    m = messages(4)

    def run(self, seconds=None, live=None, live_every_s=0.5):
        for i in (0, 1, 3):
            self.on_message(0, m[i], i + 1)
        self.close()
        return self.stats

    monkeypatch.setattr(Recorder, "run", run)
    path = str(tmp_path / "r.kvev")
    # WHEN `events record` records it
    assert main(["events", "record", "ipc:///nonexistent-kvscope/pub", "-o", path]) == 0
    (line,) = capsys.readouterr().err.splitlines()
    # THEN its last line counts the batches in the file
    assert line.startswith("kvscope: recorded 3 batch(es) (0 replayed), 3 event(s)")
    assert "1 gap(s) of 1 batch(es), 1 not replayed" in line and path in line
    assert len([c for c in contents(path) if c[0] != NOTE]) == 3


def test_a_live_check_prints_no_line_about_its_temporary_file(tmp_path, capsys, monkeypatch):
    # GIVEN a live check whose recording gets three batches (fed through the relay API)
    m = messages(3)

    def run(self, seconds=None, live=None, live_every_s=0.5):
        for i, frames in enumerate(m):
            self.on_message(0, frames, i + 1)
        self.close()
        return self.stats

    monkeypatch.setattr(Recorder, "run", run)
    # WHEN checked
    assert main(["events", "check", "ipc:///nonexistent-kvscope/pub", "--seconds", "1"]) == 0
    out, err = capsys.readouterr()
    # THEN the check's text and nothing on stderr: no "wrote" of a file that is gone
    assert "health: HEALTHY" in out and "3 batch(es)" in out
    assert err == ""


@pytest.mark.parametrize(
    "args,needle",
    [
        (["tcp://127.0.0.1:99999"], "port 99999 is out of range"),
        (["tcp://127.0.0.1:5557", "--replay", "notanendpoint"], "--replay notanendpoint is not"),
        (["tcp://127.0.0.1:5557", "--replay", "tcp://127.0.0.1:0"], "port 0 is out of range"),
        (["tcp://127.0.0.1:5557", "--replay", "tcp://127.0.0.1"], "cannot use --replay"),
        (["tcp://127.0.0.1:5557", "--replay", "tcp://*:6557"], "the engine binds it"),
        (
            ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "--replay", "tcp://127.0.0.1:6557"],
            "2 endpoint(s) and 1 --replay endpoint(s)",
        ),
        (["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557"], "named twice"),
        (
            ["tcp://127.0.0.1:5557", "--replay", "tcp://127.0.0.1:5557"],
            "named twice",
        ),
    ],
)
@pytest.mark.parametrize("verb", ["record", "check"])
def test_an_unusable_endpoint_is_one_line_and_exit_2(tmp_path, capsys, args, needle, verb):
    # GIVEN an endpoint or replay endpoint no recording can use WHEN recorded or checked live
    out = ["-o", str(tmp_path / "x.kvev")] if verb == "record" else []
    rc = main(["events", verb, *args, *out, "--seconds", "5"])
    # THEN one line, exit 2, at once (nothing recorded)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("kvscope: error:"), err
    assert needle in err
    assert not (tmp_path / "x.kvev").exists()
