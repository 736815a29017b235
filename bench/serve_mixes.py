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
Outputs are 16-48 tokens (mean 32), greedy, the same in every case. Two more request shapes
have the same prompts (as lm-eval-harness sends them): "short", 1-4 output tokens, and "score",
a continuation of 1-8 tokens whose log-likelihoods are returned (one forward, no decoding);
with `choices` N > 1 (`--choices`), a score question is one prompt scored against N
continuations, N requests side by side, as lm-eval-harness's multiple-choice tasks send them
(requests/s counts requests, one per choice).
"""

from __future__ import annotations

import cProfile
import gc
import io
import math
import os
import pstats
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from server.checkpoint import LLAMA2_7B, random_model, tiny_model
from server.model import LlamaModel, ModelConfig
from server.report import RequestResult, StepSample
from server.runconfig import RunConfig
from server.runner import run
from server.workload import Request

CLIENTS = 12
BLOCK_SIZE = 16
MIXES = ("uniform", "top-10", "long")
# request shapes: outputs of 16-48 tokens; of 1-4 ("short"); a continuation scored ("score")
SHAPES = ("generate", "short", "score")
SHORT_OUTPUT = (1, 4)
CONTINUATION = (1, 8)
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


def mix_requests(
    mix: str,
    num_requests: int,
    vocab_size: int,
    seed: int = 0,
    shape: str = "generate",
    choices: int = 1,
) -> list[Request]:
    """The seeded requests of one mix (see the module docstring) in one request shape: every
    shape has the same prompts; "generate" 16-48 output tokens, "short" 1-4, "score" a
    continuation of 1-8 tokens scored for log-likelihoods (nothing generated).

    `choices` (score only): each question is one prompt (its context) scored against `choices`
    different continuations, `choices` requests next to each other in the list (`r7.0` ..
    `r7.3`), as lm-eval-harness's multiple-choice tasks send one loglikelihood request per
    answer with the same context; `num_requests` counts requests (num_requests // choices
    questions, the first questions' prompts those of choices=1)."""
    assert shape in SHAPES, shape
    assert choices >= 1 and (choices == 1 or shape == "score"), (shape, choices)
    rng = random.Random(f"{mix}:{seed}")
    # the other shapes' lengths from rngs of their own: the prompts stay the same
    short_rng = random.Random(f"{mix}:{seed}:short")
    score_rng = random.Random(f"{mix}:{seed}:score")
    system_len = 128 if mix == "long" else 64
    own = (768, 1024) if mix == "long" else (32, 96)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    systems = [tokens(system_len) for _ in range(10)]
    whole = [tokens(128) for _ in range(10)]
    requests = []
    for i in range(max(num_requests // choices, 1)):
        if mix == "top-10" and rng.random() < 0.65:
            prompt = list(whole[rng.randrange(10)])
        else:
            prompt = systems[rng.randrange(10)] + tokens(rng.randint(*own))
        max_tokens = rng.randint(16, 48)
        if shape == "short":
            max_tokens = short_rng.randint(*SHORT_OUTPUT)
        if shape == "score":
            for j in range(choices):
                n = score_rng.randint(*CONTINUATION)
                continuation = [score_rng.randrange(vocab_size) for _ in range(n)]
                rid = f"r{i}" if choices == 1 else f"r{i}.{j}"
                requests.append(Request(rid, list(prompt), 0, continuation=continuation))
        else:
            requests.append(Request(f"r{i}", prompt, max_tokens=max_tokens))
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
    model: LlamaModel,
    mix: str,
    sharing: bool,
    graphs: bool,
    n: int,
    device: str,
    tag: str,
    shape: str = "generate",
) -> dict[str, Any]:
    """Serve one case; its summary as a dict, with requests/s added."""
    requests = mix_requests(mix, n, model.config.vocab_size, shape=shape)
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
    return config_block_bytes(model.config, model.lm_head.weight.element_size())


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


def profile_case(
    model: LlamaModel,
    device: str,
    graphs: bool,
    num_requests: int,
    mix: str = "top-10",
    shape: str = "generate",
) -> dict[str, Any]:
    """Where the time of one mix in one request shape (sharing on) goes: the GPU's kernels
    (torch.profiler; the window holds the case's set-up too, graph captures included, so the
    kernel total is not the serving's: the case's own `gpu_step_share` is), and the engine
    thread's hottest functions (cProfile)."""

    def case(n: int, tag: str) -> dict[str, Any]:
        return serve_case(model, mix, True, graphs, n, device, tag, shape)

    case(CLIENTS, "pwarm")
    out: dict[str, Any] = {"mix": mix, "shape": shape, "cuda_graphs": graphs}
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            began = time.perf_counter()
            summary = case(num_requests, "prof")
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
    served = case(num_requests, "cprof")
    profiler.disable()
    out["served"] = {k: served[k] for k in ("requests", "output_tokens", "scored_tokens")}
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


# The memory regime: an A100 40GB beside Llama-2-7B's fp16 weights. Its KV budget is sized as
# vLLM sizes its cache: 90% of the GPU's memory (gpu_memory_utilization 0.9), less the weights,
# less a reserve for the forward's activations; in blocks of Llama-2-7B's fp16 K/V (2,873 of
# 16 tokens, 22.45 GiB). Another model (the tiny one on the CPU) gets the same blocks, so the
# budget holds the same tokens of every request; its bytes are that model's blocks'.
A100_BYTES = 40 * 2**30
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE = 2**30
# the pool of the other cases: 1024 blocks (8 GiB of Llama-2-7B's KV), never short
DEFAULT_BLOCKS = 1024
MEMORY_CLIENTS = (12, 16, 24, 32)
# The report's memory regime, kept as a fraction: 12 streams held 14.2 GB of KV without sharing
# on a GPU whose KV budget ran 9 of them at once (9.8 GB with sharing ran 16). The mixes'
# requests are far shorter than the report's, so the literal A100 budget holds hundreds of them
# and never binds; `--memory` (report) gives each mix and request shape the budget that holds
# REPORT_FIT of its requests without sharing (report_blocks).
REPORT_STREAMS = 12
REPORT_FIT = 9


def request_blocks(request: Request) -> int:
    """Blocks a request's sequence holds at its end when nothing is shared: prompt and
    continuation, and every generated token but the last (its K/V is never computed)."""
    return -(-(request.num_tokens + max(request.max_tokens - 1, 0)) // BLOCK_SIZE)


def report_blocks(requests: list[Request], fit: int = REPORT_FIT) -> int:
    """The report's budget for `requests`: `fit` of them at their end without sharing, each with
    the block of headroom the scheduler keeps free per running stream (its watermark), so that
    about `fit` run at once without sharing; rounded up to an even count (a pool's sequence
    records need one)."""
    mean = sum(request_blocks(r) for r in requests) / len(requests)
    blocks = math.ceil(fit * (mean + 1))
    return blocks + blocks % 2


def streams_fit(num_blocks: int, requests: list[Request]) -> float:
    """How many of `requests` a budget holds at their end without sharing (mean request,
    with its block of headroom)."""
    mean = sum(request_blocks(r) for r in requests) / len(requests)
    return round(num_blocks / (mean + 1), 1)


def weight_bytes(model: LlamaModel) -> int:
    """Bytes of the model's weights (fused views counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def config_weight_bytes(config: ModelConfig, itemsize: int) -> int:
    """Bytes of a Llama model's weights from its shape (embeddings and lm_head untied, as
    Llama-2-7B's), at `itemsize` bytes a parameter."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads
    attention = h * q + 2 * h * kv * config.head_dim + q * h
    layer = attention + 3 * h * config.intermediate_size + 2 * h
    return (2 * config.vocab_size * h + config.num_layers * layer + h) * itemsize


def config_block_bytes(config: ModelConfig, itemsize: int) -> int:
    """Bytes of one pool block of a model of this shape: K and V of every layer, BLOCK_SIZE
    tokens."""
    return 2 * config.num_layers * BLOCK_SIZE * config.num_kv_heads * config.head_dim * itemsize


def a100_blocks() -> int:
    """Pool blocks in the KV budget an A100 40GB leaves beside Llama-2-7B's fp16 weights: the
    budget of every model (in a model's pool, kv_block_bytes(model) each)."""
    budget = (
        GPU_MEMORY_UTILIZATION * A100_BYTES - config_weight_bytes(LLAMA2_7B, 2) - ACTIVATION_RESERVE
    )
    return int(budget // config_block_bytes(LLAMA2_7B, 2))


class SharedPool:
    """One pool and one set of step graphs serving many cases in turn: between cases every
    cached block is evicted, so each case starts on an empty pool (as a fresh one) and the
    graphs are captured once (max_seqs: the most clients of any case)."""

    def __init__(
        self,
        model: LlamaModel,
        device: str,
        num_blocks: int,
        max_clients: int,
        max_len: int,
        graphs: bool,
    ) -> None:
        from server.graphs import StepGraphs
        from server.runconfig import create_pool

        self.model = model
        self.device = device
        self.config = RunConfig(
            model_shape=model.config,
            device=device,
            dtype="float32" if device == "cpu" else "float16",
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=max_clients,
            max_num_batched_tokens=4096,
            prefill_chunk=2048,
            pool_name=f"mixes-{os.getpid()}-{num_blocks}",
        )
        self.pool = create_pool(self.config)
        self.graphs = (
            StepGraphs(model, self.pool, max_clients, max_len, max_tokens=4096, max_chunk=2048)
            if graphs and device == "cuda"
            else None
        )

    def serve(
        self,
        requests: list[Request],
        clients: int,
        sharing: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> tuple[dict[str, Any], list[RequestResult]]:
        """Serve `requests` with at most `clients` at once; the summary (with the case's
        memory over time) and every request's result. (`clock`: the engine's; the tests give
        a server.engine.StepClock, which makes a run the same on every machine.)"""
        from server.engine import Engine
        from server.report import summarize
        from server.runconfig import engine_extra

        engine = Engine(
            self.model,
            self.pool,
            max_num_seqs=clients,
            max_num_batched_tokens=4096,
            prefill_chunk=2048,
            prefix_cache=sharing,
            graphs=self.graphs,
            clock=clock,
        )
        began = clock()
        results = engine.run(requests, start_s=began)
        if self.device == "cuda":
            torch.cuda.synchronize()
        duration_s = clock() - began
        summary = summarize(
            results, engine.samples, duration_s, engine.scheduler.num_preemptions,
            extra=engine_extra(engine),
        )  # fmt: skip
        # (in batches: one eviction's undo journal holds about a hundred blocks)
        while self.pool.evict(64):
            pass
        stats = self.pool.stats()
        assert stats["num_cached"] == 0 and not any(r.error for r in results), stats
        out = asdict(summary)
        out["requests_per_s"] = round(summary.requests / duration_s, 2)
        out["peak_kv_bytes"] = summary.peak_kv_blocks * kv_block_bytes(self.model)
        out["kv"] = kv_over_time(engine.samples, kv_block_bytes(self.model))
        out["running"] = running_over_time(engine.samples)
        # streams set aside while the pool was full (preemptions: those whose blocks were taken)
        out["set_aside"] = engine.scheduler.num_set_aside
        out["num_blocks"] = self.config.num_blocks
        return out, results

    def close(self) -> None:
        self.pool.close()
        self.pool.unlink()


def step_weights(samples: list[StepSample]) -> list[float]:
    """Each step's share of a run: its duration's (on a virtual clock whose steps take no
    time, server.engine.StepClock, every step the same)."""
    total = sum(s.dt_s for s in samples)
    if total <= 0:
        return [1.0 / len(samples)] * len(samples)
    return [s.dt_s / total for s in samples]


def kv_over_time(samples: list[StepSample], block_bytes: int) -> dict[str, Any]:
    """The K/V the running (and waiting) streams held over a case, from the engine's samples:
    `peak_bytes` the most at any step (the cold start included: the first requests find
    nothing cached), `mean_bytes` the time-weighted mean (a block several streams map counts
    once), `mapped_bytes` the mean of the same streams' blocks counted once per stream (what
    they would hold if none were shared), `saved` = 1 - mean / mapped (what sharing saved at a
    time), `maps_per_block` = mapped / mean (how many streams map a held block, on average).
    Time-weighted: each step by its duration (step_weights)."""
    if not samples:
        return {"peak_bytes": 0, "mean_bytes": 0, "mapped_bytes": 0, "saved": 0.0}
    weights = step_weights(samples)
    held = sum(s.held_blocks * w for s, w in zip(samples, weights, strict=True))
    mapped = sum(s.mapped_blocks * w for s, w in zip(samples, weights, strict=True))
    return {
        "peak_bytes": max(s.held_blocks for s in samples) * block_bytes,
        "mean_bytes": round(held * block_bytes),
        "mapped_bytes": round(mapped * block_bytes),
        "saved": round(1 - held / mapped, 3) if mapped else 0.0,
        "maps_per_block": round(mapped / held, 3) if held else 0.0,
    }


def running_over_time(samples: list[StepSample], points: int = 40) -> dict[str, Any]:
    """Streams running over a case: the time-weighted mean, the peak, and (t_s, running) at
    `points` evenly spaced moments (the last sample at or before each)."""
    if not samples:
        return {"mean": 0.0, "peak": 0, "series": []}
    weights = step_weights(samples)
    mean = sum(s.num_running_requests * w for s, w in zip(samples, weights, strict=True))
    end = samples[-1].t_s
    series, i = [], 0
    for k in range(points):
        t = end * (k + 1) / points
        while i + 1 < len(samples) and samples[i + 1].t_s <= t:
            i += 1
        series.append((round(t, 3), samples[i].num_running_requests))
    peak = max(s.num_running_requests for s in samples)
    return {"mean": round(mean, 2), "peak": peak, "series": series}


def requests_of(
    mix: str, shape: str, n: int, model: LlamaModel, seed: int = 0, choices: int = 1
) -> list[Request]:
    """A case's requests: half as many on the long mix (its prompts are 8x longer); the score
    shape's questions with `choices` continuations each (the other shapes ignore it)."""
    n = n // 2 if mix == "long" else n
    choices = choices if shape == "score" else 1
    return mix_requests(mix, n, model.config.vocab_size, seed, shape, choices)


def run_report(
    model: LlamaModel,
    device: str,
    *,
    shapes: list[str],
    clients: list[int],
    num_blocks: int,
    num_requests: int,
    repeat: int,
    graphs: bool,
    hf: Any = None,
    hf_requests: int = 24,
    check: int = 4,
    mixes: tuple[str, ...] = MIXES,
    hf_ways: tuple[str, ...] = ("threads", "batches"),
    budget: str = "fixed",
    clock: Callable[[], Callable[[], float]] | None = None,
    choices: int = 1,
) -> dict[str, Any]:
    """Every mix in every shape and client count, sharing on and off, `repeat` times; with `hf`
    (bench_serve_hf.HFBaseline) Transformers serves the same requests too (its first
    `hf_requests`), and its outputs are compared with the engine's on the first `check`
    requests.

    `budget`: "fixed", every case on one pool of `num_blocks` (SharedPool); "report", each mix
    and shape on a pool of its own of report_blocks(its requests) blocks (the report's regime:
    about REPORT_FIT of its requests fit without sharing), Transformers in padded batches of at
    most that many. `clock`: a fresh engine clock per case (the tests' StepClock). `choices`:
    the score shape's continuations per question (mix_requests); requests/s counts requests,
    one per choice, and the report's budget holds REPORT_FIT requests (choices), not questions."""
    assert budget in ("fixed", "report"), budget
    groups = {
        (mix, shape): requests_of(mix, shape, num_requests, model, choices=choices)
        for mix in mixes
        for shape in shapes
    }
    max_len = max(r.num_tokens + r.max_tokens for rs in groups.values() for r in rs)
    blocks = {
        key: report_blocks(rs) if budget == "report" else num_blocks for key, rs in groups.items()
    }
    a100 = a100_blocks()
    budgets = [
        {
            "mix": mix, "shape": shape, "num_blocks": n, "kv_budget_bytes": n * kv_block_bytes(model),
            "request_blocks_mean": round(sum(map(request_blocks, rs)) / len(rs), 2),
            "fit_without_sharing": streams_fit(n, rs), "a100_fit_without_sharing": streams_fit(a100, rs),
        }
        for (mix, shape), rs in groups.items()
        for n in [blocks[mix, shape]]
    ]  # fmt: skip
    for b in budgets:
        print(
            f"budget {b['mix']:8} {b['shape']:8} {b['num_blocks']} blocks "
            f"({size(b['kv_budget_bytes'])}): {b['fit_without_sharing']} of its requests without "
            f"sharing (mean {b['request_blocks_mean']} blocks each); the A100 40GB budget, "
            f"{a100} blocks: {b['a100_fit_without_sharing']}",
            flush=True,
        )
    pools: dict[int, SharedPool] = {}
    cases: list[dict[str, Any]] = []

    def hf_width(mix: str, shape: str, n: int) -> int:
        """Transformers' streams at once: the clients, or in the report's budget the streams it
        holds without sharing (its caches are not paged: nothing to share, nothing to preempt)."""
        if budget == "fixed":
            return n
        fit = next(b for b in budgets if (b["mix"], b["shape"]) == (mix, shape))
        return min(n, int(fit["fit_without_sharing"]))

    try:
        for n in sorted(set(blocks.values())):
            pools[n] = SharedPool(model, device, n, max(clients), max_len, graphs)
        # warm-up (Triton's compilation, cuBLAS's choices, each pool's first use), not counted
        for (mix, shape), n in blocks.items():
            warm = requests_of(mix, shape, 2 * CLIENTS, model, seed=1, choices=choices)
            pools[n].serve(warm, CLIENTS, True, *([clock()] if clock else []))
        for rep in range(repeat):
            for (mix, shape), requests in groups.items():
                shared = pools[blocks[mix, shape]]
                for n in clients:
                    for sharing in (True, False):
                        out, results = shared.serve(
                            requests, n, sharing, *([clock()] if clock else [])
                        )
                        case = {
                            "engine": "kvscope", "mix": mix, "shape": shape,
                            "clients": n, "sharing": sharing, "repeat": rep, **out,
                        }  # fmt: skip
                        if shape == "score" and choices > 1:
                            case["choices"] = choices
                        cases.append(case)
                        print(case_line(case), flush=True)
                        if hf is not None and rep == 0 and sharing and n == clients[0]:
                            ours = {r.request_id: r for r in results}
                            cases += hf_cases(
                                hf, requests[:hf_requests], mix, shape, n, ours, check, hf_ways,
                                width=hf_width(mix, shape, n),
                            )  # fmt: skip
                if hf is not None and rep == 0:
                    for n in clients[1:]:
                        width = hf_width(mix, shape, n)
                        got = hf.serve_batches(requests[:hf_requests], width)
                        cases.append(hf_case(got, mix, shape, n, "batches"))
                        cases[-1]["batch"] = width
                        print(case_line(cases[-1]), flush=True)
    finally:
        for shared in pools.values():
            shared.close()
    return {
        "block_bytes": kv_block_bytes(model),
        "budget": budget,
        "num_blocks": num_blocks if budget == "fixed" else max(blocks.values()),
        "kv_budget_bytes": (num_blocks if budget == "fixed" else max(blocks.values()))
        * kv_block_bytes(model),
        "budgets": budgets,
        "a100_blocks": a100,
        "a100_kv_budget_bytes": a100 * kv_block_bytes(model),
        "weight_bytes": weight_bytes(model),
        "choices": choices,
        "cases": cases,
    }


def hf_cases(
    hf: Any,
    requests: list[Request],
    mix: str,
    shape: str,
    clients: int,
    ours: dict[str, RequestResult],
    check: int,
    ways: tuple[str, ...] = ("threads", "batches"),
    width: int = 0,
) -> list[dict[str, Any]]:
    """Transformers both ways (a thread per client; padded batches), each compared with the
    engine's results on the first `check` requests; `width` streams at once (0: `clients`)."""
    out = []
    width = width or clients
    for how in ways:
        if how == "threads":
            got = hf.serve_threads(requests, width)
        else:
            got = hf.serve_batches(requests, width)
        case = hf_case(got, mix, shape, clients, how)
        case["batch"] = width
        case["check"] = hf.compare(requests[:check], ours, got["results"])
        out.append(case)
        print(case_line(case), flush=True)
    return out


def hf_case(got: dict[str, Any], mix: str, shape: str, clients: int, how: str) -> dict[str, Any]:
    """One Transformers run as a case of the table."""
    summary = {k: v for k, v in got.items() if k != "results"}
    return {
        "engine": f"hf-{how}", "mix": mix, "shape": shape, "clients": clients,
        "sharing": False, "repeat": 0, **summary,
    }  # fmt: skip


def case_line(c: dict[str, Any]) -> str:
    """One case as a progress line."""
    kv = c.get("kv")
    held = (
        f"KV held peak {size(kv['peak_bytes'])} mean {size(kv['mean_bytes'])} "
        f"unshared {size(kv['mapped_bytes'])} saved {kv['saved']:.0%} "
        if kv
        else f"peak KV {size(c['peak_kv_bytes'])} "
    )
    running = c.get("running")
    return (
        f"{c['engine']:12} {c['mix']:8} {c['shape']:8} clients={c['clients']:<3} "
        + (f"choices={c['choices']} " if "choices" in c else "")
        + f"sharing={c['sharing']!s:5} {c['requests_per_s']:8.2f} req/s "
        f"TTFT p95 {c['ttft_admitted_p95_ms']:8.1f} ms "
        + held
        + (f"running peak {running['peak']} mean {running['mean']:.2f} " if running else "")
        + f"preemptions {c.get('preemptions', 0)}"
        + (f" set aside {c['set_aside']}" if "set_aside" in c else "")
        + (f" budget {c['num_blocks']} blocks" if "num_blocks" in c else "")
        + (f" batch {c['batch']}" if "batch" in c else "")
        + (f" check {c['check']}" if "check" in c else "")
    )


# The prefix-sharing report's figures: requests/s with sharing against without, and the KV
# memory of the top-10 mix (14.2 GB -> 9.8 GB for 12 streams on an A100 40GB)
REPORT = {"uniform": ("+72%", ""), "top-10": ("+87%", "-31%"), "long": ("+12%", "")}


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """The median of repeats, and their range when there are several."""
    if not values:
        return "-"
    ordered = sorted(values)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (
        (ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    )  # fmt: skip
    text = fmt.format(median)
    if len(ordered) > 1:
        text += f" ({fmt.format(ordered[0])}-{fmt.format(ordered[-1])})"
    return text


def size(num_bytes: float) -> str:
    """Bytes as GiB (MiB below a tenth of one: the tiny model's pool)."""
    if num_bytes >= 0.1 * 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.2f} MiB"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _pick(
    cases: list[dict[str, Any]], engine: str, mix: str, shape: str, n: int, sharing: bool | None
) -> list[dict[str, Any]]:
    """The cases of one engine, mix, shape and client count (and sharing, unless None)."""
    return [
        c
        for c in cases
        if c["engine"] == engine and c["mix"] == mix and c["shape"] == shape
        and c["clients"] == n and (sharing is None or c["sharing"] == sharing)
    ]  # fmt: skip


# the request shapes as the summary names them
SHAPE_LABELS = {"generate": "16-48 output tokens", "short": "1-4 output tokens", "score": "score"}


def render_summary(results: dict[str, Any]) -> str:
    """The table as the report prints it, at the first client count: per mix and request shape
    the baseline's requests/s (HF: the better of its ways; kvscope without sharing), the shared
    requests/s, the K/V held over the run (time-weighted mean) without and with sharing, and
    TTFT p95; medians of the repeats."""
    cases = results["cases"]
    n0 = min(c["clients"] for c in cases)
    choices = results.get("choices", 1)
    lines = [
        f"As the report prints it ({n0} clients; requests/s, medians of the repeats; HF: the "
        "better of a thread per client and padded batches; K/V: held over the run, the "
        "time-weighted mean; TTFT p95 from admission):",
        "",
        "| mix | request shape | HF | kvscope, sharing off | kvscope, sharing on | sharing on "
        "vs off | report | on vs HF | K/V held over the run, off → on | TTFT p95, HF / off / "
        "on |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mix in MIXES:
        for shape in SHAPES:
            on = _pick(cases, "kvscope", mix, shape, n0, True)
            off = _pick(cases, "kvscope", mix, shape, n0, False)
            if not on or not off:
                continue
            hf = _pick(cases, "hf-threads", mix, shape, n0, None)
            hf += _pick(cases, "hf-batches", mix, shape, n0, None)
            best = max(hf, key=lambda c: c["requests_per_s"], default=None)
            q_on = _median([c["requests_per_s"] for c in on])
            q_off = _median([c["requests_per_s"] for c in off])
            held_on = _median([c["kv"]["mean_bytes"] for c in on])
            held_off = _median([c["kv"]["mean_bytes"] for c in off])
            report_kv = f"; the report {REPORT[mix][1]}" if REPORT[mix][1] else ""
            label = SHAPE_LABELS[shape] + (
                f", {choices} choices" if shape == "score" and choices > 1 else ""
            )
            ttft = [
                f"{best['ttft_admitted_p95_ms']:.0f}" if best else "-",
                f"{_median([c['ttft_admitted_p95_ms'] for c in off]):.0f}",
                f"{_median([c['ttft_admitted_p95_ms'] for c in on]):.0f}",
            ]
            lines.append(
                f"| {mix} | {label} | "
                + (f"{best['requests_per_s']:.1f}" if best else "-")
                + f" | {q_off:.1f} | {q_on:.1f} | {q_on / q_off - 1:+.0%} | {REPORT[mix][0]} | "
                + (f"{q_on / best['requests_per_s']:.1f}x" if best else "-")
                + f" | {size(held_off)} → {size(held_on)} "
                f"({held_on / max(held_off, 1e-12) - 1:+.0%}{report_kv}) | "
                f"{' / '.join(ttft)} ms |"
            )
    return "\n".join(lines)


def render_report(results: dict[str, Any]) -> str:
    """The table as the report prints it (baseline QPS, shared QPS, KV memory, TTFT p95 per mix
    and request shape; medians of the repeats, their range in brackets), then the memory
    regime's table when more than one client count ran or the report's budget was used."""
    cases = results["cases"]
    clients = sorted({c["clients"] for c in cases})
    shapes = [s for s in SHAPES if any(c["shape"] == s for c in cases)]

    def pick(engine: str, mix: str, shape: str, n: int, sharing: bool | None = None) -> list:
        return _pick(cases, engine, mix, shape, n, sharing)

    def qps(cs: list) -> list[float]:
        return [c["requests_per_s"] for c in cs]

    def kv(cs: list, key: str) -> float:
        return _median([c["kv"][key] for c in cs])

    def change(off: float, on: float) -> str:
        return f"{size(off)} -> {size(on)} ({on / max(off, 1e-12) - 1:+.0%})"

    def checked(cs: list) -> str:
        """Transformers' outputs equal to the engine's, per HF way ('-': none compared)."""
        found = [c["check"] for c in cs if c.get("check", {}).get("requests")]
        return ", ".join(f"{k['equal']}/{k['requests']}" for k in found) or "-"

    n0 = clients[0]
    choices = results.get("choices", 1)

    def label(shape: str) -> str:
        return f"{shape} ({choices} choices)" if shape == "score" and choices > 1 else shape

    lines = [
        f"{n0} clients. requests/s. KV held: the blocks the streams' tables hold (a block "
        "several streams map counts once), the time-weighted mean over the run and its peak "
        "(the cold start included: the first requests find nothing cached); streams per held "
        "block: how many streams map a held block on average, sharing on (1.00: nothing held "
        "at once by two). TTFT p95 from admission. Medians of the repeats, (min-max). HF "
        "outputs equal: of the first requests compared (`--check`), those whose Transformers "
        "outputs equal the engine's (tokens; scores: log-probabilities within 1e-3 + 1% and "
        "the same is_greedy), a thread per client, padded batches.",
        *(
            [
                f"score ({choices} choices): a question is one prompt scored against {choices} "
                f"continuations, {choices} requests side by side in the queue (lm-eval-harness's "
                "multiple-choice tasks); clients and requests/s count requests (choices)."
            ]
            if choices > 1
            else []
        ),
        "",
        "| mix | request shape | HF, a thread per client | HF, padded batches | kvscope, sharing "
        "off | kvscope, sharing on | sharing on vs off | report | sharing on vs HF | "
        "KV held, mean, off -> on | KV held, peak, off -> on | report: KV | streams per held "
        "block | TTFT p95 off / on (ms) | HF outputs equal |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mix in MIXES:
        for shape in shapes:
            on, off = pick("kvscope", mix, shape, n0, True), pick("kvscope", mix, shape, n0, False)
            if not on or not off:
                continue
            threads, batches = (
                pick("hf-threads", mix, shape, n0),
                pick("hf-batches", mix, shape, n0),
            )
            gain = _median(qps(on)) / _median(qps(off)) - 1
            best_hf = max(qps(threads) + qps(batches), default=0.0)
            vs_hf = f"{_median(qps(on)) / best_hf:.1f}x" if best_hf else "-"
            lines.append(
                f"| {mix} | {label(shape)} | {spread(qps(threads), '{:.2f}')} | "
                f"{spread(qps(batches), '{:.2f}')} | {spread(qps(off))} | {spread(qps(on))} | "
                f"{gain:+.0%} | {REPORT[mix][0]} | {vs_hf} | "
                f"{change(kv(off, 'mean_bytes'), kv(on, 'mean_bytes'))} | "
                f"{change(kv(off, 'peak_bytes'), kv(on, 'peak_bytes'))} | "
                f"{REPORT[mix][1] or '-'} | {kv(on, 'maps_per_block'):.2f} | "
                f"{spread([c['ttft_admitted_p95_ms'] for c in off])} / "
                f"{spread([c['ttft_admitted_p95_ms'] for c in on])} | "
                f"{checked(threads + batches)} |"
            )
    report_budget = results.get("budget") == "report"
    if len(clients) == 1 and not report_budget:
        return "\n".join(lines)
    a100 = (
        f"{results['a100_blocks']} blocks of {BLOCK_SIZE} tokens "
        f"({size(results['a100_kv_budget_bytes'])} of this model's K/V)"
    )
    if report_budget:
        lines += [
            "",
            f"Memory regime (the report's): each mix and request shape on a KV budget that "
            f"holds {REPORT_FIT} of its requests without sharing, as the report's budget held "
            f"{REPORT_FIT} of its {REPORT_STREAMS} streams (blocks: {REPORT_FIT} x (the mean "
            "request's blocks at its end + the block of headroom the scheduler keeps per "
            f"running stream)). The literal budget an A100 40GB leaves beside Llama-2-7B's fp16 "
            f"weights, {a100}, "
            "holds the streams in the budget column's brackets: it never binds.",
        ]
    else:
        lines += [
            "",
            f"Memory regime: a KV budget of {results['num_blocks']} blocks "
            f"({size(results['kv_budget_bytes'])}); an A100 40GB's, beside Llama-2-7B's fp16 "
            f"weights: {a100}.",
        ]
    lines += [
        "kvscope off / on. Running streams: the engine's count after each step, peak (time-"
        "weighted mean). Preemptions: streams whose blocks were taken (set aside: stopped "
        "while the pool was full). HF: padded batches of the clients (in the report's budget "
        "at most the streams it holds without sharing: `batch` in the JSON), its KV the padded "
        "caches' bytes (on CUDA its peak allocation above the weights: "
        "`peak_memory_above_weights`).",
        "",
        "| mix | request shape | clients | budget (streams it holds; A100's) | requests/s "
        "off / on | HF requests/s | KV held peak off / on | KV held mean off / on | HF peak "
        "KV | running streams peak (mean) off / on | preemptions (set aside) off / on | "
        "TTFT p95 ms off / on | HF TTFT p95 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    budgets = {(b["mix"], b["shape"]): b for b in results.get("budgets", [])}
    for mix in MIXES:
        for shape in shapes:
            for n in clients:
                on, off = (
                    pick("kvscope", mix, shape, n, True),
                    pick("kvscope", mix, shape, n, False),
                )
                if not on or not off:
                    continue
                hf = pick("hf-batches", mix, shape, n)
                b = budgets.get((mix, shape))
                fits = (
                    f"{b['num_blocks']} ({b['fit_without_sharing']:.1f}; "
                    f"{b['a100_fit_without_sharing']:.0f})"
                    if b
                    else str(results["num_blocks"])
                )

                def run_(cs: list) -> str:
                    peak = max(c["running"]["peak"] for c in cs)
                    return f"{peak} ({_median([c['running']['mean'] for c in cs]):.1f})"

                def pre(cs: list) -> str:
                    return (
                        f"{max(c['preemptions'] for c in cs)} "
                        f"({max(c.get('set_aside', 0) for c in cs)})"
                    )

                lines.append(
                    f"| {mix} | {label(shape)} | {n} | {fits} | {spread(qps(off))} / {spread(qps(on))} | "
                    f"{spread(qps(hf), '{:.2f}')} | "
                    f"{size(kv(off, 'peak_bytes'))} / {size(kv(on, 'peak_bytes'))} | "
                    f"{size(kv(off, 'mean_bytes'))} / {size(kv(on, 'mean_bytes'))} | "
                    + (size(hf[0]["peak_kv_bytes"]) if hf else "-")
                    + f" | {run_(off)} / {run_(on)} | {pre(off)} / {pre(on)} | "
                    f"{spread([c['ttft_admitted_p95_ms'] for c in off])} / "
                    f"{spread([c['ttft_admitted_p95_ms'] for c in on])} | "
                    f"{spread([c['ttft_admitted_p95_ms'] for c in hf])} |"
                )
    return "\n".join(lines)
