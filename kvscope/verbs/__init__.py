"""One module per CLI verb; each is a class whose docstring is its --help."""

from __future__ import annotations

from kvscope.verbs.analyze import AnalyzeCommand
from kvscope.verbs.check import CheckCommand
from kvscope.verbs.dump import DumpCommand
from kvscope.verbs.ls import LsCommand
from kvscope.verbs.run import RunCommand
from kvscope.verbs.top import TopCommand

VERBS = {
    "run": RunCommand,
    "ls": LsCommand,
    "top": TopCommand,
    "dump": DumpCommand,
    "analyze": AnalyzeCommand,
    "check": CheckCommand,
}
