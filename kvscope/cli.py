"""The `kvscope` command line: one verb per module in kvscope/verbs, `main(argv) -> int`.

Exit codes everywhere: 0 healthy, 1 findings of severity error, 2 unusable input (docs/CLI.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from kvscope import __version__
from kvscope.errors import EXIT_USAGE, PoolError, UsageError
from kvscope.verbs import VERBS


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code 2, through UsageError."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def build_parser() -> Parser:
    """The top-level parser with one subcommand per verb."""
    parser = Parser(
        prog="kvscope",
        description="Debugging and observability harness for the kvscope shared KV-cache pool.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser)
    for name, verb in VERBS.items():
        doc = (verb.__doc__ or "").strip()
        p = sub.add_parser(
            name,
            help=doc.splitlines()[0] if doc else None,
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            # `kvscope run script.py --n 2`: the script's flags are never our abbreviations.
            allow_abbrev=False,
        )
        verb.prepare_parser(p)
        p.set_defaults(command=verb)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse argv, run the verb and return its exit code; user errors are one line on stderr."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.verb is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return int(args.command.run(args))
    except PoolError as e:
        print(f"kvscope: error: {e}", file=sys.stderr)
        return int(getattr(e, "exit_code", EXIT_USAGE))
    except SystemExit as e:
        # --help and --version exit through argparse.
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_USAGE)
    except KeyboardInterrupt:
        print("kvscope: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def entry() -> None:
    """Console-script entry point."""
    sys.exit(main())
