"""Stopping the script of `kvscope run`: signals forwarded once, a grace period, then SIGKILL.

The script runs in kvscope's process group, as it would without kvscope: Ctrl-C at a terminal
reaches it (and every process it started) directly. While it runs, kvscope blocks SIGINT,
SIGTERM and SIGHUP in its own threads and collects them with `sigtimedwait`, which says who
sent each one: a signal another process sent to kvscope alone (`kill PID`, a service manager)
is forwarded to the script; one the terminal sent (si_code SI_KERNEL) already reached it and is
not sent twice, nor one sent to the whole process group or cgroup (`timeout -s INT`, `kill --
-PGID`, systemd's default KillMode), which a witness tells apart (below). Either way the first
one starts the grace period (`--stop-grace`, 10 s): if the script still runs when it ends, or
when a second such signal comes, it is killed with SIGKILL. The same signal from the same
sender again within a second is the same stop, not a second one (`timeout` sends it to kvscope
and then to its group).

A signal's siginfo cannot say whether its sender sent it to kvscope alone or to the whole
group. The witness can: a process of kvscope's own in its group and cgroup (`sleep`, started
with the stop signals blocked), in which a signal sent to all of them stays pending, where
/proc shows it. No library offers this, hence the few lines here. The script itself gets the parent-death signal SIGKILL (PR_SET_PDEATHSIG), so killing
kvscope, even with SIGKILL, never leaves it running on its own.

    stopper = Stopper(echo, grace_s=10.0)
    with stopper.collecting():
        proc = subprocess.Popen(cmd, preexec_fn=stopper.child_setup())
        stopper.watch(proc)
        while proc.poll() is None:
            stopper.sleep(0.05)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# siginfo si_code of a signal the kernel sent on its own: a terminal's Ctrl-C or hangup.
SI_KERNEL = 0x80
PR_SET_PDEATHSIG = 1
DEFAULT_GRACE_S = 10.0
# How long a signal kvscope got may wait for its copy in the witness: a kill of the process
# group signals every member in one system call, a cgroup's kill (systemd) one process after
# another.
WITNESS_WAIT_S = 0.1
# The same signal from the same sender again within this many seconds is the same stop.
REPEAT_S = 1.0


def _prctl() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


class Witness:
    """A `sleep` in kvscope's process group and cgroup with the stop signals blocked: a signal
    sent to the whole group stays pending in it, which tells it from one sent to kvscope alone.
    Started and replaced by the main thread only (its parent-death signal follows the thread
    that started it)."""

    def __init__(self, prctl: Callable[..., int] | None):
        self._prctl = prctl
        self.proc: subprocess.Popen[bytes] | None = self._start()

    def _start(self) -> subprocess.Popen[bytes] | None:
        prctl = self._prctl

        def setup() -> None:
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
            if prctl is not None:
                prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)

        try:
            return subprocess.Popen(
                ["sleep", "2147483647"], preexec_fn=setup, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
            )  # fmt: skip
        except OSError:
            return None  # (no `sleep`: every signal from another process is forwarded)

    def pending(self) -> set[int]:
        """The stop signals pending in the witness (empty when it is gone)."""
        if self.proc is None:
            return set()
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                status = f.read()
        except OSError:
            return set()
        mask = 0
        for line in status.splitlines():
            if line.startswith(("SigPnd:", "ShdPnd:")):
                mask |= int(line.split()[1], 16)
        return {int(s) for s in STOP_SIGNALS if mask >> (int(s) - 1) & 1}

    def saw(self, signum: int) -> bool:
        """Whether `signum` reached the witness too (waiting up to WITNESS_WAIT_S for it); the
        witness is replaced when it did, so that it is ready for the next signal."""
        deadline = time.monotonic() + WITNESS_WAIT_S
        while signum not in self.pending():
            if self.proc is None or time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        self.stop()
        self.proc = self._start()
        return True

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None


def drop_dead_terminal() -> bool:
    """After a hangup: when the terminal is gone (a write to it fails with EIO), point stdin,
    stdout and stderr at /dev/null, so what still writes to it (the TUI closing, the analysis)
    finishes instead of failing or blocking; True when it did."""
    try:
        os.write(1, b"")
        return False
    except OSError as e:
        if e.errno != errno.EIO:
            return False
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    return True


def echo(line: str) -> None:
    """One line on kvscope's stderr, at once: one write (the script writes to the same stderr,
    and print's line and newline, two writes, let its output in between)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class OutlivingStream:
    """A text stream (kvscope's stdout or stderr) whose reader may go away (`kvscope run ...
    2>&1 | head`): a write or flush that meets the closed pipe points its descriptor at
    /dev/null and carries on, so that what kvscope does after (the dump, the pool's files
    removed, the script's exit code) does not depend on anyone reading it."""

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._drop()

    def _drop(self) -> None:
        fd = self._stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        # (what the stream still buffers goes to /dev/null now)
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        # (fileno, isatty, encoding, ...: the stream's own)
        return getattr(self._stream, name)


@contextlib.contextmanager
def outliving_readers() -> Iterator[None]:
    """sys.stdout and sys.stderr as OutlivingStreams for a while (`kvscope run`)."""
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = OutlivingStream(old[0]), OutlivingStream(old[1])  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old


class Stopper:
    """Forwards stop signals to one child, and kills it when the grace period runs out."""

    def __init__(
        self,
        echo: Callable[[str], None],
        grace_s: float = DEFAULT_GRACE_S,
        before_kill: Callable[[int], None] | None = None,
    ):
        self.echo = echo
        self.grace_s = grace_s
        # called with the script's pid when the grace period ran out, before it is killed
        # (`kvscope run` shows its threads' stacks)
        self.before_kill = before_kill
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.blocked = False
        self._mask: set[int | signal.Signals] | None = None
        self._timer: threading.Timer | None = None
        self._prctl = _prctl()
        self._witness: Witness | None = None
        # the first stop: its signal, its sender's pid (0: unknown) and when it came
        self._first: tuple[int, int, float] | None = None
        # Set by every stop signal, even one that comes after the script ended: what else
        # kvscope waits on (the TUI of --live) stops waiting.
        self.stop_requested = threading.Event()

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        """Block the stop signals (collected by `sleep`), with handlers for any that another
        thread receives; restore both afterwards. Outside the main thread: nothing to do."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self._on_handler) for s in STOP_SIGNALS}
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        self.blocked = True
        self._witness = Witness(self._prctl)
        try:
            yield
        finally:
            self._witness.stop()
            self._witness = None
            self.blocked = False
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask or set())
            for s, h in old.items():
                signal.signal(s, h)
            if self._timer is not None:
                self._timer.cancel()

    @contextlib.contextmanager
    def handled(self) -> Iterator[None]:
        """Unblock the stop signals for a while (the TUI of --live): the handlers forward them."""
        if not self.blocked:
            yield
            return
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)

    def child_setup(self) -> Callable[[], None]:
        """A preexec_fn for the child: kvscope's signal mask undone, and SIGKILL when kvscope dies."""
        parent = os.getpid()
        mask = self._mask
        prctl = self._prctl

        def setup() -> None:
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            if prctl is not None:
                prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
                # kvscope died before the death signal was armed: do not run on alone.
                if os.getppid() != parent:
                    os._exit(128 + int(signal.SIGKILL))

        return setup

    def watch(self, proc: subprocess.Popen[bytes]) -> None:
        """The child to forward signals to."""
        self.proc = proc

    def sleep(self, seconds: float) -> None:
        """Wait up to `seconds`, acting on a stop signal that comes meanwhile."""
        if not self.blocked:
            time.sleep(seconds)
            return
        info = signal.sigtimedwait(STOP_SIGNALS, seconds)
        # A wait that a ptrace attach cut short (`py-spy record --subprocesses -- kvscope run`)
        # can come back with a siginfo the kernel never filled: not a signal, so not a stop.
        if info is not None and info.si_signo in STOP_SIGNALS:
            from_terminal = info.si_code == SI_KERNEL
            self.on_signal(info.si_signo, from_terminal, 0 if from_terminal else info.si_pid)

    def _on_handler(self, signum: int, frame: object) -> None:
        self.on_signal(signum, from_terminal=False)

    def on_signal(self, signum: int, from_terminal: bool, sender: int = 0) -> None:
        """Forward a stop signal unless it reached the child too (the terminal's, or one sent to
        the whole group); the first starts the grace period, a second one kills the child now.
        `sender`: the sending process's pid (0: the kernel, or not known)."""
        if signum == signal.SIGHUP:
            drop_dead_terminal()
        self.stop_requested.set()
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        name = signal.Signals(signum).name
        if self.stopping:
            if self._repeats(signum, sender):
                return
            self.kill()
            self._say(f"kvscope: {name} again: killed the script (pid {proc.pid}) with SIGKILL")
            return
        self.stopping = True
        self._first = (signum, sender, time.monotonic())
        if from_terminal:
            sent = "sent to"
        elif self._group_wide(signum, proc):
            sent = "sent to the whole process group, so also to"
        else:
            sent = "forwarded to"
            proc.send_signal(signum)
        self._timer = threading.Timer(self.grace_s, self._grace_over)
        self._timer.daemon = True
        self._timer.start()
        self._say(
            f"kvscope: {name} {sent} the script (pid {proc.pid}); it is killed with SIGKILL"
            f" if it still runs in {self.grace_s:g} s (--stop-grace) or on a second signal"
        )

    def _group_wide(self, signum: int, proc: subprocess.Popen[bytes]) -> bool:
        """Whether `signum` was sent to kvscope's whole process group (or cgroup), the script
        with it: the witness got it too, and the script is still in kvscope's group."""
        witness = self._witness
        if witness is None or threading.current_thread() is not threading.main_thread():
            return False
        try:
            if os.getpgid(proc.pid) != os.getpgrp():
                return False
        except ProcessLookupError:
            return False
        return witness.saw(signum)

    def _repeats(self, signum: int, sender: int) -> bool:
        """Whether a signal is the first stop's own again: the same signal from the same
        process (not the terminal) within REPEAT_S."""
        first = self._first
        return (
            first is not None
            and sender != 0
            and (signum, sender) == first[:2]
            and time.monotonic() - first[2] < REPEAT_S
        )

    def _grace_over(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            if self.before_kill is not None:
                # (whatever it meets, the script is killed after it)
                with contextlib.suppress(Exception):
                    self.before_kill(proc.pid)
            # (killed first: the line is said after, where kvscope's stderr may be gone, a pipe
            # whose reader exited)
            self.kill()
            self._say(
                f"kvscope: the script (pid {proc.pid}) still ran {self.grace_s:g} s after the"
                " stop signal: killed it with SIGKILL"
            )

    def _say(self, line: str) -> None:
        """echo a line where kvscope's stderr may be closed (`kvscope run ... 2>&1 | head`):
        what the stopper does never depends on being able to say it."""
        with contextlib.suppress(OSError):
            self.echo(line)

    def kill(self) -> None:
        """SIGKILL the child if it still runs."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
