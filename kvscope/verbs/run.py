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

SIGINT, SIGTERM and SIGHUP sent to kvscope are forwarded to the script; if it still runs
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
from typing import Any

from kvscope.allocator.dumpfile import dump_name, write_dump
from kvscope.allocator.errors import PoolError
from kvscope.allocator.faults import FAULTS
from kvscope.allocator.findings import ERROR, WARNING
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.process import is_alive
from kvscope.analysis import analyze_view
from kvscope.capacity import capacity_answer
from kvscope.errors import EXIT_FAIL_ON, EXIT_FINDINGS, EXIT_USAGE, UsageError
from kvscope.history import history_path
from kvscope.report import console, render
from kvscope.scriptlog import ScriptLog
from kvscope.stopper import DEFAULT_GRACE_S, Stopper
from kvscope.supervisor import Outcome, Supervisor, Watched, fails, is_error, is_leak
from kvscope.timeline import build_trace, trace_path, write_trace
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
        if not args.stop_grace >= 0:
            raise UsageError(f"--stop-grace must be 0 or more seconds, got {args.stop_grace}")
        run_top = load_run_top() if args.live else None
        dump_dir = check_dump_dir(args.dump_dir)
        run_dir = tempfile.mkdtemp(prefix="kvscope-run-")
        target = (["-m"] if args.module else []) + [args.script, *args.script_args]
        from kvscope.probes.otel_config import OtelConfigError, otel_env_from_args
        from kvscope.probes.otel_exporters import start_collector

        otel_env = {**os.environ, **otel_env_from_args(args)}
        sup = Supervisor(
            target,
            run_dir=run_dir,
            env=child_env(otel_env, run_dir, args),
            echo=_echo,
            fail_on=args.fail_on,
            stopper=Stopper(_echo, args.stop_grace),
        )
        tel = None
        try:
            # Stop signals are collected from here on (kvscope/stopper.py), before the
            # collector starts threads that would otherwise take them.
            with sup.stopper.collecting():
                try:
                    # The supervisor collects pool metrics once for every process of the run.
                    tel = start_collector(
                        lambda: [w.name for w in list(sup.pools.values())],
                        otel_env,
                        path_of=sup.segment_of,
                    )
                except OtelConfigError as e:
                    raise UsageError(str(e)) from None
                log = _start(sup, live=run_top is not None)
                if run_top is not None:
                    with sup.stopper.handled():
                        _live(sup, run_top, args.hz, log)
                outcome = sup.wait()
                if log is not None:
                    log.close()
            code, dumped = _finish(sup, outcome, dump_dir, args.fail_on)
            if args.timeline:
                _write_timelines(sup, dump_dir)
            if tel is not None:
                # The last export, while the pools' files are still there to be read.
                tel.shutdown()
            _settle_pools(sup, dumped, keep=args.keep_pool)
            return code
        finally:
            if tel is not None:
                tel.shutdown()
            sup.cleanup()
            shutil.rmtree(run_dir, ignore_errors=True)


def _echo(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _start(sup: Supervisor, *, live: bool) -> ScriptLog | None:
    """Start the child; under --live its output goes to pipes and is kept (kvscope.scriptlog)."""
    if not live:
        sup.start()
        return None
    # Line by line into the log panel rather than in 8 KiB blocks.
    sup.env["PYTHONUNBUFFERED"] = "1"
    sup.start(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert sup.proc is not None
    return ScriptLog(sup.proc, sup.run_dir)


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
    sup.echo = _echo
    for line in held:
        _echo(line)


def _beside_dump(w: Watched, snap: SegmentView, path: str, report: dict[str, Any]) -> None:
    """The pool's history beside its dump, and the capacity answer in the printed analysis."""
    if w.history is not None and w.history.count:
        try:
            w.history.write(history_path(path))
        except OSError as e:
            _echo(f"kvscope: could not write the history beside {path}: {e.strerror or e}")
    report["capacity"] = capacity_answer(snap, w.history)


def _write_timelines(sup: Supervisor, dump_dir: str) -> None:
    """--timeline: each pool's flight recorder and history as a Chrome trace in dump_dir, and
    the history itself (for `kvscope report NAME --history FILE` on a pool the script kept)."""
    used: set[str] = set()
    for w in sup.pools.values():
        snap, found = sup.final_findings(w)
        base = _unique(os.path.join(dump_dir, dump_name(w.name, sup.pid)), used)
        trace = build_trace(snap, history=w.history, findings=found, end_ns=time.time_ns())
        try:
            write_trace(trace, trace_path(base))
            if w.history is not None and w.history.count:
                w.history.write(history_path(base))
        except (OSError, PoolError) as e:
            why = getattr(e, "strerror", None) or e
            _echo(f"kvscope: could not write the timeline of pool {w.name!r}: {why}")
            continue
        _echo(f"kvscope: wrote {trace_path(base)} (open it in Perfetto or chrome://tracing)")


def _finish(
    sup: Supervisor, outcome: Outcome, dump_dir: str, fail_on: str
) -> tuple[int, list[Watched]]:
    """Dump and analyze when something went wrong; the exit code and the pools dumped.

    The printed analysis gives each finding the severity --fail-on gives it (error when it
    fails the run, warning when not), so its headline and the exit code agree; the dump keeps
    the findings' own severities. A dump that cannot be written (a full disk) is one line, the
    analysis is still printed, and the exit code is the script's when it failed, else 2.
    """
    pid = sup.pid
    finals = []
    dumped: list[Watched] = []
    dump_failed = False
    for w in sup.pools.values():
        try:
            finals.append((w, *sup.final_findings(w)))
        except PoolError as e:
            _echo(f"kvscope: error: {e}")
            dump_failed = True
    found = sup.live_findings + [f for _, _, fs in finals for f in fs]
    # (the exit check's other findings are errors or warnings of their own kinds, not leaks)
    leaked_at_exit = any(v.get("blocks") or v.get("leaks") for v in outcome.exit_checks.values())
    leaked = leaked_at_exit or any(is_leak(f) for f in found)
    errored = any(is_error(f) for f in found)
    what = outcome.describe(pid)
    if outcome.failed or errored or leaked:
        notes = [what] + (["findings of severity error"] if errored else [])
        notes += ["blocks leaked"] if leaked else []
        reason = "; ".join(notes)
        if not finals and not dump_failed:
            _echo(f"kvscope: {what}; it opened no pool, so there is nothing to dump")
        used: set[str] = set()
        for w, snap, fs in finals:
            path = _unique(os.path.join(dump_dir, dump_name(w.name, pid)), used)
            try:
                write_dump(snap, path, reason=reason, pid=pid, header_prefix=w.header_prefix)
            except PoolError as e:
                _echo(f"kvscope: error: {e}")
                dump_failed, path = True, ""
            report = analyze_view(snap, alive=is_alive, findings=fs)
            _as_run_sees_it(report, fail_on)
            if path:
                report["pool"]["dump"] = _dump_info(path, pid, reason)
                _beside_dump(w, snap, path, report)
            con = console(sys.stderr)
            con.print()
            render(report, con, title=f"kvscope run: {what}; pool")
            if path:
                dumped.append(w)
                _echo(f"kvscope: wrote {path} (kvscope analyze {path})")
            else:
                _echo(f"kvscope: no dump of pool {w.name!r} was written (above)")
    else:
        _echo(f"kvscope run: {what}; {_clean_verdict(sup, found)}")
    unfired = _report_unfired(sup)
    if outcome.failed:
        return outcome.returncode if outcome.returncode > 0 else 128 + (outcome.signal or 0), dumped
    if dump_failed:
        return EXIT_USAGE, dumped
    if unfired:
        return EXIT_FINDINGS, dumped
    if (fail_on == "error" and errored) or (fail_on == "leak" and (errored or leaked)):
        _echo(f"kvscope: {what}, but --fail-on {fail_on} matched: exit {EXIT_FAIL_ON}")
        return EXIT_FAIL_ON, dumped
    return 0, dumped


def _settle_pools(sup: Supervisor, dumped: list[Watched], *, keep: bool) -> None:
    """Remove the files of each dumped pool no live process holds any more (the dump has what
    they held), unless --keep-pool; say what became of each."""
    holders: dict[str, list[int]] = {}
    for w, pid in sup.still_attached():
        holders.setdefault(w.key, []).append(pid)
    for w in dumped:
        if w.unlinked_to:
            continue  # the script unlinked it: its files go with the run (Supervisor.cleanup)
        if keep:
            _echo(
                f"kvscope: kept pool {w.name!r} (--keep-pool); `kvscope check {w.name} --repair"
                " --unlink` removes it"
            )
        elif w.key in holders:
            pids = ", ".join(map(str, holders[w.key]))
            _echo(f"kvscope: kept pool {w.name!r}: pid {pids} still holds it")
        elif sup.remove_pool(w):
            _echo(
                f"kvscope: removed pool {w.name!r} from /dev/shm (its dump holds it;"
                " --keep-pool keeps it)"
            )


def _clean_verdict(sup: Supervisor, found: list) -> str:
    """The one line of a run with nothing to dump: which pools were watched, and what came."""
    if not sup.pools:
        return "it opened no pool"
    names = ", ".join(repr(w.name) for w in sup.pools.values())
    pools = f"pool{'s' if len(sup.pools) > 1 else ''} {names}"
    if found:
        return f"{pools}: no error, no leak, {len(found)} warning(s) above; nothing to dump"
    return f"{pools}: no finding, no leak; nothing to dump"


def _as_run_sees_it(report: dict[str, Any], fail_on: str) -> None:
    """Give each finding of the report the severity --fail-on gives it, and say so."""
    for d in report["findings"]:
        severity = ERROR if fails(d, fail_on) else WARNING
        if severity != d["severity"]:
            d["message"] += f" ({severity} under --fail-on {fail_on})"
            d["severity"] = severity
    report["healthy"] = not any(d["severity"] == ERROR for d in report["findings"])


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
