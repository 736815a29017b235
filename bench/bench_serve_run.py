"""examples/serve.py plainly and under `kvscope run` (every probe it switches on), interleaved:
the output tokens/s of each, and the ratio (docs/BENCHMARKS.md, "serve.py under kvscope run").

    python bench/bench_serve_run.py --device cuda --requests 256 --repeat 6   # on the H200
    python bench/bench_serve_run.py --device cuda --requests 256 --repeat 6 --cuda-graphs
    python bench/bench_serve_run.py --device cpu --quick --repeat 1          # smoke test

The model and workload are bench_serve.py's (a random-weight ~110M-parameter Llama; `--quick`:
its tiny model); one 8-request warm-up of each first, so that Triton's compilation is not counted.
The pairs alternate their order; with runs of a few seconds on a shared host a single pair's
ratio moves by a fifth, so the median of six or more pairs is the figure to read.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serve  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = bench_serve.run_arguments(__doc__, repeat=3)
    ap.add_argument("--cuda-graphs", action="store_true", help="serve.py --cuda-graphs, both runs")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        bench_serve.write_model(tmp, args.quick)
        extra = ["--cuda-graphs"] if args.cuda_graphs else []
        cmd = bench_serve.serve_command(tmp, args.device, extra, args.quick, str(args.requests))
        runs = {
            "plain": cmd,
            "kvscope run": [sys.executable, "-m", "kvscope", "run", "--dump-dir", tmp, *cmd[1:]],
        }
        for c in runs.values():  # Triton's compilations (the probes' kernels too) into its cache
            subprocess.run(bench_serve.with_requests(c, 8), capture_output=True, check=True)
        out: dict[str, list[float]] = {k: [] for k in runs}
        # the engine thread's host ms per step and phase (serve.py's extra.step_phase_ms)
        phases: dict[str, list[dict[str, float]]] = {k: [] for k in runs}
        for rep in range(args.repeat):
            # each pair in the other order than the last (ABBA): drift on a shared host
            # favours neither
            for name in list(runs)[:: 1 if rep % 2 == 0 else -1]:
                c = runs[name]
                done = subprocess.run(c, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{name}: exit {done.returncode}\n{done.stderr[-2000:]}", file=sys.stderr)
                    return 1
                summary = json.loads(done.stdout)
                out[name].append(summary["output_tokens_per_s"])
                phases[name].append(summary.get("extra", {}).get("step_phase_ms", {}))
                print(f"{name}: {out[name][-1]:.1f} output tokens/s", flush=True)
    med = {k: _median(v) for k, v in out.items()}
    print(f"median: plain {med['plain']:.1f}, kvscope run {med['kvscope run']:.1f} output tokens/s"
          f" ({med['kvscope run'] / med['plain']:.2f}x)")  # fmt: skip
    pairs = [r / p for p, r in zip(out["plain"], out["kvscope run"])]
    print(
        "each pair: " + " ".join(f"{x:.2f}x" for x in pairs)
        + f" (median {_median(pairs):.2f}x; spread {min(pairs):.2f}-{max(pairs):.2f}x: a run's"
        " noise, on a shared host)"
    )  # fmt: skip
    names = sorted({p for runs_ in phases.values() for r in runs_ for p in r})
    if names:
        print("host ms per step, medians: phase  plain  kvscope run  difference")
        for p in names:
            a, b = (_median([r.get(p, 0.0) for r in phases[k]]) for k in runs)
            print(f"  {p:<10} {a:7.3f} {b:7.3f} {b - a:+7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"output_tokens_per_s": out, "step_phase_ms": phases}, f)
    return 0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


if __name__ == "__main__":
    sys.exit(main())
