"""A user's engine, written from docs/POOL.md alone (tests/user_engine.py), with one bug planted
per run: under `kvscope run` each bug is a finding naming the right block, request and line, and
the bug-free engine runs clean."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.analysis import analyze_view
from kvscope.dumpfile import alive_for, read_dump

ENGINE = Path(__file__).resolve().parent / "user_engine.py"


def site_line(name: str) -> int:
    """The line of the `# SITE:<name>` marker in the engine."""
    for i, line in enumerate(ENGINE.read_text().splitlines(), start=1):
        if line.rstrip().endswith(f"# SITE:{name}"):
            return i
    raise AssertionError(f"no SITE:{name} marker")


def run_engine(tmp_path: Path, bug: str) -> tuple[int, str, dict, list[dict]]:
    """Run the engine with one bug under kvscope; (exit code, stderr, its facts and the run's
    pid, findings)."""
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    name = f"user-engine-{os.getpid()}-{bug}"
    out = subprocess.run(
        [kvscope, "run", "--fail-on", "leak", "--dump-dir", str(tmp_path), str(ENGINE), name, bug],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    dumps = glob.glob(str(tmp_path / "kvscope-*.kvd"))
    findings: list[dict] = []
    if dumps:
        view, dh = read_dump(dumps[0])
        findings = analyze_view(view, alive=alive_for(dh), dump_header=dh)["findings"]
        facts["pid"] = int(dh["pid"])
    return out.returncode, out.stderr, facts, findings


def of_kind(findings: list[dict], kind: str) -> list[dict]:
    return [f for f in findings if f["kind"] == kind]


def at(line: int) -> re.Pattern[str]:
    return re.compile(rf"user_engine\.py:{line} ")


@pytest.mark.slow
def test_the_bug_free_engine_runs_clean(tmp_path):
    code, err, _, findings = run_engine(tmp_path, "none")
    assert code == 0 and not findings, err[-3000:]
    assert "kvscope: pool" not in err


@pytest.mark.slow
def test_a_leak_on_an_exception_path_names_the_request_and_its_allocate_line(tmp_path):
    code, err, facts, findings = run_engine(tmp_path, "exception")
    assert code != 0 and facts["failed"] == ["r2"]
    (f,) = [f for f in of_kind(findings, "leak_finished") if f["request"] == "r2"]
    assert at(site_line("admit")).search(f["site"] + " "), f


@pytest.mark.slow
def test_a_spawned_worker_that_never_frees_is_named_at_its_own_allocate_line(tmp_path):
    code, err, facts, findings = run_engine(tmp_path, "worker")
    assert code != 0
    (f,) = [f for f in of_kind(findings, "leak_finished") if f["request"] == "w1"]
    # Its first blocks are the shared system prompt's (another request allocated them): the
    # finding is about w1's own block, allocated at the worker's allocate line.
    assert at(site_line("worker-allocate")).search(f["site"] + " "), f
    assert f["owner_pid"] != facts["pid"]  # the worker's, not the script's


@pytest.mark.slow
def test_a_refused_double_free_is_a_finding_at_the_second_free(tmp_path):
    code, err, _, findings = run_engine(tmp_path, "double-free")
    assert code != 0
    (f,) = of_kind(findings, "double_free")
    assert f["request"] == "r2" and at(site_line("second-free")).search(f["message"])


@pytest.mark.slow
def test_prefill_written_as_if_contiguous_is_named_at_the_store_into_the_prefix_blocks(tmp_path):
    code, err, facts, findings = run_engine(tmp_path, "contiguous")
    assert code != 0 and facts["strays"]
    hit = of_kind(findings, "published_block_modified")
    assert hit, [f["kind"] for f in findings]
    for f in hit:
        # The damaged block is one the bad writes landed in, named by the request whose store
        # wrote there, at the store's line; its site is still where the block was allocated.
        assert facts["stray_writers"][str(f["block"])] == f["request"]
        assert at(site_line("store")).search(f["message"]), f
        assert f"published by request '{facts['strays'][str(f['block'])]}'" in f["message"]
        assert at(site_line("admit")).search(f["site"] + " ")


@pytest.mark.slow
def test_a_request_that_stores_the_prefix_it_hit_is_named_at_its_store(tmp_path):
    code, err, facts, findings = run_engine(tmp_path, "whole-prompt")
    assert code != 0
    hit = of_kind(findings, "published_block_modified")
    # Every request after the first hit the 10 blocks of the system prompt and wrote them: the
    # first to do so, r1, is named for each, at the store's line, not the publisher r0.
    assert len({f["block"] for f in hit}) == len(hit) == 10, [f["kind"] for f in findings]
    for f in hit:
        assert f["request"] == "r1" and at(site_line("store")).search(f["message"]), f
        assert "published by request 'r0'" in f["message"]
    assert {f["kind"] for f in findings} == {"published_block_modified"}


@pytest.mark.slow
def test_a_write_through_a_table_kept_after_free_names_who_freed_the_block(tmp_path):
    code, err, facts, findings = run_engine(tmp_path, "stale-table")
    assert code != 0
    (blk,) = [int(b) for b in facts["strays"]]
    (f,) = [f for f in of_kind(findings, "use_after_free") if f["block"] == blk]
    assert f["request"] == "r2" and "written after it was freed" in f["message"]
    assert re.search(r"request 'r2' freed it at \d{4}-\d\d-\d\d ", f["message"])


@pytest.mark.slow
def test_a_skipped_copy_on_write_copy_is_kv_never_written_at_the_free(tmp_path):
    code, err, facts, findings = run_engine(tmp_path, "skip-copy")
    assert code != 0
    # r3's first sample went on without its copy: the new block holds the token stored next
    # and poison where the positions before it belong, found as r3 finished
    assert {f["kind"] for f in findings} == {"kv_never_written"}, [f["kind"] for f in findings]
    (f,) = findings
    assert f["request"] == "r3" and "never written" in f["message"], f
