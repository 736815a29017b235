"""Exporters chosen by the standard OTEL_* variables and the matching `kvscope run` flags.

`kvscope run` wiring (the harness calls these):

    add_otel_arguments(parser)                       # --metrics-exporter, --prometheus-port, ...
    env = {**os.environ, **otel_env_from_args(args)} # the child's and the supervisor's settings
    tel = start_collector(lambda: names, env)        # supervisor: pool metrics, GPU, Prometheus
    ...                                              # child: kvscope.probes.otel.install_from_env()
    tel.shutdown()                                   # before the pools are unlinked

The process that runs the collector is the one that serves Prometheus; other processes export
their per-process histograms and spans through OTLP or the console (which writes to stderr).
An exporter variable that is unset means `none` here (not the SDK's `otlp`), so kvscope never
exports anywhere it was not told to.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.resources import Resource

EXPORTERS = {"metrics": ("none", "console", "otlp", "prometheus"), "traces": ("none", "console", "otlp"), "logs": ("none", "console", "otlp")}
PROTOCOLS = ("http/protobuf", "grpc")
DEFAULT_ENDPOINTS = {"http/protobuf": "http://localhost:4318", "grpc": "http://localhost:4317"}
COLLECT_ENV = "KVSCOPE_OTEL_COLLECT"


class OtelConfigError(ValueError):
    """A bad OTEL_* value or flag; the message says which and what is accepted."""


def exporter_names(environ: Mapping[str, str], signal: str) -> list[str]:
    """OTEL_<SIGNAL>_EXPORTER as a list (comma-separated; unset or empty: none)."""
    key = f"OTEL_{signal.upper()}_EXPORTER"
    names = [n.strip().lower() for n in environ.get(key, "").split(",") if n.strip()]
    for n in names:
        if n not in EXPORTERS[signal]:
            raise OtelConfigError(f"{key}={n!r} is not supported; use one of {', '.join(EXPORTERS[signal])}")
    return [n for n in names if n != "none"]


def otlp_target(environ: Mapping[str, str], signal: str) -> tuple[str, str]:
    """(protocol, endpoint URL) of the OTLP exporter for one signal, per the OTLP exporter spec."""
    up = signal.upper()
    protocol = environ.get(f"OTEL_EXPORTER_OTLP_{up}_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol not in PROTOCOLS:
        raise OtelConfigError(f"OTLP protocol {protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}")
    own = environ.get(f"OTEL_EXPORTER_OTLP_{up}_ENDPOINT")
    if own:
        return protocol, own
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_ENDPOINTS[protocol]
    return protocol, base if protocol == "grpc" else f"{base.rstrip('/')}/v1/{signal}"


def resource_from_env(environ: Mapping[str, str], extra: Mapping[str, Any] | None = None) -> Resource:
    """service.name, host.name, process.pid, OTEL_RESOURCE_ATTRIBUTES and `extra` (GPU ids)."""
    attrs: dict[str, Any] = {}
    for item in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip():
            attrs[k.strip()] = v.strip()
    attrs["service.name"] = environ.get("OTEL_SERVICE_NAME") or attrs.get("service.name", "kvscope")
    attrs.update({"host.name": socket.gethostname(), "process.pid": os.getpid(), **(extra or {})})
    return Resource(attrs)


@dataclass
class Telemetry:
    """The providers one process exports through; `shutdown()` flushes and stops them."""

    meter_provider: Any = None
    tracer_provider: Any = None
    logger_provider: Any = None
    prometheus_port: int | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)

    def shutdown(self) -> None:
        """Export what is pending, stop the collector and instrumentation, stop the exporters."""
        if self.meter_provider is not None:
            # While the collector still reads the pools: the last export carries their values.
            self.meter_provider.force_flush()
        for close in reversed(self.closers):
            close()
        self.closers.clear()
        for p in (self.meter_provider, self.tracer_provider, self.logger_provider):
            if p is not None:
                p.shutdown()


def _metric_readers(environ: Mapping[str, str], names: list[str], tel: Telemetry) -> list[Any]:
    from opentelemetry.sdk.metrics.export import (
        ConsoleMetricExporter,
        PeriodicExportingMetricReader,
    )

    interval = float(environ.get("OTEL_METRIC_EXPORT_INTERVAL") or 60000)
    readers: list[Any] = []
    for n in names:
        if n == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter(out=sys.stderr), interval))
        elif n == "otlp":
            protocol, url = otlp_target(environ, "metrics")
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                    OTLPMetricExporter,
                )
            else:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                    OTLPMetricExporter,  # type: ignore[assignment]
                )
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=url), interval))
        elif n == "prometheus":
            readers.append(_prometheus(environ, tel))
    return readers


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
        raise OtelConfigError(f"cannot serve Prometheus metrics on {host}:{port}: {e.strerror or e}") from None
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

            return ConsoleSpanExporter(out=sys.stderr)
        from opentelemetry.sdk._logs.export import ConsoleLogRecordExporter

        return ConsoleLogRecordExporter(out=sys.stderr)
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


def build_telemetry(environ: Mapping[str, str], prometheus: bool, extra: Mapping[str, Any] | None = None) -> Telemetry:
    """Providers for the exporters the environment names (Prometheus only when `prometheus`)."""
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = resource_from_env(environ, extra)
    tel = Telemetry()
    metric_names = [n for n in exporter_names(environ, "metrics") if prometheus or n != "prometheus"]
    span_names, log_names = exporter_names(environ, "traces"), exporter_names(environ, "logs")
    try:
        tel.meter_provider = MeterProvider(resource=resource, metric_readers=_metric_readers(environ, metric_names, tel))
    except BaseException:
        tel.shutdown()
        raise
    tel.tracer_provider = TracerProvider(resource=resource)
    for n in span_names:
        tel.tracer_provider.add_span_processor(BatchSpanProcessor(_exporter(environ, "traces", n)))
    tel.logger_provider = LoggerProvider(resource=resource)
    for n in log_names:
        tel.logger_provider.add_log_record_processor(BatchLogRecordProcessor(_exporter(environ, "logs", n)))
    return tel


def describe(environ: Mapping[str, str], prometheus: bool) -> str:
    """One line naming where metrics, traces and logs go."""
    parts = []
    for signal in EXPORTERS:
        names = [n for n in exporter_names(environ, signal) if prometheus or n != "prometheus"] or ["none"]
        shown = []
        for n in names:
            if n == "otlp":
                shown.append("otlp {} {}".format(*otlp_target(environ, signal)))
            elif n == "prometheus":
                host = environ.get("OTEL_EXPORTER_PROMETHEUS_HOST") or "localhost"
                shown.append(f"prometheus http://{host}:{environ.get('OTEL_EXPORTER_PROMETHEUS_PORT') or 9464}/metrics")
            else:
                shown.append(n)
        parts.append(f"{signal} -> {', '.join(shown)}")
    return "kvscope: OpenTelemetry " + "; ".join(parts)


def _configured(environ: Mapping[str, str]) -> bool:
    return any(exporter_names(environ, s) for s in EXPORTERS)


def install_from_env(environ: Mapping[str, str] | None = None) -> Telemetry | None:
    """Child side of `kvscope run`: instrument every pool this process opens; None when off.

    The pool collector runs here only with KVSCOPE_OTEL_COLLECT=1 (the supervisor collects).
    """
    from kvscope.probes.otel import KVPoolInstrumentor

    env = os.environ if environ is None else environ
    if not _configured(env):
        return None
    collect = env.get(COLLECT_ENV) == "1"
    tel = build_telemetry(env, prometheus=collect)
    inst = KVPoolInstrumentor()
    inst.instrument(tel.meter_provider, tel.tracer_provider, tel.logger_provider, collect=collect)
    tel.closers.append(inst.uninstrument)
    return tel


def start_collector(pool_names: Callable[[], Iterable[str]], environ: Mapping[str, str] | None = None) -> Telemetry | None:
    """Supervisor side: pool metrics of `pool_names()`, GPU metrics and the Prometheus endpoint."""
    from kvscope.probes.nvml import GpuMetrics
    from kvscope.probes.otel_metrics import PoolCollector

    env = os.environ if environ is None else environ
    if not _configured(env):
        return None
    gpus = GpuMetrics()
    tel = build_telemetry(env, prometheus=True, extra=gpus.resource_attributes())
    meter = tel.meter_provider.get_meter("kvscope.probes.otel")
    collector = PoolCollector(meter, pool_names, logger=tel.logger_provider.get_logger("kvscope.probes.otel"))
    gpus.register(meter)
    tel.closers += [gpus.close, collector.close]
    shown = {**env, "OTEL_EXPORTER_PROMETHEUS_PORT": str(tel.prometheus_port)} if tel.prometheus_port else env
    print(describe(shown, prometheus=True), file=sys.stderr, flush=True)
    return tel


def add_otel_arguments(parser: argparse.ArgumentParser) -> None:
    """The exporter flags of `kvscope run`; each overrides its OTEL_* variable."""
    g = parser.add_argument_group("OpenTelemetry (flags override the OTEL_* variables)")
    g.add_argument("--metrics-exporter", metavar="LIST", help="none, console, otlp, prometheus (comma-separated)")
    g.add_argument("--traces-exporter", metavar="LIST", help="none, console, otlp")
    g.add_argument("--logs-exporter", metavar="LIST", help="none, console, otlp (findings as log records)")
    g.add_argument("--otlp-endpoint", metavar="URL", help="OTLP endpoint (default http://localhost:4318, grpc :4317)")
    g.add_argument("--otlp-protocol", choices=PROTOCOLS, help="OTLP protocol (default http/protobuf)")
    g.add_argument("--prometheus-host", metavar="HOST", help="Prometheus endpoint address (default localhost)")
    g.add_argument("--prometheus-port", type=int, metavar="PORT", help="Prometheus endpoint port (default 9464)")
    g.add_argument("--service-name", metavar="NAME", help="service.name resource attribute (default kvscope)")
    g.add_argument("--metrics-interval", type=float, metavar="SECONDS", help="push interval of console/OTLP metrics (default 60)")


FLAG_TO_ENV = {
    "metrics_exporter": "OTEL_METRICS_EXPORTER",
    "traces_exporter": "OTEL_TRACES_EXPORTER",
    "logs_exporter": "OTEL_LOGS_EXPORTER",
    "otlp_endpoint": "OTEL_EXPORTER_OTLP_ENDPOINT",
    "otlp_protocol": "OTEL_EXPORTER_OTLP_PROTOCOL",
    "prometheus_host": "OTEL_EXPORTER_PROMETHEUS_HOST",
    "prometheus_port": "OTEL_EXPORTER_PROMETHEUS_PORT",
    "service_name": "OTEL_SERVICE_NAME",
}


def otel_env_from_args(args: argparse.Namespace) -> dict[str, str]:
    """The OTEL_* variables the given flags set (validated; flags not given are left out)."""
    env = {key: str(getattr(args, flag)) for flag, key in FLAG_TO_ENV.items() if getattr(args, flag, None) is not None}
    if getattr(args, "metrics_interval", None) is not None:
        env["OTEL_METRIC_EXPORT_INTERVAL"] = str(int(args.metrics_interval * 1000))
    for signal in EXPORTERS:
        exporter_names(env, signal)
    return env
