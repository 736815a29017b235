"""A worker killed with SIGKILL is one cause: the whole-pool check reports each request it held
once, with its local cache counted in, not listed as a second leak; a survivor's
`pool.reclaim_dead()` records it in the findings ring once, and `kvscope run`'s supervisor
says it once, whichever of the two saw it first."""

from __future__ import annotations

import os

import pytest

from kvscope.allocator import KVPool
from kvscope.allocator.findings import Finding, FindingKind, read_findings
from kvscope.allocator.findingset import Origin, pool_findings
from kvscope.allocator.layout import BlockState
from kvscope.allocator.segment import segment_path
from kvscope.allocator.snapshot import snapshot
from kvscope.child import pool_key
from kvscope.supervisor import Supervisor
from tests.forking import killed_after

DEAD = FindingKind.LEAK_DEAD_OWNER.value


def killed_worker(name: str, requests: list[tuple[str, int]], free: bool = False) -> int:
    """Fork a worker that attaches to pool `name`, allocates each (request, tokens) and, with
    `free`, frees them again; kill it with SIGKILL once it is done; its pid."""

    def work() -> KVPool:
        pool = KVPool.attach(name)
        for request, tokens in requests:
            seq = pool.allocate(request, list(range(tokens)))
            if free:
                pool.free(seq)
        return pool

    return killed_after(work)


def cached_by(pool: KVPool, pid: int) -> int:
    """Free blocks in the local cache of pid."""
    b = pool.view.blocks
    return int(((b["owner_pid"] == pid) & (b["state"] == BlockState.LOCAL)).sum())


def test_a_dead_workers_local_cache_is_not_a_second_leak(make_pool):
    # GIVEN a worker killed holding two requests, with free blocks left in its local cache
    pool = make_pool(64)
    pid = killed_worker(pool.name, [("w-1", 9), ("w-2", 5)])
    cached = cached_by(pool, pid)
    assert cached > 0
    # WHEN the whole pool is checked
    dead = [f for f in pool.check() if f.kind == DEAD]
    # THEN every finding about the worker names one of its requests: its local cache is no
    # finding of its own, but each finding's message counts it
    assert {f.owner_pid for f in dead} == {pid}
    assert {f.request for f in dead} == {"w-1", "w-2"}
    assert all(f"with {cached} more free in its local cache" in f.message for f in dead)
    b = pool.view.blocks
    assert all(int(b["state"][f.block]) == BlockState.ALLOCATED for f in dead)


def died_reporting(pool: KVPool, held: int, reported: int) -> tuple[int, list[Finding]]:
    """A process that attaches, takes `held` requests of 5 blocks each, reports the first
    `reported` of them as leak_finished (as kvscope run's exit check does) and is killed; its
    pid, and the pool's findings as every reader assembles them."""

    def work() -> KVPool:
        p = KVPool.attach(pool.name)
        for i in range(held):
            seq = p.allocate(f"r{i}", list(range(100 * i, 100 * i + 20)))
            if i < reported:
                p.report(
                    Finding(
                        FindingKind.LEAK_FINISHED, "left", block=seq.block_table[0],
                        owner_pid=os.getpid(), request=f"r{i}",
                    )
                )  # fmt: skip
        return p

    pid = killed_after(work)
    return pid, pool_findings(snapshot(pool.view), Origin.live(pool.name)).findings


def test_past_the_cap_the_dead_owners_leaks_its_exit_reported_are_not_counted_again(make_pool):
    # GIVEN a process that died holding 14 requests of 5 blocks each (70 blocks: past the
    # check's 50 findings of a kind), each of which it reported as leak_finished as it exited
    # (kvscope run's exit check), and one more request it did not report
    pool = make_pool(128, block_size=4)
    pid, found = died_reporting(pool, held=15, reported=14)
    # THEN its leaks are the 14 it reported and the one it did not: none of the reported ones
    # again, listed or counted past the cap (the unreported one's 5 blocks are past the cap,
    # behind 50 of the reported ones': counted, by their owner and request)
    assert len([f for f in found if f.kind == FindingKind.LEAK_FINISHED]) == 14
    (dead,) = [f for f in found if f.kind == DEAD]
    assert dead.message == f"5 more {DEAD} findings not listed (5 in all)"
    assert dead.extra["not_listed"] == [[pid, "r14", 5]]


def test_past_the_cap_the_findings_not_listed_count_only_those_not_reported(make_pool):
    # GIVEN the same with 20 requests not reported (100 blocks: 50 listed, 50 counted)
    pool = make_pool(128, block_size=4)
    _, found = died_reporting(pool, held=24, reported=4)
    # THEN the finding that counts those past the cap counts the unreported requests' blocks
    # only, and says how many of its kind there are in all
    dead = [f for f in found if f.kind == DEAD]
    listed = [f for f in dead if f.block is not None]
    (more,) = [f for f in dead if f.block is None]
    assert {f.request for f in listed} <= {f"r{i}" for i in range(4, 24)}
    n = 20 * 5 - len(listed)
    assert more.message == f"{n} more {DEAD} findings not listed ({20 * 5} in all)"
    assert sum(e[2] for e in more.extra["not_listed"]) == n


def test_a_dead_worker_holding_only_its_local_cache_is_still_reported(make_pool):
    # GIVEN a worker that freed what it allocated (the blocks went to its local cache), killed
    pool = make_pool(64)
    pid = killed_worker(pool.name, [("w-1", 9)], free=True)
    cached = cached_by(pool, pid)
    assert cached > 0
    # WHEN the whole pool is checked
    dead = [f for f in pool.check() if f.kind == DEAD]
    # THEN the cache it left is reported (nothing else names the dead worker), block by block
    b = pool.view.blocks
    local = (b["owner_pid"] == pid) & (b["state"] == BlockState.LOCAL)
    assert sorted(f.block for f in dead) == local.nonzero()[0].tolist()
    assert all(f"free in the local cache of pid {pid}, which died" in f.message for f in dead)


def test_a_survivors_reclaim_is_recorded_once(make_pool):
    # GIVEN a worker killed holding two requests
    pool = make_pool(64)
    pid = killed_worker(pool.name, [("w-1", 9), ("w-2", 5)])
    held = int((pool.view.blocks["owner_pid"] == pid).sum())
    # WHEN a survivor reclaims, twice
    got = pool.reclaim_dead()
    again = pool.reclaim_dead()
    # THEN the findings ring holds one leak_dead_owner naming the dead pid and what came back
    assert got["processes"] == 1 and again["processes"] == 0
    recorded = [f for f in read_findings(pool.view) if f.kind == DEAD]
    assert len(recorded) == 1
    (f,) = recorded
    assert f.owner_pid == pid
    assert (
        f"pid {pid} died attached to the pool holding 2 sequence(s) (request(s) 'w-1', 'w-2');"
        f" pid {os.getpid()} reclaimed them (pool.reclaim_dead()): {got['blocks']} block(s)"
        " freed, shared ones lost a reference"
    ) == f.message
    assert got["blocks"] == held
    # AND every reader's assembly shows that one line about the dead worker, the check adding
    # none (what it held is back)
    found = pool_findings(snapshot(pool.view), Origin.live(pool.name)).findings
    assert [(x.kind, x.owner_pid) for x in found if x.owner_pid == pid] == [(DEAD, pid)]


def write_run_dir(run_dir, pool: KVPool) -> None:
    """What kvscope/child.py records when a process of a run opens `pool`."""
    created = int(pool.view.h["created_ns"])
    with open(os.path.join(run_dir, "hdr." + pool_key(pool.name, created)), "wb") as f:
        f.write(pool.view.raw[:256].tobytes())
    with open(os.path.join(run_dir, "pools"), "w") as f:
        f.write(f"{pool.name}\t{created}\t{segment_path(pool.name)}\n")


@pytest.mark.parametrize("first", ["supervisor", "survivor"])
def test_the_supervisor_says_a_dead_worker_once(make_pool, tmp_path, first):
    # GIVEN a pool of a run whose worker was killed holding a request, and a supervisor
    # following it (its polls made by hand, in the order the case names)
    pool = make_pool(64)
    write_run_dir(str(tmp_path), pool)
    said: list[str] = []
    sup = Supervisor(["script.py"], run_dir=str(tmp_path), env={}, echo=said.append)
    sup.poll()
    pid = killed_worker(pool.name, [("w-1", 9)])
    # WHEN the supervisor polls before the survivor reclaims, or after it
    if first == "supervisor":
        sup.poll()
        pool.reclaim_dead()
    else:
        pool.reclaim_dead()
    sup.poll()
    sup.poll()
    sup.cleanup()
    # THEN one line names the dead worker
    about = [line for line in said if f"pid {pid}" in line]
    assert len(about) == 1, said
    assert f"{DEAD}" in about[0]


def test_analyze_of_a_dump_counts_the_dead_owners_leaks_under_its_warnings(
    make_pool, tmp_path, capsys
):
    # GIVEN a dump of a pool a worker died in, holding a request's blocks
    from kvscope.cli import main
    from kvscope.dumpfile import write_dump

    pool = make_pool(64)
    killed_worker(pool.name, [("w-1", 9)])
    path = write_dump(pool, tmp_path / "pool.kvd")
    # WHEN it is analyzed
    code = main(["analyze", str(path)])
    out = capsys.readouterr().out
    # THEN the dead owner's leak is a warning (exit 0), and the line under the headline says
    # what it is and that kvscope run's default policy fails on it
    held = sum(1 for line in out.splitlines() if line.startswith("  leak_dead_owner blocks"))
    blocks = 3  # (9 tokens in blocks of 4)
    assert code == 0 and held == 1 and f"health: OK with {blocks} warning(s)" in out, out
    assert f"{blocks} of them leak_dead_owner: blocks a dead process still held" in out, out
    assert "--fail-on leak counts them as errors" in out


def test_a_finding_two_processes_recorded_in_the_same_words_is_one():
    # GIVEN the ring holding one use-after-free twice (two processes' checks found the same
    # overwritten poison of the same free) beside another of the same block said otherwise
    from kvscope.allocator.findings import Finding
    from kvscope.allocator.findingset import merge

    def uaf(when: str) -> Finding:
        msg = f"written after it was freed: pid 7 request 'w4' freed it at {when}"
        return Finding("use_after_free", msg, block=24, owner_pid=7, request="w4")

    ring = [uaf("12:00:00.288"), uaf("12:00:00.288"), uaf("12:00:01.500")]
    # WHEN the readers' one rule merges them THEN the repeat is dropped, the other kept
    assert [f.message[-12:] for f in merge(ring, [])] == ["12:00:00.288", "12:00:01.500"]
