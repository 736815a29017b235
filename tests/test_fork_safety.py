"""kvscope's own work on a CPU pool's K/V never enters torch's OpenMP thread pool.

GNU OpenMP (the libgomp torch ships) is not fork-safe: a process that ran a parallel region and
then forked leaves a child whose next parallel region waits forever for threads it does not
have. Inference servers fork workers; a probe that runs a parallel torch op in the parent (the
canary fill of a guarded pool) or in a child (a digest, a poison, a canary scan) would hang a
program that runs fine without kvscope. The probes' CPU work runs single-threaded
(kernels/backend.py `serial_cpu`), so the child below finishes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvscope.allocator import KVPool
from tests.forking import fork_child, wait_child

# Big enough that one op over the K/V is split across threads (ATen's grain is 32,768 elements).
BLOCKS = 256


def _serve(name: str) -> int:
    pool = KVPool.attach(name)
    for i in range(24):
        seq = pool.allocate(f"req-{i}", list(range(i % 5, i % 5 + 40)))
        for blk in seq.block_table:  # the request's K/V (ops too small to go parallel)
            pool.kv[:, :, blk, : pool.block_size] = float(i)
        pool.mark_computed(seq, len(seq.tokens))
        pool.free(seq)
    pool.verify()
    pool.close()
    return 0


@pytest.mark.slow
def test_a_forked_worker_finishes_under_guard_and_digest(make_pool, probes):
    # GIVEN a parent that used torch's thread pool (as a model's forward pass does) and then
    # created a guarded pool with the digest probe on
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.ones(1 << 20)
        x[torch.arange(0, 1 << 20, 3)] += 1  # a parallel region in the parent
        pool = make_pool(BLOCKS, guard=True, head_dim=64, num_layers=2, num_kv_heads=2)
        # WHEN a forked worker allocates, writes, publishes and frees under the probes
        pid = fork_child(lambda: _serve(pool.name), alarm_s=120)
        # THEN it finishes (a probe entering OpenMP in it would wait forever: SIGALRM)
        assert wait_child(pid) == 0
    finally:
        torch.set_num_threads(threads)


_PARENT = """
import os, sys, torch
from kvscope.allocator import KVPool, PoolConfig
torch.set_num_threads(2)
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=256, block_size=4, num_layers=2,
                     num_kv_heads=2, head_dim=64, dtype="float32", guard=True))
seq = pool.allocate("parent", list(range(40)))
pool.mark_computed(seq, 40)
pool.free(seq)
pid = os.fork()
if pid == 0:
    import signal
    signal.alarm(120)
    x = torch.ones(1 << 20)
    x[torch.arange(0, 1 << 20, 3)] += 1  # the worker's own parallel op
    os._exit(0)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
pool.close()
pool.unlink()
sys.exit(code)
"""


@pytest.mark.slow
def test_a_guarded_pool_leaves_the_parent_without_a_thread_pool(pool_name, probes):
    # GIVEN a fresh process that creates a guarded pool and runs a request under the probes
    # (canary fill, poison, digest: kvscope's work) but no parallel op of its own
    # WHEN it forks a worker that runs a parallel torch op of its own
    done = subprocess.run([sys.executable, "-c", _PARENT, pool_name], timeout=300)
    # THEN the worker finishes, as it does without kvscope (SIGALRM would give -14)
    assert done.returncode == 0
