"""Analyze a dump file or a live pool: health, findings with owners and events, summary.

Exit code 0 when healthy, 1 when a finding of severity error is present, 2 on unusable input.
`--json` prints DESIGN.md's object: {"pool", "healthy", "summary", "findings"}.
"""

from __future__ import annotations

import argparse

from kvscope.analysis import analyze_view, exit_code
from kvscope.kvread import for_target
from kvscope.report import print_json, render
from kvscope.target import open_target


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

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        t = open_target(args.target)
        report = analyze_view(
            t.view,
            alive=t.alive,
            dump_header=t.dump_header,
            block=args.block,
            request=args.request,
            kv=for_target(args.target, t.view, t.dump_header),
        )
        if args.json:
            print_json(report)
        else:
            render(report, title=t.title)
        return exit_code(report)
