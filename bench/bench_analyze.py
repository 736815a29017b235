"""`kvscope analyze` on a dump of 1,000,000 blocks: the target is at most 2 s for the command.

    python bench/bench_analyze.py                 # 1,000,000 blocks, about half of them held
    python bench/bench_analyze.py --blocks 100000 # smaller

Builds a pool (block_size 16, 1 layer, 1 kv head x 8, float16), allocates --seqs sequences,
dumps it, then times each stage of the analysis in this process, twice: with the owner alive (a
healthy pool) and as seen from another host (every owner dead: every held block is a leak
finding, the worst case for the report). Then times the command a user types, `kvscope analyze
FILE` (and `--json`), end to end in a fresh process: start-up, imports, read, analysis and
output; with the owner alive (this process), then on the same dump marked as written on another
host. Each command row gives the seconds to its first line on stdout, to its exit, and the CPU
seconds (user + system) it used: on a loaded machine, wall time is not the command's own.
Prints the median of --repeat runs per row. Bytecode is compiled first, as bench_startup.py does.
"""

from __future__ import annotations

import argparse
import compileall
import io
import os
import statistics
import tempfile
import time
import uuid

from bench_startup import kvscope_command, medians

import kvscope
from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.check import check_view
from kvscope.allocator.dumpfile import write_dump
from kvscope.allocator.dumpread import read_dump
from kvscope.allocator.layout import DUMP_HEADER_DTYPE
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


def timed(fn, repeat: int) -> str:
    """The median wall seconds of `repeat` calls, and in parentheses their median CPU seconds."""
    wall, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return f"{statistics.median(wall):.3f} ({statistics.median(cpu):.3f})"


def mark_foreign(path: str) -> None:
    """Rewrite the dump's host as another host's: every process in it counts as dead."""
    offset = DUMP_HEADER_DTYPE.fields["host"][1]
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"another-host".ljust(64, b"\0"))


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
        print(f"load average {os.getloadavg()[0]:.1f}")
        view, dh = read_dump(path)
        sink = io.StringIO()
        print("| stage: wall (CPU) | owner alive (s) | owner dead (s) |\n|---|---:|---:|")
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
            print(f"| {name} | {a} | {b} |")
        for folder in {
            os.path.dirname(kvscope.__file__),
            os.path.dirname(kvscope.allocator.__file__),
        }:
            compileall.compile_dir(folder, quiet=1)
        cmd = kvscope_command()
        print(
            "\n| command | owner | first line (s) | exit (s) | CPU (s) |\n|---|---|---:|---:|---:|"
        )
        for owner in ("alive", "dead"):
            if owner == "dead":
                mark_foreign(path)
            for extra in ([], ["--json"]):
                first, end, cpu = medians([*cmd, "analyze", path, *extra], args.repeat)
                label = " ".join(["kvscope analyze FILE", *extra])
                print(f"| `{label}` | {owner} | {first:.3f} | {end:.3f} | {cpu:.3f} |")
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
