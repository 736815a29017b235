"""The example server on the GPU: paged pool vs static reservation, prefix sharing on vs off.

    python bench/bench_serve.py --device cuda          # on the H200 (docs/BENCHMARKS.md)
    python bench/bench_serve.py --device cpu --quick   # smoke test
    python bench/bench_serve.py --mixes --device cuda  # the prefix-sharing report's table

(`--mixes`: bench/serve_mixes.py.)

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
        help="--mixes: no table; profile N requests of the top-10 mix instead",
    )
    args = ap.parse_args(argv)
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
        results["profiles"] = [
            serve_mixes.profile_case(model, args.device, g, args.only_profile) for g in graphs
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


if __name__ == "__main__":
    sys.exit(main())
