"""Replay speed: operations per second `kvscope replay` re-executes and compares.

    python bench/bench_replay.py                 # the serving loop, ~100,000 operations
    python bench/bench_replay.py --steps 300 --probes all

Records bench_serving_loop's workload (64 running sequences, appends, publications, frees,
admissions behind 8 shared prompts) into an operation log with the probes of --probes (none, or
all as under `kvscope run`), then replays the log against a fresh pool (kvscope/replay.py),
comparing every result; prints the log's operations, its size and the replay's rate (the median
of --repeat replays, reading the log included; this process's CPU time, one core pinned, GC
off, as bench_serving_loop.py times: other work on the machine delays a run but does not count).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_probes import PROBE_VARS, make  # noqa: E402
from bench_serving_loop import serve  # noqa: E402

from kvscope.allocator.oplog import read_log  # noqa: E402
from kvscope.replay import replay  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=1000, help="serving-loop steps recorded")
    ap.add_argument("--probes", choices=("none", "all"), default="none")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    env = {k: "1" for k in PROBE_VARS} if args.probes == "all" else {}
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    gc.disable()
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "ops.log")
        os.environ["KVSCOPE_RECORD_OPS"] = log
        pool = make(env)
        os.environ.pop("KVSCOPE_RECORD_OPS")
        try:
            serve(pool, args.steps, seed=0)
        finally:
            pool.close()
            pool.unlink()
        size = os.path.getsize(log)
        rates = []
        for _ in range(args.repeat):
            t = time.process_time()
            oplog = read_log(log)
            read_s = time.process_time() - t
            out = replay(oplog)
            total = time.process_time() - t
            assert out.reason == "end", (out.reason, out.diff)
            rates.append(out.replayed / total)
        print(f"load average at the end: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
        print(
            f"log: {out.replayed:,} operations, {size / 1e6:.1f} MB; probes {args.probes}; "
            f"reading it {read_s:.2f} s"
        )
        print(
            f"replay: {statistics.median(rates):,.0f} ops/s (median of {args.repeat}; "
            f"{', '.join(f'{r:,.0f}' for r in rates)}), every result compared"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
