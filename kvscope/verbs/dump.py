"""Write a consistent snapshot of a live pool to a dump file (mode 0600), or to stdout (`-o -`).

The copy is taken under the seqlock without locking or slowing the pool. `--with-data` adds
the KV data; `--redact` replaces every prompt token id, prefix key and request id with a keyed
hash (equal values still look equal, the originals cannot be recovered) so the dump can travel.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvscope.allocator.dumpfile import STDOUT, write_dump
from kvscope.allocator.segment import check_name
from kvscope.target import add_trust_owner


class DumpCommand:
    """Dump a live pool to a file: `kvscope dump NAME -o FILE [--with-data] [--redact]`."""

    @staticmethod
    def prepare_parser(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("name", metavar="NAME", help="the pool's name (see `kvscope ls`)")
        parser.add_argument(
            "-o", "--output", required=True, metavar="FILE", help="dump file (- for stdout)"
        )
        parser.add_argument("--with-data", action="store_true", help="include the KV data")
        parser.add_argument(
            "--redact",
            action="store_true",
            help="replace token ids, prefix keys and request ids with keyed hashes",
        )
        add_trust_owner(parser)
        parser.add_argument("--reason", default="kvscope dump", help="note kept in the dump")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        check_name(args.name)
        path = write_dump(
            args.name,
            args.output,
            with_data=args.with_data,
            redact=args.redact,
            reason=args.reason,
            trust_owner=args.trust_owner,
        )
        if path == STDOUT:
            print(f"wrote pool {args.name!r} to standard output", file=sys.stderr)
            return 0
        size = os.path.getsize(path)
        print(f"wrote {path} ({size / 2**20:.1f} MiB) from pool {args.name!r}", file=sys.stderr)
        return 0
