"""The example server on the GPU: paged pool vs static reservation, prefix sharing on vs off.

    python bench/bench_serve.py --device cuda          # on the H200 (docs/BENCHMARKS.md)
    python bench/bench_serve.py --device cpu --quick   # smoke test
    python bench/bench_serve.py --mixes --device cuda  # the prefix-sharing report's table
    python bench/bench_serve.py --mixes --score --short --baseline hf --table --device cuda
    python bench/bench_serve.py --mixes --memory --baseline hf --table --device cuda
    python bench/bench_serve.py --mixes --score --choices 4 --table --device cuda

(`--mixes`: bench/serve_mixes.py; `--baseline hf`: bench/bench_serve_hf.py.) `--mixes` alone
serves each case on a fresh 8 GiB pool; with a request shape (`--score`, `--short`,
`--shape`), `--baseline hf`, `--memory`, `--clients`, `--repeat` or `--table` every case runs
on one pool (1024 blocks; `--memory a100`: the KV budget an A100 40GB leaves beside
Llama-2-7B's fp16 weights, 2,873 blocks of 16 tokens, the same blocks for the tiny model) whose
cached blocks are evicted between cases, and the step graphs are captured once; `--memory`
(report) gives each mix and request shape a pool of its own, of the budget that holds 9 of its
requests without sharing (the report's 9 of 12 streams). `--choices N`: the score shape as
lm-eval-harness's multiple-choice tasks send it, each question one prompt scored against N
continuations (N requests; requests/s, `--requests` and `--clients` count requests). `--table`
prints the table as the report prints it (baseline and shared requests/s, K/V held, TTFT p95 per
mix and request shape), then the full tables (every figure, the memory regime's). With
`--device cpu --quick` every command runs on the tiny model on the CPU (`--step-clock`: the
engine's figures the same on every machine).

A random-weight Llama checkpoint (~110M parameters) is written to a temporary directory; the
same seeded workload (256 requests arriving at once, 70% behind one of 10 shared 256-token
system prompts) is served three ways, each in its own process, and the summaries are printed
side by side. Each case is served once with 8 requests first, so that Triton's one-time kernel
compilation is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
sys.path.insert(0, EXAMPLES)


def write_model(directory: str, quick: bool) -> None:
    from pathlib import Path

    from server.checkpoint import save_model, tiny_model
    from server.model import ModelConfig

    cfg = (
        ModelConfig(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
        )
        if quick
        else ModelConfig(
            vocab_size=8192,
            hidden_size=1024,
            intermediate_size=2816,
            num_layers=8,
            num_heads=16,
            num_kv_heads=4,
            head_dim=64,
        )
    )
    save_model(tiny_model(seed=0, config=cfg), Path(directory))


def run_arguments(doc: str | None, repeat: int) -> argparse.ArgumentParser:
    """The arguments of the benchmarks that serve this workload plainly and under `kvscope run`
    (bench_serve_run.py, bench_serve_probes.py)."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="the tiny model")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=repeat)
    return ap


def with_requests(cmd: list[str], n: int) -> list[str]:
    """A serve command line with `--requests n` instead (a short warm-up run of it)."""
    i = cmd.index("--requests") + 1
    return [*cmd[:i], str(n), *cmd[i + 1 :]]


def serve_command(
    model: str | None, device: str, extra: list[str], quick: bool, n: str = ""
) -> list[str]:
    """The examples/serve.py command line of this benchmark's workload."""
    n = n or ("32" if quick else "256")
    return [
        sys.executable,
        os.path.join(EXAMPLES, "serve.py"),
        *(["--model", model] if model else []),
        "--device",
        device,
        "--json",
        "--no-progress",
        "--requests",
        n,
        "--rate",
        "0",
        "--prompt-len",
        "32:256",
        "--output-len",
        "32:192",
        "--num-prefixes",
        "10",
        "--prefix-share",
        "0.7",
        "--prefix-len",
        "256:256",
        "--num-blocks",
        "64" if quick else "1024",
        "--block-size",
        "16",
        "--max-num-seqs",
        "128",
        "--max-batched-tokens",
        "4096",
        "--prefill-chunk",
        "512",
        *extra,
    ]


def serve(model: str | None, device: str, extra: list[str], quick: bool, n: str = "") -> dict:
    cmd = serve_command(model, device, extra, quick, n)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny model, 32 requests")
    ap.add_argument(
        "--tiny", action="store_true", help="the built-in tiny model on the full workload"
    )
    ap.add_argument("--json", help="also write the raw summaries here")
    ap.add_argument(
        "--mixes", action="store_true", help="the prefix-sharing table: 3 mixes x sharing on/off"
    )
    ap.add_argument("--requests", type=int, default=192, help="--mixes: requests per case")
    ap.add_argument(
        "--cuda-graphs",
        choices=["off", "on", "both"],
        default="off",
        help="--mixes: replay steps (decode and prompt chunks) as CUDA graphs",
    )
    ap.add_argument(
        "--only-profile",
        type=int,
        default=0,
        metavar="N",
        help="--mixes: no table; profile N requests of one mix (--mix, default top-10) in one "
        "request shape (--shape, --score or --short; default generate), sharing on, instead",
    )
    r = ap.add_argument_group(
        "--mixes: the report's regime (one pool for every case; --memory: one per mix and shape)"
    )
    r.add_argument(
        "--shape", default="", help="request shapes, comma-separated: generate, short, score"
    )
    r.add_argument("--score", action="store_true", help="scoring requests (loglikelihood)")
    r.add_argument(
        "--choices",
        type=int,
        default=1,
        metavar="N",
        help="the score shape as lm-eval-harness's multiple-choice tasks send it (2-5 choices; "
        "e.g. 4): each question is one prompt scored against N continuations, N requests "
        "side by side in the queue; --requests, --clients and requests/s count requests "
        "(choices), so 12 clients run 3 questions of 4 at once (default 1: one continuation "
        "per prompt)",
    )
    r.add_argument("--short", action="store_true", help="short generations (1-4 tokens)")
    r.add_argument("--baseline", choices=["hf"], help="also serve with Hugging Face Transformers")
    r.add_argument(
        "--memory",
        nargs="?",
        const="report",
        choices=["report", "a100"],
        help="the memory regime at 12, 16, 24, 32 clients (or --clients). report (the default): each mix "
        "and shape on a KV budget that holds 9 of its requests without sharing, as the report's "
        "budget ran 9 of its 12 streams (9 x (the mean request's blocks at its end + 1 block "
        "of headroom)); a100: the literal budget an A100 40GB leaves beside Llama-2-7B's fp16 "
        "weights, 2,873 blocks of 16 tokens (22.45 GiB of its K/V; the same blocks, so the same "
        "tokens, for another model such as --quick's); it holds hundreds of the mixes' requests: "
        "it never binds. The output names both budgets",
    )
    r.add_argument("--mix", default="", help="mixes, comma-separated (default all three)")
    r.add_argument("--clients", default="", help="client counts, comma-separated (default 12)")
    r.add_argument("--num-blocks", type=int, default=0, help="the pool's blocks (overrides)")
    r.add_argument("--repeat", type=int, default=1, help="serve every case this many times")
    r.add_argument(
        "--table",
        action="store_true",
        help="print the table as the report prints it (Markdown: per mix and request shape, "
        "baseline and shared requests/s, K/V held, TTFT p95), then the full tables",
    )
    r.add_argument("--hf-requests", type=int, default=24, help="requests Transformers serves")
    r.add_argument(
        "--hf-ways", default="threads,batches", help="Transformers' ways: threads, batches"
    )
    r.add_argument("--check", type=int, default=4, help="requests compared with Transformers")
    r.add_argument(
        "--step-clock",
        action="store_true",
        help="the engine on a virtual clock (server.engine.StepClock, 5 ms a step): the same "
        "figures on every machine; the means weigh every step the same, requests/s and TTFT "
        "are in virtual seconds (requests per step: a step that computes a few tokens counts "
        "as much as one that computes thousands)",
    )
    args = ap.parse_args(argv)
    problem = _arguments_problem(args)
    if problem:
        print(f"bench_serve.py: error: {problem}", file=sys.stderr)
        return 2
    if args.mixes and args.only_profile:
        return _mixes(args)
    if args.mixes and (
        any(getattr(args, name) for name in REPORT_OPTIONS) or args.repeat > 1 or args.choices > 1
    ):
        return _report(args)
    if args.mixes:
        return _mixes(args)
    cases = {
        "paged + prefix sharing": [],
        "paged, prefix sharing off": ["--no-prefix-cache"],
        "static reservation (max_len)": ["--baseline", "static"],
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = None if args.tiny else tmp
        if model:
            write_model(model, args.quick)
        # Warm-up: Triton compiles each kernel variant once (cached on disk for later processes).
        for extra in cases.values():
            serve(model, args.device, extra, args.quick, n="8")
        results = {
            name: serve(model, args.device, extra, args.quick) for name, extra in cases.items()
        }
    keys = [
        ("output tokens/s", "output_tokens_per_s", "{:,.0f}"),
        ("KV utilization", "kv_utilization", "{:.1%}"),
        ("internal fragmentation", "internal_fragmentation", "{:.1%}"),
        ("peak concurrent requests", "peak_concurrent_requests", "{}"),
        ("KV slots per running request", "kv_slots_per_request", "{:.0f}"),
        ("prompt tokens cached", "prefix_hit_rate", "{:.1%}"),
        ("preemptions", "preemptions", "{}"),
        ("duration (s)", "duration_s", "{:.2f}"),
    ]
    print("| metric | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for label, key, fmt in keys:
        print(
            f"| {label} | "
            + " | ".join(fmt.format(r.get(key, float("nan"))) for r in results.values())
            + " |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


# the report regime's options (a run with any of them set is a report run: _report)
REPORT_OPTIONS = (
    "shape", "score", "short", "baseline", "memory", "clients", "mix", "table", "num_blocks",
    "step_clock",
)  # fmt: skip
HF_WAYS = ("threads", "batches")
# those `--only-profile` takes (one mix, one request shape)
PROFILE_OPTIONS = ("mix", "shape", "score", "short")


def _shapes(args: argparse.Namespace) -> list[str]:
    """The request shapes asked for, in serve_mixes.SHAPES' order (default: generate)."""
    import serve_mixes

    shapes = [x for x in args.shape.split(",") if x]
    shapes += [x for x, on in (("short", args.short), ("score", args.score)) if on]
    return [x for x in serve_mixes.SHAPES if x in shapes] or ["generate"]


def _arguments_problem(args: argparse.Namespace) -> str:
    """What is wrong with the arguments, in a line ('' when nothing is)."""
    import serve_mixes

    if not args.mixes:
        given = [name for name in (*REPORT_OPTIONS, "only_profile") if getattr(args, name)]
        given += [
            name
            for name, default in (("choices", 1), ("repeat", 1), ("cuda_graphs", "off"))
            if getattr(args, name) != default
        ]
        return f"--{given[0].replace('_', '-')} needs --mixes" if given else ""
    for flag, text, known in (
        ("--mix", args.mix, serve_mixes.MIXES),
        ("--shape", args.shape, serve_mixes.SHAPES),
        ("--hf-ways", args.hf_ways, HF_WAYS),
    ):
        unknown = [x for x in text.split(",") if x and x not in known]
        if unknown:
            return f"{flag}: {unknown[0]!r} is none of {', '.join(known)}"
    if not any(args.hf_ways.split(",")):
        return f"--hf-ways: name one or more of {', '.join(HF_WAYS)}"
    for x in args.clients.split(",") if args.clients else []:
        if not x.isdigit() or int(x) < 1:
            return f"--clients: {x!r} is not a client count (1 or more)"
    for flag, value, least in (
        ("--requests", args.requests, 1),
        ("--repeat", args.repeat, 1),
        ("--choices", args.choices, 1),
        ("--hf-requests", args.hf_requests, 1),
        ("--check", args.check, 0),
        ("--num-blocks", args.num_blocks, 0),
        ("--only-profile", args.only_profile, 0),
    ):
        if value < least:
            return f"{flag} must be {least} or more (got {value})"
    shapes = args.shape.split(",") + ["score"] * args.score
    if args.only_profile:
        others = [n for n in REPORT_OPTIONS if getattr(args, n) and n not in PROFILE_OPTIONS]
        if others or args.choices != 1 or args.repeat != 1:
            flag = others[0] if others else ("choices" if args.choices != 1 else "repeat")
            return f"--only-profile takes --mix and a request shape, not --{flag.replace('_', '-')}"
        if len([x for x in args.mix.split(",") if x]) > 1:
            return "--only-profile: one mix (--mix)"
        if len(_shapes(args)) > 1:
            return "--only-profile: one request shape (--shape, --score or --short)"
    if args.choices > 1 and "score" not in shapes:
        return "--choices needs the score shape (--score)"
    return ""


def _mixes(args: argparse.Namespace) -> int:
    """`--mixes`: the table, or (`--only-profile N`) where a step's time goes."""
    import datetime
    import platform

    import serve_mixes
    import torch

    graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graphs]
    model = serve_mixes.build_model(args.device, args.quick)
    results: dict = {"cases": []}
    if not args.only_profile:
        results = serve_mixes.run_mixes(model, args.device, args.requests, graphs)
    results["machine"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "model": "tiny" if args.quick else "llama2-7b shape, random fp16",
    }
    if args.only_profile:
        mix, (shape,) = args.mix or "top-10", _shapes(args)
        results["profiles"] = [
            serve_mixes.profile_case(model, args.device, g, args.only_profile, mix, shape)
            for g in graphs
        ]
        for p in results["profiles"]:
            shown = {k: v for k, v in p.items() if k not in ("top_kernels", "cprofile_tottime")}
            print(json.dumps(shown, indent=1))
            print(p.get("top_kernels", ""))
            print(p["cprofile_tottime"][:6000])
    else:
        print(serve_mixes.render(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _report(args: argparse.Namespace) -> int:
    """`--mixes` in the report's regime: request shapes, Transformers beside, the memory
    regime, the report's table."""
    import serve_mixes

    shapes = _shapes(args)
    if args.clients:
        clients = [int(x) for x in args.clients.split(",")]
    else:
        clients = list(serve_mixes.MEMORY_CLIENTS) if args.memory else [serve_mixes.CLIENTS]
    model = serve_mixes.build_model(args.device, args.quick)
    num_blocks = args.num_blocks or (
        serve_mixes.a100_blocks() if args.memory == "a100" else serve_mixes.DEFAULT_BLOCKS
    )
    budget = "report" if args.memory == "report" and not args.num_blocks else "fixed"
    clock = None
    if args.step_clock:
        from server.engine import StepClock

        clock = StepClock
    hf = None
    if args.baseline == "hf":
        from bench_serve_hf import HFBaseline

        hf = HFBaseline(model)
    results = serve_mixes.run_report(
        model, args.device, shapes=shapes, clients=clients, num_blocks=num_blocks,
        num_requests=args.requests, repeat=args.repeat, graphs=args.cuda_graphs != "off",
        hf=hf, hf_requests=args.hf_requests, check=args.check,
        mixes=tuple(x for x in serve_mixes.MIXES if x in args.mix.split(",")) or serve_mixes.MIXES,
        hf_ways=tuple(args.hf_ways.split(",")), budget=budget, clock=clock,
        choices=args.choices,
    )  # fmt: skip
    results["machine"] = _machine(args)
    if args.table:
        summary, full = serve_mixes.render_summary(results), serve_mixes.render_report(results)
        print(f"{summary}\n\n{full}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _machine(args: argparse.Namespace) -> dict[str, str]:
    """Where and when a `--mixes` run ran."""
    import datetime
    import platform

    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "model": "tiny" if args.quick else "llama2-7b shape, random fp16",
    }


if __name__ == "__main__":
    sys.exit(main())
