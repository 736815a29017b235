"""Subscribe to engines' KV-event publishers and record every message (`kvscope events record`).

One SUB socket per endpoint (vLLM and SGLang publish one per data-parallel rank). Each message
is written to the recorded-stream file (streamfile.py) as it arrived, frames untouched, with
its receive time. The recorder follows each publisher's seq (per endpoint, topic and rank):
a jump forward is a gap, which it fills from that endpoint's replay socket when one is given
(the replayed batches are written before the message that revealed the gap, marked replayed);
a jump back is a restart. A gap's replay request starts at the last batch recorded, which the
replay must send back as recorded: where it sends another, the publisher restarted between the
two (faster than the subscriber reconnected, so its first batches were missed, not a gap of the
old sequence's), and the new sequence is asked for from its start instead, as a late join's.
Usage:

    rec = Recorder(["tcp://localhost:5557"], "run.kvev", replay=["tcp://localhost:5558"])
    stats = rec.run(seconds=60)

A replay request does not block: while it is in flight the SUB sockets are read as before, and
the endpoint's messages wait in memory behind it (so the file keeps each endpoint's order); it
ends at the replay's end marker or after `replay_timeout_s`. A replay socket that answers
nothing in that time is not asked again for the rest of the recording (one warning says so).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvscope.errors import UsageError
from kvscope.events.checker import INTERLEAVED_SWITCHES, SWITCH_WINDOW
from kvscope.events.streamfile import PUBLISHED, REPLAYED, StreamWriter
from kvscope.events.wire import END_SEQ, peek_batch

# How long a replay request may take before the gap is left as it is.
REPLAY_TIMEOUT_S = 2.0


@dataclass
class RecordStats:
    """What a recording wrote and saw. `messages` and `events` count what the file holds
    (published and replayed batches, not the recorder's notes)."""

    messages: int = 0
    events: int = 0
    # seq jumps forward seen, the batches they skipped, and those of them not replayed
    gaps: int = 0
    missing: int = 0
    unfilled: int = 0
    # batches written from a replay socket (a gap's, or those before a late join)
    filled: int = 0
    resets: int = 0
    elapsed_s: float = 0.0
    publishers: set[tuple[int, bytes, int | None]] = field(default_factory=set)
    # replay endpoints given up on (they did not answer)
    dead_replay: list[str] = field(default_factory=list)
    # publishers (endpoint, topic, rank) found to be two, their seqs interleaved
    interleaved: int = 0


def binds(endpoint: str) -> bool:
    """Whether a subscriber binds `endpoint` (a wildcard address: publishers connect to it)."""
    return "*" in endpoint or "://[::]" in endpoint


def _check_address(ep: str, what: str) -> None:
    """A UsageError for an address zmq would take but that cannot work: a TCP port out of
    range (zmq connects to port 99999 and waits for ever)."""
    scheme, sep, rest = ep.partition("://")
    if not sep:
        raise UsageError(
            f"{what}{ep} is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH, inproc://NAME)"
        )
    if scheme == "tcp":
        _, colon, port = rest.rpartition(":")
        if colon and port.isdigit() and not 0 < int(port) <= 65535:
            raise UsageError(f"{what}{ep}: port {port} is out of range (1 to 65535)")


def check_endpoints(endpoints: list[str], replay: list[str]) -> None:
    """A UsageError (one line) for endpoints a recording cannot use: no endpoint, an address
    out of range, a replay endpoint zmq cannot parse or that binds, another number of replay
    endpoints than of endpoints, an endpoint named twice."""
    if not endpoints:
        raise UsageError("events record needs at least one endpoint")
    if replay and len(replay) != len(endpoints):
        raise UsageError(
            f"{len(endpoints)} endpoint(s) and {len(replay)} --replay endpoint(s): name one"
            " replay socket per endpoint, in the same order"
        )
    seen: set[str] = set()
    for ep in [*endpoints, *replay]:
        if ep in seen:
            raise UsageError(f"{ep} is named twice: each endpoint is one publisher's")
        seen.add(ep)
    for ep in endpoints:
        _check_address(ep, "")
    if not replay:
        return
    ctx = zmq.Context()
    try:
        for ep in replay:
            _check_address(ep, "--replay ")
            if binds(ep):
                raise UsageError(
                    f"--replay {ep}: a replay socket is connected to (the engine binds it):"
                    " name its host"
                )
            sock = ctx.socket(zmq.DEALER)
            try:
                sock.connect(ep)
            except zmq.ZMQError as e:
                raise UsageError(f"cannot use --replay {ep}: {e}") from None
            finally:
                sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)


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


def _warn(message: str) -> None:
    print(f"kvscope: warning: {message}", file=sys.stderr, flush=True)


class _Replay:
    """A replay request in flight: endpoint i's batches first..stop-1 asked for."""

    __slots__ = ("sock", "first", "stop", "deadline", "gap", "got", "answered", "last", "restart")

    def __init__(
        self,
        sock: zmq.Socket,
        first: int,
        stop: int,
        deadline: float,
        gap: bool,
        last: bytes | None = None,
    ):
        self.sock = sock
        self.first = first
        self.stop = stop
        self.deadline = deadline
        # a gap's (its batches lost unless replayed), not a late join's
        self.gap = gap
        self.got = 0
        self.answered = False
        # a gap's: the payload of batch first - 1 as recorded, which the replay sends first
        # (another one: the publisher restarted, `restart`)
        self.last = last
        self.restart = False


class Recorder:
    """Records the messages of one or more publishers into a recorded-stream file.

    Args:
        endpoints: the publishers' PUB addresses (`tcp://host:5557`; `tcp://*:5557` binds, for
            publishers that connect).
        replay: each endpoint's replay (ROUTER) address, in the same order, or None.
        topic: the topic prefix to subscribe to ("" for all).
        replay_timeout_s: how long a replay request may go unanswered.
        warn: where the one line about a replay socket given up on goes (stderr).
        clock: the clock replay deadlines are kept by (a test's own).
    """

    def __init__(
        self,
        endpoints: list[str],
        output: str,
        topic: str = "",
        replay: list[str] | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        warn: Callable[[str], None] = _warn,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.endpoints = endpoints
        self.replay = list(replay or [])
        check_endpoints(endpoints, self.replay)
        self.replay_timeout_s = replay_timeout_s
        self.warn = warn
        self._clock = clock
        self.stats = RecordStats()
        self._next: dict[tuple[int, bytes, int | None], int] = {}
        # per publisher: the payload of the last batch recorded (a gap's replay checks it)
        self._last: dict[tuple[int, bytes, int | None], bytes] = {}
        # per publisher: the next seq of the sequence it last left, (times that sequence went
        # on, messages written then); the publishers found two interleaved (not followed)
        self._other: dict[tuple[int, bytes, int | None], int] = {}
        self._switches: dict[tuple[int, bytes, int | None], tuple[int, int]] = {}
        self._mixed: set[tuple[int, bytes, int | None]] = set()
        # per endpoint: the replay in flight, and the messages waiting behind it
        # (frames, receive time, whether its seq was followed already)
        self._pending: dict[int, _Replay] = {}
        self._held: dict[int, deque[tuple[list[bytes], int, bool]]] = {}
        self._dead: set[int] = set()
        self._stop = threading.Event()
        self._closed = False
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
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

    @property
    def replays_in_flight(self) -> int:
        """Replay requests not answered (nor timed out) yet."""
        return len(self._pending)

    @property
    def waiting(self) -> int:
        """Messages received and waiting behind a replay in flight."""
        return sum(len(h) for h in self._held.values())

    def stop(self) -> None:
        """Make `run` stop (from another thread, or a callback)."""
        self._stop.set()

    def close(self) -> None:
        """End the replays in flight (each within its timeout) and write what waits behind
        them; then close the sockets and the file."""
        if self._closed:
            return
        if hasattr(self, "writer"):
            try:
                self.finish()
            except KeyboardInterrupt:
                self.finish(wait=False)
        self._closed = True
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
        """Record until `seconds` have passed (None: until Ctrl-C, SIGTERM, SIGHUP or `stop`);
        then end the replays in flight and close everything."""
        poller = self._poller
        for s in self._subs:
            poller.register(s, zmq.POLLIN)
        start = time.monotonic()
        next_live = start + live_every_s
        restore = _stop_on_signals()
        try:
            try:
                while not self._stop.is_set():
                    now = time.monotonic()
                    if seconds is not None and now - start >= seconds:
                        break
                    if live is not None and now >= next_live:
                        self.stats.elapsed_s = now - start
                        live(self.stats)
                        next_live = now + live_every_s
                    wait_ms = 100
                    if self._pending:
                        due = min(r.deadline for r in self._pending.values()) - self._clock()
                        wait_ms = max(0, min(wait_ms, int(due * 1000) + 1))
                    ready = dict(poller.poll(wait_ms))
                    if not ready:
                        # idle: what is recorded so far is on disk for a reader
                        self.writer.flush()
                    for i, s in enumerate(self._subs):
                        if s in ready:
                            self._drain(i, s)
                    if self._pending:
                        self.service()
            except KeyboardInterrupt:
                pass
            try:
                self.finish()
            except KeyboardInterrupt:
                self.finish(wait=False)
        finally:
            restore()
            self.stats.elapsed_s = time.monotonic() - start
            self.close()
        return self.stats

    def finish(self, wait: bool = True) -> None:
        """End every replay in flight: wait for each up to its timeout (`wait`), or give it
        up now; the messages behind it are written."""
        while True:
            # (what waits behind no replay: one ended as a signal came)
            for i in [i for i, held in self._held.items() if held and i not in self._pending]:
                self._release(i)
            if not self._pending:
                return
            if not wait:
                for i, rep in list(self._pending.items()):
                    self._end_replay(i, rep, "stopped")
                continue
            poller = zmq.Poller()
            for rep in self._pending.values():
                poller.register(rep.sock, zmq.POLLIN)
            due = min(r.deadline for r in self._pending.values()) - self._clock()
            poller.poll(max(0, int(due * 1000) + 1))
            self.service()

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
        message; a relay of its own may call it instead, and `close` when done): follow its
        seq, ask the replay socket for a gap, write it (behind the replay, if one is in
        flight for its endpoint)."""
        held = self._held.get(i)
        if held:
            held.append((frames, recv_ns, False))
        else:
            self._take(i, frames, recv_ns)
        if self._pending:
            self.service()

    def _take(self, i: int, frames: list[bytes], recv_ns: int) -> None:
        """Follow a message's seq; write it, or hold it behind the replay it starts."""
        stats = self.stats
        if len(frames) == 3 and len(frames[1]) == 8:
            _, rank = peek_batch(frames[2])
            key = (i, frames[0], rank)
            seq = int.from_bytes(frames[1], "big")
            expected = self._next.get(key)
            self._next[key] = seq + 1
            last = self._last.get(key)
            self._last[key] = frames[2]
            fill = None
            if expected is None:
                stats.publishers.add(key)
                if seq > 0:
                    # joined after the publisher's first batches: ask for them
                    fill = (0, False)
            elif seq == expected or key in self._mixed:
                pass
            elif seq == self._other.get(key):
                # the sequence it left goes on: no gap, no restart (two publishers, past a few)
                self._other[key] = expected
                self._switched(i, key)
            elif seq > expected:
                stats.gaps += 1
                stats.missing += seq - expected
                fill = (expected, True)
            else:
                stats.resets += 1
                self._other[key] = expected
            if fill is not None:
                first, gap = fill
                if self._ask(i, first, seq, gap, last if gap else None):
                    self._held.setdefault(i, deque()).appendleft((frames, recv_ns, True))
                    return
                if gap:
                    stats.unfilled += seq - first
        self._write(i, frames, recv_ns, PUBLISHED)

    def _switched(self, i: int, key: tuple[int, bytes, int | None]) -> None:
        """Publisher `key` went back to the sequence it left: past INTERLEAVED_SWITCHES times
        (each within SWITCH_WINDOW messages) it is two publishers, its seq not followed."""
        n, at = self._switches.get(key, (0, 0))
        n = n + 1 if self.stats.messages - at <= SWITCH_WINDOW else 1
        self._switches[key] = (n, self.stats.messages)
        if n < INTERLEAVED_SWITCHES:
            return
        self._mixed.add(key)
        self.stats.interleaved += 1
        topic = f" topic {key[1].decode(errors='replace')!r}" if key[1] else ""
        rank = "" if key[2] is None else f" rank {key[2]}"
        self.warn(
            f"two publishers' seqs interleave on {self.endpoints[i]}{topic}{rank} (two engines"
            " at one data-parallel rank on one port?): recorded, their gaps not followed"
        )

    def _write(self, i: int, frames: list[bytes], recv_ns: int, source: int) -> None:
        self.writer.write(recv_ns, source, i, frames)
        self.stats.messages += 1
        if len(frames) >= 2:
            self.stats.events += peek_batch(frames[-1])[0]

    def _ask(self, i: int, first: int, stop: int, gap: bool, last: bytes | None = None) -> bool:
        """Send endpoint i's replay socket a request for batches first..stop-1 (from first - 1
        where `last`, that batch's payload as recorded, is given: the check of a restart);
        whether one is in flight now (no replay socket, or one given up on: no)."""
        if i >= len(self.replay) or not self.replay[i] or i in self._dead:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # (a gap's `first` is the seq after one recorded: never 0)
        ask = first - 1 if last is not None else first
        try:
            sock.connect(self.replay[i])
            sock.send_multipart([b"", ask.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            note = {"note": "replay", "replay": self.replay[i], "first": first, "stop": stop}
            self.writer.note(i, {**note, "replayed": 0, "error": str(e)})
            self._give_up(i, f"cannot be asked ({e})")
            return False
        rep = _Replay(sock, first, stop, self._clock() + self.replay_timeout_s, gap, last)
        self._pending[i] = rep
        self._poller.register(sock, zmq.POLLIN)
        return True

    def service(self) -> None:
        """Read what the replays in flight answered; end those done or past their time (`run`
        and `on_message` call it; a relay of its own between messages too)."""
        now = self._clock()
        for i, rep in list(self._pending.items()):
            try:
                done = self._receive(i, rep)
            except zmq.ZMQError as e:
                self._end_replay(i, rep, str(e))
                continue
            if done:
                self._end_replay(i, rep, None)
            elif now >= rep.deadline:
                self._end_replay(i, rep, "timeout")

    def _receive(self, i: int, rep: _Replay) -> bool:
        """Write the batches a replay socket sent so far; True at its end marker."""
        while True:
            try:
                frames = rep.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            rep.answered = True
            if frames and frames[0] == b"":
                frames = frames[1:]
            # [seq, payload] (vLLM <= 0.25) or [topic, seq, payload] (>= 0.26)
            seq_frame = frames[-2] if len(frames) >= 2 else b""
            if seq_frame == END_SEQ:
                return True
            if len(seq_frame) != 8:
                continue
            seq = int.from_bytes(seq_frame, "big")
            if seq == rep.first - 1 and rep.last is not None:
                if frames[-1] != rep.last:
                    rep.restart = True  # (not the batch recorded: a new publisher's)
                    return True
                continue
            if rep.first <= seq < rep.stop:
                self._write(i, frames, time.time_ns(), REPLAYED)
                rep.got += 1

    def _end_replay(self, i: int, rep: _Replay, why: str | None) -> None:
        """A replay done (`why` None), past its time ("timeout"), given up ("stopped") or
        failed (the error): a note of it, then the messages that waited behind it."""
        del self._pending[i]
        try:
            self._poller.unregister(rep.sock)
        except KeyError:
            pass
        rep.sock.close(linger=0)
        if rep.restart:
            self._restarted(i, rep)
            return
        self.stats.filled += rep.got
        if rep.gap:
            self.stats.unfilled += rep.stop - rep.first - rep.got
        note = {
            "note": "replay",
            "replay": self.replay[i],
            "first": rep.first,
            "stop": rep.stop,
            "replayed": rep.got,
        }
        timeout = f"{self.replay_timeout_s:g} s"
        if why == "timeout":
            note["error"] = (
                f"no end marker within {timeout}" if rep.answered else f"no answer within {timeout}"
            )
        elif why is not None:
            note["error"] = why
        self.writer.note(i, note)
        if why == "timeout" and not rep.answered:
            self._give_up(i, f"did not answer within {timeout}")
        self._release(i)

    def _restarted(self, i: int, rep: _Replay) -> None:
        """A gap's replay found the publisher restarted: no gap, a restart; the new sequence's
        batches before the message that revealed it asked for from its start (a late join's),
        the messages behind it still held."""
        stats = self.stats
        stats.gaps -= 1
        stats.missing -= rep.stop - rep.first
        stats.resets += 1
        self.writer.note(
            i,
            {
                "note": "restart",
                "replay": self.replay[i],
                "seq": rep.first - 1,
                "next": rep.stop,
            },
        )
        if not self._ask(i, 0, rep.stop, False):
            self._release(i)

    def _give_up(self, i: int, why: str) -> None:
        """No more replay requests to endpoint i's replay socket; said once."""
        self._dead.add(i)
        self.stats.dead_replay.append(self.replay[i])
        self.warn(
            f"replay socket {self.replay[i]} {why}: not asked again in this recording (gaps"
            f" of {self.endpoints[i]} stay unfilled)"
        )

    def _release(self, i: int) -> None:
        """Write the messages that waited behind endpoint i's replay, up to the next replay
        one of them starts."""
        held = self._held.get(i)
        while held and i not in self._pending:
            frames, recv_ns, followed = held.popleft()
            if followed:
                self._write(i, frames, recv_ns, PUBLISHED)
            else:
                self._take(i, frames, recv_ns)


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
