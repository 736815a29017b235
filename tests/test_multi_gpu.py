"""One pool per GPU on a machine with two or more: each rank's pool on its own device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ranks_check import leak_on_rank_one

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def test_each_rank_pool_lives_on_its_gpu_and_a_leak_names_rank_and_device(
    tmp_path: Path,
) -> None:
    # GIVEN kvscope run arming a leak, serve.py on ranks 0 and 1 of two GPUs, fault on rank 1
    got = leak_on_rank_one("cuda", tmp_path)
    rank0, rank1 = got["names"]
    # THEN the run's diagnosis of rank 1's pool names the leak and the pool's device
    assert set(got["sections"]) >= {rank0, rank1}, got["run"].stdout + got["run"].stderr
    assert "leak_finished" in got["sections"][rank1]
    assert "on cuda:1" in got["sections"][rank1]
    assert "health: OK - no findings" in got["sections"][rank0]
    assert "on cuda:0" in got["sections"][rank0]
    # AND kvscope ls shows each pool on its own GPU
    assert got["ls"][rank0]["device"] == "cuda:0" and got["ls"][rank1]["device"] == "cuda:1"
    # AND analyze of rank 1's live pool names the orphaned block, and reads GPU 1's memory
    report = got["analyze"][rank1]
    assert {f["kind"] for f in report["findings"]} >= {"leak_orphan"}
    assert report["pool"]["device"] == "cuda:1"
    gpu = report["pool"].get("gpu")
    if gpu is not None:  # NVML present (nvidia-ml-py)
        assert gpu["index"] == 1 and gpu["used"] >= report["pool"]["data_bytes"]
    assert got["analyze"][rank0]["findings"] == []
