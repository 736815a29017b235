"""The stress of bench/bench_stress.py in short: workers checking their own sequences, a killer,
concurrent reclaimers and `check --repair`, re-attach churn, live analyses; nothing corrupted,
no block lost."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "bench"))

from bench_stress import stress  # noqa: E402


@pytest.mark.slow
def test_workers_killers_and_concurrent_reclaimers_lose_nothing():
    # GIVEN 4 workers on one pool, one SIGKILLed every 0.2-2 s and restarted, two reclaimers
    # and a `check --repair` now and then, and live analyses
    # WHEN it runs for 12 s and everything is killed and reclaimed at the end
    r = stress(12.0, workers=4, seed=3)
    # THEN no worker found its sequences, tokens or K/V changed, no worker failed, the final
    # check is clean and every block is free or cached again
    assert r["kills"] >= 1 and r["operations"] > 0
    assert r["corruptions"] == 0
    assert r["worker_exits"] == 0
    assert r["check"] == []
    assert r["blocks_lost"] == 0
    # ... and no live analysis that says its copy is consistent reported an error
    assert r["analyses"] and all(
        errors == 0 for _, consistent, errors in r["analyses"] if consistent
    )
