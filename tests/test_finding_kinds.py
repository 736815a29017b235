"""Every finding kind is produced by the library, and its producers name it with `FindingKind`
(allocator/findings.py). Read from the source with `ast`, and from the C core's table of the
kinds it writes itself (allocator/csrc/probes.c FK_NAMES)."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from kvscope.allocator.findings import SEVERITY, FindingKind
from tests.sources import parsed

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("allocator", "probes", "kvscope", "tui")
VALUES = {k.value: k for k in FindingKind}


@functools.cache
def kinds_passed() -> list[tuple[str, FindingKind, bool]]:
    """(file, kind, as a literal) for each kind passed as an argument of a call in the library."""
    out = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(parsed(path)):
                if not isinstance(node, ast.Call):
                    continue
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    if (
                        isinstance(arg, ast.Attribute)
                        and isinstance(arg.value, ast.Name)
                        and arg.value.id == "FindingKind"
                    ):
                        out.append((rel, FindingKind[arg.attr], False))
                    elif isinstance(arg, ast.Constant) and arg.value in VALUES:
                        out.append((rel, VALUES[arg.value], True))
    return out


def kinds_of_the_core() -> set[FindingKind]:
    """The kinds the C core writes into the findings ring itself (FK_NAMES)."""
    text = (ROOT / "allocator" / "csrc" / "probes.c").read_text()
    table = re.search(r"FK_NAMES\[FK_COUNT\] = \{(.*?)\};", text, re.S)
    assert table, "probes.c has no FK_NAMES table"
    return {VALUES[name] for name in re.findall(r'"([a-z_]+)"', table.group(1))}


@pytest.mark.slow
def test_every_kind_is_produced_by_the_library():
    # GIVEN the findings vocabulary WHEN the library's calls and the core's table are read
    produced = {kind for _, kind, _ in kinds_passed()} | kinds_of_the_core()
    # THEN each kind is passed to some producer, and each has a severity
    assert set(FindingKind) - produced == set()
    assert set(SEVERITY) == set(FindingKind)


def test_producers_name_kinds_with_the_enum():
    # GIVEN every kind passed in a call of the library
    # WHEN the string literals among them are collected
    literals = {(rel, kind.value) for rel, kind, literal in kinds_passed() if literal}
    # THEN there is none
    assert literals == set()
