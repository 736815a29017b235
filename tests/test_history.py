"""The pool's history (a bounded time series of its counters) and the capacity answer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvscope.allocator import PoolError, PoolExhausted
from kvscope.allocator.snapshot import snapshot
from kvscope.capacity import capacity_answer
from kvscope.cli import main
from kvscope.history import History, history_path, read_history


def preempting_run(pool, history: History):
    """req-a (6 blocks) waits; req-b (10) and req-c (4) then need 20 of 16: req-a is preempted."""
    history.add(pool.view)
    a = pool.allocate("req-a", list(range(24)))
    pool.set_state(a, "waiting")
    history.add(pool.view)
    b = pool.allocate("req-b", list(range(100, 140)))
    history.add(pool.view)
    c = pool.allocate("req-c", list(range(200, 216)))
    history.add(pool.view)
    assert a.state == "preempted"
    return a, b, c


def test_a_full_history_halves_and_keeps_the_span_and_the_peak(make_pool):
    # GIVEN a history of at most 8 samples and a pool whose demand spikes once
    pool = make_pool(32)
    h = History.for_view(pool.view, capacity=8, interval_s=0.1)
    for _ in range(5):
        h.add(pool.view)
    spike = pool.allocate("spike", list(range(80)))  # 20 blocks
    h.add(pool.view)
    pool.free(spike)
    first = int(h.samples["time_ns"][0])
    for _ in range(14):
        h.add(pool.view)
    # THEN it never holds more than 8 samples, still spans the whole run, kept the spike's peak
    # and samples half as often for each halving
    assert h.count <= 8
    assert int(h.samples["time_ns"][0]) <= first + 10**9
    assert int(h.samples["demand_max"].max()) == 20
    assert int(h.samples["demand"][-1]) == 0
    assert h.interval_s >= 0.2


def test_sampling_stretches_its_interval_to_its_cost(make_pool):
    pool = make_pool(32)
    h = History.for_view(pool.view, interval_s=0.001)
    # WHEN a sample is due at t=0, THEN the next one is not due before interval and 50x its cost
    assert h.sample(pool.view, now_s=0.0)
    assert not h.sample(pool.view, now_s=0.0005)
    assert h.next_s >= max(0.001, 50 * h.cost_s)


def test_a_history_file_round_trips(make_pool, tmp_path):
    pool = make_pool(16)
    h = History.for_view(pool.view)
    preempting_run(pool, h)
    path = tmp_path / "x.history.json"
    h.write(str(path))
    back = read_history(str(path))
    assert back.count == h.count and back.locks == h.locks
    assert np.array_equal(back.samples, h.samples)
    assert json.loads(path.read_text())["schema"] == 1


def test_capacity_names_the_pool_size_that_avoids_the_preemption(make_pool):
    # GIVEN a run that needed 20 blocks of a 16-block pool and preempted once
    pool = make_pool(16)
    h = History.for_view(pool.view)
    preempting_run(pool, h)
    cap = capacity_answer(snapshot(pool.view), h)
    # THEN the answer is the peak demand: 20 blocks, 4 more than the pool
    assert cap["source"] == "history"
    assert cap["num_preemptions"] == 1
    assert cap["peak_demand"] == 20
    assert cap["pool_size_without_preemption"] == 20
    assert "a pool of 20 blocks (+4)" in cap["answer"]
    assert 0 < cap["mean_demand"] < cap["peak_demand"]


def test_capacity_without_preemption_and_without_history(make_pool):
    pool = make_pool(16)
    h = History.for_view(pool.view)
    h.add(pool.view)
    pool.allocate("r", list(range(12)))
    h.add(pool.view)
    cap = capacity_answer(snapshot(pool.view), h)
    assert cap["num_preemptions"] == 0 and cap["pool_size_without_preemption"] == 3
    assert cap["answer"].startswith("big enough")
    none = capacity_answer(snapshot(pool.view), None)
    assert none["source"] == "snapshot" and none["demand_now"] == 3
    assert "no recorded history" in none["answer"]


def test_capacity_of_requests_that_came_and_went_between_samples_names_no_size(make_pool):
    # GIVEN a run whose requests were all served and freed between two samples
    pool = make_pool(16)
    h = History.for_view(pool.view)
    h.add(pool.view)
    for i in range(3):
        pool.free(pool.allocate(f"r{i}", list(range(12))))
    h.add(pool.view)
    cap = capacity_answer(snapshot(pool.view), h)
    # THEN it is not "big enough" on a peak of 0: the samples missed the serving
    assert cap["peak_demand"] == 0 and cap["pool_size_without_preemption"] is None
    assert "no sample (every" in cap["answer"] and "9 block(s) were allocated" in cap["answer"]
    assert "big enough" not in cap["answer"]


def test_analyze_reads_the_history_beside_a_dump(make_pool, tmp_path, capsys):
    # GIVEN a dump of a preempting run with its history beside it
    pool = make_pool(16)
    h = History.for_view(pool.view)
    preempting_run(pool, h)
    dump = tmp_path / "run.kvd"
    assert main(["dump", pool.name, "-o", str(dump)]) == 0
    h.write(history_path(str(dump)))
    capsys.readouterr()
    # WHEN it is analyzed THEN the capacity answer is in the text and in the JSON
    main(["analyze", str(dump)])
    out = capsys.readouterr().out
    assert "capacity" in out and "a pool of 20 blocks" in out
    main(["analyze", str(dump), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["capacity"]["pool_size_without_preemption"] == 20
    # AND a history that cannot be read is a warning, not a failure
    (tmp_path / "run.history.json").write_text("{not json")
    main(["analyze", str(dump), "--json"])
    got = capsys.readouterr()
    assert json.loads(got.out)["capacity"]["source"] == "snapshot"
    assert "warning" in got.err and "not a kvscope history file" in got.err


def test_capacity_sizes_the_pool_for_both_the_preemption_and_the_exhaustion(make_pool):
    # GIVEN the preempting run (peak demand 20 of 16), then a prompt of 10 blocks with 2 free
    pool = make_pool(16, local_cache_size=0)
    h = History.for_view(pool.view)
    preempting_run(pool, h)
    with pytest.raises(PoolExhausted):
        pool.allocate("req-d", list(range(300, 340)))
    h.add(pool.view)
    cap = capacity_answer(snapshot(pool.view), h)
    # THEN the size named covers the exhausted take too: 16 + (10 - 2) = 24 blocks, not the
    # samples' peak of 20
    assert (cap["peak_demand"], cap["num_preemptions"], cap["num_exhausted"]) == (20, 1, 1)
    assert cap["exhaustion_cause"] == "pool_too_small"
    assert cap["pool_size_without_preemption"] == 24
    assert cap["answer"].startswith("pool too small: PoolExhausted raised 1 time;"), cap["answer"]
    assert cap["answer"].endswith(
        "a pool of 24 blocks (+8) would have served this run without preemption or PoolExhausted"
    ), cap["answer"]


def test_a_history_without_a_counter_column_is_one_line_naming_it(make_pool, tmp_path):
    # GIVEN a history file written before the pool counted PoolExhausted (no such column)
    pool = make_pool(16)
    h = History.for_view(pool.view)
    h.add(pool.view)
    d = h.to_json()
    del d["columns"]["num_exhausted"]
    path = tmp_path / "old.history.json"
    path.write_text(json.dumps(d))
    # WHEN it is read THEN the error says which column it lacks
    with pytest.raises(PoolError, match="no column num_exhausted: written by another kvscope"):
        read_history(str(path))
