"""`kvscope analyze` on a dump of 1,000,000 blocks: the target is at most 2 s.

    python bench/bench_analyze.py                 # 1,000,000 blocks, about half of them held
    python bench/bench_analyze.py --blocks 100000 # smaller

Builds a pool (block_size 16, 1 layer, 1 kv head x 8, float16), allocates --seqs sequences,
dumps it, then times each stage of the analysis twice: with the owner alive (a healthy pool)
and as seen from another host (every owner dead: every held block is a leak finding, the worst
case for the report). Then times the command a user types, `kvscope analyze FILE` (and
`--json`), end to end in a fresh process: start-up, imports, read, analysis and output (its
owner, this process, alive). Prints the median of --repeat runs per row, in seconds.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.check import check_view
from kvscope.allocator.dumpfile import read_dump, write_dump
from kvscope.analysis import analyze_view
from kvscope.report import console, print_json, render


def build(num_blocks: int, num_seqs: int, path: str) -> None:
    cfg = PoolConfig(
        num_blocks=num_blocks,
        num_layers=1,
        head_dim=8,
        num_kv_heads=1,
        block_size=16,
        dtype="float16",
    )
    pool = KVPool.create(f"bench-analyze-{uuid.uuid4().hex[:8]}", cfg)
    try:
        per_seq = num_blocks // 2 // num_seqs
        for i in range(num_seqs):
            pool.allocate(f"req-{i}", [i] * (16 * per_seq - 3))
        write_dump(pool, path, reason="bench")
    finally:
        pool.close()
        pool.unlink()


def timed(fn, repeat: int) -> float:
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs)


def analyze_command(argv: list[str], cpu_s: list[float]) -> None:
    """Run `kvscope analyze` as a user does; it must have analyzed (exit 0 or 1). Appends the
    CPU seconds (user + system) it used to cpu_s: on a loaded machine, wall time is not its own."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode in (0, 1), done.stderr
    cpu_s.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=1_000_000)
    p.add_argument("--seqs", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.kvd")
        t = time.perf_counter()
        build(args.blocks, args.seqs, path)
        print(
            f"built and dumped {args.blocks} blocks in {time.perf_counter() - t:.1f} s"
            f" ({os.path.getsize(path) / 2**20:.0f} MiB)"
        )
        view, dh = read_dump(path)
        sink = io.StringIO()
        print("| stage | owner alive (s) | owner dead (s) |\n|---|---|---|")
        rows = {
            "read_dump": lambda alive: read_dump(path),
            "check_view": lambda alive: check_view(view, alive=alive),
            "analyze_view": lambda alive: analyze_view(view, alive=alive, dump_header=dh),
            "read + analyze + render": lambda alive: render(
                analyze_view(read_dump(path)[0], alive=alive, dump_header=dh), console(sink)
            ),
            "read + analyze + json": lambda alive: print_json(
                analyze_view(read_dump(path)[0], alive=alive, dump_header=dh), sink
            ),
        }
        alive = {"alive": lambda pid, start: True, "dead": lambda pid, start: False}
        for name, fn in rows.items():
            a = timed(lambda fn=fn: fn(alive["alive"]), args.repeat)
            b = timed(lambda fn=fn: fn(alive["dead"]), args.repeat)
            print(f"| {name} | {a:.3f} | {b:.3f} |")
        kvscope = shutil.which("kvscope")
        command = [kvscope] if kvscope else [sys.executable, "-m", "kvscope"]
        for extra in ([], ["--json"]):
            argv = [*command, "analyze", path, *extra]
            cpu: list[float] = []
            t = timed(lambda argv=argv, cpu=cpu: analyze_command(argv, cpu), args.repeat)
            label = " ".join(["kvscope analyze FILE", *extra])
            print(f"| `{label}` (the command; CPU {statistics.median(cpu):.3f} s) | {t:.3f} | - |")


if __name__ == "__main__":
    main()
