"""`kvscope top --events ENDPOINT...`: a live view of an engine's prefix cache from its KV-event
stream (vLLM, SGLang; docs/EVENTS.md), or of a recorded stream file replayed.

The stream is fed to the checker (kvscope.events.walk.StreamWalk, the checker that keeps each
hash's stays and the prefix tree) as it arrives. Panels: per publisher, blocks stored now and
at the peak, distinct hashes, hashes stored and removed per second (over the last refresh),
new hashes against hashes stored again, gaps and restarts; the prefix tree's largest branches;
the checker's findings, newest last. `q` quits.
"""

from __future__ import annotations

import time
from typing import Any

from textual.app import App, ComposeResult
from textual.widgets import DataTable, Footer, Static

from kvscope.events.streamfile import PUBLISHED, StreamFile
from kvscope.events.walk import StreamWalk
from kvscope.events.wire import hash_text

# Records fed per refresh at most (a recorded file replays over several refreshes).
MAX_PER_TICK = 200_000
TREE_ROOTS = 8
# A root's hash shown whole up to this many characters (any 64-bit int, signed or not); a
# longer one (a digest's hex) cut, its end marked: a cut hash is never taken for a whole one.
HASH_CHARS = 20


class FileFeed:
    """A recorded stream, replayed: `per_tick` records per refresh."""

    def __init__(self, path: str, per_tick: int = MAX_PER_TICK):
        self.stream = StreamFile(path)
        self.endpoints = self.stream.endpoints
        self._records = self.stream.records()
        self.per_tick = per_tick
        self.done = False
        self.name = path

    def poll(self) -> list[tuple[int, int, int, list[Any]]]:
        out = []
        for rec in self._records:
            out.append((rec[0], rec[1], rec[2], [bytes(f) for f in rec[3]]))
            if len(out) >= self.per_tick:
                return out
        self.done = True
        return out

    def close(self) -> None:
        self.stream.close()


class ZmqFeed:
    """Live publishers: one SUB socket per endpoint, read without blocking at each refresh."""

    def __init__(self, endpoints: list[str], topic: str = ""):
        import zmq

        from kvscope.errors import UsageError
        from kvscope.events.recorder import subscribe

        self.endpoints = endpoints
        self.name = " ".join(endpoints)
        self.done = False
        self._zmq = zmq
        self._ctx = zmq.Context()
        try:
            self._subs = subscribe(self._ctx, endpoints, topic)
        except UsageError:
            self._ctx.destroy(linger=0)
            raise

    def poll(self) -> list[tuple[int, int, int, list[Any]]]:
        out: list[tuple[int, int, int, list[Any]]] = []
        for i, s in enumerate(self._subs):
            while len(out) < MAX_PER_TICK:
                try:
                    frames = s.recv_multipart(self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
                out.append((time.time_ns(), PUBLISHED, i, frames))
        return out

    def close(self) -> None:
        self._ctx.destroy(linger=0)


def tree_lines(walk: StreamWalk, roots: int = TREE_ROOTS) -> list[str]:
    """The prefix tree's largest branches: per cache, its roots by the hashes under them."""
    lines = []
    for (key, ck), parents in walk.parents.items():
        below: dict[Any, int] = {}
        root_of: dict[Any, Any] = {}
        for h in parents:
            # the root of h, by following parents (memoised along the way)
            path = []
            r = h
            while r in parents and parents[r] is not None and parents[r] in parents:
                if r in root_of:
                    break
                path.append(r)
                r = parents[r]
            r = root_of.get(r, r)
            for p in path:
                root_of[p] = r
            root_of[h] = r
            below[r] = below.get(r, 0) + 1
        pub = walk.publishers.get(key)
        cache = pub.caches.get(ck) if pub is not None else None
        live = cache.copies if cache is not None else {}
        where = walk.publisher_name(key) + "".join(
            f" {n} {v}" for n, v in zip(("medium", "group"), ck) if v is not None
        )
        lines.append(f"{where}: {len(parents):,} hashes ever stored, {len(below):,} roots")
        for r, n in sorted(below.items(), key=lambda kv: -kv[1])[:roots]:
            state = "stored" if live.get(r) else "gone"
            text = hash_text(r)
            text = text if len(text) <= HASH_CHARS else text[: HASH_CHARS - 1] + "…"
            lines.append(f"  {text}  {n:,} hashes  (root {state})")
    return lines or ["no block stored yet"]


class EventsApp(App):
    """The live view of one KV-event stream."""

    TITLE = "kvscope top --events"
    BINDINGS = [("q", "quit", "quit")]
    CSS = """
    #summary { height: auto; padding: 0 1; }
    #publishers { height: auto; max-height: 12; }
    #tree { height: auto; max-height: 14; padding: 0 1; border-top: solid $primary; }
    #findings { height: 1fr; border-top: solid $primary; }
    """

    def __init__(self, feed: Any, hz: float = 2.0):
        super().__init__()
        self.feed = feed
        self.hz = hz
        self.walk = StreamWalk(list(feed.endpoints))
        self._prev: dict[Any, tuple[int, int]] = {}
        self._prev_t = time.monotonic()
        self._findings_shown = 0

    def compose(self) -> ComposeResult:
        yield Static("waiting for the stream…", id="summary")
        yield DataTable(id="publishers", cursor_type="row")
        yield Static("", id="tree")
        yield DataTable(id="findings", cursor_type="row")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = self.feed.name
        pubs = self.query_one("#publishers", DataTable)
        pubs.add_columns(
            "publisher",
            "stored now",
            "peak",
            "hashes",
            "stored/s",
            "removed/s",
            "new",
            "again",
            "gaps",
            "restarts",
        )
        self.query_one("#findings", DataTable).add_columns("batch", "kind", "message")
        self.tick()
        self.set_interval(1 / self.hz, self.tick)

    def on_unmount(self) -> None:
        self.feed.close()

    def tick(self) -> None:
        """Feed what arrived, then redraw."""
        for rec in self.feed.poll():
            self.walk.feed(*rec)
        now = time.monotonic()
        dt = max(now - self._prev_t, 1e-9)
        self._prev_t = now
        walk = self.walk
        pubs = self.query_one("#publishers", DataTable)
        pubs.clear()
        live = 0
        for key, p in walk.publishers.items():
            c = p.counts
            s0, r0 = self._prev.get(key, (c["stored"], c["removed"]))
            self._prev[key] = (c["stored"], c["removed"])
            new, again = walk.hits.get(key, [0, 0])
            live += p.live
            pubs.add_row(
                p.name(),
                f"{p.live:,}",
                f"{p.peak_stored:,}",
                f"{sum(len(x.copies) for x in p.caches.values()):,}",
                f"{(c['stored'] - s0) / dt:,.0f}",
                f"{(c['removed'] - r0) / dt:,.0f}",
                f"{new:,}",
                f"{again:,}",
                str(c["gaps"]),
                str(c["resets"]),
            )
        counts = walk.finding_counts
        total = sum(counts.values())
        health = "UNHEALTHY" if any(f.severity == "error" for f in walk.findings) else "HEALTHY"
        state = " (replayed whole)" if self.feed.done else ""
        self.query_one("#summary", Static).update(
            f"{health}{state}: {len(walk.publishers)} publisher(s), {walk.num_events:,} events,"
            f" {live:,} block copies stored now; {total} finding(s)"
        )
        self.query_one("#tree", Static).update("\n".join(tree_lines(walk)))
        table = self.query_one("#findings", DataTable)
        for f in walk.findings[self._findings_shown :]:
            table.add_row(str(f.extra.get("batch", "")), f.kind, f.message)
        self._findings_shown = len(walk.findings)


def is_file_feed(targets: list[str]) -> bool:
    """Whether `top --events` targets are one recorded stream file (else endpoints); a
    UsageError for a mix."""
    from kvscope.errors import UsageError

    if len(targets) == 1 and "://" not in targets[0]:
        return True
    if all("://" in t for t in targets):
        return False
    raise UsageError("top --events takes endpoints or one recorded stream file, not both")


def run_events_top(targets: list[str], hz: float = 2.0, topic: str = "") -> int:
    """`kvscope top --events ENDPOINT...|FILE`: the live view; its exit code."""
    feed: Any = FileFeed(targets[0]) if is_file_feed(targets) else ZmqFeed(targets, topic)
    EventsApp(feed, hz=hz).run()
    return 0
