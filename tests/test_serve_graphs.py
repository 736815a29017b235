"""Steps through StepGraphs' static buffers (decode and mixed steps) give the eager tokens."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from server.checkpoint import tiny_model  # noqa: E402
from server.engine import Engine  # noqa: E402
from server.graphs import StepGraphs, token_buckets  # noqa: E402
from server.model import LlamaModel, generate_reference  # noqa: E402
from server.workload import WorkloadSpec, generate_workload  # noqa: E402

from kvscope.allocator import KVPool, PoolConfig  # noqa: E402


@pytest.fixture
def pools() -> Iterator[list[KVPool]]:
    made: list[KVPool] = []
    yield made
    for pool in made:
        pool.close()
        pool.unlink()


def make_pool(model: LlamaModel, num_blocks: int) -> KVPool:
    cfg = model.config
    config = PoolConfig(
        num_blocks=num_blocks,
        block_size=8,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=model.lm_head.weight.dtype,
        device=str(model.lm_head.weight.device),
    )
    return KVPool.create(f"test-graphs-{os.getpid()}-{uuid.uuid4().hex[:8]}", config)


SPEC = WorkloadSpec(
    num_requests=10, rate=0, prompt_len=(1, 20), output_len=(4, 14), prefix_len=(8, 24)
)


def serve(
    model: LlamaModel, pool: KVPool, graphs: StepGraphs | None, spec: WorkloadSpec = SPEC
) -> dict[str, list]:
    requests = generate_workload(spec, model.config.vocab_size)
    engine = Engine(model, pool, max_num_seqs=4, prefill_chunk=8, graphs=graphs)
    results = engine.run(requests)
    assert not any(r.error for r in results)
    return {r.request_id: r.outputs for r in results}


def test_token_buckets_cover_every_step_size() -> None:
    # GIVEN a token budget of 4096 a step
    buckets = token_buckets(4096)
    # THEN the buckets rise from 16 to the budget, each at most 1.5x the one before
    assert buckets[0] == 16 and buckets[-1] == 4096
    assert all(b < c <= max(b + 16, int(b * 1.5)) for b, c in zip(buckets, buckets[1:]))
    assert token_buckets(16) == [16] and token_buckets(40) == [16, 32, 40]


def test_static_buffer_steps_equal_eager_steps(pools: list) -> None:
    # GIVEN the tiny model and two pools, one engine with step graphs (on the CPU: their
    # static buffers, run eagerly) for up to 4 sequences of at most 40 tokens and steps of up
    # to 256 tokens (the model's projections fused, as serve.py runs it)
    torch.set_num_threads(1)
    model = tiny_model(0).fuse()
    eager_pool, graph_pool = make_pool(model, 96), make_pool(model, 96)
    pools += [eager_pool, graph_pool]
    graphs = StepGraphs(model, graph_pool, max_seqs=4, max_len=40, max_tokens=256, max_chunk=8)
    # WHEN both serve the same requests
    eager = serve(model, eager_pool, None)
    through_graphs = serve(model, graph_pool, graphs)
    # THEN every token agrees, and the decode steps and the steps holding prompt chunks (with
    # decodes beside them) all went through the static buffers
    assert through_graphs == eager
    assert graphs.num_mixed > 5 and graphs.num_forwards - graphs.num_mixed > 10
    # AND the outputs are the no-cache reference's
    for request in generate_workload(SPEC, model.config.vocab_size)[:3]:
        expected = generate_reference(model, request.prompt, request.max_tokens)
        assert through_graphs[request.request_id] == [expected]


def test_a_batch_wider_than_the_graphs_runs_eagerly(pools: list) -> None:
    # GIVEN step graphs sized for 2 sequences of at most 16 tokens
    torch.set_num_threads(1)
    model = tiny_model(0)
    pool = make_pool(model, 96)
    pools.append(pool)
    graphs = StepGraphs(model, pool, max_seqs=2, max_len=16, max_tokens=64)
    # WHEN an engine running 4 sequences at once, each over 16 tokens, serves
    long = WorkloadSpec(num_requests=6, rate=0, prompt_len=(20, 30), output_len=(4, 8))
    through_graphs = serve(model, pool, graphs, long)
    # THEN no step fitted the graphs, and the outputs are still exact
    assert graphs.num_forwards == 0
    eager_pool = make_pool(model, 96)
    pools.append(eager_pool)
    assert through_graphs == serve(model, eager_pool, None, long)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_replay_the_eager_tokens_on_cuda(pools: list) -> None:
    # GIVEN the tiny model in fp16 on the GPU, with step graphs captured for 4 sequences
    model = tiny_model(0).to(device="cuda", dtype=torch.float16).fuse()
    eager_pool, graph_pool = make_pool(model, 96), make_pool(model, 96)
    pools += [eager_pool, graph_pool]
    graphs = StepGraphs(model, graph_pool, max_seqs=4, max_len=40, max_tokens=256, max_chunk=8)
    # WHEN both engines serve the same requests
    eager = serve(model, eager_pool, None)
    through_graphs = serve(model, graph_pool, graphs)
    # THEN the replays, decode and mixed steps alike, produced the eager engine's tokens
    assert graphs.num_replays == graphs.num_forwards > 10 and graphs.num_mixed > 5
    assert through_graphs == eager


def test_the_step_timer_sums_each_phase_between_its_boundaries() -> None:
    # GIVEN a step timer on the CPU
    from server.steptime import PHASES, StepTimer

    timer = StepTimer(torch.device("cpu"))
    # WHEN two steps report their phase boundaries
    timer.add((0.0, 1.0, 3.0, 6.0, 10.0, 15.0, 21.0, 28.0))
    timer.add((100.0, 101.0, 103.0, 106.0, 110.0, 115.0, 121.0, 128.0))
    # THEN each phase holds the sum of its spans, in order, and the CPU records no GPU time
    assert timer.num_steps == 2
    assert list(timer.phase_s) == list(PHASES)
    assert list(timer.phase_s.values()) == [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0]
    assert timer.gpu_began(mixed=True) is None and timer.gpu_seconds() == {}
