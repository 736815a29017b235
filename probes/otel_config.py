"""OpenTelemetry settings: the OTEL_* variables, the `kvscope run` flags that set them, the resource.

    add_otel_arguments(parser)                  # --metrics-exporter, --prometheus-port, ...
    env = otel_env_from_args(args)              # {"OTEL_METRICS_EXPORTER": "prometheus", ...}
    exporter_names(env, "metrics")              # ["prometheus"]; unset means none here

An exporter variable that is unset means `none` here (not the SDK's `otlp`), so kvscope never
exports anywhere it was not told to.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

# The SDK is imported where a resource is made: `kvscope run`'s flags need none of it.
if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

EXPORTERS = {
    "metrics": ("none", "console", "otlp", "prometheus"),
    "traces": ("none", "console", "otlp"),
    "logs": ("none", "console", "otlp"),
}
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
            raise OtelConfigError(
                f"{key}={n!r} is not supported; use one of {', '.join(EXPORTERS[signal])}"
            )
    return [n for n in names if n != "none"]


def otlp_target(environ: Mapping[str, str], signal: str) -> tuple[str, str]:
    """(protocol, endpoint URL) of the OTLP exporter for one signal, per the OTLP exporter spec."""
    up = signal.upper()
    protocol = (
        environ.get(f"OTEL_EXPORTER_OTLP_{up}_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    if protocol not in PROTOCOLS:
        raise OtelConfigError(
            f"OTLP protocol {protocol!r} is not supported; use one of {', '.join(PROTOCOLS)}"
        )
    own = environ.get(f"OTEL_EXPORTER_OTLP_{up}_ENDPOINT")
    if own:
        return protocol, own
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or DEFAULT_ENDPOINTS[protocol]
    return protocol, base if protocol == "grpc" else f"{base.rstrip('/')}/v1/{signal}"


def resource_from_env(
    environ: Mapping[str, str], extra: Mapping[str, Any] | None = None
) -> Resource:
    """service.name, host.name, process.pid, OTEL_RESOURCE_ATTRIBUTES and `extra` (GPU ids)."""
    attrs: dict[str, Any] = {}
    for item in environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        k, sep, v = item.partition("=")
        if sep and k.strip():
            attrs[k.strip()] = v.strip()
    attrs["service.name"] = environ.get("OTEL_SERVICE_NAME") or attrs.get("service.name", "kvscope")
    attrs.update({"host.name": socket.gethostname(), "process.pid": os.getpid(), **(extra or {})})
    from opentelemetry.sdk.resources import Resource

    return Resource(attrs)


def describe(environ: Mapping[str, str], prometheus: bool) -> str:
    """One line naming where metrics, traces and logs go."""
    parts = []
    for signal in EXPORTERS:
        names = [n for n in exporter_names(environ, signal) if prometheus or n != "prometheus"] or [
            "none"
        ]
        shown = []
        for n in names:
            if n == "otlp":
                shown.append("otlp {} {}".format(*otlp_target(environ, signal)))
            elif n == "prometheus":
                host = environ.get("OTEL_EXPORTER_PROMETHEUS_HOST") or "localhost"
                shown.append(
                    f"prometheus http://{host}:{environ.get('OTEL_EXPORTER_PROMETHEUS_PORT') or 9464}/metrics"
                )
            else:
                shown.append(n)
        parts.append(f"{signal} -> {', '.join(shown)}")
    return "kvscope: OpenTelemetry " + "; ".join(parts)


# The modules each exporter needs beyond the SDK (`pip install 'kvscope[otel]'`); the console
# exporters come with the SDK.
EXPORTER_MODULES = {
    "prometheus": ("opentelemetry.exporter.prometheus", "prometheus_client"),
    "http/protobuf": ("opentelemetry.exporter.otlp.proto.http",),
    "grpc": ("opentelemetry.exporter.otlp.proto.grpc",),
}
INSTALL_OTEL = "pip install 'kvscope[otel]'"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_installed(environ: Mapping[str, str]) -> None:
    """OtelConfigError naming what to install when an exporter the settings name is missing."""
    for signal in EXPORTERS:
        for n in exporter_names(environ, signal):
            if n == "console":
                continue
            need = n if n == "prometheus" else otlp_target(environ, signal)[0]
            if not all(_installed(m) for m in EXPORTER_MODULES[need]):
                what = "prometheus" if n == "prometheus" else f"otlp ({need})"
                raise OtelConfigError(
                    f"the {what} exporter for {signal} is not installed: {INSTALL_OTEL}"
                    " (the console exporter needs nothing more)"
                )


def configured(environ: Mapping[str, str]) -> bool:
    return any(exporter_names(environ, s) for s in EXPORTERS)


def add_otel_arguments(parser: argparse.ArgumentParser) -> None:
    """The exporter flags of `kvscope run`; each overrides its OTEL_* variable."""
    g = parser.add_argument_group("OpenTelemetry (flags override the OTEL_* variables)")
    g.add_argument(
        "--metrics-exporter",
        metavar="LIST",
        help="none, console, otlp, prometheus (comma-separated)",
    )
    g.add_argument("--traces-exporter", metavar="LIST", help="none, console, otlp")
    g.add_argument(
        "--logs-exporter", metavar="LIST", help="none, console, otlp (findings as log records)"
    )
    g.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="OTLP endpoint (default http://localhost:4318, grpc :4317)",
    )
    g.add_argument(
        "--otlp-protocol", choices=PROTOCOLS, help="OTLP protocol (default http/protobuf)"
    )
    g.add_argument(
        "--prometheus-host", metavar="HOST", help="Prometheus endpoint address (default localhost)"
    )
    g.add_argument(
        "--prometheus-port",
        type=int,
        metavar="PORT",
        help="Prometheus endpoint port (default 9464)",
    )
    g.add_argument(
        "--service-name", metavar="NAME", help="service.name resource attribute (default kvscope)"
    )
    g.add_argument(
        "--metrics-interval",
        type=float,
        metavar="SECONDS",
        help="push interval of console/OTLP metrics (default 60)",
    )


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
    env = {
        key: str(getattr(args, flag))
        for flag, key in FLAG_TO_ENV.items()
        if getattr(args, flag, None) is not None
    }
    if getattr(args, "metrics_interval", None) is not None:
        env["OTEL_METRIC_EXPORT_INTERVAL"] = str(int(args.metrics_interval * 1000))
    for signal in EXPORTERS:
        exporter_names(env, signal)
    return env
