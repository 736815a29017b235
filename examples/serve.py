"""Serve a workload with continuous batching on a kvscope pool and print what it measured.

A Llama-architecture model (the built-in tiny random one, or `--model DIR` with a Hugging Face
checkpoint) serves synthetic requests (Poisson arrivals, a shared-prefix mix) or a JSONL file,
on the shared paged pool or, with `--baseline static`, on contiguous `max_len` reservations.

    python examples/serve.py
    python examples/serve.py --workers 2 --keep-pool --pool-name demo   # then: kvscope top demo
    python examples/serve.py --baseline static --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from server.checkpoint import load_config  # noqa: E402
from server.errors import ServeError  # noqa: E402
from server.model import ModelConfig  # noqa: E402
from server.report import RequestResult, Summary, render_table  # noqa: E402
from server.runconfig import RunConfig  # noqa: E402
from server.runner import run  # noqa: E402
from server.workload import Request, WorkloadSpec, generate_workload, read_jsonl  # noqa: E402


def length_range(text: str) -> tuple[int, int]:
    """`LOW:HIGH` or `N` as an inclusive range of positive lengths."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {text!r}") from None
    if not 0 <= lo <= hi or hi == 0:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW <= HIGH, HIGH > 0, got {text!r}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    """The command line of serve.py."""
    p = argparse.ArgumentParser(
        prog="serve.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    spec = WorkloadSpec()
    m = p.add_argument_group("model")
    m.add_argument("--model", type=Path, help="Hugging Face Llama dir (config.json, *.safetensors)")
    m.add_argument("--model-seed", type=int, default=0, help="seed of the built-in tiny model")
    m.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto")
    m.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=spec.num_requests, help="number of requests")
    w.add_argument("--rate", type=float, default=spec.rate, help="arrivals/s (0: all at once)")
    w.add_argument("--prompt-len", type=length_range, default=spec.prompt_len, metavar="LO:HI")
    w.add_argument("--output-len", type=length_range, default=spec.output_len, metavar="LO:HI")
    w.add_argument("--num-prefixes", type=int, default=spec.num_prefixes, help="system prompts")
    w.add_argument("--prefix-share", type=float, default=spec.prefix_share, metavar="FRACTION")
    w.add_argument("--prefix-len", type=length_range, default=spec.prefix_len, metavar="LO:HI")
    w.add_argument(
        "--n", "--samples", dest="n", type=int, default=1,
        help="samples per request (fork + copy-on-write)",
    )  # fmt: skip
    w.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload and sampling")
    w.add_argument(
        "--cancel-share", type=float, default=0.0, metavar="FRACTION",
        help="requests the client cancels midway (the server aborts them)",
    )  # fmt: skip
    w.add_argument("--jsonl", type=Path, help="read requests from this JSONL file instead")
    c = p.add_argument_group("cache and batching")
    c.add_argument("--baseline", choices=["paged", "static"], default="paged")
    c.add_argument("--num-blocks", type=int, default=64)
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--max-len", type=int, default=0, help="static reservation (0: the longest)")
    c.add_argument("--max-num-seqs", type=int, default=32)
    c.add_argument("--max-batched-tokens", type=int, default=256)
    c.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens per step")
    c.add_argument("--workers", type=int, default=1, help="processes serving from one pool")
    c.add_argument(
        "--ranks", type=int, default=1,
        help="engine processes each with its own pool, on cuda:0..N-1 with --device cuda",
    )  # fmt: skip
    c.add_argument(
        "--fault-rank", type=int, default=-1, metavar="RANK",
        help="with --ranks: faults armed by `kvscope run --inject` fire in this rank only",
    )  # fmt: skip
    c.add_argument(
        "--cuda-graphs", action="store_true",
        help="replay engine steps as CUDA graphs (on the CPU: their static buffers, run eagerly)",
    )  # fmt: skip
    c.add_argument("--threads", type=int, default=0, help="torch threads (0: 1 for tiny model)")
    c.add_argument("--pool-name", default="", help="pool name (default serve-PID)")
    c.add_argument("--keep-pool", action="store_true", help="leave the pool for kvscope top")
    c.add_argument("--guard", action="store_true", help="pool guard mode (a guard slot per block)")
    c.add_argument(
        "--no-prefix-cache", action="store_true", help="never share computed prefix blocks"
    )
    c.add_argument(
        "--clock", choices=["wall", "steps"], default="wall",
        help="arrivals on the wall clock, or on virtual time advancing per engine step "
        "(the same schedule on every machine)",
    )  # fmt: skip
    c.add_argument(
        "--kv-events", default="", metavar="ENDPOINT",
        help="publish the pool's prefix index as vLLM's KV-event stream (tcp://*:5557); "
        "with --ranks, rank r on the port plus r",
    )  # fmt: skip
    c.add_argument(
        "--offload", action="store_true",
        help="copy each finished request's K/V to host memory on a background thread, under "
        "read leases (its blocks are freed at once and quarantined until the copy is done)",
    )  # fmt: skip
    c.add_argument(
        "--kv-events-replay", default="", metavar="ENDPOINT",
        help="with --kv-events: the replay socket that resends buffered batches (tcp://*:5558)",
    )  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the summary as JSON")
    o.add_argument("--outputs", type=Path, help="write every request's tokens here (JSONL)")
    o.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run serve.py; returns the exit code (2 on a user error, printed as one line)."""
    args = build_parser().parse_args(argv)
    try:
        return _serve(args)
    except ServeError as exc:
        print(f"serve.py: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _serve(args: argparse.Namespace) -> int:
    """Validate flags, run, print."""
    for flag in ("requests", "workers", "ranks", "num_blocks", "block_size", "n", "max_num_seqs"):
        if getattr(args, flag) < 1:
            raise ServeError(f"--{flag.replace('_', '-')} must be at least 1")
    if args.model is not None and not args.model.is_dir():
        raise ServeError(f"--model {args.model}: not a directory")
    if args.kv_events_replay and not args.kv_events:
        raise ServeError("--kv-events-replay needs --kv-events")
    for flag, endpoint in (
        ("kv-events", args.kv_events),
        ("kv-events-replay", args.kv_events_replay),
    ):
        if endpoint:
            _check_endpoint(flag, endpoint, args.ranks)
    if args.kv_events and args.baseline != "paged":
        raise ServeError("--kv-events needs the paged pool (--baseline paged)")
    if args.ranks > 1 and args.workers > 1:
        raise ServeError("--ranks and --workers do not combine: each rank is one engine")
    if not -1 <= args.fault_rank < args.ranks:
        raise ServeError(f"--fault-rank {args.fault_rank}: not a rank of --ranks {args.ranks}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ServeError("--device cuda: no CUDA device here")
        if args.ranks > torch.cuda.device_count():
            raise ServeError(
                f"--ranks {args.ranks}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    config = RunConfig(
        model_path=args.model,
        model_seed=args.model_seed,
        dtype=args.dtype,
        device=args.device,
        baseline=args.baseline,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_len=args.max_len,
        workers=args.workers,
        pool_name=args.pool_name,
        keep_pool=args.keep_pool,
        guard=args.guard,
        prefix_cache=not args.no_prefix_cache,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        prefill_chunk=args.prefill_chunk,
        seed=args.seed,
        threads=args.threads,
        clock=args.clock,
        cuda_graphs=args.cuda_graphs,
        ranks=args.ranks,
        fault_rank=args.fault_rank,
        kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        offload=args.offload,
    )
    vocab_size = _vocab_size(args.model)
    if args.jsonl is not None:
        requests = read_jsonl(args.jsonl, vocab_size)
    else:
        spec = WorkloadSpec(
            num_requests=args.requests,
            rate=args.rate,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            num_prefixes=args.num_prefixes,
            prefix_share=args.prefix_share,
            prefix_len=args.prefix_len,
            n=args.n,
            temperature=args.temperature,
            seed=args.seed,
            cancel_share=args.cancel_share,
        )
        requests = generate_workload(spec, vocab_size)
    summary, results = _run_with_progress(config, requests, show=not args.no_progress)
    if args.outputs is not None:
        with open(args.outputs, "w") as f:
            for r in results:
                f.write(json.dumps({"id": r.request_id, "outputs": r.outputs, "error": r.error}))
                f.write("\n")
    if args.json:
        print(summary.to_json())
    else:
        from rich.console import Console

        Console().print(render_table(summary))
        if config.keep_pool and config.baseline == "paged":
            names = [config.pool_name]
            if config.ranks > 1:
                names = [f"{config.pool_name}-rank{i}" for i in range(config.ranks)]
            for name in names:
                print(f"pool kept: kvscope top {name}")
    return 0


def _check_endpoint(flag: str, endpoint: str, ranks: int) -> None:
    """A ServeError unless every rank can publish on its offset of `endpoint`."""
    from kvscope.allocator.config import check_kv_events
    from kvscope.allocator.errors import PoolError
    from kvscope.events.publisher import offset_endpoint

    try:
        check_kv_events(endpoint, what=f"--{flag}")
        offset_endpoint(endpoint, ranks - 1)
    except PoolError as exc:
        raise ServeError(str(exc)) from None


def _vocab_size(model: Path | None) -> int:
    """The vocabulary the workload draws token ids from."""
    return (ModelConfig() if model is None else load_config(model)).vocab_size


def _run_with_progress(
    config: RunConfig, requests: list[Request], show: bool
) -> tuple[Summary, list[RequestResult]]:
    """`run` with a rich progress bar on stderr (when stderr is a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console(stderr=True)
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(
        *columns, console=console, transient=True, disable=not (show and console.is_terminal)
    ) as progress:
        task = progress.add_task("serving", total=len(requests))
        return run(config, requests, on_finish=lambda n: progress.advance(task, n))


if __name__ == "__main__":
    sys.exit(main())
