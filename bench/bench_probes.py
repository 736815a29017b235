"""Cost of each probe on the pool's hot operations, in one run.

    python bench/bench_probes.py            # ~1 minute
    python bench/bench_probes.py --quick

Workload per iteration: allocate a 40-token prompt, append 8 tokens one at a time, publish the
full blocks, free (one core pinned, GC off, median of --repeat runs, each at least MIN_S long). Each configuration gets
a fresh pool; probes are switched by the same KVSCOPE_* variables `kvscope run` sets.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid

from kvscope.allocator import KVPool, PoolConfig

LIGHT_VARS = (
    "KVSCOPE_MAGIC",
    "KVSCOPE_OWNERSHIP",
    "KVSCOPE_LEAKS",
    "KVSCOPE_EVENTS",
    "KVSCOPE_LOCKDEP",
)
PROBE_VARS = (*LIGHT_VARS, "KVSCOPE_GUARD", "KVSCOPE_DIGEST")
# Set per configuration too (not a probe of its own: it samples guard mode).
SAMPLE_VAR = "KVSCOPE_GUARD_SAMPLE"


def make(env: dict[str, str]) -> KVPool:
    for k in (*PROBE_VARS, SAMPLE_VAR):
        os.environ[k] = env.get(k, "0")
    os.environ.pop("KVSCOPE_RUN_DIR", None)
    pool = KVPool.create(
        f"bprobe-{uuid.uuid4().hex[:8]}",
        PoolConfig(
            num_blocks=4096,
            block_size=16,
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            dtype="float16",
        ),
    )
    if env.get("KVSCOPE_LOCKDEP") == "1":
        from kvscope.probes import watchdog

        watchdog.install(pool, {"KVSCOPE_LOCKDEP": "1", "KVSCOPE_LOCK_HOLD_S": "0"})
    return pool


# Each measurement runs batches of n iterations for at least this long (the C core does a
# thousand in a few tens of ms, too short to time on a shared machine). Times are this process's
# CPU time (time.process_time): other work on the machine delays a run but does not count.
MIN_S = 0.5


def workload(pool: KVPool, n: int, min_s: float = MIN_S) -> float:
    """Iterations per second (batches of n, at least min_s of them)."""
    prompt = list(range(40))
    done = 0
    t = time.process_time()
    while done == 0 or time.process_time() - t < min_s:
        for i in range(done, done + n):
            prompt[0] = i
            s = pool.allocate("b", prompt)
            for k in range(8):
                pool.append(s, [k])
            pool.mark_computed(s, s.num_tokens)
            pool.free(s)
        done += n
    return done / (time.process_time() - t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    n = 200 if args.quick else 1000
    reps = 1 if args.quick else args.repeat
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    gc.disable()
    # Every probe runs in the C core (docs/FORMAT.md "The core"); ratios are against the
    # probes-off C core.
    light = {k: "1" for k in LIGHT_VARS}
    configs = {
        "every probe off (the C core)": {},
        "magic": {"KVSCOPE_MAGIC": "1"},
        "ownership (sites)": {"KVSCOPE_OWNERSHIP": "1"},
        "events (flight recorder)": {"KVSCOPE_EVENTS": "1"},
        "leaks (per-request checks)": {"KVSCOPE_LEAKS": "1"},
        "lockdep": {"KVSCOPE_LOCKDEP": "1"},
        "light probes (magic, ownership, events, leaks, lockdep)": light,
        "digest": {"KVSCOPE_DIGEST": "1"},
        "guard (canary scan, poison, quarantine)": {"KVSCOPE_GUARD": "1"},
        "all probes (as under kvscope run)": {k: "1" for k in PROBE_VARS},
        "light probes + sampled guard 1/64": {**light, "KVSCOPE_GUARD": "1", SAMPLE_VAR: "64"},
    }
    pools = {name: make(env) for name, env in configs.items()}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    try:
        for pool in pools.values():
            workload(pool, n // 4, min_s=0)  # warm-up
        for _ in range(reps):
            # Interleaved rounds: every configuration sees the same machine conditions.
            for name, pool in pools.items():
                rates[name].append(workload(pool, n))
    finally:
        for pool in pools.values():
            pool.close()
            pool.unlink()
            gc.collect()  # (GC is off while timing: a closed pool's cycles, and its mapping, go here)
    fast = statistics.median(rates["every probe off (the C core)"])
    print(f"load average at the end: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)\n")
    print("| configuration | iterations/s | vs the C core |")
    print("|---|---:|---:|")
    for name in configs:
        r = statistics.median(rates[name])
        print(f"| {name} | {r:,.0f} | {r / fast:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
