"""Shrinking: how long `kvscope replay --shrink` takes on a long run, and to how many operations.

    python bench/bench_shrink.py                       # every fault, ~100,000 ops
    python bench/bench_shrink.py --ops 20000 --faults leak,double-free

For each fault, records tests/replay_work.py's seeded workload (requests behind six shared
prompts; appends, publications, forks, frees, aborts; for the lease faults its lease_work, whose
requests take write leases while they wait and read leases as they finish; for kill-holding-lock
its worker_work, a forked worker the fault kills, then this process's run and reclaim; for
stale-padding-row its padded_work, whose steps' padded block table is audited every step; for
foreign-slot with slot provenance on and swept every step) on a pool with every probe on, the
fault armed so that it fires near the end of --ops operations, then replays the log to its
finding and shrinks it (kvscope/replay.py), printing the operations recorded, the operation the
finding came at, the operations left and the shrink's runs and seconds (CPU time of this
process and of the children it waited for: a killed process's replay runs in one).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvscope.allocator import KVPool, PoolConfig, faults  # noqa: E402
from kvscope.allocator.oplog import read_log  # noqa: E402
from kvscope.allocator.probeflags import ProbeFlags  # noqa: E402
from kvscope.allocator.probing import PoolProbes  # noqa: E402
from kvscope.replay import Shrinker, replay  # noqa: E402
from tests.replay_work import CONFIG, lease_work, padded_work, work, worker_work  # noqa: E402

EVERY = {
    "refcount-skew": 5,
    "oob-write": 10,
    "header-scribble": 10,
    "block-scribble": 10,
    "lock-inversion": 2,
    # lease_work's steps: a request each 8 (its read lease's release), one in two of them a
    # write lease on a waiting request
    "transfer-after-free": 16,
    "lease-leak": 8,
}
LEASE_FAULTS = ("transfer-after-free", "lease-leak")
ALL = ProbeFlags(events=True, ownership=True, guard=True, leaks=True, magic=True, digest=True)


def record(path: str, fault: str, at: int, n_ops: int) -> None:
    faults.configure(f"{fault}:{at}")
    pool = KVPool.create(f"bshrink-{uuid.uuid4().hex[:8]}", PoolConfig(**CONFIG, guard=True))
    try:
        pool.probe = PoolProbes(pool, ALL)
        pool.trace_locks(True)
        if fault == "foreign-slot":
            pool.provenance_sample = 1
        pool.record_ops(path)
        with contextlib.suppress(Exception), contextlib.redirect_stderr(io.StringIO()):
            if fault in LEASE_FAULTS:
                lease_work(pool, n_ops)
            elif fault == "kill-holding-lock":
                worker_work(pool, n_ops)
            elif fault == "stale-padding-row":
                padded_work(pool, n_ops)
            else:
                work(pool, n_ops, sweep=fault == "foreign-slot")
        # the per-step check a scheduler runs (refcount-skew is found by it; the magic probe's
        # own runs every 10 ms)
        with contextlib.redirect_stderr(io.StringIO()):
            pool.verify()
    finally:
        faults.configure(None)
        pool.close()
        pool.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ops", type=int, default=75000, help="workload steps (about 1.35 ops each)")
    ap.add_argument("--faults", default=",".join(faults.FAULTS))
    args = ap.parse_args(argv)
    gc.disable()
    print(f"load average: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    print("| fault | operations recorded | finding at | shrunk to | runs | seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        for fault in args.faults.split(","):
            # (GC is off while timing: the pools the last fault's runs left in cycles, and their
            # mappings, go here, or every fork of the replay's child copies their page tables)
            gc.collect()
            path = os.path.join(d, f"{fault}.ops")
            # the opportunities come about once in 4 steps (a release), once in 10 (oob-write,
            # the scribbles), fewer for lock-inversion (a transaction of several locks):
            # the fault armed to fire at about two thirds of the run
            at = args.ops * 2 // 3 // EVERY.get(fault, 4)
            record(path, fault, at, args.ops)
            log = read_log(path)
            out = replay(log, quiet=True)
            if out.reason != "finding" or out.record is None:
                print(f"| {fault} | {len(log.records)} | ({out.reason}) | - | - | - |")
                continue
            t, c = time.process_time(), os.times()
            shrunk = Shrinker(log, out).shrink()
            c2 = os.times()
            spent = time.process_time() - t + (c2.children_user - c.children_user)
            spent += c2.children_system - c.children_system
            print(
                f"| {fault} | {len(log.records):,} | {out.record.seq:,} | {len(shrunk.ops)} "
                f"| {shrunk.tests} | {spent:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
