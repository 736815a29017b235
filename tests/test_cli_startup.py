"""The reading verbs start without torch, Triton, OpenTelemetry or Textual (kvscope/verbs): each
test runs a verb in a fresh interpreter and fails if one of them is in its sys.modules."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

from kvscope.cli import main
from kvscope.verbs import VERBS, load, summary

HEAVY = ("torch", "triton", "opentelemetry", "textual")

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


def run_fresh(*argv: str) -> tuple[dict, str]:
    """Exit code and the heavy modules `kvscope ARGV` imported in a fresh interpreter, and
    what it printed on stdout."""
    run = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVSCOPE_RUN_DIR": ""},
    )
    return json.loads(run.stderr.strip().splitlines()[-1]), run.stdout


def imported_by(*argv: str) -> dict:
    """Exit code and the heavy modules `kvscope ARGV` imported, in a fresh interpreter."""
    return run_fresh(*argv)[0]


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


@pytest.mark.slow
def test_check_and_analyze_of_a_guarded_pool_read_its_data_without_torch(
    make_pool, probes, tmp_path
):
    # GIVEN a live guard-mode CPU pool whose held block's guard slot was overwritten, and a
    # dump of it with its KV data
    pool = make_pool(16, guard=True)
    held = pool.allocate("held", list(range(5)))
    pool.kv[0, 1, held.block_table[0], pool.block_size] = 1.0
    dump = str(tmp_path / "guarded.kvd")
    assert main(["dump", pool.name, "-o", dump, "--with-data"]) == 0
    # WHEN a fresh interpreter checks the pool and analyzes the dump, as JSON
    for argv in (["check", pool.name, "--json"], ["analyze", dump, "--json"]):
        got, out = run_fresh(*argv)
        # THEN each read the data and found the canary, without the heavy modules
        assert got == {"code": 1, "heavy": []}, argv
        report = json.loads(out)
        found = {(f["kind"], f["block"]) for f in report["findings"]}
        assert ("guard_violation", held.block_table[0]) in found, argv
        assert report["data_checks"] == {"checked": True, "unchecked": None}


@pytest.mark.slow
def test_a_dump_without_data_of_a_guarded_pool_says_its_data_was_not_checked(make_pool, tmp_path):
    # GIVEN a dump, without KV data, of a guard-mode pool
    pool = make_pool(16, guard=True)
    pool.allocate("held", list(range(5)))
    dump = str(tmp_path / "bare.kvd")
    assert main(["dump", pool.name, "-o", dump]) == 0
    # WHEN a fresh interpreter analyzes it, as text
    got, out = run_fresh("analyze", dump)
    # THEN it says which checks did not run, and imported none of the heavy modules
    assert got == {"code": 0, "heavy": []}
    assert "note: the dump carries no KV data (written without --with-data)" in out


@pytest.mark.slow
def test_dump_report_and_timeline_import_no_heavy_module(make_pool, tmp_path):
    # GIVEN a live guard-mode CPU pool holding a sequence
    pool = make_pool(16, guard=True)
    pool.allocate("req-1", list(range(5)))
    dump = str(tmp_path / "p.kvd")
    # WHEN a fresh interpreter dumps it (with its data), writes its report and its timeline
    runs = [
        ["dump", pool.name, "-o", dump, "--with-data"],
        ["report", dump, "-o", str(tmp_path / "p.html")],
        ["timeline", pool.name, "-o", str(tmp_path / "p.json")],
    ]
    # THEN each succeeds without the heavy modules
    for argv in runs:
        assert imported_by(*argv) == {"code": 0, "heavy": []}, argv


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
