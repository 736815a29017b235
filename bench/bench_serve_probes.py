"""Where `kvscope run`'s cost goes in examples/serve.py: plainly, under `kvscope run`, and under
`kvscope run` with guard mode, the digest probe or both switched off, interleaved; with
`--time-checks` one more run times the frees (`KVPool.free`, one call into the C core, which
runs guard mode's finish check in it; the core's own checks call no Python: docs/BENCHMARKS.md,
"Probes on a CUDA pool").

    python bench/bench_serve_probes.py --device cuda --requests 128 --repeat 2 --time-checks

The model and workload are bench_serve.py's; one 8-request warm-up of each variant first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve  # noqa: E402

# Run as `kvscope run bench_serve_probes.py --timed-serve serve.py ...`: serve.py with the
# frees (and their finish checks) timed, the totals printed to stderr at exit.
_TIMED = "--timed-serve"


def _timed_serve(argv: list[str]) -> None:
    import atexit
    import runpy
    import time
    from collections import defaultdict

    from kvscope.allocator import pool

    stats: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                s = stats[name]
                s[0] += 1
                s[1] += time.perf_counter() - t

        return call

    for name in ("free",):
        setattr(pool.KVPool, name, timed(name, getattr(pool.KVPool, name)))

    def report() -> None:  # at exit: the totals of the whole run
        totals = {k: {"calls": int(v[0]), "seconds": round(v[1], 3)} for k, v in stats.items()}
        print("CHECKS", json.dumps(totals), file=sys.stderr)

    atexit.register(report)
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    ap = bench_serve.run_arguments(__doc__, repeat=2)
    ap.add_argument("--time-checks", action="store_true", help="one more run, frees timed")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        bench_serve.write_model(tmp, args.quick)
        cmd = bench_serve.serve_command(tmp, args.device, [], args.quick, str(args.requests))
        run = [sys.executable, "-m", "kvscope", "run", "--dump-dir", tmp]
        variants: dict[str, tuple[list[str], dict[str, str]]] = {
            "plain": (cmd, {}),
            "kvscope run": (run + cmd[1:], {}),
            "kvscope run, no digest": (run + cmd[1:], {"KVSCOPE_DIGEST": "0"}),
            "kvscope run --no-guard": (run + ["--no-guard"] + cmd[1:], {}),
            "kvscope run --no-guard, no digest": (
                run + ["--no-guard"] + cmd[1:],
                {"KVSCOPE_DIGEST": "0"},
            ),
        }
        if args.time_checks:
            me = os.path.abspath(__file__)
            variants["kvscope run, checks timed"] = (run + [me, _TIMED] + cmd[1:], {})
        for c, env in variants.values():
            warm = bench_serve.with_requests(c, 8)
            subprocess.run(warm, capture_output=True, check=True, env={**os.environ, **env})
        for _ in range(args.repeat):
            for name, (c, env) in variants.items():
                done = subprocess.run(c, capture_output=True, text=True, env={**os.environ, **env})
                if done.returncode != 0:
                    print(f"{name}: exit {done.returncode}\n{done.stderr[-2000:]}", file=sys.stderr)
                    return 1
                out = json.loads(done.stdout)
                checks = [ln[7:] for ln in done.stderr.splitlines() if ln.startswith("CHECKS ")]
                print(
                    f"{name}: {out['output_tokens_per_s']:.1f} output tokens/s,"
                    f" {out['duration_s']:.2f} s", *checks, flush=True
                )  # fmt: skip
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _TIMED:
        _timed_serve(sys.argv[2:])
    else:
        sys.exit(main())
