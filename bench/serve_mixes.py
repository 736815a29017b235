"""The prefix-sharing report's table: three prompt mixes, prefix sharing on and off, 12 clients.

    python bench/bench_serve.py --mixes --device cuda --json mixes.json    # Llama-2-7B shape
    python bench/bench_serve.py --mixes --device cpu --quick               # smoke test

One process builds a random-weight model once (Llama-2-7B's geometry on CUDA: 32 layers,
hidden 4096, 32 heads of 128, fp16; the built-in tiny model with `--quick`) and serves every
case with it, each on a fresh pool. Every request arrives at t=0 and at most 12 run at once:
12 closed-loop clients, each sending its next request as the last one finishes.

The mixes (every prompt a token list; the same seed gives the same requests):
- uniform: one of 10 shared 64-token system prompts, picked uniformly, then the request's own
  32-96 tokens (mean 128);
- top-10: 65% of requests repeat one of 10 whole 128-token prompts verbatim, the rest are
  drawn as in "uniform" (mean 128);
- long: one of 10 shared 128-token system prompts, then 768-1024 own tokens (mean 1024).
Outputs are 16-48 tokens (mean 32), greedy, the same in every case.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import random
import time
from dataclasses import asdict
from typing import Any

import torch
from server.checkpoint import LLAMA2_7B, random_model, tiny_model
from server.model import LlamaModel, ModelConfig
from server.runconfig import RunConfig
from server.runner import run
from server.workload import Request

CLIENTS = 12
BLOCK_SIZE = 16
MIXES = ("uniform", "top-10", "long")
# --quick: multi-head attention like Llama-2-7B's, at a size the CPU serves in seconds
QUICK = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=32,
)


def mix_requests(mix: str, num_requests: int, vocab_size: int, seed: int = 0) -> list[Request]:
    """The seeded requests of one mix (see the module docstring)."""
    rng = random.Random(f"{mix}:{seed}")
    system_len = 128 if mix == "long" else 64
    own = (768, 1024) if mix == "long" else (32, 96)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    systems = [tokens(system_len) for _ in range(10)]
    whole = [tokens(128) for _ in range(10)]
    requests = []
    for i in range(num_requests):
        if mix == "top-10" and rng.random() < 0.65:
            prompt = list(whole[rng.randrange(10)])
        else:
            prompt = systems[rng.randrange(10)] + tokens(rng.randint(*own))
        requests.append(Request(f"r{i}", prompt, max_tokens=rng.randint(16, 48)))
    return requests


def build_model(device: str, quick: bool) -> LlamaModel:
    """Llama-2-7B's shape with random fp16 weights on `device`, or (quick) a tiny model."""
    if quick:
        dtype = torch.float32 if device == "cpu" else torch.float16
        return tiny_model(0, QUICK).to(device=device, dtype=dtype).fuse()
    return random_model(LLAMA2_7B, device, torch.float16).fuse()


def case_config(
    model: LlamaModel, mix: str, device: str, sharing: bool, graphs: bool, name: str
) -> RunConfig:
    """The run of one case: 12 sequences at most, a pool large enough never to preempt.

    1024 blocks (8 GiB of Llama-2-7B's KV). A pool's CUDA memory stays with this process
    after the pool is closed (torch keeps a tensor it shared through CUDA IPC until every
    receiver lets go), so one process has room for about 15 such pools beside the model: the
    table (3 warm-ups, 12 cases) or a profile (`--only-profile`), not both.
    """
    return RunConfig(
        model_shape=model.config,
        device=device,
        dtype="float32" if device == "cpu" else "float16",
        num_blocks=1024,
        block_size=BLOCK_SIZE,
        max_num_seqs=CLIENTS,
        max_num_batched_tokens=4096,
        prefill_chunk=2048,
        prefix_cache=sharing,
        pool_name=name,
        cuda_graphs=graphs,
    )


def serve_case(
    model: LlamaModel, mix: str, sharing: bool, graphs: bool, n: int, device: str, tag: str
) -> dict[str, Any]:
    """Serve one case; its summary as a dict, with requests/s added."""
    requests = mix_requests(mix, n, model.config.vocab_size)
    name = f"mix-{tag}-{mix}-{int(sharing)}{int(graphs)}"
    config = case_config(model, mix, device, sharing, graphs, name)
    summary, _ = run(config, requests, model=model)
    free_device_memory(device)
    out = asdict(summary)
    out["requests_per_s"] = round(summary.requests / summary.duration_s, 2)
    out["mean_prompt_tokens"] = round(sum(len(r.prompt) for r in requests) / len(requests), 1)
    # The share of the run's wall time the GPU spent inside steps' work (CUDA events around
    # each step). A graph replays its kernels back to back, so there it is nearly the GPU's
    # busy time; an eager step's span also holds the gaps while Python issues its kernels.
    if "gpu_s" in summary.extra:
        out["gpu_step_share"] = round(summary.extra["gpu_s"] / summary.duration_s, 3)
    return out


def free_device_memory(device: str) -> None:
    """Give a finished case's pool back to the GPU before the next one asks for its own: the
    engine's references go in a collection, the pool's IPC-shared KV tensor with `ipc_collect`,
    and torch's cached blocks with `empty_cache` (the pool checks the GPU's free memory)."""
    if device != "cuda":
        return
    gc.collect()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()


def kv_block_bytes(model: LlamaModel) -> int:
    """Bytes of one pool block: K and V of every layer for BLOCK_SIZE tokens."""
    cfg = model.config
    itemsize = model.lm_head.weight.element_size()
    return 2 * cfg.num_layers * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * itemsize


def run_mixes(
    model: LlamaModel, device: str, num_requests: int, graphs: list[bool]
) -> dict[str, Any]:
    """Every mix with sharing on and off (and each graphs setting); warm-up first."""
    # Warm-up: Triton compiles each kernel variant once; not counted.
    for mix in MIXES:
        serve_case(model, mix, True, False, 2 * CLIENTS, device, "warm")
    cases = []
    for mix in MIXES:
        n = num_requests // 2 if mix == "long" else num_requests
        for g in graphs:
            for sharing in (True, False):
                summary = serve_case(model, mix, sharing, g, n, device, "run")
                cases.append({"mix": mix, "sharing": sharing, "cuda_graphs": g, **summary})
                print(
                    f"{mix:8} sharing={sharing!s:5} graphs={g!s:5} "
                    f"{summary['requests_per_s']:8.2f} req/s "
                    f"{summary['output_tokens_per_s']:9.1f} tok/s "
                    f"peak {summary['peak_kv_blocks']} blocks "
                    f"steps {summary['extra'].get('engine_steps')} "
                    f"phase ms {summary['extra'].get('step_phase_ms')} "
                    f"replays {summary['extra'].get('graph_replays')} "
                    f"GPU in steps {summary.get('gpu_step_share')} "
                    f"gpu ms/step {summary['extra'].get('gpu_step_ms')} "
                    f"steps {summary['extra'].get('steps_by_kind')}",
                    flush=True,
                )
    return {"block_bytes": kv_block_bytes(model), "cases": cases}


def profile_case(model: LlamaModel, device: str, graphs: bool, num_requests: int) -> dict[str, Any]:
    """Where the time of the top-10 mix (sharing on) goes: the GPU's kernels (torch.profiler;
    the window holds the case's set-up too, graph captures included, so the kernel total is not
    the serving's: the case's own `gpu_step_share` is), and the engine thread's hottest functions
    (cProfile)."""
    serve_case(model, "top-10", True, graphs, CLIENTS, device, "pwarm")
    out: dict[str, Any] = {"cuda_graphs": graphs}
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            summary = serve_case(model, "top-10", True, graphs, num_requests, device, "prof")
            torch.cuda.synchronize()
            wall_s = time.perf_counter() - began
        events = prof.key_averages()
        kernel_us = sum(
            getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
            for e in events
        )
        out.update(
            window_s=round(wall_s, 3),
            window_kernel_s=round(kernel_us / 1e6, 3),
            gpu_step_share=summary.get("gpu_step_share"),
            engine=summary["extra"],
            top_kernels=events.table(sort_by="self_device_time_total", row_limit=12),
        )
    profiler = cProfile.Profile()
    profiler.enable()
    serve_case(model, "top-10", True, graphs, num_requests, device, "cprof")
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    out["cprofile_tottime"] = text.getvalue()
    return out


def render(results: dict[str, Any]) -> str:
    """The mix table in Markdown: per case, then sharing's effect per mix."""
    block_gib = results["block_bytes"] / 2**30
    lines = [
        "| mix | prefix sharing | CUDA graphs | requests/s | output tokens/s | peak KV blocks "
        "(GiB) | TTFT p95 from admission | prompt tokens cached | GPU in steps |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in results["cases"]:
        lines.append(
            f"| {c['mix']} | {'on' if c['sharing'] else 'off'} | "
            f"{'on' if c['cuda_graphs'] else 'off'} | {c['requests_per_s']:.1f} | "
            f"{c['output_tokens_per_s']:,.0f} | {c['peak_kv_blocks']} "
            f"({c['peak_kv_blocks'] * block_gib:.2f}) | {c['ttft_admitted_p95_ms']:,.1f} ms | "
            f"{c['prefix_hit_rate']:.1%} | "
            + (f"{c['gpu_step_share']:.0%} |" if "gpu_step_share" in c else "- |")
        )
    lines += ["", "| mix | CUDA graphs | requests/s, sharing on vs off | peak KV blocks |"]
    lines.append("|---|---|---:|---:|")
    by = {(c["mix"], c["cuda_graphs"], c["sharing"]): c for c in results["cases"]}
    for (mix, g, sharing), on in by.items():
        off = by.get((mix, g, False))
        if not sharing or off is None:
            continue
        qps = on["requests_per_s"] / off["requests_per_s"] - 1
        mem = on["peak_kv_blocks"] / max(off["peak_kv_blocks"], 1) - 1
        lines.append(f"| {mix} | {'on' if g else 'off'} | {qps:+.0%} | {mem:+.0%} |")
    return "\n".join(lines)
