"""Metrics read from the segment: the same values whether the C core or the Python path ran the
operations (lock wait and hold included), and per-lock histograms that add up to the records."""

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


def _run(make_pool: Any, monkeypatch: Any, native: bool) -> tuple[dict, KVPool, np.ndarray]:
    """(metric values, the pool, its lock records before the run) of one instrumented run."""
    monkeypatch.setenv("KVSCOPE_NATIVE", "1" if native else "0")
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    inst = KVPoolInstrumentor()
    pool = make_pool(24, block_size=4, local_cache_size=0, num_shards=2)
    assert (pool._native is not None) == native
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


def _pool_and_op_values(values: dict) -> dict:
    """Every series but the per-lock ones, durations as counts (two runs never take the same
    time). The lock series count real acquisitions, and the C core takes a different number of
    them for some operations (docs/FORMAT.md, "Differences in how, not what"): they are checked
    against the lock records on each path instead."""
    return {
        k: v[0] if isinstance(v, tuple) else v
        for k, v in values.items()
        if "kvscope.lock.name" not in dict(k[1:])
    }


@pytest.mark.slow
def test_c_core_and_python_path_publish_the_same_metrics(make_pool, monkeypatch):
    # GIVEN the same seeded run on a pool on the C core and on one on the Python path
    native, npool, _ = _run(make_pool, monkeypatch, native=True)
    python, ppool, _ = _run(make_pool, monkeypatch, native=False)
    assert npool._native.stats()["native_ops"] > 100  # the core really ran them
    # WHEN their metrics are collected
    # THEN every pool counter and gauge, the operation counts and block lifetimes are equal
    assert _pool_and_op_values(native) == _pool_and_op_values(python)
    assert len(_pool_and_op_values(native)) > 20
    # AND both publish every lock's wait and hold histograms (test below: they add up)
    for values in (native, python):
        holds = [k for k in values if k[0] == "kvscope.lock.hold.duration"]
        assert {dict(k[1:])["kvscope.lock.name"] for k in holds} >= {"seqs", "free", "index.0"}
    assert native[("kvscope.pool.allocations", ("kvscope.pool.device", "cpu"))] > 100


@pytest.mark.parametrize("native", [True, False], ids=["c-core", "python"])
def test_lock_histograms_add_up_to_the_lock_records(make_pool, monkeypatch, native):
    # GIVEN one instrumented run (the C core's acquisitions were invisible to the old wrapper)
    values, pool, before = _run(make_pool, monkeypatch, native)
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
