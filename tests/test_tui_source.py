"""The TUI opens a live pool as every reader does: read-only, no symlink, no FIFO, your own."""

from __future__ import annotations

import os

import pytest

from kvscope.allocator.errors import PoolError
from kvscope.allocator.segment import segment_path
from kvscope.tui.frame import (
    BLOCK_COLUMNS,
    Frame,
    cow_candidates,
    cow_positions,
    request_of,
)
from kvscope.tui.source import LiveSource
from tests.test_tui_app import populate


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


def test_live_source_copies_what_each_event_ring_gained(make_pool):
    # GIVEN a live pool that records events, read once into each of the two buffers
    pool = make_pool(32, events=True)
    source = LiveSource(pool.name)
    try:
        source.read()
        source.read()
        # WHEN the pool records more than a ring's worth of events (the ring wraps), then a
        # few more, and the TUI reads after each (into one buffer, then the other)
        for i in range(pool.view.events.shape[1]):
            pool.free(pool.allocate(f"req-{i}", [i]))
        first = source.read()
        # THEN every copy holds the rings exactly as the pool does at its moment
        assert (first.events == pool.view.events).all()
        seq = pool.allocate("late", list(range(8)))
        second = source.read()
        third = source.read()
        assert (second.events == pool.view.events).all()
        assert (third.events == pool.view.events).all()
        assert (third.events["time_ns"] != 0).any()
        pool.free(seq)
    finally:
        source.close()


def test_live_source_copies_the_shown_records_with_the_sequences(make_pool):
    # GIVEN a live pool with a sequence
    pool = make_pool(32)
    seq = pool.allocate("req-a", list(range(10)))
    source = LiveSource(pool.name)
    try:
        # WHEN the TUI reads it with that sequence's slot and a block selected
        slot = int(source.read().seqs["seq_id"].tolist().index(seq.seq_id))
        view = source.read(block=31, slot=slot)
        # THEN the sequence's block records and the selected block's are the pool's
        table = view.seqs["table"][slot][: int(view.seqs["num_blocks"][slot])]
        for b in [*table.tolist(), 31]:
            assert view.blocks[b].tobytes() == pool.view.blocks[b].tobytes()
        assert not view.torn
    finally:
        source.close()


def test_live_source_copies_the_block_columns_and_only_the_records_on_show(make_pool):
    # GIVEN a live pool with sequences
    pool = make_pool(64)
    populate(pool)
    source = LiveSource(pool.name)
    try:
        # WHEN the TUI reads it with block 7 on show
        view = source.read(block=7)
        # THEN every block's state, refcount and token count is the pool's, and of the whole
        # records only block 7's is there (and says so)
        for name in BLOCK_COLUMNS:
            assert (view.columns[name] == pool.view.blocks[name]).all()
        assert view.records.tolist() == [7]
        assert view.blocks[7].tobytes() == pool.view.blocks[7].tobytes()
        frame = Frame.of(view, stats={}, findings=[], taken_ns=0, copy_ms=0, torn=False, live=True)
        assert frame.has_records([7]) and not frame.has_records([8])
    finally:
        source.close()


def test_live_source_copies_the_records_a_copy_on_write_mark_compares(make_pool):
    # GIVEN a live pool where req-b was forked from req-a and wrote into a copy of its last block
    pool = make_pool(64)
    populate(pool)
    source = LiveSource(pool.name)
    try:
        seqs = source.read().seqs
        slot = next(
            s for s in range(len(seqs)) if request_of(seqs[s]) == "req-b" and seqs["state"][s]
        )
        # WHEN the TUI reads it with req-b's sequence on show
        view = source.read(slot=slot)
        frame = Frame.of(view, stats={}, findings=[], taken_ns=0, copy_ms=0, torn=False, live=True)
        # THEN its table's records and the sibling's block it diverges from are there, and its
        # last block is marked a copy-on-write copy
        assert frame.has_records(frame.block_table(slot))
        assert frame.has_records([theirs for _, _, theirs in cow_candidates(view.seqs, slot)])
        assert cow_positions(frame, slot) == {2}
    finally:
        source.close()
