"""Exporters chosen by the standard OTEL_* variables and the matching `kvscope run` flags.

`kvscope run` wiring (the harness calls these):

    add_otel_arguments(parser)                       # otel_config.py: --metrics-exporter, ...
    env = {**os.environ, **otel_env_from_args(args)} # the child's and the supervisor's settings
    tel = start_collector(lambda: names, env)        # supervisor: pool metrics, GPU, Prometheus
    ...                                              # child: kvscope.probes.otel.install_from_env()
    tel.shutdown()                                   # before the pools are unlinked

The process that runs the collector is the one that serves Prometheus; other processes export
their per-process histograms and spans through OTLP or the console (which writes to stderr).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvscope.probes.otel_config import (
    COLLECT_ENV,
    OtelConfigError,
    check_installed,
    configured,
    describe,
    exporter_names,
    otlp_target,
    resource_from_env,
)


@dataclass
class Telemetry:
    """The providers one process exports through; `shutdown()` flushes and stops them."""

    meter_provider: Any = None
    tracer_provider: Any = None
    logger_provider: Any = None
    prometheus_port: int | None = None
    # Run before the last export (the collector's last read of the pools).
    finals: list[Callable[[], None]] = field(default_factory=list)
    closers: list[Callable[[], None]] = field(default_factory=list)
    stopped: bool = False

    def shutdown(self) -> None:
        """Export what is pending, stop the collector and instrumentation, stop the exporters
        (once: the exit handler finds it done when its owner already called it)."""
        if self.stopped:
            return
        self.stopped = True
        for final in self.finals:
            final()
        self.finals.clear()
        if self.meter_provider is not None:
            # While the collector still reads the pools: the last export carries their values.
            self.meter_provider.force_flush()
        for close in reversed(self.closers):
            close()
        self.closers.clear()
        for p in (self.meter_provider, self.tracer_provider, self.logger_provider):
            if p is not None:
                p.shutdown()


class _WholeDocuments:
    """stderr as the console exporters write to it: each document whole. They write from
    threads of their own (the periodic metric reader, the span and log batch processors); a
    document past the pipe's 64 KiB blocks its write midway, and another thread's document
    written then landed inside it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            return sys.stderr.write(text)

    def flush(self) -> None:
        with self._lock:
            sys.stderr.flush()


CONSOLE: Any = _WholeDocuments()


def _metric_readers(environ: Mapping[str, str], names: list[str], tel: Telemetry) -> list[Any]:
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        PeriodicExportingMetricReader,
    )

    interval = float(environ.get("OTEL_METRIC_EXPORT_INTERVAL") or 60000)
    readers: list[Any] = []
    for n in names:
        if n == "console":
            readers.append(
                PeriodicExportingMetricReader(ConsoleMetricExporter(out=CONSOLE), interval)
            )
        elif n == "otlp":
            protocol, url = otlp_target(environ, "metrics")
            readers.append(
                PeriodicExportingMetricReader(_otlp_metric_exporter(protocol, url), interval)
            )
        elif n == "prometheus":
            readers.append(_prometheus(environ, tel))
    return readers


def _otlp_metric_exporter(protocol: str, url: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=url)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

    return Http(endpoint=url)


def _prometheus(environ: Mapping[str, str], tel: Telemetry) -> Any:
    """A Prometheus reader on its own registry, served at OTEL_EXPORTER_PROMETHEUS_HOST:PORT."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry, start_http_server

    host = environ.get("OTEL_EXPORTER_PROMETHEUS_HOST") or "localhost"
    port = int(environ.get("OTEL_EXPORTER_PROMETHEUS_PORT") or 9464)
    registry = CollectorRegistry()
    reader = PrometheusMetricReader(registry=registry)
    try:
        server, thread = start_http_server(port, host, registry=registry)
    except OSError as e:
        raise OtelConfigError(
            f"cannot serve Prometheus metrics on {host}:{port}: {e.strerror or e}"
        ) from None
    tel.prometheus_port = server.server_port

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    tel.closers.append(stop)
    return reader


def _exporter(environ: Mapping[str, str], signal: str, name: str) -> Any:
    """The span or log exporter named `name` (console or otlp)."""
    traces = signal == "traces"
    if name == "console":
        if traces:
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter(out=CONSOLE)
        from opentelemetry.sdk._logs.export import ConsoleLogRecordExporter

        return ConsoleLogRecordExporter(out=CONSOLE)
    protocol, url = otlp_target(environ, signal)
    if protocol == "grpc":
        if traces:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter(endpoint=url)
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter

        return OTLPLogExporter(endpoint=url)
    if traces:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )

        return HttpSpanExporter(endpoint=url)
    from opentelemetry.exporter.otlp.proto.http._log_exporter import (
        OTLPLogExporter as HttpLogExporter,
    )

    return HttpLogExporter(endpoint=url)


def build_telemetry(
    environ: Mapping[str, str], prometheus: bool, extra: Mapping[str, Any] | None = None
) -> Telemetry:
    """Providers for the exporters the environment names (Prometheus only when `prometheus`)."""
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    check_installed(environ)
    resource = resource_from_env(environ, extra)
    tel = Telemetry()
    metric_names = [
        n for n in exporter_names(environ, "metrics") if prometheus or n != "prometheus"
    ]
    span_names, log_names = exporter_names(environ, "traces"), exporter_names(environ, "logs")
    try:
        tel.meter_provider = MeterProvider(
            resource=resource,
            metric_readers=_metric_readers(environ, metric_names, tel),
            # Telemetry.shutdown flushes them, at the moment its owner says (after the exit
            # check in a process of `kvscope run`).
            shutdown_on_exit=False,
        )
    except BaseException:
        tel.shutdown()
        raise
    tel.tracer_provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for n in span_names:
        tel.tracer_provider.add_span_processor(BatchSpanProcessor(_exporter(environ, "traces", n)))
    tel.logger_provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
    for n in log_names:
        tel.logger_provider.add_log_record_processor(
            BatchLogRecordProcessor(_exporter(environ, "logs", n))
        )
    return tel


def install_from_env(environ: Mapping[str, str] | None = None) -> Telemetry | None:
    """Child side of `kvscope run`: instrument every pool this process opens; None when off.

    The pool collector runs here only with KVSCOPE_OTEL_COLLECT=1 (the supervisor collects).
    Everything is flushed when the process exits, multiprocessing workers included, after the
    exit checks registered before this call (kvscope/child.py installs the probes first).
    """
    env = os.environ if environ is None else environ
    if not configured(env):
        return None  # (before the import: a run without exporters needs no OTel SDK)
    from kvscope.probes.otel import KVPoolInstrumentor
    from kvscope.probes.process_exit import at_exit

    collect = env.get(COLLECT_ENV) == "1"
    tel = build_telemetry(env, prometheus=collect)
    inst = KVPoolInstrumentor()
    inst.instrument(tel.meter_provider, tel.tracer_provider, tel.logger_provider, collect=collect)
    if inst.collector is not None:
        tel.finals.append(inst.collector.finish)
    tel.closers.append(inst.uninstrument)
    at_exit(tel.shutdown)
    return tel


def start_collector(
    pool_names: Callable[[], Iterable[str]],
    environ: Mapping[str, str] | None = None,
    path_of: Callable[[str], str] | None = None,
) -> Telemetry | None:
    """Supervisor side: pool metrics of `pool_names()` (their segment files: `path_of`), GPU
    metrics and the Prometheus endpoint. `shutdown()` reads the pools a last time (late
    findings, the whole-pool check's) and exports everything, whatever the interval."""
    env = os.environ if environ is None else environ
    if not configured(env):
        return None  # (before the imports: a run without exporters needs no OTel SDK)
    check_installed(env)
    from kvscope.probes.nvml import GpuMetrics
    from kvscope.probes.otel_metrics import PoolCollector

    gpus = GpuMetrics()
    tel = build_telemetry(env, prometheus=True, extra=gpus.resource_attributes())
    meter = tel.meter_provider.get_meter("kvscope.probes.otel")
    logger = tel.logger_provider.get_logger("kvscope.probes.otel")
    if path_of is None:
        collector = PoolCollector(meter, pool_names, logger=logger)
    else:
        collector = PoolCollector(meter, pool_names, logger=logger, path_of=path_of)
    gpus.register(meter)
    tel.finals.append(collector.finish)
    tel.closers += [gpus.close, collector.close]
    shown = (
        {**env, "OTEL_EXPORTER_PROMETHEUS_PORT": str(tel.prometheus_port)}
        if tel.prometheus_port
        else env
    )
    print(describe(shown, prometheus=True), file=sys.stderr, flush=True)
    return tel
