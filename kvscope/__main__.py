"""`python -m kvscope` is the `kvscope` command."""

from kvscope.cli import entry

entry()
