"""One engine per GPU, each with its own pool: the "each rank its own page pool" layout.

    reports, duration_s, extra = run_ranks(config, requests, ["cuda:0", "cuda:1"])

Rank i is a process serving every N-th request on `devices[i]` from its own pool, named
`<pool_name>-rank<i>`, whose header records that device (`kvscope ls` and `analyze` show it).
Nothing is shared between ranks: a prefix one rank computed is not found by another. With
`kv_events`, each rank publishes its pool's KV events as a vLLM data-parallel rank does: on the
endpoint's port plus its rank, its rank in every batch. With
`fault_rank`, the faults `kvscope run --inject` armed fire in that rank only (the others disarm
them), so a finding can be traced to the one pool and device it came from.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from .report import RequestResult
from .runconfig import (
    RunConfig,
    build_cache,
    build_model,
    cache_extra,
    create_pool,
    engine_extra,
    make_engine,
    release_cache,
    start_kv_events,
    stop_kv_events,
)
from .worker import Outcome, WorkerReport
from .workload import Request


def rank_pool_name(base: str, rank: int) -> str:
    """The pool of rank `rank`."""
    return f"{base}-rank{rank}"


def run_ranks(
    config: RunConfig,
    requests: list[Request],
    devices: list[str],
    max_len: int,
    on_finish: Callable[[int], None] | None = None,
    fault_rank: int = -1,
) -> Outcome:
    """One process per device, each its own cache; returns every rank's report."""
    assert devices and -1 <= fault_rank < len(devices)
    cuda = any(d.startswith("cuda") for d in devices)
    ctx: Any = mp.get_context("spawn" if cuda else "fork")
    shares = [requests[i :: len(devices)] for i in range(len(devices))]
    procs, reads = [], []
    for rank, (device, share) in enumerate(zip(devices, shares, strict=True)):
        rank_config = dataclasses.replace(
            config, device=device, pool_name=rank_pool_name(config.pool_name, rank)
        )
        read, write = ctx.Pipe(duplex=False)
        disarm = fault_rank >= 0 and rank != fault_rank
        proc = ctx.Process(
            target=rank_main,
            args=(rank_config, share, max_len, rank, write, disarm),
            daemon=True,
        )
        proc.start()
        write.close()
        procs.append(proc)
        reads.append(read)
    reports: list[WorkerReport] = []
    extra: dict[str, Any] = {"ranks": []}
    duration_s = 0.0
    for rank, (proc, read) in enumerate(zip(procs, reads, strict=True)):
        try:
            report, rank_s, rank_extra = read.recv()
        except EOFError:
            proc.join()
            report = WorkerReport([], [], 0, error=f"rank {rank} exited with {proc.exitcode}")
            rank_s, rank_extra = 0.0, {}
        proc.join()
        if on_finish is not None:
            on_finish(len(report.results))
        reports.append(report)
        duration_s = max(duration_s, rank_s)
        extra["ranks"].append(
            {"rank": rank, "device": devices[rank], "duration_s": round(rank_s, 3), **rank_extra}
        )
    return reports, duration_s, extra


def rank_main(
    config: RunConfig,
    requests: list[Request],
    max_len: int,
    rank: int,
    conn: Connection,
    disarm: bool = False,
) -> None:
    """A rank: its model and its own cache on its device; serve its share; report.

    `disarm`: drop the faults `kvscope run --inject` armed (another rank injects them).
    """
    if disarm:
        from kvscope.allocator import faults

        faults.configure(None)
    torch.set_num_threads(config.num_threads() or 1)
    extra: dict[str, Any] = {"pool": config.pool_name}
    duration_s = 0.0
    try:
        if config.device.startswith("cuda"):
            # Triton launches on the current device, not the tensors' own
            torch.cuda.set_device(torch.device(config.device))
        model = build_model(config)
        if config.baseline == "static":
            cache: Any = build_cache(config, max_len)
        else:
            cache = create_pool(config, max(r.n for r in requests) if requests else 1)
        publisher = start_kv_events(config, cache, rank=rank)
        try:
            engine = make_engine(config, model, cache, rank, max_len)
            if publisher is not None:
                engine.on_step = publisher.poll
            start = time.monotonic()
            engine.run(requests, start_s=start if config.clock == "wall" else None)
            duration_s = time.monotonic() - start
            extra |= cache_extra(cache) | engine_extra(engine)
            extra |= stop_kv_events(publisher, cache)
            publisher = None
        finally:
            if publisher is not None:
                publisher.close()
            release_cache(config, cache)
        results: list[RequestResult] = engine.results
        report = WorkerReport(results, engine.samples, engine.scheduler.num_preemptions)
    except BaseException:
        report = WorkerReport([], [], 0, error=f"rank {rank}:\n{traceback.format_exc()}")
    conn.send((report, duration_s, extra))
    conn.close()
