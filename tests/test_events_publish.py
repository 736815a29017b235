"""kvscope as a KV-event publisher: a pool's prefix index as vLLM's current wire format.

A small CPU pool publishes (kvscope/events/publisher.py) to a plain ZMQ SUB socket on an ipc://
endpoint; what arrives is decoded with wire.py, written as a recorded stream and checked with
`kvscope events check`. The subscriber's subscription is awaited through the publisher's XPUB
socket before anything is published, so no message is lost to a late join.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import msgpack
import pytest
import zmq

from kvscope.cli import main
from kvscope.events.publisher import KVEventPublisher
from kvscope.events.streamfile import PUBLISHED, StreamWriter
from kvscope.events.wire import CLEARED, REMOVED, STORED, as_tuple, decode_payload, split_message

BS = 4
RECV_TIMEOUT_MS = 5000


class Subscriber:
    """A plain ZMQ SUB socket and the messages it received, in order."""

    def __init__(self, endpoint: str):
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
            assert rank == 0
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


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2], ids=["engine", "workers"])
def test_serve_under_kvscope_run_publishes_and_checks(tmp_path, workers):
    # GIVEN the example server publishing its pool under `kvscope run` (its check on)
    serve = Path(__file__).resolve().parents[1] / "examples" / "serve.py"
    cmd = [
        "kvscope", "run", str(serve), "--workers", str(workers), "--requests", "12",
        "--rate", "0", "--prompt-len", "20:40", "--output-len", "4:8", "--num-prefixes", "2",
        "--prefix-share", "0.8", "--num-blocks", "48", "--block-size", "4", "--no-progress",
        "--kv-events", f"ipc://{tmp_path}/serve-events", "--json",
    ]  # fmt: skip
    # WHEN it serves a workload that fills and evicts the cache
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    # THEN the run is clean, the stream was checked, and it holds what the pool caches
    assert done.returncode == 0, done.stderr
    extra = json.loads(done.stdout)["extra"]
    events = extra["kv_events"]
    assert events["findings_by_kind"] == {}
    # (a block published and evicted between two polls is never announced: removals are at
    # most the evictions)
    assert 0 < events["removed"] <= extra["cache_stats"]["num_evictions"]
    assert events["stored"] - events["removed"] == extra["cache_stats"]["num_cached"]
