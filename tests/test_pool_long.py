"""Sequences of more than CHUNK blocks (the most one transaction journals) run in the C core:
an allocation takes its hits and the first CHUNK new blocks in one transaction and appends the
rest, CHUNK blocks' worth a transaction; a release gives its table back from the tail, CHUNK
blocks a transaction; a publish of every full block, CHUNK blocks a transaction; a fork of a
long table is one transaction; with or without the probes."""

from __future__ import annotations

import pytest

from kvscope.allocator import PoolExhausted
from kvscope.allocator.events import recent_events
from kvscope.allocator.layout import CHUNK

BS = 2


def _write_kv(pool, seq) -> None:
    """The engine's K/V writes of every position (guard mode checks them at the free)."""
    for b in seq.block_table:
        pool.kv[:, :, b, :BS] = 1.0


def _prompt(first: int, blocks: int) -> list[int]:
    return [first] + list(range(1000, 1000 + blocks * BS - 2))


@pytest.mark.parametrize("guard", [False, True], ids=["plain", "guard"])
@pytest.mark.parametrize("probed", [False, True], ids=["bare", "probes"])
def test_a_long_sequence_runs_in_the_core(make_pool, monkeypatch, guard, probed):
    if probed:
        for name in ("LEAKS", "MAGIC", "EVENTS", "OWNERSHIP", "DIGEST"):
            monkeypatch.setenv(f"KVSCOPE_{name}", "1")
    blocks = 2 * CHUNK + 30
    pool = make_pool(3 * blocks + 16, block_size=BS, guard=guard, max_seqs=64, max_clients=4)
    pool.free(pool.allocate("warm", [1, 2, 3]))  # (the first claim fills the slot reserve)
    before = pool._core.stats()
    stats0 = pool.stats()
    # GIVEN a prompt of more than two CHUNKs of blocks
    toks = _prompt(7, blocks)
    # WHEN it is allocated, published, forked, hit by a second request, appended and freed
    a = pool.allocate("long-a", toks)
    # THEN the sequence holds every token and block, in the order of its prompt
    assert a.tokens == toks and len(a.block_table) == blocks and a.num_cached_tokens == 0
    assert pool.slot_mapping(a, len(toks) - 1, len(toks)) == [
        a.block_table[-1] * pool.slots_per_block + (len(toks) - 1) % BS
    ]
    _write_kv(pool, a)
    assert pool.mark_computed(a, len(toks)) == blocks - 1  # (every full block)
    child = pool.fork(a, "long-a-fork")
    assert child.block_table == a.block_table
    b = pool.allocate("long-b", toks)  # every full block is a hit
    assert (
        b.num_cached_tokens == (blocks - 1) * BS
        and b.block_table[: blocks - 1] == a.block_table[: blocks - 1]
    )
    _write_kv(pool, b)
    pool.append(a, list(range(3 * BS)))
    _write_kv(pool, a)
    for s in (child, a, b):
        pool.free(s)
    after = pool._core.stats()
    # AND the core ran each operation itself, the pool is consistent and every block is back
    assert after["native_ops"] - before["native_ops"] >= 8
    assert pool.check() == []
    got = pool.stats()
    assert got["num_sequences"] == 0 and got["num_allocated"] == 0
    assert (
        got["num_free"] + got["num_cached"] + got["num_local"] + got["num_quarantined"]
        == (stats0["num_blocks"])
    )
    assert got["num_frees"] - stats0["num_frees"] == 3 * blocks + 3 - 1 + 1  # (a grew 2 blocks)
    assert not [f for f in pool.findings() if f.severity == "error"]


def test_a_long_prompt_that_runs_short_leaves_the_pool_as_it_was(make_pool):
    # GIVEN a pool with room for the first CHUNK new blocks of a prompt but not the rest
    pool = make_pool(
        CHUNK + 20, block_size=BS, max_seqs=64, max_clients=4, max_blocks_per_seq=CHUNK + 64
    )
    pool.free(pool.allocate("warm", [1, 2, 3]))
    keep = pool.allocate("other", [5, 6, 7])
    before = pool.stats()
    # WHEN a prompt of CHUNK + 40 blocks is allocated
    with pytest.raises(PoolExhausted):
        pool.allocate("too-long", _prompt(9, CHUNK + 40))
    # THEN the part allocated is released again: the blocks and sequences are as they were
    got = pool.stats()
    assert got["num_sequences"] == before["num_sequences"] == 1
    assert got["num_allocated"] == before["num_allocated"]
    assert pool.check() == []
    # AND the pool still serves
    pool.free(keep)
    pool.free(pool.allocate("after", _prompt(3, CHUNK + 5)))
    assert pool.check() == [] and pool.stats()["num_allocated"] == 0


def test_a_long_waiting_sequence_is_preempted_in_the_core(make_pool, monkeypatch):
    # GIVEN a waiting sequence of more than CHUNK blocks and a pool with no other room
    pool = make_pool(
        2 * CHUNK, block_size=BS, max_seqs=64, max_clients=4, max_blocks_per_seq=2 * CHUNK
    )
    pool.free(pool.allocate("warm", [1, 2, 3]))
    wait = pool.allocate("wait", _prompt(5, CHUNK + 60))
    pool.set_state(wait, "waiting")
    # WHEN a request needs more blocks than are left (and its blocks and the preemption's fit
    # one transaction's undo journal)
    got = pool.allocate("new", _prompt(6, CHUNK - 20))
    # THEN the core preempts the long sequence to make room
    assert wait.state == "preempted" and wait.block_table == []
    assert len(got.block_table) == CHUNK - 20
    assert pool.stats()["num_preemptions"] == 1 and pool.check() == []
    pool.free(got)


def _waiting(pool, blocks: int, bs: int = 16):
    seq = pool.allocate("wait", [5] + list(range(1000, 1000 + blocks * bs - 2)))
    pool.set_state(seq, "waiting")
    return seq


@pytest.mark.parametrize("op", ["allocate", "append"])
def test_a_waiting_sequence_too_long_for_the_journal_is_preempted_ahead(make_pool, op):
    # GIVEN a waiting sequence of 300 blocks of 16 tokens (its release alone, inside another
    # operation, would outgrow that operation's undo journal) and no other room
    pool = make_pool(
        330, block_size=16, max_seqs=64, max_clients=4, events=True, event_capacity=2048
    )
    pool.free(pool.allocate("warm", [1, 2, 3]))
    run = pool.allocate("run", list(range(16 * 10)))
    wait = _waiting(pool, 300)
    # WHEN an allocation or an append needs 40 blocks
    if op == "allocate":
        got = pool.allocate("new", list(range(500, 500 + 16 * 40)))
        assert len(got.block_table) == 40
    else:
        pool.append(run, list(range(16 * 40)))
        assert len(run.block_table) == 50
    # THEN the waiting sequence is preempted first, in transactions of its own, and the
    # operation runs again and succeeds, in the core
    assert wait.state == "preempted" and wait.block_table == []
    st = pool.stats()
    assert st["num_preemptions"] == 1 and pool.check() == []
    # AND every block it held was released once, recorded as preempted and freed
    ev = [e for e in recent_events(pool.view, 2048) if e["request"] == "wait"]
    preempted = [e["block"] for e in ev if e["op"] == "preempt"]
    freed = [e["block"] for e in ev if e["op"] == "free"]
    assert sorted(preempted) == sorted(freed) == sorted(set(preempted))
    assert len(preempted) == 300


def test_a_preemption_ahead_stays_when_the_operation_still_fails(make_pool):
    # GIVEN a waiting sequence of 300 blocks of 16 tokens in a pool with 20 other blocks
    pool = make_pool(320, block_size=16, max_seqs=64, max_clients=4, max_blocks_per_seq=400)
    pool.free(pool.allocate("warm", [1, 2, 3]))
    wait = _waiting(pool, 300)
    # WHEN an allocation needs more than the whole pool
    with pytest.raises(PoolExhausted):
        pool.allocate("huge", list(range(16 * 330)))
    # THEN it fails, and the sequence preempted ahead of it stays preempted (as blocks evicted
    # ahead stay evicted: docs/POOL.md); the pool is consistent and holds nothing of "huge"
    assert wait.state == "preempted" and pool.stats()["num_allocated"] == 0
    assert pool.check() == []


def test_the_abort_of_a_prompt_that_ran_short_is_marked_as_the_core_s_not_the_program_s(
    make_pool, monkeypatch
):
    # GIVEN the flight recorder on, and a pool with room for a prompt's first CHUNK new blocks
    # but not the rest
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(CHUNK + 20, block_size=BS, max_blocks_per_seq=CHUNK + 64)
    # WHEN the prompt's allocation runs short (the core abandons what it took), and the
    # program aborts a request of its own
    with pytest.raises(PoolExhausted):
        pool.allocate("too-long", _prompt(9, CHUNK + 40))
    pool.abort(pool.allocate("mine", [5, 6, 7]))
    # THEN the abandoned sequence's abort events say so (arg 1), the program's do not (arg 0)
    aborts = [e for e in recent_events(pool.view, 10_000) if e["op"] == "abort"]
    args = {(e["request"], e["arg"]) for e in aborts}
    assert args == {("too-long", 1), ("mine", 0)}, args
