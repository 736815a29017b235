"""The `kvscope` command line: one verb per module in kvscope/verbs, `main(argv) -> int`.

Exit codes everywhere: 0 healthy, 1 findings of severity error, 2 unusable input (docs/CLI.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from kvscope import __version__
from kvscope.errors import EXIT_USAGE, PoolError, UsageError
from kvscope.verbs import VERBS, load, summary


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code 2, through UsageError."""

    # The innermost parser that read the command line (a verb's, `events record`'s): where an
    # argument none of them took is explained (argparse reports it from the top-level parser).
    innermost: Parser | None = None

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if not action.option_strings and action.nargs in (None, "?"):
            # (one pool or file: where more are given, the error says so)
            self.targets = [*getattr(self, "targets", []), action]
        return action

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        Parser.innermost = self
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        prog = self.prog
        if message.startswith("unrecognized arguments") and Parser.innermost is not None:
            prog = Parser.innermost.prog
            extra = message.partition(": ")[2].split()
            targets = getattr(Parser.innermost, "targets", [])
            if extra and len(targets) == 1 and not any(a.startswith("-") for a in extra):
                # (a glob of several dumps: `kvscope analyze dumps/*.kvd`)
                more = f"{len(extra)} more {'was' if len(extra) == 1 else 'were'} given"
                raise UsageError(
                    f"{prog} takes one {targets[0].metavar or targets[0].dest}, and {more}"
                    f" ({', '.join(extra[:3])}{', ...' if len(extra) > 3 else ''}): name one at"
                    f" a time (see `{prog} --help`)"
                )
        raise UsageError(f"{message} (see `{prog} --help`)")


def build_parser(verb: str | None = None) -> Parser:
    """The top-level parser with one subcommand per verb; only `verb`'s flags are prepared
    (None: every verb's), so a command imports nothing of the verbs it does not run."""
    parser = Parser(
        prog="kvscope",
        description="Debugging and observability harness for the kvscope shared KV-cache pool.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvscope {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=Parser)
    for name in VERBS:
        cls = load(name) if verb in (None, name) else None
        doc = (cls.__doc__ or "").strip() if cls is not None else None
        p = sub.add_parser(
            name,
            help=summary(name),
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            # `kvscope run script.py --n 2`: the script's flags are never our abbreviations.
            allow_abbrev=False,
        )
        if cls is not None:
            cls.prepare_parser(p)
            p.set_defaults(command=cls)
    return parser


def verb_of(argv: list[str]) -> str:
    """The verb argv names: its first word that is not an option (the top-level options,
    --help and --version, take no value); "" when there is none."""
    return next((a for a in argv if not a.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    """Parse argv, run the verb and return its exit code; user errors are one line on stderr."""
    if argv is None:
        argv = sys.argv[1:]
    try:
        parser = build_parser(verb_of(argv))
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
