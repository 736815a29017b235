"""A CUDA pool: the KV tensor is shared with another process through a CUDA IPC handle, and the
probes' checks of its K/V never make the host wait for the GPU."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from kvscope.allocator import devicechecks, integrity


@pytest.mark.gpu
def test_second_process_attaches_and_sees_the_same_gpu_bytes(make_pool):
    # GIVEN a pool on the GPU with a block written by its creator
    pool = make_pool(64, device="cuda", dtype="float16", block_size=16, head_dim=64)
    seq = pool.allocate("r", list(range(20)))
    blk = seq.block_table[0]
    pool.kv[:, 0, blk] = 2.0
    torch.cuda.synchronize()
    # WHEN an unrelated process attaches by name, reads it and writes V
    code = f"""
import torch
from kvscope.allocator import KVPool
p = KVPool.attach({pool.name!r})
assert p.kv.is_cuda and p.kv.shape == {tuple(pool.kv.shape)!r}
assert float(p.kv[:, 0, {blk}].float().mean()) == 2.0
assert p.stats()["num_allocated"] == 2
p.kv[:, 1, {blk}] = 3.0
torch.cuda.synchronize()
p.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    # THEN the creator sees the other process's write
    assert float(pool.kv[:, 1, blk].float().mean()) == 3.0
    pool.free(seq)
    assert pool.check() == []


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu-deferred"])
def test_guard_and_digest_checks_never_make_the_host_wait_for_the_gpu(
    make_pool, monkeypatch, device
):
    # GIVEN a CUDA pool with guard mode and the digest on, in the C core (or a CPU pool whose
    # core queues its checks and reads their answers later, as it does on a CUDA pool)
    for probe, on in (("GUARD", "1"), ("DIGEST", "1")):
        monkeypatch.setenv(f"KVSCOPE_{probe}", on)
    if device == "cpu-deferred":
        monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", True)
    cuda = device == "cuda"
    # (a table with a slot reserve: the C core runs allocations and frees)
    pool = make_pool(
        64,
        device="cuda" if cuda else "cpu",
        dtype="float16",
        block_size=16,
        head_dim=64,
        max_seqs=256,
    )

    def write(seq) -> None:
        for blk in seq.block_table:  # an int index: no upload
            pool.kv[:, :, blk, :16] = 1.0

    # WHEN a request's life runs through every operation that launches a check (poison checks at
    # allocation, digests at publication, their verification at a prefix hit, the finish check,
    # canary scans and poison at release), with torch raising on any call that waits for the GPU
    pool.free(pool.allocate("warm-up", [1]))  # (the first claim fills the reserve)
    ops = pool._core.stats()["native_ops"]
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        a = pool.allocate("a", list(range(40)))
        write(a)
        pool.mark_computed(a, 32)
        published = np.asarray(a.block_table[:2])
        b = pool.allocate("b", list(range(32)) + [7, 7])
        write(b)
        pool.append(b, [8])
        pool.free(a)
        pool.free(b)
        c = pool.allocate("c", list(range(100, 140)))
        write(c)
        pool.free(c)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    # THEN the C core ran every operation, nothing waited, and once the answers are in they show
    # no finding: the checks ran on the right blocks (b's prefix hit found a's two published
    # blocks, with their digests)
    assert pool._core.stats()["native_ops"] >= ops + 8
    pool.verify()
    assert b.num_cached_tokens == 32
    assert integrity.has_digest(pool.view.blocks, published).all()
    assert pool.findings() == []
    assert pool.check() == []


@pytest.mark.gpu
def test_a_settle_records_no_event_while_an_older_one_is_outstanding(make_pool, monkeypatch):
    # GIVEN a CUDA pool with the digest on, two requests' K/V written, and the GPU held busy
    # (a sleep kernel of about two seconds on the stream the checks go to)
    monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    pool = make_pool(64, device="cuda", dtype="float16", block_size=16, head_dim=64)
    later = pool.probe.later
    a = pool.allocate("a", list(range(40)))
    b = pool.allocate("b", list(range(100, 140)))
    for blk in a.block_table + b.block_table:
        pool.kv[:, :, blk, :16] = 1.0
    later.settle(wait=True)
    torch.cuda._sleep(4_000_000_000)  # (cycles: about two seconds at an H200's 2 GHz)
    stats = pool._core.device_stats()
    # WHEN a publication's check is queued behind it and a settle comes, then another
    # publication's and another settle
    pool.mark_computed(a, 32)
    later.settle()
    covered = pool._core.device_stats()
    pool.mark_computed(b, 32)
    later.settle()
    after = pool._core.device_stats()
    # THEN the first settle covered the first check with an event (not answered yet: the GPU
    # sleeps), and the second recorded none while that one is outstanding
    assert covered["events"] == stats["events"] + 1 and covered["waiting"] == 1
    assert after["events"] == covered["events"] and after["waiting"] == 2
    # AND once waited for, both answers are applied
    pool.verify()
    published = np.asarray(a.block_table[:2] + b.block_table[:2])
    assert integrity.has_digest(pool.view.blocks, published).all()
    assert pool.findings() == []
