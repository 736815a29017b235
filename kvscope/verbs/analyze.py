"""Analyze a dump file or a live pool: health, findings with owners and events, summary.

Exit code 0 when healthy, 1 when a finding of severity error is present, 2 on unusable input.
`--json` prints the object of docs/CLI.md: {"pool", "healthy", "summary", "findings"}.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvscope.analysis import analyze_view, exit_code
from kvscope.capacity import capacity_answer
from kvscope.history import History, history_for
from kvscope.report import print_json, render
from kvscope.target import Target, add_trust_owner, open_target, removed_meanwhile


def add_pool_context(report: dict[str, Any], t: Target, history: History | None) -> None:
    """What `analyze` and `check` add to a pool's analysis: the capacity answer (from the
    run's history where there is one, else from the copy) and a live CUDA pool's GPU memory."""
    if report["summary"]:  # empty when the header is corrupt: no counter can be trusted
        report["capacity"] = capacity_answer(t.view, history, t.alive)
    if t.dump_header is None and str(report["pool"]["device"]).startswith("cuda"):
        # A live pool on a GPU: that GPU's memory now (NVML), beside the pool's own bytes
        # (kvscope.probes imports the pool, and torch: only here).
        from kvscope.probes.nvml import gpu_memory

        gpu = gpu_memory(report["pool"]["device"])
        if gpu is not None:
            report["pool"]["gpu"] = gpu


class AnalyzeCommand:
    """Analyze a dump file or a live pool (FILE|NAME) and say what is wrong and who did it."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("target", metavar="FILE|NAME", help="a dump file or a pool name")
        parser.add_argument("--json", action="store_true", help="print the report as JSON")
        parser.add_argument("--block", type=int, metavar="N", help="narrow the report to block N")
        parser.add_argument(
            "--request", metavar="R", help="narrow the report to the request with id R"
        )
        add_trust_owner(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        t = open_target(args.target, args.trust_owner)
        got = t.findings()
        report = analyze_view(
            t.view,
            alive=t.alive,
            dump_header=t.dump_header,
            block=args.block,
            request=args.request,
            findings=got.findings,
            kv=got.kv,
        )
        add_pool_context(report, t, history_for(args.target))
        if t.dump_header is None:
            removed_meanwhile(args.target)
        if args.json:
            print_json(report)
        else:
            render(report, title=t.title)
        return exit_code(report)
