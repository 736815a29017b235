"""The host time of an example-server step, plainly and under `kvscope run` (guard mode, every
probe it switches on), without the model: what the probes add to each step where the host is
the bottleneck (serve.py --cuda-graphs on a fast GPU).

    python bench/bench_step_host.py [--requests 256] [--repeat 5] [--eager] [--deferred]
                                    [--time] [--profile FILE]
    python bench/bench_step_host.py --device cuda --profile FILE     # on a GPU

Each run is a process serving bench_serve.py's workload (256 requests at once, 70% behind one
of 10 shared 256-token system prompts, up to 128 running) through examples/server's engine,
scheduler and pool (1024 blocks of 16 tokens, one layer's K/V of 16 elements a slot, on the
CPU) with the step graphs' host path (`StepGraphs.forward`: the static buffers, the block-table
audit's expected table, the guard mode block states), but no model: each "graph replay" only
stores a constant into the step's slots (so guard mode's finish check sees its K/V written)
and the logits are zeros (every sampled token 0). With `--eager` the steps run as serve.py
without --cuda-graphs (the store per layer, the host tables and their audit), still without
attention. The stores' time is taken out of every figure (a GPU's work); a run whose pool holds
a finding at its end fails the bench. With `--attend` the model runs its attention layers
instead (the store and paged attention through kvscope.kernels, one head, no projections: the
step graphs captured and replayed, as serve.py's): what `--device cuda` runs, on a CUDA pool,
where the figures are the host's time with the GPU's work overlapping it.

The runs alternate plain / `kvscope run` (ABBA); prints µs per step of each run (the engine's
phases summed, wall clock; and the engine thread's CPU time, which other processes on a loaded
machine inflate less), the medians and spread, and the difference per phase (wall).
`--profile FILE`: one more run of each under cProfile, the top functions by own time written to
FILE.plain.txt and FILE.kvscope.txt (their raw statistics beside them, .txt.pstats). `--time`:
each run also adds up the engine thread's CPU time in the methods TIMED names (the probes' and
the pool's calls of a step), printed as µs per step, plain and under `kvscope run`. The CPU
pool's own K/V checks (the digest hashed on the host, the slot hashes of the provenance sweep,
the finish check's poison scan) are the GPU's work on a CUDA pool; the profile shows how much of
the difference they are. `--deferred`: the CPU pool's K/V checks go through the core's queue
of a CUDA pool's (devicechecks.DEFERRED_ON_CPU: each check a ring entry and an answer read back
at a settle, the answer computed at once on the host where a CUDA pool launches the kernel):
that queue's host path, with the checks and events it queues a step printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
_WORKER = "--worker"
# What `--time` times (module, class, method): where the probes' host time goes in a step, each
# call's CPU time on the engine's thread (a pool's appends are left out: 128 a step, the timing
# would cost more than most of them)
TIMED = [
    ("server.batch", "Batch", "check_writes"),
    ("kvscope.probes.stores", "Writers", "check"),
    ("kvscope.allocator.pool", "KVPool", "check_provenance"),
    ("kvscope.allocator.audit", "TableAudit", "expect"),
    ("kvscope.allocator.audit", "TableAudit", "answered"),
    ("kvscope.allocator.pool", "KVPool", "audit_block_table"),
    ("kvscope.allocator.pool", "KVPool", "block_state"),
    ("kvscope.allocator.pool", "KVPool", "allocate"),
    ("kvscope.allocator.pool", "KVPool", "mark_computed"),
    ("kvscope.allocator.pool", "KVPool", "mark_computed_many"),
    ("kvscope.allocator.pool", "KVPool", "free"),
    ("kvscope.allocator.pool", "KVPool", "stats"),
    # a CUDA pool's (or --deferred's) own: the settles of the device checks' answers at
    # allocations and frees, the audit's expected table written (TableAudit.expect's share)
    ("kvscope.allocator.devicechecks", "DeviceChecks", "settle"),
    ("kvscope.allocator.audit", "DeviceAudits", "expect"),
    # the step's publications (mark_computed_many and the Python around it), and the copies
    # to the host (the token picks'; under guard mode the error buffer's, queued at
    # ErrorCopy.flush, which a graph step's greedy picks join instead of a copy of their own)
    ("server.engine", "Engine", "_publish"),
    ("server.hostcopy", "HostCopy", "start"),
    ("server.violations", "ErrorCopy", "start"),
    ("server.violations", "ErrorCopy", "flush"),
    ("server.violations", "ErrorCopy", "take"),
]


def _worker(argv: list[str]) -> int:
    """One run: the engine without the model; prints its step figures as JSON."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attend", action="store_true")
    ap.add_argument("--profile", default="")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--deferred", action="store_true")
    args = ap.parse_args(argv)
    if args.deferred:
        from kvscope.allocator import devicechecks

        devicechecks.DEFERRED_ON_CPU = True
    # (a CUDA run's steps run the attention layers: its graphs are captured and replayed)
    attending = args.attend or args.device == "cuda"
    sys.path.insert(0, EXAMPLES)
    import torch
    from server.model import ModelConfig
    from server.runconfig import RunConfig, create_pool, make_engine, release_cache
    from server.steptime import PHASES
    from server.workload import WorkloadSpec, generate_workload

    from kvscope import kernels

    torch.set_num_threads(1)
    # the smallest K/V a slot can have: a CPU pool's core reads the K/V itself (digests, slot
    # hashes, poison scans), the GPU's work on a CUDA pool, kept to a few bytes a slot here
    shape = ModelConfig(
        vocab_size=1024, hidden_size=16, intermediate_size=16, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=16,
    )  # fmt: skip
    config = RunConfig(
        model_shape=shape, device=args.device, num_blocks=1024, block_size=16, max_num_seqs=128,
        max_num_batched_tokens=4096, prefill_chunk=512, clock="steps",
        cuda_graphs=not args.eager, pool_name=f"stephost-{os.getpid()}",
    )  # fmt: skip
    spec = WorkloadSpec(
        num_requests=args.requests, rate=0.0, prompt_len=(32, 256), output_len=(32, 192),
        num_prefixes=10, prefix_share=0.7, prefix_len=(256, 256),
    )  # fmt: skip
    requests = generate_workload(spec, shape.vocab_size)
    max_len = max(len(r.prompt) + r.max_tokens for r in requests)
    pool = create_pool(config)
    kv = pool.kv
    # a constant that is not the poison: every stored slot reads as written
    kv_heads, head_dim = shape.num_kv_heads, shape.head_dim
    row = torch.ones(1, kv_heads, head_dim, dtype=kv.dtype)
    # the attention layers' q, k and v (one head), sliced to a step's tokens
    qkv = torch.ones(config.max_num_batched_tokens, kv_heads, head_dim, dtype=kv.dtype,
                     device=kv.device)  # fmt: skip

    # seconds in the stores, wall and this thread's CPU: the GPU's work, taken out of the figures
    stored = [0.0, 0.0]

    def store(slots: torch.Tensor) -> None:
        """The step's K/V stores, every layer (what the model's attention does first)."""
        t, c = time.perf_counter(), time.thread_time()
        n = slots.shape[0]
        kv_rows = row.expand(n, kv_heads, head_dim)
        for layer in range(shape.num_layers):
            kernels.store_kv(kv_rows, kv_rows, kv[layer, 0], kv[layer, 1], slots, block_size=16)
        stored[0] += time.perf_counter() - t
        stored[1] += time.thread_time() - c

    class NoModel(torch.nn.Module):
        """The model's interface, computing nothing but the eager step's stores and tables (or,
        `attending`, its attention layers: the store and paged attention, no projections)."""

        def __init__(self) -> None:
            super().__init__()
            self.lm_head = torch.nn.Linear(1, 1, bias=False)

        def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
            if attending:
                x = qkv[: tokens.shape[0]]
                for layer in range(shape.num_layers):
                    attend(layer, x, x, x)
                return torch.zeros(tokens.shape[0], 1, device=tokens.device)
            batch = getattr(attend, "__self__", None)
            if batch is not None:  # the eager step: its stores, and the tables it would read
                store(batch.slot_mapping)
                if batch.num_prefills:
                    batch.prefill  # noqa: B018 (the host tables and their audit)
                if batch.num_prefills < len(batch.chunks):
                    batch.decode  # noqa: B018
            return torch.zeros(tokens.shape[0], 1)

        def logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return torch.zeros(hidden.shape[0], shape.vocab_size, device=hidden.device)

    class Replay:
        """A captured graph's replay: the step's stores from the static slot buffer."""

        def __init__(self, slots: torch.Tensor) -> None:
            self.slots = slots

        def replay(self) -> None:
            store(self.slots)

    model = NoModel().to(kv.device)
    engine = make_engine(config, model, pool, worker=0, max_len=max_len)
    graphs = engine.graphs
    if graphs is not None and not attending:
        rows = graphs.dev64.shape[1]
        keys = [("mixed", b) for b in graphs.buckets]
        keys += [("decode", n) for n in range(1, graphs.max_seqs + 1)]
        for kind, size in keys:
            graphs.graphs[(kind, size)] = (Replay(graphs.dev64[2, :size]), torch.zeros(rows, 1))
    timed, untime = _time_calls() if args.time else ({}, lambda: None)
    try:
        t, cpu = time.perf_counter(), time.thread_time()
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(engine.run, requests)
            prof.dump_stats(args.profile + ".pstats")
            with open(args.profile, "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(60)
        else:
            engine.run(requests)
        wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
        # (a run whose probes found something times their reports too: not the figure wanted)
        findings = [f"{f.kind} (block {f.block})" for f in pool.findings()]
        device = pool.core.device_stats()
    finally:
        untime()
        release_cache(config, pool)
    steps = engine.timer.num_steps
    phase_s = dict(engine.timer.phase_s)
    phase_s["launch"] -= stored[0]
    out = {
        "steps": steps,
        "us_per_step": 1e6 * sum(phase_s.values()) / steps,
        "wall_us_per_step": 1e6 * (wall - stored[0]) / steps,
        # the engine thread's CPU time: what a loaded machine's other processes do not inflate
        "cpu_us_per_step": 1e6 * (cpu - stored[1]) / steps,
        "store_us": 1e6 * stored[0] / steps,
        "phase_us": {p: 1e6 * phase_s[p] / steps for p in PHASES},
        "tokens": sum(len(o) for r in engine.results for o in r.outputs),
        "findings": findings,
        "calls": {k: [n, 1e6 * s / steps] for k, (n, s) in timed.items()},
        # the core's device-check queue (a CUDA pool's, or --deferred's): launches and events
        "launches": device["launched"] / steps if device else 0.0,
        "events": device["events"] / steps if device else 0.0,
    }
    print(json.dumps(out))
    return 0


def _time_calls() -> tuple[dict[str, list], Callable[[], None]]:
    """TIMED's methods wrapped: each call's CPU time on this thread added up, by name ([calls,
    seconds]; a call inside another timed one counts in both); and what puts them back."""
    import importlib

    out: dict[str, list] = {}
    saved: list[tuple[Any, str, Any]] = []
    for module, cls, name in TIMED:
        owner = getattr(importlib.import_module(module), cls)
        real, key = owner.__dict__[name], f"{cls}.{name}"
        saved.append((owner, name, real))
        out[key] = [0, 0.0]

        def timed(*a, _real=real, _acc=out[key], **k):
            t = time.thread_time()
            try:
                return _real(*a, **k)
            finally:
                _acc[0] += 1
                _acc[1] += time.thread_time() - t

        setattr(owner, name, timed)

    def undo() -> None:
        for owner, name, real in saved:
            setattr(owner, name, real)

    return out, undo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5, help="pairs of runs")
    ap.add_argument("--eager", action="store_true", help="serve.py without --cuda-graphs")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--attend", action="store_true",
        help="run the attention layers (the store, paged attention); always with --device cuda",
    )  # fmt: skip
    ap.add_argument("--profile", default="", help="also profile one run of each (FILE.*.txt)")
    ap.add_argument(
        "--time", action="store_true",
        help="also time each run's calls of the methods TIMED names (CPU µs per step)",
    )  # fmt: skip
    ap.add_argument(
        "--deferred", action="store_true",
        help="the CPU pool's K/V checks queued as a CUDA pool's (devicechecks.DEFERRED_ON_CPU:"
        " the core's queue, answered at once on the host, in place of a launch)",
    )  # fmt: skip
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    for flag in ("requests", "repeat"):
        if getattr(args, flag) < 1:
            print(
                f"bench_step_host.py: error: --{flag} must be 1 or more (got {getattr(args, flag)})",
                file=sys.stderr,
            )
            return 2
    worker = [sys.executable, os.path.abspath(__file__), _WORKER, "--requests", str(args.requests)]
    worker += ["--eager"] if args.eager else []
    worker += ["--device", args.device] + (["--attend"] if args.attend else [])
    worker += ["--time"] if args.time else []
    worker += ["--deferred"] if args.deferred else []
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "plain": worker,
            "kvscope run": [sys.executable, "-m", "kvscope", "run", "--dump-dir", tmp, *worker[1:]],
        }
        out: dict[str, list[dict]] = {k: [] for k in runs}
        for rep in range(args.repeat):
            for name in list(runs)[:: 1 if rep % 2 == 0 else -1]:  # ABBA: drift favours neither
                figures = _run(name, runs[name])
                if figures is None:
                    return 1
                out[name].append(figures)
                print(
                    f"{name}: {figures['us_per_step']:.0f} µs/step, CPU"
                    f" {figures['cpu_us_per_step']:.0f} ({figures['steps']} steps,"
                    f" {figures['launches']:.2f} checks and {figures['events']:.2f} events"
                    " a step)",
                    flush=True,
                )
        if args.profile:
            for name, tag in (("plain", "plain"), ("kvscope run", "kvscope")):
                path = os.path.abspath(f"{args.profile}.{tag}.txt")
                if _run(name, [*runs[name], "--profile", path]) is None:
                    return 1
                print(f"profile of {name}: {path}")
    for key, clock in (("us_per_step", "wall"), ("cpu_us_per_step", "CPU")):
        per = {k: [f[key] for f in v] for k, v in out.items()}
        for name, values in per.items():
            print(
                f"{name}: median {statistics.median(values):.0f} µs/step, {clock}"
                f" (spread {min(values):.0f}-{max(values):.0f}, {len(values)} runs)"
            )
        diffs = [b - a for a, b in zip(per["plain"], per["kvscope run"], strict=True)]
        print(
            f"probes add: median {statistics.median(diffs):.0f} µs/step, {clock}"
            f" (each pair: {' '.join(f'{d:.0f}' for d in diffs)})"
        )
    print("µs per step, medians: phase  plain  kvscope run  difference")
    for p in out["plain"][0]["phase_us"]:
        a, b = (statistics.median(f["phase_us"][p] for f in out[k]) for k in runs)
        print(f"  {p:<10} {a:8.1f} {b:8.1f} {b - a:+8.1f}")
    if args.time:
        print("CPU µs per step in each method (calls per step), medians: plain  kvscope run")
        for name in out["plain"][0]["calls"]:
            a, b = (statistics.median(f["calls"][name][1] for f in out[k]) for k in runs)
            n = out["kvscope run"][0]["calls"][name][0] / out["kvscope run"][0]["steps"]
            print(f"  {name:<28} {a:8.1f} {b:8.1f}  ({n:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


def _run(name: str, cmd: list[str]) -> dict | None:
    """One run's figures (None, said on stderr, when it failed)."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if figures["findings"]:
        print(f"{name}: the probes found {', '.join(figures['findings'])}", file=sys.stderr)
        return None
    return figures


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == _WORKER:
        sys.exit(_worker(sys.argv[2:]))
    sys.exit(main())
