"""The TUI opens a live pool as every reader does: read-only, no symlink, no FIFO, your own."""

from __future__ import annotations

import os

import pytest

from kvscope.allocator.errors import PoolError
from kvscope.allocator.segment import segment_path
from kvscope.tui.source import LiveSource


def test_live_source_maps_a_pool_read_only(make_pool):
    # GIVEN a live pool
    pool = make_pool(16)
    # WHEN the TUI opens it
    source = LiveSource(pool.name)
    try:
        # THEN its view reads the pool, and its mapping cannot be written
        assert bytes(source.read().h["name"]).rstrip(b"\0").decode() == pool.name
        with pytest.raises(TypeError):
            source._mm[0] = 0
    finally:
        source.close()


def test_live_source_refuses_a_fifo(pool_name):
    # GIVEN a FIFO where a pool's segment would be
    os.mkfifo(segment_path(pool_name))
    # WHEN the TUI opens that name THEN it says so at once instead of blocking on the FIFO
    with pytest.raises(PoolError, match="not a pool file"):
        LiveSource(pool_name)


def test_live_source_refuses_a_symlink(make_pool, pool_name):
    # GIVEN a symlink, under another name, to a real pool's segment
    pool = make_pool(16)
    link = f"{pool_name}-link"
    os.symlink(segment_path(pool.name), segment_path(link))
    try:
        # WHEN the TUI opens the link's name THEN it refuses it
        with pytest.raises(PoolError, match="not a pool file"):
            LiveSource(link)
    finally:
        os.unlink(segment_path(link))
