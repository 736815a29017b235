"""How soon the reading verbs answer: `kvscope --version`, `ls`, `check NAME`, `analyze FILE`.

    python bench/bench_startup.py              # --repeat 5

Creates a small CPU pool (64 blocks of 16 tokens, one sequence held by this process) and a dump
of it, then runs each command as a user does, in a fresh process, --repeat times: the seconds to
its first line on stdout, to its exit, and the CPU seconds (user + system) it used. Prints the
median of each. On a machine that other work loads, wall times include waiting for a core and
CPU times do not.

Python's bytecode of kvscope is compiled first (`compileall`, what `pip install` does): with
PYTHONDONTWRITEBYTECODE set and no cache, every run would compile kvscope's sources again.
"""

from __future__ import annotations

import argparse
import compileall
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import kvscope
from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.dumpfile import write_dump


def kvscope_command() -> list[str]:
    """The installed `kvscope` script, else `python -m kvscope`."""
    found = shutil.which("kvscope")
    return [found] if found else [sys.executable, "-m", "kvscope"]


def run_command(argv: list[str]) -> tuple[float, float, float]:
    """Run argv; (seconds to its first line on stdout, seconds to its exit, CPU seconds). It
    must print a line and exit 0 or 1 (1: findings)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    first = p.stdout.readline()
    t1 = time.perf_counter()
    p.stdout.read()
    err = p.stderr.read()
    code = p.wait()
    t2 = time.perf_counter()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert first and code in (0, 1), (argv, code, err)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return t1 - t0, t2 - t0, cpu


def medians(argv: list[str], repeat: int) -> tuple[float, float, float]:
    """The median first-line, exit and CPU seconds of `repeat` runs of argv."""
    runs = [run_command(argv) for _ in range(repeat)]
    first, end, cpu = zip(*runs)
    return statistics.median(first), statistics.median(end), statistics.median(cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    for folder in {os.path.dirname(kvscope.__file__), os.path.dirname(kvscope.allocator.__file__)}:
        compileall.compile_dir(folder, quiet=1)
    cfg = PoolConfig(num_blocks=64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=16)
    pool = KVPool.create(f"bench-startup-{uuid.uuid4().hex[:8]}", cfg)
    try:
        pool.allocate("req-1", list(range(40)))
        with tempfile.TemporaryDirectory() as d:
            dump = os.path.join(d, "small.kvd")
            write_dump(pool, dump, reason="bench")
            cmd = kvscope_command()
            print(f"load average {os.getloadavg()[0]:.1f}, {args.repeat} runs each, medians")
            print("| command | first line (s) | exit (s) | CPU (s) |\n|---|---:|---:|---:|")
            for label, argv in (
                ("kvscope --version", ["--version"]),
                ("kvscope ls", ["ls"]),
                ("kvscope check NAME", ["check", pool.name]),
                ("kvscope analyze FILE", ["analyze", dump]),
                ("kvscope analyze FILE --json", ["analyze", dump, "--json"]),
            ):
                first, end, cpu = medians([*cmd, *argv], args.repeat)
                print(f"| `{label}` | {first:.3f} | {end:.3f} | {cpu:.3f} |")
            print(f"load average {os.getloadavg()[0]:.1f}")
    finally:
        pool.close()
        pool.unlink()


if __name__ == "__main__":
    main()
