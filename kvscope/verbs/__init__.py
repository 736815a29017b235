"""One module per CLI verb; each is a class whose docstring is its --help."""

from __future__ import annotations

import argparse
from typing import Protocol

from kvscope.verbs.analyze import AnalyzeCommand
from kvscope.verbs.check import CheckCommand
from kvscope.verbs.dump import DumpCommand
from kvscope.verbs.ls import LsCommand
from kvscope.verbs.report import ReportCommand
from kvscope.verbs.run import RunCommand
from kvscope.verbs.timeline import TimelineCommand
from kvscope.verbs.top import TopCommand


class Verb(Protocol):
    """What cli.py needs of a verb class: its --help (the docstring), flags and run."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None: ...

    @staticmethod
    def run(args: argparse.Namespace) -> int: ...


VERBS: dict[str, type[Verb]] = {
    "run": RunCommand,
    "ls": LsCommand,
    "top": TopCommand,
    "dump": DumpCommand,
    "analyze": AnalyzeCommand,
    "check": CheckCommand,
    "timeline": TimelineCommand,
    "report": ReportCommand,
}
