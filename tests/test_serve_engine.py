"""serve.py's engine on the real pool and kernels: paged greedy output equals full recomputation."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from server import violations  # noqa: E402
from server.batch import Batch  # noqa: E402
from server.checkpoint import load_model, save_model, tiny_model  # noqa: E402
from server.engine import Engine  # noqa: E402
from server.model import (  # noqa: E402
    LlamaModel,
    ModelConfig,
    forward_reference,
    generate_reference,
)
from server.static import StaticCache, StaticGeometry  # noqa: E402
from server.workload import Request, WorkloadSpec, generate_workload  # noqa: E402

from kvscope.allocator import KVPool, PoolConfig  # noqa: E402

BLOCK_SIZE = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return tiny_model(0)


def make_pool(model: LlamaModel, num_blocks: int, guard: bool = False) -> KVPool:
    config = model.config
    pool_config = PoolConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        dtype=model.lm_head.weight.dtype,
        device=str(model.lm_head.weight.device),
        guard=guard,
    )
    return KVPool.create(f"test-serve-{os.getpid()}-{uuid.uuid4().hex[:8]}", pool_config)


@pytest.fixture
def pools(model: LlamaModel) -> Iterator[list[KVPool]]:
    """Pools made by a test, removed afterwards."""
    made: list[KVPool] = []
    yield made
    for pool in made:
        pool.close()
        pool.unlink()


def workload(num_requests: int, seed: int = 0, **knobs: object) -> list[Request]:
    spec = WorkloadSpec(num_requests=num_requests, rate=0, seed=seed, **knobs)  # type: ignore[arg-type]
    return generate_workload(spec, vocab_size=256)


def assert_matches_reference(model: LlamaModel, requests: list[Request], results: list) -> None:
    """Every sample of every request equals greedy generation by full recomputation."""
    by_id = {r.request_id: r for r in results}
    assert set(by_id) == {r.request_id for r in requests}
    for request in requests:
        result = by_id[request.request_id]
        assert not result.error, result.error
        expected = generate_reference(model, request.prompt, request.max_tokens)
        assert len(result.outputs) == request.n
        for output in result.outputs:
            assert output == expected, f"{request.request_id} diverged from the reference"


def assert_pool_clean(pool: KVPool) -> None:
    """No finding, and every block back (free or cached) once all requests are done."""
    assert pool.check() == []
    assert pool.stats()["num_allocated"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("guard", [False, True], ids=["plain", "guard"])
def test_paged_greedy_equals_full_recomputation(
    model: LlamaModel, pools: list, guard: bool
) -> None:
    # GIVEN a roomy pool (with a guard slot per block or not) and requests sharing system
    # prompts, prompts chunked 8 tokens a step
    pool = make_pool(model, 256, guard)
    pools.append(pool)
    requests = workload(12, prefix_len=(20, 40), prompt_len=(1, 20), output_len=(4, 20))
    engine = Engine(model, pool, max_num_seqs=6, prefill_chunk=8, max_num_batched_tokens=40)
    # WHEN the engine serves them
    results = engine.run(requests)
    # THEN every output equals the no-cache reference, token for token
    assert_matches_reference(model, requests, results)
    # AND later requests found earlier ones' prefix blocks in the pool
    assert sum(r.num_hit_tokens for r in results) > 0
    assert pool.stats()["prefix_hits"] > 0
    assert_pool_clean(pool)


@pytest.mark.slow
def test_a_step_publishes_its_streams_in_one_call(
    model: LlamaModel, pools: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN requests sharing system prompts, several prefilled and decoded in each step, and a
    # count of the pool's publication calls in each step
    pool = make_pool(model, 256)
    pools.append(pool)
    requests = workload(12, prefix_len=(20, 40), prompt_len=(1, 20), output_len=(4, 20))
    engine = Engine(model, pool, max_num_seqs=6, prefill_chunk=8, max_num_batched_tokens=40)
    calls: dict[int, list[int]] = {}

    def counted(name: str):
        real = getattr(pool, name)

        def call(*args):
            calls.setdefault(engine.timer.num_steps, []).append(len(args[0]) if args else 0)
            assert name == "mark_computed_many", "a step published a stream on its own"
            return real(*args)

        return call

    monkeypatch.setattr(pool, "mark_computed", counted("mark_computed"))
    monkeypatch.setattr(pool, "mark_computed_many", counted("mark_computed_many"))
    # WHEN the engine serves them
    results = engine.run(requests)
    # THEN each step that published made one call, for every stream that filled a block, some
    # of them several streams at once; later requests hit what was published, outputs exact
    assert calls and all(len(c) == 1 for c in calls.values())
    assert max(c[0] for c in calls.values()) > 1
    assert sum(r.num_hit_tokens for r in results) > 0
    assert_matches_reference(model, requests, results)
    assert_pool_clean(pool)


@pytest.mark.slow
def test_preemption_under_a_full_pool_keeps_outputs_exact(model: LlamaModel, pools: list) -> None:
    # GIVEN a pool far too small for the batch it admits
    pool = make_pool(model, 24)
    pools.append(pool)
    requests = workload(10, seed=1, prompt_len=(10, 30), output_len=(20, 30), prefix_share=0.3)
    engine = Engine(model, pool, max_num_seqs=8, prefill_chunk=16)
    # WHEN it is served
    results = engine.run(requests)
    # THEN sequences were preempted and recomputed, and the outputs are still exact
    assert engine.scheduler.num_preemptions > 0
    assert_matches_reference(model, requests, results)
    assert_pool_clean(pool)


def test_n_samples_share_the_prompt_through_fork_and_copy_on_write(
    model: LlamaModel, pools: list
) -> None:
    # GIVEN greedy requests for 3 samples each, prompts ending inside a block
    pool = make_pool(model, 128)
    pools.append(pool)
    requests = workload(4, seed=2, n=3, prompt_len=(3, 13), output_len=(5, 12), prefix_share=0)
    engine = Engine(model, pool, max_num_seqs=12)
    # WHEN served
    results = engine.run(requests)
    # THEN every sample equals the reference, and the shared last block was copied on write
    assert_matches_reference(model, requests, results)
    assert pool.stats()["num_cow"] > 0
    assert_pool_clean(pool)


@pytest.mark.slow
def test_forked_samples_survive_preemption(model: LlamaModel, pools: list) -> None:
    # GIVEN 3 samples per request in a pool too small for all of them: set-aside sequences
    # then hold blocks that are shared with running siblings
    pool = make_pool(model, 20)
    pools.append(pool)
    requests = workload(8, n=3, prompt_len=(10, 30), output_len=(10, 24), prefix_share=0.5)
    engine = Engine(model, pool, max_num_seqs=12, prefill_chunk=16)
    # WHEN served
    results = engine.run(requests)
    # THEN there were preemptions and copies, and nothing diverged or leaked
    assert engine.scheduler.num_preemptions > 0 and pool.stats()["num_cow"] > 0
    assert_matches_reference(model, requests, results)
    assert_pool_clean(pool)


@pytest.mark.slow
def test_a_long_run_recycles_cached_prefix_blocks(model: LlamaModel, pools: list) -> None:
    # GIVEN many more requests than the pool has blocks: published prefix blocks must be
    # evicted from the prefix index over and over
    pool = make_pool(model, 32)
    pools.append(pool)
    requests = workload(200, prompt_len=(8, 40), output_len=(2, 8))
    # WHEN served
    results = Engine(model, pool).run(requests)
    # THEN all are served, a sample of them exactly, and the pool is healthy afterwards
    assert not [r.error for r in results if r.error]
    sample = requests[::20]
    ids = {q.request_id for q in sample}
    assert_matches_reference(model, sample, [r for r in results if r.request_id in ids])
    assert pool.stats()["num_evictions"] > 0
    assert_pool_clean(pool)


@pytest.mark.slow
def test_cancelled_requests_are_aborted_without_leaks(model: LlamaModel, pools: list) -> None:
    # GIVEN requests of 2 samples, half of which the client cancels midway, in a tight pool
    pool = make_pool(model, 40)
    pools.append(pool)
    requests = workload(16, seed=5, n=2, output_len=(4, 16), cancel_share=0.5)
    cancelled = {r.request_id: r.cancel_after for r in requests if r.cancel_after}
    assert cancelled
    # WHEN served
    results = Engine(model, pool, max_num_seqs=8).run(requests)
    # THEN a cancelled request stopped where the client left, on the reference's path
    for result in results:
        request = next(r for r in requests if r.request_id == result.request_id)
        expected = generate_reference(model, request.prompt, request.max_tokens)
        assert result.cancelled == (request.request_id in cancelled)
        if result.cancelled:
            assert max(len(o) for o in result.outputs) == request.cancel_after
        for output in result.outputs:
            assert output == (expected[: len(output)] if result.cancelled else expected)
    # AND the pool got every block and sequence slot back
    assert_pool_clean(pool)
    assert pool.stats()["num_sequences"] == 0


def test_temperature_sampling_is_seeded(model: LlamaModel, pools: list) -> None:
    # GIVEN the same sampled workload served twice with one seed, once with another
    requests = workload(3, seed=3, n=2, temperature=1.5, output_len=(12, 12), prefix_share=0)

    def serve(seed: int) -> dict[str, list[list[int]]]:
        pool = make_pool(model, 128)
        pools.append(pool)
        results = Engine(model, pool, seed=seed).run(requests)
        return {r.request_id: r.outputs for r in results}

    first, again, other = serve(0), serve(0), serve(1)
    # THEN the same seed gives the same tokens, another seed other tokens
    assert first == again
    assert first != other
    # AND the two samples of a request differ (they are not greedy copies)
    assert any(outputs[0] != outputs[1] for outputs in first.values())


def test_a_request_larger_than_the_pool_fails_alone(model: LlamaModel, pools: list) -> None:
    pool = make_pool(model, 8)
    pools.append(pool)
    big = Request("big", list(range(100)), max_tokens=4)
    small = Request("small", [1, 2, 3], max_tokens=4)
    results = {r.request_id: r for r in Engine(model, pool).run([big, small])}
    assert "needs up to" in results["big"].error
    assert results["small"].outputs == [generate_reference(model, [1, 2, 3], 4)]
    assert_pool_clean(pool)


def test_static_baseline_greedy_equals_full_recomputation(model: LlamaModel) -> None:
    # GIVEN the static layout with room for 4 reservations of max_len
    requests = workload(8, seed=4, output_len=(4, 12), n=2)
    max_len = max(len(r.prompt) + r.max_tokens for r in requests)
    config = model.config
    geometry = StaticGeometry(
        -(-max_len // BLOCK_SIZE) * 4,
        BLOCK_SIZE,
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
    )
    cache = StaticCache(geometry, max_len)
    engine = Engine(model, cache)
    results = engine.run(requests)
    # THEN outputs are exact, reservations waited for each other, and all came back
    assert_matches_reference(model, requests, results)
    assert cache.stats()["num_admission_failures"] > 0
    assert cache.stats()["num_free"] == geometry.num_blocks and cache.check() == []


@pytest.mark.slow
def test_paged_greedy_equals_transformers_llama(tmp_path: Path, pools: list) -> None:
    """Same weights, same greedy tokens as Hugging Face's LlamaForCausalLM (optional extra)."""
    transformers = pytest.importorskip("transformers", exc_type=ImportError)
    # GIVEN a 3-layer random model saved as a checkpoint, loaded by us and by transformers
    save_model(tiny_model(7, ModelConfig(num_layers=3)), tmp_path)
    ours = load_model(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32)
    requests = workload(4, seed=7, output_len=(16, 24))
    # WHEN our engine serves the requests on the pool and transformers generates greedily
    pool = make_pool(ours, 128)
    pools.append(pool)
    results = {r.request_id: r.outputs[0] for r in Engine(ours, pool).run(requests)}
    for request in requests:
        prompt = torch.tensor([request.prompt])
        with torch.no_grad():
            ids = hf.eval().generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=request.max_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        # THEN the tokens are the same
        assert results[request.request_id] == ids[0, len(request.prompt) :].tolist()


def assert_greedy_up_to_ties(
    model: LlamaModel, requests: list[Request], results: list, rel_tol: float
) -> None:
    """In half precision: every token is the argmax of logits recomputed without a cache for
    the same context, or within rounding of it (a near-tie may legitimately go either way)."""
    by_id = {r.request_id: r for r in results}
    for request in requests:
        result = by_id[request.request_id]
        assert not result.error, result.error
        for output in result.outputs:
            tokens = list(request.prompt)
            for i, token in enumerate(output):
                logits = forward_reference(model, tokens)[-1]
                gap = float(logits.max() - logits[token])
                assert gap <= rel_tol * max(1.0, float(logits.abs().max())), (
                    f"{request.request_id} token {i}: {token} is {gap} below the argmax"
                )
                tokens.append(token)


@pytest.mark.slow
def test_half_precision_greedy_equals_recomputation_up_to_ties(pools: list) -> None:
    # GIVEN the tiny model and the pool in float16 (what the Triton kernels take on a GPU)
    model = tiny_model(0).half()
    pool = make_pool(model, 128)
    pools.append(pool)
    requests = workload(6, seed=8, output_len=(8, 16), n=2)
    # WHEN served, THEN every token is the recomputed argmax up to fp16 rounding
    assert_greedy_up_to_ties(model, requests, Engine(model, pool).run(requests), rel_tol=0.01)
    assert_pool_clean(pool)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_larger_model_on_gpu_equals_full_recomputation(pools: list, dtype: torch.dtype) -> None:
    # GIVEN a 4-layer GQA model with head_dim 64 on the GPU, and long prompts sharing prefixes
    config = ModelConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
    )
    model = tiny_model(0, config).to(device="cuda", dtype=dtype)
    pool = make_pool(model, 512)
    pools.append(pool)
    spec = WorkloadSpec(num_requests=16, rate=0, prompt_len=(20, 300), output_len=(16, 48), n=2)
    requests = generate_workload(spec, config.vocab_size)
    # WHEN the engine serves them through the Triton kernels
    results = Engine(model, pool, max_num_seqs=16, prefill_chunk=128).run(requests)
    # THEN every token is the argmax of a full recomputation, up to half-precision rounding
    rel_tol = 0.01 if dtype == torch.float16 else 0.05
    assert_greedy_up_to_ties(model, requests, results, rel_tol)
    assert_pool_clean(pool)


def test_guard_mode_kernels_turn_a_freed_block_read_into_a_finding(
    model: LlamaModel, pools: list
) -> None:
    # GIVEN a guard-mode pool and a stream whose block table still names a block after its free
    pool = make_pool(model, 16, guard=True)
    pools.append(pool)
    seq = pool.allocate("r", list(range(20)))
    other = pool.allocate("o", list(range(100, 120)))
    stale = other.block_table[0]
    pool.free(other)
    seq.block_table[0] = stale  # the engine's bug: a freed block in a live table
    stream = type("S", (), {"seq": seq, "name": "r"})()
    chunk = type("C", (), {"stream": stream, "start": 0, "length": 20})()
    # WHEN the step runs through the kernels
    batch = Batch([chunk], pool, "cpu")
    model(batch.tokens, batch.positions, batch.attend)
    violations.report(pool, batch, batch.violations())
    # THEN the kernels skipped the read and the pool holds a use_after_free finding for it,
    # naming the request whose table still maps the block (not the block's last owner, "o")
    found = {(f.kind, f.block, f.request, f.owner_pid) for f in pool.findings()}
    assert ("use_after_free", stale, "r", os.getpid()) in found
