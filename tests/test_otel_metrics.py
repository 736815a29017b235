"""Every pool metric's name, unit, attributes and value after a known sequence of operations."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk._logs import LoggerProvider
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvscope.allocator import Finding, KVPool
from kvscope.probes.otel import KVPoolInstrumentor
from kvscope.probes.otel_metrics import POOL_METRICS, pool_attributes

BS = 4
# 1 layer x (K, V) x 4 slots x 2 heads x 8 dims x 4 bytes.
BLOCK_BYTES = 2 * BS * 2 * 8 * 4


@dataclass
class Otel:
    """In-memory providers and the instrumentor under test."""

    reader: InMemoryMetricReader
    spans: InMemorySpanExporter
    logs: InMemoryLogRecordExporter
    inst: KVPoolInstrumentor
    providers: tuple[Any, Any, Any]

    def metrics(self) -> dict[str, Any]:
        """name -> Metric of one collection."""
        data = self.reader.get_metrics_data()
        if data is None:
            return {}
        return {
            m.name: m for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics
        }

    def instrument(self, **kw: Any) -> None:
        self.inst.instrument(*self.providers, **kw)


def points(metric: Any, **match: str) -> list[Any]:
    """Data points of a metric whose attributes include `match` (keys with dots as __)."""
    want = {k.replace("__", "."): v for k, v in match.items()}
    return [
        p for p in metric.data.data_points if all(p.attributes.get(k) == v for k, v in want.items())
    ]


def value(metric: Any, **match: str) -> Any:
    """The one matching point's value (sum/gauge) or count (histogram)."""
    (p,) = points(metric, **match)
    return p.count if hasattr(p, "count") else p.value


@pytest.fixture
def otel():
    """GIVEN in-memory metric, span and log readers; uninstrumented again after the test."""
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    spans = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(spans))
    logs = InMemoryLogRecordExporter()
    lp = LoggerProvider()
    lp.add_log_record_processor(SimpleLogRecordProcessor(logs))
    o = Otel(reader, spans, logs, KVPoolInstrumentor(), (mp, tp, lp))
    yield o
    o.inst.uninstrument()
    mp.shutdown()


def known_sequence(pool: KVPool) -> dict[str, Any]:
    """a (10 tokens), published; b shares a's 2 full blocks; c forks b and copies on write; a freed."""
    a = pool.allocate("a", list(range(10)))
    pool.mark_computed(a, 8)
    b = pool.allocate("b", list(range(8)) + [50, 51])
    c = pool.fork(b, "c")
    pool.append(c, [7])
    pool.free(a)
    return {"b": b, "c": c}


def test_pool_metrics_after_a_known_sequence(otel, make_pool):
    # GIVEN an instrumented process that collects, and a 16-block pool without local caches
    otel.instrument(collect=True)
    pool = make_pool(16, block_size=BS, local_cache_size=0)
    # WHEN the known sequence runs
    known_sequence(pool)
    m = otel.metrics()
    # THEN every pool metric has its unit, the pool's attributes and the expected value
    # (no finding was reported: the findings counter has a series at 0 for each of the pool's
    # kinds, so the first finding of one is an increase)
    assert {s.name for s in POOL_METRICS} - set(m) == set()
    zero = m["kvscope.pool.findings"].data.data_points
    assert {p.attributes["kvscope.finding.kind"] for p in zero} >= {"double_free", "leak_finished"}
    assert all(p.value == 0 for p in zero)
    assert not any(p.attributes["kvscope.finding.kind"].startswith("kv_event_") for p in zero)
    for spec in POOL_METRICS[:-5] + POOL_METRICS[-4:]:
        assert m[spec.name].unit == spec.unit, spec.name
        for p in m[spec.name].data.data_points:
            assert set(p.attributes) == set(spec.attributes), spec.name
            assert p.attributes["kvscope.pool.name"] == pool.name
            assert p.attributes["kvscope.pool.device"] == "cpu"
    expected = {
        "kvscope.pool.allocations": 5,
        "kvscope.pool.frees": 3,
        "kvscope.pool.cow_copies": 1,
        "kvscope.pool.evictions": 0,
        "kvscope.pool.preemptions": 0,
        "kvscope.pool.prefix.queries": 4,
        "kvscope.pool.prefix.hits": 2,
        "kvscope.pool.forks": 1,
        "kvscope.pool.exhausted": 0,
        "kvscope.pool.utilization": 4 / 16,
        "kvscope.pool.internal_fragmentation": 3 / 16,
        "kvscope.pool.refcount.peak": 2,
        "kvscope.pool.prefix.hit_rate": 0.5,
        "kvscope.pool.sequences": 2,
        "kvscope.pool.requests.idle": 0,
        "kvscope.pool.memory.limit": 16 * BLOCK_BYTES,
    }
    for name, v in expected.items():
        assert value(m[name]) == pytest.approx(v), name
    blocks = m["kvscope.pool.blocks"]
    assert {p.attributes["kvscope.block.state"]: p.value for p in blocks.data.data_points} == {
        "free": 12,
        "allocated": 4,
        "cached": 0,
        "local": 0,
        "quarantined": 0,
    }
    assert (
        value(m["kvscope.pool.memory.usage"], kvscope__block__state="allocated") == 4 * BLOCK_BYTES
    )
    assert m["kvscope.pool.blocks"].data.__class__.__name__ == "Gauge"
    assert m["kvscope.pool.allocations"].data.is_monotonic
    assert value(m["kvscope.pool.lock.acquisitions"], kvscope__lock__name="seqs") >= 4


def test_counters_after_freeing_everything_and_evicting(otel, make_pool):
    otel.instrument(collect=True)
    pool = make_pool(16, block_size=BS, local_cache_size=0)
    seqs = known_sequence(pool)
    # WHEN b and c end and the two cached prefix blocks are evicted
    pool.free(seqs["b"])
    pool.free(seqs["c"])
    assert pool.evict(8) == 2
    m = otel.metrics()
    # THEN frees count every dropped reference, the evictions show, nothing is held
    assert value(m["kvscope.pool.frees"]) == 9
    assert value(m["kvscope.pool.evictions"]) == 2
    assert value(m["kvscope.pool.utilization"]) == 0
    assert value(m["kvscope.pool.blocks"], kvscope__block__state="free") == 16
    # AND a block lifetime was recorded for each block whose last reference went away
    assert value(m["kvscope.block.lifetime"]) == 5
    assert m["kvscope.block.lifetime"].unit == "s"


def test_per_process_histograms(otel, make_pool):
    otel.instrument()
    pool = make_pool(16, block_size=BS, local_cache_size=0)
    known_sequence(pool)
    m = otel.metrics()
    # THEN one duration per outer operation (allocate's inner append is not counted twice)
    ops = m["kvscope.pool.operation.duration"]
    assert ops.unit == "s"
    counts = {p.attributes["kvscope.operation"]: p.count for p in ops.data.data_points}
    assert counts == {"allocate": 2, "mark_computed": 1, "fork": 1, "append": 1, "free": 1}
    # AND lock waits and holds per lock, one of each per acquisition
    wait, hold = m["kvscope.lock.wait.duration"], m["kvscope.lock.hold.duration"]
    assert wait.unit == hold.unit == "s"
    assert value(wait, kvscope__lock__name="seqs") == value(hold, kvscope__lock__name="seqs") >= 4
    assert all(p.sum >= 0 for p in hold.data.data_points)
    # AND without collect=True no pool-level metric comes from this process
    assert not {s.name for s in POOL_METRICS} & set(m)


def test_a_failed_operation_records_its_error_type(otel, make_pool):
    from kvscope.allocator import PoolExhausted

    otel.instrument()
    pool = make_pool(4, block_size=BS, local_cache_size=0)
    pool.allocate("held", list(range(12)))
    with pytest.raises(PoolExhausted):
        pool.allocate("big", list(range(100, 108)))
    ops = otel.metrics()["kvscope.pool.operation.duration"]
    # THEN the success and the failure are two series of the allocate latency
    errors = {
        p.attributes.get("error.type"): p.count for p in points(ops, kvscope__operation="allocate")
    }
    assert errors == {None: 1, "PoolExhausted": 1}


def test_findings_counted_by_kind_and_logged(otel, make_pool):
    otel.instrument(collect=True)
    pool = make_pool(16, block_size=BS)
    # WHEN three findings are reported to the pool
    pool.report(Finding("leak_orphan", "block 3 has a reference but no owner", block=3))
    pool.report(Finding("leak_orphan", "block 4 has a reference but no owner", block=4))
    pool.report(Finding("double_free", "block 5 was freed twice", block=5, request="r9"))
    m = otel.metrics()
    f = m["kvscope.pool.findings"]
    # THEN the counter has one series per kind with its severity
    assert value(f, kvscope__finding__kind="leak_orphan") == 2
    (p,) = points(f, kvscope__finding__kind="double_free")
    assert p.value == 1 and p.attributes["kvscope.finding.severity"] == "error"
    # AND each finding is one log record, counted again by no later collection
    assert value(otel.metrics()["kvscope.pool.findings"], kvscope__finding__kind="leak_orphan") == 2
    logs = [r.log_record for r in otel.logs.get_finished_logs()]
    assert [r.body for r in logs][-1] == "block 5 was freed twice"
    assert len(logs) == 3
    last = logs[-1]
    assert last.severity_text == "ERROR"
    assert last.attributes["kvscope.finding.kind"] == "double_free"
    assert last.attributes["kvscope.request.id"] == "r9"
    assert last.attributes["kvscope.pool.name"] == pool.name


def test_a_pool_used_by_two_processes_is_counted_once(otel, make_pool):
    # GIVEN the collector in this process and the instrumentation inherited by a forked child
    otel.instrument(collect=True)
    pool = make_pool(32, block_size=BS, local_cache_size=0)
    pool.allocate("parent", list(range(8)))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            child = KVPool.attach(pool.name)
            for i in range(3):
                child.free(child.allocate(f"child-{i}", list(range(100, 112))))
            child.close()
            # The inherited collector reports nothing in the child.
            names = set(otel.metrics())
            os.write(w, b"none" if not {s.name for s in POOL_METRICS} & names else b"dup")
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert os.read(r, 10) == b"none"
    os.close(r)
    # WHEN the parent collects
    m = otel.metrics()
    # THEN both processes' allocations appear exactly once
    assert value(m["kvscope.pool.allocations"]) == 2 + 3 * 3
    assert value(m["kvscope.pool.frees"]) == 9
    assert value(m["kvscope.pool.blocks"], kvscope__block__state="allocated") == 2


def test_uninstrument_restores_everything(otel, make_pool):
    pool = make_pool(16, block_size=BS)
    before = {n: getattr(KVPool, n) for n in ("allocate", "free", "append", "fork")}
    otel.instrument(pools=[pool])
    # (the locks are not wrapped: their wait and hold times come from the segment)
    assert "allocate" in vars(pool) and "acquire" not in vars(pool.locks)
    assert KVPool.allocate is before["allocate"]
    otel.inst.uninstrument()
    assert "allocate" not in vars(pool) and "acquire" not in vars(pool.locks)
    assert pool.on_finding is None
    otel.instrument()
    assert KVPool.allocate is not before["allocate"]
    otel.inst.uninstrument()
    assert {n: getattr(KVPool, n) for n in before} == before
    # AND an uninstrumented pool records nothing more
    pool.free(pool.allocate("x", [1, 2, 3]))
    assert "kvscope.pool.operation.duration" not in otel.metrics()


def test_every_exported_metric_is_documented(otel, make_pool):
    from pathlib import Path

    from kvscope.probes.nvml import GpuMetrics
    from tests.test_otel_nvml import FakeNvml, collect

    # GIVEN every metric this process and the fake GPU export after a run with a finding
    otel.instrument(collect=True)
    pool = make_pool(16, block_size=BS)
    pool.free(pool.allocate("r", list(range(9))))
    pool.report(Finding("leak_orphan", "orphan", block=1))
    names = set(otel.metrics()) | set(collect(GpuMetrics(nvml=FakeNvml())))
    doc = (Path(__file__).resolve().parents[1] / "docs" / "METRICS.md").read_text()
    # THEN docs/METRICS.md has a table row for each, with its unit
    rows = {
        line.split("|")[1].strip(" `"): line for line in doc.splitlines() if line.startswith("| `")
    }
    assert names - set(rows) == set()
    for spec in POOL_METRICS:
        assert f"| `{spec.unit}` |" in rows[spec.name], spec.name


def test_a_gpu_pool_s_series_carry_its_gpu_s_nvml_index(monkeypatch):
    # GIVEN pools on the CPU and on two GPUs (one pool per rank)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    # THEN a GPU pool's attributes name its GPU as the hw.gpu.* series do; a CPU pool's do not
    assert pool_attributes("p", "cpu") == {"kvscope.pool.name": "p", "kvscope.pool.device": "cpu"}
    assert pool_attributes("p-rank1", "cuda:1") == {
        "kvscope.pool.name": "p-rank1",
        "kvscope.pool.device": "cuda:1",
        "kvscope.gpu.index": 1,
    }
    assert pool_attributes("p-rank0", "cuda")["kvscope.gpu.index"] == 0
    # AND under CUDA_VISIBLE_DEVICES, cuda:1 is the second GPU listed (NVML numbers them all)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert pool_attributes("p-rank1", "cuda:1")["kvscope.gpu.index"] == 5


def test_the_doc_says_where_the_instrumentor_comes_from_and_its_metrics_move(make_pool):
    # GIVEN docs/METRICS.md, read by someone instrumenting their own engine
    doc = (Path(__file__).resolve().parents[1] / "docs" / "METRICS.md").read_text()
    (line,) = re.findall(r"`(from kvscope\.[a-z_.]+ import KVPoolInstrumentor)`", doc)
    scope: dict = {}
    exec(line, scope)

    # WHEN the import it names instruments a pool with collect=True and an in-memory reader
    reader = InMemoryMetricReader()
    pool = make_pool(32)
    inst = scope["KVPoolInstrumentor"]()
    inst.instrument(
        meter_provider=MeterProvider(metric_readers=[reader]), collect=True, pools=[pool]
    )
    try:
        pool.allocate(7, np.arange(10))

        def allocated() -> list:
            return [
                p.value
                for rm in reader.get_metrics_data().resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
                if m.name == "kvscope.pool.blocks"
                for p in m.data.data_points
                if p.attributes.get("kvscope.block.state") == "allocated"
            ]

        # THEN the pool's blocks gauge shows the request's 3 blocks under the documented names
        assert allocated() == [3]
    finally:
        inst.uninstrument()
