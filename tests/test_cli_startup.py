"""The reading verbs start without torch, Triton or the OpenTelemetry SDK (kvscope/verbs)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from kvscope.cli import main
from kvscope.verbs import VERBS, load, summary

HEAVY = ("torch", "triton", "opentelemetry.sdk", "textual")

# Runs the installed CLI's main in a fresh interpreter and prints what it had to import.
PROBE = """
import json, sys
from kvscope.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = [m for m in {heavy!r} if m in sys.modules]
print(json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
"""


def imported_by(*argv: str) -> dict:
    """Exit code and the heavy modules `kvscope ARGV` imported, in a fresh interpreter."""
    run = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVSCOPE_RUN_DIR": ""},
    )
    return json.loads(run.stderr.strip().splitlines()[-1])


@pytest.fixture
def dump_file(make_pool, tmp_path):
    """A dump (without data) of an unguarded pool holding one sequence."""
    pool = make_pool(32)
    pool.allocate("req-1", list(range(9)))
    out = tmp_path / "p.kvd"
    assert main(["dump", pool.name, "-o", str(out)]) == 0
    return str(out)


def test_version_imports_no_heavy_module():
    # GIVEN a fresh interpreter WHEN `kvscope --version` runs
    got = imported_by("--version")
    # THEN it succeeds without importing torch, Triton, the OTel SDK or Textual
    assert got == {"code": 0, "heavy": []}


@pytest.mark.slow
def test_analyze_of_a_dump_imports_no_heavy_module(dump_file):
    # GIVEN a dump of a healthy pool, without KV data
    # WHEN a fresh interpreter analyzes it, as text and as JSON
    text = imported_by("analyze", dump_file)
    as_json = imported_by("analyze", dump_file, "--json")
    # THEN both succeed and neither imported torch, Triton, the OTel SDK or Textual
    assert text == {"code": 0, "heavy": []}
    assert as_json == {"code": 0, "heavy": []}


@pytest.mark.slow
def test_ls_and_check_of_an_unguarded_pool_import_no_heavy_module(make_pool):
    # GIVEN a live CPU pool without guard slots or digests (no data check applies)
    pool = make_pool(16)
    pool.allocate("req-1", list(range(5)))
    # WHEN a fresh interpreter lists pools and checks this one
    listed = imported_by("ls")
    checked = imported_by("check", pool.name)
    # THEN both run without the heavy modules
    assert listed["heavy"] == [] and listed["code"] in (0, 2)
    assert checked == {"code": 0, "heavy": []}


def test_help_summaries_are_the_verbs_docstrings():
    # GIVEN every verb's class WHEN its docstring's first line is read
    # THEN it is the summary `kvscope --help` lists without importing the verb
    for name in VERBS:
        doc = inspect.getdoc(load(name)) or ""
        assert doc.splitlines()[0] == summary(name), name


def test_verb_help_shows_its_flags(capsys):
    # GIVEN the CLI WHEN `kvscope analyze --help` runs
    assert main(["analyze", "--help"]) == 0
    # THEN the verb's own flags are prepared and shown
    assert "--json" in capsys.readouterr().out
