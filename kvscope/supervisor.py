"""The parent side of `kvscope run`: start the child, follow its pools, dump and analyze at the end.

The child (kvscope.bootstrap), and every process it starts, lists each pool it opens in the run
directory (kvscope/child.py). The supervisor maps each one read-only and, every `interval_s`,
prints the findings new in its findings ring and checks its header, so a finding shows up while
the script runs. It also samples each pool's counters into a bounded time series
(kvscope.history), which `kvscope run` writes beside the dump. The pool lives in /dev/shm:
after the child exits, however it exits (SIGKILL included), the supervisor still reads it whole. A process of the run that dies while attached to a pool
(a worker killed with `kill -9`) is said the first poll that sees it gone, with the blocks it
left held (`leak_dead_owner`), or once a survivor's `pool.reclaim_dead()` has recorded it:
one line either way. A pool whose requests hold blocks while no process operates on it for
`hang_after_s` (a deadlocked or stuck server) is said once per stall, with the script's threads'
stacks; a running request that its live process has not served for KVSCOPE_IDLE_REQUEST_S while
holding blocks (`idle_request`, allocator/idle.py: a leak in the making) is said as it lands, once
more at IDLE_AGAIN times that, and again after it is served and idles again.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvscope.allocator.check import check_header, lock_findings
from kvscope.allocator.checklocks import lock_named
from kvscope.allocator.dumpfile import layout_of_prefix
from kvscope.allocator.errors import PoolError
from kvscope.allocator.findings import (
    ERROR,
    LEAK_KINDS,
    WARNING,
    Finding,
    FindingKind,
    read_findings,
)
from kvscope.allocator.findingset import Origin, pool_findings, said_key
from kvscope.allocator.idle import idle_findings, idle_threshold_s
from kvscope.allocator.layout import (
    COUNTER_FIELDS,
    BlockState,
    ClientState,
    Layout,
    SegmentView,
    SeqState,
)
from kvscope.allocator.process import is_alive
from kvscope.allocator.segment import data_path, segment_path
from kvscope.allocator.snapshot import snapshot
from kvscope.bootstrap import launch
from kvscope.child import pool_key, stacks_said
from kvscope.history import History
from kvscope.poolsummary import field_text, some
from kvscope.stopper import Stopper

try:
    from kvscope import _sigbus  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: a cut between check and read still kills
    _sigbus = None

# How often each pool's counters are sampled (kvscope.history stretches it on large pools).
HISTORY_INTERVAL_S = 0.1
# Findings of one kind printed as they land, per pool; the rest are in the verdict and the dump.
LIVE_LINES_PER_KIND = 10
# How often the stall watch (`hang_after_s`, `kvscope run --hang-after`) looks at a pool.
STALL_CHECK_S = 1.0
# An idle request said at KVSCOPE_IDLE_REQUEST_S is said once more, still not served, at this
# many times it (a leak only grows; a parked request is seldom parked that long).
IDLE_AGAIN = 10


def dead_owner(view: SegmentView, pid: int) -> Finding | str:
    """What a process of the run that ended attached to the pool without its exit check left:
    a `leak_dead_owner` finding naming the blocks it held and their requests (its live
    sequences'), or a line when it held none. Its exit check (kvscope's at-exit hook) did not
    run, so it did not end through Python's exit: os._exit (a forked worker's usual end), a
    signal or a crash."""
    b = view.blocks
    mine = b["owner_pid"] == pid
    held = np.flatnonzero(mine & (b["state"] == BlockState.ALLOCATED))
    cached = int((mine & (b["state"] == BlockState.LOCAL)).sum())
    how = "without closing it or running its exit check: os._exit, a signal or a crash"
    if not len(held) and not cached:
        return f"pid {pid} died while attached to the pool ({how}), holding no block"
    seqs = view.seqs
    live = (seqs["state"] != SeqState.EMPTY) & (seqs["owner_pid"] == pid)
    names = list(dict.fromkeys(field_text(r) for r in seqs["request"][live].tolist()))
    of = f" of request(s) {some(map(repr, names))}" if names else ""
    local = f" and {cached} free in its local cache" if cached else ""
    # (blocks other processes allocated that only its sequences still map, by prefix hits:
    # held by it too, as the whole-pool check counts them)
    table = seqs["table"][live]
    refs = np.bincount(table[table >= 0], minlength=len(b))
    theirs = (refs > 0) & ~mine & (b["state"] == BlockState.ALLOCATED) & (b["refcount"] == refs)
    more = int(theirs.sum())
    shared = (
        f"; its requests were also the last to map {more} block(s) other processes allocated"
        if more
        else ""
    )
    return Finding(
        FindingKind.LEAK_DEAD_OWNER,
        f"pid {pid} died while attached to the pool ({how}), holding {len(held)} block(s)"
        f"{of}{local}{shared}: they stay held until a survivor calls pool.reclaim_dead() or"
        " `kvscope check --repair` runs",
        block=int(held[0]) if len(held) else None,
        owner_pid=pid,
        request=names[0] if names else None,
    )


@dataclass
class Watched:
    """One pool the child opened, mapped read-only by the supervisor."""

    name: str
    created_ns: int
    path: str
    layout: Layout
    header_prefix: bytes
    view: SegmentView
    fd: int = -1
    seen: int = 0
    header_reported: bool = False
    truncated_to: int | None = None
    cut_reported: bool = False
    unlinked_to: str | None = None
    history: History | None = None
    # Processes seen dead while still attached (each said once).
    dead_seen: set[int] = field(default_factory=set)
    # Findings printed as they landed, per kind (LIVE_LINES_PER_KIND each, then one line).
    shown: dict[str, int] = field(default_factory=dict)
    # What the ring's findings said (findingset.said_key): one said again is not new.
    said: set[tuple] = field(default_factory=set)
    # The mapping's length (the layout's end), checked against the file several times a poll.
    size: int = 0
    # The stall watch: what the pool's operations last changed (`progress`), when the watch saw
    # it change (monotonic seconds), when it looked last, and whether this stall was said.
    progress: tuple[int, ...] = ()
    progress_at: float = 0.0
    progress_looked: float = 0.0
    stall_said: bool = False
    # The last stall said: since when (the monotonic second of the last progress before it; 0:
    # none said), until when (0 while it lasts) and how many requests held blocks then.
    stalled_at: float = 0.0
    stalled_end: float = 0.0
    stalled_held: int = 0
    # The idle watch (allocator/idle.py): when it looked last, and for each sequence (pid,
    # seq_id) whose idle_request was said, its idle seconds then and how many times it was
    # said in this idle stretch (once at the threshold, once more at IDLE_AGAIN times it).
    idle_looked: float = 0.0
    idle_said: dict[tuple[int, int], tuple[float, int]] = field(default_factory=dict)
    # The lock watch: when it looked last, and the (lock, holder pid) held too long then.
    locks_looked: float = 0.0
    locks_said: set[tuple[str, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.size = self.layout.offsets()["end"]

    def stall_note(self) -> str:
        """The last stall said, in a few words for the dump's reason ("" when none): how long
        it lasted, or has lasted so far."""
        if not self.stalled_at:
            return ""
        end = self.stalled_end or time.monotonic()
        return (
            f"hung {end - self.stalled_at:.0f} s with {self.stalled_held} request(s) holding blocks"
        )

    def check_size(self) -> bool:
        """True while the file is still as long as the mapping (reading a page the file lost
        would kill this process with SIGBUS); remembers the size it shrank to."""
        size = os.fstat(self.fd).st_size
        if size < self.size:
            self.truncated_to = size
        return self.truncated_to is None

    @property
    def key(self) -> str:
        return pool_key(self.name, self.created_ns)


class ShortFile(ValueError):
    """A segment file shorter than its layout (truncated): mapping it would SIGBUS."""


def map_readonly(path: str, layout: Layout) -> tuple[SegmentView, int]:
    """A read-only view of a segment file laid out as `layout` (whatever its header says now),
    and the descriptor it was mapped from (kept open, so that its size can be checked)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        need, size = layout.offsets()["end"], os.fstat(fd).st_size
        if size < need:
            raise ShortFile(
                f"its segment file is {size} bytes, shorter than its layout ({need}): it is not"
                " read, and every process still using it dies of SIGBUS"
            )
        mm = mmap.mmap(fd, need, mmap.MAP_SHARED, mmap.PROT_READ)
    except BaseException:
        os.close(fd)
        raise
    view = SegmentView(mm, layout)
    if _sigbus is not None:
        # A cut between a size check and a read reads zeros here, not SIGBUS: the reader checks
        # the size again afterwards and drops what it read (kvscope/csrc/sigbus.c).
        _sigbus.guard(view.raw.ctypes.data, need)
    return view, fd


def _read_lines(path: str) -> list[list[str]]:
    try:
        with open(path) as f:
            return [ln.rstrip("\n").split("\t") for ln in f if ln.endswith("\n")]
    except FileNotFoundError:
        return []


@dataclass
class Outcome:
    """How the child ended and what the supervisor saw."""

    returncode: int
    exception: dict[str, Any] | None = None
    exit_checks: dict[str, Any] = field(default_factory=dict)

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode < 0 else None

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    def describe(self, pid: int) -> str:
        """One sentence: how the child ended."""
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = f"signal {self.signal}"
            return f"child pid {pid} was killed by {name}"
        if self.exception:
            e = self.exception
            said = f"{e['type']}: {e['message']}" if e["message"] else e["type"]
            return f"child pid {pid} raised {said} ({e['where']})"
        if self.returncode:
            return f"child pid {pid} exited with status {self.returncode}"
        return f"child pid {pid} exited normally"


class Supervisor:
    """Runs one child under the bootstrap and follows the pools it opens."""

    def __init__(
        self,
        target: list[str],
        *,
        run_dir: str,
        env: dict[str, str],
        echo: Callable[[str], None],
        interval_s: float = 0.05,
        fail_on: str = "error",
        stopper: Stopper | None = None,
        proc: subprocess.Popen[bytes] | None = None,
        hang_after_s: float = 0.0,
    ):
        """Args:
        proc: the child, when already started (`kvscope.bootstrap.launch`); else `start()`.
        hang_after_s: a pool whose requests hold blocks with no operation for this long is
            said to look hung (0: never).
        """
        self.target = target
        self.run_dir = run_dir
        self.env = env
        self.echo = echo
        self.interval_s = interval_s
        # Findings are echoed with the severity --fail-on gives them (`fails`).
        self.fail_on = fail_on
        self.stopper = stopper if stopper is not None else Stopper(lambda line: self.echo(line))
        self.pools: dict[str, Watched] = {}
        # Pools whose file was already too short when found (said once each).
        self._short: set[str] = set()
        self.live_findings: list[Finding] = []
        self.proc = proc
        self.hang_after_s = hang_after_s

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, **popen_kw: Any) -> None:
        """Start the child: `python -m kvscope.bootstrap <target>` (popen_kw: its pipes)."""
        self.proc = launch(self.target, self.env, self.stopper, **popen_kw)

    def poll(self) -> list[Finding]:
        """Map pools the child opened since the last poll and return findings new since then."""
        self._discover()
        new: list[Finding] = []
        for w in self.pools.values():
            for f in self._new_findings(w):
                key = said_key(f)
                if key in w.said:
                    continue
                w.said.add(key)
                if f.kind == FindingKind.LOCK_HELD_TOO_LONG and lock_named(f.message):
                    # (a pool lock's: one line per holding, whether the lock watch below or
                    # a process's watchdog, into the ring, saw it first)
                    if _hold(f) in w.locks_said:
                        continue
                    w.locks_said.add(_hold(f))
                if f.kind == FindingKind.LEAK_DEAD_OWNER and f.owner_pid:
                    # A survivor's reclaim of a dead process (allocator/recovery.py): said
                    # once, whether this poll or an earlier one (`_deaths`) saw it first.
                    if f.owner_pid in w.dead_seen:
                        continue
                    w.dead_seen.add(f.owner_pid)
                shown = replace(f, severity=ERROR if fails(f, self.fail_on) else WARNING)
                self._echo_live(w, shown)
                new.append(f)
            for death in self._deaths(w):
                if isinstance(death, str):
                    self.echo(f"kvscope: pool {w.name!r}: {death}")
                    continue
                shown = replace(death, severity=ERROR if fails(death, self.fail_on) else WARNING)
                self._echo_live(w, shown)
                new.append(death)
            self._sample(w)
            new += self._watch_locks(w)
            self._watch_stall(w)
            new += self._watch_idle(w)
        self.live_findings += new
        return new

    def _watch_stall(self, w: Watched) -> None:
        """Say once per stall that the pool's requests hold blocks and no process has operated
        on it for hang_after_s, with the script's threads' stacks (threads that wait for each
        other's locks deadlocked). Progress is any change of the clients' and the header's
        operation counters or of the live sequences' lengths (a decode's append)."""
        now = time.monotonic()
        if not self.hang_after_s or now - w.progress_looked < STALL_CHECK_S:
            return
        w.progress_looked = now
        if w.header_reported or not self._whole(w):
            return
        view = w.view
        live = view.seqs["state"] != SeqState.EMPTY
        lengths = view.seqs["num_tokens"][live]
        progress = (
            *(int(view.clients[c].sum()) for c in COUNTER_FIELDS),
            *(int(view.header[c][0]) for c in COUNTER_FIELDS),
            int(lengths.sum()),
            int(live.sum()),
        )
        if not self._whole(w):
            return
        if progress != w.progress or not w.progress_at:
            if w.stall_said:
                w.stalled_end = now
            w.progress, w.progress_at, w.stall_said = progress, now, False
            return
        # (a dead process's requests wait on nothing: its death is said on its own)
        seqs = view.seqs
        held = [
            i
            for i in np.flatnonzero(live & (seqs["num_blocks"] > 0)).tolist()
            if is_alive(int(seqs["owner_pid"][i]), int(seqs["owner_start"][i]))
        ]
        idle_s = now - w.progress_at
        if w.stall_said or not held or idle_s < self.hang_after_s:
            return
        w.stall_said = True
        w.stalled_at, w.stalled_end, w.stalled_held = w.progress_at, 0.0, len(held)
        requests = [field_text(seqs["request"][i]) for i in held]
        pids = sorted({int(seqs["owner_pid"][i]) for i in held})
        self.echo(
            f"kvscope: pool {w.name!r}: no pool operation for {idle_s:.0f} s while"
            f" {len(held)} request(s) hold blocks ({some([repr(r) for r in requests], 4)};"
            f" pid {', '.join(map(str, pids))}): the script looks hung (--hang-after)"
        )
        if self.proc is not None and self.proc.poll() is None:
            pid = self.proc.pid
            # (the other processes holding the requests: the script's workers)
            others = {
                p: "holds "
                + some(
                    [repr(r) for i, r in zip(held, requests) if int(seqs["owner_pid"][i]) == p], 4
                )
                for p in pids
            }
            said = stacks_said(pid, self.run_dir, f"the script (pid {pid}) looks hung", others)
            if said:
                self.echo(said)

    def _watch_locks(self, w: Watched) -> list[Finding]:
        """A pool lock a live process has held past KVSCOPE_LOCK_HOLD_S (lock_held_too_long:
        a holder stopped, or blocking inside a callback), said as it lands, once per holding:
        every process that needs the lock waits behind it, so it is what a stall of the run
        comes from. A lock let go and held too long again is said again."""
        now = time.monotonic()
        if now - w.locks_looked < STALL_CHECK_S or w.header_reported:
            return []
        w.locks_looked = now
        if not self._whole(w):
            return []
        stalls = [
            f
            for f in lock_findings(w.view, now_mono_ns=time.monotonic_ns())
            if f.kind == FindingKind.LOCK_HELD_TOO_LONG
        ]
        new = [f for f in stalls if _hold(f) not in w.locks_said]
        # (a hold no longer seen is said again if it comes back)
        w.locks_said = {_hold(f) for f in stalls}
        for f in new:
            self._echo_live(w, replace(f, severity=ERROR if fails(f, self.fail_on) else WARNING))
        return new

    def _watch_idle(self, w: Watched) -> list[Finding]:
        """The pool's requests that their live process has not served for
        KVSCOPE_IDLE_REQUEST_S (idle_request), each said as it lands, and once more if it is
        still not served at IDLE_AGAIN times that: in a server that never exits, a request
        dropped without pool.free is otherwise said by no exit check. A request served again
        and idle again is said again. Not while a stall of the whole pool is said (its line
        names the requests)."""
        now = time.monotonic()
        if now - w.idle_looked < STALL_CHECK_S or w.header_reported or w.stall_said:
            return []
        w.idle_looked = now
        if not self._whole(w):
            return []
        new = []
        again_s = idle_threshold_s(w.view) * IDLE_AGAIN
        for f in idle_findings(w.view, now=(time.monotonic_ns(), time.time_ns())):
            key = (f.owner_pid or 0, int(f.extra["seq_id"]))
            w.idle_said[key], say = idle_to_say(
                w.idle_said.get(key, (0.0, 0)), float(f.extra["idle_s"]), again_s
            )
            if not say:
                continue
            self._echo_live(w, replace(f, severity=ERROR if fails(f, self.fail_on) else WARNING))
            new.append(f)
        return new

    def _echo_live(self, w: Watched, f: Finding) -> None:
        """Print a finding as it lands: the first LIVE_LINES_PER_KIND of each kind of a pool,
        then one line saying that the rest of that kind are counted by the verdict (and listed
        by the dump, where the run writes one) only
        (one systematic bug finds one block after another: the first lines say what it is)."""
        n = w.shown.get(f.kind, 0) + 1
        w.shown[f.kind] = n
        if n <= LIVE_LINES_PER_KIND:
            self.echo(f"kvscope: pool {w.name!r}: {f.line()}")
        elif n == LIVE_LINES_PER_KIND + 1:
            self.echo(
                f"kvscope: pool {w.name!r}: more {f.kind} findings: not printed as they land "
                "(the verdict counts every one; a dump, where the run writes one, lists them)"
            )

    def _deaths(self, w: Watched) -> list[Finding | str]:
        """Processes of the run newly seen dead while attached to the pool: a `leak_dead_owner`
        finding for one that left blocks held, a line for one that held none. Left out: the
        script (how it ended is the run's verdict) and a process whose exit check ran (it
        ended normally, and the check reported what it still held)."""
        if w.header_reported or not self._whole(w):
            return []
        # Read in place (every poll: no copy of the table); each value is read whole.
        c = w.view.clients
        attached = np.flatnonzero(c["state"] == ClientState.ATTACHED).tolist()
        if not self._whole(w):
            return []
        out: list[Finding | str] = []
        script = self.proc.pid if self.proc is not None else -1
        for i in attached:
            pid = int(c["pid"][i])
            if pid in w.dead_seen or pid == script or is_alive(pid, int(c["start"][i])):
                continue
            w.dead_seen.add(pid)
            if os.path.exists(self._p(f"exit.{pid}")):
                continue
            said = dead_owner(w.view, pid)
            if not self._whole(w):
                return out
            out.append(said)
        return out

    def _sample(self, w: Watched, *, now: bool = False) -> None:
        """Add to the pool's time series when a sample is due (`now`: always)."""
        if w.header_reported:
            return  # its counters cannot be trusted any more
        if not self._whole(w):
            return  # reading a page the file lost would kill this process (SIGBUS)
        if w.history is None:
            w.history = History.for_view(w.view, interval_s=HISTORY_INTERVAL_S)
        before = w.history.count
        if now:
            w.history.add(w.view)
        else:
            w.history.sample(w.view)
        if not self._whole(w):
            w.history.count = min(w.history.count, before)  # read (partly) from zero pages

    def _discover(self) -> None:
        for name, created, path in (r for r in _read_lines(self._p("pools")) if len(r) == 3):
            key = pool_key(name, int(created))
            if key in self.pools:
                continue
            try:
                with open(self._p("hdr." + key), "rb") as f:
                    prefix = f.read()
            except FileNotFoundError:
                continue
            layout = layout_of_prefix(prefix)
            if layout is None:
                continue
            where = self._unlinked().get(key, path)
            try:
                view, fd = map_readonly(where, layout)
            except ShortFile as e:
                if key not in self._short:
                    self._short.add(key)
                    self.echo(f"kvscope: pool {name!r}: {e}")
                continue
            except (FileNotFoundError, ValueError, OSError):
                continue
            self.pools[key] = Watched(name, int(created), where, layout, prefix, view, fd)
        for key, aside in self._unlinked().items():
            if key in self.pools:
                self.pools[key].unlinked_to = aside

    def _unlinked(self) -> dict[str, str]:
        return {
            pool_key(r[0], int(r[1])): r[2] for r in _read_lines(self._p("unlinks")) if len(r) == 3
        }

    def _whole(self, w: Watched) -> bool:
        """True while the pool's file is whole; says so once when it is found cut short."""
        if w.truncated_to is None and w.check_size():
            return True
        if not w.cut_reported:
            w.cut_reported = True
            self.echo(
                f"kvscope: pool {w.name!r}: its segment file shrank to {w.truncated_to} bytes"
                f" (it needs {w.layout.offsets()['end']}): every process still using it will"
                " die of SIGBUS; it is no longer read"
            )
        return False

    def _new_findings(self, w: Watched) -> list[Finding]:
        if w.header_reported or not self._whole(w):
            return []
        v = w.view
        # Copies of the header and the findings ring only: cheap at any pool size.
        small = SimpleNamespace(
            h=v.header.copy()[0], findings=v.findings.copy(), raw=v.raw[:4096].copy()
        )
        small.layout = w.layout
        bad = check_header(small, w.header_prefix)  # type: ignore[arg-type]
        if bad:
            # The header's counters cannot be trusted any more: report once, stop reading.
            w.header_reported = True
            return bad
        head = int(small.h["findings_head"])
        try:
            recorded = read_findings(small)  # type: ignore[arg-type]
        except ValueError:
            return []
        if not self._whole(w):
            return []  # cut while it was read (the lost pages read as zeros)
        first = head - len(recorded)
        new = recorded[max(0, w.seen - first) :]
        w.seen = head
        return new

    def wait(self) -> Outcome:
        """Poll until the child exits; then one last poll and the child's own records."""
        assert self.proc is not None
        while self.proc.poll() is None:
            self.poll()
            self.stopper.sleep(self.interval_s)
        self.poll()
        for w in self.pools.values():
            self._sample(w, now=True)
        for w, pid in self.still_attached():
            self.echo(
                f"kvscope: pid {pid} is still attached to pool {w.name!r} and still running"
                " after the script ended: a process of the run outlived it"
            )
        exc = None
        try:
            with open(self._p("exception")) as f:
                exc = json.load(f)
        except (FileNotFoundError, ValueError):
            pass
        checks: dict[str, Any] = {}
        try:
            with open(self._p(f"exit.{self.proc.pid}")) as f:
                checks = json.load(f)
        except (FileNotFoundError, ValueError):
            pass
        return Outcome(self.proc.returncode, exc, checks)

    def still_attached(self) -> list[tuple[Watched, int]]:
        """Live processes (other than this one) still attached to a pool of the run."""
        out = []
        me = os.getpid()
        for w in self.pools.values():
            if not w.check_size():
                continue
            # Read in place, as `_deaths` does (each value is read whole): a copy of the whole
            # segment for three columns of the client table costs more than the rest of the
            # run's end.
            c = w.view.clients
            attached = np.flatnonzero(c["state"] == ClientState.ATTACHED).tolist()
            found = [(int(c["pid"][i]), int(c["start"][i])) for i in attached]
            if not w.check_size():
                continue
            out += [(w, pid) for pid, start in found if pid != me and is_alive(pid, start)]
        return out

    def final_findings(self, w: Watched) -> tuple[SegmentView, list[Finding]]:
        """A consistent copy of the pool now, and every finding in it (recorded and checked);
        PoolError when its file was truncated meanwhile."""

        def whole() -> None:
            if not w.check_size():
                raise PoolError(
                    f"pool {w.name!r} cannot be dumped: its segment file shrank to"
                    f" {w.truncated_to} bytes"
                )

        whole()
        snap = snapshot(w.view)
        whole()  # a cut while the copy was taken: it read zero pages
        # As every reader assembles them (the KV data's checks and its file's findings too),
        # from where the pool's files are now (renamed aside when the script unlinked it).
        where = (w.unlinked_to or w.path) + ".data"
        origin = Origin.live(w.name, data_file=where, again=lambda: snapshot(w.view))
        return snap, pool_findings(snap, origin).findings

    def segment_of(self, name: str) -> str:
        """Where the segment file of the run's pool `name` is now (renamed aside when the
        script unlinked it; the last one opened under that name)."""
        for w in reversed(list(self.pools.values())):
            if w.name == name:
                return w.unlinked_to or w.path
        return segment_path(name)

    def remove_pool(self, w: Watched) -> bool:
        """Unlink the pool's files when its name still names the segment the run watched (not
        one created again under that name since); True when removed."""
        path = segment_path(w.name)
        try:
            if w.fd < 0 or os.stat(path).st_ino != os.fstat(w.fd).st_ino:
                return False
            os.unlink(path)
        except FileNotFoundError:
            return False
        try:
            os.unlink(data_path(w.name))
        except FileNotFoundError:
            pass
        return True

    def cleanup(self) -> None:
        """Remove the files of pools the child unlinked (renamed aside until now)."""
        for w in self.pools.values():
            if w.fd >= 0:
                os.close(w.fd)
                w.fd = -1
                if _sigbus is not None:
                    _sigbus.unguard(w.view.raw.ctypes.data)
            if w.unlinked_to:
                for p in (w.unlinked_to, w.unlinked_to + ".data"):
                    try:
                        os.unlink(p)
                    except FileNotFoundError:
                        pass

    def _p(self, name: str) -> str:
        return os.path.join(self.run_dir, name)


def _hold(f: Finding) -> tuple[str, int]:
    """A lock_held_too_long's holding: the pool lock its message names and its holder."""
    return lock_named(f.message), f.owner_pid or 0


def idle_to_say(
    was: tuple[float, int], idle_s: float, again_s: float
) -> tuple[tuple[float, int], bool]:
    """The idle watch's rule for one request found idle: `was` its idle seconds when last seen
    idle and how many times this idle stretch was said; whether to say it now (the first time,
    and once more at `again_s`; a request idle for less than when last seen was served since:
    a new stretch), and what to keep."""
    was_s, said = was
    if idle_s < was_s:
        said = 0
    if said >= (2 if idle_s >= again_s else 1):
        return (idle_s, said), False
    return (idle_s, said + 1), True


def is_leak(f: Finding) -> bool:
    """True for the leak kinds."""
    return f.kind in LEAK_KINDS


def is_error(f: Finding) -> bool:
    """True for a finding of severity error that is not a leak."""
    return f.severity == ERROR and not is_leak(f)


def fails(f: Finding | dict[str, Any], fail_on: str) -> bool:
    """True when the finding makes `kvscope run --fail-on fail_on` fail: `error`, a finding of
    severity error that is not a leak; `leak`, that or any leak; `never`, nothing."""
    kind, severity = (f["kind"], f["severity"]) if isinstance(f, dict) else (f.kind, f.severity)
    leak = kind in LEAK_KINDS
    if fail_on == "error":
        return severity == ERROR and not leak
    if fail_on == "leak":
        return severity == ERROR or leak
    return False
