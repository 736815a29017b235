"""One module per CLI verb; each is a class whose docstring is its --help.

A verb's module is imported only when that verb runs (cli.py): the reading verbs then start
without torch, Triton or the OpenTelemetry SDK, which only `run`, a pool and the exporters need.
The one-line summaries `kvscope --help` lists are kept here for the same reason;
tests/test_cli_startup.py checks each against its class's docstring.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Protocol


class Verb(Protocol):
    """What cli.py needs of a verb class: its --help (the docstring), flags and run."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None: ...

    @staticmethod
    def run(args: argparse.Namespace) -> int: ...


# Each verb: its module under kvscope.verbs, its class, and its docstring's first line.
VERBS: dict[str, tuple[str, str, str]] = {
    "run": (
        "run",
        "RunCommand",
        "Run a script with the probes on: `kvscope run [options] script.py [args]` or `-m module`.",
    ),
    "ls": (
        "ls",
        "LsCommand",
        "List the pools on this host with their geometry, occupancy, owners and probes.",
    ),
    "top": (
        "top",
        "TopCommand",
        "Show a live pool or a dump in the terminal UI: `kvscope top NAME|FILE [--hz N] [--at N]`.",
    ),
    "dump": (
        "dump",
        "DumpCommand",
        "Dump a live pool to a file: `kvscope dump NAME -o FILE [--with-data] [--redact]`.",
    ),
    "analyze": (
        "analyze",
        "AnalyzeCommand",
        "Analyze a dump file or a live pool (FILE|NAME) and say what is wrong and who did it.",
    ),
    "check": (
        "check",
        "CheckCommand",
        "Check a live pool (`--repair` reclaims what dead processes left behind).",
    ),
    "timeline": (
        "timeline",
        "TimelineCommand",
        "Write a pool's flight recorder as a trace for Perfetto:"
        " `kvscope timeline NAME|FILE -o trace.json`.",
    ),
    "report": (
        "report",
        "ReportCommand",
        "Write a self-contained HTML report of a pool or a dump:"
        " `kvscope report NAME|FILE -o report.html`.",
    ),
    "replay": (
        "replay",
        "ReplayCommand",
        "Re-run an operation log against a fresh pool and stop at the first divergence or"
        " finding: `kvscope replay LOG [--until N] [--shrink] [--emit-script FILE]`.",
    ),
    "events": (
        "events",
        "EventsCommand",
        "Record or check an engine's KV-event stream: `kvscope events record|check ...`.",
    ),
}


def summary(name: str) -> str:
    """The one-line help of verb `name`, without importing its module."""
    return VERBS[name][2]


def load(name: str) -> type[Verb]:
    """The class of verb `name` (imports its module)."""
    module, cls, _ = VERBS[name]
    verb: type[Verb] = getattr(importlib.import_module(f"{__name__}.{module}"), cls)
    return verb
