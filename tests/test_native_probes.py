"""The C core with probes on against the Python path: over geometries (block size, local cache,
index shards, clients) and probe sets (none, each light probe alone, all of them), the same
operations leave the same bytes, the same flight-recorder events, the same allocation sites and
the same findings; and the core does run them (the probes no longer send a handle to Python)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolConfig, integrity
from kvscope.allocator.events import EventOp
from kvscope.allocator.findings import read_findings
from kvscope.allocator.layout import BlockState
from kvscope.probes import lockdep
from tests.test_native import _apply, _live_fields, _script, _state

PROBES = ("EVENTS", "OWNERSHIP", "LEAKS", "MAGIC", "LOCKDEP")
PROBE_SETS = {"none": (), **{p.lower(): (p,) for p in PROBES}, "all": PROBES}


def _pool(
    name: str, use_native: bool, bs: int, local: int, shards: int, clients: int, blocks: int = 0
) -> KVPool:
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
    if not use_native:
        pool._native = None
    # No watchdog: a hold it times would depend on the machine's speed.
    lockdep.install(pool, {**os.environ, "KVSCOPE_LOCK_HOLD_S": "0"})
    return pool


def _probe_state(pool: KVPool) -> dict[str, object]:
    """What the probes wrote: this client's events (without times), the site table, findings."""
    v = pool.view
    ev = v.events[pool.client].copy()
    ev["time_ns"] = 0
    # Sequence ids (the argument of allocate and fork events) as their order: a failed
    # allocation with prefix hits uses one on the Python path, none in the core.
    ids = np.isin(ev["op"], (EventOp.ALLOCATE, EventOp.FORK))
    ev["arg"][ids] = np.unique(ev["arg"][ids], return_inverse=True)[1].ravel()
    used = int(v.h["num_sites_used"])
    return {
        "events": ev.view(np.uint8),
        "event_head": int(v.clients["event_head"][pool.client]),
        "sites": [bytes(t) for t in v.sites["text"][:used]],
        "findings": [(f.kind, f.block, f.message, f.request) for f in read_findings(v)],
        "lock_order": {
            (bytes(e["src"]), bytes(e["dst"])) for e in v.lockgraph[: int(v.h["lockgraph_used"])]
        },
    }


def _same_all(a: KVPool, b: KVPool, step: str) -> None:
    sa, sb = _state(a), _state(b)
    for key in sa:
        assert np.array_equal(sa[key], sb[key]), f"after {step}: {key} differs (C vs Python)"
    pa, pb = _probe_state(a), _probe_state(b)
    # The core takes some locks together that the Python path takes in two transactions (an
    # allocation's index shard and free lock): its lock-order graph has every edge of the
    # Python path's, and may have more; except that the Python path takes a prompt's index
    # shards before it knows the prompt can hit (the core looks first, and takes none for a
    # prompt whose first block is not indexed): an edge into an index shard may be its alone.
    missing = pb.pop("lock_order") - pa.pop("lock_order")
    assert all(dst.startswith(b"index") for _, dst in missing), f"after {step}: {missing} missing"
    for key in pa:
        if isinstance(pa[key], np.ndarray):
            assert np.array_equal(pa[key], pb[key]), f"after {step}: {key} differ"
        else:
            assert pa[key] == pb[key], f"after {step}: {key} differ"


def _corrupt(pool: KVPool, live: list, rng: random.Random) -> None:
    """Hostile writes the probes exist for, the same on both pools: a block record scribbled
    over (magic) or a refcount taken twice (leaks)."""
    if not live:
        return
    seq = live[rng.randrange(len(live))]
    blk = seq.block_table[rng.randrange(len(seq.block_table))]
    b = pool.view.blocks
    if b["state"][blk] != BlockState.ALLOCATED:
        return
    if rng.random() < 0.5:
        b["owner_pid"][blk] ^= 0x40  # not resealed: the checksum no longer matches
    else:
        b["refcount"][blk] += 1
        pool.store.seal(np.array([blk]))


def _run(
    pool_name: str,
    monkeypatch,
    probes: tuple[str, ...],
    geometry: tuple,
    steps: int,
    seed: int,
    hostile: bool,
    waits: bool = False,
) -> dict[str, int]:
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p in probes else "0")
    # (with waiting sequences, a pool of 20 blocks: full often enough to preempt)
    blocks = 20 if waits else 0
    fast = _pool(pool_name, True, *geometry, blocks)
    slow = _pool(f"{pool_name}-py", False, *geometry, blocks)
    live_fast: list = []
    live_slow: list = []
    rng = random.Random(seed)
    try:
        script = _script(random.Random(seed), steps, churn=seed % 2 == 1, waits=waits)
        for i, op in enumerate(script):
            if hostile and rng.random() < 0.03:
                state = rng.getstate()
                _corrupt(fast, live_fast, rng)
                rng.setstate(state)
                _corrupt(slow, live_slow, rng)
            got_fast = _apply(fast, live_fast, op)
            got_slow = _apply(slow, live_slow, op)
            assert got_fast == got_slow, f"step {i} {op[0]}"
            assert _live_fields(live_fast) == _live_fields(live_slow)
            _same_all(fast, slow, f"step {i} {op}")
        return {**fast._native.stats(), "preemptions": fast.stats()["num_preemptions"]}
    finally:
        for p in (fast, slow):
            lockdep.LOCKDEP.uninstrument(p)
            p.close()
            p.unlink()


# (block size, local cache, shards, clients)
DEFAULT = (4, 3, 2, 4)
GEOMETRIES = [
    (bs, local, shards, clients)
    for bs in (1, 4, 16)
    for local in (0, 64)
    for shards in (1, 8)
    for clients in (2, 32)
]
# Every value of every dimension at least once, kept quick; the full product is slow.
QUICK = [(1, 0, 1, 2), (4, 64, 8, 32), (16, 0, 8, 2), (16, 64, 1, 32)]


def _gid(g: tuple) -> str:
    return "bs{}-local{}-shards{}-clients{}".format(*g)


@pytest.mark.parametrize("name", list(PROBE_SETS))
def test_each_probe_set_leaves_the_same_bytes_events_sites_and_findings(
    pool_name, monkeypatch, name
):
    # GIVEN two pools, one on the C core and one on the Python path, with the same probes on
    # WHEN the same operations run on both, with hostile writes now and then
    stats = _run(pool_name, monkeypatch, PROBE_SETS[name], DEFAULT, 300, 3, hostile=True)
    # THEN every byte, event, site and finding agreed after every step (checked in _run), and
    # the C core ran most of the operations with the probes on
    assert stats["native_ops"] > 150, stats


@pytest.mark.parametrize("geometry", QUICK, ids=_gid)
def test_the_light_probes_keep_every_operation_in_the_core(pool_name, monkeypatch, geometry):
    # GIVEN a geometry, WHEN the same operations run with no probe and with every light probe
    plain = _run(pool_name, monkeypatch, (), geometry, 250, 1, hostile=False)
    probed = _run(pool_name, monkeypatch, PROBES, geometry, 250, 1, hostile=False)
    # THEN both agreed with Python throughout, and the probes sent not one more operation there
    assert probed == plain and plain["native_ops"] > 40, (plain, probed)


@pytest.mark.parametrize("name", ["none", "events", "all"])
def test_preemption_with_probes_leaves_the_same_bytes_and_events(pool_name, monkeypatch, name):
    # GIVEN a small pool whose sequences are marked waiting now and then, with probes on
    # WHEN the same operations run on the C core and on the Python path
    stats = _run(pool_name, monkeypatch, PROBE_SETS[name], DEFAULT, 600, 8, False, waits=True)
    # THEN bytes, events (PREEMPT and FREE of each victim's table), sites and findings agreed
    # after every step, and the core preempted them itself: nothing handed back
    assert stats["preemptions"] > 0 and stats["fallbacks"] == 0, stats


@pytest.mark.slow
@pytest.mark.parametrize("probes", ["none", "all"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_gid)
def test_every_geometry(pool_name, monkeypatch, geometry, probes):
    stats = _run(pool_name, monkeypatch, PROBE_SETS[probes], geometry, 200, 2, hostile=True)
    assert stats["native_ops"] > 20, stats


def test_probe_findings_come_from_either_path(pool_name, monkeypatch):
    # GIVEN the C core with every light probe on, and a block record scribbled over
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1")
    pool = _pool(pool_name, True, *DEFAULT)
    try:
        a = pool.allocate("a", [1, 2, 3, 4, 5])
        b = pool.allocate("b", [9, 9, 9])
        ops = pool._native.stats()["native_ops"]
        first = a.block_table[0]
        pool.view.blocks["owner_pid"][first] ^= 1
        # WHEN the sequences end
        pool.free(b)
        pool.free(a)
        # THEN both ended in the C core; the scribbled record was reported once, and left
        # alone by its release (so it stays held: a leak)
        assert pool._native.stats()["native_ops"] == ops + 2
        kinds = [f.kind for f in pool.findings()]
        assert kinds == ["block_header_corrupt", "leak_finished"], kinds
        # and the flight recorder has the blocks' frees, the site names this file
        ops_seen = {int(o) for o in pool.view.events[pool.client]["op"]}
        assert {1, 2, 9} <= ops_seen, ops_seen
        site = int(pool.view.blocks["site"][first])
        assert "test_native_probes.py" in bytes(pool.view.sites["text"][site]).decode()
    finally:
        pool.close()
        pool.unlink()


def _magic_and_leaks(pool_name: str, monkeypatch) -> KVPool:
    """A pool on the C core with the magic and leaks probes on, past its first periodic check."""
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p in ("MAGIC", "LEAKS") else "0")
    pool = _pool(pool_name, True, *DEFAULT)
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
        ops = pool._native.stats()["native_ops"]
        pool.free(pool.allocate("c", [1, 2, 3]))
        # THEN the core's count found it and the probe reported it; the operation ran in the core
        assert [f.kind for f in pool.findings()] == ["free_list_corrupt"]
        assert pool._native.stats()["native_ops"] == ops + 2
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


def test_the_python_path_asks_the_core_to_verify_on_one_clock(pool_name, monkeypatch):
    # GIVEN the C core with magic and leaks on, past its first periodic check, the probe's own
    # (Python) verification counted, and a callback for findings
    import time

    pool = _magic_and_leaks(pool_name, monkeypatch)
    seen: list = []
    pool.on_finding = seen.append
    try:
        runs: list[int] = []
        verify = pool.probe._verify
        monkeypatch.setattr(pool.probe, "_verify", lambda: (runs.append(1), verify())[1])
        # WHEN the Python path asks for the periodic check (stats()), past the interval, again
        # and again, on a clean pool
        for _ in range(3):
            time.sleep(0.011)
            pool.stats()
        # THEN the core's check ran each time, and found nothing
        assert runs == [] and pool.findings() == []
        # WHEN the header is scribbled over and, past the core's interval, stats() is asked for
        # just after the Python path's own clock was reset
        was = int(pool.view.raw[8])
        pool.view.raw[8] ^= 0xFF
        time.sleep(0.011)
        pool.probe.last_verify = time.monotonic()
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


def _each_path(pool_name: str, *geometry):
    """A pool on the C core, then one on the Python path, each with a findings callback:
    (on the core, the pool, the findings handed to it); closed and removed after its turn."""
    for native in (True, False):
        pool = _pool(f"{pool_name}-{int(native)}", native, *geometry)
        seen: list = []
        pool.on_finding = seen.append
        try:
            yield native, pool, seen
        finally:
            lockdep.LOCKDEP.uninstrument(pool)
            pool.close()
            pool.unlink()


@pytest.mark.parametrize("taken", [1, 3], ids=["one-block", "three-blocks"])
def test_a_block_still_mapped_by_a_live_table_is_caught_when_handed_out(
    pool_name, monkeypatch, taken
):
    # GIVEN the leaks probe, on the C core and on the Python path, and a live request whose
    # table (in the segment) still maps a block that was freed: the stale table of a bug
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p == "LEAKS" else "0")
    found = []
    for native, pool, seen in _each_path(pool_name, 4, 4, 2, 4):
        holder = pool.allocate("holder", [1, 2, 3])
        gone = pool.allocate("gone", list(range(10, 10 + 4 * taken - 1)))
        freed = list(gone.block_table)
        pool.free(gone)
        seqs = pool.view.seqs
        seqs["table"][holder.slot, 1] = freed[-1]
        seqs["num_blocks"][holder.slot] = 2
        # WHEN a request takes blocks again (the freed ones come first, from the cache)
        ops = pool._native.stats()["native_ops"] if native else 0
        pool.allocate("taker", list(range(50, 50 + 4 * taken - 1)))
        # THEN the block is reported as handed out while still mapped, naming the holder
        found.append([(f.kind, f.block, f.request, f.message) for f in pool.findings()])
        assert [(f.kind, f.block, f.message) for f in seen] == [
            (k, b, m) for k, b, _, m in found[-1]
        ]
        if native:
            # (the core found it, reported it and handed the block out itself)
            assert pool._native.stats()["native_ops"] == ops + 1
    assert found[0] == found[1]
    assert found[0] == [
        (
            "use_after_free",
            freed[-1],
            "holder",
            "block is being handed to request 'taker' but request 'holder' of pid "
            f"{os.getpid()} still maps it: it was freed while that request's block table was "
            "in use",
        )
    ]


def _leak_at_release(pool: KVPool) -> int:
    """A request whose table in the segment maps its block twice, with the refcount to match,
    while the handle's Sequence lists it once: its release leaves the block held, unmapped."""
    a = pool.allocate("a", [1, 2, 3])
    x = a.block_table[0]
    pool.view.seqs["table"][a.slot, 1] = x
    pool.view.seqs["num_blocks"][a.slot] = 2
    pool.view.blocks["refcount"][x] = 2
    pool.store.seal(np.array([x]))
    pool.free(a)
    return x


def test_a_leak_at_a_release_is_written_by_the_core_as_the_python_path_reports_it(
    pool_name, monkeypatch
):
    # GIVEN the leaks probe (with sites and events), on the C core and on the Python path, and
    # a callback for findings
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "0" if p in ("MAGIC", "LOCKDEP") else "1")
    got = []
    for native, pool, seen in _each_path(pool_name, *DEFAULT):
        ops = pool._native.stats()["native_ops"] if native else 0
        # WHEN a request ends leaving its block held and unmapped
        x = _leak_at_release(pool)
        if native:
            # (the core released it and reported the leak itself)
            assert pool._native.stats()["native_ops"] == ops + 2
        # THEN one leak_finished names the block, its request and owner, in the ring and
        # to the callback, with the allocation site and the block's events
        (f,) = pool.findings()
        assert (f.kind, f.block, f.request, f.owner_pid) == (
            "leak_finished",
            x,
            "a",
            os.getpid(),
        )
        assert f.message == (
            "request 'a' ended but its block is still allocated (refcount 1) and no "
            "sequence maps it"
        )
        (cb,) = seen
        assert (cb.kind, cb.block, cb.message) == (f.kind, f.block, f.message)
        assert "test_native_probes.py" in cb.extra["site"]
        got.append((cb.extra["site"], [e["op"] for e in cb.events], f.site_id >= 0))
        # and the flight recorder has the finding after the free
        ev = pool.view.events[pool.client]
        ops_seen = [int(o) for o in ev["op"][ev["time_ns"] > 0]]
        assert ops_seen[-2:] == [EventOp.FREE, EventOp.FINDING]
        # WHEN either path finds the same leak again THEN it is not reported twice
        assert pool.probe.block_finding("leak_finished", x, "again") is None
        assert len(pool.findings()) == 1 and len(seen) == 1
    assert got[0] == got[1] and got[0][1] == ["allocate", "free"]


def test_a_refcount_taken_twice_is_reported_by_the_core_and_the_release_goes_on(
    pool_name, monkeypatch
):
    # GIVEN the leaks probe on the C core and on the Python path, and a request whose block's
    # refcount was taken twice (resealed: no magic finding)
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "1" if p in ("LEAKS", "EVENTS") else "0")
    got = []
    for native, pool, seen in _each_path(pool_name, *DEFAULT):
        a = pool.allocate("a", [1, 2, 3])
        x = a.block_table[0]
        pool.view.blocks["refcount"][x] = 2
        pool.store.seal(np.array([x]))
        ops = pool._native.stats()["native_ops"] if native else 0
        # WHEN the request ends
        pool.free(a)
        if native:
            # (the core released it, reporting what it found)
            assert pool._native.stats()["native_ops"] == ops + 1
        # THEN the refcount is reported before the release, and the block it left held
        # after it, in the ring and to the callback
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
        got.append([[e["op"] for e in f.events] for f in seen])
    assert got[0] == got[1]


def test_a_write_after_free_is_reported_by_the_core_as_it_hands_the_block_out(
    pool_name, monkeypatch
):
    # GIVEN guard mode on the C core (a CPU pool: it reads the K/V bytes itself), and a block
    # written after its release, in quarantine
    for p in PROBES:
        monkeypatch.setenv(f"KVSCOPE_{p}", "0")
    monkeypatch.setenv("KVSCOPE_GUARD", "1")
    pool = _pool(pool_name, True, 4, 4, 2, 4, blocks=16)
    seen: list = []
    pool.on_finding = seen.append
    try:
        a = pool.allocate("a", list(range(8)))
        x = a.block_table[1]
        pool.free(a)
        pool.kv[0, 1, x, 2, 0, :3] = 9.0
        rec = pool.view.blocks[x].copy()
        ops = pool._native.stats()
        # WHEN requests take every block, that one too
        for i in range(16):
            pool.allocate(f"b{i}", [100 + i] * 3)
        # THEN the core handed them all out itself, and reported the block once, naming who
        # freed it and when, and how much of its poison was overwritten
        after = pool._native.stats()
        assert after["native_ops"] == ops["native_ops"] + 16
        assert after["fallbacks"] == ops["fallbacks"]
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
    pool = _pool(pool_name, True, 4, 4, 2, 4, blocks=16)
    seen: list = []
    pool.on_finding = seen.append
    try:
        a = pool.allocate("a", list(range(7)))
        x = a.block_table[0]
        pool.kv[0, 1, x, -1, 0, 0] = 1.0
        ops = pool._native.stats()
        # WHEN the request ends
        pool.free(a)
        # THEN the core released it itself, put the canary back and reported the block once,
        # with a guard_violation event, then the finding, then the release's frees
        after = pool._native.stats()
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
    pool = _pool(pool_name, True, 4, 4, 2, 4, blocks=16)
    seen: list = []
    pool.on_finding = seen.append
    try:
        a = pool.allocate("a", list(range(9)))
        x = a.block_table[0]
        if written:
            pool.kv[:, :, x, :4] = 1.0
        pool.mark_computed(a, 8)
        pool.kv[0, 0, x, 1, 0, 0] = 4.0
        ops = pool._native.stats()
        # WHEN another request hits the prefix
        pool.allocate("b", list(range(9)))
        # THEN the core ran the allocation and reported the block once, naming the request
        # that published it and the moment, or that it was published before its K/V was written
        after = pool._native.stats()
        assert after["native_ops"] == ops["native_ops"] + 1
        assert after["fallbacks"] == ops["fallbacks"]
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
