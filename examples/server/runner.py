"""Run a workload: create the cache, start one engine or N worker processes, gather the summary.

With `workers > 1` the parent creates the pool and each worker attaches to it by name, serves
its share of the requests (every N-th) and reports back; blocks one worker computed are found
by the others through the pool's prefix index.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .checkpoint import load_config, load_model, tiny_model
from .engine import Engine
from .errors import ServeError
from .model import LlamaModel, ModelConfig
from .report import RequestResult, StepSample, Summary, summarize
from .static import StaticCache, StaticGeometry
from .workload import Request

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RunConfig:
    """Everything a run needs besides its requests."""

    model_path: Path | None = None
    model_seed: int = 0
    dtype: str = "auto"
    device: str = "cpu"
    baseline: str = "paged"
    num_blocks: int = 64
    block_size: int = 16
    max_len: int = 0
    workers: int = 1
    pool_name: str = ""
    keep_pool: bool = False
    guard: bool = False
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    prefill_chunk: int = 64
    seed: int = 0
    # torch threads per process; 0: one for the tiny model (OpenMP only slows tiny matmuls)
    threads: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def num_threads(self) -> int:
        """Threads each serving process should run torch with (0: leave torch's default)."""
        if self.threads > 0:
            return self.threads
        return 1 if self.model_path is None or self.workers > 1 else 0


@dataclass
class WorkerReport:
    """What one worker hands back."""

    results: list[RequestResult]
    samples: list[StepSample]
    num_preemptions: int
    error: str = ""


def model_config(config: RunConfig) -> ModelConfig:
    """The geometry of the run's model, read without loading its weights."""
    if config.model_path is None:
        return ModelConfig()
    return load_config(config.model_path)


def resolve_dtype(config: RunConfig) -> str:
    """`--dtype auto` made explicit: float32 on the CPU (half matmuls there are slow); on CUDA
    the checkpoint's half dtype, else float16, because the Triton kernels take fp16/bf16 only."""
    if config.dtype != "auto":
        return config.dtype
    if config.device == "cpu":
        return "float32"
    extra = model_config(config).extra
    wanted = extra.get("torch_dtype") or extra.get("dtype")
    return wanted if wanted in ("float16", "bfloat16") else "float16"


def build_model(config: RunConfig) -> LlamaModel:
    """The checkpoint at `model_path`, or the built-in tiny model, on the configured device."""
    dtype = DTYPES[resolve_dtype(config)]
    if config.model_path is not None:
        return load_model(config.model_path, dtype=dtype, device=config.device)
    return tiny_model(config.model_seed).to(device=config.device, dtype=dtype)


def build_cache(config: RunConfig, max_len: int, workers: int = 1) -> StaticCache:
    """The static baseline's private cache (a 1/workers share of the blocks each)."""
    model = model_config(config)
    geometry = StaticGeometry(
        num_blocks=config.num_blocks // workers,
        block_size=config.block_size,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=DTYPES[resolve_dtype(config)],
        device=config.device,
    )
    return StaticCache(geometry, max_len)


def create_pool(config: RunConfig, max_n: int = 1) -> Any:
    """A new shared pool shaped for the model, with sequence slots for every worker's streams."""
    from kvscope.allocator import KVPool, PoolConfig, PoolError

    model = model_config(config)
    pool_config = PoolConfig(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        dtype=resolve_dtype(config),
        device=config.device,
        max_seqs=max(64, 2 * config.workers * config.max_num_seqs * max_n),
        guard=config.guard,
    )
    try:
        return KVPool.create(config.pool_name, pool_config)
    except PoolError as exc:
        raise ServeError(f"--pool-name {config.pool_name}: {exc}") from exc


def make_engine(config: RunConfig, model: LlamaModel, cache: Any, worker: int) -> Engine:
    """An engine with the run's batching limits."""
    return Engine(
        model,
        cache,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        prefill_chunk=config.prefill_chunk,
        seed=config.seed,
        exclusive=config.workers == 1 or config.baseline == "static",
        worker=worker,
    )


def run(
    config: RunConfig, requests: list[Request], on_finish: Callable[[int], None] | None = None
) -> tuple[Summary, list[RequestResult]]:
    """Serve `requests` as configured; returns the summary and every request's result."""
    assert config.baseline in ("paged", "static") and config.workers >= 1
    if not config.pool_name:
        config.pool_name = f"serve-{os.getpid()}"
    max_len = config.max_len or max(len(r.prompt) + r.max_tokens for r in requests)
    threads_before = torch.get_num_threads()
    try:
        if config.num_threads():
            torch.set_num_threads(config.num_threads())
        if config.workers == 1:
            reports, duration_s, extra = _run_here(config, requests, max_len, on_finish)
        else:
            reports, duration_s, extra = _run_workers(config, requests, max_len, on_finish)
    finally:
        torch.set_num_threads(threads_before)
    errors = [r.error for r in reports if r.error]
    if errors:
        raise RuntimeError("a worker failed:\n" + errors[0])
    results = sorted((r for rep in reports for r in rep.results), key=lambda r: r.arrival_s)
    samples = [s for rep in reports for s in rep.samples]
    preemptions = sum(rep.num_preemptions for rep in reports)
    if config.baseline == "static":
        extra["max_len"] = max_len
    summary = summarize(
        results, samples, duration_s, preemptions, config.baseline, config.workers, extra
    )
    return summary, results


Outcome = tuple[list[WorkerReport], float, dict[str, Any]]


def _run_here(
    config: RunConfig,
    requests: list[Request],
    max_len: int,
    on_finish: Callable[[int], None] | None,
) -> Outcome:
    """One engine in this process."""
    model = build_model(config)
    if config.baseline == "static":
        cache: Any = build_cache(config, max_len)
    else:
        cache = create_pool(config, max(r.n for r in requests))
    try:
        engine = make_engine(config, model, cache, worker=0)
        if on_finish is not None:
            engine.on_finish = lambda _result: on_finish(1)
        start = time.monotonic()
        engine.run(requests, start_s=start)
        duration_s = time.monotonic() - start
        extra = _cache_extra(cache)
    finally:
        _release(config, cache)
    report = WorkerReport(engine.results, engine.samples, engine.scheduler.num_preemptions)
    return [report], duration_s, extra


def _run_workers(
    config: RunConfig,
    requests: list[Request],
    max_len: int,
    on_finish: Callable[[int], None] | None,
) -> Outcome:
    """N worker processes; the paged ones share one pool created here."""
    max_n = max(r.n for r in requests)
    pool = create_pool(config, max_n) if config.baseline == "paged" else None
    ctx = mp.get_context("fork" if config.device == "cpu" else "spawn")
    ready, reports_q = ctx.Queue(), ctx.Queue()
    go, start_value, finished = ctx.Event(), ctx.Value("d", 0.0), ctx.Value("i", 0)
    procs = [
        ctx.Process(
            target=worker_main,
            args=(config, requests[i :: config.workers], max_len, i, ready, go, start_value)
            + (finished, reports_q),
            daemon=True,
        )
        for i in range(config.workers)
    ]
    try:
        for proc in procs:
            proc.start()
        for _ in procs:
            ready.get(timeout=300)
        start_value.value = time.monotonic()
        go.set()
        reports: list[WorkerReport] = []
        seen = 0
        while len(reports) < len(procs):
            try:
                reports.append(reports_q.get(timeout=0.1))
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and reports_q.empty():
                    raise RuntimeError("a worker died without a report") from None
            if on_finish is not None and finished.value > seen:
                on_finish(finished.value - seen)
                seen = finished.value
        duration_s = time.monotonic() - start_value.value
        for proc in procs:
            proc.join()
        extra = _cache_extra(pool) if pool is not None else {}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        if pool is not None:
            _release(config, pool)
    return reports, duration_s, extra


def worker_main(
    config: RunConfig,
    requests: list[Request],
    max_len: int,
    worker: int,
    *channels: Any,
) -> None:
    """A worker process: load the model, attach the pool, serve its requests, report."""
    ready, go, start_value, finished, reports_q = channels
    torch.set_num_threads(config.num_threads() or 1)
    is_ready = False
    try:
        model = build_model(config)
        if config.baseline == "static":
            cache = build_cache(config, max_len, config.workers)
        else:
            from kvscope.allocator import KVPool

            cache = KVPool.attach(config.pool_name)
        engine = make_engine(config, model, cache, worker)

        def count(_result: RequestResult) -> None:
            with finished.get_lock():
                finished.value += 1

        engine.on_finish = count
        ready.put(worker)
        is_ready = True
        go.wait()
        engine.run(requests, start_s=start_value.value)
        report = WorkerReport(engine.results, engine.samples, engine.scheduler.num_preemptions)
        cache.close()
    except BaseException:
        if not is_ready:
            ready.put(worker)
        report = WorkerReport([], [], 0, error=traceback.format_exc())
    reports_q.put(report)


def _cache_extra(cache: Any) -> dict[str, Any]:
    """The cache's own counters and health at the end of the run."""
    stats = dict(cache.stats())
    return {"cache_stats": stats, "cache_findings": len(cache.check())}


def _release(config: RunConfig, cache: Any) -> None:
    """Close the cache; remove the shared pool unless the user keeps it for `kvscope top`."""
    cache.close()
    if not config.keep_pool:
        cache.unlink()
