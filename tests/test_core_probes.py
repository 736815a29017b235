"""The probes in the C core: what each finds (a scribbled record, a free ring missing a block, a
header changed, a block handed out while a live table maps it, a leak at a release, a refcount
taken twice, a write after free, a write past a block, a published block written again) is
reported once, in the findings ring and to the callback, with its events and site."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolConfig, faults, integrity
from kvscope.allocator.events import EventOp, events_for_block
from kvscope.allocator.findings import Finding, FindingKind
from kvscope.allocator.layout import block_checksums
from kvscope.probes import lockdep, watchdog

PROBES = ("EVENTS", "OWNERSHIP", "LEAKS", "MAGIC", "LOCKDEP")
# (block size, local cache, shards, clients)
DEFAULT = (4, 3, 2, 4)


def _pool(name: str, bs: int, local: int, shards: int, clients: int, blocks: int = 0) -> KVPool:
    pool = KVPool.create(
        name,
        PoolConfig(
            num_blocks=blocks or max(48, 192 // bs),
            block_size=bs,
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
            dtype="float32",
            local_cache_size=local,
            num_shards=shards,
            max_clients=clients,
            max_seqs=64,
            event_capacity=256,
        ),
    )
    # No watchdog: a hold it times would depend on the machine's speed.
    watchdog.install(pool, {**os.environ, "KVSCOPE_LOCK_HOLD_S": "0"})
    return pool


def test_a_scribbled_record_is_reported_once_and_left_held(pool_name, monkeypatch):
    # GIVEN the C core with every light probe on, and a block record scribbled over
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1")
    pool = _pool(pool_name, *DEFAULT)
    try:
        a = pool.allocate("a", [1, 2, 3, 4, 5])
        b = pool.allocate("b", [9, 9, 9])
        ops = pool._core.stats()["native_ops"]
        first = a.block_table[0]
        pool.view.blocks["owner_pid"][first] ^= 1
        # WHEN the sequences end
        pool.free(b)
        pool.free(a)
        # THEN both ended in the C core; the scribbled record was reported once, and left
        # alone by its release (so it stays held: a leak)
        assert pool._core.stats()["native_ops"] == ops + 2
        kinds = [f.kind for f in pool.findings()]
        assert kinds == ["block_header_corrupt", "leak_finished"], kinds
        # and the flight recorder has the blocks' frees, the site names this file
        ops_seen = {int(o) for o in pool.view.events[pool.client]["op"]}
        assert {1, 2, 9} <= ops_seen, ops_seen
        site = int(pool.view.blocks["site"][first])
        assert "test_core_probes.py" in bytes(pool.view.sites["text"][site]).decode()
    finally:
        pool.close()
        pool.unlink()


def _magic_and_leaks(pool_name: str, monkeypatch) -> KVPool:
    """A pool with the magic and leaks probes on, past its first periodic check."""
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p in ("MAGIC", "LEAKS") else "0")
    pool = _pool(pool_name, *DEFAULT)
    pool.free(pool.allocate("a", [1, 2, 3]))
    return pool


def test_the_core_reverifies_the_header_and_the_free_counts(pool_name, monkeypatch):
    # GIVEN the C core with magic and leaks on, past its first periodic check
    import time

    pool = _magic_and_leaks(pool_name, monkeypatch)
    try:
        time.sleep(0.011)
        pool.free(pool.allocate("b", [1, 2, 3]))
        assert pool.findings() == []
        # WHEN a block goes missing from the free ring, and 10 ms later an operation runs
        pool.view.ring_header["count"] -= 1
        time.sleep(0.011)
        ops = pool._core.stats()["native_ops"]
        pool.free(pool.allocate("c", [1, 2, 3]))
        # THEN the core's count found it and the probe reported it; the operation ran in the core
        assert [f.kind for f in pool.findings()] == ["free_list_corrupt"]
        assert pool._core.stats()["native_ops"] == ops + 2
        # WHEN the header is scribbled over THEN the next check reports that too
        pool.view.ring_header["count"] += 1
        pool.view.raw[8] ^= 0xFF
        time.sleep(0.011)
        pool.free(pool.allocate("d", [1, 2, 3]))
        assert [f.kind for f in pool.findings()][-1] == "header_corrupt"
    finally:
        lockdep.LOCKDEP.uninstrument(pool)
        pool.close()
        pool.unlink()


def test_stats_asks_the_core_to_verify_on_one_clock(pool_name, monkeypatch):
    # GIVEN the C core with magic and leaks on, past its first periodic check, pool.verify()
    # counted, and a callback for findings
    import time

    pool = _magic_and_leaks(pool_name, monkeypatch)
    seen: list = []
    pool.on_finding = seen.append
    try:
        runs: list[int] = []
        verify = pool.verify
        monkeypatch.setattr(pool, "verify", lambda: (runs.append(1), verify())[1])
        # WHEN stats() asks for the periodic check, past the interval, again and again, on a
        # clean pool
        for _ in range(3):
            time.sleep(0.011)
            pool.stats()
        # THEN the core's check ran each time, and found nothing
        assert runs == [] and pool.findings() == []
        # WHEN the header is scribbled over and, past the core's interval, stats() is asked for
        was = int(pool.view.raw[8])
        pool.view.raw[8] ^= 0xFF
        time.sleep(0.011)
        pool.stats()
        # THEN the core's check reports it at once, itself, naming the byte and its field, in
        # the ring and to the callback
        assert runs == []
        f = pool.findings()[-1]
        assert f.kind == "header_corrupt" and f.block is None
        assert f.message.startswith(
            f"segment header changed at byte 8 (version): found {was ^ 0xFF:02x}"
        )
        assert f", expected {was:02x}" in f.message
        assert [(g.kind, g.message) for g in seen] == [(f.kind, f.message)]
    finally:
        lockdep.LOCKDEP.uninstrument(pool)
        pool.close()
        pool.unlink()


def test_verify_is_the_cores_check_at_once_reported_once_and_not_recursive(pool_name, monkeypatch):
    # GIVEN the C core with magic and leaks on, just past an operation (its periodic check not
    # due), and a callback for findings that calls verify() again
    pool = _magic_and_leaks(pool_name, monkeypatch)
    seen: list = []
    inner: list = []

    def on_finding(f) -> None:
        seen.append(f)
        inner.append(pool.verify())

    pool.on_finding = on_finding
    try:
        pool.free(pool.allocate("a", [1, 2, 3]))
        # WHEN the pool is clean THEN verify() finds nothing
        assert pool.verify() == [] and pool.findings() == []
        # WHEN the free ring loses a block THEN verify(), at once, reports free_list_corrupt
        pool.view.ring_header["count"] -= 1
        (f,) = pool.verify()
        assert f.kind == "free_list_corrupt" and "the free ring holds" in f.message
        pool.view.ring_header["count"] += 1
        # WHEN a byte of the header's num_blocks is scribbled over
        off = pool.view.header.dtype.fields["num_blocks"][1]
        was = int(pool.view.raw[off])
        pool.view.raw[off] ^= 0xFF
        (f,) = pool.verify()
        # THEN verify() returns header_corrupt naming the byte, its field, found and expected
        assert f.kind == "header_corrupt" and f.block is None
        assert f.extra["offset"] == off and f.extra["field"] == "num_blocks"
        assert f.extra["found"][:2] == f"{was ^ 0xFF:02x}"
        assert f.extra["expected"][:2] == f"{was:02x}"
        assert f.message.startswith(f"segment header changed at byte {off} (num_blocks)")
        # THEN each finding was written once by the core and handed to the callback, whose
        # own verify() did not recurse
        assert [g.kind for g in pool.findings()] == ["free_list_corrupt", "header_corrupt"]
        assert [(g.kind, g.message) for g in seen] == [
            ("free_list_corrupt", seen[0].message),
            (f.kind, f.message),
        ]
        assert inner == [[], []]
        # WHEN verify() is asked again THEN what it reported is not reported twice
        assert pool.verify() == []
        assert len(pool.findings()) == 2
        pool.view.raw[off] ^= 0xFF
    finally:
        lockdep.LOCKDEP.uninstrument(pool)
        pool.close()
        pool.unlink()


def _watched(pool_name: str, *geometry) -> tuple[KVPool, list]:
    """A pool with a findings callback: (the pool, the findings handed to it)."""
    pool = _pool(pool_name, *geometry)
    seen: list = []
    pool.on_finding = seen.append
    return pool, seen


def _close(pool: KVPool) -> None:
    lockdep.LOCKDEP.uninstrument(pool)
    pool.close()
    pool.unlink()


@pytest.mark.parametrize("taken", [1, 3], ids=["one-block", "three-blocks"])
def test_a_block_still_mapped_by_a_live_table_is_caught_when_handed_out(
    pool_name, monkeypatch, taken
):
    # GIVEN the leaks probe, and a live request of another handle (another client) whose
    # table (in the segment) still maps a block that was freed: the stale table of a bug
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p == "LEAKS" else "0")
    pool, seen = _watched(pool_name, 4, 4, 2, 4)
    other = KVPool.attach(pool_name)
    try:
        holder = other.allocate("holder", [1, 2, 3])
        gone = pool.allocate("gone", list(range(10, 10 + 4 * taken - 1)))
        freed = list(gone.block_table)
        pool.free(gone)
        seqs = pool.view.seqs
        seqs["table"][holder.slot, 1] = freed[-1]
        seqs["num_blocks"][holder.slot] = 2
        # WHEN a request takes blocks again (the freed ones come first, from the cache)
        ops = pool._core.stats()["native_ops"]
        pool.allocate("taker", list(range(50, 50 + 4 * taken - 1)))
        # THEN the core handed the blocks out, and reported the block as handed out while
        # still mapped, naming the holder, in the ring and to the callback
        assert pool._core.stats()["native_ops"] == ops + 1
        found = [(f.kind, f.block, f.request, f.message) for f in pool.findings()]
        assert found == [
            (
                "use_after_free",
                freed[-1],
                "holder",
                "block is being handed to request 'taker' but request 'holder' of pid "
                f"{os.getpid()} still maps it: it was freed while that request's block table "
                "was in use",
            )
        ]
        assert [(f.kind, f.block, f.message) for f in seen] == [(k, b, m) for k, b, _, m in found]
    finally:
        seqs = pool.view.seqs
        seqs["num_blocks"][holder.slot] = 1
        other.close()
        _close(pool)


def test_a_table_of_its_own_left_live_by_a_release_is_caught_when_its_block_is_handed_out(
    pool_name, monkeypatch
):
    # GIVEN the leaks probe, and a release that freed its blocks but left its table live and
    # mapping them (the use-after-free fault: the stale table of a bug in the core)
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p == "LEAKS" else "0")
    pool, seen = _watched(pool_name, 4, 4, 2, 4)
    try:
        pool.allocate("holder", [1, 2, 3])
        gone = pool.allocate("gone", [10, 11, 12])
        (freed,) = gone.block_table
        faults.configure("use-after-free:1")
        try:
            pool.free(gone)
        finally:
            faults.configure(None)
        assert pool.view.seqs["state"][gone_slot(pool, "gone")] != 0
        # WHEN a request takes a block again (the freed one comes first, from the cache)
        pool.allocate("taker", [50, 51, 52])
        # THEN the core reported it as handed out while that table still maps it
        found = [(f.kind, f.block, f.request) for f in pool.findings()]
        assert found == [("use_after_free", freed, "gone")]
        assert [(f.kind, f.block) for f in seen] == [("use_after_free", freed)]
    finally:
        _close(pool)


def gone_slot(pool: KVPool, request: str) -> int:
    """The slot of the live sequence record whose request is `request`."""
    seqs = pool.view.seqs
    (slot,) = [
        s
        for s in range(len(seqs))
        if seqs["state"][s] != 0 and seqs["request"][s] == request.encode()
    ]
    return slot


def test_a_table_of_its_own_written_from_outside_the_core_is_found_by_the_check(
    pool_name, monkeypatch
):
    # GIVEN the leaks probe, and a live request of this handle whose table something outside
    # the core rewrote to map a freed block (the core counts its own tables as it writes them:
    # what it did not write, the whole-pool check finds against the refcounts)
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p == "LEAKS" else "0")
    pool, _ = _watched(pool_name, 4, 4, 2, 4)
    try:
        holder = pool.allocate("holder", [1, 2, 3])
        gone = pool.allocate("gone", [10, 11, 12])
        (freed,) = gone.block_table
        pool.free(gone)
        pool.view.seqs["table"][holder.slot, 1] = freed
        pool.view.seqs["num_blocks"][holder.slot] = 2
        # WHEN the pool is checked / THEN the free block a live table maps is found
        kinds = {(f.kind, f.block) for f in pool.check()}
        assert ("use_after_free", freed) in kinds, kinds
    finally:
        pool.view.seqs["num_blocks"][holder.slot] = 1
        _close(pool)


def _seal(pool: KVPool, blk: int) -> None:
    """Recompute a block record's checksum after a test changed it (no magic finding)."""
    b = pool.view.blocks
    b["checksum"][blk] = block_checksums(b, np.array([blk]))[0]


def _leak_at_release(pool: KVPool) -> int:
    """A request whose release keeps its block (the leak fault): held, and no table maps it."""
    a = pool.allocate("a", [1, 2, 3])
    x = a.block_table[0]
    faults.configure("leak:1")
    try:
        pool.free(a)
    finally:
        faults.configure(None)
    return x


def test_a_leak_at_a_release_is_reported_by_the_core(pool_name, monkeypatch):
    # GIVEN the leaks probe (with sites and events), and a callback for findings
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "0" if p in ("MAGIC", "LOCKDEP") else "1")
    pool, seen = _watched(pool_name, *DEFAULT)
    try:
        ops = pool._core.stats()["native_ops"]
        # WHEN a request ends leaving its block held and unmapped
        x = _leak_at_release(pool)
        # THEN the core released it and reported the leak itself
        assert pool._core.stats()["native_ops"] == ops + 2
        # with one leak_finished naming the block, its request and owner, in the ring and
        # to the callback, with the allocation site and the block's events
        (f,) = pool.findings()
        assert (f.kind, f.block, f.request, f.owner_pid) == ("leak_finished", x, "a", os.getpid())
        assert f.message == (
            "request 'a' ended but its block is still allocated (refcount 1) and no "
            "sequence maps it"
        )
        (cb,) = seen
        assert (cb.kind, cb.block, cb.message) == (f.kind, f.block, f.message)
        assert "test_core_probes.py" in cb.extra["site"] and f.site_id >= 0
        # (the release's FREE event names the blocks it let go: not the one it kept)
        assert [e["op"] for e in cb.events] == ["allocate"]
        # and the flight recorder has the finding after the free
        ev = pool.view.events[pool.client]
        ops_seen = [int(o) for o in ev["op"][ev["time_ns"] > 0]]
        assert ops_seen[-2:] == [EventOp.FREE, EventOp.FINDING]
        # WHEN the probe finds the same leak again THEN it is not reported twice
        assert pool.probe.block_finding("leak_finished", x, "again") is None
        assert len(pool.findings()) == 1 and len(seen) == 1
    finally:
        _close(pool)


def test_a_refcount_taken_twice_is_reported_by_the_core_and_the_release_goes_on(
    pool_name, monkeypatch
):
    # GIVEN the leaks probe, and a request whose block's refcount was taken twice (resealed:
    # no magic finding)
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p in ("LEAKS", "EVENTS") else "0")
    pool, seen = _watched(pool_name, *DEFAULT)
    try:
        a = pool.allocate("a", [1, 2, 3])
        x = a.block_table[0]
        pool.view.blocks["refcount"][x] = 2
        _seal(pool, x)
        ops = pool._core.stats()["native_ops"]
        # WHEN the request ends
        pool.free(a)
        # THEN the core released it, reporting the refcount before the release, and the block
        # it left held after it, in the ring and to the callback, each with the block's events
        assert pool._core.stats()["native_ops"] == ops + 1
        found = [(f.kind, f.block, f.request, f.message) for f in pool.findings()]
        assert found == [
            (
                "refcount_mismatch",
                x,
                "a",
                "refcount is 2 but 1 sequence(s) of this process map the block (at the end "
                "of request 'a')",
            ),
            (
                "leak_finished",
                x,
                "a",
                "request 'a' ended but its block is still allocated (refcount 1) and no "
                "sequence maps it",
            ),
        ]
        assert [(f.kind, f.block, f.message) for f in seen] == [(k, b, m) for k, b, _, m in found]
        assert [[e["op"] for e in f.events] for f in seen] == [
            ["allocate"],
            ["allocate", "finding", "free"],
        ]
    finally:
        _close(pool)


def test_a_finding_reported_from_python_is_in_the_flight_recorder_by_the_core(
    pool_name, monkeypatch
):
    # GIVEN the flight recorder on, and a request holding a block
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p == "EVENTS" else "0")
    pool, seen = _watched(pool_name, *DEFAULT)
    try:
        a = pool.allocate("a", [1, 2, 3])
        x = a.block_table[0]
        head = int(pool.view.clients["event_head"][pool.client])
        # WHEN a reader reports a finding about it (as kvscope run's exit check, the block-table
        # audit and the KV-event publisher do, through pool.report)
        pool.report(Finding(FindingKind.LEAK_FINISHED, "left held", block=x, request="a"))
        # THEN its FINDING event is in this process's ring, written by the core (one event, the
        # ring's head moved by one), before the finding itself
        assert int(pool.view.clients["event_head"][pool.client]) == head + 1
        ev = events_for_block(pool.view, x)
        assert [(e["op"], e["request"], e["pid"]) for e in ev] == [
            ("allocate", "a", os.getpid()),
            ("finding", "a", os.getpid()),
        ]
        assert ev[-1]["time_ns"] <= pool.findings()[-1].extra["time_ns"]
        assert [f.kind for f in seen] == ["leak_finished"]
        pool.free(a)
    finally:
        _close(pool)


def test_a_write_after_free_is_reported_by_the_core_as_it_hands_the_block_out(
    pool_name, monkeypatch
):
    # GIVEN guard mode on the C core (a CPU pool: it reads the K/V bytes itself), and a block
    # written after its release, in quarantine
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "0")
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    pool = _pool(pool_name, 4, 4, 2, 4, blocks=16)
    seen: list = []
    pool.on_finding = seen.append
    try:
        a = pool.allocate("a", list(range(8)))
        x = a.block_table[1]
        pool.free(a)
        pool.kv[0, 1, x, 2, 0, :3] = 9.0
        rec = pool.view.blocks[x].copy()
        ops = pool._core.stats()
        # WHEN requests take every block, that one too
        for i in range(16):
            pool.allocate(f"b{i}", [100 + i] * 3)
        # THEN the core handed them all out itself, and reported the block once, naming who
        # freed it and when, and how much of its poison was overwritten
        after = pool._core.stats()
        assert after["native_ops"] == ops["native_ops"] + 16
        (f,) = [f for f in pool.findings() if f.kind == "use_after_free"]
        assert (f.block, f.request, f.owner_pid) == (x, "a", os.getpid())
        assert f.message == integrity.poison_message(rec, 3)
        assert [(g.kind, g.block, g.message) for g in seen] == [(f.kind, x, f.message)]
    finally:
        lockdep.LOCKDEP.uninstrument(pool)
        pool.close()
        pool.unlink()


def test_a_write_past_a_block_is_reported_by_the_core_at_its_release(pool_name, monkeypatch):
    # GIVEN guard mode on the C core (a CPU pool), and a request that wrote into its first
    # block's guard slot
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p == "EVENTS" else "0")
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    pool = _pool(pool_name, 4, 4, 2, 4, blocks=16)
    seen: list = []
    pool.on_finding = seen.append
    try:
        a = pool.allocate("a", list(range(7)))
        x = a.block_table[0]
        pool.kv[0, 1, x, -1, 0, 0] = 1.0
        ops = pool._core.stats()
        # WHEN the request ends
        pool.free(a)
        # THEN the core released it itself, put the canary back and reported the block once,
        # with a guard_violation event, then the finding, then the release's frees
        after = pool._core.stats()
        assert after["native_ops"] == ops["native_ops"] + 1
        assert integrity.broken_canaries(pool.kv) == []
        (f,) = pool.findings()
        assert (f.kind, f.block, f.request, f.message) == (
            "guard_violation",
            x,
            "a",
            integrity.CANARY_MESSAGE,
        )
        assert [(g.kind, g.block) for g in seen] == [("guard_violation", x)]
        ev = pool.view.events[pool.client]
        ops_seen = [int(o) for o in ev["op"][ev["time_ns"] > 0]]
        assert ops_seen[-4:] == [
            EventOp.GUARD_VIOLATION,
            EventOp.FINDING,
            EventOp.FREE,
            EventOp.FREE,
        ]
    finally:
        lockdep.LOCKDEP.uninstrument(pool)
        pool.close()
        pool.unlink()


@pytest.mark.parametrize("written", [True, False], ids=["written", "published-blank"])
def test_a_published_block_written_again_is_reported_by_the_core_at_a_prefix_hit(
    pool_name, monkeypatch, written
):
    # GIVEN the digest probe on the C core (a CPU pool), a published block, and a write into
    # it after its publication
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "0")
    monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    pool = _pool(pool_name, 4, 4, 2, 4, blocks=16)
    seen: list = []
    pool.on_finding = seen.append
    try:
        a = pool.allocate("a", list(range(9)))
        x = a.block_table[0]
        if written:
            pool.kv[:, :, x, :4] = 1.0
        pool.mark_computed(a, 8)
        pool.kv[0, 0, x, 1, 0, 0] = 4.0
        ops = pool._core.stats()
        # WHEN another request hits the prefix
        pool.allocate("b", list(range(9)))
        # THEN the core ran the allocation and reported the block once, naming the request
        # that published it and the moment, or that it was published before its K/V was written
        after = pool._core.stats()
        assert after["native_ops"] == ops["native_ops"] + 1
        (f,) = pool.findings()
        assert (f.kind, f.block, f.request) == ("published_block_modified", x, "a")
        if written:
            assert f.message.startswith(
                "K/V changed since request 'a' published it (seen at a prefix hit by request 'b')"
            )
        else:
            assert f.message.startswith(
                f"{integrity.UNWRITTEN_AT_PUBLISH}: mark_computed digested an all-zero block"
            )
        assert [(g.kind, g.message) for g in seen] == [(f.kind, f.message)]
    finally:
        lockdep.LOCKDEP.uninstrument(pool)
        pool.close()
        pool.unlink()
