"""OpenTelemetry instrumentation of KVPool: per-process histograms, request spans, pool metrics.

    from kvscope.probes.otel import KVPoolInstrumentor

    inst = KVPoolInstrumentor()
    inst.instrument(meter_provider=mp, tracer_provider=tp, collect=True)
    pool = KVPool.create("demo", PoolConfig(num_blocks=1024))  # every pool opened from now on
    ...
    inst.uninstrument()                                          # methods restored exactly

While instrumented, the KVPool operations are wrapped (the class, or only the given `pools`):
each records `kvscope.pool.operation.duration`; allocate/fork start a `kvscope.request` span
that free/abort end, with the request's block events (otel_traces.py); a finding reported in
this process becomes an event on its request's span. Lock wait and hold times are read from
the segment's lock records (what each operation added to them: otel_locks.py), which the C
core keeps. Pool
gauges and counters are read from the segment by ONE collector (`collect=True`,
otel_metrics.py); under `kvscope run` the supervisor runs it, so a pool shared by several
processes is counted once. Setup from OTEL_* variables: otel_exporters.py. Cost:
docs/METRICS.md (bench/bench_metrics.py measures it).
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import metrics, trace

from kvscope.allocator import pool as pool_module
from kvscope.allocator.pool import KVPool
from kvscope.probes.otel_locks import LockTimes
from kvscope.probes.otel_metrics import DEVICE, POOL, PoolCollector
from kvscope.probes.otel_traces import RequestSpans

__all__ = ["KVPoolInstrumentor"]

WRAPPED = (
    "allocate", "append", "fork", "free", "abort", "resume", "evict", "mark_computed",
    "mark_computed_many",
)  # fmt: skip
OP = "kvscope.operation"
# Bucket boundaries in seconds: pool operations and lock times are microseconds to milliseconds.
OP_BUCKETS = (
    1e-6,
    2.5e-6,
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    0.1,
    1.0,
)
LIFETIME_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)
SCOPE = "kvscope.probes.otel"
_MISSING = object()


class KVPoolInstrumentor:
    """Instruments KVPool with OpenTelemetry meters and tracers; symmetric instrument/uninstrument."""

    def __init__(self) -> None:
        self._on = False
        self._local = threading.local()
        self._pools: list[KVPool] = []
        self._saved: list[tuple[object, str, Any]] = []
        self._requests: RequestSpans | None = None
        self.collector: PoolCollector | None = None

    @property
    def is_instrumented(self) -> bool:
        """True between instrument() and uninstrument()."""
        return self._on

    def instrument(
        self,
        meter_provider: Any = None,
        tracer_provider: Any = None,
        logger_provider: Any = None,
        pools: Iterable[KVPool] | None = None,
        collect: bool = False,
        pool_names: Callable[[], Iterable[str]] | None = None,
    ) -> None:
        """Wrap KVPool (or only `pools`); with collect, also report pool metrics from segments.

        Args:
            collect: run the pool collector in this process (one process per pool should).
            pool_names: what the collector reads (default: the pools this instrumentor saw).
        """
        assert not self._on, "already instrumented"
        mp = meter_provider or metrics.get_meter_provider()
        meter = mp.get_meter(SCOPE)
        tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(SCOPE)
        self._requests = RequestSpans(tracer)
        self._op_hist = meter.create_histogram(
            "kvscope.pool.operation.duration",
            "s",
            "Duration of a pool operation in this process.",
            explicit_bucket_boundaries_advisory=OP_BUCKETS,
        )
        self._wait_hist = meter.create_histogram(
            "kvscope.lock.wait.duration",
            "s",
            "Time an acquisition of a pool lock waited behind another holder.",
            explicit_bucket_boundaries_advisory=OP_BUCKETS,
        )
        self._hold_hist = meter.create_histogram(
            "kvscope.lock.hold.duration",
            "s",
            "Time a pool lock was held.",
            explicit_bucket_boundaries_advisory=OP_BUCKETS,
        )
        self._locks = LockTimes(self._wait_hist, self._hold_hist)
        self._life_hist = meter.create_histogram(
            "kvscope.block.lifetime",
            "s",
            "Allocation to last reference dropped, per block.",
            explicit_bucket_boundaries_advisory=LIFETIME_BUCKETS,
        )
        given = list(pools) if pools is not None else None
        for name in WRAPPED:
            if given is None:
                self._patch(KVPool, name, self._wrap(name, getattr(KVPool, name)))
            for p in given or []:
                self._patch(p, name, types.MethodType(self._wrap(name, getattr(KVPool, name)), p))
        for p in given or []:
            self._attach(p)
        if given is None:
            pool_module.OPEN_HOOKS.append(self._attach)
        self._on = True
        if collect:
            logger = logger_provider.get_logger(SCOPE) if logger_provider is not None else None
            names = pool_names or (lambda: sorted({p.name for p in self._pools}))
            self.collector = PoolCollector(meter, names, logger=logger)

    def uninstrument(self) -> None:
        """Restore every wrapped method and hook exactly; end open request spans."""
        if not self._on:
            return
        if self._attach in pool_module.OPEN_HOOKS:
            pool_module.OPEN_HOOKS.remove(self._attach)
        for obj, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._saved.clear()
        if self._requests is not None:
            self._requests.end_all()
        if self.collector is not None:
            self.collector.close()
            self.collector = None
        self._pools.clear()
        self._on = False

    # -- wrapping ------------------------------------------------------------------------------

    def _patch(self, obj: object, name: str, new: Any) -> None:
        self._saved.append((obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, new)

    def _attach(self, pool: KVPool) -> None:
        """Per pool: see its findings (restored on uninstrument)."""
        self._pools.append(pool)
        previous = pool.on_finding

        def on_finding(finding: Any) -> None:
            if previous is not None:
                previous(finding)
            if self._requests is not None:
                self._requests.finding_event(pool, finding)

        self._patch(pool, "on_finding", on_finding)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(pool: KVPool, *args: Any, **kw: Any) -> Any:
            local = self._local
            if getattr(local, "depth", 0):
                # Inner calls (resume -> allocate, allocate -> append) belong to the outer op.
                return original(pool, *args, **kw)
            local.depth = 1
            # Under the mapping's op mutex (which the operation takes itself, reentrantly): no
            # other thread's operation adds to the lock records between the two reads.
            with pool.op_mutex:
                before = self._locks.snapshot(pool)
                try:
                    return self._call(name, original, pool, args, kw)
                finally:
                    local.depth = 0
                    self._locks.record(pool, before)

        wrapper.__name__ = wrapper.__qualname__ = name
        wrapper.__doc__ = original.__doc__
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _call(
        self, name: str, original: Callable[..., Any], pool: KVPool, args: tuple, kw: dict
    ) -> Any:
        attrs = {POOL: pool.name, DEVICE: pool.config.device, OP: name}
        before = _blocks_before(pool, args) if name in ("free", "abort") else None
        preempted = int(pool.counters["num_preemptions"][0]) if not pool.closed else 0
        start_ns = time.time_ns()
        t0 = time.perf_counter_ns()
        try:
            result = original(pool, *args, **kw)
        except BaseException as e:
            self._op_hist.record(
                (time.perf_counter_ns() - t0) * 1e-9, {**attrs, "error.type": type(e).__name__}
            )
            raise
        self._op_hist.record((time.perf_counter_ns() - t0) * 1e-9, attrs)
        requests = self._requests
        assert requests is not None
        getattr(requests, "after_" + name, _nothing)(pool, args, result, start_ns)
        if before is not None:
            self._lifetimes(pool, *before, attrs={POOL: pool.name, DEVICE: pool.config.device})
        if not pool.closed and int(pool.counters["num_preemptions"][0]) > preempted:
            requests.mark_preempted(pool)
        return result

    def _lifetimes(self, pool: KVPool, ids: Any, alloc_ns: Any, attrs: dict[str, str]) -> None:
        """Record allocation-to-free time of the blocks whose last reference this free dropped."""
        if pool.closed or not len(ids):
            return
        now = time.time_ns()
        gone = pool.view.blocks["refcount"][ids] == 0
        for t in alloc_ns[gone].tolist():
            self._life_hist.record(max(0, now - t) * 1e-9, attrs)


def _blocks_before(pool: KVPool, args: tuple) -> tuple[Any, Any] | None:
    """(block ids, their alloc_ns) of the sequence about to be freed."""
    import numpy as np

    seq = args[0] if args else None
    table = getattr(seq, "block_table", None)
    if not table or pool.closed:
        return None
    ids = np.asarray(table, np.int64)
    return ids, pool.view.blocks["alloc_ns"][ids].astype(np.int64)


def _nothing(*args: Any) -> None:
    return None
