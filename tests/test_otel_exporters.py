"""Exporters from OTEL_* and flags: an OTLP receiver in the test, a real Prometheus scrape."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvscope.allocator import Finding
from kvscope.probes.otel_config import (
    OtelConfigError,
    add_otel_arguments,
    exporter_names,
    otel_env_from_args,
    otlp_target,
)
from kvscope.probes.otel_exporters import install_from_env
from tests.ranks_check import free_port, scrape_two_ranks

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")


def test_exporters_and_endpoints_follow_the_otel_variables():
    env = {"OTEL_METRICS_EXPORTER": "console, Prometheus", "OTEL_TRACES_EXPORTER": "none"}
    assert exporter_names(env, "metrics") == ["console", "prometheus"]
    assert exporter_names(env, "traces") == [] == exporter_names({}, "logs")
    assert otlp_target({}, "metrics") == ("http/protobuf", "http://localhost:4318/v1/metrics")
    base = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x",
    }
    assert otlp_target(base, "metrics") == ("http/protobuf", "http://c:4318/v1/metrics")
    assert otlp_target(base, "traces") == ("http/protobuf", "http://t/x")
    assert otlp_target({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "logs") == (
        "grpc",
        "http://localhost:4317",
    )
    with pytest.raises(OtelConfigError, match="OTEL_TRACES_EXPORTER='prometheus'"):
        exporter_names({"OTEL_TRACES_EXPORTER": "prometheus"}, "traces")
    with pytest.raises(OtelConfigError, match="http/json"):
        otlp_target({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "metrics")


def test_run_flags_become_otel_variables():
    parser = argparse.ArgumentParser()
    add_otel_arguments(parser)
    args = parser.parse_args(
        [
            "--metrics-exporter",
            "prometheus,otlp",
            "--otlp-protocol",
            "grpc",
            "--prometheus-port",
            "9999",
            "--service-name",
            "llm-a",
            "--metrics-interval",
            "2.5",
        ]
    )
    assert otel_env_from_args(args) == {
        "OTEL_METRICS_EXPORTER": "prometheus,otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_PROMETHEUS_PORT": "9999",
        "OTEL_SERVICE_NAME": "llm-a",
        "OTEL_METRIC_EXPORT_INTERVAL": "2500",
    }
    assert otel_env_from_args(parser.parse_args([])) == {}
    with pytest.raises(OtelConfigError):
        otel_env_from_args(parser.parse_args(["--traces-exporter", "zipkin"]))


def test_nothing_is_installed_without_an_exporter():
    assert install_from_env({"OTEL_SERVICE_NAME": "x"}) is None


class _Receiver(BaseHTTPRequestHandler):
    """Collects OTLP/HTTP posts: path -> list of bodies."""

    bodies: dict[str, list[bytes]] = {}

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        assert self.headers["Content-Type"] == "application/x-protobuf"
        self.bodies.setdefault(self.path, []).append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def receiver():
    """An OTLP/HTTP receiver on 127.0.0.1 (ephemeral port)."""
    _Receiver.bodies = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield server, _Receiver.bodies
    server.shutdown()
    server.server_close()


def test_otlp_http_export_decodes_as_protobuf(receiver, make_pool):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="the otel extra")
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    server, bodies = receiver
    # GIVEN every signal sent over OTLP/HTTP to the receiver, this process collecting
    env = {
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
        "OTEL_SERVICE_NAME": "kvscope-test",
        "KVSCOPE_OTEL_COLLECT": "1",
    }
    tel = install_from_env(env)
    assert tel is not None
    # WHEN a pool serves a request and reports a finding, and the process shuts telemetry down
    pool = make_pool(16, block_size=4)
    pool.free(pool.allocate("r1", list(range(9))))
    pool.report(Finding("leak_orphan", "block 3 has a reference but no owner", block=3))
    tel.shutdown()
    # THEN the receiver got protobuf exports of all three signals
    metrics = ExportMetricsServiceRequest.FromString(b"".join(bodies["/v1/metrics"][:1]))
    (rm,) = metrics.resource_metrics
    res = {a.key: a.value for a in rm.resource.attributes}
    assert res["service.name"].string_value == "kvscope-test"
    assert res["process.pid"].int_value == os.getpid()
    assert res["host.name"].string_value
    by_name = {m.name: m for sm in rm.scope_metrics for m in sm.metrics}
    alloc = by_name["kvscope.pool.allocations"]
    assert alloc.unit == "{block}" and alloc.sum.is_monotonic
    assert alloc.sum.data_points[0].as_int == 3
    assert by_name["kvscope.pool.operation.duration"].histogram.data_points[0].count >= 1
    spans = ExportTraceServiceRequest.FromString(bodies["/v1/traces"][0])
    (span,) = [s for rs in spans.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert span.name == "kvscope.request"
    assert [e.name for e in span.events] == ["allocate", "free"]
    logs = ExportLogsServiceRequest.FromString(bodies["/v1/logs"][0])
    (rec,) = [r for rl in logs.resource_logs for sl in rl.scope_logs for r in sl.log_records]
    assert rec.body.string_value == "block 3 has a reference but no owner"
    assert {a.key: a.value.string_value for a in rec.attributes}[
        "kvscope.finding.kind"
    ] == "leak_orphan"


def test_otlp_grpc_export_reaches_a_grpc_receiver(make_pool):
    grpc = pytest.importorskip("grpc")
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc", reason="the otel extra")
    from concurrent import futures

    from opentelemetry.proto.collector.metrics.v1 import (
        metrics_service_pb2,
        metrics_service_pb2_grpc,
    )

    got: list[object] = []

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the gRPC service's name
            got.append(request)
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
            "KVSCOPE_OTEL_COLLECT": "1",
        }
        tel = install_from_env(env)
        pool = make_pool(16, block_size=4)
        pool.allocate("r1", [1, 2, 3])
        tel.shutdown()
    finally:
        server.stop(None)
    names = {
        m.name
        for r in got
        for rm in r.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
    }
    assert {
        "kvscope.pool.blocks",
        "kvscope.pool.allocations",
        "kvscope.lock.hold.duration",
    } <= names


# What `kvscope run --metrics-exporter prometheus` is to do (see otel_exporters.py): the
# supervisor runs the collector over the pools its child opens and serves the endpoint.
SUPERVISED = """
import argparse, os, shutil, sys, tempfile
from kvscope.probes.otel_exporters import start_collector
from kvscope.supervisor import Supervisor
from kvscope.verbs.run import child_env

run_dir = tempfile.mkdtemp(prefix="kvscope-run-")
flags = argparse.Namespace(guard=False, lockdep=False, inject=None)
sup = Supervisor(sys.argv[1:], run_dir=run_dir, env=child_env(dict(os.environ), run_dir, flags),
                 echo=lambda line: print(line, file=sys.stderr))
tel = start_collector(lambda: [w.name for w in list(sup.pools.values())])
print("PORT", tel.prometheus_port, flush=True)
sup.start()
outcome = sup.wait()
tel.shutdown()
sup.cleanup()
shutil.rmtree(run_dir)
sys.exit(outcome.returncode)
"""


@pytest.mark.slow
def test_prometheus_scrape_of_a_supervised_example_server():
    pytest.importorskip("opentelemetry.exporter.prometheus", reason="the otel extra")
    pytest.importorskip("prometheus_client", reason="the otel extra")
    from prometheus_client.parser import text_string_to_metric_families

    name = f"otel-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": "0",
        "OTEL_SERVICE_NAME": "serve-test",
    }
    serve = [
        str(REPO / "examples" / "serve.py"),
        "--requests",
        "40",
        "--rate",
        "8",
        "--no-progress",
        "--pool-name",
        name,
    ]
    # GIVEN the example server running under a supervisor that serves Prometheus
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISED, *serve],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline().split()[1])
        # WHEN Prometheus scrapes it over HTTP while requests are in flight
        families, deadline = {}, time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            text = (
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                .read()
                .decode()
            )
            families = {f.name: f for f in text_string_to_metric_families(text)}
            allocs = (
                [s.value for s in families.get("kvscope_pool_allocations", []).samples]
                if families
                else []
            )
            if "kvscope_pool_allocations" in families and allocs and allocs[0] > 0:
                break
            time.sleep(0.2)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    # THEN the pool's metrics are there with its name, parsed by prometheus_client
    allocs = families["kvscope_pool_allocations"]
    assert allocs.type == "counter"
    (sample,) = [s for s in allocs.samples if s.name == "kvscope_pool_allocations_total"]
    assert sample.labels["kvscope_pool_name"] == name and sample.value > 0
    blocks = {
        s.labels["kvscope_block_state"]: s.value for s in families["kvscope_pool_blocks"].samples
    }
    assert set(blocks) == {"free", "allocated", "cached", "local", "quarantined"}
    limit = families["kvscope_pool_memory_limit_bytes"].samples[0].value
    usage = sum(s.value for s in families["kvscope_pool_memory_usage_bytes"].samples)
    assert limit > 0 and usage == limit
    assert 0 <= families["kvscope_pool_utilization"].samples[0].value <= 1
    assert families["kvscope_pool_lock_wait_time_seconds"].type == "counter"
    (info,) = families["target_info"].samples
    assert info.labels["service_name"] == "serve-test"
    # AND without a GPU the supervisor said so once and exported no GPU metric
    assert err.count("no GPU metrics") == 1
    assert not [n for n in families if n.startswith("hw_gpu")]


@pytest.mark.slow
def test_prometheus_scrape_of_kvscope_run_with_the_example(tmp_path):
    pytest.importorskip("opentelemetry.exporter.prometheus", reason="the otel extra")
    pytest.importorskip("prometheus_client", reason="the otel extra")
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    # GIVEN `kvscope run` with the Prometheus exporter, serving the example server
    cmd = [
        kvscope,
        "run",
        "--metrics-exporter",
        "prometheus",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(port),
        str(REPO / "examples" / "serve.py"),
        "--requests",
        "60",
        "--rate",
        "10",
        "--no-progress",
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    families: dict = {}
    try:
        # WHEN Prometheus scrapes it over HTTP while requests are in flight
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                text = (
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                    .read()
                    .decode()
                )
            except OSError:
                time.sleep(0.2)
                continue
            families = {f.name: f for f in text_string_to_metric_families(text)}
            samples = families.get("kvscope_pool_allocations")
            if samples and any(s.value > 0 for s in samples.samples):
                break
            time.sleep(0.2)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # THEN the run succeeded and the pool's counters were scraped, parsed by prometheus_client
    assert proc.returncode == 0, err
    allocs = families["kvscope_pool_allocations"]
    assert allocs.type == "counter"
    assert any(
        s.value > 0 and s.labels.get("kvscope_pool_name", "").startswith("serve-")
        for s in allocs.samples
    ), allocs.samples
    assert "kvscope_pool_blocks" in families


@pytest.mark.slow
def test_prometheus_scrape_of_two_ranks_shows_each_rank_s_pool_with_its_device(tmp_path):
    pytest.importorskip("opentelemetry.exporter.prometheus", reason="the otel extra")
    pytest.importorskip("prometheus_client", reason="the otel extra")
    # GIVEN `kvscope run` with the Prometheus exporter, serving the example server as two
    # ranks (two engine processes, each with its own pool; on the CPU both pools are "cpu")
    # WHEN Prometheus scrapes the supervisor until both ranks have allocated
    got = scrape_two_ranks("cpu", tmp_path)
    # THEN the run succeeded and one scrape held both ranks' pools, each with its device
    assert got["returncode"] == 0, got["stderr"]
    assert set(got["wanted"]) <= set(got["pools"]), got["pools"]
    for pool in got["wanted"]:
        assert got["pools"][pool]["value"] > 0
        assert got["pools"][pool]["kvscope_pool_device"] == "cpu"
