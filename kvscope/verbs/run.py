"""Run a Python script (or -m module) with the probes on, under a supervisor.

Findings are printed to stderr, one line each, as they happen. When the script crashes (signal,
uncaught exception, non-zero exit), when a finding of severity error occurs, or when blocks
leak at exit, every pool the script used is dumped to --dump-dir as kvscope-<pool>-<pid>.kvd
and the analysis is printed.

Exit code: the script's when it failed (128+N when killed by signal N); otherwise 66 when
--fail-on matched (error: a finding of severity error other than a leak; leak: that, or any
leaked block); otherwise 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvscope.allocator.faults import FAULTS
from kvscope.allocator.process import is_alive
from kvscope.analysis import analyze_view
from kvscope.dumpfile import dump_name, write_dump
from kvscope.errors import EXIT_FAIL_ON, EXIT_FINDINGS, UsageError
from kvscope.report import console, render
from kvscope.supervisor import Outcome, Supervisor, is_error, is_leak
from kvscope.verbs.top import load_run_top

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


def child_env(base: dict[str, str], run_dir: str, args: argparse.Namespace) -> dict[str, str]:
    """The child's environment: the run directory and the probe flags."""
    env = dict(base)
    env["KVSCOPE_RUN_DIR"] = run_dir
    env["KVSCOPE_GUARD"] = "1" if args.guard else "0"
    env["KVSCOPE_LOCKDEP"] = "1" if args.lockdep else "0"
    env["KVSCOPE_EVENTS"] = "1"
    faults = parse_faults(args.inject)
    if faults:
        env["KVSCOPE_INJECT"] = ",".join(faults)
    else:
        env.pop("KVSCOPE_INJECT", None)
    return env


def check_dump_dir(path: str) -> str:
    """--dump-dir must be a writable directory (checked before the script starts)."""
    if not os.path.isdir(path):
        raise UsageError(f"--dump-dir {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--dump-dir {path} is not writable")
    return path


@contextlib.contextmanager
def forwarded_signals(sup: Supervisor) -> Iterator[None]:
    """While the child runs: Ctrl-C reaches it through the terminal; SIGTERM/SIGHUP are forwarded."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {
        s: signal.signal(s, h)
        for s, h in (
            (signal.SIGINT, signal.SIG_IGN),
            (signal.SIGTERM, lambda n, f: sup.signal_child(n)),
            (signal.SIGHUP, lambda n, f: sup.signal_child(n)),
        )
    }
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class RunCommand:
    """Run a script with the probes on: `kvscope run [options] script.py [args]` or `-m module`."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--live", action="store_true", help="show the TUI while it runs")
        parser.add_argument("--hz", type=float, default=10.0, help="TUI refresh rate (--live)")
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
            "--dump-dir", default=".", metavar="DIR", help="where dumps go (default: .)"
        )
        parser.add_argument(
            "--fail-on",
            choices=FAIL_ON,
            default="error",
            help="exit 66 when the script succeeded but this happened (default: error)",
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
        if not args.module and not os.path.isfile(args.script):
            raise UsageError(f"no script at {args.script}")
        run_top = load_run_top() if args.live else None
        dump_dir = check_dump_dir(args.dump_dir)
        run_dir = tempfile.mkdtemp(prefix="kvscope-run-")
        target = (["-m"] if args.module else []) + [args.script, *args.script_args]
        from kvscope.probes.otel_config import OtelConfigError, otel_env_from_args
        from kvscope.probes.otel_exporters import start_collector

        otel_env = {**os.environ, **otel_env_from_args(args)}
        sup = Supervisor(
            target, run_dir=run_dir, env=child_env(otel_env, run_dir, args), echo=_echo
        )
        tel = None
        try:
            try:
                # The supervisor collects pool metrics once for every process of the run.
                tel = start_collector(lambda: [w.name for w in list(sup.pools.values())], otel_env)
            except OtelConfigError as e:
                raise UsageError(str(e)) from None
            with forwarded_signals(sup):
                sup.start()
                if run_top is not None:
                    _live(sup, run_top, args.hz)
                outcome = sup.wait()
            return _finish(sup, outcome, dump_dir, args.fail_on)
        finally:
            if tel is not None:
                tel.shutdown()
            sup.cleanup()
            shutil.rmtree(run_dir, ignore_errors=True)


def _echo(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _live(sup: Supervisor, run_top: Any, hz: float) -> None:
    """Show the first pool the child opens in the TUI; findings wait until the TUI closes."""
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
            run_top(first.name, hz=hz)
        finally:
            stop.set()
            worker.join()
    sup.echo = _echo
    for line in held:
        _echo(line)


def _finish(sup: Supervisor, outcome: Outcome, dump_dir: str, fail_on: str) -> int:
    """Dump and analyze when something went wrong; the exit code."""
    pid = sup.pid
    finals = [(w, *sup.final_findings(w)) for w in sup.pools.values()]
    found = sup.live_findings + [f for _, _, fs in finals for f in fs]
    leaked_at_exit = any(v.get("blocks") or v.get("findings") for v in outcome.exit_checks.values())
    leaked = leaked_at_exit or any(is_leak(f) for f in found)
    errored = any(is_error(f) for f in found)
    what = outcome.describe(pid)
    if outcome.failed or errored or leaked:
        notes = [what] + (["findings of severity error"] if errored else [])
        notes += ["blocks leaked"] if leaked else []
        reason = "; ".join(notes)
        if not finals:
            _echo(f"kvscope: {what}; it opened no pool, so there is nothing to dump")
        used: set[str] = set()
        for w, snap, fs in finals:
            path = _unique(os.path.join(dump_dir, dump_name(w.name, pid)), used)
            write_dump(snap, path, reason=reason, pid=pid, header_prefix=w.header_prefix)
            report = analyze_view(snap, alive=is_alive, findings=fs)
            report["pool"]["dump"] = _dump_info(path, pid, reason)
            con = console(sys.stderr)
            con.print()
            render(report, con, title=f"kvscope run: {what}; pool")
            _echo(f"kvscope: wrote {path} (kvscope analyze {path})")
    unfired = _report_unfired(sup)
    if outcome.failed:
        return outcome.returncode if outcome.returncode > 0 else 128 + (outcome.signal or 0)
    if unfired:
        return EXIT_FINDINGS
    if (fail_on == "error" and errored) or (fail_on == "leak" and (errored or leaked)):
        _echo(f"kvscope: {what}, but --fail-on {fail_on} matched: exit {EXIT_FAIL_ON}")
        return EXIT_FAIL_ON
    return 0


def _report_unfired(sup: Supervisor) -> bool:
    """Faults armed for the run that no process injected (kvscope/child.py records them): say
    so; True when there is one (the run proved nothing about them)."""
    from kvscope.child import unfired_faults

    unfired = unfired_faults(sup.run_dir)
    for name in unfired:
        _echo(
            f"kvscope: fault {name!r} was armed but never fired: no operation of the script "
            "gave it an opportunity it could act on"
        )
    return bool(unfired)


def _unique(path: str, used: set[str]) -> str:
    base, ext = os.path.splitext(path)
    k = 1
    while path in used:
        k += 1
        path = f"{base}-{k}{ext}"
    used.add(path)
    return path


def _dump_info(path: str, pid: int, reason: str) -> dict[str, Any]:
    import socket

    return {
        "path": path,
        "pid": pid,
        "host": socket.gethostname(),
        "reason": reason,
        "created_ns": time.time_ns(),
        "with_data": False,
        "redacted": False,
        "torn": False,
    }
