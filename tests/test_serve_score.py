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
from server.engine import Engine  # noqa: E402
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
    pytest.importorskip("transformers")
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


def test_the_memory_accounting_and_the_report_table(quick: LlamaModel) -> None:
    # GIVEN a pool too small for 6 clients of the uniform mix at once (~12 blocks each)
    num_blocks = 40
    block_bytes = serve_mixes.kv_block_bytes(quick)
    results = serve_mixes.run_report(
        quick, "cpu", shapes=["short", "score"], clients=[2, 6], num_blocks=num_blocks,
        num_requests=12, repeat=1, graphs=False, mixes=("uniform",),
    )  # fmt: skip
    cases = results["cases"]
    assert len(cases) == 2 * 2 * 2
    for c in cases:
        # THEN peak KV bytes are the peak blocks' bytes, within the pool
        assert c["peak_kv_bytes"] == c["peak_kv_blocks"] * block_bytes > 0
        assert c["peak_kv_blocks"] <= num_blocks and c["requests"] == 12 and c["failed"] == 0
        assert 1 <= c["running"]["peak"] <= c["clients"]
        if c["shape"] == "score":
            assert c["scored_tokens"] > 0 and c["output_tokens"] == 0
    # AND the memory held back the 6 clients: fewer ran at once than there were clients
    six = [c for c in cases if c["clients"] == 6 and c["shape"] == "short"]
    assert all(c["running"]["peak"] < 6 for c in six)
    # AND the table has a row per mix and shape, beside the report's figures
    table = serve_mixes.render_report(results)
    assert "| uniform | short |" in table and "| uniform | score |" in table
    assert "+72%" in table and "Memory regime: a KV budget of 40 blocks" in table
