"""Shared by the scenario scripts: run the example server with one allocator fault armed."""

from __future__ import annotations

import os
import sys

from kvscope.allocator import faults

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def run(fault: str, *serve_args: str) -> int:
    """Arm `fault` (unless KVSCOPE_INJECT already names faults), then serve a short workload."""
    if not faults.ARMED:
        faults.configure(fault)
    import serve

    # Arrivals on the step clock: the fault strikes the same request on every machine.
    sys.argv = [
        "serve.py",
        "--requests",
        "24",
        "--clock",
        "steps",
        "--no-progress",
        *serve_args,
        *sys.argv[1:],
    ]
    return serve.main()
