"""kvscope as a KV-event publisher: a pool's prefix index as vLLM's current KV-event stream.

A router that speaks vLLM's protocol (NVIDIA Dynamo, llm-d, `kvscope events record`) can index
a kvscope-backed engine: `KVEventPublisher` reads the pool's segment and publishes, in vLLM's
current wire format (docs/EVENTS.md: three frames `[topic, seq, payload]`, tagged-map events,
int hashes), a `BlockStored` for every block that entered the prefix index (its index key as
the block hash, its parent's key, its tokens from the block record) and a `BlockRemoved` for
every block that left it (evicted, reclaimed), one batch per poll that saw a change.

    pub = KVEventPublisher(pool, "tcp://*:5557", replay_endpoint="tcp://*:5558")
    pub.start()          # a thread polls the segment; or call pub.poll() once per engine step
    ...
    pub.close()          # the last poll, the sockets closed

`PoolConfig(kv_events="tcp://*:5557")` makes one for a pool from its create to its close
(`start_for_pool`, `close_with`); `PoolConfig(kv_events=KVEventsConfig(endpoint,
replay_endpoint=..., rank=...))` gives it the options below. With `rank=r` it publishes on the
endpoint offset as vLLM's data-parallel rank r does (`offset_endpoint`); with `replay_endpoint`
a ROUTER answers replay requests from the last `buffer_steps` batches in vLLM's reply shape.

The publisher reads block records, not the pool's code paths: the C core's operations and
every process attached to the pool are seen alike, and one publisher beside the pool's
creator covers all its workers. It samples: a block published and evicted between two polls
is never announced (a router never learns of it, which is harmless), so a poll per engine
step is the closest view. With `check=True` the stream it publishes is fed, in process, to the
same checker as `kvscope events check`, and `verify()` compares the hashes that stream holds
stored with the keys in the pool's prefix index: any difference is a `kv_event_index_mismatch`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import numpy as np
import zmq

from kvscope.allocator.checksums import record_checksums
from kvscope.allocator.config import KVEventsConfig
from kvscope.allocator.errors import PoolError
from kvscope.allocator.findings import ERROR, Finding, FindingKind
from kvscope.allocator.layout import ClientState
from kvscope.child import run_dir
from kvscope.errors import UsageError
from kvscope.events.checker import StreamChecker
from kvscope.events.streamfile import PUBLISHED
from kvscope.events.wire import END_SEQ, Encoder, hash_text

# Where the publisher's socket drops batches for a slow subscriber (vLLM's default hwm).
SEND_HWM = 100_000
# Batches kept for the replay socket (vLLM's default `buffer_steps`).
BUFFER_STEPS = 10_000
# How long close() lets queued batches leave.
LINGER_MS = 1000
# At most this many hashes of each side are named in a mismatch finding.
MAX_NAMED = 20


class KVEventPublisher:
    """Publishes a pool's prefix-index lifecycle as vLLM's KV-event stream (docs/EVENTS.md).

    Args:
        pool: a `KVPool` (its `view` and `block_size` are read; nothing is written).
        endpoint: where to publish, as vLLM's `--kv-events-config` endpoint: `tcp://*:5557`,
            `ipc://` and `inproc://` bind (subscribers connect); a TCP address naming a host
            connects to a subscriber that binds it. Offset by `rank` (`offset_endpoint`).
        topic: the topic frame of every message (vLLM's default is empty).
        rank: the data-parallel rank put in every batch.
        medium: the `medium` of every event (vLLM names its device cache "GPU").
        check: feed the published stream to a `StreamChecker` in process (`verify()`).
        replay_endpoint: bind a ROUTER here (offset by `rank`) that answers a start seq with
            the buffered batches from it, then the end marker, as vLLM's replay socket.
        buffer_steps: the batches kept for replay.
    """

    def __init__(
        self,
        pool: Any,
        endpoint: str,
        topic: str = "",
        rank: int = 0,
        medium: str = "GPU",
        check: bool = False,
        replay_endpoint: str | None = None,
        buffer_steps: int = BUFFER_STEPS,
    ):
        self.view = pool.view
        self.block_size = int(pool.block_size)
        endpoint = offset_endpoint(endpoint, rank)
        self.endpoint = endpoint
        self.replay_endpoint = offset_endpoint(replay_endpoint, rank) if replay_endpoint else None
        self.topic = topic.encode()
        self.rank = rank
        self.medium = medium
        self._encoder = Encoder(maps=True, with_rank=True, with_medium=True)
        self._ctx = zmq.Context()
        # XPUB: a PUB to its subscribers, and it hears their subscriptions (wait_subscriber).
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        try:
            self._sock.bind(endpoint) if publisher_binds(endpoint) else self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise UsageError(f"cannot publish KV events on {endpoint}: {e}") from None
        # The replay ROUTER (always bound, as vLLM's) and the batches it can send again.
        self._replay: zmq.Socket | None = None
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=buffer_steps)
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            # room for a whole replay and its end marker (vLLM's replay hwm)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            try:
                self._replay.bind(self.replay_endpoint)
            except zmq.ZMQError as e:
                self._ctx.destroy(linger=0)
                raise UsageError(
                    f"cannot serve KV-event replay on {self.replay_endpoint}: {e}"
                ) from None
        self.num_replays = 0
        num_blocks = len(self.view.blocks)
        # block -> the index key it was announced under (0: not announced)
        self._announced = np.zeros(num_blocks, np.uint64)
        self._seq = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_stored = 0
        self.num_removed = 0
        # blocks whose record was caught mid-change (checksum not yet sealed): retried next poll
        self.num_deferred = 0
        # subscriptions the XPUB socket received
        self.num_subscriptions = 0
        self.checker = StreamChecker([endpoint]) if check else None
        self._closed = False

    # --- subscribers -----------------------------------------------------------------------

    def wait_subscriber(self, timeout_s: float = 5.0, count: int = 1) -> bool:
        """Wait until `count` subscriptions have arrived since the publisher started; False
        after `timeout_s` without them."""
        deadline = time.monotonic() + timeout_s
        while True:
            # (the socket is used under the lock: the thread polls and drains it too)
            with self._lock:
                self._drain_subscriptions()
                if self.num_subscriptions >= count:
                    return True
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    return False
                self._sock.poll(int(min(left_s, 0.05) * 1000), zmq.POLLIN)

    def _drain_subscriptions(self) -> None:
        while self._sock.poll(0, zmq.POLLIN):
            # XPUB: b"\x01" + topic subscribes, b"\x00" + topic unsubscribes
            if self._sock.recv()[:1] == b"\x01":
                self.num_subscriptions += 1

    # --- publishing ------------------------------------------------------------------------

    def poll(self) -> int:
        """Compare the pool's indexed blocks with what was announced; publish the difference as
        one batch (none when nothing changed), and answer waiting replay requests. Returns the
        number of events published."""
        with self._lock:
            n = self._poll()
            self._serve_replay()
            return n

    def _poll(self) -> int:
        b = self.view.blocks
        indexed = b["indexed"] == 1
        now = np.where(indexed, b["prefix_hash"], np.uint64(0))
        changed = np.flatnonzero(now != self._announced)
        if len(changed) == 0:
            return 0
        # Each changed record read once (a copy): its key, its parent's and its tokens are what
        # its checksum vouches for, however the live record moves on (another process may
        # evict and publish it again meanwhile; a key read apart from the tokens and the
        # parent would be announced with another key's, and later removed never stored).
        rows = b[changed]
        keys = np.where(rows["indexed"] == 1, rows["prefix_hash"], np.uint64(0))
        # A record is read whole only once its writer sealed it: a block whose checksum does
        # not match its identity words is mid-change, and waits for the next poll.
        sealed = record_checksums(rows, changed) == rows["checksum"]
        unsealed = int((~sealed).sum())
        self.num_deferred += unsealed
        keep = sealed & (keys != self._announced[changed])
        if unsealed:
            # A record mid-change may be a child whose parent key it has not written yet: no
            # key leaves the stream until every record is sealed, so that no child is
            # announced later under a parent the stream already removed (vLLM never stores a
            # child under an evicted parent: the request holds the whole chain). Blocks that
            # held an announced key wait whole; only fresh stores go out now.
            fresh = self._announced[changed] == 0
            self.num_deferred += int((keep & ~fresh).sum())
            keep &= fresh
        keep &= self._parents_first(keys, rows["parent_hash"], keep)
        if not keep.any():
            return 0
        changed, rows, new = changed[keep], rows[keep], keys[keep]
        old = self._announced[changed]
        gone = old[old != 0]
        # Stores before removals: what changed between two polls is not ordered, and a block
        # published under a parent that was evicted after it must not name a parent the
        # stream already removed. A key that moved to another block is stored once more, then
        # removed once: a second copy for a moment, as vLLM stores one per physical copy.
        events = self._stores(rows[new != 0])
        if len(gone):
            events.append(self._encoder.removed(gone.tolist(), self.medium))
        self._announced[changed] = new
        self.num_removed += len(gone)
        self.num_stored += int((new != 0).sum())
        self._send(events)
        return len(events)

    def _parents_first(self, keys: np.ndarray, parents: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Which of the records `keep` marks may go out now: not a newly indexed block whose
        parent is neither announced nor announced with it. It waits, so that no subscriber
        sees a child before its parent. The parent may be indexed with its record mid-change
        (deferred above), or evicted before the stream saw it (another process's LRU took it
        first): then the child is unreachable (a lookup stops at the missing parent) and waits
        until its parent's key is published again, or is evicted unannounced. Repeated until
        no block waits (a waiting parent holds its own children back too)."""
        out = set(self._announced[self._announced != 0].tolist())
        keep = keep.copy()
        while True:
            batch = set(keys[keep].tolist())
            wait = keep & np.fromiter(
                (
                    k != 0 and p != 0 and p not in out and p not in batch
                    for k, p in zip(keys.tolist(), parents.tolist())
                ),
                bool,
                len(keys),
            )
            if not wait.any():
                return keep
            self.num_deferred += int(wait.sum())
            keep &= ~wait

    def _stores(self, rows: np.ndarray) -> list[Any]:
        """BlockStored events for newly indexed blocks (their records as read): chains,
        parents before children."""
        if len(rows) == 0:
            return []
        keys = rows["prefix_hash"].tolist()
        parents = rows["parent_hash"].tolist()
        toks = rows["tokens"].tolist()
        key_to_row = {k: i for i, k in enumerate(keys)}
        children: dict[int, list[int]] = {}
        roots: list[int] = []
        for i, p in enumerate(parents):
            if p in key_to_row and key_to_row[p] != i:
                children.setdefault(key_to_row[p], []).append(i)
            else:
                roots.append(i)
        # One BlockStored per run of a chain; a branch's other children start runs of their
        # own, after the run that stores their parent.
        events: list[Any] = []
        stack = roots[::-1]
        seen: set[int] = set()
        while stack:
            i = stack.pop()
            run = [i]
            seen.add(i)
            kids = children.get(i, [])
            while kids:
                stack.extend(k for k in kids[:0:-1] if k not in seen)
                i = kids[0]
                if i in seen:
                    break
                run.append(i)
                seen.add(i)
                kids = children.get(i, [])
            parent = parents[run[0]]
            events.append(
                self._encoder.stored(
                    [keys[r] for r in run],
                    parent if parent else None,
                    [t for r in run for t in toks[r]],
                    self.block_size,
                    self.medium,
                )
            )
        return events

    def _send(self, events: list[Any]) -> None:
        payload = self._encoder.payload(events, rank=self.rank)
        frames = self._encoder.message(self._seq, payload, self.topic)
        self._seq += 1
        try:
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # at the high-water mark the batch is dropped, as vLLM's PUB socket drops it
        # kept for replay whether or not it left (vLLM buffers after its send, too)
        if self._replay is not None:
            self._buffer.append((frames[1], payload))
        if self.checker is not None:
            self.checker.feed(time.time_ns(), PUBLISHED, 0, frames)

    def _serve_replay(self) -> None:
        """Answer each waiting replay request `[client, b"", start seq]`: every buffered batch
        from that seq as `[topic, seq, payload]`, then the end marker `[b"", -1, b""]` (vLLM's
        replies from 0.26 on; the ROUTER adds the client's envelope)."""
        sock = self._replay
        if sock is None:
            return
        while sock.poll(0, zmq.POLLIN):
            request = sock.recv_multipart()
            if len(request) != 3 or len(request[2]) != 8:
                continue  # not a replay request (vLLM logs and ignores it)
            client, _, start = request
            first = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if int.from_bytes(seq, "big") >= first:
                    sock.send_multipart([client, b"", self.topic, seq, payload])
            sock.send_multipart([client, b"", b"", END_SEQ, b""])
            self.num_replays += 1

    def clear(self) -> None:
        """Publish `AllBlocksCleared` and start announcing the pool's index afresh."""
        with self._lock:
            self._announced[:] = 0
            self._send([self._encoder.cleared()])

    # --- the thread ------------------------------------------------------------------------

    def start(self, interval_s: float = 0.005) -> None:
        """Poll every `interval_s` (or four times as long as a poll takes, if longer) on a
        daemon thread until `stop()`."""
        assert self._thread is None, "the publisher's thread is already running"
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, args=(interval_s,), name="kvscope-kv-events", daemon=True
        )
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        wait_s = interval_s
        while not self._stop.wait(wait_s):
            start = time.perf_counter()
            with self._lock:
                self._poll()
                self._drain_subscriptions()
                self._serve_replay()
            # A poll reads every block record: on a large pool, poll less often, so the
            # thread takes at most a fifth of a core.
            wait_s = max(interval_s, 4 * (time.perf_counter() - start))

    def stop(self) -> None:
        """Stop the thread (if running) after its current poll."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    # --- the check -------------------------------------------------------------------------

    def stored_hashes(self) -> set[int]:
        """The hashes the published stream holds stored now (the checker's live multiset)."""
        assert self.checker is not None, "stored_hashes needs check=True"
        out: set[int] = set()
        for pub in self.checker.publishers.values():
            for cache in pub.caches.values():
                out.update(h for h, n in cache.copies.items() if n > 0)
        return out

    def index_keys(self) -> set[int]:
        """The keys in the pool's prefix index now (its hash table, not the block records)."""
        keys = self.view.index["hash"]
        return set(keys[keys != 0].tolist())

    def unreachable(self, keys: set[int]) -> set[int]:
        """Those of the index's `keys` a lookup cannot reach: a key whose parent's key is not
        in the index, and its descendants (never announced: _parents_first)."""
        b = self.view.blocks
        rows = b["indexed"] == 1
        parent_of = dict(zip(b["prefix_hash"][rows].tolist(), b["parent_hash"][rows].tolist()))
        index = self.index_keys()
        out = set()
        for key in keys:
            seen = set()
            k = key
            while k and k in index and k not in seen:
                seen.add(k)
                k = parent_of.get(k, 0)
            if k and k not in index:
                out.add(key)
        return out

    def verify(self) -> list[Finding]:
        """Poll a last time, then compare the stream's stored hashes with the pool's index.

        Call it when no process changes the pool (the end of a run): the index read is not
        locked. A difference becomes a `kv_event_index_mismatch` finding, also kept in the
        checker's findings (its report)."""
        assert self.checker is not None, "verify needs check=True"
        self.poll()
        stream, index = self.stored_hashes(), self.index_keys()
        extra_in_stream = sorted(stream - index)
        missing = sorted((index - stream) - self.unreachable(index - stream))
        if not extra_in_stream and not missing:
            return []
        parts = []
        if extra_in_stream:
            parts.append(
                f"{len(extra_in_stream)} hash(es) the stream holds stored are not in the pool's"
                f" prefix index ({_named(extra_in_stream)})"
            )
        if missing:
            parts.append(
                f"{len(missing)} key(s) of the pool's prefix index were never published or were"
                f" removed from the stream ({_named(missing)})"
            )
        finding = Finding(
            kind=FindingKind.KV_EVENT_INDEX_MISMATCH,
            message=(
                f"the KV-event stream published on {self.endpoint} (seq 0 to {self._seq - 1})"
                f" disagrees with the pool's prefix index: " + "; ".join(parts)
            ),
            extra={
                "publisher": self.endpoint,
                "last_seq": self._seq - 1,
                "stream_not_indexed": [hash_text(h) for h in extra_in_stream[:MAX_NAMED]],
                "indexed_not_stream": [hash_text(h) for h in missing[:MAX_NAMED]],
            },
        )
        self.checker.findings.append(finding)
        kind = FindingKind.KV_EVENT_INDEX_MISMATCH.value
        self.checker.finding_counts[kind] = self.checker.finding_counts.get(kind, 0) + 1
        return [finding]

    def report(self) -> dict[str, Any]:
        """The check of the published stream, as `kvscope events check --json` prints it."""
        assert self.checker is not None, "report needs check=True"
        out = self.checker.report(source=self.endpoint)
        out["publisher"] = self.stats()
        return out

    def stats(self) -> dict[str, Any]:
        """Batches, blocks stored and removed, records deferred to a later poll."""
        return {
            "endpoint": self.endpoint,
            "rank": self.rank,
            "batches": self._seq,
            "stored": self.num_stored,
            "removed": self.num_removed,
            "deferred": self.num_deferred,
            "replays": self.num_replays,
        }

    def close_with(self, pool: Any) -> None:
        """Close as `pool` closes (the publisher of `PoolConfig.kv_events`; lifecycle.py): the
        stream is compared with the pool's index only when this handle is the last attached
        one (while other processes change the pool the two may differ for a moment)."""
        alone = int((pool.view.clients["state"] == ClientState.ATTACHED).sum()) <= 1
        finish(self, pool, verify=alone)

    def close(self) -> None:
        """Stop the thread, publish what changed since the last poll, close the socket."""
        if self._closed:
            return
        self.stop()
        self.poll()
        self._closed = True
        self._ctx.destroy(linger=LINGER_MS)


def finish(pub: KVEventPublisher, pool: Any, verify: bool = True) -> dict[str, Any]:
    """Close a pool's publisher; with its check on, verify the stream against the pool's index
    first (unless `verify` is False) and record every error finding of the check in the pool's
    findings ring (where `kvscope run` reads it). Returns the publisher's stats and the findings
    by kind."""
    if pub.checker is not None and verify:
        pub.verify()
    pub.close()
    out = pub.stats()
    if pub.checker is not None:
        found = [f for f in pub.checker.findings if f.severity == ERROR]
        for f in found:
            pool.report(f)
        out["findings_by_kind"] = dict(sorted(pub.checker.finding_counts.items()))
    return out


def start_for_pool(pool: Any, option: str | KVEventsConfig) -> KVEventPublisher:
    """The publisher of `PoolConfig(kv_events=...)` (or `KVPool.attach(..., kv_events=...)`),
    an endpoint or a `KVEventsConfig` (replay socket, data-parallel rank, topic): polling on
    its thread from the pool's create to its close, its stream checked under `kvscope run`. A
    PoolError when an endpoint cannot be bound or connected."""
    spec = option if isinstance(option, KVEventsConfig) else KVEventsConfig(option)
    try:
        pub = KVEventPublisher(
            pool,
            spec.endpoint,
            topic=spec.topic,
            rank=spec.rank,
            check=run_dir() is not None,
            replay_endpoint=spec.replay_endpoint or None,
        )
    except UsageError as exc:
        raise PoolError(f"PoolConfig.kv_events: {exc}") from None
    pub.start()
    return pub


def offset_endpoint(endpoint: str, rank: int) -> str:
    """Data-parallel rank `rank`'s endpoint, as vLLM's `ZmqEventPublisher.offset_endpoint_port`:
    a TCP port plus the rank (port 0 stays 0), `_dp<rank>` after an inproc:// name; rank 0's
    is the endpoint itself. kvscope also takes ipc:// (vLLM refuses it with ranks): `_dp<rank>`
    after the path."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise UsageError(f"cannot offset {endpoint!r} by rank {rank}: no tcp port")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


def publisher_binds(endpoint: str) -> bool:
    """Whether a publisher binds `endpoint` (vLLM's rule in `ZmqEventPublisher`)."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def _named(hashes: list[int]) -> str:
    more = f", and {len(hashes) - MAX_NAMED} more" if len(hashes) > MAX_NAMED else ""
    return ", ".join(hash_text(h) for h in hashes[:MAX_NAMED]) + more
