"""Metrics read from the segment: pool counters and gauges, operation counts and block lifetimes,
and per-lock histograms that add up to the lock records."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvscope.allocator import KVPool, PoolExhausted
from kvscope.probes.otel import KVPoolInstrumentor

POOL = "kvscope.pool.name"


def _drive(pool: KVPool, steps: int = 300) -> None:
    """A seeded serving-shaped run: shared prompts, decode appends, publication, forks, frees,
    aborts and a pool small enough to evict (every op here is one the C core runs)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(100) for _ in range(9)] for _ in range(3)]
    live: list[Any] = []
    for i in range(steps):
        r = rng.random()
        try:
            if r < 0.3 or not live:
                own = [rng.randrange(100) for _ in range(rng.randrange(1, 6))]
                live.append(pool.allocate(f"r{i}", rng.choice(prompts) + own))
            elif r < 0.7:
                pool.append(rng.choice(live), [rng.randrange(100)])
            elif r < 0.8:
                s = rng.choice(live)
                pool.mark_computed(s, s.num_tokens)
            elif r < 0.85:
                live.append(pool.fork(rng.choice(live), f"f{i}"))
            elif r < 0.95:
                pool.free(live.pop(rng.randrange(len(live))))
            else:
                pool.abort(live.pop(rng.randrange(len(live))))
        except PoolExhausted:
            pool.free(live.pop(0))
    for s in live:
        pool.free(s)


def _run(make_pool: Any) -> tuple[dict, KVPool, np.ndarray]:
    """(metric values, the pool, its lock records before the run) of one instrumented run."""
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    inst = KVPoolInstrumentor()
    pool = make_pool(24, block_size=4, local_cache_size=0, num_shards=2)
    before = pool.view.locks.copy()
    inst.instrument(mp, pools=[pool], collect=True, pool_names=lambda: [pool.name])
    try:
        _drive(pool)
        data = reader.get_metrics_data()
    finally:
        inst.uninstrument()
        mp.shutdown()
    values: dict[tuple, Any] = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    key = (m.name, *sorted((k, v) for k, v in p.attributes.items() if k != POOL))
                    values[key] = (p.count, p.sum) if hasattr(p, "count") else p.value
    return values, pool, before


def test_a_run_publishes_pool_operation_and_lock_metrics(make_pool):
    # GIVEN a seeded run on a pool
    values, pool, _ = _run(make_pool)
    # WHEN its metrics are collected
    # THEN pool counters and gauges, operation counts and block lifetimes are there, and every
    # lock's wait and hold histograms (test below: they add up), and they count what ran
    assert len([k for k in values if "kvscope.lock.name" not in dict(k[1:])]) > 20
    holds = [k for k in values if k[0] == "kvscope.lock.hold.duration"]
    assert {dict(k[1:])["kvscope.lock.name"] for k in holds} >= {"seqs", "free", "index.0"}
    cpu = ("kvscope.pool.device", "cpu")
    assert values[("kvscope.pool.allocations", cpu)] == pool.stats()["num_allocs"] > 100


def test_lock_histograms_add_up_to_the_lock_records(make_pool):
    # GIVEN one instrumented run
    values, pool, before = _run(make_pool)
    after = pool.view.locks
    # WHEN each lock's histograms are compared with what the run added to its record
    for i, name in enumerate(pool.locks.names):
        attrs = ("kvscope.lock.name", name)
        key = attrs, ("kvscope.pool.device", "cpu")
        acquired = int(after["num_acquires"][i] - before["num_acquires"][i])
        held_s = int(after["hold_ns"][i] - before["hold_ns"][i]) * 1e-9
        waited_s = int(after["wait_ns"][i] - before["wait_ns"][i]) * 1e-9
        hold = values.get(("kvscope.lock.hold.duration", *key), (0, 0.0))
        wait = values.get(("kvscope.lock.wait.duration", *key), (0, 0.0))
        # THEN count and sum are exactly the record's acquisitions and hold/wait time
        assert hold[0] == wait[0] == acquired, name
        assert hold[1] == pytest.approx(held_s, rel=1e-9, abs=1e-12), name
        assert wait[1] == pytest.approx(waited_s, rel=1e-9, abs=1e-12), name
        # AND the collector's lock counters are the record's totals
        assert values[("kvscope.pool.lock.acquisitions", *key)] == int(after["num_acquires"][i])
    seqs = ("kvscope.lock.name", "seqs"), ("kvscope.pool.device", "cpu")
    assert values[("kvscope.lock.hold.duration", *seqs)][0] > 50
