"""bench/bench_step_host.py: the example server's steps without the model, plainly and under
`kvscope run`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import bench_step_host  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("model", [[], ["--attend"]], ids=["no-model", "attention"])
def test_a_run_serves_every_request_and_reports_its_steps(
    model: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # WHEN one run serves 8 requests in this process, without the probes (the attention layers
    # run, or no model at all)
    rc = bench_step_host._worker(["--requests", "8", *model])
    # THEN it prints one JSON line: its steps, their host time by phase, every request's tokens
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and len(out) == 1
    figures = json.loads(out[0])
    assert figures["steps"] > 0 and figures["tokens"] >= 8 * 32 and figures["findings"] == []
    assert figures["us_per_step"] == pytest.approx(sum(figures["phase_us"].values()))


def test_timed_methods_are_counted_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    # WHEN a run times TIMED's methods
    assert bench_step_host._worker(["--requests", "8", "--time"]) == 0
    figures = json.loads(capsys.readouterr().out)
    # THEN each is there, with its calls: a check of the writes every step, none without probes
    calls = figures["calls"]
    assert set(calls) == {f"{cls}.{name}" for _, cls, name in bench_step_host.TIMED}
    assert calls["Batch.check_writes"][0] == figures["steps"] and calls["Writers.check"][0] == 0
    assert calls["KVPool.allocate"][0] == 8


@pytest.mark.parametrize("flag", ["--requests", "--repeat"])
def test_a_bad_count_is_a_one_line_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = bench_step_host.main([flag, "0"])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"bench_step_host.py: error: {flag} must be 1 or more (got 0)\n"


@pytest.mark.slow
def test_a_pair_runs_plainly_and_under_kvscope_run(capsys: pytest.CaptureFixture[str]):
    # WHEN one pair of runs serves 8 requests (the second under kvscope run's probes)
    rc = bench_step_host.main(["--requests", "8", "--repeat", "1"])
    # THEN both served without a finding, and the figures of each are printed
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "plain: median" in out and "kvscope run: median" in out and "probes add:" in out


@pytest.mark.slow
def test_deferred_runs_the_probes_checks_through_the_core_queue(capsys: pytest.CaptureFixture[str]):
    # WHEN one pair of runs serves 8 requests with the CPU pool's checks queued as a CUDA
    # pool's (--deferred)
    rc = bench_step_host.main(["--requests", "8", "--repeat", "1", "--deferred"])
    # THEN the run under kvscope run queued checks every step, the plain one none
    out = capsys.readouterr().out
    assert rc == 0, out
    plain = next(
        line for line in out.splitlines() if line.startswith("plain: ") and "steps" in line
    )
    probed = next(
        line for line in out.splitlines() if line.startswith("kvscope run: ") and "steps" in line
    )
    assert "0.00 checks" in plain and "0.00 checks" not in probed
