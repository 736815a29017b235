"""The live terminal view of a pool, or a dump file, from another terminal (kvscope.tui)."""

from __future__ import annotations

import argparse

from kvscope.errors import UsageError


def load_run_top():
    """kvscope.tui.run_top, or a UsageError when the TUI is not available."""
    try:
        from kvscope.tui import run_top  # type: ignore[attr-defined]
    except ImportError as e:
        raise UsageError(f"the TUI is not available in this install ({e})") from None
    return run_top


class TopCommand:
    """Show a live pool or a dump in the terminal UI: `kvscope top NAME|FILE [--hz N]`.

    Or an engine's prefix cache from its KV-event stream: `kvscope top --events ENDPOINT...`."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "target", nargs="?", metavar="NAME|FILE", help="a pool name or a dump file"
        )
        parser.add_argument("--hz", type=float, default=10.0, help="refresh rate (default 10)")
        parser.add_argument(
            "--events",
            nargs="+",
            metavar="ENDPOINT",
            help="an engine's KV-event publishers (or one recorded stream): its prefix cache",
        )

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        if not args.hz > 0:
            raise UsageError(f"--hz must be positive, got {args.hz}")
        if args.events:
            if args.target is not None:
                raise UsageError("top takes a pool (NAME|FILE) or --events, not both")
            try:
                from kvscope.events.top import run_events_top
            except ImportError as e:
                raise UsageError(f"the TUI is not available in this install ({e})") from None
            return run_events_top(args.events, hz=args.hz)
        if args.target is None:
            raise UsageError("top needs a pool (NAME|FILE) or --events ENDPOINT")
        return int(load_run_top()(args.target, hz=args.hz))
