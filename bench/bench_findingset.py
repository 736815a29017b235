"""What the one findings assembly costs beside the ring and the whole-pool check alone.

    python bench/bench_findingset.py                  # 8192 blocks, guard mode, --repeat 5
    python bench/bench_findingset.py --blocks 64      # a test-sized pool

Builds a live CPU pool (blocks of 16 tokens, 2 layers, 2 kv heads x 64, float16; guard mode
unless --no-guard) with one block in eight published under a digest, then times, --repeat
times on one consistent copy, `pool_findings` of kvscope.allocator.findingset read from nowhere
else (the findings ring and `check_view`) and as every reader of the live pool reads it (with
the KV data checks: digests, poison and guard canaries over its data file, and the data file's
own check). Prints the median, min and max of each in ms. `kvscope run`'s verdict, the
exporter's close and each full check of `top` pay the second; `analyze` and `check` did before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

for probe in ("LEAKS", "MAGIC", "EVENTS", "OWNERSHIP", "DIGEST"):
    os.environ[f"KVSCOPE_{probe}"] = "1"

from kvscope.allocator import KVPool, PoolConfig  # noqa: E402
from kvscope.allocator.findingset import Origin, pool_findings  # noqa: E402
from kvscope.allocator.kvread import read_live  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-guard", action="store_true")
    args = p.parse_args()
    name = f"bench-findingset-{os.getpid()}"
    config = PoolConfig(
        num_blocks=args.blocks,
        block_size=16,
        head_dim=64,
        num_layers=2,
        num_kv_heads=2,
        dtype="float16",
        guard=not args.no_guard,
    )
    pool = KVPool.create(name, config)
    try:
        for i in range(args.blocks // 8):
            s = pool.allocate(f"r{i}", [i] * 64)
            pool.kv[:, :, s.block_table, :16] = 0.5
            pool.mark_computed(s, 64)
        view = read_live(name)
        published = int((view.blocks["indexed"] == 1).sum())
        mib = pool.kv.numel() * pool.kv.element_size() / 2**20
        print(
            f"{args.blocks} blocks, {mib:.0f} MiB of KV data, {published} published,"
            f" guard {'off' if args.no_guard else 'on'}"
        )
        for label, origin in (
            ("ring + check_view", Origin()),
            ("every reader's (live)", Origin.live(name)),
        ):
            took = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                found = pool_findings(view, origin).findings
                took.append((time.perf_counter() - t0) * 1e3)
            print(
                f"{label:22s} median {statistics.median(took):7.1f} ms  min {min(took):7.1f}"
                f"  max {max(took):7.1f}  ({len(found)} findings)"
            )
    finally:
        pool.close()
        pool.unlink()


if __name__ == "__main__":
    main()
