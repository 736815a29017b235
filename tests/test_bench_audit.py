"""bench/bench_audit.py on the CPU, in a quick mode: the host table's audit, and the step graphs
with and without the audit (their static buffers run eagerly on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts import run_script

BENCH = str(Path(__file__).resolve().parents[1] / "bench" / "bench_audit.py")


def _run(*argv: str) -> str:
    done = run_script(BENCH, Path.cwd(), *argv, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
def test_the_host_audit_prints_its_time_per_call():
    out = _run("--rows", "8", "--tokens", "64", "--calls", "50", "--repeat", "2")
    assert "audit of a 8x4 table (8 live rows of 64 tokens, 0 padding rows), CPU pool" in out
    assert "us per audit" in out and "ns per entry" in out


@pytest.mark.slow
def test_the_step_audit_compares_graphs_with_and_without_the_audit():
    # (the bench asserts that neither set of graphs found anything)
    out = _run("--step", "--rows", "4", "--tokens", "32", "--steps", "3", "--repeat", "2")
    assert "decode step of 4 requests of 32 tokens, model tiny, cpu" in out
    for line in ("ms per step, no audit", "ms per step, audited", "the audit's share",
                 "host us per step in forward(), audited", "the audit's host time"):  # fmt: skip
        assert line in out
