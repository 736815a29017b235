"""The findings ring and the site table have one writer, the C core: `KVPool.report` and the
site table write through it, and what the core finds itself (a double free, a scribbled block
record, a lock-order edge closing a cycle) it writes where it finds it, once, with none of the
probe's Python finding writers called."""

from __future__ import annotations

import os
import signal

import pytest

from kvscope.allocator import KVPool, faults, probing
from kvscope.allocator.findings import Finding
from kvscope.probes.lockdep import LockDep
from kvscope.probes.lockgraph import SegmentGraph, call_site, cycle_finding, find_path
from tests import lockholder
from tests.forking import fork_child, wait_child


def _kinds(pool: KVPool, kind: str) -> list[Finding]:
    return [f for f in pool.findings() if f.kind == kind]


def _refuse(monkeypatch, owner: object, name: str) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran")

    monkeypatch.setattr(owner, name, refuse)


def test_report_writes_through_the_core(make_pool, monkeypatch):
    # GIVEN a handle, and a callback for findings
    pool = make_pool(16)
    seen: list[Finding] = []
    pool.on_finding = seen.append
    # WHEN a finding is reported
    f = Finding("double_free", "block 5 was freed twice", block=5, owner_pid=77, request="r9")
    f.site_id = 3
    pool.report(f)
    # THEN the core wrote it as it is, and it was handed over
    (got,) = pool.findings()
    assert (got.kind, got.block, got.owner_pid, got.request, got.severity, got.site_id) == (
        "double_free",
        5,
        77,
        "r9",
        "error",
        3,
    )
    assert got.message == "block 5 was freed twice" and got.extra["time_ns"] > 0
    assert seen == [f]


def test_report_cuts_the_request_and_message_to_their_fields(make_pool):
    # GIVEN a finding whose request and message are longer than the ring's fields
    pool = make_pool(16)
    # WHEN it is reported, THEN it is cut to 32 and 200 bytes, as every reader expects
    pool.report(Finding("leak_orphan", "m" * 300, request="r" * 40))
    (got,) = pool.findings()
    assert got.request == "r" * 32 and got.message == "m" * 200
    assert (got.block, got.owner_pid, got.severity) == (None, None, "error")


def test_report_recovers_a_dead_holder_of_the_findings_lock(make_pool, pool_name):
    # GIVEN a process killed while it held the findings lock
    pool = make_pool(16)

    def die_holding_findings() -> int:
        p = KVPool.attach(pool_name)
        lockholder.hold(p, p.locks.index("findings"))
        os.kill(os.getpid(), signal.SIGKILL)
        return 0

    assert wait_child(fork_child(die_holding_findings, 20)) == -signal.SIGKILL
    # WHEN a finding is reported (the core recovers the lock, and writes under it)
    pool.report(Finding("leak_orphan", "after the death"))
    # THEN the dead holder and the finding are both recorded, once each
    kinds = [f.kind for f in pool.findings()]
    assert kinds == ["lock_dead_holder", "leak_orphan"], kinds


def test_sites_are_interned_by_the_core(make_pool, monkeypatch):
    # GIVEN the ownership probe on a handle
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    pool = make_pool(16)
    # WHEN two allocations at two lines, and one at the first line again
    seqs = [pool.allocate(f"r{i}", [i] * 5) for i in range(2)]
    seqs.append(pool.allocate("r2", [9] * 5))
    # THEN each line is one entry of the site table, named by its blocks
    used = int(pool.view.h["num_sites_used"])
    texts = [bytes(t).decode() for t in pool.view.sites["text"][:used]]
    assert len(texts) == 2 and all("test_core_findings.py:" in t for t in texts), texts
    site = pool.view.blocks["site"]
    assert site[seqs[0].block_table[0]] == site[seqs[1].block_table[0]]
    assert site[seqs[2].block_table[0]] != site[seqs[0].block_table[0]]


def test_a_full_site_table_takes_no_more(make_pool, monkeypatch):
    # GIVEN the ownership probe on a handle, and a script with one allocation on each of
    # NUM_SITES + 1 lines (each line one site)
    from kvscope.allocator.layout import NUM_SITES

    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    pool = make_pool(16)
    lines = "\n".join(f"seqs.append(pool.allocate('r{i}', [{i}]))" for i in range(NUM_SITES + 1))
    code = compile(lines, "sites_script.py", "exec")
    # (and another code object with the allocation on the 8th line of the same file)
    again = compile(
        "\n" * 7 + "seqs.append(pool.allocate('again', [7]))", "sites_script.py", "exec"
    )
    site = pool.view.blocks["site"]
    # WHEN each allocation's block is read and the sequence freed, line by line
    sites = []

    def take(seq):
        sites.append(int(site[seq.block_table[0]]))
        pool.free(seq)

    class Taker(list):
        def append(self, seq):
            take(seq)

    exec(code, {"pool": pool, "seqs": Taker()})
    exec(again, {"pool": pool, "seqs": Taker()})
    # THEN the first NUM_SITES lines got entries 0..NUM_SITES-1, the one more none (-1), and
    # the 8th line again keeps its own entry
    assert sites[:NUM_SITES] == list(range(NUM_SITES))
    assert sites[NUM_SITES] == -1
    assert sites[-1] == 7
    assert int(pool.view.h["num_sites_used"]) == NUM_SITES
    texts = [bytes(t).decode() for t in pool.view.sites["text"][:2]]
    assert texts == ["sites_script.py:1 <module>", "sites_script.py:2 <module>"], texts


def test_a_double_free_is_written_by_the_core(make_pool, probes, monkeypatch):
    # GIVEN the double-free fault armed, on the core with the probes, and the probe's Python
    # finding writer refused
    pool = make_pool(16)
    seq = pool.allocate("priv", [50, 51, 52, 53, 54])
    last = seq.block_table[-1]
    faults.configure("double-free:1")
    _refuse(monkeypatch, probing.PoolProbes, "block_finding")
    ops = pool._core.stats()["native_ops"]
    seen: list[Finding] = []
    pool.on_finding = seen.append
    # WHEN the request ends
    pool.free(seq)
    # THEN the core released it and wrote one double_free about its last block
    assert pool._core.stats()["native_ops"] == ops + 1 and faults.FIRED[-1] == "double-free"
    (f,) = _kinds(pool, "double_free")
    assert (f.block, f.owner_pid, f.request) == (last, pool.pid, "priv")
    assert f.message == (
        "block released a second time after request 'priv' ended: it is already free"
    )
    assert [g.kind for g in seen] == ["double_free"] and "site" in seen[0].extra


def test_a_scribbled_block_record_is_written_by_the_core(make_pool, probes, monkeypatch):
    # GIVEN a published block whose record something outside the allocator overwrote, and the
    # probe's Python finding writer refused
    pool = make_pool(16)
    first = pool.allocate("first", list(range(9)))
    pool.mark_computed(first, 8)
    blk = first.block_table[0]
    pool.view.blocks["refcount"][blk] = 0x5A5A5A5A
    _refuse(monkeypatch, probing.PoolProbes, "block_finding")
    ops = pool._core.stats()["native_ops"]
    # WHEN a prefix hit takes a reference on it (the core reseals the record)
    second = pool.allocate("second", list(range(9)))
    # THEN the core ran it, and reported the record once, as it was before it changed it
    assert pool._core.stats()["native_ops"] == ops + 1 and second.num_cached_tokens == 8
    (f,) = _kinds(pool, "block_header_corrupt")
    assert (f.block, f.owner_pid, f.request) == (blk, pool.pid, "first")
    assert "about to change it" in f.message
    # AND the record is sealed again: the next operation on it finds nothing more
    pool.free(second)
    assert len(_kinds(pool, "block_header_corrupt")) == 1


def _hit_prefix(pool: KVPool) -> None:
    a = pool.allocate("a", list(range(8)))
    pool.mark_computed(a, 8)
    pool.free(a)
    pool.free(pool.allocate("b", list(range(8)) + [99]))


@pytest.mark.parametrize("repeat", range(3))
def test_a_cycle_the_core_closes_is_written_by_the_core(make_pool, monkeypatch, repeat):
    # GIVEN lockdep, and an edge index -> seqs in the segment's graph (a hit of the core's
    # under the lock-inversion fault)
    pool = make_pool(32)
    lockdep = LockDep()
    lockdep.instrument(pool)
    pool.mark_computed(pool.allocate("published", list(range(8))), 8)
    faults.configure("lock-inversion:1")
    try:
        pool.allocate("inverted", list(range(8)) + [98])
    finally:
        faults.configure(None)
    assert _kinds(pool, "lock_order_cycle") == []
    seen: list[Finding] = []
    pool.on_finding = seen.append
    _refuse(monkeypatch, LockDep, "_learn")
    ops = pool._core.stats()["native_ops"]
    # WHEN an allocation hits a published prefix (the core's order: seqs -> index)
    _hit_prefix(pool)
    # THEN the core ran every operation and wrote the cycle it closed, once, naming both edges
    assert pool._core.stats()["native_ops"] == ops + 5
    (f,) = _kinds(pool, "lock_order_cycle")
    pid = os.getpid()
    assert f.message.startswith(f"pid {pid} takes seqs -> index at test_core_findings.py:")
    assert f"_hit_prefix; pid {pid} took index -> seqs at test_core_findings.py:" in f.message
    assert (f.owner_pid, f.block, f.severity) == (pid, None, "error")
    assert f.message == _as_lockdep_says(pool, "seqs", "index")
    assert [g.kind for g in seen] == ["lock_order_cycle"]
    lockdep.uninstrument(pool)


def _as_lockdep_says(pool: KVPool, src: str, dst: str) -> str:
    """The message lockdep composes (lockgraph.cycle_finding) for the edge src -> dst of the
    segment's graph and the chain back that the edges before it hold, as the ring keeps it."""
    edges = SegmentGraph(pool).edges()
    at = next(k for k, e in enumerate(edges) if (e.src, e.dst) == (src, dst))
    new = edges[at]
    path = find_path(edges[:at], new.dst, new.src)
    assert path
    return cycle_finding(new, path).message.encode()[:200].decode()


def test_a_longer_chain_is_named_edge_by_edge(make_pool, monkeypatch):
    # GIVEN lockdep, and edges index -> free -> seqs in the segment's graph (as another
    # process's lockdep left them)
    pool = make_pool(32)
    lockdep = LockDep()
    lockdep.instrument(pool)
    for src, dst in (("index", "free"), ("free", "seqs")):
        assert pool.core.learn_edge(src, dst, call_site())
    assert _kinds(pool, "lock_order_cycle") == []
    _refuse(monkeypatch, LockDep, "_learn")
    # WHEN the core takes seqs -> free, then seqs -> index
    _hit_prefix(pool)
    # THEN it wrote each cycle it closed as lockdep names it: one edge back, then two
    got = [f.message for f in _kinds(pool, "lock_order_cycle")]
    assert got == [_as_lockdep_says(pool, "seqs", "free"), _as_lockdep_says(pool, "seqs", "index")]
    assert "took index -> free" in got[1] and "took free -> seqs" in got[1]
    lockdep.uninstrument(pool)
