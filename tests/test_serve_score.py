"""Scoring requests in the example engine, and bench_serve's report regime on the CPU: the
Transformers baseline's comparison, the memory accounting, the report's table."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

import serve_mixes  # noqa: E402
from server.checkpoint import tiny_model  # noqa: E402
from server.engine import Engine, StepClock  # noqa: E402
from server.errors import ServeError  # noqa: E402
from server.model import LlamaModel, forward_reference, generate_reference  # noqa: E402
from server.workload import Request, read_jsonl  # noqa: E402

from kvscope.allocator import KVPool, PoolConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def pool() -> Iterator[KVPool]:
    config = tiny_model(0).config
    made = KVPool.create(
        f"test-score-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        PoolConfig(
            num_blocks=48, block_size=8, num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            dtype=torch.float32, device="cpu",
        ),
    )  # fmt: skip
    yield made
    made.close()
    made.unlink()


def reference_scores(model: LlamaModel, request: Request) -> tuple[list[float], bool]:
    """Log-probabilities of the continuation from one forward over the whole sequence."""
    logits = forward_reference(model, request.prompt + request.continuation)
    first = len(request.prompt) - 1
    rows = torch.log_softmax(logits[first : first + len(request.continuation)], -1)
    target = torch.tensor(request.continuation)
    return rows.gather(1, target[:, None])[:, 0].tolist(), bool((rows.argmax(-1) == target).all())


def test_scoring_requests_return_the_continuations_log_likelihoods(pool: KVPool) -> None:
    # GIVEN scoring requests behind one 24-token system prompt (prompt lengths 25-40, some a
    # multiple of the block size), mixed with generation requests, and a greedy continuation
    model = tiny_model(0)
    system = [(7 * i) % 256 for i in range(24)]
    requests = []
    for i in range(8):
        prompt = system + [(i * 13 + j) % 256 for j in range(1 + 2 * i)]
        continuation = [(i * 31 + j * 5) % 256 for j in range(1 + i % 7)]
        requests.append(Request(f"s{i}", prompt, 0, continuation=continuation))
    requests.append(Request("g0", system + [1, 2, 3], max_tokens=6))
    greedy = generate_reference(model, system + [9], 4)
    requests.append(Request("s-greedy", system + [9], 0, continuation=greedy))
    # the same scoring request twice: the second finds the first's blocks in the prefix index
    requests.append(
        Request("s-again", list(requests[3].prompt), 0, continuation=requests[3].continuation)
    )
    # WHEN the engine serves them, prompt chunks of 8 tokens (a continuation spans steps)
    engine = Engine(model, pool, max_num_seqs=4, max_num_batched_tokens=24, prefill_chunk=8)
    results = {r.request_id: r for r in engine.run(requests)}
    # THEN every scoring request's log-probabilities are the recomputed ones, nothing generated
    for request in requests:
        result = results[request.request_id]
        assert not result.error
        if not request.is_scoring:
            assert result.outputs[0] == generate_reference(model, request.prompt, 6)
            continue
        logprobs, is_greedy = reference_scores(model, request)
        assert result.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert result.is_greedy == is_greedy and result.outputs == [[]]
        # AND prefix hits stop before the prompt's last token (its logits score the first)
        assert result.num_hit_tokens <= len(request.prompt) - 1
    assert results["s-greedy"].is_greedy
    assert results["s-again"].num_hit_tokens > 0
    assert pool.check() == []


def test_a_scoring_request_in_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(
        '{"id": "a", "prompt_tokens": [1, 2, 3], "continuation_tokens": [4, 5]}\n'
        '{"id": "b", "prompt": "hi", "continuation": "!"}\n'
    )
    a, b = read_jsonl(path, vocab_size=256)
    assert a.is_scoring and a.continuation == [4, 5] and a.max_tokens == 0
    assert b.continuation == [ord("!")]
    path.write_text('{"prompt_tokens": [1], "continuation_tokens": [2], "max_tokens": 3}\n')
    with pytest.raises(ServeError, match="scoring request"):
        read_jsonl(path, vocab_size=256)


@pytest.fixture(scope="module")
def quick() -> LlamaModel:
    return serve_mixes.build_model("cpu", quick=True)


@pytest.mark.slow  # importing transformers takes seconds
@pytest.mark.parametrize("shape", ["generate", "short", "score"])
def test_transformers_serves_the_same_outputs_as_the_engine(quick: LlamaModel, shape: str) -> None:
    pytest.importorskip("transformers", exc_type=ImportError)
    from bench_serve_hf import HFBaseline

    # GIVEN four requests of the top-10 mix, served by the engine on one pool
    requests = serve_mixes.requests_of("top-10", shape, 4, quick)
    for r in requests:
        if not r.is_scoring:
            r.max_tokens = min(r.max_tokens, 6)
    shared = serve_mixes.SharedPool(quick, "cpu", 64, 4, 200, graphs=False)
    try:
        _, results = shared.serve(requests, 4, sharing=True)
    finally:
        shared.close()
    ours = {r.request_id: r for r in results}
    # WHEN Transformers serves them on the same weights, a thread per client and in a batch
    hf = HFBaseline(quick)
    for got in (hf.serve_threads(requests, 2), hf.serve_batches(requests, 4)):
        # THEN every output (or score) is the engine's
        check = hf.compare(requests, ours, got["results"])
        assert check["equal"] == 4, check
        assert got["requests"] == 4 and got["peak_kv_bytes"] > 0


@pytest.mark.slow
def test_the_memory_accounting_and_the_report_table(quick: LlamaModel) -> None:
    # GIVEN a pool too small for 6 clients of the uniform mix at once (~12 blocks each)
    num_blocks = 40
    block_bytes = serve_mixes.kv_block_bytes(quick)
    results = serve_mixes.run_report(
        quick, "cpu", shapes=["short", "score"], clients=[2, 6], num_blocks=num_blocks,
        num_requests=12, repeat=1, graphs=False, mixes=("uniform",), clock=StepClock,
    )  # fmt: skip
    cases = results["cases"]
    assert len(cases) == 2 * 2 * 2
    for c in cases:
        # THEN peak KV bytes are the peak blocks' bytes, within the pool
        assert c["peak_kv_bytes"] == c["peak_kv_blocks"] * block_bytes == c["kv"]["peak_bytes"] > 0
        assert c["peak_kv_blocks"] <= num_blocks and c["requests"] == 12 and c["failed"] == 0
        assert 0 < c["kv"]["mean_bytes"] <= c["kv"]["mapped_bytes"] and c["num_blocks"] == 40
        assert 1 <= c["running"]["peak"] <= c["clients"]
        if c["shape"] == "score":
            assert c["scored_tokens"] > 0 and c["output_tokens"] == 0
        if not c["sharing"]:
            # (nothing shared: every held block is one stream's)
            assert c["kv"]["mean_bytes"] == c["kv"]["mapped_bytes"] and c["kv"]["saved"] == 0
    # AND the memory held back the 6 clients: fewer ran at once than there were clients
    six = [c for c in cases if c["clients"] == 6 and c["shape"] == "short"]
    assert all(c["running"]["peak"] < 6 for c in six)
    # AND the table has a row per mix and shape, beside the report's figures
    table = serve_mixes.render_report(results)
    assert "| uniform | short |" in table and "| uniform | score |" in table
    assert "+72%" in table and "Memory regime: a KV budget of 40 blocks" in table


def test_a_block_several_streams_map_is_held_once(quick: LlamaModel) -> None:
    # GIVEN a scoring request on a 3-block prompt, then three more on the same prompt at once
    # (each with its own 4-token continuation: a 4th block)
    prompt = [(5 * i) % 500 for i in range(3 * serve_mixes.BLOCK_SIZE)]
    requests = [Request("w", prompt, 0, continuation=[1, 2, 3, 4])]
    requests += [
        Request(f"r{i}", prompt, 0, arrival_s=1.0, continuation=[i, 7, 8, 9]) for i in range(3)
    ]
    block_bytes = serve_mixes.kv_block_bytes(quick)
    shared = serve_mixes.SharedPool(quick, "cpu", 64, 3, 100, graphs=False)
    try:
        # WHEN the engine serves them with sharing on, then off
        on, _ = shared.serve(requests, 3, sharing=True, clock=StepClock())
        off, _ = shared.serve(requests, 3, sharing=False, clock=StepClock())
    finally:
        shared.close()
    # THEN with sharing the three hold the first request's first 2 blocks once, and their own
    # last prompt block (a prefix hit stops before the prompt's last token) and continuation
    # block: 2 + 3 x 2 = 8 blocks where they map 12; the first request's step held its 4
    assert on["kv"]["peak_bytes"] == 8 * block_bytes
    assert on["kv"]["mean_bytes"] == (4 + 8) / 2 * block_bytes
    assert on["kv"]["mapped_bytes"] == (4 + 12) / 2 * block_bytes
    assert on["kv"]["saved"] == 0.25 and on["kv"]["maps_per_block"] == pytest.approx(4 / 3, 1e-3)
    assert on["running"] == {"mean": 2.0, "peak": 3, "series": on["running"]["series"]}
    # AND without sharing each holds its 4 blocks
    assert off["kv"]["peak_bytes"] == 12 * block_bytes and off["kv"]["saved"] == 0


@pytest.mark.slow
def test_the_reports_budget_holds_nine_requests_without_sharing(quick: LlamaModel) -> None:
    # GIVEN requests of 2 blocks (20 + 12 generated tokens but the last: 32) and 3 (40 scored)
    requests = [Request("g", [1] * 20, 13), Request("s", [1] * 39, 0, continuation=[2])]
    assert [serve_mixes.request_blocks(r) for r in requests] == [2, 3]
    # THEN the budget is 9 x (their mean + a block of headroom), rounded up to even
    assert serve_mixes.report_blocks(requests) == 32  # 9 x 3.5 = 31.5
    assert serve_mixes.report_blocks(requests[:1]) == 28  # 9 x 3 = 27
    assert serve_mixes.streams_fit(32, requests) == pytest.approx(9.1, abs=0.05)
    # WHEN the top-10 mix's scoring requests are served on the budget of their own (the
    # report's regime) by 12 and 16 clients
    results = serve_mixes.run_report(
        quick, "cpu", shapes=["score"], clients=[12, 16], num_blocks=0, num_requests=24,
        repeat=1, graphs=False, mixes=("top-10",), budget="report", clock=StepClock,
    )  # fmt: skip
    mixed = serve_mixes.requests_of("top-10", "score", 24, quick)
    budget = serve_mixes.report_blocks(mixed)
    assert results["budgets"][0]["num_blocks"] == budget and results["budget"] == "report"
    assert len(results["cases"]) == 4
    peaks = {}
    for c in results["cases"]:
        # THEN the budget binds: at most ~9 of the clients' requests run at once without
        # sharing; with it, prefix hits on blocks running streams hold leave room for more
        assert c["num_blocks"] == budget and c["requests"] == 24 and c["failed"] == 0
        assert c["kv"]["peak_bytes"] <= budget * serve_mixes.kv_block_bytes(quick)
        peaks[c["clients"], c["sharing"]] = c["running"]["peak"]
        if not c["sharing"]:
            assert 8 <= c["running"]["peak"] <= 10 < c["clients"]
        # AND a scoring stream is never set aside (it never grows), so none is preempted
        assert c["preemptions"] == c["set_aside"] == 0
    assert all(peaks[n, False] <= peaks[n, True] <= n for n in (12, 16))
    # AND the table names the budget, what it holds, and the A100's
    table = serve_mixes.render_report(results)
    assert "Memory regime (the report's)" in table
    assert f"| top-10 | score | 16 | {budget} (" in table
    assert f"{results['a100_blocks']} blocks" in table


def test_the_choices_shape_scores_one_context_against_n_continuations() -> None:
    # GIVEN the top-10 mix's scoring requests with one continuation, and with 4 per question
    one = serve_mixes.mix_requests("top-10", 8, 512, shape="score")
    four = serve_mixes.mix_requests("top-10", 8, 512, shape="score", choices=4)
    # THEN 8 requests are 2 questions of 4 choices side by side, each question one context
    # (the first prompts of the one-continuation shape) against 4 different continuations
    assert [r.request_id for r in four] == [f"r{i}.{j}" for i in range(2) for j in range(4)]
    for i in range(2):
        question = four[4 * i : 4 * i + 4]
        assert all(r.prompt == one[i].prompt for r in question)
        assert len({tuple(r.continuation) for r in question}) == 4
    # AND one continuation is the shape as before; the other shapes take no choices
    assert [r.request_id for r in one] == [f"r{i}" for i in range(8)]
    with pytest.raises(AssertionError):
        serve_mixes.mix_requests("top-10", 8, 512, shape="short", choices=4)


def test_a_questions_choices_share_its_cached_context_and_fit_more_at_once(
    quick: LlamaModel,
) -> None:
    # GIVEN a scoring request on a 5-block context (80 tokens), then a question on the same
    # context: 4 choices of 2 tokens (6 blocks each), on a pool of 20 blocks
    bs = serve_mixes.BLOCK_SIZE
    context = [(3 * i) % 500 for i in range(5 * bs)]
    requests = [Request("w", context, 0, continuation=[1, 2])]
    requests += [
        Request(f"q.{j}", context, 0, arrival_s=1.0, continuation=[j, 9]) for j in range(4)
    ]
    block_bytes = serve_mixes.kv_block_bytes(quick)
    shared = serve_mixes.SharedPool(quick, "cpu", 20, 4, 100, graphs=False)
    try:
        # WHEN the engine serves them with sharing on, then off
        on, _ = shared.serve(requests, 4, sharing=True, clock=StepClock())
        off, _ = shared.serve(requests, 4, sharing=False, clock=StepClock())
    finally:
        shared.close()
    # THEN with sharing the 4 choices run at once: each hits the context's first 4 blocks (a
    # hit stops before the prompt's last token), which the first takes from the cache and the
    # others map, so admission counts 2 new blocks for each after the first; they hold
    # 4 + 4 x 2 = 12 blocks where they map 24
    assert on["running"]["peak"] == 4
    assert on["kv"]["peak_bytes"] == 12 * block_bytes
    assert on["kv"]["mapped_bytes"] > on["kv"]["mean_bytes"]
    # AND without sharing 6 blocks each leave room for 2 at once (each with a block of
    # headroom), every held block one stream's
    assert off["running"]["peak"] == 2
    assert off["kv"]["peak_bytes"] == 12 * block_bytes and off["kv"]["saved"] == 0


def test_choices_arriving_together_on_a_new_context_compute_it_once(quick: LlamaModel) -> None:
    # GIVEN a question whose context nothing has computed yet (5 blocks): 4 choices of 2 tokens
    # arriving together
    bs = serve_mixes.BLOCK_SIZE
    context = [(3 * i) % 500 for i in range(5 * bs)]
    requests = [Request(f"q.{j}", context, 0, continuation=[j, 9]) for j in range(4)]
    block_bytes = serve_mixes.kv_block_bytes(quick)
    shared = serve_mixes.SharedPool(quick, "cpu", 64, 4, 100, graphs=False)
    try:
        # WHEN the engine serves them with sharing on, then off
        on, results = shared.serve(requests, 4, sharing=True, clock=StepClock())
        off, _ = shared.serve(requests, 4, sharing=False, clock=StepClock())
    finally:
        shared.close()
    # THEN the first computes the context while the other 3 wait for it (deferred: the pool
    # publishes a block once its K/V is written), then they hit its first 4 blocks (a hit stops
    # before the prompt's last token): 6 blocks held in the first step, 4 + 3 x 2 in the second
    hits = {r.request_id: r.num_hit_tokens for r in results}
    assert hits == {"q.0": 0, "q.1": 4 * bs, "q.2": 4 * bs, "q.3": 4 * bs}
    assert on["extra"]["deferred"] == 3 and off["extra"]["deferred"] == 0
    assert on["kv"]["peak_bytes"] == 10 * block_bytes
    assert on["kv"]["mean_bytes"] == (6 + 10) / 2 * block_bytes
    # AND a deferred choice's wait is in its time to first token: one step of the step clock
    ttft = sorted(r.first_token_s - r.admitted_s for r in results)
    assert ttft == pytest.approx([0.0, 0.005, 0.005, 0.005])
    # AND without sharing all 4 run in the first step, each holding its 6 blocks
    assert off["running"]["peak"] == 4 and off["kv"]["peak_bytes"] == 24 * block_bytes


def test_deferred_choices_keep_their_seats_and_fit_more_in_a_budget(quick: LlamaModel) -> None:
    # GIVEN 4 questions on new 5-block contexts, 4 choices of 2 tokens each (6 blocks a
    # choice), 8 clients, on a pool of 36 blocks: 5 choices at once without sharing (each with
    # its block of headroom)
    bs = serve_mixes.BLOCK_SIZE
    requests = []
    for q in range(4):
        context = [(7 * q + 3 * i) % 500 for i in range(5 * bs)]
        requests += [Request(f"q{q}.{j}", context, 0, continuation=[j, 9]) for j in range(4)]
    shared = serve_mixes.SharedPool(quick, "cpu", 36, 8, 100, graphs=False)
    try:
        # WHEN the engine serves them with sharing on, then off
        on, results = shared.serve(requests, 8, sharing=True, clock=StepClock())
        off, _ = shared.serve(requests, 8, sharing=False, clock=StepClock())
    finally:
        shared.close()
    # THEN with sharing each question's first choice computes its context while its other 3
    # wait, keeping their seats (2 questions in the first step: 8 seats); in the second those
    # 6 take 6 blocks for the first of each question and 2 for each after (its hits on blocks
    # the first holds take nothing), which leaves room for the next question's first choice
    # and one of its choices' seats: 7 at once
    assert on["running"]["peak"] == 7 and on["extra"]["deferred"] == 10
    assert sorted(r.num_hit_tokens for r in results) == [0] * 4 + [4 * bs] * 12
    assert on["kv"]["mean_bytes"] < off["kv"]["mean_bytes"]
    # AND without sharing at most 5 run at once
    assert off["running"]["peak"] == 5


def test_a_request_waits_for_a_prefix_only_while_a_step_computes_it(pool: KVPool) -> None:
    # GIVEN a 4-block context (block size 8) in two requests arriving together, steps of 16
    # prompt tokens: the first computes the context's blocks two at a time
    model = tiny_model(0)
    context = [(5 * i) % 256 for i in range(32)]
    pair = [Request("a", context + [1], max_tokens=2), Request("c", context + [2], max_tokens=2)]
    engine = Engine(model, pool, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=16)
    results = {r.request_id: r for r in engine.run(pair)}
    # THEN the second waits two steps, one for each pair of blocks, then hits all 4 (a hit stops
    # before the prompt's last token); the outputs are those of recomputation
    assert results["c"].num_hit_tokens == 32 and engine.scheduler.num_deferred == 1
    for request in pair:
        result = results[request.request_id]
        assert result.outputs[0] == generate_reference(model, request.prompt, 2)
    # WHEN a 2-block request before them takes the first step's whole token budget
    before = Request("b", [(3 * i) % 256 for i in range(16)], max_tokens=2)
    pair = [Request(f"{r.request_id}2", r.prompt, max_tokens=2) for r in pair]
    engine = Engine(model, pool, max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk=16)
    # (the context is evicted: both find nothing cached)
    while pool.evict(64):
        pass
    results = {r.request_id: r for r in engine.run([before, *pair])}
    # THEN nothing computes the context in that step, so the second is not deferred (it would
    # wait more than a step): it is admitted and computes a copy of its own
    assert results["c2"].num_hit_tokens == 0 and engine.scheduler.num_deferred == 0
    assert results["c2"].outputs[0] == generate_reference(model, pair[1].prompt, 2)
    assert pool.check() == []
