"""kvscope as a KV-event publisher: a pool's prefix index as vLLM's current wire format.

A small CPU pool publishes (kvscope/events/publisher.py) to a plain ZMQ SUB socket on an ipc://
endpoint; what arrives is decoded with wire.py, written as a recorded stream and checked with
`kvscope events check`. The subscriber's subscription is awaited through the publisher's XPUB
socket before anything is published, so no message is lost to a late join.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from kvscope.allocator import KVPool, PoolConfig, PoolError
from kvscope.allocator.checksums import block_checksums
from kvscope.allocator.config import KVEventsConfig
from kvscope.cli import main
from kvscope.errors import UsageError
from kvscope.events.publisher import KVEventPublisher, offset_endpoint
from kvscope.events.recorder import Recorder
from kvscope.events.streamfile import NOTE, PUBLISHED, StreamFile, StreamWriter
from kvscope.events.wire import (
    CLEARED,
    END_SEQ,
    REMOVED,
    STORED,
    as_tuple,
    decode_payload,
    split_message,
)

BS = 4
RECV_TIMEOUT_MS = 5000


class Subscriber:
    """A plain ZMQ SUB socket and the messages it received, in order."""

    def __init__(self, endpoint: str, rank: int = 0):
        self.rank = rank
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        self.sock.connect(endpoint)
        self.messages: list[list[bytes]] = []

    def take(self, n: int) -> list[tuple[int, list[tuple]]]:
        """The next n batches as (seq, events as wire.as_tuple)."""
        out = []
        for _ in range(n):
            frames = self.sock.recv_multipart()
            self.messages.append(frames)
            _topic, seq, payload = split_message(frames)
            _ts, rank, events = decode_payload(payload)
            assert rank == self.rank
            out.append((seq, [as_tuple(e) for e in events]))
        return out

    def nothing_pending(self) -> bool:
        return not self.sock.poll(0)

    def save(self, path: str, endpoint: str) -> str:
        w = StreamWriter(path, {"endpoints": [endpoint], "replay": [], "topic": ""})
        for i, frames in enumerate(self.messages):
            w.write(i + 1, PUBLISHED, 0, frames)
        w.close()
        return path

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def wired(make_pool, tmp_path):
    """(pool, publisher with its check, subscriber), subscribed before anything is published."""
    pool = make_pool(32, block_size=BS)
    endpoint = f"ipc://{tmp_path}/kv-events"
    pub = KVEventPublisher(pool, endpoint, check=True)
    sub = Subscriber(endpoint)
    assert pub.wait_subscriber(timeout_s=5.0), "the subscription never arrived"
    yield pool, pub, sub, endpoint
    sub.close()
    pub.close()


def test_publish_store_hit_and_evict_decode_and_check_clean(wired, tmp_path, capsys):
    pool, pub, sub, endpoint = wired
    b = pool.view.blocks
    # GIVEN a request of three full blocks and one partial, its prompt computed
    prompt = list(range(100, 114))
    a = pool.allocate("a", prompt)
    pool.mark_computed(a, len(prompt))
    # WHEN the publisher polls
    assert pub.poll() == 1
    # THEN one BlockStored names the three full blocks as one chain: their index keys, no
    # parent, their tokens, the block size
    [(seq, [ev])] = sub.take(1)
    full = a.block_table[:3]
    assert seq == 0
    kind, hashes, parent, tokens, bs, medium, _group, _spec = ev
    assert kind == STORED and parent is None and bs == BS and medium == "GPU"
    assert hashes == [int(b["prefix_hash"][x]) for x in full]
    assert tokens == prompt[:12]
    # the raw event is vLLM's current tagged map
    raw = msgpack.unpackb(sub.messages[0][2], raw=False)
    assert raw[1][0]["type"] == "BlockStored" and raw[2] == 0

    # GIVEN a second request sharing two blocks of the prefix, then a new block of its own
    c = pool.allocate("c", prompt[:8] + [7, 7, 7, 7, 9])
    assert c.block_table[:2] == a.block_table[:2]
    pool.mark_computed(c, 12)
    assert pub.poll() == 1
    [(seq, [ev])] = sub.take(1)
    # THEN only its new block is stored, its parent the shared second block's key
    assert seq == 1
    own = int(b["prefix_hash"][c.block_table[2]])
    assert ev[0] == STORED and ev[1] == [own]
    assert ev[2] == hashes[1] and ev[3] == [7, 7, 7, 7]
    # AND a poll with nothing new publishes nothing
    assert pub.poll() == 0

    # WHEN both finish and the pool evicts every cached block
    pool.free(a)
    pool.free(c)
    assert pool.evict(32) == 4
    assert pub.poll() == 1
    [(seq, [ev])] = sub.take(1)
    # THEN one BlockRemoved names the four published keys
    assert seq == 2 and ev[0] == REMOVED
    assert sorted(ev[1]) == sorted(hashes + [own])
    assert sub.nothing_pending()

    # AND the stream is clean, in process and through `kvscope events check`
    assert pub.verify() == []
    report = pub.report()
    assert report["healthy"] and report["findings"] == []
    assert report["publisher"]["stored"] == 4 and report["publisher"]["removed"] == 4
    path = sub.save(str(tmp_path / "pub.kvev"), endpoint)
    assert main(["events", "check", path]) == 0
    assert "kv_event" not in capsys.readouterr().out


def test_one_poll_of_branching_chains_stores_parents_first(wired, tmp_path):
    pool, pub, sub, endpoint = wired
    # GIVEN a prompt published, and two requests that branch off its first block, all computed
    # before the publisher looks: one batch holds all three chains
    base = pool.allocate("base", list(range(12)))
    pool.mark_computed(base, 12)
    x = pool.allocate("x", list(range(4)) + [50, 51, 52, 53, 54, 55, 56, 57])
    y = pool.allocate("y", list(range(4)) + [60, 61, 62, 63])
    pool.mark_computed(x, 12)
    pool.mark_computed(y, 8)
    # WHEN it polls
    pub.poll()
    [(_seq, events)] = sub.take(1)
    # THEN every block's parent is stored before it (or is no block: the prompt's start)
    stored: set[int] = set()
    for kind, hashes, parent, tokens, *_ in events:
        assert kind == STORED
        assert parent is None or parent in stored
        assert len(tokens) == BS * len(hashes)
        stored.update(hashes)
    assert len(stored) == 3 + 2 + 1
    assert pub.verify() == []
    assert main(["events", "check", sub.save(str(tmp_path / "b.kvev"), endpoint)]) == 0


def test_a_child_waits_while_its_parents_record_is_mid_change(wired, tmp_path):
    pool, pub, sub, endpoint = wired
    b = pool.view.blocks
    # GIVEN a prompt of three full blocks published, its first block's record mid-change when
    # the publisher looks (its checksum not yet sealed, as another process's write leaves it)
    a = pool.allocate("a", list(range(12)))
    pool.mark_computed(a, 12)
    first = a.block_table[0]
    sealed = int(b["checksum"][first])
    b["checksum"][first] = sealed ^ 1
    # WHEN it polls
    # THEN nothing is published: the first block waits for its seal, its children for it
    assert pub.poll() == 0
    assert pub.num_deferred == 3
    # WHEN the record is sealed again and it polls
    b["checksum"][first] = sealed
    assert pub.poll() == 1
    # THEN the chain is stored whole, parent first, and the stream is clean
    [(_seq, [ev])] = sub.take(1)
    assert ev[0] == STORED and ev[2] is None
    assert ev[1] == [int(b["prefix_hash"][x]) for x in a.block_table]
    assert pub.verify() == []
    assert main(["events", "check", sub.save(str(tmp_path / "w.kvev"), endpoint)]) == 0


def test_no_key_leaves_the_stream_while_a_record_is_mid_change(wired, tmp_path):
    pool, pub, sub, endpoint = wired
    b = pool.view.blocks
    # GIVEN a block announced, and a child of it indexed since (its chain's second block)
    a = pool.allocate("a", list(range(BS)))
    pool.mark_computed(a, BS)
    assert pub.poll() == 1
    s = pool.allocate("s", list(range(2 * BS)))
    pool.mark_computed(s, 2 * BS)
    parent, child = s.block_table
    # and, when the publisher looks, the child's record mid-change (another process's free
    # not yet sealed) while the parent is already evicted (another shard's LRU took it first)
    child_sum = int(b["checksum"][child])
    b["checksum"][child] = child_sum ^ 1
    b["indexed"][parent] = 0
    b["checksum"][parent] = block_checksums(b, np.array([parent]))[0]
    try:
        # WHEN it polls
        # THEN the parent's key stays in the stream: the child may yet be announced under it
        assert pub.poll() == 0
        # WHEN the child's record is sealed and it polls again
        b["checksum"][child] = child_sum
        assert pub.poll() == 2
        # THEN the child is stored under its parent, and only then is the parent removed
        [_first, (_seq, [stored, removed])] = sub.take(2)
        key = int(b["prefix_hash"][parent])
        assert stored[0] == STORED and stored[2] == key
        assert removed[0] == REMOVED and removed[1] == [key]
        assert main(["events", "check", sub.save(str(tmp_path / "m.kvev"), endpoint)]) == 0
    finally:
        b["indexed"][parent] = 1
        b["checksum"][parent] = block_checksums(b, np.array([parent]))[0]
    pub.poll()
    assert pub.verify() == []


def test_a_child_whose_parent_was_evicted_unannounced_is_not_announced(wired, tmp_path):
    pool, pub, sub, endpoint = wired
    b = pool.view.blocks
    # GIVEN a chain of two blocks published, its first block evicted before the publisher
    # looked (another process's LRU took it first), its second still indexed
    s = pool.allocate("s", list(range(2 * BS)))
    pool.mark_computed(s, 2 * BS)
    parent, child = s.block_table
    keys = pool.view.index["hash"]
    slot = int((keys == b["prefix_hash"][parent]).nonzero()[0][0])
    key = int(keys[slot])
    keys[slot] = 0
    b["indexed"][parent] = 0
    b["checksum"][parent] = block_checksums(b, np.array([parent]))[0]
    try:
        # WHEN it polls THEN nothing is published: the child is unreachable, and no subscriber
        # may see a child whose parent it never saw; the stream still agrees with the index
        assert pub.poll() == 0
        assert pub.verify() == []
        # WHEN the parent's key is indexed again THEN the chain is stored, parent first
    finally:
        keys[slot] = key
        b["indexed"][parent] = 1
        b["checksum"][parent] = block_checksums(b, np.array([parent]))[0]
    assert pub.poll() == 1
    [(_seq, [ev])] = sub.take(1)
    assert ev[0] == STORED and ev[2] is None and len(ev[1]) == 2
    assert pub.verify() == []
    assert main(["events", "check", sub.save(str(tmp_path / "o.kvev"), endpoint)]) == 0


def test_clear_then_republish_is_clean(wired, tmp_path):
    pool, pub, sub, endpoint = wired
    s = pool.allocate("s", list(range(8)))
    pool.mark_computed(s, 8)
    pub.poll()
    # WHEN the publisher announces AllBlocksCleared and polls again
    pub.clear()
    pub.poll()
    batches = sub.take(3)
    # THEN the index is stored again after the clear, and the stream is clean
    assert [ev[0] for _, evs in batches for ev in evs] == [STORED, CLEARED, STORED]
    assert batches[2][1][0][1] == batches[0][1][0][1]
    assert pub.verify() == []
    assert main(["events", "check", sub.save(str(tmp_path / "c.kvev"), endpoint)]) == 0


def test_index_mismatch_is_reported(wired):
    pool, pub, _sub, _endpoint = wired
    s = pool.allocate("s", list(range(8)))
    pool.mark_computed(s, 8)
    pub.poll()
    # GIVEN a key dropped from the pool's prefix index behind its block record's back (the
    # record still says indexed, so no removal is ever published)
    keys = pool.view.index["hash"]
    lost = int(pool.view.blocks["prefix_hash"][s.block_table[1]])
    slot = int((keys == lost).nonzero()[0][0])
    saved = (int(keys[slot]), int(pool.view.index["block"][slot]))
    keys[slot] = 0
    try:
        # WHEN the stream is compared with the index
        found = pub.verify()
    finally:
        keys[slot] = saved[0]
    # THEN the finding names the hash the stream holds that the index does not
    [f] = found
    assert f.kind == "kv_event_index_mismatch" and f.severity == "error"
    assert f.extra["stream_not_indexed"] == [str(lost)]
    assert f.extra["indexed_not_stream"] == []
    report = pub.report()
    assert not report["healthy"]
    assert report["summary"]["findings_by_kind"] == {"kv_event_index_mismatch": 1}


def test_unpublished_index_key_is_reported(wired):
    pool, pub, _sub, _endpoint = wired
    # GIVEN a block the publisher is told was already announced (a lost store)
    s = pool.allocate("s", list(range(8)))
    pool.mark_computed(s, 8)
    blk = s.block_table[0]
    pub._announced[blk] = pool.view.blocks["prefix_hash"][blk]
    # WHEN the rest is published and compared
    found = pub.verify()
    # THEN the index key that never reached the stream is named (its child's parent is
    # unknown to the stream as well)
    [f] = found
    assert f.extra["indexed_not_stream"] == [str(int(pool.view.blocks["prefix_hash"][blk]))]
    kinds = pub.report()["summary"]["findings_by_kind"]
    assert kinds == {"kv_event_index_mismatch": 1, "kv_event_unknown_parent": 1}


def test_thread_publishes_everything_by_close(make_pool, tmp_path):
    # GIVEN a publisher polling on its own thread
    pool = make_pool(32, block_size=BS)
    endpoint = f"ipc://{tmp_path}/kv-thread"
    pub = KVEventPublisher(pool, endpoint, check=True)
    sub = Subscriber(endpoint)
    try:
        assert pub.wait_subscriber(timeout_s=5.0)
        pub.start(interval_s=0.001)
        seqs = [pool.allocate(f"r{i}", [i] * 4 + list(range(8))) for i in range(4)]
        for s in seqs:
            pool.mark_computed(s, 12)
        # WHEN it is stopped (its last poll publishes what it had not seen yet)
        pub.stop()
        pub.poll()
        # THEN the stream holds exactly the pool's index, in however many batches
        assert pub.stored_hashes() == pub.index_keys()
        assert len(pub.index_keys()) == 12
        assert pub.verify() == []
        n = pub.stats()["batches"]
        got = sub.take(n)
        assert [seq for seq, _ in got] == list(range(n))
        assert main(["events", "check", sub.save(str(tmp_path / "t.kvev"), endpoint)]) == 0
    finally:
        sub.close()
        pub.close()


def _batches_on_disk(path) -> int:
    try:
        f = StreamFile(str(path))
    except UsageError:
        return 0  # its header is not on disk yet
    try:
        return sum(1 for r in f.records() if r[1] != NOTE)
    finally:
        f.close()


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _default_sigint() -> None:
    # as a terminal starts it, whatever this test run inherited (CI starts it ignored)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop, preexec",
    [
        (signal.SIGINT, _default_sigint),
        (signal.SIGTERM, _default_sigint),
        (signal.SIGTERM, _ignore_sigint),
    ],
    ids=["ctrl-c", "sigterm", "sigterm-in-a-background-job"],
)
def test_a_recording_stops_whole_on_ctrl_c_and_on_sigterm(make_pool, tmp_path, stop, preexec):
    # GIVEN `kvscope events record` on a pool's publisher, started as a terminal would start
    # it, or as a shell without job control starts a background job (SIGINT ignored, so
    # Ctrl-C cannot reach it and SIGTERM is how it is stopped)
    pool = make_pool(32, block_size=BS)
    endpoint = f"ipc://{tmp_path}/kv-rec"
    out = tmp_path / "rec.kvev"
    pub = KVEventPublisher(pool, endpoint)
    recorder = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "events", "record", endpoint, "-o", str(out)],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )
    try:
        # (a batch on disk says its loop runs, with its handlers set; a bound, not a pace:
        # a publisher drops what it sends before the subscription arrives)
        deadline = time.monotonic() + 60
        i = 0
        while _batches_on_disk(out) == 0 and time.monotonic() < deadline:
            seq = pool.allocate(f"r{i}", [i] * BS)
            pool.mark_computed(seq, BS)
            pool.free(seq)
            pub.poll()
            i += 1
            time.sleep(0.1)
        assert _batches_on_disk(out) > 0, "nothing recorded within 60 s"
        # WHEN it is sent the signal
        recorder.send_signal(stop)
        _, err = recorder.communicate(timeout=60)
        # THEN it closes the file whole and exits 0 with its last line
        assert recorder.returncode == 0, err
        assert "recorded" in err.splitlines()[-1], err
        assert _batches_on_disk(out) >= 1
    finally:
        if recorder.poll() is None:
            recorder.kill()
            recorder.communicate()
        pub.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags", [[], ["--workers", "2"], ["--ranks", "2"]], ids=["engine", "workers", "ranks"]
)
def test_serve_under_kvscope_run_publishes_and_checks(tmp_path, flags):
    # GIVEN the example server publishing its pool(s) under `kvscope run` (its check on)
    serve = Path(__file__).resolve().parents[1] / "examples" / "serve.py"
    endpoint = f"ipc://{tmp_path}/serve-events"
    cmd = [
        "kvscope", "run", str(serve), *flags, "--requests", "12",
        "--rate", "0", "--prompt-len", "20:40", "--output-len", "4:8", "--num-prefixes", "2",
        "--prefix-share", "0.8", "--num-blocks", "48", "--block-size", "4", "--no-progress",
        "--kv-events", endpoint, "--kv-events-replay", f"ipc://{tmp_path}/serve-replay",
        "--json",
    ]  # fmt: skip
    # WHEN it serves a workload that fills and evicts the cache
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    # THEN the run is clean, each pool's stream was checked, and it holds what the pool caches
    assert done.returncode == 0, done.stderr
    extra = json.loads(done.stdout)["extra"]
    # (with --ranks: one pool, publisher and check per rank, rank r on the endpoint's offset r)
    pools = extra["ranks"] if "--ranks" in flags else [extra]
    assert len(pools) == (2 if "--ranks" in flags else 1)
    for rank, one in enumerate(pools):
        events = one["kv_events"]
        assert events["rank"] == rank
        assert events["endpoint"] == (endpoint if rank == 0 else f"{endpoint}_dp{rank}")
        assert events["findings_by_kind"] == {}
        # (the workload evicts; a block published and evicted between two of the publisher's
        # polls is never announced, and on a loaded machine the polls may catch no eviction
        # at all: removals are at most the evictions)
        assert one["cache_stats"]["num_evictions"] > 0
        assert 0 <= events["removed"] <= one["cache_stats"]["num_evictions"]
        assert events["stored"] - events["removed"] == one["cache_stats"]["num_cached"]


def _all_stored(batches: list[tuple[int, list[tuple]]]) -> set[int]:
    """The hashes a stream leaves stored (one copy each here)."""
    held: set[int] = set()
    for _seq, events in batches:
        for ev in events:
            if ev[0] == STORED:
                held.update(ev[1])
            elif ev[0] == REMOVED:
                held.difference_update(ev[1])
            else:
                held.clear()
    return held


def test_pool_option_publishes_from_create_to_close(make_pool, tmp_path):
    # GIVEN a pool created with the kv_events option and a subscriber of its stream
    endpoint = f"ipc://{tmp_path}/kv-option"
    pool = make_pool(32, block_size=BS, kv_events=endpoint)
    pub = pool.kv_events
    assert isinstance(pub, KVEventPublisher) and pub.endpoint == endpoint
    sub = Subscriber(endpoint)
    try:
        assert pub.wait_subscriber(timeout_s=5.0)
        # WHEN requests publish blocks and one prompt's blocks are evicted, then the pool closes
        a = pool.allocate("a", list(range(12)))
        pool.mark_computed(a, 12)
        pool.free(a)
        assert pool.evict(32) == 3
        c = pool.allocate("c", list(range(50, 58)))
        pool.mark_computed(c, 8)
        kept = {int(pool.view.blocks["prefix_hash"][x]) for x in c.block_table}
        pool.close()
        # THEN the publisher stopped with the pool, after a last poll: the stream (however
        # many batches its thread made) leaves stored exactly what the pool kept indexed
        assert pool.kv_events is None and pub._closed
        n = pub.stats()["batches"]
        got = sub.take(n)
        assert [seq for seq, _ in got] == list(range(n))
        assert _all_stored(got) == kept
        assert main(["events", "check", sub.save(str(tmp_path / "o.kvev"), endpoint)]) == 0
    finally:
        sub.close()


@pytest.mark.parametrize(
    "endpoint, says",
    [
        ("5557", "must be a ZMQ endpoint"),
        ("http://localhost:5557", "must be a ZMQ endpoint"),
        ("tcp://*", "names no port"),
    ],
    ids=["port-only", "http", "no-port"],
)
def test_pool_option_bad_endpoint_is_one_pool_error(pool_name, endpoint, says):
    # WHEN a pool is created with an endpoint no publisher can use
    with pytest.raises(PoolError) as err:
        KVPool.create(pool_name, PoolConfig(num_blocks=8, block_size=BS, kv_events=endpoint))
    # THEN one line says what is wrong and what an endpoint looks like, and no pool is left
    assert says in str(err.value) and "\n" not in str(err.value)
    assert "PoolConfig.kv_events" in str(err.value)
    with pytest.raises(PoolError):
        KVPool.attach(pool_name)


def test_pool_option_address_in_use_leaves_no_pool(pool_name):
    # GIVEN a TCP port another socket holds
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    try:
        holder.bind("tcp://*:*")
        port = holder.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
        # WHEN a pool is created to publish on it
        config = PoolConfig(num_blocks=8, block_size=BS, kv_events=f"tcp://*:{port}")
        with pytest.raises(PoolError) as err:
            KVPool.create(pool_name, config)
    finally:
        ctx.destroy(linger=0)
    # THEN it fails with a PoolError naming the endpoint, and the pool's files are gone
    assert f"tcp://*:{port}" in str(err.value)
    with pytest.raises(PoolError):
        KVPool.attach(pool_name)


def test_pool_option_publishes_with_its_rank_and_answers_replay(make_pool, tmp_path):
    # GIVEN a pool whose kv_events option names a replay socket and data-parallel rank 1
    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/kv-replay"
    option = KVEventsConfig(endpoint, replay_endpoint=replay, rank=1, topic="kv")
    pool = make_pool(32, block_size=BS, kv_events=option)
    pub = pool.kv_events
    # THEN it publishes on rank 1's endpoints, offset as vLLM offsets them
    assert pub.endpoint == offset_endpoint(endpoint, 1) == f"{endpoint}_dp1"
    assert pub.replay_endpoint == f"{replay}_dp1"
    sub = Subscriber(pub.endpoint, rank=1)
    dealer = sub.ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    dealer.connect(pub.replay_endpoint)
    try:
        assert pub.wait_subscriber(timeout_s=5.0)
        # WHEN a prompt is stored, then evicted (each published by a poll made here, if its
        # thread did not publish it first), then a router asks the replay socket for everything
        a = pool.allocate("a", list(range(12)))
        pool.mark_computed(a, 12)
        pub.poll()
        pool.free(a)
        assert pool.evict(32) == 3
        pub.poll()
        n = pub.stats()["batches"]
        got = sub.take(n)  # (each batch's rank is 1: Subscriber.take asserts it)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = [dealer.recv_multipart() for _ in range(n + 1)]
    finally:
        dealer.close(linger=0)
        sub.close()
    # THEN every batch carries rank 1 and the topic, the stream stored and removed the prompt,
    # and the replay socket (served by the pool's publisher thread) resent every batch, then
    # the end marker
    assert [seq for seq, _ in got] == list(range(n))
    assert {m[0] for m in sub.messages} == {b"kv"}
    assert _all_stored(got) == set()
    assert sum(len(ev[1]) for _, evs in got for ev in evs if ev[0] == STORED) == 3
    assert replies[:n] == [[b""] + m for m in sub.messages]
    assert replies[n] == [b"", b"", END_SEQ, b""]
    pool.close()
    # (its thread, joined by close, counted the replay after sending the end marker)
    assert pub._closed and pub.stats()["replays"] == 1 and pub.stats()["rank"] == 1


@pytest.mark.parametrize(
    "option, says",
    [
        (KVEventsConfig("5557"), "PoolConfig.kv_events.endpoint must be a ZMQ endpoint"),
        (KVEventsConfig("tcp://*:5557", replay_endpoint="tcp://*"), "names no port"),
        (KVEventsConfig("tcp://*:5557", replay_endpoint="tcp://*:5557"), "must differ"),
        (KVEventsConfig("tcp://*:5557", rank=-1), "rank must be a data-parallel rank"),
    ],
    ids=["endpoint", "replay-no-port", "replay-same", "rank"],
)
def test_pool_option_bad_config_is_one_pool_error(pool_name, option, says):
    # WHEN a pool is created with a KVEventsConfig no publisher can use
    with pytest.raises(PoolError) as err:
        KVPool.create(pool_name, PoolConfig(num_blocks=8, block_size=BS, kv_events=option))
    # THEN one line says what is wrong, and no pool is left
    assert says in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(PoolError):
        KVPool.attach(pool_name)


def test_each_rank_publishes_on_its_offset_endpoint_and_checks_per_rank(
    make_pool, tmp_path, capsys
):
    # GIVEN two data-parallel ranks, each its own pool and publisher on one configured endpoint
    endpoint = f"ipc://{tmp_path}/kv-dp"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"
    pools = [make_pool(32, block_size=BS) for _ in range(2)]
    pubs = [KVEventPublisher(p, endpoint, rank=r, check=True) for r, p in enumerate(pools)]
    assert [p.endpoint for p in pubs] == [endpoint, f"{endpoint}_dp1"]
    subs = [Subscriber(p.endpoint, rank=r) for r, p in enumerate(pubs)]
    try:
        for pub in pubs:
            assert pub.wait_subscriber(timeout_s=5.0)
        # WHEN each rank caches its own prompt (the same tokens on both)
        for pool, pub in zip(pools, pubs, strict=True):
            s = pool.allocate("s", list(range(8)))
            pool.mark_computed(s, 8)
            pub.poll()
        # THEN each rank's batch arrives on its own endpoint with its rank (Subscriber asserts)
        got = [sub.take(1) for sub in subs]
        assert got[0][0][1] == got[1][0][1]
        for pub in pubs:
            assert pub.verify() == []
        # AND a recording of both is checked per publisher: one per rank, each clean
        path = str(tmp_path / "dp.kvev")
        w = StreamWriter(path, {"endpoints": [p.endpoint for p in pubs], "replay": [], "topic": ""})
        for i, sub in enumerate(subs):
            w.write(i + 1, PUBLISHED, i, sub.messages[0])
        w.close()
        assert main(["events", "check", path, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        ranks = sorted(p["rank"] for p in report["publishers"])
        assert ranks == [0, 1] and report["findings"] == []
    finally:
        for sub in subs:
            sub.close()
        for pub in pubs:
            pub.close()


def test_a_lost_batch_is_filled_from_the_replay_socket(make_pool, tmp_path, capsys):
    # GIVEN a publisher with a replay socket, and a plain subscriber of its stream
    pool = make_pool(32, block_size=BS)
    endpoint, replay = f"ipc://{tmp_path}/kv-pub", f"ipc://{tmp_path}/kv-replay"
    pub = KVEventPublisher(pool, endpoint, check=True, replay_endpoint=replay)
    sub = Subscriber(endpoint)
    recorders: list[Recorder] = []
    try:
        assert pub.wait_subscriber(timeout_s=5.0)
        # three batches: a prompt stored; a second prompt stored; the second one evicted
        a = pool.allocate("a", list(range(8)))
        pool.mark_computed(a, 8)
        assert pub.poll() == 1
        b = pool.allocate("b", list(range(40, 48)))
        pool.mark_computed(b, 8)
        assert pub.poll() == 1
        pool.free(b)
        assert pool.evict(2) == 2
        assert pub.poll() == 1
        sub.take(3)
        # the replay socket answers as vLLM's (>= 0.26): [topic, seq, payload] from the start
        # seq asked for, then the end marker
        dealer = sub.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        dealer.connect(replay)
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        # (poll answers the requests that arrived: poll until this one has)
        while not dealer.poll(10):
            pub.poll()
        replies = [dealer.recv_multipart() for _ in range(3)]
        assert replies[0] == [b""] + sub.messages[1]
        assert replies[1] == [b""] + sub.messages[2]
        assert replies[2] == [b"", b"", END_SEQ, b""]
        dealer.close(linger=0)
        # WHEN a recorder is relayed every batch but the second (lost on purpose), once with
        # the replay socket and once without; the publisher's thread answers replays
        pub.start(interval_s=0.001)
        paths = [str(tmp_path / "filled.kvev"), str(tmp_path / "lost.kvev")]
        for path, rep in zip(paths, [[replay], None], strict=True):
            rec = Recorder([endpoint], path, replay=rep)
            recorders.append(rec)
            for frames in (sub.messages[0], sub.messages[2]):
                rec.on_message(0, frames, 1)
            rec.close()
        pub.stop()
    finally:
        for rec in recorders:
            rec.close()
        sub.close()
        pub.close()
    # THEN with the replay socket the gap is filled and the recording checks clean
    filled, lost = (r.stats for r in recorders)
    assert (filled.gaps, filled.missing, filled.filled) == (1, 1, 1)
    assert pub.stats()["replays"] == 2
    assert main(["events", "check", paths[0]]) == 0
    capsys.readouterr()
    # AND without it the lost batch is a gap the check reports
    assert (lost.gaps, lost.filled) == (1, 0)
    assert main(["events", "check", paths[1], "--json"]) == 1
    kinds = json.loads(capsys.readouterr().out)["summary"]["findings_by_kind"]
    assert kinds == {"kv_event_gap": 1}


def test_a_block_published_and_evicted_between_two_polls_is_not_announced(wired):
    pool, pub, sub, _endpoint = wired
    # GIVEN a prompt published and announced
    a = pool.allocate("a", list(range(8)))
    pool.mark_computed(a, 8)
    assert pub.poll() == 1
    sub.take(1)
    # WHEN a second prompt is published and evicted before the next poll
    b = pool.allocate("b", list(range(40, 48)))
    pool.mark_computed(b, 8)
    pool.free(b)
    assert pool.evict(2) == 2
    # THEN the publisher, which samples the block records, announces neither its store nor
    # its removal (docs/EVENTS.md says what the core would have to record for it to), and
    # the stream still holds exactly what the pool's index holds
    assert pub.poll() == 0
    assert sub.nothing_pending()
    assert pub.stats()["stored"] == 2 and pub.stats()["removed"] == 0
    assert pub.verify() == []


def test_serve_refuses_an_endpoint_no_rank_can_publish_on(capsys):
    # WHEN the example server is given a KV-event endpoint with no port
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    from serve import main as serve_main

    code = serve_main(["--ranks", "2", "--kv-events", "tcp://*", "--no-progress"])
    # THEN it says so in one line and exits 2, before serving anything
    assert code == 2
    err = capsys.readouterr().err
    assert err == "serve.py: error: --kv-events 'tcp://*' names no port (tcp://*:5557)\n"


def test_a_block_published_again_while_a_poll_reads_it_is_announced_by_the_key_it_read(
    wired, monkeypatch
):
    import kvscope.events.publisher as publisher

    pool, pub, sub, _endpoint = wired
    # GIVEN a prompt published and not yet announced
    a = pool.allocate("a", list(range(4)))
    pool.mark_computed(a, 4)
    (blk,) = a.block_table
    pool.free(a)
    # WHEN, while the next poll reads the block records, another process (here: this one)
    # evicts the block and publishes another prompt into it
    checksums = publisher.record_checksums
    moved = []

    def read_then_move(rows, ids):
        got = checksums(rows, ids)
        if not moved:
            assert pool.evict(32) == 1
            held = [pool.allocate(f"b{i}", list(range(40, 44))) for i in range(32)]
            (b,) = [s for s in held if s.block_table == [blk]]
            pool.mark_computed(b, 4)
            moved.append(blk)
            for s in held:
                pool.free(s)
        return got

    monkeypatch.setattr(publisher, "record_checksums", read_then_move)
    assert pub.poll() == 1
    monkeypatch.undo()
    assert moved == [blk]
    # THEN the poll announced the key it read, with that key's tokens; the next announces the
    # move (the new key stored, the old one removed), and the stream holds what the index holds
    [(_seq, [stored])] = sub.take(1)
    assert stored[0] == STORED and stored[3] == list(range(4))
    assert pub.poll() == 2
    [(_seq, events)] = sub.take(1)
    assert [e[0] for e in events] == [STORED, REMOVED]
    assert events[0][3] == list(range(40, 44)) and events[1][1] == stored[1]
    assert pub.verify() == [] and pub.report()["findings"] == []
