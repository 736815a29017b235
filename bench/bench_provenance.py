"""Slot provenance's cost on bench_serving_loop: each probe set with provenance at 1/N sampling
beside the same probes without it, pair by pair, in interleaved rounds.

    python bench/bench_provenance.py                 # ~1 minute
    python bench/bench_provenance.py --sample 64 --repeat 5

The loop is bench_serving_loop.py's `serve` (64 running sequences appending a token a step,
finished ones published and freed, 70% of new requests behind a shared system prompt): with
provenance on, the core records a sampled sequence's slots at allocate and append, hashes their
K/V at a publication (a CPU pool) and checks every prefix hit against the records. The
"+ sweep" row's runs with provenance also run `pool.check_provenance()` over the running
sequences every step (what the example server does in guard mode), beside the same probes with
neither. Each measurement is at least --min-s of this process's
CPU time (one core pinned, GC off); the table shows each pair's median rate and the ratio of
with to without, and under it every round's ratio (the spread).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_probes import LIGHT_VARS, PROBE_VARS, SAMPLE_VAR, make  # noqa: E402
from bench_serving_loop import serve  # noqa: E402

from kvscope.allocator.probeflags import PROVENANCE_SAMPLE_ENV  # noqa: E402


def measure(env: dict[str, str], sample: int, swept: bool, steps: int, seed: int, min_s: float):
    """Pool operations per second of runs of `steps` (seeds seed, seed + 1000, ...) for at
    least min_s."""
    ops = spent = 0.0
    while spent == 0 or spent < min_s:
        os.environ[PROVENANCE_SAMPLE_ENV] = str(sample)
        pool = make(env)
        os.environ.pop(PROVENANCE_SAMPLE_ENV, None)
        try:
            sweep = pool.check_provenance if swept and sample else None
            rate, n = serve(pool, steps, seed=seed, after_step=sweep)
        finally:
            pool.close()
            pool.unlink()
            gc.collect()  # (GC is off while timing: a closed pool's cycles, and its mapping, go here)
        ops += n
        spent += n / rate
        seed += 1000
    return ops / spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sample", type=int, default=64, help="provenance records 1 sequence in N")
    ap.add_argument("--min-s", type=float, default=0.5, help="timed seconds per measurement")
    ap.add_argument("--only", default="", help="the probe sets whose name contains this")
    args = ap.parse_args(argv)
    if args.sample < 1 or args.repeat < 1 or args.steps < 1:
        print("bench_provenance: --sample, --repeat and --steps must be >= 1", file=sys.stderr)
        return 2
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    gc.disable()
    light = {k: "1" for k in LIGHT_VARS}
    probe_sets = {
        "every probe off (the C core)": ({}, False),
        "light probes": (light, False),
        "light probes + sampled guard 1/64": (
            {**light, "KVSCOPE_GUARD": "1", SAMPLE_VAR: "64"},
            False,
        ),
        "all probes (as under kvscope run)": ({k: "1" for k in PROBE_VARS}, False),
        "light probes + sweep each step": (light, True),
    }
    probe_sets = {k: v for k, v in probe_sets.items() if args.only in k}
    if not probe_sets:
        print(f"bench_provenance: no probe set matches --only {args.only!r}", file=sys.stderr)
        return 2
    ratios: dict[str, list[float]] = {name: [] for name in probe_sets}
    rates: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in probe_sets}
    for r in range(args.repeat):
        # Interleaved: each pair measured back to back, in alternating order, each round.
        for name, (env, swept) in probe_sets.items():
            order = (0, args.sample) if r % 2 == 0 else (args.sample, 0)
            got = {s: measure(env, s, swept, args.steps, r, args.min_s) for s in order}
            rates[name][0].append(got[0])
            rates[name][1].append(got[args.sample])
            ratios[name].append(got[args.sample] / got[0])
    print(f"load average at the end: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)\n")
    print(f"| probes | without provenance ops/s | with 1/{args.sample} ops/s | ratio |")
    print("|---|---:|---:|---:|")
    for name in probe_sets:
        off, on = (statistics.median(v) for v in rates[name])
        print(f"| {name} | {off:,.0f} | {on:,.0f} | {statistics.median(ratios[name]):.3f}x |")
    print("\nround by round (with / without), then the lowest and highest:")
    for name in probe_sets:
        r = ratios[name]
        print(f"  {name}: " + ", ".join(f"{x:.3f}" for x in r) + f" [{min(r):.3f}, {max(r):.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
