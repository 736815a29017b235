"""kvscope: a debugging and observability harness around a paged, shared-memory KV-cache pool."""

__version__ = "0.1.0"
