"""The `kvscope` command line: one verb per module, `main(argv) -> int`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse argv, run the verb and return its exit code."""
    parser = argparse.ArgumentParser(prog="kvscope", description=__doc__)
    parser.add_subparsers(dest="verb")
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    return 0


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
