"""PoolExhausted leaves a trace the capacity answer reads: the C core counts each one
(`num_exhausted`) and records the last one's figures in the segment header, so a pool that
raised one is never "big enough", and free blocks stranded in other processes' local caches are
named as the cause ("memory still free") rather than the pool's size."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvscope.allocator import KVPool, PoolExhausted
from kvscope.allocator.events import EventOp
from kvscope.capacity import capacity_answer, exhaustion_answer
from kvscope.history import History
from tests.forking import fork_child, wait_child


def _other_process_parks_blocks(name: str, ready_w: int, done_r: int) -> int:
    """Attach, allocate and free 8 one-block requests (the freed blocks stay in this handle's
    local cache), say how many it keeps, and hold the handle until told to go."""
    p = KVPool.attach(name)
    for s in [p.allocate(f"side{i}", [i] * 4) for i in range(8)]:
        p.free(s)
    kept = int(p.view.clients["local_count"][p.client])
    os.write(ready_w, bytes([kept]))
    os.read(done_r, 1)
    p.close()
    return 0


def test_the_core_counts_each_exhaustion_and_records_the_last(make_pool):
    # GIVEN a pool of 16 blocks, 10 of them held, and no local cache
    pool = make_pool(16, local_cache_size=0)
    held = pool.allocate("held", list(range(40)))
    assert pool.stats()["num_exhausted"] == 0 and pool.stats()["last_exhausted"] is None
    # WHEN two allocations find too few blocks (10, then 7 needed; 6 free)
    for n in (40, 28):
        with pytest.raises(PoolExhausted) as e:
            pool.allocate("peak", list(range(100, 100 + n)))
    # THEN both are counted, and the header holds the last one's figures, as its exception
    st = pool.stats()
    assert st["num_exhausted"] == 2
    last = st["last_exhausted"]
    assert last is not None and last["time_ns"] > 0
    assert (
        (last["pid"], last["needed"], last["free_list"])
        == (os.getpid(), 7, 6)
        == (
            os.getpid(),
            e.value.needed,
            e.value.free,
        )
    )
    assert (last["own_cache"], last["other_caches"]) == (0, 0)
    # ... and nothing else of the pool changed (the failed operations were undone)
    assert pool.check() == [] and st["num_allocated"] == 10
    # WHEN the pool's only process frees and detaches
    pool.free(held)
    name = pool.name
    pool.close()
    # THEN its count is folded into the header and the record stays: a new reader sees both
    with KVPool.attach(name) as again:
        st = again.stats()
    assert st["num_exhausted"] == 2 and st["last_exhausted"] == last


def test_each_exhaustion_is_an_event_naming_its_request_and_the_blocks_it_needed(
    make_pool, monkeypatch
):
    # GIVEN a pool whose flight recorder is on, 3 of its 4 blocks held
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(4, local_cache_size=0)
    held = pool.allocate("held", list(range(12)))
    # WHEN an allocation needing 3 and an append needing 1 find too few
    with pytest.raises(PoolExhausted):
        pool.allocate("big", list(range(12)))
    pool.allocate("small", [1])
    with pytest.raises(PoolExhausted):
        pool.append(held, [1, 2])
    # THEN the recorder holds an `exhausted` event for each, the request and the need in it
    # (a wedged pool's failing operations leave events, not silence)
    ev = pool.view.events.reshape(-1)
    ev = ev[ev["op"] == EventOp.EXHAUSTED]
    assert [(bytes(e["request"]), int(e["arg"]), int(e["block"])) for e in ev] == [
        (b"big", 3, -1),
        (b"held", 1, -1),
    ]


def test_a_requests_forks_count_its_blocks_once_and_a_preempted_one_is_not_a_holder(make_pool):
    # GIVEN a request sampled four ways (forks sharing its id and its 2 blocks), a request
    # waiting with a block and then preempted, and the pool's last blocks held by a third
    pool = make_pool(8, local_cache_size=0)
    r = pool.allocate("r", list(range(8)))
    forks = [pool.fork(r, "r") for _ in range(3)]
    w = pool.allocate("w", [1, 2])
    pool.set_state(w, "waiting")
    filler = pool.allocate("filler", list(range(100, 124)))  # (preempts w for its last block)
    assert w.state == "preempted"
    # WHEN a take finds too few
    with pytest.raises(PoolExhausted) as e:
        pool.allocate("big", list(range(200, 212)))
    # THEN the holders name r's two blocks once, and no preempted request
    assert e.value.holders == {"r": 2, "filler": 6}, e.value.holders
    assert "(by filler=6, r=2)" in str(e.value)
    for s in (*forks, r, filler, w):
        pool.free(s)


def test_a_retry_storm_is_one_exhausted_event_and_keeps_the_history(make_pool, monkeypatch):
    # GIVEN a pool whose flight recorder holds 16 events per process, its blocks all held
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(4, local_cache_size=0, event_capacity=16)
    held = pool.allocate("held", list(range(16)))
    # WHEN an engine retries one request a thousand times on the full pool, then another
    for _ in range(1000):
        with pytest.raises(PoolExhausted):
            pool.allocate("big", list(range(8)))
    with pytest.raises(PoolExhausted):
        pool.allocate("other", [1])
    # THEN the retries are one event (its time the last's), the other request's its own, and
    # the held request's allocation is still in the ring; the count has every one
    ev = pool.view.events.reshape(-1)
    ev = ev[ev["time_ns"] != 0]
    ops = [(EventOp(int(e["op"])).name.lower(), bytes(e["request"])) for e in ev]
    assert ops.count(("exhausted", b"big")) == 1 and ops.count(("exhausted", b"other")) == 1
    assert ("allocate", b"held") in ops
    assert pool.stats()["num_exhausted"] == 1001
    pool.free(held)


def test_blocks_in_another_process_local_cache_are_named_as_memory_still_free(make_pool):
    # GIVEN a pool of 16 blocks and another process that allocated and freed 8 of them and
    # keeps its handle open, its freed blocks parked in its local cache (ordered by pipes)
    pool = make_pool(16, local_cache_size=4)
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = fork_child(lambda: _other_process_parks_blocks(pool.name, ready_w, done_r), 60)
    kept = os.read(ready_r, 1)[0]
    try:
        # WHEN this process asks for all 16 blocks
        with pytest.raises(PoolExhausted) as e:
            pool.allocate("big", list(range(64)))
    finally:
        os.write(done_w, b"x")
        assert wait_child(pid) == 0
    # THEN the header recorded the blocks the other process kept, as the exception saw them
    assert kept > 0 and e.value.elsewhere == {pid: kept}
    st = pool.stats()
    last = st["last_exhausted"]
    assert (st["num_exhausted"], last["needed"], last["other_caches"]) == (1, 16, kept)
    assert last["free_list"] + last["own_cache"] + kept == 16
    # ... and the capacity answer names them as the cause, not the pool's size
    cap = capacity_answer(pool.view, None)
    assert cap["exhaustion_cause"] == "memory_still_free" and cap["num_exhausted"] == 1
    assert cap["answer"].startswith(
        f"memory still free: {kept} blocks in other processes' local caches at the last"
        f" PoolExhausted (raised 1 time): pid {os.getpid()} needed 16 blocks with"
    ), cap["answer"]
    assert "pool too small" not in cap["answer"] and "big enough" not in cap["answer"]


def test_an_exhaustion_between_two_samples_is_never_big_enough(make_pool):
    # GIVEN a history whose samples saw the pool empty before and after a brief peak
    pool = make_pool(16, local_cache_size=0)
    history = History.for_view(pool.view)
    history.add(pool.view)
    a = pool.allocate("a", list(range(40)))
    with pytest.raises(PoolExhausted):
        pool.allocate("b", list(range(100, 140)))
    pool.free(a)
    history.add(pool.view)
    # WHEN the capacity answer reads them with the pool
    cap = capacity_answer(pool.view, history)
    # THEN the samples' peak is 0, but the answer names the exhaustion and the pool's size
    assert cap["peak_demand"] == 0 and cap["num_exhausted"] == 1
    assert cap["exhaustion_cause"] == "pool_too_small"
    assert cap["pool_size_without_preemption"] is None
    assert cap["answer"].startswith("pool too small: PoolExhausted raised 1 time; the last (pid"), (
        cap["answer"]
    )
    assert (
        "needed 10 blocks with 6 free in the shared free list, 0 in its own local cache and none"
        " in other processes' local caches: a pool of at least 20 blocks (+4) would have served it"
    ) in cap["answer"]
    assert "big enough" not in cap["answer"]


# argv: pool name, what the script does with the PoolExhausted (catch, raise). A brief peak:
# 10 of 16 blocks held, an allocation of 10 more fails and is caught, then everything is freed
# and the script ends cleanly; or it is raised from the script after the free.
BRIEF_PEAK = """
import sys
from kvscope.allocator import KVPool, PoolConfig, PoolExhausted
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=16, block_size=4, head_dim=8,
                     num_layers=1, dtype="float32", local_cache_size=0))
a = pool.allocate("a", list(range(40)))
try:
    pool.allocate("peak", list(range(100, 140)))
except PoolExhausted as e:
    print(f"caught: {e.needed} needed, {e.free} free", flush=True)
    caught = e
pool.free(a)
pool.close()
if sys.argv[2] == "raise":
    raise caught
"""

# argv: pool name. A worker process parks 8 freed blocks in its local cache and holds its
# handle; the main process's allocation of all 16 fails (caught), then the worker goes. Ordered
# by events: no timing.
TWO_PROCESSES = """
import multiprocessing as mp
import sys
from kvscope.allocator import KVPool, PoolConfig, PoolExhausted


def worker(name, ready, done):
    pool = KVPool.attach(name)
    for s in [pool.allocate(f"side{i}", [i] * 4) for i in range(8)]:
        pool.free(s)
    ready.set()
    done.wait()
    pool.close()


if __name__ == "__main__":
    name = sys.argv[1]
    pool = KVPool.create(name, PoolConfig(num_blocks=16, block_size=4, head_dim=8,
                         num_layers=1, dtype="float32", local_cache_size=4))
    ctx = mp.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=worker, args=(name, ready, done))
    proc.start()
    ready.wait()
    try:
        pool.allocate("big", list(range(64)))
    except PoolExhausted as e:
        print(f"elsewhere {sum(e.elsewhere.values())}", flush=True)
    done.set()
    proc.join()
    pool.close()
"""


def _run(tmp_path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "script.py"
    path.write_text(script)
    return subprocess.run(
        [sys.executable, "-m", "kvscope", "run", "--no-guard", "--dump-dir", str(tmp_path),
         str(path), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_a_run_whose_script_caught_an_exhaustion_says_so(tmp_path, pool_name):
    # GIVEN a script that exhausts its pool once in a brief peak, catches it and ends cleanly
    # WHEN it runs under `kvscope run --no-guard`
    out = _run(tmp_path, BRIEF_PEAK, pool_name, "catch")
    # THEN the run passes with nothing to dump, and its diagnosis names the exhaustion
    assert out.returncode == 0 and "caught: 10 needed, 6 free" in out.stdout, out.stderr
    lines = out.stderr.splitlines()
    assert lines[-1].endswith("no finding, no leak; nothing to dump"), out.stderr
    assert (
        f"kvscope run: pool {pool_name!r}: pool too small: PoolExhausted raised 1 time; the last"
        in out.stderr
    ), out.stderr
    assert "needed 10 blocks with 6 free in the shared free list" in out.stderr
    assert "a pool of at least 20 blocks (+4) would have served it" in out.stderr
    assert "big enough" not in out.stderr


@pytest.mark.slow
def test_a_run_that_dies_of_an_exhaustion_gets_a_capacity_answer_that_names_it(tmp_path, pool_name):
    # GIVEN the same script, raising the PoolExhausted once the peak is over (its pool empty)
    # WHEN it runs under `kvscope run --no-guard`
    out = _run(tmp_path, BRIEF_PEAK, pool_name, "raise")
    # THEN the run fails as the script did, and the dump's capacity answer names the exhaustion
    # (its samples saw no demand: it was "big enough: no preemption; peak demand 0 of 16")
    assert out.returncode == 1 and "PoolExhausted" in out.stderr, out.stderr
    capacity = out.stderr.split("\ncapacity\n")[1]
    assert capacity.lstrip().startswith("pool too small: PoolExhausted raised 1 time"), capacity
    assert "a pool of at least 20 blocks (+4) would have served it" in capacity
    assert "PoolExhausted 1" in capacity and "big enough" not in out.stderr


@pytest.mark.slow
def test_a_run_names_blocks_another_process_kept_as_memory_still_free(tmp_path, pool_name):
    # GIVEN a script whose worker keeps freed blocks in its local cache while the main process
    # asks for the whole pool (and catches PoolExhausted)
    # WHEN it runs under `kvscope run --no-guard` (guard mode's quarantine keeps freed blocks
    # out of local caches)
    out = _run(tmp_path, TWO_PROCESSES, pool_name)
    assert out.returncode == 0, out.stderr
    kept = int(out.stdout.split("elsewhere ")[1].split()[0])
    # THEN the diagnosis names the worker's cached blocks as the cause, not the pool's size
    assert kept > 0, out.stdout
    assert (
        f"kvscope run: pool {pool_name!r}: memory still free: {kept} blocks in other processes'"
        " local caches at the last PoolExhausted (raised 1 time): pid"
    ) in out.stderr, out.stderr
    assert "pool too small" not in out.stderr and "big enough" not in out.stderr


def test_the_html_report_s_capacity_table_gives_the_exhaustion(make_pool):
    # GIVEN a pool whose process caught a PoolExhausted
    from kvscope.analysis import analyze_view
    from kvscope.htmlreport import build_report

    pool = make_pool(16, local_cache_size=0)
    held = pool.allocate("held", list(range(40)))
    with pytest.raises(PoolExhausted):
        pool.allocate("peak", list(range(100, 140)))
    pool.free(held)
    # WHEN its HTML report is built
    page = build_report(
        pool.view,
        analysis=analyze_view(pool.view),
        history=None,
        capacity=capacity_answer(pool.view, None),
        source=pool.name,
    )
    # THEN the capacity table has the count and the last one's figures
    assert "<th>PoolExhausted raised</th><td>1</td>" in page
    assert (
        f"<th>last PoolExhausted</th><td>pid {os.getpid()} needed 10 blocks: 6 free in the shared"
        " free list, 0 in its own local cache, 0 in other processes&#x27; local caches</td>"
    ) in page


@pytest.mark.parametrize("other", [0, 1, 4])
def test_blocks_parked_in_other_caches_too_few_to_serve_the_take_leave_the_pool_too_small(other):
    # GIVEN a last PoolExhausted that needed 4 blocks and found none it could take, and
    # `other` in other processes' local caches
    last = {"pid": 7, "needed": 4, "free_list": 0, "own_cache": 0, "other_caches": other}
    # WHEN the capacity answer reads it
    cause, said = exhaustion_answer(3, last, 32)
    # THEN only blocks enough to serve it are memory still free; fewer leave the pool too
    # small, by what was short even with them, and the parked ones are named beside it
    if other == 4:
        assert cause == "memory_still_free" and said.startswith("memory still free: 4 blocks")
        return
    assert cause == "pool_too_small" and said.startswith("pool too small:")
    assert f"a pool of at least {32 + 4 - other} blocks (+{4 - other})" in said
    assert ("1 in other processes' local caches, which it cannot take" in said) is (other == 1)
    assert ("none in other processes' local caches" in said) is (other == 0)


@pytest.mark.parametrize("idle_s, quarantine", [(9.0, True), (9.0, False), (3.0, True)])
def test_a_run_that_ends_idle_with_room_num_free_leaves_out_says_so(make_pool, idle_s, quarantine):
    # GIVEN a history whose first sample saw a request hold blocks, and whose later ones saw
    # none held and none allocated, the pool's blocks cached (its published prompts) and, in
    # guard mode, quarantined, `idle_s` seconds up to the last sample of a 10 s run
    pool = make_pool(12, local_cache_size=0, guard=quarantine)
    history = History.for_view(pool.view)
    seqs = [pool.allocate(f"r{i}", list(range(100 * i, 100 * i + 12))) for i in range(4)]
    history.add(pool.view)
    history.add(pool.view)
    for s in seqs[:3]:
        pool.mark_computed(s, 12)
    for s in seqs:
        pool.free(s)
    history.add(pool.view)
    history.rows["time_ns"][:3] = np.array([0.0, 10.0 - idle_s, 10.0]) * 1e9 + 1
    # WHEN the capacity answer reads them
    cap = capacity_answer(pool.view, history)
    # THEN where the pool stood idle long enough with more cached and quarantined blocks than
    # free ones, the answer says an engine may have stopped admitting and what to count
    idle = cap.get("idle_with_room")
    if idle_s < 5 or not quarantine:
        # (without guard mode, the freed request's blocks are free: a quarter of the pool)
        assert idle is None and "num_available" not in cap["answer"], cap
        return
    assert idle == {"idle_s": 9.0, "span_s": 10.0, "free": 0, "cached": 9, "quarantined": 3}
    assert (
        "for the last 9 s of the run (of 10 s) no request held a block and none was allocated,"
        " with 0 of the pool's 12 blocks free but 9 cached and 3 quarantined"
    ) in cap["answer"], cap["answer"]
    assert "count stats()['num_available']" in cap["answer"]


# argv: pool name. Four requests held for 2 s (the sampler sees them), three of them published,
# all freed, then 6 s with no request: under guard mode the freed blocks wait in quarantine,
# the published ones cached, none free: what an engine whose admission counts num_free sees.
IDLE_WITH_ROOM = """
import sys, time
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=12, block_size=4, head_dim=8,
                     num_layers=1, dtype="float32", local_cache_size=0))
seqs = [pool.allocate(f"r{i}", list(range(100 * i, 100 * i + 12))) for i in range(4)]
time.sleep(2)
for s in seqs[:3]:
    pool.mark_computed(s, 12)
for s in seqs:
    pool.free(s)
print("free", pool.stats()["num_free"], flush=True)
time.sleep(6)
pool.close()
"""


@pytest.mark.slow
def test_a_run_that_ends_idle_with_its_memory_cached_and_quarantined_says_so(tmp_path, pool_name):
    # GIVEN a script whose pool stands idle for its last 6 s with every block cached or
    # quarantined (num_free 0)
    path = tmp_path / "script.py"
    path.write_text(IDLE_WITH_ROOM)
    # WHEN it runs under `kvscope run` as it comes (guard mode)
    out = subprocess.run(
        [sys.executable, "-m", "kvscope", "run", "--dump-dir", str(tmp_path), str(path),
         pool_name],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # THEN the run passes, and its capacity line says the engine may have stopped admitting
    # with the memory there, and what to count
    assert out.returncode == 0 and "free 0" in out.stdout, out.stderr
    assert out.stderr.splitlines()[-1].endswith("no finding, no leak; nothing to dump")
    line = next(
        s for s in out.stderr.splitlines() if s.startswith(f"kvscope run: pool {pool_name!r}")
    )
    assert "no request held a block and none was allocated, with 0 of the pool's 12" in line, line
    assert "9 cached and 3 quarantined" in line and "stats()['num_available']" in line


def test_check_of_a_live_pool_prints_the_capacity_answer_as_analyze_does(make_pool, capsys):
    import json

    from kvscope.cli import main

    # GIVEN a live pool that raised PoolExhausted
    pool = make_pool(16, local_cache_size=0)
    held = pool.allocate("held", list(range(40)))
    with pytest.raises(PoolExhausted):
        pool.allocate("peak", list(range(100, 140)))
    # WHEN check and analyze read it
    answers = {}
    for verb in ("check", "analyze"):
        main([verb, pool.name, "--json"])
        answers[verb] = json.loads(capsys.readouterr().out)["capacity"]
    main(["check", pool.name])
    text = capsys.readouterr().out
    # THEN check says what analyze says: the exhaustion, in its capacity section
    assert answers["check"]["num_exhausted"] == 1
    assert answers["check"]["answer"] == answers["analyze"]["answer"]
    assert "capacity" in text and "PoolExhausted raised 1 time" in text
    pool.free(held)
