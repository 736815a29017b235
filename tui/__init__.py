"""kvscope.tui: `kvscope top`, the live terminal view of a pool or a dump.

from kvscope.tui import run_top
run_top("demo")            # a live pool, by name
run_top("pool.kvd")        # a dump file
"""

from __future__ import annotations

from typing import Any


def run_top(
    target: str, *, hz: float = 10.0, script: Any = None, stop: Any = None, stepper: Any = None
) -> int:
    """Show the TUI on a live pool (by name) or a dump (by path); returns the exit code.

    `script` (kvscope run --live): the running script's output and state, shown in a panel;
    `stop` (a threading.Event): closes the TUI when set; `stepper` (kvscope.replay.Stepper): a
    replay of the operation log `target` stepped through with [ and ].
    """
    from kvscope.tui.app import run_top as _run_top

    return _run_top(target, hz=hz, script=script, stop=stop, stepper=stepper)


__all__ = ["run_top"]
