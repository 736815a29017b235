"""Write one self-contained HTML report of a live pool or a dump.

The file works offline and runs no script (inline SVG and CSS): the block map with a legend;
utilization, held / cached / free blocks, demand and preemptions over time (from the history
`kvscope run` writes beside its dumps); the capacity answer (peak vs mean demand, the pool size
that would have avoided every preemption); refcount and reuse histograms; every finding with
its allocation site or stack and the events that allocated and freed its blocks.
Exit code 0, or 2 on unusable input.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvscope.allocator.dumpfile import check_target, write_atomic
from kvscope.analysis import analyze_view
from kvscope.capacity import capacity_answer
from kvscope.events.streamfile import is_stream_file
from kvscope.history import history_for
from kvscope.htmlreport import build_report
from kvscope.target import open_target
from kvscope.verbs.common import add_target_and_history


class ReportCommand:
    """Write a self-contained HTML report of a pool or a dump: `kvscope report NAME|FILE -o report.html`."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        add_target_and_history(parser)
        parser.add_argument("-o", "--output", required=True, metavar="FILE", help="HTML file")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        # Refused before the work: a device, FIFO or directory is never replaced.
        check_target(args.output, "a report", stdout=False)
        if is_stream_file(args.target):
            # a recorded KV-event stream (kvscope events record): its own report
            from kvscope.events.report import report_verb

            return report_verb(args.target, args.output, args.history)
        t = open_target(args.target)
        history = history_for(args.target, args.history)
        got = t.findings()
        analysis = analyze_view(
            t.view, alive=t.alive, dump_header=t.dump_header, findings=got.findings, kv=got.kv
        )
        if analysis["summary"]:
            capacity = capacity_answer(t.view, history, t.alive)
        else:
            # The summary is empty when the header is corrupt: none of its counters is trusted.
            capacity = {
                "num_blocks": t.view.layout.num_blocks,
                "answer": "the pool's header is corrupt: its counters cannot be trusted",
            }
        page = build_report(
            t.view, analysis=analysis, history=history, capacity=capacity, source=args.target
        )
        write_atomic(args.output, [page.encode()], mode=None)
        size = os.path.getsize(args.output)
        print(
            f"kvscope: wrote {os.path.abspath(args.output)} ({size / 1024:.0f} KiB,"
            f" {len(analysis['findings'])} finding(s),"
            f" {0 if history is None else history.count} history sample(s))",
            file=sys.stderr,
        )
        return 0
