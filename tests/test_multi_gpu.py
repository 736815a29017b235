"""One pool per GPU on a machine with two or more: each rank's pool on its own device."""

from __future__ import annotations

import asyncio
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.ranks_check import leak_on_rank_one, scrape_two_ranks

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


def _smi_memory() -> dict[int, tuple[int, int]]:
    """nvidia-smi's memory used and total (MiB) by GPU index."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = [[int(x) for x in line.split(",")] for line in out.strip().splitlines()]
    return {i: (used, total) for i, used, total in rows}


def test_the_exporters_send_each_rank_s_pool_with_its_gpu(tmp_path: Path) -> None:
    pytest.importorskip("opentelemetry.exporter.prometheus", reason="the otel extra")
    # GIVEN `kvscope run` with the Prometheus exporter over serve.py on two GPUs, one pool each
    # WHEN Prometheus scrapes the supervisor until both ranks have allocated
    got = scrape_two_ranks("cuda", tmp_path)
    # THEN one scrape holds both pools, each with its own device and that GPU's NVML index
    assert got["returncode"] == 0, got["stderr"]
    pools = got["pools"]
    for rank, pool in enumerate(got["wanted"]):
        assert pools[pool]["value"] > 0
        assert pools[pool]["kvscope_pool_device"] == f"cuda:{rank}"
        assert pools[pool]["kvscope_gpu_index"] == str(rank)
    # AND the GPU series carry both GPUs' memory, as NVML reads it
    fams = got["families"]
    usage = (fams.get("hw_gpu_memory_usage_bytes") or fams["hw_gpu_memory_usage"]).samples
    assert {s.labels["kvscope_gpu_index"] for s in usage} >= {"0", "1"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_top_shows_the_memory_of_the_gpu_a_pool_lives_on(pool_name: str) -> None:
    pytest.importorskip("textual", reason="top needs textual")
    pytest.importorskip("pynvml", reason="nvidia-ml-py")
    from kvscope.allocator import KVPool, PoolConfig
    from kvscope.tui.app import TopApp, gpu_reader
    from kvscope.tui.source import LiveSource
    from kvscope.tui.widgets.header import PoolHeader

    # GIVEN a live pool on the second GPU, 1 GiB of KV
    cfg = PoolConfig(num_blocks=4096, block_size=16, num_layers=4, num_kv_heads=8, head_dim=128,
                     dtype="float16", device="cuda:1")  # fmt: skip
    pool = KVPool.create(pool_name, cfg)
    try:
        source = LiveSource(pool.name)
        reader = gpu_reader(source)
        assert reader is not None and reader.device == "cuda:1"

        async def look() -> str:
            app = TopApp(source, hz=20, gpu=reader)
            async with app.run_test(size=(200, 48)) as pilot:
                for _ in range(100):
                    await pilot.pause(0.05)
                    if "GPU 1" in app.query_one(PoolHeader)._text:
                        break
                return app.query_one(PoolHeader)._text

        # WHEN top shows it, with the NVML reader top opens for it
        text = asyncio.run(look())
        reader.close()
        # THEN the header names GPU 1 with its used/total memory, as nvidia-smi reads them
        m = re.search(r"GPU 1 (.+?) ([\d.]+)/([\d.]+) GiB used, KV data ([\d.]+) GiB", text)
        assert m, text
        used, total = _smi_memory()[1]
        assert abs(float(m.group(3)) - total / 1024) < 0.1
        assert abs(float(m.group(2)) - used / 1024) < 0.5  # (a live reading: within 0.5 GiB)
        assert float(m.group(2)) >= float(m.group(4)) == pytest.approx(1.0, abs=0.01)
    finally:
        pool.close()
        pool.unlink()
