"""The serving loop's instructions under `kvscope run`'s probes against the loop run plainly,
counted by callgrind: the one figure a loaded 2-core machine gives the same twice (to about
0.4%), where bench_loop_run's timed rounds move by half.

    python bench/bench_loop_callgrind.py                     # 1,000 steps after 1,000, ~10 min
    python bench/bench_loop_callgrind.py --steps 200 --warm 200 --top 15   # quick

Needs valgrind (with its headers: valgrind/callgrind.h), callgrind_annotate and a C compiler.
Each configuration is one process under `valgrind --tool=callgrind` that runs
bench_serving_loop's `Loop` (64 running sequences, one append each per step, a finished one
published and freed, a new request admitted) over a pool of 4,096 blocks of 16 tokens, as
bench_loop_run's script does: `--warm` steps uncounted, then `--steps` steps counted, counting
switched on and off around them with callgrind's client requests (a small library compiled
here, called through ctypes). `plain` runs the script as `python script.py`; `run` runs it
as `kvscope run` starts its child (`python -m kvscope.bootstrap`, with the environment
kvscope/verbs/run.py `child_env` gives: guard mode, lockdep, events, slot provenance of every
sequence, every light probe).

Under valgrind the loop runs about 50 times slower, so the magic probe's check every 10 ms of
the core's clock (csrc/core.h VERIFY_EVERY_NS; with the leaks probe it reads every block
record) runs about once a step instead of about once in 50: its instructions (`verify_now`,
inclusive) are printed apart, and the excess without them is the figure to compare. Prints
each configuration's instructions, the excess of `run` over `plain`, and with `--top N` the N
functions whose own instructions grew the most and the N that shrank the most.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))

# What the counted span switches (valgrind/callgrind.h's client requests are C macros: no
# Python binding exists, so a two-function library is compiled for the run).
TOGGLE_C = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION;
                      CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS;
                     CALLGRIND_STOP_INSTRUMENTATION; }
"""


def child(steps: int, warm: int, toggle: str) -> None:
    """The counted script: the loop, `warm` steps, then `steps` steps between the toggles."""
    import ctypes

    sys.path.insert(0, HERE)
    from bench_serving_loop import Loop

    from kvscope.allocator import KVPool, PoolConfig

    lib = ctypes.CDLL(toggle)
    cfg = PoolConfig(
        num_blocks=4096, block_size=16, num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16"
    )
    pool = KVPool.create(f"cg-{uuid.uuid4().hex[:8]}", cfg)
    try:
        loop = Loop(pool, 0)
        for _ in range(warm):
            loop.step()
        ops = loop.ops
        lib.cg_start()
        for _ in range(steps):
            loop.step()
        lib.cg_stop()
        print(f"ops {loop.ops - ops}", flush=True)
        loop.finish()
    finally:
        pool.close()
        pool.unlink()


def run_env(run_dir: str) -> dict[str, str]:
    """The environment `kvscope run script.py` gives its child, as it comes."""
    from kvscope.cli import build_parser
    from kvscope.verbs.run import child_env

    args = build_parser("run").parse_args(["run", "script.py"])
    return child_env(dict(os.environ), run_dir, args)


def count(config: str, steps: int, warm: int, work: str, toggle: str) -> dict[str, int]:
    """Instructions per function (own, and `verify_now` inclusive) of one configuration."""
    out = os.path.join(work, f"{config}.out")
    me = os.path.abspath(__file__)
    target = [me, "--child", str(steps), str(warm), toggle]
    if config == "run":
        run_dir = os.path.join(work, "run")
        os.makedirs(run_dir, exist_ok=True)
        env, cmd = run_env(run_dir), [sys.executable, "-m", "kvscope.bootstrap", *target]
    else:
        env, cmd = dict(os.environ), [sys.executable, *target]
    env["PYTHONHASHSEED"] = "0"
    vg = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        f"--callgrind-out-file={out}.%p",
    ]
    p = subprocess.run(vg + cmd, env=env, capture_output=True, text=True)
    if config == "run":
        # No supervisor runs here: remove what the script's unlink renamed aside for one to
        # read (the run directory's `unlinks`), as `kvscope run` does after a run.
        unlinks = os.path.join(run_dir, "unlinks")
        lines = open(unlinks).read().splitlines() if os.path.exists(unlinks) else []
        for aside in (line.split("\t")[-1] for line in lines):
            for path in (aside, aside + ".data"):
                if os.path.exists(path):
                    os.unlink(path)
    if p.returncode != 0:
        sys.exit(f"bench_loop_callgrind: {config} failed:\n{p.stderr[-2000:]}")
    files = [os.path.join(work, f) for f in os.listdir(work) if f.startswith(f"{config}.out.")]
    # the dump at cg_stop (callgrind writes `.N` parts for CALLGRIND_DUMP_STATS)
    dumps = [f for f in files if re.search(r"\.\d+\.\d+$", f)] or files
    own = annotate(max(dumps, key=os.path.getsize), inclusive=False)
    incl = annotate(max(dumps, key=os.path.getsize), inclusive=True)
    own["(verify_now, inclusive)"] = incl.get("verify_now", 0)
    ops = re.search(r"^ops (\d+)", p.stdout, re.M)
    own["(ops)"] = int(ops.group(1)) if ops else 0
    return own


def annotate(path: str, inclusive: bool) -> dict[str, int]:
    """callgrind_annotate's instructions per function name: own instructions summed over the
    source files they were inlined from; inclusive ones the largest of a name's lines (each
    line of an inlined part repeats its function's inclusive cost)."""
    text = subprocess.run(
        [
            "callgrind_annotate",
            "--threshold=100",
            f"--inclusive={'yes' if inclusive else 'no'}",
            path,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    total = re.search(r"^\s*([\d,]+) \([^)]*\)\s+PROGRAM TOTALS", text, re.M)
    out = {"(total)": int(total.group(1).replace(",", "")) if total else 0}
    for line in text.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S+?)(?: \[.*\])?$", line)
        if m and "PROGRAM" not in line:
            fn = m.group(2).split(":")[-1]
            n = int(m.group(1).replace(",", ""))
            out[fn] = max(out.get(fn, 0), n) if inclusive else out.get(fn, 0) + n
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1000, help="steps counted (default 1000)")
    ap.add_argument("--warm", type=int, default=1000, help="steps before them (default 1000)")
    ap.add_argument("--top", type=int, default=0, help="the N functions that grew the most")
    ap.add_argument("--keep", metavar="DIR", help="keep callgrind's files in DIR")
    args = ap.parse_args()
    for tool in ("valgrind", "callgrind_annotate", "cc"):
        if shutil.which(tool) is None:
            sys.exit(f"bench_loop_callgrind: needs {tool} (apt-get install valgrind gcc)")
    with tempfile.TemporaryDirectory(prefix="kvscope-cg-") as tmp:
        work = args.keep or tmp
        os.makedirs(work, exist_ok=True)
        toggle = os.path.join(work, "libcgtoggle.so")
        src = os.path.join(work, "cgtoggle.c")
        with open(src, "w") as f:
            f.write(TOGGLE_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", toggle, src], check=True)
        counts = {}
        for config in ("plain", "run"):
            print(f"counting {config} ({args.warm} + {args.steps} steps) ...", file=sys.stderr)
            counts[config] = count(config, args.steps, args.warm, work, toggle)
    plain, run = counts["plain"]["(total)"], counts["run"]["(total)"]
    verify = counts["run"]["(verify_now, inclusive)"]
    excess = run - verify - plain
    ops = counts["plain"]["(ops)"]
    print(f"plain: {plain:,} instructions over {args.steps} steps ({ops:,} pool operations)")
    print(
        f"kvscope run: {run:,} (of them the magic probe's periodic check, verify_now: {verify:,})"
    )
    print(f"excess without verify_now: {excess:+,} ({excess / plain:+.1%})")
    if args.top:
        a, b = counts["plain"], counts["run"]
        names = [k for k in set(a) | set(b) if not k.startswith("(")]
        names.sort(key=lambda k: -(b.get(k, 0) - a.get(k, 0)))
        print(f"\n{'grew by':>14} {'plain':>14} {'kvscope run':>14}  function (own instructions)")
        for k in names[: args.top] + ["..."] + names[-args.top :]:
            if k == "...":
                print(f"{'...':>14}")
                continue
            print(f"{b.get(k, 0) - a.get(k, 0):>14,} {a.get(k, 0):>14,} {b.get(k, 0):>14,}  {k}")


if __name__ == "__main__":
    main()
