"""kvscope.probes: the probes `kvscope run` switches on in the process it runs.

Each probe is off by default in the library and has its own KVSCOPE_* switch (docs/PROBES.md):
magic, ownership, guard, leaks and events live in the allocator's hooks (allocator/probing.py);
lockdep and the watchdog, fault injection, the leak summary (printed by the exit check,
kvscope/child.py) and the OpenTelemetry exporters live here. `install_from_env()` is what `kvscope run` calls in every process of the
run (kvscope/child.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvscope.allocator.faults import FAULTS

__all__ = ["FAULTS", "OP_NAMES", "EventOp", "install_from_env"]


def __getattr__(name: str) -> Any:
    # OP_NAMES and EventOp on first use: `kvscope run` imports this package for its flags
    # (probes/otel_config.py) before the script starts, and the events module brings numpy.
    if name in ("OP_NAMES", "EventOp"):
        from kvscope.allocator import events

        return getattr(events, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _on_open(pool: Any, env: Mapping[str, str]) -> None:
    from kvscope.probes import watchdog

    watchdog.install(pool, env)


def install_from_env(environ: Mapping[str, str] | None = None) -> None:
    """Install the probes the environment switches on, for every pool this process opens."""
    # Imported here: the pool imports torch, and `kvscope analyze` imports probes.nvml.
    from kvscope.allocator import pool as pool_module

    env = os.environ if environ is None else environ
    pool_module.OPEN_HOOKS.append(lambda pool: _on_open(pool, env))
    from kvscope.probes.otel_exporters import install_from_env as otel_install

    otel_install(env)
