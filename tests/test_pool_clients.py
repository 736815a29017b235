"""Client records under many processes: concurrent reclaimers, a full table, close() at any size.

Real processes and real `kill -9`: processes die holding sequences, then several reclaimers,
`kvscope check --repair` and newly attaching processes run against each other.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolError
from kvscope.allocator.layout import ClientState, SeqState
from kvscope.cli import main
from tests.forking import fork_child
from tests.forking import wait_child as _wait

BS = 4
NUM_BLOCKS = 256
PROMPTS = [[50 + i] * 8 + [i] for i in range(4)]
CHILD_ALARM_S = 60
CORRUPT = 3


def _fork(fn: Callable[[], int]) -> int:
    return fork_child(fn, CHILD_ALARM_S)


def _own_sequences_intact(pool: KVPool, live: list) -> bool:
    """True when the pool's table still holds each of this process's sequences as it knows it."""
    seqs = pool.view.seqs
    for s in live:
        row = seqs[s.slot]
        if (
            int(row["state"]) != SeqState.RUNNING
            or int(row["owner_pid"]) != os.getpid()
            or row["table"][: int(row["num_blocks"])].tolist() != s.block_table
        ):
            print(f"pid {os.getpid()}: sequence {s.request_id} was changed by another process")
            return False
    return True


def _allocate_some(pool: KVPool, rng: random.Random, tag: str, n: int) -> list:
    live = []
    for i in range(n):
        seq = pool.allocate(
            f"{tag}-{i}", rng.choice(PROMPTS) + [rng.randrange(40)] * rng.randrange(9)
        )
        pool.mark_computed(seq, seq.num_tokens)
        live.append(seq)
    return live


def _holder(name: str, seed: int, ready_w: int) -> int:
    """Attach, take sequences, say so, and wait to be killed."""
    pool = KVPool.attach(name)
    _allocate_some(pool, random.Random(seed), f"h{seed}", 4)
    os.write(ready_w, b"1")
    time.sleep(CHILD_ALARM_S)
    return 0


def _attacher(name: str, seed: int, rounds: int) -> int:
    """Attach, allocate, check that nobody touched its sequences, free, close; again."""
    rng = random.Random(seed)
    for r in range(rounds):
        pool = KVPool.attach(name)
        live = _allocate_some(pool, rng, f"a{seed}-{r}", 3)
        for _ in range(5):
            if not _own_sequences_intact(pool, live):
                return CORRUPT
            time.sleep(0.001)
        for s in live:
            pool.free(s)
        pool.close()
    return 0


def _reclaimer(name: str, rounds: int) -> int:
    pool = KVPool.attach(name)
    for _ in range(rounds):
        pool.reclaim_dead()
    pool.close()
    return 0


def _repairer(name: str) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return main(["check", name, "--repair"])


def _conserved(pool: KVPool) -> None:
    st = pool.stats()
    assert st["num_free"] + st["num_local"] + st["num_cached"] + st["num_allocated"] == NUM_BLOCKS


@pytest.mark.slow
def test_concurrent_reclaimers_repair_and_attaches_never_touch_a_live_process(make_pool):
    # GIVEN a pool whose client table is small enough that records are reused at once
    pool = make_pool(NUM_BLOCKS, block_size=BS, max_clients=10, max_seqs=256)
    for rnd in range(6):
        # GIVEN three processes killed while holding sequences
        r, w = os.pipe()
        holders = [
            _fork(lambda i=i, rnd=rnd, w=w: _holder(pool.name, 10 * rnd + i, w)) for i in range(3)
        ]
        for _ in holders:
            os.read(r, 1)
        for pid in holders:
            os.kill(pid, signal.SIGKILL)
            _wait(pid)
        os.close(r)
        os.close(w)
        # WHEN three reclaimers, a `check --repair` and three attaching processes run at once
        procs = [_fork(lambda: _reclaimer(pool.name, 8)) for _ in range(3)]
        procs.append(_fork(lambda: _repairer(pool.name)))
        procs += [
            _fork(lambda i=i, rnd=rnd: _attacher(pool.name, 100 * rnd + i, 4)) for i in range(3)
        ]
        codes = [_wait(pid) for pid in procs]
        # THEN no process saw its sequences changed, and the pool is consistent
        assert codes == [0] * len(procs), codes
        assert pool.check() == []
    pool.reclaim_dead()
    # THEN every dead process was reclaimed once, and no block is lost
    assert pool.check() == []
    c = pool.view.clients
    attached = np.flatnonzero(c["state"] == ClientState.ATTACHED).tolist()
    assert attached == [pool.client]
    assert pool.stats()["num_allocated"] == 0
    _conserved(pool)


def test_a_stale_dead_client_is_not_reclaimed_once_a_live_process_reuses_its_record(make_pool):
    from kvscope.allocator.recovery import find_dead

    # GIVEN a process killed holding sequences, seen dead by this reclaimer
    pool = make_pool(NUM_BLOCKS, block_size=BS, max_clients=3)
    r, w = os.pipe()
    dead = _fork(lambda: _holder(pool.name, 1, w))
    os.read(r, 1)
    os.kill(dead, signal.SIGKILL)
    _wait(dead)
    (stale,) = find_dead(pool.view, pool.client)
    # ... and then reclaimed by another process, whose record a new live process reuses
    assert _wait(_fork(lambda: _reclaimer(pool.name, 1))) == 0
    go_r, go_w = os.pipe()

    def reuser() -> int:
        p = KVPool.attach(pool.name)
        live = _allocate_some(p, random.Random(2), "reuser", 4)
        os.write(w, p.client.to_bytes(4, "little"))
        os.read(go_r, 1)
        if not _own_sequences_intact(p, live):
            return CORRUPT
        for s in live:
            p.free(s)
        p.close()
        return 0

    pid = _fork(reuser)
    assert int.from_bytes(os.read(r, 4), "little") == stale.client
    # WHEN this reclaimer acts on its stale list
    got = pool._core.reclaim_client(stale.client, stale.pid, stale.start, stale.generation)
    totals = pool.reclaim_dead()
    os.write(go_w, b"1")
    # THEN it does nothing: the live process's sequences are intact
    assert got is None and totals["processes"] == 0
    assert _wait(pid) == 0
    assert pool.check() == []


def test_a_table_full_of_dead_processes_still_takes_an_attach_and_a_repair(make_pool, capsys):
    # GIVEN a pool with room for 3 processes: this one, and 2 killed holding sequences
    pool = make_pool(NUM_BLOCKS, block_size=BS, max_clients=3)
    r, w = os.pipe()
    dead = [_fork(lambda i=i: _holder(pool.name, i, w)) for i in range(2)]
    for _ in dead:
        os.read(r, 1)
    for pid in dead:
        os.kill(pid, signal.SIGKILL)
        _wait(pid)
    assert (pool.view.clients["state"] == ClientState.ATTACHED).all()

    # WHEN another process attaches
    def attach() -> int:
        p = KVPool.attach(pool.name)
        (done,) = p.reclaimed_at_attach
        p.free(p.allocate("new", [1, 2, 3]))
        p.close()
        return 0 if done["pid"] in dead and done["sequences"] == 4 else 5

    # THEN it reclaims one dead process's record and works
    assert _wait(_fork(attach)) == 0
    assert {f.kind for f in pool.check()} <= {"leak_dead_owner"}

    # WHEN the table is full again (one more dies) and `kvscope check --repair` runs
    dead.append(_fork(lambda: _holder(pool.name, 7, w)))
    os.read(r, 1)
    os.kill(dead[-1], signal.SIGKILL)
    _wait(dead[-1])
    assert (pool.view.clients["state"] == ClientState.ATTACHED).all()
    assert main(["check", pool.name, "--repair"]) == 0
    # THEN it attaches, reclaims both dead processes and the pool is clean
    err = capsys.readouterr().err
    assert "from 2 dead process(es)" in err, err
    assert pool.check() == []
    assert pool.stats()["num_allocated"] == 0
    _conserved(pool)


def test_a_table_full_of_live_processes_refuses_in_one_line(make_pool):
    # GIVEN a pool with room for 2 processes, both alive
    pool = make_pool(32, max_clients=2)
    other = KVPool.attach(pool.name)
    # WHEN a third attach comes THEN it is refused with what to do
    with pytest.raises(PoolError, match="all alive.*larger max_clients"):
        KVPool.attach(pool.name)
    other.close()
    KVPool.attach(pool.name).close()


def test_close_with_hundreds_of_live_sequences(make_pool):
    # GIVEN a handle with 600 live sequences (each in a slot of its reserve)
    pool = make_pool(2048, max_seqs=1024, max_clients=8)
    other = KVPool.attach(pool.name)
    for i in range(600):
        other.allocate(f"r{i}", [i, i + 1, i + 2])
    # WHEN it closes
    other.close()
    # THEN its record is detached and none of its slots stays reserved; its sequences stay,
    # each a leak (the ring keeps the newest findings)
    seqs = pool.view.seqs
    assert pool.view.clients["state"][other.client] == ClientState.DETACHED
    assert not ((seqs["reserved"] == 1) & (seqs["owner_client"] == other.client)).any()
    assert int((seqs["state"] == SeqState.RUNNING).sum()) == 600
    leaks = [f for f in pool.findings() if f.kind == "leak_finished"]
    assert len(leaks) == len(pool.view.findings) < 600
    # AND the whole-pool check finds all 600 from the tables, the ring's room aside
    checked = pool.check()
    assert {f.kind for f in checked} == {"leak_finished"}
    assert checked[-1].message.endswith("(600 in all)")


def test_a_close_reports_each_sequence_still_holding_blocks(make_pool, capsys):
    # GIVEN a worker's handle with a request that published its prefix and forked a sample
    # (neither freed: the bug), a request freed as it should be, and one set waiting
    pool = make_pool(32, block_size=4)
    other = KVPool.attach(pool.name)
    seen = []
    other.on_finding = seen.append
    leaked = other.allocate("leaky", list(range(10)))
    other.mark_computed(leaked, 8)
    other.fork(leaked, "leaky-sample")
    other.free(other.allocate("done", list(range(100, 106))))
    waiting = other.allocate("waiting", list(range(200, 206)))
    other.set_state(waiting, "waiting")
    # WHEN it closes
    other.close()
    # THEN each live request holding blocks is a leak_finished, handed to on_finding and read
    # from the ring by another process, by its own first block (not the published prefix;
    # the sample holds only its parent's blocks, reported once)
    by_request = {f.request: f for f in seen}
    assert set(by_request) == {"leaky", "waiting"} and {f.kind for f in seen} == {"leak_finished"}
    leak = by_request["leaky"]
    assert leak.block == 2 and leak.owner_pid == os.getpid()
    assert leak.message == (
        "request 'leaky' still held 3 block(s) when the pool was closed: "
        "free or abort every sequence when its request ends"
    )
    assert {(f.request, f.block) for f in pool.findings()} == {(f.request, f.block) for f in seen}
    # AND the blocks stay held, and `kvscope check` reads the pool as leaking, not healthy
    assert pool.stats()["num_allocated"] == 5
    assert main(["check", pool.name]) == 1
    out = capsys.readouterr().out
    assert "UNHEALTHY" in out and "request 'leaky' still held 3 block(s)" in out


def test_a_close_reports_each_preempted_sequence_left_waiting(make_pool, capsys):
    # GIVEN a worker's handle whose two waiting requests another request's allocation
    # preempted, and which it never resumed nor ended (the bug: its scheduler lost them)
    pool = make_pool(32, block_size=4)
    other = KVPool.attach(pool.name)
    seen = []
    other.on_finding = seen.append
    lost = [
        other.allocate(rid, list(range(base, base + 8))) for rid, base in (("pa", 0), ("pb", 50))
    ]
    for seq in lost:
        other.set_state(seq, "waiting")
    other.free(other.allocate("big", list(range(100, 228))))  # every block: both preempted
    assert [seq.state for seq in lost] == ["preempted", "preempted"]
    # WHEN it closes
    other.close()
    # THEN each is a leak_finished about no block, naming its request, one finding each
    assert sorted((f.kind, f.request, f.block) for f in seen) == [
        ("leak_finished", "pa", None),
        ("leak_finished", "pb", None),
    ]
    assert seen[0].message == (
        f"request {seen[0].request!r} was preempted and neither resumed nor ended when the pool"
        " was closed: free or abort every sequence when its request ends, a preempted one too"
    )
    # AND the whole-pool check reads them from the tables as sequences no handle can end
    # (`kvscope check` shows the close's words for them), which `--repair` ends
    checked = [f.message for f in pool.check() if f.request == "pa"]
    assert checked and checked[0].startswith(
        "request 'pa' was preempted and neither resumed nor ended, but pid"
    )
    assert main(["check", pool.name]) == 1
    out = capsys.readouterr().out
    assert "request 'pa' was preempted and neither resumed nor ended when the pool" in out
    assert main(["check", pool.name, "--repair"]) == 0
    capsys.readouterr()
    assert pool.check() == [] and pool.stats()["num_sequences"] == 0


def _closes_leaking(name: str, prompts: dict[str, list[int]]) -> int:
    """A worker process that allocates `prompts` (request -> tokens), publishes their full
    blocks and closes its handle without ending them; its pid, once it has exited."""

    def work() -> int:
        w = KVPool.attach(name)
        for rid, tokens in prompts.items():
            w.mark_computed(w.allocate(rid, tokens), len(tokens))
        w.close()
        return 0

    pid = fork_child(work, alarm_s=60)
    assert _wait(pid) == 0
    return pid


def test_repair_ends_the_sequences_a_closed_handle_left_live(make_pool, capsys):
    # GIVEN a worker that closed its handle with two requests still live, one sharing its
    # prefix with a request this process still serves
    pool = make_pool(32, block_size=4)
    mine = pool.allocate("mine", list(range(8)) + [50])
    pool.mark_computed(mine, 8)
    pid = _closes_leaking(pool.name, {"leaky": list(range(8)) + [60, 61], "other": [70] * 6})
    before = pool.stats()["num_allocated"]
    assert main(["check", pool.name]) == 1
    capsys.readouterr()
    # WHEN `kvscope check --repair` runs
    assert main(["check", pool.name, "--repair"]) == 0
    # THEN it ends both, says so, and the pool is healthy, its close's findings answered
    err = capsys.readouterr().err
    assert (
        f"ended 2 sequences that pid {pid} left live when it closed the pool ('leaky', 'other'),"
        " returning 2 blocks to the free ring" in err
    ), err
    assert "cleared the recorded findings it repaired (2 leak_finished)" in err
    assert (
        pool.check() == []
        and not (pool.view.seqs["owner_pid"][pool.view.seqs["state"] != 0] != os.getpid()).any()
    )
    # AND the shared prefix lost only the worker's references: this process's request keeps it
    st = pool.stats()
    assert st["num_allocated"] == before - 3 == 3  # (their own 3: 2 freed, 1 published, cached)
    assert pool.view.blocks["refcount"][mine.block_table[:2]].tolist() == [1, 1]
    pool.free(mine)
    assert pool.check() == [] and pool.stats()["num_allocated"] == 0


def test_reclaim_orphans_leaves_the_sequences_of_a_process_attached_into_the_record(make_pool):
    # GIVEN a worker that closed with a request live, and then another process attached into
    # its client record (a table of two records) and allocated a request of its own
    pool = make_pool(32, block_size=4, max_clients=2)
    pid = _closes_leaking(pool.name, {"closed-leak": [1, 2, 3, 4, 5]})
    other = KVPool.attach(pool.name)
    held = other.allocate("attached-live", [9, 9, 9, 9, 9])
    # THEN the whole-pool check names the closed process's request, not the attached one's
    assert [(f.kind, f.request, f.owner_pid) for f in pool.check()] == [
        ("leak_finished", "closed-leak", pid)
    ]
    # WHEN the orphans are reclaimed
    ended = pool.reclaim_orphans()
    # THEN only the closed process's request is ended; the attached process's stays its own
    assert [(e["pid"], e["request"], e["blocks"]) for e in ended] == [(pid, "closed-leak", 1)]
    assert other.live() and pool.reclaim_orphans() == []
    other.free(held)
    other.close()
    assert pool.check() == [] and pool.stats()["num_allocated"] == 0
