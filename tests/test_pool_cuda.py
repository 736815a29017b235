"""A CUDA pool: the KV tensor is shared with another process through a CUDA IPC handle."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


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
