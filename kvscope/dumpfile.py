"""Dump files live beside the segment layout, in kvscope.allocator.dumpfile and .dumpread (the TUI
reads them without the harness); this name stays for the scripts and tests that import it."""

from kvscope.allocator.dumpfile import (
    DUMP_SUFFIX,
    SAVED_HEADER_BYTES,
    STDOUT,
    check_target,
    dump_name,
    layout_of_prefix,
    write_dump,
)
from kvscope.allocator.dumpread import alive_for, read_dump, read_dump_data

__all__ = [
    "DUMP_SUFFIX",
    "SAVED_HEADER_BYTES",
    "STDOUT",
    "alive_for",
    "check_target",
    "dump_name",
    "layout_of_prefix",
    "read_dump",
    "read_dump_data",
    "write_dump",
]
