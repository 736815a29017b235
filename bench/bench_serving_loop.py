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
the same probes without it (separate runs: their spread is the machine's). Recording's cost is
then measured apart, --pairs runs for each of the two probe sets: in a run two pools of the same
probes, one of them recording, serve the same seeded requests in lockstep for --pair-steps
steps, which of them takes a step first alternating, every step timed in this process's CPU
time, so that what the machine does to one it does to the other within a step (an A/A run, two
pools neither recording, measures within half a percent of zero). A run's cost is its CPU time
with recording over the time without; each run's, their median and spread are printed. After
the table they run in a fresh process (in the one that ran the table they read higher and
wider).

    python bench/bench_serving_loop.py --repeat 0 --pairs 15     # recording's cost only
    python bench/bench_serving_loop.py --repeat 0 --pairs 15 --aa   # and A/A runs beside it
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_probes import LIGHT_VARS, PROBE_VARS, SAMPLE_VAR, make  # noqa: E402

from kvscope.allocator import KVPool  # noqa: E402

RUNNING = 64
SYSTEMS = 8


class Loop:
    """The serving loop's state on one pool: its running sequences and its seeded requests
    (the same seed, the same operations)."""

    def __init__(self, pool: KVPool, seed: int) -> None:
        self.pool = pool
        self.rng = random.Random(seed)
        self.systems = [[self.rng.randrange(32000) for _ in range(32)] for _ in range(SYSTEMS)]
        self.n = 0
        self.running = [self.admit() for _ in range(RUNNING)]
        self.ops = RUNNING

    def admit(self) -> list:
        rng = self.rng
        self.n += 1
        own = [rng.randrange(32000) for _ in range(rng.randrange(8, 41))]
        prompt = (rng.choice(self.systems) if rng.random() < 0.7 else []) + own
        return [self.pool.allocate(f"req-{self.n}", prompt), rng.randrange(16, 129)]

    def step(self) -> None:
        """One decode step: a token appended to every running sequence, the finished ones
        published and freed, new requests in their place."""
        pool, rng, running = self.pool, self.rng, self.running
        ops = 0
        for i, (seq, left) in enumerate(running):
            pool.append(seq, [rng.randrange(32000)])
            ops += 1
            if left > 1:
                running[i][1] = left - 1
                continue
            pool.mark_computed(seq, seq.num_tokens)
            pool.free(seq)
            running[i] = self.admit()
            ops += 3
        self.ops += ops

    def sequences(self) -> list:
        return [seq for seq, _ in self.running]

    def finish(self) -> None:
        for seq, _ in self.running:
            self.pool.free(seq)


def serve(
    pool: KVPool, steps: int, seed: int, after_step: Callable[[list], None] | None = None
) -> tuple[float, int]:
    """Pool operations per second over `steps` decode steps, and how many operations;
    `after_step(running sequences)` runs after each step, timed with it."""
    loop = Loop(pool, seed)
    t = time.process_time()
    for _ in range(steps):
        loop.step()
        if after_step is not None:
            after_step(loop.sequences())
    dt = time.process_time() - t
    loop.finish()
    return loop.ops / dt, loop.ops


def step_in_turn(loops: tuple[Loop, Loop] | list[Loop], steps: int) -> list[int]:
    """Two loops stepped in turn, which steps first alternating; each one's process CPU ns."""
    clock = time.process_time_ns
    spent = [0, 0]
    for i in range(steps):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            t = clock()
            loops[k].step()
            spent[k] += clock() - t
    return spent


def recording_cost(
    env: dict[str, str], steps: int, seed: int, log: str, record: bool = True
) -> tuple[float, int]:
    """Recording's cost in one run: two pools of the same probes, one recording into `log`,
    serve the same seeded requests in lockstep, step by step, which of them goes first
    alternating; each step timed in this process's CPU time. Returns the time with recording
    over the time without, minus 1, and the bytes of log written. With `record` False neither
    records (an A/A run: what the method measures where there is nothing to measure)."""
    plain = make(env)
    if record:
        os.environ["KVSCOPE_RECORD_OPS"] = log
    try:
        recorded = make(env)
    finally:
        os.environ.pop("KVSCOPE_RECORD_OPS", None)
    try:
        loops = (Loop(plain, seed), Loop(recorded, seed))
        spent = step_in_turn(loops, steps)
        assert loops[0].ops == loops[1].ops
        for loop in loops:
            loop.finish()
    finally:
        for pool in (plain, recorded):
            pool.close()
            pool.unlink()
            gc.collect()  # (GC is off while timing: a closed pool's cycles, and its mapping, go here)
    size = os.path.getsize(log) if record else 0
    if record:
        os.unlink(log)
    return spent[1] / spent[0] - 1, size


def spread(costs: list[float]) -> str:
    """A list of costs' median, range and middle half."""
    ordered = sorted(costs)
    k = len(ordered)
    return (
        f"median {statistics.median(ordered):+.1%} (from {ordered[0]:+.1%} to {ordered[-1]:+.1%};"
        f" middle half {ordered[k // 4]:+.1%} .. {ordered[(3 * k) // 4]:+.1%})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--min-s", type=float, default=0.5, help="timed seconds per measurement")
    ap.add_argument("--log-dir", default=None, help="where the recording rows write their log")
    ap.add_argument("--pairs", type=int, default=15, help="recording's cost: runs per probe set")
    ap.add_argument("--pair-steps", type=int, default=2000, help="steps of each lockstep run")
    ap.add_argument(
        "--aa", action="store_true", help="the lockstep runs with neither pool recording too"
    )
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
                    gc.collect()  # (GC is off while timing: a closed pool's cycles, and its mapping, go here)
                    if os.path.exists(log):
                        os.unlink(log)
                ops += n
                spent += n / rate
                seed += args.repeat
            rates[name].append(ops / spent)
    if args.repeat:
        fast = statistics.median(rates["every probe off (the C core)"])
        print("| configuration | pool ops/s | vs the C core |")
        print("|---|---:|---:|")
        for name in configs:
            rate = statistics.median(rates[name])
            print(f"| {name} | {rate:,.0f} | {rate / fast:.2f}x |")
    if args.repeat and args.pairs:
        # The lockstep runs in a fresh process: after the table's runs (some 40 pools made and
        # dropped with GC off) this one reads recording's cost higher and wider.
        argv2 = ["--repeat", "0", "--pairs", str(args.pairs), "--pair-steps", str(args.pair_steps)]
        if args.log_dir:
            argv2 += ["--log-dir", args.log_dir]
        os.rmdir(log_dir)
        sys.stdout.flush()
        return subprocess.run(
            [sys.executable, os.path.abspath(__file__), *argv2, *(["--aa"] if args.aa else [])]
        ).returncode
    print(
        f"\nrecording's cost: {args.pairs} runs per probe set, each two pools (the same probes,"
        f" one recording) serving the same requests in lockstep for {args.pair_steps} steps,"
        " alternating which steps first; the CPU time with recording over the time without:"
    )
    for label, env in (("every probe off", {}), ("all probes", {k: "1" for k in PROBE_VARS})):
        costs = []
        size = 0
        for i in range(args.pairs):
            cost, size = recording_cost(env, args.pair_steps, 1000 + i, log)
            costs.append(cost)
        print(
            f"  {label} + recording: {spread(costs)}; log {size / 1e6:.1f} MB a run: "
            + ", ".join(f"{x:+.1%}" for x in costs)
        )
        if args.aa:
            null = [
                recording_cost(env, args.pair_steps, 1000 + i, log, record=False)[0]
                for i in range(args.pairs)
            ]
            print(f"  {label}, neither recording (A/A): {spread(null)}")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    os.rmdir(log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
