"""The hooks every process of a `kvscope run` carries, the script's and each one it starts.

`install()` runs once per process. The bootstrap calls it before the script runs; a process the
script starts gets it from `import kvscope` (kvscope/__init__.py), which installs it whenever
`KVSCOPE_RUN_DIR` names an existing directory. That variable is inherited by every child, and a
process cannot open a pool without importing kvscope first, so spawn, forkserver and
`subprocess` children come up with the same hooks as forked ones, which inherit them anyway.

The hooks record in the run directory:

- `pools`: one line per pool a process opens (`name<TAB>created_ns<TAB>segment path`), and
  `hdr.<name>.<created_ns>`, the segment header's first bytes, so the supervisor can lay out and
  dump the pool even after a SIGKILL or a scribbled header;
- `unlinks`: pools the script unlinked; the files are renamed aside (the name is free again) and
  the supervisor removes them after it has dumped and analyzed them;
- `exit.<pid>`: what the leak check at that process's exit found, as JSON;
- `stacks.PID`: every thread's Python stack, written by faulthandler at STACKS_SIGNAL (below),
  and `threads.PID` the threads' names;
- `faults`: one line per injected fault (`fired<TAB>name<TAB>pid`) the moment it acts, and one
  per fault still armed when a process exits (`unfired<TAB>name<TAB>pid`): a run whose fault
  never fired in any process proved nothing (`run_faults`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import IO, Any

from kvscope.allocator import faults
from kvscope.allocator.checkrefs import own_block
from kvscope.allocator.errors import HandleInherited, PoolError
from kvscope.allocator.findings import LEAK_KINDS, Finding, FindingKind
from kvscope.allocator.probeflags import env_flag
from kvscope.allocator.segment import data_path, segment_path
from kvscope.probes.leaks import creation_site, summary
from kvscope.probes.process_exit import at_exit

RUN_DIR_ENV = "KVSCOPE_RUN_DIR"
HEADER_PREFIX_BYTES = 256
# At most this many check findings are written to a pool's findings ring at exit.
MAX_EXIT_FINDINGS = 32

_pools: list[Any] = []
# id(pool) -> the created_ns of its segment (a closed pool no longer has a view to read it from).
_created: dict[int, int] = {}
_install_lock = threading.Lock()
_installed = False


def run_dir() -> str | None:
    """The supervisor's run directory; None outside a run or once the run is over."""
    path = os.environ.get(RUN_DIR_ENV)
    return path if path and os.path.isdir(path) else None


def _append(name: str, line: str) -> None:
    """Append one line to a run-directory file (O_APPEND: lines of many processes stay whole)."""
    where = run_dir()
    if where is None:
        return
    fd = os.open(os.path.join(where, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def pool_key(name: str, created_ns: int) -> str:
    """Names one creation of a pool (a name can be unlinked and created again)."""
    return f"{name}.{created_ns}"


def on_open(pool: Any) -> None:
    """OPEN_HOOKS entry: record the pool and its intact header for the supervisor."""
    where = run_dir()
    if where is None:
        return
    created = int(pool.view.h["created_ns"])
    hdr = os.path.join(where, "hdr." + pool_key(pool.name, created))
    if not os.path.exists(hdr):
        # Written aside and renamed: a supervisor that sees the file sees all of it, even when
        # two processes open the same pool at once.
        tmp = f"{hdr}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(pool.view.raw[:HEADER_PREFIX_BYTES].tobytes())
        os.replace(tmp, hdr)
    _append("pools", f"{pool.name}\t{created}\t{segment_path(pool.name)}")
    _pools.append(pool)
    _created[id(pool)] = created


def on_unlink(pool: Any) -> None:
    """UNLINK_HOOK: rename the pool's files aside; the supervisor unlinks them after the dump."""
    created = _created.get(id(pool), 0)
    aside = f"{pool.name}.unlinked-{os.getpid()}-{created % 10**9}"
    try:
        os.rename(segment_path(pool.name), segment_path(aside))
    except FileNotFoundError:
        return
    try:
        os.rename(data_path(pool.name), data_path(aside))
    except FileNotFoundError:
        pass
    _append("unlinks", f"{pool.name}\t{created}\t{segment_path(aside)}")


def report_held(pool: Any, when: str) -> tuple[list[Any], int]:
    """Report each sequence of this process that still holds blocks, or waits preempted, as
    leak_finished, and print the LEAK SUMMARY of the same sequences (with the leaks probe
    on)."""
    seqs = held(pool)
    for seq in seqs:
        # Named after the call that created the sequence (its allocate, or the fork of a sample
        # sharing its parent's blocks): the block it is shown by may be another request's.
        site = creation_site(pool.view, seq.slot)
        made = f" (created at {site})" if site else ""
        what = (
            f"still held {len(seq.block_table)} block(s) when {when}: free or abort every"
            " sequence when its request ends"
            if seq.block_table
            else f"was preempted and neither resumed nor ended when {when}: free or abort every"
            " sequence when its request ends, a preempted one too"
        )
        pool.report(
            Finding(
                FindingKind.LEAK_FINISHED,
                f"request {seq.request_id!r}{made} {what}",
                block=own_block(
                    pool.view.blocks, seq.block_table, str(seq.request_id).encode()[:32]
                ),
                owner_pid=os.getpid(),
                request=str(seq.request_id)[:32],
            )
        )
    exited = when.removeprefix(EXITED)
    leak_summary(pool, seqs, f"at exit{exited}" if exited != when else f"when {when}")
    return seqs, sum(len(seq.block_table) for seq in seqs)


EXITED = "the process exited"


def exit_when() -> str:
    """How this process is exiting, for its leaks: EXITED, and `raising NAME` where an
    exception is ending it (a multiprocessing child's target that raised: its exit check runs
    in the finally that the exception passes through; kvscope.analysis names its leaks by the
    failure)."""
    exc = sys.exc_info()[1]
    if exc is None or isinstance(exc, SystemExit) and exc.code in (0, None):
        return EXITED
    return f"{EXITED} raising {type(exc).__name__}"


def held(pool: Any) -> list[Any]:
    """This process's sequences of `pool` that hold blocks, or wait preempted (no block: a
    request the engine lost while it waited)."""
    return [s for s in pool.live().values() if s.block_table or s.state == "preempted"]


def leak_summary(pool: Any, seqs: list[Any], when: str) -> None:
    """With the leaks probe on, the LEAK SUMMARY of `seqs` on stderr."""
    text = summary(pool, seqs, when)
    if text is not None and env_flag("LEAKS"):
        # (one write: print's separate newline lets another process's summary in between)
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def on_close(pool: Any) -> None:
    """CLOSE_HOOK: the sequences still live are leaks, which the close reports (the core's
    leak_finished, as it aborts them): their LEAK SUMMARY first, with the leaks probe on; and
    the pool's KV data is checked while this process can still read it (the supervisor checks
    the rest at the end of the run, when no other process is busy with the pool)."""
    if pool.pid == os.getpid():
        leak_summary(pool, held(pool), "when the pool was closed")
        report_checked(pool, data_only=True)


def report_checked(pool: Any, data_only: bool = False) -> list[Finding]:
    """`pool.check()` (with data_only, only its KV data checks), and its findings about this
    process (or no process) into the ring; not its own requests found idle (`idle_request`):
    at its exit or close they are the leaks report_held names."""
    from kvscope.allocator.integrity import check_kv
    from kvscope.allocator.snapshot import snapshot

    me = os.getpid()
    if data_only:
        found = check_kv(snapshot(pool.view), pool.kv, again=lambda: snapshot(pool.view))
    else:
        found = pool.check()
    mine = [f for f in found if f.owner_pid in (None, me) and f.kind != FindingKind.IDLE_REQUEST]
    # Through the probes when on: what they already reported about a block is not repeated.
    report = pool.report if pool.probe is None else pool.probe.report
    for f in mine[:MAX_EXIT_FINDINGS]:
        report(f)
    return mine


def check_at_exit() -> dict[str, Any]:
    """Report this process's leaks into each pool's findings ring; close pools that are clean."""
    out: dict[str, Any] = {}
    me = os.getpid()
    for pool in _pools:
        if not pool.closed and pool.pid != me:
            report_inherited(pool)
        if pool.closed or pool.pid != me:
            continue
        seqs, held = report_held(pool, exit_when())
        # The local cache is not a leak: flush it to the free ring before looking for orphans.
        pool.flush_local()
        mine = report_checked(pool)
        orphans = sum(1 for f in mine if f.kind == FindingKind.LEAK_ORPHAN)
        leaks = sum(1 for f in mine if f.kind in LEAK_KINDS)
        out[pool.name] = {
            "sequences": len(seqs),
            "blocks": held,
            "findings": len(mine),
            "leaks": leaks,
        }
        if not seqs and not orphans:
            pool.close()
    return out


def report_inherited(pool: Any) -> bool:
    """Where an operation on `pool`, a handle this forked process inherited from the parent
    that opened it, is what ends the process (its PoolError passing through the exit check):
    a `handle_inherited` finding in the pool's ring, through a handle of this process's own.
    Without it a program that outlives its failed workers would end with no finding at all:
    the workers never attached. Whether it reported."""
    exc = sys.exc_info()[1]
    if not (
        isinstance(exc, HandleInherited) and exc.name == pool.name and exc.opener_pid == pool.pid
    ):
        return False
    me = os.getpid()
    try:
        with type(pool).attach(pool.name) as own:
            own.report(
                Finding(
                    FindingKind.HANDLE_INHERITED,
                    f"pid {me} exited raising PoolError: it used the handle on pool"
                    f" {pool.name!r} that pid {pool.pid} opened, inherited through fork; in a"
                    " forked process call KVPool.attach(name) (the requests it was given were"
                    " not served)",
                    owner_pid=me,
                )
            )
    except PoolError:
        return False  # (no handle of its own to be had: the pool gone, its client table full)
    return True


def _fault_fired(name: str) -> None:
    """faults.ON_FIRE hook: record the injected fault at once (the process may die of it)."""
    _append("faults", f"fired\t{name}\t{os.getpid()}")


def _record_unfired() -> None:
    for name in faults.unfired():
        _append("faults", f"unfired\t{name}\t{os.getpid()}")


def run_faults(where: str) -> tuple[list[str], list[str]]:
    """The faults of a run (its run directory): those some process injected, and those armed
    in some process that fired in none."""
    fired: set[str] = set()
    armed: set[str] = set()
    try:
        with open(os.path.join(where, "faults")) as f:
            for line in f:
                what, _, rest = line.rstrip("\n").partition("\t")
                name = rest.partition("\t")[0]
                (fired if what == "fired" else armed).add(name)
    except FileNotFoundError:
        return [], []
    return sorted(fired), sorted(armed - fired)


def _at_exit() -> None:
    _record_unfired()
    try:
        found = check_at_exit()
    except Exception as e:  # noqa: BLE001 - the check must never hide the script's own exit
        print(f"kvscope: leak check at exit failed: {e}", file=sys.stderr)
        return
    where = run_dir()
    if where is not None:
        with open(os.path.join(where, f"exit.{os.getpid()}"), "w") as f:
            json.dump(found, f)


def install() -> None:
    """Install the harness hooks, the exit check and the probes (once per process)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _installed = True
    # Imported here, not at the top: the supervisor reads this module's run-directory names
    # and must not pay for the pool's import of torch.
    from kvscope.allocator import pool as pool_module

    pool_module.OPEN_HOOKS.append(on_open)
    pool_module.CLOSE_HOOK = on_close
    pool_module.UNLINK_HOOK = on_unlink
    faults.ON_FIRE.append(_fault_fired)
    from kvscope.probes import install_from_env

    install_from_env()
    # (the supervisor shows where a hung run's processes are)
    answer_stacks()
    # After the probes: exit handlers run last registered first, so the exit check runs before
    # the exporters' final flush, which then carries what it found.
    at_exit(_at_exit)


# The signal at which each process of the run writes every thread's Python stack into its own
# `stacks.PID` file in the run directory (faulthandler, which writes from the signal handler
# without the GIL, so a process whose threads deadlocked holding it still answers): what the
# supervisor shows of a hung run, and of a script that outlived its stop signal's grace period
# before it kills it. A real-time signal: no program gives it a meaning of its own (SIGUSR1 and
# SIGUSR2 often have one: reopen logs, reload).
STACKS_SIGNAL = signal.SIGRTMIN + 6
STACKS_FILE = "stacks"
THREADS_FILE = "threads"
_stacks_file: IO[str] | None = None  # (this process's: faulthandler writes into its descriptor)


def answers_stacks(pid: int) -> bool:
    """Whether process `pid` catches STACKS_SIGNAL (/proc/PID/status `SigCgt`): a process of
    the run does; any other one would be killed by it (a real-time signal's default action)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next((ln.split()[1] for ln in f if ln.startswith("SigCgt:")), "0")
    except (OSError, IndexError):
        return False
    return bool(int(caught, 16) >> (STACKS_SIGNAL - 1) & 1)


def thread_stacks(pid: int, run_dir: str, wait_s: float = 1.0) -> str:
    """Process `pid`'s threads' Python stacks, as faulthandler writes them at STACKS_SIGNAL
    ("" if it does not answer it, or none came within `wait_s`: one stopped in the kernel)."""
    path = os.path.join(run_dir, f"{STACKS_FILE}.{pid}")
    if not answers_stacks(pid):
        return ""
    try:
        start = os.path.getsize(path)  # (what an earlier signal wrote)
    except OSError:
        start = 0
    names = os.path.join(run_dir, f"{THREADS_FILE}.{pid}")
    try:
        os.unlink(names)  # (an earlier signal's: this one's is written anew)
    except OSError:
        pass
    try:
        os.kill(pid, STACKS_SIGNAL)
    except ProcessLookupError:
        return ""
    deadline = time.monotonic() + wait_s
    size = -1
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now = os.path.getsize(path)
        except OSError:
            continue
        if now > start and now == size:
            break  # (written, and no longer growing)
        size = now
    try:
        with open(path, errors="replace") as f:
            f.seek(start)
            text = f.read()
    except OSError:
        return ""
    return _program_threads(text, _thread_names(names))


def stacks_said(pid: int, run_dir: str, lead: str, others: dict[int, str] | None = None) -> str:
    """`kvscope: LEAD; its threads now ...` and the script's threads' stacks (thread_stacks),
    then, for each other process of the run in `others` (pid: what it is), its own, as kvscope
    says them; "" when none came."""
    said = []
    text = thread_stacks(pid, run_dir)
    if text:
        said.append(
            f"kvscope: {lead}; its threads now (most recent call first; threads waiting on locks"
            " that the others hold are deadlocked):\n" + text
        )
    for other, what in (others or {}).items():
        text = "" if other == pid else thread_stacks(other, run_dir)
        if text:
            said.append(f"kvscope: pid {other} ({what}): its threads now:\n" + text)
    return "\n".join(said)


def _thread_names(path: str, wait_s: float = 0.5) -> dict[str, str]:
    """The threads' names a process wrote into `path` (its `threads.PID`, removed before the
    signal: `_write_thread_names`), by faulthandler's hex id; {} when none came within `wait_s`
    (the main thread, which runs Python's handlers, stuck in a call that holds the GIL)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path, errors="replace") as f:
                return dict(ln.split(" ", 1) for ln in f.read().splitlines() if " " in ln)
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return {}
        time.sleep(0.02)


def _write_thread_names(signum: int, frame: Any) -> None:
    """At STACKS_SIGNAL, after faulthandler's stacks (its chain): each thread's hex id, as
    faulthandler prints it, and its name, into `threads.PID` (written whole, then renamed)."""
    out = run_dir()
    if out is None:
        return
    path = os.path.join(out, f"{THREADS_FILE}.{os.getpid()}")
    try:
        with open(path + ".tmp", "w") as f:
            f.writelines(f"0x{t.ident:016x} {t.name}\n" for t in threading.enumerate() if t.ident)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _program_threads(text: str, names: dict[str, str] | None = None) -> str:
    """faulthandler's stacks of the program's threads: each thread with a frame of the
    program's own (kvscope's threads in the script, the probes' watchdog, go), its frames
    without kvscope's and runpy's (the bootstrap that ran the script); each thread's line with
    its name where `names` (hex id: name) has it."""
    ours = tuple(package_dirs())
    plumbing = ("in _bootstrap", "in _bootstrap_inner", "in run")  # (threading.py's)
    kept: list[str] = []
    for block in text.strip().split("\n\n"):
        lines = block.splitlines()
        if not lines:
            continue  # (nothing written: a process that did not answer in time)
        head = lines[0].split(" (most recent call first)")
        ident = head[0].rsplit(" ", 1)[-1]
        if names and ident in names and len(head) == 2:
            lines[0] = f"{head[0]} {names[ident]!r} (most recent call first){head[1]}"
        frames = [
            ln
            for ln in lines[1:]
            if not any(d in ln for d in ours)
            and "runpy" not in ln
            and not ("/threading.py" in ln and ln.endswith(plumbing))
        ]
        if any("/threading.py" not in ln for ln in frames):
            kept.append("\n".join([lines[0], *frames]))
    return "\n\n".join(kept)


def package_dirs() -> list[str]:
    """The directories of kvscope's packages (kvscope.probes and the others live beside
    kvscope/ in a source tree, not under it), each with a trailing separator."""
    import importlib.util

    dirs = [os.path.dirname(os.path.abspath(__file__))]
    for sub in ("allocator", "kernels", "probes", "tui"):
        spec = importlib.util.find_spec(f"kvscope.{sub}")
        dirs += list(spec.submodule_search_locations or []) if spec else []
    return [os.path.abspath(d) + os.sep for d in dirs]


def answer_stacks() -> None:
    """In each process of the run (kvscope/child.py `install`): faulthandler writes every
    thread's stack into the run directory's `stacks.PID` at STACKS_SIGNAL (the file kept open:
    faulthandler holds its descriptor); a forked child opens its own."""
    import faulthandler

    global _stacks_file
    out = run_dir()
    if out is None:
        return
    if _stacks_file is None:
        os.register_at_fork(after_in_child=answer_stacks)
    _stacks_file = open(os.path.join(out, f"{STACKS_FILE}.{os.getpid()}"), "w")
    # The threads' names come from Python's handler, which faulthandler calls after it has
    # written the stacks (chain): Python runs it in the main thread when it next can (a lock
    # wait or a sleep is interrupted for it), so a process whose main thread cannot run it
    # still gives its stacks, without the names.
    # (a forked child inherits the parent's registration: undone first, so that faulthandler
    # installs its handler over Python's again)
    faulthandler.unregister(STACKS_SIGNAL)
    try:
        signal.signal(STACKS_SIGNAL, _write_thread_names)
        chain = True
    except ValueError:  # (not the main thread: no Python handler can be set here)
        chain = False
    faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True, chain=chain)
