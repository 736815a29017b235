"""What a lease costs: a lease and its release of a request's blocks beside an allocate+free pair
of the same request, on one pool, interleaved round by round (docs/POOL.md "Leases": the target
is a lease and its release at most one allocate+free pair's time).

    python bench/bench_lease.py [--tokens 48] [--pairs 20000] [--repeat 5] [--clock wall|cpu]

Rows, each per pair of calls:
- `allocate+free`: `pool.free(pool.allocate(rid, prompt))`;
- `lease+release (read)` and `(write)`: `pool.lease(seq, mode, holder=...).release()` on a live
  sequence of the same prompt;
- `core lease+release`: the two core calls alone (`pool.core.lease` / `lease_release`), without
  the `Lease` object's Python;
- `lease+free+release (read)`: an allocate, a read lease, the free (its blocks quarantined) and
  the release (an offload's whole cycle), beside `allocate+free` of the same prompt.

Prints µs per pair of calls (median of the rounds) and the ratio of each to `allocate+free`,
with the spread of the per-round ratios. `--clock cpu` times the process's CPU time: on a
shared, loaded machine the ratios then measure this process's own work.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import uuid
from collections.abc import Callable

from kvscope.allocator import KVPool, PoolConfig

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def rows(pool: KVPool, prompt: list[int]) -> dict[str, Callable[[int], None]]:
    """name -> one round of n pairs."""
    alloc, free, lease = pool.allocate, pool.free, pool.lease
    seq = alloc("held", prompt)
    core = pool.core

    def alloc_free(n: int) -> None:
        for _ in range(n):
            free(alloc("r", prompt))

    def lease_release(mode: str) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                lease(seq, mode, holder="bench").release()

        return run

    def core_pair(n: int) -> None:
        for _ in range(n):
            rec, lid = core.lease(pool, seq, "read", "bench", 0)
            core.lease_release(pool, rec, lid)

    def offload_cycle(n: int) -> None:
        for _ in range(n):
            s = alloc("r", prompt)
            held = lease(s, "read", holder="bench")
            free(s)
            held.release()

    return {
        "allocate+free": alloc_free,
        "lease+release (read)": lease_release("read"),
        "lease+release (write)": lease_release("write"),
        "core lease+release": core_pair,
        "lease+free+release (read)": offload_cycle,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=48, help="prompt tokens (3 blocks of 16)")
    ap.add_argument("--pairs", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = ap.parse_args(argv)
    now = CLOCKS[args.clock]
    name = f"bench-lease-{uuid.uuid4().hex[:8]}"
    pool = KVPool.create(name, PoolConfig(num_blocks=1024, num_layers=1, head_dim=8))
    try:
        bench = rows(pool, list(range(args.tokens)))
        times: dict[str, list[float]] = {k: [] for k in bench}
        for run in bench.values():
            run(min(args.pairs, 2000))  # (warm-up)
        gc.disable()
        for _ in range(args.repeat):
            for k, run in bench.items():
                t0 = now()
                run(args.pairs)
                times[k].append((now() - t0) / args.pairs * 1e6)
        gc.enable()
    finally:
        pool.close()
        pool.unlink()
    base = times["allocate+free"]
    print(f"{args.tokens} tokens, {args.pairs} pairs x {args.repeat} rounds ({args.clock} clock)")
    print(f"{'':28} {'µs/pair':>9} {'ratio':>7}  {'ratio range':>13}")
    for k, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        print(
            f"{k:28} {statistics.median(ts):9.2f} {statistics.median(ratios):7.2f}"
            f"  {min(ratios):5.2f}-{max(ratios):5.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
