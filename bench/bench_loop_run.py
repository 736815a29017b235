"""The serving-shaped loop as a user's script: `python script.py` against `kvscope run script.py`.

    python bench/bench_loop_run.py                    # 7 rounds, ~1 minute on a quiet machine
    python bench/bench_loop_run.py --pairs 3 --steps 300 --dump-dir /tmp   # quick

bench_serving_loop.py switches probe sets by environment variables inside one process; this
measures the real thing. This file is also the script (`--loop`): it creates a pool (4096
blocks of 16 tokens, as bench_serving_loop's), runs bench_serving_loop's `serve` over it
(64 running sequences, one append each per step, a finished sequence published with
mark_computed and freed, a new request admitted in its place, 70% of them behind one of 8
shared 32-token system prompts), frees everything, closes and unlinks the pool, and prints
one JSON line: the loop's pool operations, its process CPU seconds and wall seconds (timed
inside the script, so the supervisor's start and exit are not in them), and the process's
CPU seconds at the end.

Each round runs the script plainly, under `kvscope run` as it comes (guard mode, slot
provenance on every sequence, lockdep, every probe, the supervisor, the exit check), and
under `kvscope run --no-guard`, in an order that rotates round by round, each a fresh
process, the same seed within a round. Per run the bench reads the script's own ops/s (its
process CPU time: other work on a loaded machine delays the loop but does not count) and
also its wall-clock ops/s, and times from outside: the seconds from the command's start to
the loop's start (interpreter, imports, under kvscope run the supervisor's start and the
hooks), from the loop's end to the command's exit (close, unlink; under kvscope run the
exit check, the supervisor's last read and the verdict), and the CPU seconds of every
process of the command. Prints every round's ratio to the plain run of the same round,
and the median and range of each figure.

    python bench/bench_loop_run.py --loop --steps 300    # the script alone
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))

MODES = ("plain", "kvscope run", "kvscope run --no-guard")


def loop(steps: int, seed: int, name: str) -> dict[str, float]:
    """The script's body: a pool, the serving loop over it, the pool closed and unlinked."""
    sys.path.insert(0, HERE)
    from bench_serving_loop import serve

    from kvscope.allocator import KVPool, PoolConfig

    pool = KVPool.create(
        name,
        PoolConfig(
            num_blocks=4096, block_size=16, num_layers=1, num_kv_heads=1, head_dim=8,
            dtype="float16",
        ),
    )  # fmt: skip
    start = time.monotonic()
    cpu = time.process_time()
    _, ops = serve(pool, steps, seed=seed)
    end = time.monotonic()
    loop_cpu = time.process_time() - cpu
    pool.close()
    pool.unlink()
    return {
        "ops": ops,
        "ops_per_cpu_s": ops / loop_cpu,
        "loop_cpu_s": loop_cpu,
        "loop_wall_s": end - start,
        "loop_start": start,
        "loop_end": end,
        "process_cpu_s": time.process_time(),
    }


def kvscope_command() -> list[str]:
    """The installed `kvscope` script beside this interpreter, else `python -m kvscope`."""
    found = shutil.which("kvscope", path=os.path.dirname(sys.executable))
    return [found] if found else [sys.executable, "-m", "kvscope"]


def command(mode: str, steps: int, seed: int, dump_dir: str) -> list[str]:
    """The command line of one run of the script in `mode`."""
    name = f"bench-loop-{uuid.uuid4().hex[:8]}"
    script = [os.path.abspath(__file__), "--loop", "--steps", str(steps), "--seed", str(seed),
              "--name", name]  # fmt: skip
    if mode == "plain":
        return [sys.executable, *script]
    extra = ["--no-guard"] if mode.endswith("--no-guard") else []
    return [*kvscope_command(), "run", "--dump-dir", dump_dir, *extra, *script]


def time_run(argv: list[str]) -> dict[str, float]:
    """Run one command; the script's figures, the seconds from the start to the loop's start
    and from its end to the exit, the CPU seconds of every process of it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    t1 = time.monotonic()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    out = json.loads(lines[-1])
    out["start_s"] = out["loop_start"] - t0
    out["exit_s"] = t1 - out["loop_end"]
    out["ops_per_wall_s"] = out["ops"] / out["loop_wall_s"]
    out["all_cpu_s"] = (
        after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    )  # fmt: skip
    return out


def spread(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def bench(pairs: int, steps: int, dump_dir: str, modes: tuple[str, ...] = MODES) -> dict:
    """`pairs` rounds of every mode (the order rotating); each run's figures by mode."""
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(pairs):
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        for mode in order:
            runs[mode].append(time_run(command(mode, steps, r, dump_dir)))
        plain = runs["plain"][-1]
        print(
            f"round {r + 1}: "
            + "; ".join(
                f"{m} {runs[m][-1]['ops_per_cpu_s']:,.0f} ops/CPU-s"
                + (
                    ""
                    if m == "plain"
                    else f" ({runs[m][-1]['ops_per_cpu_s'] / plain['ops_per_cpu_s']:.2f}x)"
                )  # fmt: skip
                for m in modes
            ),
            flush=True,
        )
    return runs


def report(runs: dict[str, list[dict[str, float]]], steps: int) -> None:
    plain = runs["plain"]
    n = len(plain)
    print(
        f"\nthe serving loop, {steps} steps ({statistics.median(r['ops'] for r in plain):,.0f}"
        f" pool operations), {n} rounds; load average {os.getloadavg()[0]:.1f}"
        f" ({os.cpu_count()} CPUs); medians (range)\n"
    )
    print(
        "| run | loop ops/s (process CPU) | vs plain, each round | vs plain, medians |"
        " loop ops/s (wall) | start to loop (s) | loop end to exit (s) | CPU, every process (s) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    base = statistics.median(r["ops_per_cpu_s"] for r in plain)
    for mode, rs in runs.items():
        rates = [r["ops_per_cpu_s"] for r in rs]
        ratios = [a["ops_per_cpu_s"] / b["ops_per_cpu_s"] for a, b in zip(rs, plain)]
        each = "" if mode == "plain" else spread(ratios, ".2f") + "x"
        print(
            f"| {mode} | {spread(rates, ',.0f')} | {each} | "
            f"{statistics.median(rates) / base:.2f}x | "
            f"{spread([r['ops_per_wall_s'] for r in rs], ',.0f')} | "
            f"{spread([r['start_s'] for r in rs], '.2f')} | "
            f"{spread([r['exit_s'] for r in rs], '.2f')} | "
            f"{spread([r['all_cpu_s'] for r in rs], '.2f')} |"
        )
    for mode, rs in runs.items():
        if mode != "plain":
            ratios = [a["ops_per_cpu_s"] / b["ops_per_cpu_s"] for a, b in zip(rs, plain)]
            print(f"{mode} / plain, each round: " + ", ".join(f"{x:.2f}x" for x in ratios))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="bench_loop_run.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--pairs", type=int, default=7, help="rounds of every mode (default 7)")
    ap.add_argument("--steps", type=int, default=3000, help="decode steps a run (default 3000)")
    ap.add_argument("--dump-dir", default=None, help="kvscope run's --dump-dir (default: a temp)")
    ap.add_argument("--json", help="also write every run's figures here")
    ap.add_argument("--loop", action="store_true", help="be the script: run the loop once")
    ap.add_argument("--seed", type=int, default=0, help="with --loop: the requests' seed")
    ap.add_argument("--name", default=None, help="with --loop: the pool's name")
    args = ap.parse_args(argv)
    for flag, value in (("--steps", args.steps), ("--pairs", args.pairs)):
        if value < 1:
            print(f"bench_loop_run.py: error: {flag} must be 1 or more (got {value})",
                  file=sys.stderr)  # fmt: skip
            return 2
    if args.loop:
        name = args.name or f"bench-loop-{uuid.uuid4().hex[:8]}"
        print(json.dumps(loop(args.steps, args.seed, name)), flush=True)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        runs = bench(args.pairs, args.steps, args.dump_dir or tmp)
    report(runs, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
