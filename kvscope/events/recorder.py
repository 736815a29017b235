"""Subscribe to engines' KV-event publishers and record every message (`kvscope events record`).

One SUB socket per endpoint (vLLM and SGLang publish one per data-parallel rank). Each message
is written to the recorded-stream file (streamfile.py) as it arrived, frames untouched, with
its receive time. The recorder follows each publisher's seq (per endpoint, topic and rank):
a jump forward is a gap, which it fills from that endpoint's replay socket when one is given
(the replayed batches are written before the message that revealed the gap, marked replayed);
a jump back is a restart. Usage:

    rec = Recorder(["tcp://localhost:5557"], "run.kvev", replay=["tcp://localhost:5558"])
    stats = rec.run(seconds=60)
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvscope.errors import UsageError
from kvscope.events.streamfile import PUBLISHED, REPLAYED, StreamWriter
from kvscope.events.wire import END_SEQ, peek_batch

# How long a replay request may take before the gap is left as it is.
REPLAY_TIMEOUT_S = 2.0


@dataclass
class RecordStats:
    """What a recording saw."""

    messages: int = 0
    events: int = 0
    gaps: int = 0
    missing: int = 0
    filled: int = 0
    resets: int = 0
    elapsed_s: float = 0.0
    publishers: set[tuple[int, bytes, int | None]] = field(default_factory=set)


def binds(endpoint: str) -> bool:
    """Whether a subscriber binds `endpoint` (a wildcard address: publishers connect to it)."""
    return "*" in endpoint or "://[::]" in endpoint


def subscribe(ctx: zmq.Context, endpoints: list[str], topic: str) -> list[zmq.Socket]:
    """One SUB socket per endpoint (a wildcard one bound, the others connected), with no receive
    limit: the subscriber's own queue never drops (the publisher's high-water mark may). A
    UsageError naming the endpoint it could not subscribe to; the caller destroys `ctx`."""
    subs: list[zmq.Socket] = []
    for ep in endpoints:
        s = ctx.socket(zmq.SUB)
        try:
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.SUBSCRIBE, topic.encode())
            s.bind(ep) if binds(ep) else s.connect(ep)
        except zmq.ZMQError as e:
            raise UsageError(f"cannot subscribe to {ep}: {e}") from None
        subs.append(s)
    return subs


class Recorder:
    """Records the messages of one or more publishers into a recorded-stream file.

    Args:
        endpoints: the publishers' PUB addresses (`tcp://host:5557`; `tcp://*:5557` binds, for
            publishers that connect).
        replay: each endpoint's replay (ROUTER) address, or None; shorter than `endpoints`
            means no replay for the rest.
        topic: the topic prefix to subscribe to ("" for all).
    """

    def __init__(
        self,
        endpoints: list[str],
        output: str,
        topic: str = "",
        replay: list[str] | None = None,
    ):
        if not endpoints:
            raise UsageError("events record needs at least one endpoint")
        self.endpoints = endpoints
        self.replay = list(replay or [])
        self._ctx = zmq.Context()
        try:
            self._subs = subscribe(self._ctx, endpoints, topic)
        except UsageError:
            self.close()
            raise
        try:
            self.writer = StreamWriter(
                output, {"endpoints": endpoints, "replay": self.replay, "topic": topic}
            )
        except UsageError:
            self.close()
            raise
        self.stats = RecordStats()
        self._next: dict[tuple[int, bytes, int | None], int] = {}

    def close(self) -> None:
        """Close the sockets (and the file, once opened)."""
        # every socket of the context, one that failed to connect too
        self._ctx.destroy(linger=0)
        if hasattr(self, "writer"):
            self.writer.close()

    def run(
        self,
        seconds: float | None = None,
        live: Callable[[RecordStats], None] | None = None,
        live_every_s: float = 0.5,
    ) -> RecordStats:
        """Record until `seconds` have passed (None: until Ctrl-C, SIGTERM or SIGHUP); then
        close everything."""
        poller = zmq.Poller()
        for s in self._subs:
            poller.register(s, zmq.POLLIN)
        start = time.monotonic()
        next_live = start + live_every_s
        restore = _stop_on_signals()
        try:
            while True:
                now = time.monotonic()
                if seconds is not None and now - start >= seconds:
                    break
                if live is not None and now >= next_live:
                    self.stats.elapsed_s = now - start
                    live(self.stats)
                    next_live = now + live_every_s
                ready = dict(poller.poll(100))
                if not ready:
                    # idle: what is recorded so far is on disk for a reader
                    self.writer.flush()
                for i, s in enumerate(self._subs):
                    if s in ready:
                        self._drain(i, s)
        except KeyboardInterrupt:
            pass
        finally:
            restore()
            self.stats.elapsed_s = time.monotonic() - start
            self.close()
        return self.stats

    def _drain(self, i: int, sock: zmq.Socket) -> None:
        recv = sock.recv_multipart
        while True:
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_message(i, frames, time.time_ns())

    def on_message(self, i: int, frames: list[bytes], recv_ns: int) -> None:
        """Record one message of endpoint i as received at `recv_ns` (`run` calls it for every
        message; a relay of its own may call it instead): follow its seq, fill a gap from the
        replay socket, write it."""
        stats = self.stats
        stats.messages += 1
        if len(frames) == 3 and len(frames[1]) == 8:
            num_events, rank = peek_batch(frames[2])
            stats.events += num_events
            key = (i, frames[0], rank)
            seq = int.from_bytes(frames[1], "big")
            expected = self._next.get(key)
            if expected is None:
                stats.publishers.add(key)
                if seq > 0 and i < len(self.replay) and self.replay[i]:
                    # joined after the publisher's first batches: ask for them
                    self._fill(i, 0, seq)
            elif seq > expected:
                stats.gaps += 1
                stats.missing += seq - expected
                if i < len(self.replay) and self.replay[i]:
                    self._fill(i, expected, seq)
            elif seq < expected:
                stats.resets += 1
            self._next[key] = seq + 1
        self.writer.write(recv_ns, PUBLISHED, i, frames)

    def _fill(self, i: int, first: int, stop: int) -> None:
        """Ask endpoint i's replay socket for batches first..stop-1 and write those it has."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        got = 0
        try:
            sock.connect(self.replay[i])
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms):
                    break
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                # [seq, payload] (vLLM <= 0.25) or [topic, seq, payload] (>= 0.26)
                seq_frame = frames[-2] if len(frames) >= 2 else b""
                if seq_frame == END_SEQ:
                    break
                if len(seq_frame) != 8:
                    continue
                seq = int.from_bytes(seq_frame, "big")
                if first <= seq < stop:
                    self.writer.write(time.time_ns(), REPLAYED, i, frames)
                    got += 1
        except zmq.ZMQError as e:
            self.writer.note(i, {"note": "replay", "first": first, "stop": stop, "error": str(e)})
            return
        finally:
            sock.close(linger=0)
        self.stats.filled += got
        self.writer.note(i, {"note": "replay", "first": first, "stop": stop, "replayed": got})


def live_line(stats: RecordStats, file=None) -> None:
    """The recorder's live line: events/s, batches, gaps (rewritten in place on a terminal)."""
    out = file or sys.stderr
    rate = stats.events / stats.elapsed_s if stats.elapsed_s > 0 else 0.0
    out.write(
        f"\rkvscope: {rate:,.0f} events/s, {stats.messages:,} batches,"
        f" {stats.events:,} events, {stats.gaps} gap(s) ({stats.filled} batch(es) replayed),"
        f" {stats.resets} restart(s)   "
    )
    out.flush()


def _stop_on_signals() -> Callable[[], None]:
    """Make SIGTERM and SIGHUP stop a recording as Ctrl-C does (a supervisor's stop is SIGTERM;
    a closed terminal SIGHUP), so the file is closed whole; return what puts the handlers back.
    A signal this process was started ignoring stays ignored (`nohup`, or a background job of a
    shell without job control, which starts with SIGINT ignored: there Python raises no
    KeyboardInterrupt, and SIGTERM is the way to stop it). Only the main thread can set
    handlers; a recorder run from another thread stops by `seconds`."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            saved[sig] = signal.signal(sig, stop)

    def restore() -> None:
        for sig, handler in saved.items():
            signal.signal(sig, handler)

    return restore
