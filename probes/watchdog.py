"""The lock watchdog: reports `lock_held_too_long` with the holder thread's Python stack.

    from kvscope.probes.watchdog import Watchdog, install
    install(pool, os.environ)   # lockdep on the pool and its watchdog, as the probes package does
    dog = Watchdog(pool, threshold_s=1.0).start()
    ...
    dog.stop()

Every `interval_s` a daemon thread looks at the pool's lock records and, with a LockDep, at the
traced user locks this process's threads hold. A hold by this process is timed with its own
clock (a record's `acquired_ns` is the holder's perf_counter) and reported with the holder's
stack; a hold by another process is timed from when the watchdog first saw it (the record's
sequence counter names one hold) and reported without a stack after twice the threshold,
unless already reported (by the holder's own watchdog, say).
Each hold is reported once.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

from kvscope.allocator.checklocks import held_severity, holder_advice
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.header import threshold_s
from kvscope.allocator.probeflags import LOCK_HOLD_ENV, env_flag
from kvscope.allocator.process import is_alive, process_state
from kvscope.allocator.sites import KVSCOPE_DIRS
from kvscope.probes.lockdep import ENV, LOCKDEP, LockDep, SegmentGraph

STACK_FRAMES = 10
# The standard library's folders: a holder waiting in threading.py's Condition.wait is shown at
# the program's line that waits (packages installed beside it are the program's).
STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})


def _library(filename: str) -> bool:
    """A frame of kvscope's or of the standard library's (not of a package beside it)."""
    if filename.startswith(KVSCOPE_DIRS):
        return True
    return filename.startswith(STDLIB_DIRS) and "-packages" not in filename


def thread_stack(ident: int | None) -> list[str]:
    """The innermost STACK_FRAMES frames of a thread of this process, one `file:line fn` each,
    up to the program's own call into kvscope or the standard library: a holder that waits in
    a traced lock's acquire, a Condition's wait, or runs a pool operation is shown at the line
    of the program that did it."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return []
    frames = list(traceback.extract_stack(frame))
    inner = len(frames)
    while inner > 0 and _library(frames[inner - 1].filename):
        inner -= 1
    frames = frames[: inner or len(frames)][-STACK_FRAMES:]
    return [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames]


def held_finding(
    lock: str, held_s: float, pid: int, tid: int, stack: list[str], hold: str = ""
) -> Finding:
    """The `lock_held_too_long` finding; `hold` names one hold of a pool lock (for dedupe).
    Another process's hold says what that process is doing (a stopped one, how to continue
    it), as the whole-pool check's finding does."""
    where = f", now at {stack[-1]}" if stack else ""
    which = f" ({hold})" if hold else ""
    if pid == os.getpid():
        state, why = "running", ": do not block, sleep or compute long while holding it"
    else:
        state = process_state(pid)
        why = f"; {holder_advice(pid, state)}"
    msg = f"{lock} held {held_s:.1f} s so far by pid {pid} thread {tid}{which}{where}{why}"
    return Finding(
        FindingKind.LOCK_HELD_TOO_LONG,
        msg,
        owner_pid=pid,
        severity=held_severity(state),
        extra={"lock": lock, "held_s": round(held_s, 3), "thread": tid, "stack": stack},
    )


class Watchdog:
    """A daemon thread that reports locks held longer than `threshold_s`."""

    def __init__(
        self,
        pool: Any | None = None,
        threshold_s: float = 1.0,
        interval_s: float | None = None,
        lockdep: LockDep | None = None,
    ):
        assert pool is not None or lockdep is not None, "watch a pool, a LockDep, or both"
        self.pool: Any = pool
        self.lockdep: Any = lockdep
        self.graph = SegmentGraph(pool) if pool is not None else None
        self.threshold_ns = int(threshold_s * 1e9)
        self.interval_s = interval_s if interval_s is not None else min(threshold_s / 2, 1.0)
        self.reported: set[object] = set()
        # (lock index, sequence counter) of another process's hold -> when first seen (our clock).
        self.first_seen: dict[tuple[int, int], int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Watchdog:
        """Start the watchdog thread."""
        self._thread = threading.Thread(target=self._loop, name="kvscope-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the watchdog thread and wait for it."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.pool is not None and (self.pool.closed or self.pool.pid != os.getpid()):
                return
            try:
                for report, f in self.check():
                    report(f)
            except (AttributeError, TypeError):
                # The pool was closed under us (its view is gone): nothing left to watch.
                if self.pool is not None and self.pool.closed:
                    return
                raise

    def check(self) -> list[tuple[Any, Finding]]:
        """One look: findings for holds over the threshold not reported yet, with their reporter."""
        out = self._pool_holds() if self.pool is not None else []
        if self.lockdep is not None:
            out += self._traced_holds()
        return out

    def _pool_holds(self) -> list[tuple[Any, Finding]]:
        lt, now = self.pool.locks, time.perf_counter_ns()
        out = []
        by_native = {t.native_id: t.ident for t in threading.enumerate()}
        # After a fork Thread.native_id of the main thread is the parent's; its tid is our pid.
        by_native[os.getpid()] = threading.main_thread().ident
        for i, name in enumerate(lt.names):
            seq = int(lt.seq[i])
            pid, tid, t0 = int(lt.holder_pid[i]), int(lt.holder_tid[i]), int(lt.acquired_ns[i])
            # Fields read under an odd, unchanged counter belong to one hold.
            if seq % 2 == 0 or int(lt.seq[i]) != seq or not pid or (i, seq) in self.reported:
                continue
            lock, stack = f"pool lock {name!r}", []
            if pid == lt.pid:
                held_ns, wait_ns = now - t0, self.threshold_ns
            else:
                # Twice the threshold: the holder's own watchdog, which has the stack, goes first.
                held_ns = now - self.first_seen.setdefault((i, seq), now)
                wait_ns = 2 * self.threshold_ns
            if held_ns < wait_ns:
                continue
            hold = f"hold #{seq}"
            if pid == lt.pid:
                stack = thread_stack(by_native.get(tid))
            elif not is_alive(pid, int(lt.holder_start[i])) or self._already(lock, hold):
                continue
            self.reported.add((i, seq))
            f = held_finding(lock, held_ns / 1e9, pid, tid, stack, hold)
            out.append((self._reporter(), f))
        self.first_seen = {k: v for k, v in self.first_seen.items() if int(lt.seq[k[0]]) == k[1]}
        return out

    def _reporter(self) -> Any:
        """graph.report, or only the callback while this process holds the findings lock."""
        assert self.graph is not None
        lt = self.pool.locks
        fl = self.graph.findings_lock
        return self.graph.notify if int(lt.holder_pid[fl]) == lt.pid else self.graph.report

    def _already(self, lock: str, hold: str) -> bool:
        """True when some process already reported this hold into the ring."""
        return any(
            f.kind == FindingKind.LOCK_HELD_TOO_LONG
            and lock in f.message
            and f"({hold})" in f.message
            for f in self.pool.findings()
        )

    def _traced_holds(self) -> list[tuple[Any, Finding]]:
        now, pid, out = time.perf_counter_ns(), os.getpid(), []
        for st in list(self.lockdep.threads.values()):
            for h in list(st.stack):
                # (t_ns is 0 while still waiting; pool locks are timed from their records)
                if not h.t_ns or now - h.t_ns < self.threshold_ns:
                    continue
                if not h.graph.usable():
                    continue
                key = (id(h.key), h.t_ns)
                if key in self.reported:
                    continue
                self.reported.add(key)
                lock = f"lock {h.cls!r}"
                stack = thread_stack(st.ident)
                f = held_finding(lock, (now - h.t_ns) / 1e9, pid, st.native_id, stack)
                out.append((h.graph.report, f))
        return out


def install(pool: Any, env: Mapping[str, str] = os.environ) -> LockDep | None:
    """Lockdep on `pool` and its watchdog, when lockdep is on: the LockDep; None when off.

    KVSCOPE_LOCKDEP=1/0 decides; unset, it is on under `kvscope run` (as every probe) or when
    the pool was created with `PoolConfig(lockdep=True)`.
    """
    if not (env_flag("LOCKDEP", env) or (ENV not in env and pool.config.lockdep)):
        return None
    # (this process's KVSCOPE_LOCK_HOLD_S, else the pool's: what its check says)
    hold_s = threshold_s(pool.view, LOCK_HOLD_ENV, env)
    if LOCKDEP.instrument(pool) and hold_s > 0:
        Watchdog(pool, threshold_s=hold_s, lockdep=LOCKDEP).start()
    return LOCKDEP
