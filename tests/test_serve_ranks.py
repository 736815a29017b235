"""serve.py --ranks: one engine per rank, each with its own pool; faults on one rank only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from server.checkpoint import tiny_model  # noqa: E402
from server.model import generate_reference  # noqa: E402
from server.runconfig import RunConfig  # noqa: E402
from server.runner import run  # noqa: E402
from server.workload import Request  # noqa: E402

from tests.ranks_check import leak_on_rank_one  # noqa: E402


@pytest.mark.slow
def test_two_ranks_serve_their_shares_from_their_own_pools() -> None:
    # GIVEN four requests, two of them behind one prefix, and two ranks on the CPU
    prefix = list(range(40, 80))
    requests = [
        Request("a", prefix + [1, 2], max_tokens=4),
        Request("b", [5, 6, 7], max_tokens=3),
        Request("c", prefix + [9], max_tokens=4, arrival_s=0.2),
        Request("d", [8, 8], max_tokens=2),
    ]
    config = RunConfig(ranks=2, pool_name="test-ranks", block_size=16)
    # WHEN they are served
    summary, results = run(config, requests)
    by_id = {r.request_id: r for r in results}
    # THEN every other request went to each rank, with the reference's tokens
    assert [by_id[x].worker for x in "abcd"] == [0, 1, 0, 1]
    model = tiny_model(0)
    for r in requests:
        assert by_id[r.request_id].outputs == [generate_reference(model, r.prompt, r.max_tokens)]
    # AND each rank reports its own pool, healthy, and the summary counts both
    ranks = summary.extra["ranks"]
    assert [(x["rank"], x["pool"], x["device"]) for x in ranks] == [
        (0, "test-ranks-rank0", "cpu"),
        (1, "test-ranks-rank1", "cpu"),
    ]
    assert all(x["cache_findings"] == 0 for x in ranks)
    assert summary.workers == 2 and summary.requests == 4
    # AND rank 0 found the prefix it computed itself (no pool is shared across ranks)
    assert by_id["c"].num_hit_tokens == 32


@pytest.mark.slow
def test_a_leak_injected_on_rank_one_is_diagnosed_in_rank_ones_pool(tmp_path: Path) -> None:
    # GIVEN kvscope run arming a leak, serve.py on two CPU ranks with the fault on rank 1
    got = leak_on_rank_one("cpu", tmp_path)
    rank0, rank1 = got["names"]
    # THEN the run analyzed both pools, and only rank 1's has the leak
    assert set(got["sections"]) >= {rank0, rank1}, got["run"].stdout + got["run"].stderr
    assert "leak_finished" in got["sections"][rank1]
    assert "health: OK - no findings" in got["sections"][rank0]
    # AND kvscope ls lists both pools; analyze of rank 1's names its orphaned block
    assert set(got["ls"]) == {rank0, rank1}
    assert {f["kind"] for f in got["analyze"][rank1]["findings"]} >= {"leak_orphan"}
    assert got["analyze"][rank0]["findings"] == []
