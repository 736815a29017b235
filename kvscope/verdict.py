"""What a finished `kvscope run` says and leaves: the dumps and their analysis, the history and
the trace beside them, the exit code, and what becomes of each pool.

    code, dumped = finish(sup, outcome, dump_dir, fail_on)  # dump, analyze, the exit code
    write_timelines(sup, dump_dir)                          # --timeline
    settle_pools(sup, dumped, keep=False)                   # a dumped pool nobody holds goes

kvscope/verbs/run.py imports this module once the script has started (it brings the analysis,
the report and the dump writer), so their import overlaps the script's own start-up.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from typing import Any

from kvscope.allocator.dumpfile import dump_name, write_dump
from kvscope.allocator.dumpread import read_dump_header
from kvscope.allocator.errors import PoolError
from kvscope.allocator.findings import ERROR, WARNING, Finding, FindingKind
from kvscope.allocator.findingset import said_key
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.process import is_alive
from kvscope.analysis import analyze_view
from kvscope.capacity import capacity_answer
from kvscope.errors import EXIT_FAIL_ON, EXIT_FINDINGS, EXIT_USAGE
from kvscope.history import history_path
from kvscope.report import console, render
from kvscope.stopper import echo
from kvscope.supervisor import Outcome, Supervisor, Watched, fails, is_error, is_leak
from kvscope.timeline import build_trace, trace_path, write_trace


def _beside_dump(w: Watched, snap: SegmentView, path: str, report: dict[str, Any]) -> None:
    """The pool's history beside its dump, and the capacity answer in the printed analysis."""
    if w.history is not None and w.history.count:
        try:
            w.history.write(history_path(path))
        except OSError as e:
            echo(f"kvscope: could not write the history beside {path}: {e.strerror or e}")
    report["capacity"] = capacity_answer(snap, w.history)


def write_timelines(sup: Supervisor, dump_dir: str) -> None:
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
            echo(f"kvscope: could not write the timeline of pool {w.name!r}: {why}")
            continue
        echo(f"kvscope: wrote {trace_path(base)} (open it in Perfetto or chrome://tracing)")


def finish(
    sup: Supervisor, outcome: Outcome, dump_dir: str, fail_on: str, record_ops: str | None = None
) -> tuple[int, list[Watched]]:
    """Dump and analyze when something went wrong; the exit code and the pools dumped.

    The printed analysis gives each finding the severity --fail-on gives it (error when it
    fails the run, warning when not), so its headline and the exit code agree; the dump keeps
    the findings' own severities. A dump that cannot be written (a full disk) is one line, the
    analysis is still printed, and the exit code is the script's when it failed, else 2. With
    `record_ops` (--record-ops), each dump gets a link to the run's operation log beside it
    (DUMP.ops), which `kvscope replay DUMP` reads.
    """
    pid = sup.pid
    finals = []
    dumped: list[Watched] = []
    dump_failed = False
    for w in sup.pools.values():
        try:
            finals.append((w, *sup.final_findings(w)))
        except PoolError as e:
            echo(f"kvscope: error: {e}")
            dump_failed = True
    found = sup.live_findings + [f for _, _, fs in finals for f in fs]
    # (the exit check's other findings are errors or warnings of their own kinds, not leaks)
    leaked_at_exit = any(v.get("blocks") or v.get("leaks") for v in outcome.exit_checks.values())
    leaked = leaked_at_exit or any(is_leak(f) for f in found)
    errored = any(is_error(f) for f in found)
    what = outcome.describe(pid)
    if outcome.failed or errored or leaked:
        # (after how the script ended, before what leaked; a stall the run said comes between)
        notes = ["findings of severity error"] if errored else []
        # (a lease past its deadline or outliving its holder leaks a lease, not blocks)
        leases = any(f.kind == FindingKind.LEASE_LEAK for f in found)
        blocks = leaked_at_exit or any(
            is_leak(f) and f.kind != FindingKind.LEASE_LEAK for f in found
        )
        notes += ["blocks leaked"] if blocks else []
        notes += ["leases leaked"] if leases else []
        if not finals and not dump_failed:
            echo(f"kvscope: {what}; it opened no pool, so there is nothing to dump")
        used: set[str] = set()
        for w, snap, fs in finals:
            path = _unique(os.path.join(dump_dir, dump_name(w.name, pid)), used)
            try:
                write_dump(
                    snap,
                    path,
                    reason="; ".join([what, *([w.stall_note()] if w.stalled_at else []), *notes]),
                    pid=pid,
                    header_prefix=w.header_prefix,
                    failed=outcome.failed,
                )
                header = read_dump_header(path)
            except PoolError as e:
                echo(f"kvscope: error: {e}")
                dump_failed, path, header = True, "", None
            # (with the dump's header, the report is the one `kvscope analyze` gives of it)
            report = analyze_view(snap, alive=is_alive, findings=fs, dump_header=header)
            _as_run_sees_it(report, fail_on)
            if path:
                report["pool"]["dump"]["path"] = path
                _beside_dump(w, snap, path, report)
            con = console(sys.stderr)
            con.print()
            render(report, con, title=f"kvscope run: {what}; pool")
            if path:
                dumped.append(w)
                echo(f"kvscope: wrote {path} (kvscope analyze {path})")
                from_data = sum(1 for f in fs if f.extra.get("kv_data"))
                if from_data:
                    echo(
                        f"kvscope: {from_data} of the findings above were read from the pool's "
                        "K/V data, which the dump does not carry: `kvscope analyze` of it lists "
                        "the others (those the ring holds say the same)"
                    )
                if record_ops:
                    _link_log(path, record_ops)
            else:
                echo(f"kvscope: no dump of pool {w.name!r} was written (above)")
    else:
        # A PoolExhausted the script caught leaves no finding and no leak, but it is the
        # answer to "my server OOMs": said for each pool that raised one (before the verdict,
        # which stays the last line).
        for w, snap, _ in finals:
            cap = capacity_answer(snap, w.history)
            # (and a run that ended idle with room num_free leaves out: a server that stopped
            # admitting, which the same answer names)
            if cap["num_exhausted"] or cap.get("idle_with_room"):
                echo(f"kvscope run: pool {w.name!r}: {cap['answer']}")
        # The final read holds the ring's findings again (the live lines printed them) beside
        # what only the whole-pool check saw: print those too, and count each finding once.
        said = {said_key(f) for f in sup.live_findings}
        late = []
        for w, _, fs in finals:
            for f in fs:
                key = said_key(f)
                if key in said:
                    continue
                said.add(key)
                late.append(f)
                shown = replace(f, severity=ERROR if fails(f, fail_on) else WARNING)
                echo(f"kvscope: pool {w.name!r}: {shown.line()}")
        echo(f"kvscope run: {what}; {_clean_verdict(sup, sup.live_findings + late)}")
    unproved = _report_unproved(sup, found)
    if outcome.failed:
        return outcome.returncode if outcome.returncode > 0 else 128 + (outcome.signal or 0), dumped
    if dump_failed:
        return EXIT_USAGE, dumped
    if unproved:
        return EXIT_FINDINGS, dumped
    if (fail_on == "error" and errored) or (fail_on == "leak" and (errored or leaked)):
        echo(f"kvscope: {what}, but {_matched(errored, leaked, fail_on)}: exit {EXIT_FAIL_ON}")
        return EXIT_FAIL_ON, dumped
    return 0, dumped


# What each --fail-on fails a run on, said in the verdict's last line (its name alone, "leak",
# reads as if a leak matched when a double free did).
_FAILS_ON = {"leak": "errors and leaks", "error": "errors other than leaks"}


def _matched(errored: bool, leaked: bool, fail_on: str) -> str:
    """What matched --fail-on, in words: 'findings of severity error matched --fail-on leak
    (it fails a run on errors and leaks)', 'leaks matched ...', or both; under `error`, only
    the errors count."""
    what = ["findings of severity error"] if errored else []
    if fail_on == "leak" and leaked:
        what.append("leaks")
    policy = f"--fail-on {fail_on} (it fails a run on {_FAILS_ON[fail_on]})"
    return f"{' and '.join(what)} matched {policy}"


def settle_pools(sup: Supervisor, dumped: list[Watched], *, keep: bool) -> None:
    """Remove the files of each dumped pool no live process holds any more (the dump has what
    they held), unless --keep-pool; say what became of each."""
    if not dumped:
        return
    holders: dict[str, list[int]] = {}
    for w, pid in sup.still_attached():
        holders.setdefault(w.key, []).append(pid)
    for w in dumped:
        if w.unlinked_to:
            # the script unlinked it: its files go with the run (Supervisor.cleanup)
            if keep:
                echo(
                    f"kvscope: pool {w.name!r} was unlinked by the script: --keep-pool cannot "
                    "keep it (its dump holds what it held)"
                )
            continue
        if keep:
            echo(
                f"kvscope: kept pool {w.name!r} (--keep-pool); `kvscope check {w.name} --repair"
                " --unlink` removes it"
            )
        elif w.key in holders:
            pids = ", ".join(map(str, holders[w.key]))
            echo(f"kvscope: kept pool {w.name!r}: pid {pids} still holds it")
        elif sup.remove_pool(w):
            echo(
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
        return f"{pools}: no error, no leak, {len(found)} warning(s); nothing to dump"
    return f"{pools}: no finding, no leak; nothing to dump"


def _as_run_sees_it(report: dict[str, Any], fail_on: str) -> None:
    """Give each finding of the report the severity --fail-on gives it, and say so."""
    for d in report["findings"]:
        severity = ERROR if fails(d, fail_on) else WARNING
        if severity != d["severity"]:
            d["message"] += f" ({severity} under --fail-on {fail_on})"
            d["severity"] = severity
    report["healthy"] = not any(d["severity"] == ERROR for d in report["findings"])


def _report_unproved(sup: Supervisor, found: list[Finding]) -> bool:
    """Faults armed for the run that no process injected (kvscope/child.py records them), and
    faults injected that no finding of their kinds answered (faults.FOUND_AS): say so; True
    when there is one (the run proved nothing about them)."""
    from kvscope.allocator.faults import FOUND_AS
    from kvscope.child import run_faults

    fired, unfired = run_faults(sup.run_dir)
    for name in unfired:
        echo(
            f"kvscope: fault {name!r} was armed but never fired: no operation of the script "
            "gave it an opportunity it could act on"
        )
    kinds = {f.kind for f in found}
    unfound = [n for n in fired if n in FOUND_AS and not kinds & set(FOUND_AS[n][0])]
    for name in unfound:
        wanted, where = FOUND_AS[name]
        found_by = f" (it is found by {where})" if where else ""
        echo(
            f"kvscope: fault {name!r} fired but no {' or '.join(wanted)} finding came"
            f"{found_by}: this run did not show that it is caught"
        )
    return bool(unfired or unfound)


def _link_log(dump: str, log: str) -> None:
    """The run's operation log linked beside a dump (DUMP.ops: `kvscope replay DUMP`)."""
    link = dump + ".ops"
    try:
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(os.path.abspath(log), link)
    except OSError as e:
        echo(f"kvscope: could not link the operation log beside {dump}: {e.strerror or e}")
        return
    echo(f"kvscope: operation log {log} (kvscope replay {dump})")


def _unique(path: str, used: set[str]) -> str:
    base, ext = os.path.splitext(path)
    k = 1
    while path in used:
        k += 1
        path = f"{base}-{k}{ext}"
    used.add(path)
    return path
