"""The live terminal view of a pool, or a dump file, from another terminal (kvscope.tui)."""

from __future__ import annotations

import argparse
import sys

from kvscope.errors import UsageError

POOL_TEXT = "`kvscope analyze NAME|FILE` (a pool's state and findings) or `kvscope check NAME`"


def require_terminal(what: str, text: str = POOL_TEXT) -> None:
    """A UsageError unless stdin and stdout are terminals: a full-screen view written into a
    pipe or a file is escape codes, and it would wait for a key that never comes (`text`: the
    verbs that print the same as text)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError(
            f"{what} draws in a terminal and stdin or stdout is not one; for text, {text}"
        )


def load_run_top(what: str = "top"):
    """kvscope.tui.run_top, or a UsageError when the TUI is not available or there is no
    terminal to draw in (`what` names the command for the message)."""
    require_terminal(what)
    try:
        from kvscope.tui import run_top  # type: ignore[attr-defined]
    except ImportError as e:
        raise UsageError(f"the TUI is not available in this install ({e})") from None
    return run_top


class TopCommand:
    """Show a live pool or a dump in the terminal UI: `kvscope top NAME|FILE [--hz N] [--at N]`.

    Or an engine's prefix cache from its KV-event stream: `kvscope top --events ENDPOINT...`."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "target", nargs="?", metavar="NAME|FILE", help="a pool name or a dump file"
        )
        parser.add_argument("--hz", type=float, default=10.0, help="refresh rate (default 10)")
        parser.add_argument(
            "--at",
            type=int,
            metavar="N",
            help="the pool a replay of the dump's operation log (DUMP.ops, or a LOG) makes up "
            "to operation N; [ and ] step back and forward",
        )
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
                from kvscope.events.top import is_file_feed, run_events_top
            except ImportError as e:
                raise UsageError(f"the TUI is not available in this install ({e})") from None
            feed = "FILE" if is_file_feed(args.events) else "ENDPOINT... --seconds S"
            require_terminal("top --events", f"`kvscope events check {feed}`")
            return run_events_top(args.events, hz=args.hz)
        if args.target is None:
            raise UsageError("top needs a pool (NAME|FILE) or --events ENDPOINT")
        if args.at is not None:
            return step_top(args.target, args.at, args.hz)
        return int(load_run_top()(args.target, hz=args.hz))


def step_top(target: str, at: int, hz: float) -> int:
    """`kvscope top DUMP|LOG --at N`: the pool a replay of the operation log (a dump's DUMP.ops)
    makes up to operation N, stepped through in the TUI."""
    import os

    from kvscope.allocator.oplog import OplogError, read_log
    from kvscope.replay import ReplayError, Stepper

    if at < 0:
        raise UsageError("--at takes an operation number >= 0")
    path = target + ".ops" if target.endswith(".kvd") else target
    if not os.path.isfile(path):
        raise UsageError(
            f"{target}: no operation log to step through (a dump's is {target}.ops: "
            "kvscope run --record-ops)"
        )
    run_top = load_run_top()
    try:
        stepper = Stepper(read_log(path))
        stepper.goto(at)
    except (OplogError, ReplayError) as e:
        raise UsageError(str(e)) from None
    try:
        return int(run_top(path, hz=hz, stepper=stepper))
    finally:
        stepper.close()
