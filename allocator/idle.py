"""Idle requests: live sequences that hold blocks and that the program has not served for a
while, by their records' `active_ns` (docs/FORMAT.md section 5), compared with the monotonic
clock of the moment the copy was taken. What every reader of a live pool says of them: the
whole-pool check's `idle_request` warning (check.py; so `check`, `analyze`, `top` and the
metrics' last read), the metrics' idle gauges (probes/otel_metrics.py through stats.py) and
`kvscope run`'s live line (kvscope/supervisor.py).

A request a scheduler dropped without `pool.free` or `pool.abort` (an abort, a timeout, an
error path) leaks its blocks in a server that never exits: no exit check ever runs. What
tells it from a request that waits its turn is what the same process did meanwhile: the
flight recorder's requests that began and ended after it was last served (`overtaken`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope.allocator.checkrefs import own_block
from kvscope.allocator.checkreport import Alive
from kvscope.allocator.events import EventOp
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.header import threshold_s
from kvscope.allocator.layout import ClientState, SegmentView, SeqState, field_text
from kvscope.allocator.probeflags import IDLE_REQUEST_ENV
from kvscope.allocator.process import is_alive, is_stopped


def idle_threshold_s(view: SegmentView) -> float:
    """How long a request holding blocks may go unserved before it is `idle_request` (seconds;
    0: never): `KVSCOPE_IDLE_REQUEST_S` where this process sets it, else the value the pool's
    creator recorded (30 s unless it set the variable)."""
    return threshold_s(view, IDLE_REQUEST_ENV)


@dataclass(frozen=True)
class IdleRequest:
    """A live sequence not served for `idle_s` seconds, holding `blocks` blocks."""

    slot: int
    seq_id: int
    pid: int
    request: str
    state: str
    blocks: int
    idle_s: float


def idle_ages(view: SegmentView, now_mono_ns: int) -> np.ndarray:
    """Seconds since each sequence slot was last served (`now_mono_ns` on CLOCK_MONOTONIC);
    NaN where the slot holds no running sequence with blocks, or no time (0). A sequence the
    engine set waiting (`set_state(seq, "waiting")`) is parked on purpose: its blocks go to
    the first take that needs them (a preemption), so it is not idle however long it waits."""
    seqs = view.seqs
    active = seqs["active_ns"].astype(np.int64)
    held = (seqs["state"] == SeqState.RUNNING) & (seqs["num_blocks"] > 0) & (active > 0)
    return np.where(held, (now_mono_ns - active) / 1e9, np.nan)


def idle_requests(
    view: SegmentView, now_mono_ns: int, min_s: float, alive: Alive = is_alive
) -> list[IdleRequest]:
    """The live sequences of live processes that hold blocks and were not served for `min_s`
    seconds or more, the longest idle first (a dead process's are leaks the check names
    apart)."""
    ages = idle_ages(view, now_mono_ns)
    with np.errstate(invalid="ignore"):
        slots = np.flatnonzero(ages >= min_s)
    seqs = view.seqs
    owners = {
        (p, t): alive(p, t)
        for p, t in {(int(seqs["owner_pid"][s]), int(seqs["owner_start"][s])) for s in slots}
    }
    out = [
        IdleRequest(
            slot=s,
            seq_id=int(seqs["seq_id"][s]),
            pid=int(seqs["owner_pid"][s]),
            request=field_text(seqs["request"][s]),
            state=SeqState(int(seqs["state"][s])).name.lower(),
            blocks=int(seqs["num_blocks"][s]),
            idle_s=float(ages[s]),
        )
        for s in slots.tolist()
        if owners[int(seqs["owner_pid"][s]), int(seqs["owner_start"][s])]
    ]
    return sorted(out, key=lambda r: -r.idle_s)


def lock_waiters(view: SegmentView) -> set[int]:
    """The processes whose client record publishes a wait for pool locks now (the core's,
    allocator/waits.py): blocked, whatever their requests' idle times say."""
    clients = view.clients
    on = (clients["state"] == ClientState.ATTACHED) & (clients["op"] != 0)
    return {int(p) for p in clients["pid"][on].tolist()}


class Lifetimes:
    """The flight recorder's requests of one process (`pid`): each one's first event and its
    first `free` or `abort`, read from the rings once for every question about the process
    (the events of a full ring's tens of thousands, not one pass per request asked about)."""

    def __init__(self, view: SegmentView, pid: int):
        ev = view.events.reshape(-1)
        ev = ev[(ev["time_ns"] != 0) & (ev["pid"] == pid)]
        # whether the recorder holds anything of the process (it was on there)
        self.recorded = bool(len(ev))
        ev = ev[~np.isin(ev["op"], [EventOp.FINDING, EventOp.GUARD_VIOLATION])]
        ev = ev[ev["request"] != b""]
        self.keys, which = np.unique(ev["request"], return_inverse=True)
        times = ev["time_ns"].astype(np.int64)
        never = np.iinfo(np.int64).max
        self.first = np.full(len(self.keys), never)
        np.minimum.at(self.first, which, times)
        ends = np.isin(ev["op"], [EventOp.FREE, EventOp.ABORT])
        self.ended = np.full(len(self.keys), never)
        np.minimum.at(self.ended, which[ends], times[ends])
        self.last = np.full(len(self.keys), -1)
        np.maximum.at(self.last, which, times)

    def overtaken(self, request: bytes, since_wall_ns: int) -> list[str]:
        """The requests other than `request` (as the records keep it) whose whole life the
        recorder shows after `since_wall_ns` (their first event after it, and a `free` or an
        `abort`), in the order they ended. After the request's own last event too: the record's
        `active_ns` is read off the coarse clock (a tick, up to a few ms, behind), and a request
        that ended just before it began is no request served meanwhile."""
        own = np.flatnonzero(self.keys == request)
        if len(own):
            since_wall_ns = max(since_wall_ns, int(self.last[own[0]]))
        pick = np.flatnonzero(
            (self.first > since_wall_ns)
            & (self.ended != np.iinfo(np.int64).max)
            & (self.keys != request)
        )
        pick = pick[np.argsort(self.ended[pick], kind="stable")]
        return [field_text(self.keys[k]) for k in pick.tolist()]


def overtaken(view: SegmentView, pid: int, request: bytes, since_wall_ns: int) -> list[str]:
    """Lifetimes.overtaken of process `pid`: the requests the recorder shows begun and ended
    after `since_wall_ns`, other than `request`; empty without events."""
    return Lifetimes(view, pid).overtaken(request, since_wall_ns)


def idle_findings(
    view: SegmentView, alive: Alive = is_alive, now: tuple[int, int] | None = None
) -> list[Finding]:
    """`idle_request` for each running sequence of a live process that holds blocks and that the
    program has not served for `KVSCOPE_IDLE_REQUEST_S` seconds, on a live pool read at `now`
    (CLOCK_MONOTONIC and wall-clock ns; a copy's own `taken_mono_ns` and `taken_wall_ns`
    otherwise); a dump says nothing (its leaks are the exit check's). Each names what the
    same process did meanwhile."""
    now_mono, now_wall = (
        now
        if now is not None
        else (getattr(view, "taken_mono_ns", None), getattr(view, "taken_wall_ns", None))
    )
    limit = idle_threshold_s(view)
    if now_mono is None or now_wall is None or limit <= 0:
        return []
    seqs = view.seqs
    out = []
    lives: dict[int, Lifetimes] = {}
    # (a process that waits for a pool lock serves nothing until it has it: its requests
    # wait on the lock's holder, which the lock's own finding names, lock_held_too_long)
    waiting = lock_waiters(view)
    stopped: dict[int, bool] = {}
    for r in idle_requests(view, now_mono, limit, alive):
        if r.pid in waiting:
            continue
        if r.pid not in stopped:
            stopped[r.pid] = is_stopped(r.pid)
        key = seqs["request"][r.slot]
        since = now_wall - int(r.idle_s * 1e9)
        life = lives.get(r.pid) or lives.setdefault(r.pid, Lifetimes(view, r.pid))
        others = life.overtaken(bytes(key), since)
        out.append(
            Finding(
                FindingKind.IDLE_REQUEST,
                idle_message(r, others, events=life.recorded, stopped=stopped[r.pid]),
                block=own_block(view.blocks, seqs["table"][r.slot][: r.blocks].tolist(), key),
                owner_pid=r.pid,
                request=r.request,
                extra={
                    "idle_s": round(r.idle_s, 1),
                    "overtaken": len(others),
                    "state": r.state,
                    "seq_id": r.seq_id,
                },
            )
        )
    return out


def idle_message(r: IdleRequest, others: list[str], events: bool, stopped: bool = False) -> str:
    """What an idle request's finding says: how long, and what its process did meanwhile (or
    that it is stopped)."""
    for_s = f"{r.idle_s:.1f}" if r.idle_s < 10 else f"{r.idle_s:.0f}"
    head = (
        f"request {r.request!r} ({r.state}) holds {r.blocks} block(s) and pid {r.pid} has not"
        f" served it for {for_s} s (no append, mark_computed, set_state, resume or lease)"
    )
    if stopped:
        return (
            f"{head}: pid {r.pid} is stopped (SIGSTOP or a debugger) and serves nothing until"
            f" it continues (kill -CONT {r.pid})"
        )
    if others:
        named = ", ".join(repr(o) for o in others[:3]) + (", ..." if len(others) > 3 else "")
        return (
            f"{head}, while {len(others)} other request(s) of the process began and ended"
            f" ({named}): a request the scheduler dropped without pool.free or pool.abort"
            f" (an abort, a timeout, an error path, a worker that died) leaks its blocks for as"
            f" long as the server runs; one the engine parks on purpose (a slow client, a"
            f" session between turns) says so with pool.set_state(seq, 'waiting')"
        )
    if events:
        return (
            f"{head}, and no request of the process began and ended since: the process is not"
            f" serving (a hang, a wedge on PoolExhausted), or parks the request on purpose"
            f" without saying so (pool.set_state(seq, 'waiting'))"
        )
    return f"{head} (the flight recorder is off: whether the process served others meanwhile is not known)"
