"""Worker processes: N engines serving from one shared pool, each a share of the requests.

The parent creates the pool; each worker loads the model, attaches to the pool by name, waits
for a common start, serves every N-th request and reports back. A prefix one worker computed
is found by the others through the pool's prefix index.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .report import RequestResult, StepSample
from .runconfig import (
    RunConfig,
    build_cache,
    build_model,
    cache_extra,
    create_pool,
    make_engine,
    release_cache,
)
from .workload import Request

Outcome = tuple[list["WorkerReport"], float, dict[str, Any]]


@dataclass
class WorkerReport:
    """What one worker hands back."""

    results: list[RequestResult]
    samples: list[StepSample]
    num_preemptions: int
    error: str = ""


def run_workers(
    config: RunConfig,
    requests: list[Request],
    max_len: int,
    on_finish: Callable[[int], None] | None,
) -> Outcome:
    """N worker processes; the paged ones share one pool created here."""
    max_n = max(r.n for r in requests)
    pool = create_pool(config, max_n) if config.baseline == "paged" else None
    ctx: Any = mp.get_context("fork" if config.device == "cpu" else "spawn")
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
        num_ready = 0
        while num_ready < len(procs):
            try:
                ready.get(timeout=0.2)
                num_ready += 1
            except queue.Empty:
                _check_alive(procs)
        start_value.value = time.monotonic()
        go.set()
        reports: list[WorkerReport] = []
        seen = 0
        while len(reports) < len(procs):
            try:
                reports.append(reports_q.get(timeout=0.1))
            except queue.Empty:
                _check_alive(procs)
            if on_finish is not None and finished.value > seen:
                on_finish(finished.value - seen)
                seen = finished.value
        duration_s = time.monotonic() - start_value.value
        for proc in procs:
            proc.join()
        extra = cache_extra(pool) if pool is not None else {}
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        if pool is not None:
            release_cache(config, pool)
    return reports, duration_s, extra


def _check_alive(procs: list[Any]) -> None:
    """Raise if a worker process died (a crash, or a kill) instead of reporting."""
    for i, proc in enumerate(procs):
        if proc.exitcode not in (None, 0):
            raise RuntimeError(f"worker {i} died with exit code {proc.exitcode}")


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
