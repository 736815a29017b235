"""How soon the reading verbs answer (`kvscope --version`, `ls`, `check NAME`, `analyze FILE`),
and what `kvscope run` adds to a short script's wall time.

    python bench/bench_startup.py              # --repeat 5
    python bench/bench_startup.py --run-only --repeat 10

Creates a small CPU pool (64 blocks of 16 tokens, one sequence held by this process) and a dump
of it, then runs each command as a user does, in a fresh process, --repeat times: the seconds to
its first line on stdout, to its exit, and the CPU seconds (user + system) it used. Prints the
median of each. On a machine that other work loads, wall times include waiting for a core and
CPU times do not.

`kvscope run`: a script that creates a 64-block pool, serves one request and removes the pool
runs as `python script.py` and as `kvscope run script.py`, in interleaved pairs. The script
prints CLOCK_MONOTONIC (host-wide) as its first and its last line; the bench reads when each
command started, when the run's verdict line came (stderr) and when it exited. Per pair: the
overhead (run wall - plain wall); how much later the script's first line came (after its
imports) than in the plain run; how much longer its last line to the exit took (the exit check,
the supervisor's last read and the verdict); the verdict to the exit; the CPU seconds added,
by all processes and by the script's own (to its last line: its imports, the hooks and the
probes, the part of the overhead that the machine's load does not change). Prints the median
and the range of each over the pairs.

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
import threading
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


# argv: a pool name. Its first and last lines are CLOCK_MONOTONIC, which every process shares;
# the first comes after the pool's import (torch), which `kvscope run` makes before the script.
# Then the CPU seconds its process used so far (the probes' share of it does not depend on what
# else loads the machine).
SHORT_SCRIPT = """
import sys, time
from kvscope.allocator import KVPool, PoolConfig
print("first", time.monotonic(), flush=True)
cfg = PoolConfig(num_blocks=64, block_size=16, num_layers=2, num_kv_heads=2, head_dim=16)
pool = KVPool.create(sys.argv[1], cfg)
seq = pool.allocate("req-1", list(range(40)))
pool.free(seq)
pool.close()
pool.unlink()
print("last", time.monotonic(), flush=True)
print("cpu", time.process_time(), flush=True)
"""


def time_script(argv: list[str]) -> dict[str, float]:
    """Run argv (the short script, plain or under `kvscope run`); monotonic seconds from its
    start to the script's first and last lines, to the verdict line (under kvscope run) and to
    its exit; and the CPU seconds it and its children used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stderr is not None
    seen: dict[str, float] = {}
    err: list[str] = []

    def read_stderr() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            err.append(line)
            if line.startswith("kvscope run:") and "verdict" not in seen:
                seen["verdict"] = time.monotonic() - t0

    reader = threading.Thread(target=read_stderr)
    reader.start()
    for line in p.stdout:
        word, _, value = line.partition(" ")
        if word in ("first", "last"):
            seen[word] = float(value) - t0
        elif word == "cpu":
            seen[word + "_script"] = float(value)
    code = p.wait()
    seen["exit"] = time.monotonic() - t0
    reader.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    seen["cpu"] = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert code == 0 and "first" in seen and "last" in seen, (argv, code, "".join(err))
    return seen


def bench_run(repeat: int) -> None:
    """`kvscope run` beside a plain run of the short script, `repeat` interleaved pairs."""
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "short.py")
        with open(script, "w") as f:
            f.write(SHORT_SCRIPT)
        rows: dict[str, list[float]] = {
            "plain wall": [],
            "kvscope run wall": [],
            "overhead (run - plain)": [],
            "start: the script's first line later by": [],
            "end: its last line to the exit, longer by": [],
            "(the verdict to the exit)": [],
            "CPU added (all processes)": [],
            "CPU added in the script's process (to its last line)": [],
        }
        for _ in range(repeat):
            name = f"bench-run-{uuid.uuid4().hex[:8]}"
            plain = time_script([sys.executable, script, name])
            run = time_script([*kvscope_command(), "run", "--dump-dir", d, script, name])
            rows["plain wall"].append(plain["exit"])
            rows["kvscope run wall"].append(run["exit"])
            rows["overhead (run - plain)"].append(run["exit"] - plain["exit"])
            rows["start: the script's first line later by"].append(run["first"] - plain["first"])
            rows["end: its last line to the exit, longer by"].append(
                (run["exit"] - run["last"]) - (plain["exit"] - plain["last"])
            )
            rows["(the verdict to the exit)"].append(run["exit"] - run["verdict"])
            rows["CPU added (all processes)"].append(run["cpu"] - plain["cpu"])
            rows["CPU added in the script's process (to its last line)"].append(
                run["cpu_script"] - plain["cpu_script"]
            )
    print(f"\nkvscope run of a short script, {repeat} interleaved pairs")
    print("| | median (s) | min (s) | max (s) |\n|---|---:|---:|---:|")
    for label, xs in rows.items():
        print(f"| {label} | {statistics.median(xs):.3f} | {min(xs):.3f} | {max(xs):.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--run-only", action="store_true", help="only the kvscope run rows")
    args = p.parse_args()
    # Every folder of the package (kvscope.probes and kvscope.kernels live in their own).
    root = os.path.dirname(os.path.dirname(kvscope.__file__))
    for folder in ("kvscope", "allocator", "probes", "kernels", "tui"):
        compileall.compile_dir(os.path.join(root, folder), quiet=1)
    print(f"load average {os.getloadavg()[0]:.1f}")
    bench_run(args.repeat)
    print(f"load average {os.getloadavg()[0]:.1f}")
    if args.run_only:
        return
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
