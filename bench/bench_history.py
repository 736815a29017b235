"""Cost of what the pictures record: the supervisor's time series and KVSCOPE_STACK_DEPTH stacks.

    python bench/bench_history.py            # ~2 minutes
    python bench/bench_history.py --quick

1. Stacks: bench_probes.py's iteration (allocate a 40-token prompt, append 8 tokens, publish,
   free) with the ownership probe at depth 1 (a site is one frame) and at depth 8, called from
   10 frames deep so that 8 frames are there to record; beside every probe off. One core pinned, GC off, interleaved rounds, median of --repeat.
2. The time series: what one sample (`kvscope.history.read_sample`) costs on pools of 4,096
   and 100,000 blocks, the share of a core that makes at the supervisor's interval, and a pool
   user's throughput (the same iteration, C core) while a second process samples its pool as
   `kvscope run`'s supervisor does, against the same user with no sampler: alternating phases.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid

import numpy as np
from bench_probes import make, workload

from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.dumpfile import layout_of_prefix
from kvscope.allocator.segment import segment_path
from kvscope.history import History, read_sample, sample_dtype
from kvscope.supervisor import HISTORY_INTERVAL_S, map_readonly


def deep(levels: int, fn, *args):
    """Call fn(*args) from `levels` more frames of this file (frames outside kvscope)."""
    if levels == 0:
        return fn(*args)
    return deep(levels - 1, fn, *args)


def stacks(n: int, reps: int) -> None:
    configs = {
        "every probe off": ({}, "1"),
        "ownership, 1 frame per site": ({"KVSCOPE_OWNERSHIP": "1"}, "1"),
        "ownership, KVSCOPE_STACK_DEPTH=8": ({"KVSCOPE_OWNERSHIP": "1"}, "8"),
    }
    pools = {}
    for name, (env, depth) in configs.items():
        os.environ["KVSCOPE_STACK_DEPTH"] = depth
        pools[name] = make(env)
    os.environ.pop("KVSCOPE_STACK_DEPTH", None)
    rates: dict[str, list[float]] = {name: [] for name in configs}
    try:
        for pool in pools.values():
            deep(10, workload, pool, n // 4)
        for _ in range(reps):
            for name, pool in pools.items():
                rates[name].append(deep(10, workload, pool, n))
        sites = {name: int(p.view.h["num_sites_used"]) for name, p in pools.items()}
    finally:
        for pool in pools.values():
            pool.close()
            pool.unlink()
    base = statistics.median(rates["ownership, 1 frame per site"])
    off = statistics.median(rates["every probe off"])
    print(
        "| configuration | iterations/s | vs ownership at 1 frame | vs every probe off | site entries |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in configs:
        r = statistics.median(rates[name])
        print(f"| {name} | {r:,.0f} | {r / base - 1:+.1%} | {r / off - 1:+.1%} | {sites[name]} |")


def _pool(num_blocks: int) -> KVPool:
    for k in ("KVSCOPE_OWNERSHIP", "KVSCOPE_EVENTS", "KVSCOPE_GUARD", "KVSCOPE_LEAKS"):
        os.environ[k] = "0"
    return KVPool.create(
        f"bhist-{uuid.uuid4().hex[:8]}",
        PoolConfig(
            num_blocks=num_blocks,
            block_size=16,
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            dtype="float16",
            max_seqs=512,
            max_blocks_per_seq=512,
        ),
    )


def sample_cost(reps: int) -> None:
    print(
        "\n| pool | one sample (ms, min of runs) | share of a core at one sample per"
        f" {HISTORY_INTERVAL_S:g} s |"
    )
    print("|---|---:|---:|")
    for n in (4096, 100_000):
        pool = _pool(n)
        try:
            # A pool half held by 256 sequences (a process that held many more could not close:
            # its slot reserve outgrows the undo journal).
            per = n // 2 // 256 * 16
            seqs = [pool.allocate(f"r{i}", list(range(i * per, (i + 1) * per))) for i in range(256)]
            view, fd = map_readonly(segment_path(pool.name), pool.view.layout)
            os.close(fd)
            row = np.zeros(1, sample_dtype(len(view.locks)))[0]
            times = []
            for _ in range(max(5, reps * 4)):
                t = time.perf_counter()
                read_sample(view, row)
                times.append(time.perf_counter() - t)
            best = min(times)
            print(
                f"| {n:,} blocks, {len(seqs):,} sequences | {best * 1e3:.2f} |"
                f" {best / HISTORY_INTERVAL_S:.2%} |"
            )
        finally:
            pool.close()
            pool.unlink()


def _sampler(stop, active, ready, path: str) -> None:
    """What `kvscope run`'s supervisor does for the history: map read-only, sample, poll;
    sampling only while `active` is set."""
    with open(path, "rb") as f:
        layout = layout_of_prefix(f.read(4096))
    view, fd = map_readonly(path, layout)
    os.close(fd)
    h = History.for_view(view, interval_s=HISTORY_INTERVAL_S)
    h.sample(view)
    ready.set()
    while not stop.is_set():
        if active.is_set():
            h.sample(view)
        time.sleep(0.05)  # the supervisor's poll interval


def throughput(phase_s: float, rounds: int) -> None:
    """The pool user's iterations/s in alternating phases without and with the sampler (one
    sampler process throughout, switched by an event); paired ratios cancel slow drift."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    pool = _pool(4096)
    path = segment_path(pool.name)
    ctx = mp.get_context("spawn")
    stop, active, ready = ctx.Event(), ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_sampler, args=(stop, active, ready, path))
    proc.start()
    ready.wait(120)  # its imports (torch) are not part of the cost
    without, with_ = [], []
    try:
        workload(pool, 2000)
        for _ in range(rounds):
            for sampled in (False, True):
                (active.set if sampled else active.clear)()
                done, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < phase_s:
                    workload(pool, 200)
                    done += 200
                (with_ if sampled else without).append(done / (time.perf_counter() - t0))
    finally:
        stop.set()
        proc.join()
        pool.close()
        pool.unlink()
    a, b = statistics.median(without), statistics.median(with_)
    paired = statistics.median(w / o for w, o in zip(with_, without))
    print(f"\npool user (C core), iterations/s, {rounds} rounds of {phase_s:g} s phases:")
    print(
        f"  without the sampler: median {a:,.0f} (min {min(without):,.0f}, max {max(without):,.0f})"
    )
    print(
        f"  sampled every {HISTORY_INTERVAL_S:g} s: median {b:,.0f} (min {min(with_):,.0f},"
        f" max {max(with_):,.0f})"
    )
    print(f"  median of the paired ratios with / without: {paired:.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--phase-s", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    n = 200 if args.quick else 1000
    reps = 1 if args.quick else args.repeat
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    gc.disable()
    stacks(n, reps)
    sample_cost(reps)
    gc.enable()
    throughput(args.phase_s, 3 if args.quick else args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
