"""A serving-shaped loop under each probe set: pool operations per second, in one run.

    python bench/bench_serving_loop.py              # ~1 minute
    python bench/bench_serving_loop.py --steps 100 --repeat 1

Each step, every running sequence (64 of them) appends one token; a sequence whose output is
complete is published (mark_computed) and freed, and a new request takes its place, 70% of them
behind one of 8 shared 32-token system prompts (prefix hits). Every configuration runs the same
seeded requests on a fresh pool (block size 16, 4096 blocks; one core pinned, GC off), in
interleaved rounds, each measurement at least --min-s of runs (this process's CPU time: other
work on the machine delays a run but does not count); the median of --repeat rounds is shown
with its ratio to the probes-off C core. Probes are switched by the KVSCOPE_* variables `kvscope run` sets (bench_probes.make).
The "+ recording" rows record every operation into an operation log (`kvscope run
--record-ops`, docs/REPLAY.md) in a temporary directory (--log-dir; removed after each run), beside
the same probes without it. Recording's cost is then measured in --pairs triples of adjacent runs
(without, with, without; the same seed, --pair-steps steps each) for each of the two probe sets:
every triple's cost (the run with recording against the mean of its two neighbours) is printed,
with their median and spread.

    python bench/bench_serving_loop.py --repeat 1 --pairs 15     # recording's cost only, mostly
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_probes import LIGHT_VARS, PROBE_VARS, SAMPLE_VAR, make  # noqa: E402

from kvscope.allocator import KVPool  # noqa: E402

RUNNING = 64
SYSTEMS = 8


def serve(
    pool: KVPool, steps: int, seed: int, after_step: Callable[[list], None] | None = None
) -> tuple[float, int]:
    """Pool operations per second over `steps` decode steps, and how many operations;
    `after_step(running sequences)` runs after each step, timed with it."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(32)] for _ in range(SYSTEMS)]
    n = 0

    def admit() -> list:
        nonlocal n
        n += 1
        own = [rng.randrange(32000) for _ in range(rng.randrange(8, 41))]
        prompt = (rng.choice(systems) if rng.random() < 0.7 else []) + own
        return [pool.allocate(f"req-{n}", prompt), rng.randrange(16, 129)]

    running = [admit() for _ in range(RUNNING)]
    ops = RUNNING
    t = time.process_time()
    for _ in range(steps):
        for i, (seq, left) in enumerate(running):
            pool.append(seq, [rng.randrange(32000)])
            ops += 1
            if left > 1:
                running[i][1] = left - 1
                continue
            pool.mark_computed(seq, seq.num_tokens)
            pool.free(seq)
            running[i] = admit()
            ops += 3
        if after_step is not None:
            after_step([seq for seq, _ in running])
    dt = time.process_time() - t
    for seq, _ in running:
        pool.free(seq)
    return ops / dt, ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--min-s", type=float, default=0.5, help="timed seconds per measurement")
    ap.add_argument("--log-dir", default=None, help="where the recording rows write their log")
    ap.add_argument("--pairs", type=int, default=9, help="recording's cost: triples per probe set")
    ap.add_argument("--pair-steps", type=int, default=500, help="steps of each run of a triple")
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    gc.disable()
    light = {k: "1" for k in LIGHT_VARS}
    configs = {
        "every probe off (the C core)": {},
        "light probes (magic, ownership, events, leaks, lockdep)": light,
        "light probes + sampled guard 1/64": {**light, "KVSCOPE_GUARD": "1", SAMPLE_VAR: "64"},
        "every probe off + recording": {"record": "1"},
        "all probes (as under kvscope run)": {k: "1" for k in PROBE_VARS},
        "all probes + recording": {**{k: "1" for k in PROBE_VARS}, "record": "1"},
    }
    log_dir = tempfile.mkdtemp(dir=args.log_dir)
    log = os.path.join(log_dir, "ops.log")
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.repeat):
        # Interleaved rounds, a fresh pool each: every configuration sees the same machine.
        for name, env in configs.items():
            steps = args.steps
            # Runs of `steps` (seeds r, r + repeat, ...) for at least --min-s: the C core does
            # 300 steps in a few tens of ms, too short to time on a shared machine.
            ops = 0.0
            spent = 0.0
            seed = r
            while spent == 0 or spent < args.min_s:
                if env.get("record"):
                    os.environ["KVSCOPE_RECORD_OPS"] = log
                pool = make(env)
                os.environ.pop("KVSCOPE_RECORD_OPS", None)
                try:
                    rate, n = serve(pool, steps, seed=seed)
                finally:
                    pool.close()
                    pool.unlink()
                    if os.path.exists(log):
                        os.unlink(log)
                ops += n
                spent += n / rate
                seed += args.repeat
            rates[name].append(ops / spent)
    fast = statistics.median(rates["every probe off (the C core)"])
    print(f"load average at the end: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)\n")
    print("| configuration | pool ops/s | vs the C core |")
    print("|---|---:|---:|")
    for name in configs:
        rate = statistics.median(rates[name])
        print(f"| {name} | {rate:,.0f} | {rate / fast:.2f}x |")
    print(
        f"\nrecording's cost: {args.pairs} triples per probe set (without, with, without; "
        f"{args.pair_steps} steps each), the run with it against its neighbours' mean:"
    )
    for label, env in (("every probe off", {}), ("all probes", {k: "1" for k in PROBE_VARS})):
        costs = []
        for i in range(args.pairs):

            def run(record: bool, seed: int = 1000 + i, env: dict = env) -> float:
                if record:
                    os.environ["KVSCOPE_RECORD_OPS"] = log
                pool = make(env)
                os.environ.pop("KVSCOPE_RECORD_OPS", None)
                try:
                    rate, _ = serve(pool, args.pair_steps, seed=seed)
                finally:
                    pool.close()
                    pool.unlink()
                    if os.path.exists(log):
                        os.unlink(log)
                return 1 / rate

            a, b, c = run(False), run(True), run(False)
            costs.append(b / ((a + c) / 2) - 1)
        ordered = sorted(costs)
        print(
            f"  {label} + recording: median {statistics.median(costs):+.1%} (from "
            f"{ordered[0]:+.1%} to {ordered[-1]:+.1%}; middle half {ordered[len(costs) // 4]:+.1%}"
            f" .. {ordered[(3 * len(costs)) // 4]:+.1%}): " + ", ".join(f"{x:+.1%}" for x in costs)
        )
    os.rmdir(log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
