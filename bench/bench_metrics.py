"""Cost of the OpenTelemetry instrumentation (probes/otel.py) per pool operation, in one run.

    python bench/bench_metrics.py               # ~30 s
    python bench/bench_metrics.py --quick

One request = allocate of a 100-token prompt + 20 single-token appends + free (22 operations)
on a 4096-block CPU pool. The same pool runs rounds of requests plainly and instrumented
(`KVPoolInstrumentor` on that pool: the operation, lock wait/hold and block-lifetime
histograms, a request span per sequence; an in-memory metric reader, a tracer provider without
exporters), alternating so that load changes hit both alike; the median of each is reported,
with the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid

from kvscope.allocator import KVPool, PoolConfig

OPS_PER_REQUEST = 22


def requests(pool: KVPool, n: int) -> float:
    """Seconds per request over n requests."""
    prompt = list(range(100))
    t0 = time.perf_counter()
    for i in range(n):
        seq = pool.allocate(f"r{i}", prompt)
        for t in range(20):
            pool.append(seq, [t])
        pool.free(seq)
    return (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter rounds")
    args = ap.parse_args()
    rounds, n = (5, 100) if args.quick else (15, 300)
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    from kvscope.probes.otel import KVPoolInstrumentor

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    load_before = os.getloadavg()
    pool = KVPool.create(
        f"bmetrics-{uuid.uuid4().hex[:8]}",
        PoolConfig(num_blocks=4096, block_size=16, num_layers=1, head_dim=8, dtype="float16"),
    )
    reader = InMemoryMetricReader()
    mp, tp = MeterProvider(metric_readers=[reader]), TracerProvider()
    inst = KVPoolInstrumentor()
    plain: list[float] = []
    instrumented: list[float] = []
    gc.disable()
    try:
        requests(pool, n // 5)  # warm up both ways
        inst.instrument(mp, tp, pools=[pool])
        requests(pool, n // 5)
        inst.uninstrument()
        for _ in range(rounds):
            plain.append(requests(pool, n))
            inst.instrument(mp, tp, pools=[pool])
            instrumented.append(requests(pool, n))
            inst.uninstrument()
            reader.get_metrics_data()  # the reader's periodic collection, outside the timing
    finally:
        gc.enable()
        pool.close()
        pool.unlink()
        mp.shutdown()
    a, b = statistics.median(plain), statistics.median(instrumented)
    per_op = (b - a) / OPS_PER_REQUEST
    print(f"{rounds} rounds of {n} requests each way")
    print(f"plain:        {a * 1e6:8.1f} us/request")
    print(f"instrumented: {b * 1e6:8.1f} us/request  ({b / a:.1f}x)")
    print(f"cost:         {per_op * 1e6:8.1f} us per operation ({OPS_PER_REQUEST} per request)")
    after = os.getloadavg()
    print(
        f"load average (1/5/15 min): before {load_before[0]:.2f}/{load_before[1]:.2f}/"
        f"{load_before[2]:.2f}, after {after[0]:.2f}/{after[1]:.2f}/{after[2]:.2f}; "
        f"{os.cpu_count()} CPUs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
