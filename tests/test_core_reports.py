"""What the C core records and reports itself: a call site's text, composed and interned by the
core (Python has no recorder of sites); a release or preemption whose table holds a block
already free or a scribbled record, and an append filling a block whose record is scribbled,
each reported once (the probe's Python finding writers never called); the live sequences and
the slots sampled guard mode guards."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from kvscope.allocator import KVPool, probing, sites
from kvscope.allocator.events import EventOp
from kvscope.allocator.layout import CHUNK, BlockState, block_checksums
from kvscope.allocator.sites import site_frames


def _refuse(monkeypatch, owner: object, name: str) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran")

    monkeypatch.setattr(owner, name, refuse)


def _alloc(pool: KVPool, name: str):
    return pool.allocate(name, [7] * 5), sys._getframe()


def _outer(pool: KVPool, name: str):
    return _alloc(pool, name), sys._getframe()


def _site_of_block(pool: KVPool, seq) -> int:
    return int(pool.view.blocks["site"][seq.block_table[0]])


def test_the_core_composes_a_site_as_sites_py_does(make_pool, monkeypatch):
    # GIVEN the ownership probe (one frame a site) on the core
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.delenv("KVSCOPE_STACK_DEPTH", raising=False)
    pool = make_pool(16)
    ops = pool._core.stats()["native_ops"]
    # WHEN a sequence is allocated twice from one line
    (a, frame), (b, _) = _alloc(pool, "a"), _alloc(pool, "b")
    # THEN the core ran both, and the site is the frame's text as sites.py composes it, once
    assert pool._core.stats()["native_ops"] == ops + 2
    assert site_frames(pool.view, _site_of_block(pool, a)) == [sites.frame_text(frame)]
    assert _site_of_block(pool, b) == _site_of_block(pool, a)
    assert int(pool.view.h["num_sites_used"]) == 1


def test_the_core_composes_a_stack_as_sites_py_does(make_pool, monkeypatch):
    # GIVEN stacks of 2 frames
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.setenv("KVSCOPE_STACK_DEPTH", "2")
    pool = make_pool(16)
    ops = pool._core.stats()["native_ops"]
    # WHEN one stack allocates twice
    ((a, inner), outer), ((b, _), _) = _outer(pool, "a"), _outer(pool, "b")
    # THEN the core ran both: 2 frame entries and 1 stack entry, as sites.py interns them
    assert pool._core.stats()["native_ops"] == ops + 2
    frames = site_frames(pool.view, _site_of_block(pool, a))
    assert frames == [sites.frame_text(inner), sites.frame_text(outer)]
    assert _site_of_block(pool, b) == _site_of_block(pool, a)
    assert int(pool.view.h["num_sites_used"]) == 3
    raw = bytes(pool.view.sites["text"][_site_of_block(pool, a)]).rstrip(b"\0")
    assert raw == b"stack: 0 1"


# -- a release whose table holds a block already free, or a scribbled record ------------------


def _only_the_core(pool: KVPool, monkeypatch) -> int:
    """Refuse the probe's Python finding writer; the count of the core's operations now."""
    _refuse(monkeypatch, probing.PoolProbes, "block_finding")
    return pool._core.stats()["native_ops"]


def _seal(pool: KVPool, blk: int) -> None:
    """Recompute a block record's checksum after a test changed it (no magic finding)."""
    b = pool.view.blocks
    b["checksum"][blk] = block_checksums(b, np.array([blk]))[0]


def _kinds(pool: KVPool) -> list[str]:
    return [f.kind for f in pool.findings()]


def _ops_of(pool: KVPool, blk: int) -> list[int]:
    ev = pool.view.events[pool.client]
    ev = ev[ev["time_ns"] > 0]
    ev = ev[np.argsort(ev["time_ns"], kind="stable")]
    return [int(o) for o in ev["op"][ev["block"] == blk]]


def test_a_block_already_free_in_a_released_table_is_reported_by_the_core(make_pool, monkeypatch):
    # GIVEN the flight recorder on, and a sequence one of whose blocks reads as free already
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(16)
    seq = pool.allocate("twice", list(range(6)))
    blk = seq.block_table[0]
    pool.view.blocks["refcount"][blk] = 0
    ops = _only_the_core(pool, monkeypatch)
    # WHEN it is freed
    pool.free(seq)
    # THEN the core released it, with one double_free about that block, in the probe's
    # words, its FINDING event before the release's FREE
    assert pool._core.stats()["native_ops"] == ops + 1 and seq.state == "finished"
    (f,) = pool.findings()
    assert (f.kind, f.block, f.request) == ("double_free", blk, "twice")
    assert f.message == "block released by request 'twice' but it was already free"
    assert _ops_of(pool, blk)[-2:] == [int(EventOp.FINDING), int(EventOp.FREE)]


def test_a_scribbled_record_in_a_released_table_is_reported_by_the_core(make_pool, monkeypatch):
    # GIVEN the magic probe on, and a sequence one of whose records was overwritten
    monkeypatch.setenv("KVSCOPE_MAGIC", "1")
    pool = make_pool(16)
    seq = pool.allocate("scrib", list(range(6)))
    blk, other = seq.block_table
    pool.view.blocks["owner_pid"][blk] ^= 1
    ops = _only_the_core(pool, monkeypatch)
    # WHEN it is aborted
    pool.abort(seq)
    # THEN the core released it, the scribbled record reported once and left as it is
    # (still held), the other block freed
    assert pool._core.stats()["native_ops"] == ops + 1 and seq.state == "aborted"
    (f,) = pool.findings()
    assert (f.kind, f.block) == ("block_header_corrupt", blk)
    assert f.message == (
        "block record checksum mismatch when its request released it: its header was "
        "overwritten outside the allocator"
    )
    b = pool.view.blocks
    assert int(b["refcount"][blk]) == 1 and int(b["state"][blk]) == int(BlockState.ALLOCATED)
    assert int(b["refcount"][other]) == 0


def test_a_preempted_table_with_a_block_already_free_is_reported_by_the_core(
    make_pool, monkeypatch
):
    # GIVEN a waiting sequence one of whose blocks reads as free already, in a small pool
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(8)
    old = pool.allocate("old", list(range(12)))
    blk = old.block_table[1]
    pool.view.blocks["refcount"][blk] = 0
    pool.set_state(old, "waiting")
    ops = _only_the_core(pool, monkeypatch)
    # WHEN an allocation needs its blocks
    new = pool.allocate("new", list(range(100, 124)))
    # THEN the core preempted it, with one double_free about that block
    assert pool._core.stats()["native_ops"] == ops + 1
    assert old.state == "preempted" and len(new.block_table) == 6
    (f,) = pool.findings()
    assert (f.kind, f.block, f.request) == ("double_free", blk, "old")
    assert f.message == "block released by request 'old' but it was already free"


# -- an append filling a block whose record is scribbled ---------------------------------------


@pytest.mark.parametrize("more", [2, 6], ids=["decode step", "new block"])
def test_an_append_filling_a_scribbled_block_is_reported_by_the_core(make_pool, monkeypatch, more):
    # GIVEN the magic probe and the flight recorder on, and a sequence whose last, part-filled
    # block's record was overwritten; the probe's Python finding writer refused
    monkeypatch.setenv("KVSCOPE_MAGIC", "1")
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(16)
    seq = pool.allocate("grow", list(range(6)))
    blk = seq.block_table[1]
    pool.view.blocks["owner_pid"][blk] ^= 1
    ops = _only_the_core(pool, monkeypatch)
    # WHEN tokens are appended that fill it (the append's own block events first)
    pool.append(seq, list(range(100, 100 + more)))
    # THEN the core ran it, and reported the record once, as it was before it was resealed
    assert pool._core.stats()["native_ops"] == ops + 1 and len(seq.tokens) == 6 + more
    (f,) = pool.findings()
    assert (f.kind, f.block) == ("block_header_corrupt", blk)
    assert f.owner_pid == pool.pid ^ 1
    assert "about to change it" in f.message
    assert _ops_of(pool, blk)[-1] == int(EventOp.FINDING)
    # AND the record is sealed again: nothing more is found when it is released
    pool.free(seq)
    assert _kinds(pool) == ["block_header_corrupt"]


# -- the live-sequence registry and the sampled-guard slots are the core's ----------------------


def test_the_live_sequences_are_the_cores_registry(make_pool):
    # GIVEN a handle
    pool = make_pool(32)
    # WHEN sequences are allocated, forked, preempted and resumed, and freed
    a = pool.allocate("a", list(range(6)))
    b = pool.fork(a, "b")
    c = pool.allocate("c", list(range(50, 59)))
    assert pool.live() == {a.slot: a, b.slot: b, c.slot: c}
    pool.free(b)
    # THEN the core's registry names the live ones by slot, in the order they came, each the
    # caller's own object
    live = pool.live()
    assert list(live) == [a.slot, c.slot] and live[a.slot] is a and live[c.slot] is c
    # AND a copy: changing it changes nothing
    live.clear()
    assert len(pool.live()) == 2 and not hasattr(pool, "_seqs")
    pool.free(a)
    pool.abort(c)
    assert pool.live() == {}


def test_the_slots_sampled_guard_mode_guards_are_the_cores(make_pool):
    # GIVEN sampled guard mode, one allocation in 2
    pool = make_pool(32, guard_sample=2)
    # WHEN four sequences are allocated
    seqs = [pool.allocate(f"r{i}", [i] * 5) for i in range(4)]
    # THEN the first and the third are guarded, in the core's set; a release forgets its slot
    assert [pool._core.guarded(s.slot) for s in seqs] == [True, False, True, False]
    slot = seqs[0].slot
    pool.free(seqs[0])
    assert not pool._core.guarded(slot)
    assert [pool._core.guarded(s.slot) for s in seqs[1:]] == [False, True, False]


def test_sampled_guard_mode_draws_at_a_resume_too(make_pool):
    # GIVEN sampled guard mode, one claim in 2, on a pool of 8 blocks: three sequences of 2
    # (the first drawn), the oldest waiting
    pool = make_pool(8, guard_sample=2, local_cache_size=0, max_clients=4, max_seqs=64)
    old, mid, run = (
        pool.allocate(r, list(range(i, i + 8))) for i, r in ((0, "o"), (8, "m"), (16, "r"))
    )
    assert [pool._core.guarded(s.slot) for s in (old, mid, run)] == [True, False, True]
    pool.set_state(old, "waiting")
    # WHEN a prompt of 3 blocks preempts it (the fourth claim: not drawn), and, once that one
    # is freed, it resumes (the fifth: drawn)
    new = pool.allocate("new", list(range(100, 112)))
    assert old.state == "preempted" and not pool._core.guarded(new.slot)
    pool.free(new)
    pool.resume(old)
    # THEN the resumed sequence is guarded in its new slot
    assert old.state == "running" and pool._core.guarded(old.slot)


def test_a_long_release_reports_what_its_tail_holds(make_pool, monkeypatch):
    # GIVEN the magic probe on, and a sequence of more than CHUNK blocks: one record in the tail
    # its first transaction releases scribbled, one block there already free
    monkeypatch.setenv("KVSCOPE_MAGIC", "1")
    pool = make_pool(CHUNK + 40)
    seq = pool.allocate("long", list(range(4 * (CHUNK + 10))))
    table = list(seq.block_table)
    scribbled, freed = table[-1], table[-2]
    pool.view.blocks["owner_pid"][scribbled] ^= 1
    pool.view.blocks["refcount"][freed] = 0
    _seal(pool, freed)
    ops = _only_the_core(pool, monkeypatch)
    # WHEN it is freed
    pool.free(seq)
    # THEN the core released it, each reported once, the scribbled record left held
    assert pool._core.stats()["native_ops"] == ops + 1 and seq.state == "finished"
    got = sorted((f.kind, f.block) for f in pool.findings())
    assert got == [("block_header_corrupt", scribbled), ("double_free", freed)]
    assert int(pool.view.blocks["refcount"][scribbled]) == 1
