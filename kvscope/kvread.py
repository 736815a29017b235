"""The KV data behind a dump or a live pool is read in kvscope.allocator.kvread (the TUI and the
exporters check it too, without the harness); this name stays for the scripts that import it."""

from kvscope.allocator.kvread import KVData, for_dump, for_live, has_data_checks

__all__ = ["KVData", "for_dump", "for_live", "has_data_checks"]
