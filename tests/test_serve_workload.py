"""serve.py's workload generator and JSONL reader, static baseline and summary arithmetic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from server.errors import ServeError  # noqa: E402
from server.report import (  # noqa: E402
    RequestResult,
    StepSample,
    peak_running,
    percentile,
    render_table,
    summarize,
)
from server.static import StaticCache, StaticGeometry  # noqa: E402
from server.workload import WorkloadSpec, generate_workload, read_jsonl, write_jsonl  # noqa: E402

from kvscope.allocator import PoolExhausted  # noqa: E402


def test_the_generator_is_seeded_and_sorted_by_arrival() -> None:
    spec = WorkloadSpec(num_requests=50, rate=10.0, seed=5)
    a, b = generate_workload(spec, 256), generate_workload(spec, 256)
    assert a == b
    arrivals = [r.arrival_s for r in a]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert generate_workload(WorkloadSpec(num_requests=50, rate=10.0, seed=6), 256) != a


def test_arrivals_are_poisson_at_the_given_rate() -> None:
    requests = generate_workload(WorkloadSpec(num_requests=2000, rate=50.0), 256)
    mean_gap = requests[-1].arrival_s / (len(requests) - 1)
    assert mean_gap == pytest.approx(1 / 50.0, rel=0.1)
    assert all(r.arrival_s == 0 for r in generate_workload(WorkloadSpec(rate=0), 256))


def test_the_shared_prefix_mix() -> None:
    # GIVEN 10 system prompts covering about 70% of requests
    spec = WorkloadSpec(num_requests=1000, num_prefixes=10, prefix_share=0.7, prompt_len=(4, 8))
    requests = generate_workload(spec, 256)
    shared = [r for r in requests if r.prefix_id >= 0]
    # THEN about 70% start with one of them, and requests of one prefix share its tokens
    assert len(shared) / len(requests) == pytest.approx(0.7, abs=0.05)
    assert {r.prefix_id for r in shared} == set(range(10))
    by_prefix = [r for r in shared if r.prefix_id == shared[0].prefix_id]
    head = len(by_prefix[0].prompt) - 8
    assert all(r.prompt[:head] == by_prefix[0].prompt[:head] for r in by_prefix)


def test_cancellations_are_drawn_only_when_asked_for() -> None:
    plain = generate_workload(WorkloadSpec(num_requests=100), 256)
    cancelling = generate_workload(WorkloadSpec(num_requests=100, cancel_share=0.5), 256)
    assert all(r.cancel_after == 0 for r in plain)
    cancelled = [r for r in cancelling if r.cancel_after]
    assert 30 <= len(cancelled) <= 70
    assert all(1 <= r.cancel_after < r.max_tokens for r in cancelled)


def test_lengths_stay_in_their_ranges() -> None:
    spec = WorkloadSpec(num_requests=200, prompt_len=(3, 5), output_len=(2, 4), prefix_share=0)
    for r in generate_workload(spec, 100):
        assert 3 <= len(r.prompt) <= 5 and 2 <= r.max_tokens <= 4
        assert all(0 <= t < 100 for t in r.prompt)


def test_jsonl_round_trip_and_text_prompts(tmp_path: Path) -> None:
    requests = generate_workload(WorkloadSpec(num_requests=5, n=2, temperature=0.5), 256)
    for r in requests:
        r.prefix_id = -1
    write_jsonl(requests, tmp_path / "w.jsonl")
    assert read_jsonl(tmp_path / "w.jsonl", 256) == requests
    (tmp_path / "t.jsonl").write_text('{"prompt": "hi!", "max_tokens": 3}\n\n{"prompt": "a"}\n')
    text = read_jsonl(tmp_path / "t.jsonl", 256)
    assert [r.prompt for r in text] == [[104, 105, 33], [97]]
    assert [r.request_id for r in text] == ["r0", "r1"] and text[1].max_tokens == 16


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "a JSON object"),
        ('{"max_tokens": 3}', "needs 'prompt'"),
        ('{"prompt_tokens": [1, 999]}', "prompt_tokens must be"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens must be an integer >= 1"),
        ('{"prompt": "x", "n": "2"}', "n must be an integer >= 1"),
        ('{"prompt": "x", "cancel_after": -1}', "cancel_after must be an integer >= 0"),
        ('{"prompt": "x", "arrival_s": -1}', "arrival_s must be"),
        ('{"prompt": ""}', "empty prompt"),
    ],
)
def test_a_bad_jsonl_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ServeError, match=f"bad.jsonl:2: .*{message}"):
        read_jsonl(path, 256)


def test_duplicate_ids_and_missing_files_are_user_errors(tmp_path: Path) -> None:
    (tmp_path / "dup.jsonl").write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(ServeError, match="duplicate id"):
        read_jsonl(tmp_path / "dup.jsonl", 256)
    with pytest.raises(ServeError, match="cannot read"):
        read_jsonl(tmp_path / "missing.jsonl", 256)


def make_static(num_blocks: int = 10, max_len: int = 24) -> StaticCache:
    return StaticCache(StaticGeometry(num_blocks, 8, 1, 1, 4), max_len)


def test_static_reservations_are_contiguous_and_first_fit() -> None:
    # GIVEN a static cache of 10 blocks with reservations of 3 blocks (max_len 24, block 8)
    cache = make_static()
    a, b, c = (cache.allocate(name, [1, 2]) for name in "abc")
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4, 5], [6, 7, 8])
    # WHEN the middle one is freed
    cache.free(b)
    # THEN a new request reuses its hole, and the one left after that is too small
    assert cache.allocate("d", [1]).block_table == [3, 4, 5]
    with pytest.raises(PoolExhausted):
        cache.allocate("e", [1])
    assert cache.check() == []


def test_static_external_fragmentation_is_counted() -> None:
    # GIVEN two 1-block holes that are not adjacent, 2 blocks free in all
    cache = StaticCache(StaticGeometry(5, 8, 1, 1, 4), max_len=8)
    seqs = [cache.allocate(str(i), [1]) for i in range(5)]
    cache.free(seqs[1])
    cache.free(seqs[3])
    # WHEN a reservation of 2 blocks is asked for (max_len 16 on a fresh geometry view)
    cache.blocks_per_seq = 2
    with pytest.raises(PoolExhausted):
        cache.allocate("big", [1])
    # THEN it failed although enough blocks were free: external fragmentation
    assert cache.stats()["num_external_failures"] == 1
    # AND freeing the block between the holes merges all three
    cache.free(seqs[2])
    assert cache.allocate("big", [1]).block_table == [1, 2]


def test_static_fork_copies_and_appends_stay_inside() -> None:
    cache = make_static()
    seq = cache.allocate("a", list(range(10)))
    cache.kv[:, :, seq.block_table[:2]] = 7.0
    child = cache.fork(seq, "a#1")
    assert (cache.kv[:, :, child.block_table[:2]] == 7.0).all()
    assert cache.append(child, [1] * 14) == []
    with pytest.raises(AssertionError):
        cache.append(child, [1])


def test_percentiles_and_peaks() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 95) == 95
    # worker 0 runs 3 requests until t=2 while worker 1 runs 2 from t=1.5: 5 at once
    samples = [
        StepSample(1.0, 1.0, 0, 0, 0, 3, worker=0),
        StepSample(1.5, 0.5, 0, 0, 0, 2, worker=1),
        StepSample(2.0, 1.0, 0, 0, 0, 1, worker=0),
        StepSample(2.5, 1.0, 0, 0, 0, 2, worker=1),
    ]
    assert peak_running(samples) == 5


def test_summary_arithmetic() -> None:
    # GIVEN two finished requests and one failed, over two samples of the cache
    results = [
        RequestResult("a", 0.0, 10, [[1, 2, 3]], 8, 0.0, 0.1, 1.0, 16, 13),
        RequestResult("b", 0.5, 10, [[1], [2]], 0, 0.5, 0.8, 2.0, 32, 22),
        RequestResult("c", 0.5, 10, error="too large"),
        RequestResult("d", 0.5, 10, [[4]], 0, 0.5, 0.6, 0.7, cancelled=True),
    ]
    samples = [StepSample(1.0, 1.0, 10, 16, 5, 2), StepSample(2.0, 3.0, 30, 32, 5, 1)]
    s = summarize(results, samples, duration_s=2.0, num_preemptions=3)
    # THEN each number follows its definition
    assert (s.requests, s.cancelled, s.failed, s.output_tokens) == (2, 1, 1, 6)
    assert s.output_tokens_per_s == 3.0
    assert s.ttft_p50_ms == pytest.approx(100.0)
    assert s.kv_utilization == round((10 * 1 + 30 * 3) / (16 * 1 + 32 * 3), 3)
    assert s.internal_fragmentation == round((3 + 10) / 48, 3)
    assert (
        s.prefix_hit_rate == round(8 / 30, 3)
        and s.peak_concurrent_requests == 2
        and s.preemptions == 3
    )
    assert "prompt tokens cached" in str(render_table(s).columns[0]._cells)


def test_kv_slots_per_request_weighs_steps_by_time() -> None:
    from server.report import StepSample, slots_per_request

    # GIVEN a 3 s step with 2 requests in 64 slots and a 1 s step with 1 request in 16
    samples = [
        StepSample(
            t_s=3, dt_s=3, stored_tokens=60, reserved_slots=64, num_tokens=2, num_running_requests=2
        ),
        StepSample(
            t_s=4, dt_s=1, stored_tokens=10, reserved_slots=16, num_tokens=1, num_running_requests=1
        ),
        StepSample(
            t_s=5, dt_s=1, stored_tokens=0, reserved_slots=0, num_tokens=0, num_running_requests=0
        ),
    ]
    # THEN memory per running request is the time-weighted mean, idle steps left out
    assert slots_per_request(samples) == (32 * 3 + 16 * 1) / 4
