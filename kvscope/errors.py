"""The harness's user errors: one family (PoolError) carrying its exit code, mapped at the CLI edge."""

from __future__ import annotations

from kvscope.allocator.errors import PoolError

# Exit codes of every verb (docs/CLI.md).
EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
# `kvscope run`: the child succeeded but `--fail-on` matched what it left behind.
EXIT_FAIL_ON = 66


class UsageError(PoolError):
    """Bad input on the command line: an unknown flag, a wrong value, a missing argument."""

    exit_code = EXIT_USAGE


__all__ = ["EXIT_FAIL_ON", "EXIT_FINDINGS", "EXIT_OK", "EXIT_USAGE", "PoolError", "UsageError"]
