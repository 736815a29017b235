"""Write the flight recorder of a live pool or a dump as a Chrome trace-event file.

Open it in Perfetto (ui.perfetto.dev, "Open trace file") or chrome://tracing: a track per
process with a slice per request from allocate to free or abort (its blocks in the slice's
arguments), preemptions, copy-on-write, evictions, every finding as an instant naming its
blocks, and, from the history `kvscope run` writes beside its dumps, the pool's counters and
its locks over time. With the pool's operation log (`--ops LOG`; a dump's DUMP.ops beside it by
default, as `kvscope run --record-ops` links it), the log is replayed and the operation the
replay stopped at (a divergence, or the finding it reproduced) is marked across the trace.
`-o -` writes to stdout. Exit code 0, or 2 on unusable input.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from kvscope.allocator.dumpfile import check_target
from kvscope.errors import UsageError
from kvscope.events.streamfile import is_stream_file
from kvscope.history import history_for
from kvscope.target import open_target
from kvscope.timeline import build_trace, write_trace
from kvscope.verbs.common import add_target_and_history, taken_ns


class TimelineCommand:
    """Write a pool's flight recorder as a trace for Perfetto: `kvscope timeline NAME|FILE -o trace.json`."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        add_target_and_history(parser)
        parser.add_argument(
            "-o", "--output", required=True, metavar="FILE", help="trace file (- for stdout)"
        )
        parser.add_argument(
            "--ops",
            metavar="LOG",
            help="the pool's operation log, replayed to mark where it diverges (default: "
            "FILE.ops beside a dump, when there)",
        )

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        if args.output != "-":
            # Refused before the work: a device, FIFO or directory is never replaced.
            check_target(args.output, "a trace", stdout=False)
        if is_stream_file(args.target):
            # a recorded KV-event stream (kvscope events record): its own trace
            from kvscope.events.timeline import timeline_verb

            return timeline_verb(args.target, args.output, args.history)
        t = open_target(args.target)
        history = history_for(args.target, args.history)
        findings = t.findings().findings
        trace = build_trace(
            t.view,
            history=history,
            findings=findings,
            end_ns=taken_ns(t, args.target) or time.time_ns(),
            source=args.target,
        )
        replayed = _mark_replay(trace, args.target, args.ops, str(trace["otherData"]["pool"]))
        if args.output == "-":
            import json

            json.dump(trace, sys.stdout, separators=(",", ":"))
            sys.stdout.write("\n")
        else:
            write_trace(trace, args.output)
        od = trace["otherData"]
        what = f"{od['num_requests']} request slice(s), {len(findings)} finding(s)"
        what += f", {od['history_samples']} history sample(s)"
        if not od["num_requests"] and not int(t.view.events["time_ns"].max(initial=0)):
            what += " (no events recorded: the events probe was off; kvscope run turns it on)"
        if replayed:
            what += f"; {replayed}"
        where = "stdout" if args.output == "-" else os.path.abspath(args.output)
        print(
            f"kvscope: wrote {where}: {what}; open it in Perfetto or chrome://tracing",
            file=sys.stderr,
        )
        return 0


def _mark_replay(trace: dict, target: str, ops: str | None, pool: str) -> str:
    """Replay the pool's operation log (`ops`, or TARGET.ops beside a dump: its records of
    `pool`, the trace's; a log without them is one line) and mark where it stopped in the
    trace; what it says ("" without a log)."""
    path = ops if ops is not None else target + ".ops"
    if ops is None and not os.path.isfile(path):
        return ""
    from kvscope.allocator.oplog import OplogError, read_log
    from kvscope.replay import ReplayError, replay
    from kvscope.timeline import mark_replay

    try:
        outcome = replay(read_log(path, pool), quiet=True)
    except (OplogError, ReplayError) as e:
        raise UsageError(str(e)) from None
    s = mark_replay(trace, outcome, path)
    if "operation" not in s:
        return f"the replay of {path} ran to its {s['reason']} ({s['replayed']} operation(s))"
    return f"the replay of {path} stopped at operation {s['operation']} ({s['reason']})"
