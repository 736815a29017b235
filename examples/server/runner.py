"""Run a workload: create the cache, start one engine or N worker processes, gather the summary."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from .model import LlamaModel
from .ranks import run_ranks
from .report import RequestResult, Summary, summarize
from .runconfig import (
    RunConfig,
    build_cache,
    build_model,
    cache_extra,
    create_pool,
    engine_extra,
    make_engine,
    rank_devices,
    release_cache,
    start_kv_events,
    start_time,
    stop_kv_events,
)
from .worker import Outcome, WorkerReport, run_workers
from .workload import Request


def run(
    config: RunConfig,
    requests: list[Request],
    on_finish: Callable[[int], None] | None = None,
    model: LlamaModel | None = None,
) -> tuple[Summary, list[RequestResult]]:
    """Serve `requests` as configured; returns the summary and every request's result.

    `model`: one already built (a benchmark serving several cases with one set of weights);
    one process only.
    """
    assert model is None or config.workers == 1
    assert config.baseline in ("paged", "static") and config.workers >= 1
    assert config.ranks == 1 or config.workers == 1, "ranks each run one engine"
    if not config.pool_name:
        config.pool_name = f"serve-{os.getpid()}"
    max_len = config.max_len or max(len(r.prompt) + r.max_tokens for r in requests)
    threads_before = torch.get_num_threads()
    try:
        if config.num_threads():
            torch.set_num_threads(config.num_threads())
        if config.ranks > 1:
            devices = rank_devices(config)
            reports, duration_s, extra = run_ranks(
                config, requests, devices, max_len, on_finish, config.fault_rank
            )
        elif config.workers == 1:
            reports, duration_s, extra = _run_here(config, requests, max_len, on_finish, model)
        else:
            reports, duration_s, extra = run_workers(config, requests, max_len, on_finish)
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
    processes = max(config.workers, config.ranks)
    summary = summarize(
        results, samples, duration_s, preemptions, config.baseline, processes, extra
    )
    return summary, results


def _run_here(
    config: RunConfig,
    requests: list[Request],
    max_len: int,
    on_finish: Callable[[int], None] | None,
    model: LlamaModel | None = None,
) -> Outcome:
    """One engine in this process."""
    model = model if model is not None else build_model(config)
    if config.baseline == "static":
        cache: Any = build_cache(config, max_len)
    else:
        cache = create_pool(config, max(r.n for r in requests))
    publisher = start_kv_events(config, cache)
    try:
        engine = make_engine(config, model, cache, worker=0, max_len=max_len)
        if on_finish is not None:
            engine.on_finish = lambda _result: on_finish(1)
        if publisher is not None:
            engine.on_step = publisher.poll
        start = time.monotonic()
        engine.run(requests, start_s=start_time(config, start))
        duration_s = time.monotonic() - start
        extra = cache_extra(cache) | engine_extra(engine) | stop_kv_events(publisher, cache)
        publisher = None
    finally:
        if publisher is not None:
            publisher.close()
        release_cache(config, cache)
    report = WorkerReport(engine.results, engine.samples, engine.scheduler.num_preemptions)
    return [report], duration_s, extra
