"""Run a Python script (or -m module) with the probes on, under a supervisor.

Findings are printed to stderr, one line each, as they happen. When the script crashes (signal,
uncaught exception, non-zero exit), when a finding of severity error occurs, or when blocks
leak at exit, every pool the script used is dumped to --dump-dir as kvscope-<pool>-<pid>.kvd
and the analysis is printed.

Exit code: the script's when it failed (128+N when killed by signal N); otherwise 2 when a dump
could not be written; otherwise 66 when --fail-on matched (leak, the default: a finding of
severity error, or any leaked block, a dead owner's included, as LeakSanitizer fails a run on
a leak; error: a finding of severity error other than a leak; never: nothing); otherwise 0. The
printed analysis shows each finding with the severity --fail-on gives it, so its headline
agrees with that code.

Once a pool is dumped, its files are removed from /dev/shm when no live process holds it any
more (--keep-pool keeps them); the verdict says which.

SIGINT, SIGTERM and SIGHUP sent to kvscope alone are forwarded to the script (one sent to the
whole process group, or by the terminal, reached it already); if it still runs
--stop-grace seconds later (or at a second signal) it is killed with SIGKILL (kvscope/stopper.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from kvscope.allocator.errors import PoolError
from kvscope.allocator.faults import FAULTS
from kvscope.allocator.probeflags import THRESHOLDS, env_seconds
from kvscope.bootstrap import launch
from kvscope.errors import UsageError
from kvscope.scriptlog import ScriptLog
from kvscope.stopper import DEFAULT_GRACE_S, Stopper, echo, outliving_readers
from kvscope.verbs.top import load_run_top

# The supervisor and the verdict (numpy, the checks, the report) are imported once the script
# has started, so that their import overlaps its start-up (docs/CLI.md, "Start-up").
if TYPE_CHECKING:
    from kvscope.supervisor import Supervisor

FAIL_ON = ("never", "error", "leak")


def parse_faults(values: list[str] | None) -> list[str]:
    """The --inject faults (repeatable, comma-separated), each one of FAULTS."""
    out: list[str] = []
    for v in values or []:
        for fault in filter(None, (x.strip() for x in v.split(","))):
            if fault not in FAULTS:
                raise UsageError(
                    f"unknown fault {fault!r} for --inject; one of: {', '.join(FAULTS)}"
                )
            out.append(fault)
    return out


# Seconds a pool's requests may hold blocks with no pool operation before the run says the
# script looks hung (--hang-after; 0: never).
DEFAULT_HANG_AFTER_S = 20.0
# Events each process's flight recorder keeps under `kvscope run` (at least: a pool created with
# more keeps its own): 64 bytes each, per attached process.
RUN_EVENT_CAPACITY = 8192


def check_event_capacity(value: str) -> None:
    """A KVSCOPE_EVENT_CAPACITY of the user's environment, checked before the script starts (a
    pool it creates would refuse it); UsageError when it is not a count of events."""
    from kvscope.allocator.config import MAX_EVENT_CAPACITY

    if not (value.isdigit() and int(value) <= MAX_EVENT_CAPACITY):
        raise UsageError(
            f"KVSCOPE_EVENT_CAPACITY={value!r}: give a number of events from 0 to"
            f" {MAX_EVENT_CAPACITY}"
        )


def child_env(base: dict[str, str], run_dir: str, args: argparse.Namespace) -> dict[str, str]:
    """The child's environment: the run directory and the probe flags."""
    env = dict(base)
    env["KVSCOPE_RUN_DIR"] = run_dir
    env["KVSCOPE_GUARD"] = "1" if args.guard else "0"
    env["KVSCOPE_LOCKDEP"] = "1" if args.lockdep else "0"
    env["KVSCOPE_EVENTS"] = "1"
    # a flight recorder that holds a few seconds of a busy engine's operations (docs/PROBES.md)
    if "KVSCOPE_EVENT_CAPACITY" in env:
        check_event_capacity(env["KVSCOPE_EVENT_CAPACITY"])
    # (the idle and lock-hold thresholds: a pool the script creates records them, and this
    # process's supervisor reads them; checked before the script starts)
    for name in THRESHOLDS:
        try:
            env_seconds(name, env)
        except PoolError as e:
            raise UsageError(str(e)) from None
    env.setdefault("KVSCOPE_EVENT_CAPACITY", str(RUN_EVENT_CAPACITY))
    # slot provenance (docs/POOL.md): every sequence's slots in guard mode, unless set
    env.setdefault("KVSCOPE_PROVENANCE_SAMPLE", "1" if args.guard else "0")
    record = getattr(args, "record_ops", None)
    if record:
        # every handle of the run records into one log (docs/REPLAY.md); --redact: token ids
        # and request ids as keyed hashes, under a key of this run's
        env["KVSCOPE_RECORD_OPS"] = os.path.abspath(record)
        try:  # (a new log for this run)
            with open(record, "wb"):
                pass
        except OSError as e:
            raise UsageError(f"--record-ops {record}: {e.strerror or e}") from None
        if getattr(args, "redact", False):
            env["KVSCOPE_RECORD_OPS_KEY"] = str(int.from_bytes(os.urandom(8), "little") | 1)
        limit = getattr(args, "record_ops_limit", None)
        if limit:
            # a bounded log: checkpoints, the file before the one before them dropped
            env["KVSCOPE_RECORD_OPS_LIMIT"] = str(record_limit(limit, args))
    elif getattr(args, "record_ops_limit", None):
        raise UsageError("--record-ops-limit bounds the log of --record-ops FILE: give one")
    elif getattr(args, "redact", False):
        raise UsageError(
            "--redact hashes what --record-ops FILE records: give one (the dumps a run writes "
            "keep token ids; `kvscope dump NAME --redact` writes a redacted one)"
        )
    faults = parse_faults(args.inject)
    if faults:
        env["KVSCOPE_INJECT"] = ",".join(faults)
    else:
        env.pop("KVSCOPE_INJECT", None)
    return env


def numpy_without_blas_threads() -> None:
    """numpy imported into this process (the supervisor's, which reads the segment and does no
    linear algebra) with no OpenBLAS worker thread: each spins about 50 ms of CPU after the
    import, on the cores the script runs on. OpenBLAS reads the variable once, as numpy loads
    it: the environment is put back, and whatever this process starts later gets the user's.
    Nothing where numpy is loaded already or the user set the variable."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


def record_limit(text: str, args: argparse.Namespace) -> int:
    """--record-ops-limit SIZE in bytes (K, M, G suffixes), refused with --redact (a checkpoint
    holds the pool's tokens and request ids) and below a chunk's worth."""
    from kvscope.allocator.checkpoint import MIN_LIMIT, parse_size

    try:
        size = parse_size(text)
    except ValueError:
        raise UsageError(
            f"--record-ops-limit {text}: not a size (bytes, or 64K, 16M, 1G)"
        ) from None
    if getattr(args, "redact", False):
        raise UsageError(
            "--record-ops-limit with --redact: a bounded log's checkpoints hold the pool's "
            "tokens and request ids"
        )
    if size < MIN_LIMIT:
        raise UsageError(f"--record-ops-limit {text}: at least {MIN_LIMIT // 1024}K")
    return size


def check_dump_dir(path: str) -> str:
    """--dump-dir must be a writable directory, made (with its parents) where it does not exist
    yet (before the script starts)."""
    if not os.path.exists(path):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--dump-dir {path} cannot be made: {e.strerror or e}") from None
    if not os.path.isdir(path):
        raise UsageError(f"--dump-dir {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--dump-dir {path} is not writable")
    return path


class RunCommand:
    """Run a script with the probes on: `kvscope run [options] script.py [args]` or `-m module`."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--live", action="store_true", help="show the TUI while it runs")
        parser.add_argument("--hz", type=float, default=10.0, help="TUI refresh rate (--live)")
        parser.add_argument(
            "--timeline",
            action="store_true",
            help="write each pool's flight recorder as a Chrome trace beside its dump",
        )
        parser.add_argument(
            "--guard",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="guard slots, poisoning and in-kernel checks (default on)",
        )
        parser.add_argument(
            "--lockdep",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="lock-order tracing (default on)",
        )
        parser.add_argument(
            "--inject",
            action="append",
            metavar="FAULT",
            help=f"inject a fault (repeatable): {', '.join(FAULTS)}",
        )
        parser.add_argument(
            "--record-ops",
            metavar="FILE",
            help="record every pool operation of the run into the operation log FILE "
            "(emptied first), for `kvscope replay FILE`",
        )
        parser.add_argument(
            "--redact",
            action="store_true",
            help="with --record-ops: token ids and request ids recorded as keyed hashes",
        )
        parser.add_argument(
            "--record-ops-limit",
            metavar="SIZE",
            help="with --record-ops: bound the log (bytes, or 64K, 16M, 1G): past SIZE a "
            "checkpoint of the pool is written and the records before the one before it dropped",
        )
        parser.add_argument(
            "--dump-dir", default=".", metavar="DIR", help="where dumps go (default: .)"
        )
        parser.add_argument(
            "--fail-on",
            choices=FAIL_ON,
            default="leak",
            help="exit 66 when the script succeeded but this happened: leak (default), a finding"
            " of severity error or a leaked block, a dead owner's included; error, a finding of"
            " severity error other than a leak; never",
        )
        parser.add_argument(
            "--keep-pool",
            action="store_true",
            help="keep a dumped pool's files in /dev/shm (default: removed once dumped, when no"
            " live process holds it)",
        )
        parser.add_argument(
            "--stop-grace",
            type=float,
            default=DEFAULT_GRACE_S,
            metavar="S",
            help="after a forwarded SIGINT/SIGTERM/SIGHUP, SIGKILL the script if it still runs"
            f" after S seconds (default {DEFAULT_GRACE_S:g})",
        )
        parser.add_argument(
            "--hang-after",
            type=float,
            default=DEFAULT_HANG_AFTER_S,
            metavar="S",
            help="say, with the script's threads' stacks, when a pool's requests hold blocks and"
            f" no pool operation came for S seconds (default {DEFAULT_HANG_AFTER_S:g}; 0: never)",
        )
        parser.add_argument(
            "-m", dest="module", action="store_true", help="run a library module as a script"
        )
        from kvscope.probes.otel_config import add_otel_arguments

        add_otel_arguments(parser)
        parser.add_argument("script", metavar="script.py|module", help="what to run")
        parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        # (kvscope's own output may lose its reader, `kvscope run ... | head`: the run still
        # stops its script, writes its dump, removes the pool's files and exits as it would)
        with outliving_readers():
            return RunCommand.run_script(args)

    @staticmethod
    def run_script(args: argparse.Namespace) -> int:
        if not args.module and not os.path.isfile(args.script):
            raise UsageError(f"no script at {args.script}")
        if not args.hz > 0:
            raise UsageError(f"--hz must be positive, got {args.hz}")
        if not args.stop_grace >= 0:
            raise UsageError(f"--stop-grace must be 0 or more seconds, got {args.stop_grace}")
        if not args.hang_after >= 0:
            raise UsageError(f"--hang-after must be 0 or more seconds, got {args.hang_after}")
        run_top = load_run_top("run --live") if args.live else None
        dump_dir = check_dump_dir(args.dump_dir)
        target = (["-m"] if args.module else []) + [args.script, *args.script_args]
        from kvscope.probes.otel_config import OtelConfigError, configured, otel_env_from_args

        run_dir = tempfile.mkdtemp(prefix="kvscope-run-")
        try:
            otel_env = {**os.environ, **otel_env_from_args(args)}
            env = child_env(otel_env, run_dir, args)
        except BaseException:
            # (a flag or variable refused before the script starts: nothing left behind)
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        stopper = Stopper(
            echo, args.stop_grace, before_kill=lambda pid: show_stacks(pid, run_dir, sup)
        )
        sup: Supervisor | None = None
        tel = None
        try:
            # Stop signals are collected from here on (kvscope/stopper.py), before the
            # collector starts threads that would otherwise take them.
            with stopper.collecting():
                try:
                    # Before the script starts: an exporter that cannot work stops the run here.
                    # The supervisor collects pool metrics once for every process of the run.
                    # (The exporters' module only when one is asked for: before the script
                    # starts, every import delays its first line.)
                    if configured(otel_env):
                        from kvscope.probes.otel_exporters import start_collector

                        tel = start_collector(
                            lambda: (
                                [] if sup is None else [w.name for w in list(sup.pools.values())]
                            ),
                            otel_env,
                            path_of=lambda name: "" if sup is None else sup.segment_of(name),
                        )
                except OtelConfigError as e:
                    raise UsageError(str(e)) from None
                pipes: dict[str, Any] = {}
                if run_top is not None:
                    # --live: the output goes to the TUI's panel, line by line (kvscope.scriptlog).
                    env["PYTHONUNBUFFERED"] = "1"
                    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
                proc = launch(target, env, stopper, **pipes)
                numpy_without_blas_threads()
                from kvscope.supervisor import Supervisor

                sup = Supervisor(
                    target, run_dir=run_dir, env=env, echo=echo, fail_on=args.fail_on,
                    stopper=stopper, proc=proc, hang_after_s=args.hang_after,
                )  # fmt: skip
                from kvscope import verdict

                log = ScriptLog(proc, run_dir) if run_top is not None else None
                if run_top is not None:
                    with stopper.handled():
                        _live(sup, run_top, args.hz, log)
                outcome = sup.wait()
                if log is not None:
                    log.close()
            code, dumped = verdict.finish(
                sup, outcome, dump_dir, args.fail_on, record_ops=args.record_ops
            )
            if args.timeline:
                verdict.write_timelines(sup, dump_dir)
            if tel is not None:
                # The last export, while the pools' files are still there to be read.
                tel.shutdown()
            verdict.settle_pools(sup, dumped, keep=args.keep_pool)
            return code
        finally:
            if tel is not None:
                tel.shutdown()
            if sup is not None:
                sup.cleanup()
            shutil.rmtree(run_dir, ignore_errors=True)


def show_stacks(pid: int, run_dir: str, sup: Supervisor | None) -> None:
    """Before the script that outlived its stop signal's grace period is killed: where each of
    its threads is, and each other live process's attached to a pool of the run (a hang's
    diagnosis: threads that wait for each other's locks deadlocked)."""
    from kvscope.child import stacks_said

    others = {p: f"attached to pool {w.name!r}" for w, p in sup.still_attached()} if sup else {}
    said = stacks_said(pid, run_dir, f"the script (pid {pid}) did not stop", others)
    if said:
        echo(said)


def _live(sup: Supervisor, run_top: Any, hz: float, log: ScriptLog | None = None) -> None:
    """Show the first pool the child opens in the TUI with the script's output beside it;
    findings and the output are printed when the TUI closes."""
    assert sup.proc is not None
    held: list[str] = []
    sup.echo = held.append
    while not sup.pools and sup.proc.poll() is None:
        sup.poll()
        time.sleep(sup.interval_s)
    stop = threading.Event()

    def follow() -> None:
        while not stop.wait(sup.interval_s):
            sup.poll()

    if sup.pools:
        first = next(iter(sup.pools.values()))
        worker = threading.Thread(target=follow, daemon=True)
        worker.start()
        try:
            run_top(first.name, hz=hz, script=log, stop=sup.stopper.stop_requested)
        except PoolError as e:
            # The script removed its pool before the TUI could open it: go on without it.
            held.append(f"kvscope: --live: {e}")
        finally:
            stop.set()
            worker.join()
    if log is not None:
        log.release()
    sup.echo = echo
    for line in held:
        echo(line)
