"""What a prompt's length costs: a request's life (allocate a prompt of N blocks, append one
token, free) per second at block size 16, for prompts either side of CHUNK (128
blocks: the most one transaction journals) and far past it, on one pool, interleaved round by
round.

    python bench/bench_long.py [--blocks 64,128,129,256,512] [--requests 200] [--repeat 5]
                               [--clock wall|cpu]

Prints requests/s and blocks/s per length (median of the rounds, and the rounds' range), and
each length's blocks/s as a ratio to the 128-block row's in the same round: a length past
CHUNK runs the same core calls, a transaction per CHUNK blocks, so its blocks/s stays near the
128-block row's. An operation a build cannot do is printed with its error instead. `--clock cpu` times the
process's CPU time instead of the wall clock (on a loaded machine: this process's own work).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import uuid

from kvscope.allocator import KVPool, PoolConfig

BS = 16
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def life(pool: KVPool, blocks: int, requests: int, clock: str = "wall") -> float:
    """Requests per second: allocate (a prompt no other request shares), append one token,
    free (nothing published: every round starts from the same free pool, with no eviction)."""
    prompt = list(range(100, 100 + blocks * BS - 1))
    now = CLOCKS[clock]
    t0 = now()
    for i in range(requests):
        prompt[0] = i  # (a first block of its own: no prefix hit)
        seq = pool.allocate("r", prompt)
        pool.append(seq, [7])
        pool.free(seq)
    return requests / (now() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", default="64,128,129,256,512")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.blocks.split(",")]
    if 128 not in sizes:
        sizes.append(128)
    cfg = PoolConfig(
        num_blocks=max(sizes) * 4,
        block_size=BS,
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        max_blocks_per_seq=max(sizes) + 1,
    )
    pool = KVPool.create(f"bench-long-{uuid.uuid4().hex[:8]}", cfg)
    rates: dict[int, list[float]] = {n: [] for n in sizes}
    ratios: dict[int, list[float]] = {n: [] for n in sizes}
    failed: dict[int, str] = {}
    try:
        for n in sizes:  # (a warm-up round)
            try:
                life(pool, n, 5)
            except Exception as e:  # noqa: BLE001 - a build that cannot do it: say so
                failed[n] = f"{type(e).__name__}: {str(e)[:80]}"
        for _ in range(args.repeat):
            got = {}
            for n in sizes:
                if n in failed:
                    continue
                gc.collect()
                got[n] = life(pool, n, args.requests, args.clock)
                rates[n].append(got[n])
            for n, r in got.items():
                ratios[n].append(r * n / (got[128] * 128))
    finally:
        pool.close()
        pool.unlink()
    print(f"{'blocks':>6} {'requests/s':>12} {'blocks/s':>11}  {'rounds':>17}  vs 128 (rounds)")
    for n in sizes:
        if n in failed:
            print(f"{n:>6}  {failed[n]}")
            continue
        med = statistics.median(rates[n])
        lo, hi = min(rates[n]), max(rates[n])
        rq = ratios[n]
        print(
            f"{n:>6} {med:>12,.0f} {med * n:>11,.0f}  {lo:>8,.0f}-{hi:<8,.0f}  "
            f"{statistics.median(rq):.2f}x ({min(rq):.2f}-{max(rq):.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
