"""A span per request with its block events; findings as events on the request's span."""

from __future__ import annotations

from kvscope.allocator import Finding
from tests.test_otel_metrics import BS, known_sequence, otel  # noqa: F401 - the fixture


def spans_by_request(otel) -> dict[str, object]:  # noqa: F811
    return {s.attributes["kvscope.request.id"]: s for s in otel.spans.get_finished_spans()}


def events(span) -> list[tuple[str, dict]]:
    return [(e.name, dict(e.attributes)) for e in span.events]


def test_one_span_per_request_with_its_block_events(otel, make_pool):  # noqa: F811
    # GIVEN an instrumented pool WHEN the known sequence runs and every request ends
    otel.instrument()
    pool = make_pool(16, block_size=BS, local_cache_size=0)
    seqs = known_sequence(pool)
    pool.free(seqs["b"])
    pool.abort(seqs["c"])
    spans = spans_by_request(otel)
    # THEN each request is one `kvscope.request` span with what happened to its blocks
    assert set(spans) == {"a", "b", "c"}
    a, b, c = spans["a"], spans["b"], spans["c"]
    assert {s.name for s in spans.values()} == {"kvscope.request"}
    assert a.attributes["kvscope.pool.name"] == pool.name
    assert a.attributes["kvscope.request.prompt_tokens"] == 10
    assert events(a) == [
        ("allocate", {"kvscope.blocks": 3, "kvscope.prefix_hit_blocks": 0}),
        ("publish", {"kvscope.blocks": 2}),
        ("free", {}),
    ]
    assert b.attributes["kvscope.request.cached_tokens"] == 8
    assert events(b)[0] == ("allocate", {"kvscope.blocks": 3, "kvscope.prefix_hit_blocks": 2})
    assert ("fork", {"kvscope.child.request.id": "c"}) in events(b)
    assert b.attributes["kvscope.request.outcome"] == "finished"
    # AND the fork links the child to its parent; its copy-on-write is an append event
    assert [lk.context.span_id for lk in c.links] == [b.context.span_id]
    assert ("append", {"kvscope.blocks": 3, "kvscope.cow_copies": 1}) in events(c)
    assert c.attributes["kvscope.request.outcome"] == "aborted"
    assert events(c)[-1] == ("abort", {})
    assert all(s.end_time >= s.start_time for s in spans.values())


def test_a_batch_of_publications_is_an_event_on_each_requests_span(otel, make_pool):  # noqa: F811
    # GIVEN an instrumented pool and two requests of 10 and 6 tokens
    otel.instrument()
    pool = make_pool(16, block_size=BS, local_cache_size=0)
    a = pool.allocate("a", list(range(10)))
    b = pool.allocate("b", list(range(100, 106)))
    # WHEN a step publishes both in one call THEN each request's span says what it published,
    # as its own mark_computed would (b's 6 tokens fill one block of 4)
    assert pool.mark_computed_many([a, b], [8, 6]) == [2, 1]
    pool.free(a)
    pool.free(b)
    spans = spans_by_request(otel)
    assert ("publish", {"kvscope.blocks": 2}) in events(spans["a"])
    assert ("publish", {"kvscope.blocks": 1}) in events(spans["b"])


def test_appends_within_a_block_add_no_event(otel, make_pool):  # noqa: F811
    otel.instrument()
    pool = make_pool(16, block_size=BS)
    s = pool.allocate("r", [1, 2, 3, 4, 5])
    for t in range(3):
        pool.append(s, [t])
    pool.append(s, [9])
    pool.free(s)
    names = [n for n, _ in events(spans_by_request(otel)["r"])]
    # THEN only the append that took a new block shows (tokens 5..8 fit block 2; 9 opens block 3)
    assert names == ["allocate", "append", "free"]


def test_preemption_and_resume_are_events(otel, make_pool):  # noqa: F811
    # GIVEN a waiting request holding 2 of 4 blocks
    otel.instrument()
    pool = make_pool(4, block_size=BS, local_cache_size=0)
    w = pool.allocate("waiting", list(range(8)))
    pool.set_state(w, "waiting")
    # WHEN another request needs 3 blocks, and later the first one resumes
    r = pool.allocate("running", list(range(100, 112)))
    pool.free(r)
    pool.resume(w)
    pool.free(w)
    spans = spans_by_request(otel)
    # THEN the waiting request's span shows it was preempted, then resumed
    names = [n for n, _ in events(spans["waiting"])]
    assert names == ["allocate", "preempt", "resume", "free"]
    assert set(spans) == {"waiting", "running"}


def test_a_request_preempted_again_after_its_resume_has_a_second_event(otel, make_pool):  # noqa: F811
    # GIVEN a waiting request preempted, resumed and set waiting again, nothing preempted
    # between (its resume took blocks another request had freed)
    otel.instrument()
    pool = make_pool(4, block_size=BS, local_cache_size=0)
    w = pool.allocate("waiting", list(range(8)))
    pool.set_state(w, "waiting")
    pool.free(pool.allocate("running", list(range(100, 112))))
    pool.resume(w)
    pool.set_state(w, "waiting")
    # WHEN another request preempts it again
    pool.free(pool.allocate("again", list(range(200, 212))))
    pool.resume(w)
    pool.free(w)
    # THEN its span has both preemptions, each before its resume
    names = [n for n, _ in events(spans_by_request(otel)["waiting"])]
    assert names == ["allocate", "preempt", "resume", "preempt", "resume", "free"]


def test_a_finding_is_an_event_on_its_request_span(otel, make_pool):  # noqa: F811
    otel.instrument()
    pool = make_pool(16, block_size=BS)
    s = pool.allocate("req-7", [1, 2, 3, 4, 5])
    # WHEN a probe reports a finding about that request
    pool.report(
        Finding(
            "guard_violation",
            "slot 17 of block 2 was written past its end",
            block=2,
            request="req-7",
        )
    )
    pool.free(s)
    (name, attrs) = events(spans_by_request(otel)["req-7"])[1]
    # THEN the request's span carries it
    assert name == "kvscope.finding"
    assert attrs["kvscope.finding.kind"] == "guard_violation"
    assert attrs["kvscope.finding.severity"] == "error"
    assert attrs["kvscope.block.id"] == 2


def test_a_previous_finding_hook_still_runs(otel, make_pool):  # noqa: F811
    pool = make_pool(16, block_size=BS)
    seen: list[str] = []
    pool.on_finding = lambda f: seen.append(f.kind)
    otel.instrument(pools=[pool])
    pool.report(Finding("leak_orphan", "orphan", block=1))
    otel.inst.uninstrument()
    pool.report(Finding("leak_orphan", "orphan", block=1))
    assert seen == ["leak_orphan", "leak_orphan"]
    assert pool.on_finding is not None and pool.on_finding.__name__ == "<lambda>"


def test_uninstrument_ends_open_spans(otel, make_pool):  # noqa: F811
    otel.instrument()
    pool = make_pool(16, block_size=BS)
    s = pool.allocate("open", [1, 2, 3])
    otel.inst.uninstrument()
    assert spans_by_request(otel)["open"].attributes["kvscope.request.outcome"] == "open"
    pool.free(s)
