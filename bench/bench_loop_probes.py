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

    python bench/bench_loop_probes.py --lockstep all provenance    # on a busy machine

With --lockstep each configuration instead runs beside every probe off, in one run: two pools
serve the same seeded requests step by step, which of them takes a step first alternating,
every step timed in this process's CPU time (bench_serving_loop's recording_cost method: what
the machine does to one it does to the other within a step; "off" beside "off" measures
within about half a percent of 1.00x). Printed per configuration: the loop's speed over every
probe off's, each round's and their median; the excess in µs per operation; and where it goes,
the excess of each kind of call in ns (in runs of their own, each call timed in this process's
CPU time, whose every read is a system call: the calls then find less in the caches than the
untimed loop does, so read these as where the excess goes, not as its size).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_probes import PROBE_VARS  # noqa: E402
from bench_serving_loop import Loop, serve, step_in_turn  # noqa: E402

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
        from kvscope.probes import watchdog

        watchdog.install(pool, {"KVSCOPE_LOCKDEP": "1", "KVSCOPE_LOCK_HOLD_S": "0"})
    return pool


CALLS = ("allocate", "append", "mark_computed", "free")


class Timed:
    """A pool whose calls the serving loop makes are timed, per kind (ns in `spent`)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.spent = dict.fromkeys(CALLS, 0)
        self.calls = dict.fromkeys(CALLS, 0)

    def _timed(self, name: str, *args: object) -> object:
        clock = time.process_time_ns  # (this process's CPU time: a preemption is not counted)
        t = clock()
        out = getattr(self.pool, name)(*args)
        self.spent[name] += clock() - t
        self.calls[name] += 1
        return out

    def allocate(self, request_id: object, tokens: list[int]) -> object:
        return self._timed("allocate", request_id, tokens)

    def append(self, seq: object, tokens: list[int]) -> object:
        return self._timed("append", seq, tokens)

    def mark_computed(self, seq: object, num_tokens: int) -> object:
        return self._timed("mark_computed", seq, num_tokens)

    def free(self, seq: object) -> object:
        return self._timed("free", seq)


def lockstep(env: dict[str, str], steps: int, seed: int, timed: bool) -> dict[str, float]:
    """One run of `env` beside every probe off (two pools, the same seeded requests, steps
    taken in turn, which goes first alternating): the loop's CPU time with every probe off
    over its time with `env` ("speed"), the excess in µs per operation, and with `timed` the
    excess ns of each kind of call."""
    pools = [make({}), make(env)]
    try:
        fronts = [Timed(p) if timed else p for p in pools]
        loops = [Loop(f, seed) for f in fronts]  # type: ignore[arg-type]
        for f in fronts:  # (the admissions of the first sequences are not the loop's)
            if isinstance(f, Timed):
                f.spent, f.calls = dict.fromkeys(CALLS, 0), dict.fromkeys(CALLS, 0)
        ops0 = loops[0].ops
        spent = step_in_turn(loops, steps)
        ops = loops[0].ops - ops0
        assert ops == loops[1].ops - ops0
        for loop in loops:
            loop.finish()
    finally:
        for p in pools:
            p.close()
            p.unlink()
        gc.collect()  # (GC is off while timing)
    out = {"speed": spent[0] / spent[1], "us": (spent[1] - spent[0]) / ops / 1e3}
    if timed:
        a, b = fronts
        assert isinstance(a, Timed) and isinstance(b, Timed)
        for c in CALLS:
            if a.calls[c]:
                out[c] = (b.spent[c] - a.spent[c]) / a.calls[c]
    return out


def lockstep_table(
    chosen: list[str], table: dict[str, dict[str, str]], args: argparse.Namespace
) -> None:
    """--lockstep: each configuration beside every probe off, --repeat runs, rounds interleaved."""
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in chosen}
    calls: dict[str, list[dict[str, float]]] = {c: [] for c in chosen}
    for r in range(args.repeat):
        for c in chosen:
            runs[c].append(lockstep(table[c], args.steps, r, timed=False))
            # (the calls timed in a run of their own: their clock reads stay out of the speed)
            calls[c].append(lockstep(table[c], args.steps, r, timed=True))
    print("| configuration | speed vs every probe off, lockstep (median; each run) | "
          "µs per operation over off | ns per call over off: allocate, append, "
          "mark_computed, free |")  # fmt: skip
    print("|---|---|---:|---|")
    for c in chosen:
        rs = runs[c]
        speed = statistics.median(x["speed"] for x in rs)
        each = ", ".join(f"{x['speed']:.3f}" for x in rs)
        us = statistics.median(x["us"] for x in rs)
        per = ", ".join(f"{statistics.median(x[k] for x in calls[c]):+.0f}" for k in CALLS)
        print(f"| {c} | {speed:.3f}x ({each}) | {us:+.3f} | {per} |")
    print(f"\nload average {os.getloadavg()[0]:.1f} ({os.cpu_count()} CPUs)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeat", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--steps", type=int, default=None,
                    help="decode steps a run (default 300; with --lockstep 3000)")  # fmt: skip
    ap.add_argument("--lockstep", action="store_true",
                    help="each configuration beside every probe off, in lockstep")  # fmt: skip
    ap.add_argument("only", nargs="*", help="configurations to run (default: all of them)")
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 3000 if args.lockstep else 300
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
    if args.lockstep:
        lockstep_table([c for c in chosen if c != "off"], table, args)
        return 0
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
