"""bench/bench_loop_run.py: the serving loop as a script, plainly and under `kvscope run`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_loop_run  # noqa: E402

from kvscope.allocator.segment import segment_path  # noqa: E402


def test_the_script_reports_its_loop(pool_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    # WHEN the bench's script runs its loop once, in this process
    rc = bench_loop_run.main(["--loop", "--steps", "20", "--seed", "3", "--name", pool_name])
    # THEN it prints one JSON line with the loop's operations, timed by the script, and its
    # pool is gone (closed and unlinked)
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(out) == 1
    figures = json.loads(out[0])
    # 64 allocations, 64 appends a step, and 3 more operations for each request that finished
    assert figures["ops"] >= 64 + 64 * 20 and (figures["ops"] - 64 - 64 * 20) % 3 == 0
    assert figures["ops_per_cpu_s"] == pytest.approx(figures["ops"] / figures["loop_cpu_s"])
    assert figures["loop_end"] > figures["loop_start"]
    assert not Path(segment_path(pool_name)).exists()


@pytest.mark.parametrize("flag", ["--steps", "--pairs"])
def test_a_bad_count_is_a_one_line_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_loop_run.main([flag, "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"bench_loop_run.py: error: {flag} must be 1 or more (got 0)\n"


@pytest.mark.slow
def test_one_round_of_every_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # WHEN the bench runs one quick round: the script plainly, under kvscope run, and under
    # kvscope run --no-guard
    out_json = tmp_path / "runs.json"
    rc = bench_loop_run.main(
        ["--pairs", "1", "--steps", "30", "--dump-dir", str(tmp_path), "--json", str(out_json)]
    )
    out = capsys.readouterr().out
    # THEN every mode ran the same loop (the same seed: the same operations) and each has its
    # row, its ratio to the plain run, and the times outside the loop
    assert rc == 0
    runs = json.loads(out_json.read_text())
    assert set(runs) == set(bench_loop_run.MODES)
    assert len({r[0]["ops"] for r in runs.values()}) == 1
    for mode in bench_loop_run.MODES:
        row = re.search(rf"^\| {re.escape(mode)} \|(.*)$", out, re.M)
        assert row is not None, out
        cells = [c.strip() for c in row.group(1).split("|")]
        assert re.fullmatch(r"[\d,]+ \([\d,]+-[\d,]+\)", cells[0])
        assert mode == "plain" or re.fullmatch(r"\d+\.\d\dx", cells[2])
        assert all(r["start_s"] > 0 and r["exit_s"] > 0 for r in runs[mode])
    # and no dump: each run under kvscope run was clean (no finding, no leak)
    assert not list(tmp_path.glob("*.kvd"))
