"""Worker processes: N engines serving from one shared pool, each a share of the requests.

The parent creates the pool; each worker loads the model, attaches to the pool by name, waits
for a common start, serves every N-th request and sends each result back as it finishes. A
prefix one worker computed is found by the others through the pool's prefix index.

A worker that dies (a crash, or `kill -9`) does not stop the others: the parent returns what it
held to the pool (`pool.reclaim_dead()`), reports its unfinished requests as failed, and the
survivors keep serving.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
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
    start_kv_events,
    start_time,
    stop_kv_events,
)
from .workload import Request

Outcome = tuple[list["WorkerReport"], float, dict[str, Any]]


@dataclass
class WorkerReport:
    """What one worker hands back (or, for a worker that died, what the parent knows)."""

    results: list[RequestResult]
    samples: list[StepSample]
    num_preemptions: int
    error: str = ""
    # set by the parent when the worker died before reporting: how it ended
    died: str = ""


def run_workers(
    config: RunConfig,
    requests: list[Request],
    max_len: int,
    on_finish: Callable[[int], None] | None,
) -> Outcome:
    """N worker processes; the paged ones share one pool created here."""
    max_n = max(r.n for r in requests)
    pool = create_pool(config, max_n) if config.baseline == "paged" else None
    publisher = None
    ctx: Any = mp.get_context("fork" if config.device == "cpu" else "spawn")
    go, start_value = ctx.Event(), ctx.Value("d", 0.0)
    shares = [requests[i :: config.workers] for i in range(config.workers)]
    procs, conns = [], {}
    for i, share in enumerate(shares):
        # One pipe per worker, written only by it: when it dies the parent reads EOF.
        read, write = ctx.Pipe(duplex=False)
        procs.append(
            ctx.Process(
                target=worker_main,
                args=(config, share, max_len, i, go, start_value, write),
                daemon=True,
            )
        )
        conns[read] = (i, write)
    reports: dict[int, WorkerReport] = {}
    results: dict[int, list[RequestResult]] = {i: [] for i in range(len(procs))}
    try:
        for proc in procs:
            proc.start()
        # after the fork: the publisher's thread and socket stay in this process
        publisher = start_kv_events(config, pool, thread=True)
        for _, write in conns.values():
            write.close()
        live = {read: i for read, (i, _) in conns.items()}
        _gather(live, procs, results, reports, pool, shares, kind="ready")
        start_value.value = time.monotonic()
        go.set()
        notify = on_finish or (lambda _n: None)
        _gather(live, procs, results, reports, pool, shares, kind="report", notify=notify)
        duration_s = time.monotonic() - start_value.value
        for proc in procs:
            proc.join()
        extra = cache_extra(pool) if pool is not None else {}
        extra |= stop_kv_events(publisher, pool)
        publisher = None
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        if publisher is not None:
            publisher.close()
        if pool is not None:
            release_cache(config, pool)
    died = [
        {"worker": i, "how": r.died, "failed": sum(1 for x in r.results if x.error)}
        for i, r in sorted(reports.items())
        if r.died
    ]
    if len(died) == len(procs):
        raise RuntimeError(
            "every worker died: " + ", ".join(f"worker {d['worker']} {d['how']}" for d in died)
        )
    if died:
        extra["workers_died"] = died
    return [reports[i] for i in range(len(procs))], duration_s, extra


def _gather(
    live: dict[Connection, int],
    procs: list[Any],
    results: dict[int, list[RequestResult]],
    reports: dict[int, WorkerReport],
    pool: Any,
    shares: list[list[Request]],
    *,
    kind: str,
    notify: Callable[[int], None] = lambda _n: None,
) -> None:
    """Read the workers' messages until every live one has sent `kind` ("ready": set up;
    "report": done); a worker whose pipe ends first died, and is dealt with on the spot."""
    waiting = set(live.values())
    while waiting & set(live.values()):
        for conn in wait(list(live), timeout=0.2):
            i = live[conn]  # type: ignore[index]
            try:
                what, payload = conn.recv()  # type: ignore[union-attr]
            except (EOFError, OSError):
                del live[conn]  # type: ignore[arg-type]
                reports[i] = _dead(i, procs[i], results[i], shares[i], pool)
                continue
            if what == "result":
                results[i].append(payload)
                notify(1)
            elif what == "ready":
                waiting.discard(i)
            elif what == "report":
                payload.results = results[i] + payload.results
                reports[i] = payload
                waiting.discard(i)
                del live[conn]  # type: ignore[arg-type]


def _dead(
    i: int, proc: Any, done: list[RequestResult], share: list[Request], pool: Any
) -> WorkerReport:
    """A worker died without reporting: reclaim what it held, fail its unfinished requests."""
    proc.join(timeout=5)
    code = proc.exitcode
    how = (
        f"killed by {signal.Signals(-code).name}"
        if code and code < 0
        else f"exited with code {code}"
    )
    finished = {r.request_id for r in done}
    failed = [
        RequestResult(
            r.request_id,
            r.arrival_s,
            len(r.prompt),
            error=f"worker {i} {how} before finishing it",
            worker=i,
        )
        for r in share
        if r.request_id not in finished
    ]
    reclaimed = ""
    if pool is not None:
        got = pool.reclaim_dead()
        reclaimed = f"; {got.get('blocks', 0)} blocks returned to the pool"
    print(
        f"serve.py: worker {i} (pid {proc.pid}) {how}{reclaimed}; "
        f"{len(failed)} of its requests failed, the other workers keep serving",
        file=sys.stderr,
        flush=True,
    )
    return WorkerReport(done + failed, [], 0, died=how)


def worker_main(
    config: RunConfig,
    requests: list[Request],
    max_len: int,
    worker: int,
    go: Any,
    start_value: Any,
    conn: Connection,
) -> None:
    """A worker process: load the model, attach the pool, serve its requests, report."""
    torch.set_num_threads(config.num_threads() or 1)
    is_ready = False
    try:
        model = build_model(config)
        if config.baseline == "static":
            cache = build_cache(config, max_len, config.workers)
        else:
            from kvscope.allocator import KVPool

            cache = KVPool.attach(config.pool_name)
        engine = make_engine(config, model, cache, worker, max_len)
        # Each result goes back as soon as it is final: a worker that dies later loses only
        # its unfinished requests.
        engine.on_finish = lambda result: conn.send(("result", result))
        conn.send(("ready", worker))
        is_ready = True
        go.wait()
        engine.run(requests, start_s=start_time(config, start_value.value))
        report = WorkerReport([], engine.samples, engine.scheduler.num_preemptions)
        cache.close()
    except BaseException:
        if not is_ready:
            conn.send(("ready", worker))
        report = WorkerReport([], [], 0, error=traceback.format_exc())
    conn.send(("report", report))
    conn.close()
