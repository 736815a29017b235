"""Cost of the probes that catch writes into blocks the writer does not own (the C core's
csrc/kvdata.c, allocator/integrity.py): per operation, per whole-pool pass, and per block digest.

    python bench/bench_integrity.py            # ~1 minute on CPU
    python bench/bench_integrity.py --quick
    python bench/bench_integrity.py --device cuda    # the digest kernel on a GPU too

1. Per operation: bench_probes.py's workload (allocate a 40-token prompt, 8 one-token appends,
   publish, free) with each of these probes on, interleaved rounds, median.
2. Whole pool: `pool.verify()` (guard: every canary) and `pool.check()` (the KV checks
   included) on a 4096-block pool.
3. Digests: `block_digests` over a batch of blocks of a small and of a Llama-8B-like geometry.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import torch

from kvscope.allocator import KVPool, PoolConfig
from kvscope.kernels import block_digests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_probes import PROBE_VARS, workload  # noqa: E402

ALL = (*PROBE_VARS, "KVSCOPE_DIGEST")


def make(env: dict[str, str], num_blocks: int = 4096, **geometry) -> KVPool:
    for k in ALL:
        os.environ[k] = env.get(k, "0")
    os.environ.pop("KVSCOPE_RUN_DIR", None)
    geo = dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16") | geometry
    return KVPool.create(
        f"bint-{uuid.uuid4().hex[:8]}", PoolConfig(num_blocks=num_blocks, block_size=16, **geo)
    )


def per_operation(n: int, reps: int) -> None:
    on = "1"
    configs: dict[str, Callable[[], KVPool]] = {
        "every probe off": lambda: make({}),
        "magic (record checksums before every change)": lambda: make({"KVSCOPE_MAGIC": on}),
        "leaks (with the stale-table scan)": lambda: make({"KVSCOPE_LEAKS": on}),
        "guard (poison verified before reuse)": lambda: make({"KVSCOPE_GUARD": on}),
        "digest (published blocks)": lambda: make({"KVSCOPE_DIGEST": on}),
        "all probes": lambda: make({k: on for k in ALL}),
    }  # fmt: skip
    pools = {name: build() for name, build in configs.items()}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    try:
        for pool in pools.values():
            workload(pool, n // 4)
        for _ in range(reps):
            for name, pool in pools.items():
                rates[name].append(workload(pool, n))
    finally:
        for pool in pools.values():
            pool.close()
            pool.unlink()
    base = statistics.median(rates["every probe off"])
    print("| configuration | iterations/s | vs every probe off |")
    print("|---|---:|---:|")
    for name in configs:
        r = statistics.median(rates[name])
        print(f"| {name} | {r:,.0f} | {r / base - 1:+.1%} |")


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of fn."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def whole_pool(reps: int) -> None:
    env = {k: "1" for k in ALL}
    pool = make(env, num_blocks=4096)
    try:
        seqs = [pool.allocate(f"r{i}", list(range(i * 1000, i * 1000 + 40))) for i in range(512)]
        for s in seqs[:256]:
            pool.mark_computed(s, 32)
            pool.free(s)
        for s in seqs[256:384]:
            pool.free(s)  # freed: poisoned, in quarantine
        print("\n| whole-pool pass (4096 blocks, 1 layer, 1 x 8 fp16) | ms |")
        print("|---|---:|")
        print(
            f"| pool.verify() (header, conservation, 4096 canaries) | {timed(pool.verify, reps) * 1e3:.1f} |"
        )
        print(
            f"| pool.check() (with 512 digests, 384 poisoned blocks, 4096 canaries) | {timed(pool.check, reps) * 1e3:.1f} |"
        )
    finally:
        pool.close()
        pool.unlink()


def digests(device: str, reps: int) -> None:
    geometries = {
        "1 layer, 1 x 8, fp16 (the benchmark pool)": (1, 1, 8, torch.float16),
        "32 layers, 8 x 128, bf16 (Llama-3-8B)": (32, 8, 128, torch.bfloat16),
    }
    print(f"\n| block digests on {device}, block size 16 | blocks | ms per call | us per block |")
    print("|---|---:|---:|---:|")
    for label, (layers, heads, dim, dtype) in geometries.items():
        blocks = 256
        kv = torch.randn(layers, 2, blocks, 17, heads, dim, device=device).to(dtype)
        for n in (1, 64):
            ids = list(range(n))
            block_digests(kv, ids, 16)
            if device == "cuda":
                torch.cuda.synchronize()
            s = timed(lambda kv=kv, ids=ids: block_digests(kv, ids, 16), reps)
            print(f"| {label} | {n} | {s * 1e3:.3f} | {s * 1e6 / n:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="where the digest kernel runs (cpu, cuda)")
    ap.add_argument("--digests-only", action="store_true")
    args = ap.parse_args(argv)
    reps = 1 if args.quick else args.repeat
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    # One core: torch's own thread pool would only fight over it.
    torch.set_num_threads(1)
    gc.disable()
    if not args.digests_only:
        per_operation(200 if args.quick else 1000, reps)
        whole_pool(reps)
    digests(args.device, max(reps, 5))
    return 0


if __name__ == "__main__":
    sys.exit(main())
