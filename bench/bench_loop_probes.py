"""Each probe's cost on the serving loop, in microseconds per pool operation, in one process.

    python bench/bench_loop_probes.py               # ~1 minute on a quiet machine
    python bench/bench_loop_probes.py --repeat 3 provenance all

bench_serving_loop.py's loop (64 running sequences, one append each per step, a finished one
published and freed, a new request admitted, 70% behind one of 8 shared system prompts) over a
fresh pool per run (4096 blocks of 16 tokens, as bench_loop_run's), `--steps` steps, under
each configuration: every probe off, each probe alone, every probe as under `kvscope run` in
guard mode (slot provenance on every sequence too: bench_serving_loop's "all probes" row
leaves it out), and every probe but one. Probes are switched by the KVSCOPE_* variables
`kvscope run` sets (lockdep installed as bench_probes.make does). Rounds interleave the
configurations (one core pinned, GC off); each figure is the loop's process CPU time per pool
operation, the median of --repeat rounds with its range, and its excess over every probe off.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_probes import PROBE_VARS  # noqa: E402
from bench_serving_loop import serve  # noqa: E402

from kvscope.allocator import KVPool, PoolConfig  # noqa: E402

PROVENANCE = "KVSCOPE_PROVENANCE_SAMPLE"
ALL = (*PROBE_VARS, PROVENANCE)
NAMES = {
    "KVSCOPE_MAGIC": "magic",
    "KVSCOPE_OWNERSHIP": "ownership",
    "KVSCOPE_LEAKS": "leaks",
    "KVSCOPE_EVENTS": "events",
    "KVSCOPE_LOCKDEP": "lockdep",
    "KVSCOPE_GUARD": "guard",
    "KVSCOPE_DIGEST": "digest",
    PROVENANCE: "provenance",
}


def configs() -> dict[str, dict[str, str]]:
    every = {k: "1" for k in ALL}
    out: dict[str, dict[str, str]] = {"off": {}}
    out.update({NAMES[k]: {k: "1"} for k in ALL})
    out["all"] = every
    out.update({f"all but {NAMES[k]}": {v: "1" for v in ALL if v != k} for k in ALL})
    return out


def make(env: dict[str, str]) -> KVPool:
    for k in ALL:
        os.environ[k] = env.get(k, "0")
    os.environ.pop("KVSCOPE_RUN_DIR", None)
    pool = KVPool.create(
        f"bloop-{uuid.uuid4().hex[:8]}",
        PoolConfig(
            num_blocks=4096, block_size=16, num_layers=1, num_kv_heads=1, head_dim=8,
            dtype="float16",
        ),
    )  # fmt: skip
    if env.get("KVSCOPE_LOCKDEP") == "1":
        from kvscope.probes import lockdep

        lockdep.install(pool, {"KVSCOPE_LOCKDEP": "1", "KVSCOPE_LOCK_HOLD_S": "0"})
    return pool


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeat", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--steps", type=int, default=300, help="decode steps a run (default 300)")
    ap.add_argument("only", nargs="*", help="configurations to run (default: all of them)")
    args = ap.parse_args(argv)
    table = configs()
    unknown = [c for c in args.only if c not in table]
    if unknown or args.repeat < 1 or args.steps < 1:
        what = f"unknown configuration {unknown[0]!r}" if unknown else "--repeat and --steps >= 1"
        print(f"bench_loop_probes.py: error: {what} (one of: {', '.join(table)})",
              file=sys.stderr)  # fmt: skip
        return 2
    chosen = args.only or list(table)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    gc.disable()
    us: dict[str, list[float]] = {c: [] for c in chosen}
    for r in range(args.repeat):
        for c in chosen:
            pool = make(table[c])
            try:
                rate, _ = serve(pool, args.steps, seed=r)
            finally:
                pool.close()
                pool.unlink()
            us[c].append(1e6 / rate)
    base = statistics.median(us["off"]) if "off" in us else None
    print("| configuration | µs per operation (range) | over every probe off |")
    print("|---|---:|---:|")
    for c in chosen:
        m = statistics.median(us[c])
        extra = f"{m - base:+.3f}" if base is not None else ""
        print(f"| {c} | {m:.3f} ({min(us[c]):.3f}-{max(us[c]):.3f}) | {extra} |")
    print(f"\nload average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
