"""Steps through StepGraphs' static buffers (decode and mixed steps) give the eager tokens."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from server.batch import Batch  # noqa: E402
from server.checkpoint import tiny_model  # noqa: E402
from server.engine import Engine  # noqa: E402
from server.graphs import Readback, StepGraphs, token_buckets  # noqa: E402
from server.model import LlamaModel, generate_reference  # noqa: E402
from server.scheduler import Chunk  # noqa: E402
from server.violations import ErrorCopy  # noqa: E402
from server.workload import Request, WorkloadSpec, generate_workload  # noqa: E402

from kvscope import kernels  # noqa: E402
from kvscope.allocator import KVPool, PoolConfig  # noqa: E402


@pytest.fixture
def pools() -> Iterator[list[KVPool]]:
    made: list[KVPool] = []
    yield made
    for pool in made:
        pool.close()
        pool.unlink()


def make_pool(model: LlamaModel, num_blocks: int, guard: bool = False) -> KVPool:
    cfg = model.config
    config = PoolConfig(
        num_blocks=num_blocks,
        block_size=8,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=model.lm_head.weight.dtype,
        device=str(model.lm_head.weight.device),
        guard=guard,
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_guarded_graph_steps_bring_their_greedy_tokens_back_with_the_error_buffer(
    pools: list,
) -> None:
    # GIVEN the tiny model and two guard-mode pools, one engine with step graphs over it
    torch.set_num_threads(1)
    model = tiny_model(0).fuse()
    eager_pool, graph_pool = make_pool(model, 96, guard=True), make_pool(model, 96, guard=True)
    pools += [eager_pool, graph_pool]
    graphs = StepGraphs(model, graph_pool, max_seqs=4, max_len=40, max_tokens=256, max_chunk=8)
    # WHEN both serve the same greedy requests
    eager = serve(model, eager_pool, None)
    requests = generate_workload(SPEC, model.config.vocab_size)
    engine = Engine(model, graph_pool, max_num_seqs=4, prefill_chunk=8, graphs=graphs)
    copies: list[Any] = []
    start = engine.picks.start
    engine.picks.start = lambda t: copies.append(t) or start(t)  # type: ignore[method-assign]
    through_graphs = {r.request_id: r.outputs for r in engine.run(requests)}
    # THEN every token agrees, and the tokens of the steps that went through the static
    # buffers came back in the readback's copy, with the error buffer: the engine's own copy
    # of the tokens made for the eager steps (a prompt chunk past the graphs' widest) only
    assert through_graphs == eager and graphs.num_forwards > 10
    assert len(copies) <= engine.timer.num_steps - graphs.num_forwards
    assert engine.errors.held is None
    assert graph_pool.findings() == eager_pool.findings() == []


def test_a_readback_holds_the_error_buffer_the_answer_and_the_picks_apart() -> None:
    # GIVEN the readback of an audited step (a CUDA graph step's layout) for 5 picks, and one
    # of a step without the audit's answer
    audited = Readback.make(torch.device("cpu"), True, 5)
    plain = Readback.make(torch.device("cpu"), False, 5)
    for readback in (audited, plain):
        buffer, n = readback.buffer, readback.errors
        # THEN the error buffer comes first, then the answer (4 int64 words: what
        # TableAudit takes) and the picks (5 int64 words), each from an int64 boundary, none
        # overlapping another, the whole buffer copied back in one
        assert readback.picks is not None and readback.picks.shape == (5,)
        picks_from = readback.picks.data_ptr() - buffer.data_ptr()
        assert picks_from % 8 == 0 and picks_from >= 4 * n
        assert picks_from + 8 * 5 == buffer.numel() * 4
        assert torch.equal(buffer[:n], kernels.new_error_buffer())
    answer = audited.answer()
    assert answer is not None and answer.shape == (4,) and answer.dtype == torch.int64
    at = answer.data_ptr() - audited.buffer.data_ptr()
    assert at % 8 == 0 and at >= 4 * audited.errors and at + 32 <= 4 * audited.picks_at
    assert plain.answer() is None and plain.answer_at == -1


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


@pytest.mark.slow
def test_guarded_static_buffer_steps_equal_eager_steps(pools: list) -> None:
    # GIVEN a guard-mode pool holding two sequences and step graphs over it
    torch.set_num_threads(1)
    model = tiny_model(0)
    pool = make_pool(model, 32, guard=True)
    pools.append(pool)
    graphs = StepGraphs(model, pool, max_seqs=4, max_len=40, max_tokens=64, max_chunk=16)
    a = SimpleNamespace(seq=pool.allocate("a", list(range(12))), name="a")
    b = SimpleNamespace(seq=pool.allocate("b", list(range(50, 59))), name="b")
    chunk = Chunk(b, 0, 8)  # type: ignore[arg-type]
    ahead = Batch([chunk], pool, "cpu")  # b's first 8 tokens' K/V, for its decode to read
    model(ahead.tokens, ahead.positions, ahead.attend)
    steps = [[Chunk(a, 0, 12), Chunk(b, 8, 1)], [Chunk(a, 11, 1), Chunk(b, 8, 1)]]  # type: ignore[arg-type]
    for chunks in steps:
        # WHEN a mixed step, then a decode step, runs eagerly and through the static buffers
        eager_batch, graph_batch = Batch(chunks, pool, "cpu"), Batch(chunks, pool, "cpu")
        eager = model(eager_batch.tokens, eager_batch.positions, eager_batch.attend)
        hidden = graphs.forward(graph_batch)
        # THEN the guarded graph path ran it, checking against its own static buffers (the
        # pool's block states), and both give the same hidden states and no violation
        assert hidden is not None and graph_batch.guard is graphs.guard
        assert torch.equal(graphs.guard["block_state"], pool.block_state())
        torch.testing.assert_close(hidden, eager)
        assert eager_batch.violations() == graph_batch.violations() == []
    assert graphs.num_forwards == 2 and graphs.num_mixed == 1


def serve_with_a_stale_block(
    model: LlamaModel, pool: KVPool, graphs: StepGraphs | None
) -> tuple[list, list[int]]:
    """One request whose block table names a free block for one prompt chunk (a step that
    samples nothing) and one decode step; every finding the engine reported (the pool keeps
    one per kind and block), and how many it had reported after each step."""
    reported: list[tuple] = []
    keep = pool.probe.report

    def report(f: Any, rec: Any = None) -> bool:
        reported.append((f.kind, f.message, f.block, f.request))
        return keep(f, rec)

    pool.probe.report = report  # type: ignore[method-assign]
    engine = Engine(model, pool, max_num_seqs=4, prefill_chunk=8, graphs=graphs)
    engine.add(Request("r0", list(range(1, 21)), max_tokens=4))
    engine.step()  # prompt tokens 0..8
    seq = engine.states["r0"].streams[0].seq
    free = torch.nonzero(pool.block_state() == 0).flatten().tolist()
    stale, good = free[-1], seq.block_table[0]
    # planted for prompt tokens 8..16 (nothing sampled), then for the first decode step; the
    # steps between (prompt tokens 16..20, the second decode) read the right block
    counts = [len(reported)]
    for _ in range(2):
        seq.block_table[0] = stale
        engine.step()
        counts.append(len(reported))
        seq.block_table[0] = good
        engine.step()
        counts.append(len(reported))
    engine.run([])  # the last decode
    return reported, counts


def test_guarded_graph_steps_report_each_violation_once(pools: list) -> None:
    # GIVEN the tiny model and a guard-mode pool served eagerly and one through step graphs
    torch.set_num_threads(1)
    model = tiny_model(0)
    eager_pool, graph_pool = make_pool(model, 32, guard=True), make_pool(model, 32, guard=True)
    pools += [eager_pool, graph_pool]
    graphs = StepGraphs(model, graph_pool, max_seqs=4, max_len=40, max_tokens=64, max_chunk=8)
    # WHEN a request's block table names a free block during a step that samples nothing and
    # during one that samples
    eager, _ = serve_with_a_stale_block(model, eager_pool, None)
    through_graphs, counts = serve_with_a_stale_block(model, graph_pool, graphs)
    # THEN every step went through the static buffers, and each read of the free block (one
    # per layer and step) is one use_after_free finding naming the request, as the eager
    # steps report it
    assert graphs.num_forwards == 6 and graphs.num_mixed == 3
    stale = [f for f in through_graphs if f[0] == "use_after_free"]
    layers = model.config.num_layers
    assert len(through_graphs) == len(stale) == 2 * layers
    assert {(f[2], f[3]) for f in stale} == {(stale[0][2], "r0")}
    assert sorted(through_graphs) == sorted(eager)
    # AND a step's findings are in by the end of the next step, or of its own when it samples
    assert counts[2] == layers and counts[3] == 2 * layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("guard", [False, True], ids=["plain", "guard"])
def test_captured_graphs_replay_the_eager_tokens_on_cuda(pools: list, guard: bool) -> None:
    # GIVEN the tiny model in fp16 on the GPU, with step graphs captured for 4 sequences (on a
    # guard-mode pool or not)
    model = tiny_model(0).to(device="cuda", dtype=torch.float16).fuse()
    eager_pool, graph_pool = make_pool(model, 96, guard), make_pool(model, 96, guard)
    pools += [eager_pool, graph_pool]
    graphs = StepGraphs(model, graph_pool, max_seqs=4, max_len=40, max_tokens=256, max_chunk=8)
    # WHEN both engines serve the same requests
    eager = serve(model, eager_pool, None)
    through_graphs = serve(model, graph_pool, graphs)
    # THEN the replays, decode and mixed steps alike, produced the eager engine's tokens
    assert graphs.num_replays == graphs.num_forwards > 10 and graphs.num_mixed > 5
    assert through_graphs == eager
    assert graph_pool.findings() == eager_pool.findings() == []


def test_the_error_copy_hands_the_audit_the_answer_that_came_back_with_it() -> None:
    # GIVEN a step's readback: one buffer holding its error buffer, then the block-table
    # audit's answer (4 int64 from an int64 boundary), and an audit that records what it is
    # handed
    from kvscope import kernels

    errors = kernels.new_error_buffer()
    n = errors.numel()
    at = n + (n & 1)
    buffer = torch.zeros(at + 8, dtype=torch.int32)
    buffer[:n].copy_(errors)
    buffer[at:].view(torch.int64).copy_(torch.tensor([2, 12, 5, 1]))
    handed: list[tuple[int, list[int]]] = []
    audit = SimpleNamespace(answered=lambda token, words: handed.append((token, words.tolist())))
    readback = Readback(buffer, n, at)
    readback.audit = audit
    copy = ErrorCopy(torch.device("cpu"))
    # WHEN a step whose replay's answer has a token is copied back and taken
    step = SimpleNamespace(readback=(readback, 7), guard={"errors": buffer[:n]})
    copy.start(step)  # type: ignore[arg-type]
    taken = copy.take()
    # THEN the audit is handed that token and the 4 words, and the error buffer read: nothing
    assert handed == [(7, [2, 12, 5, 1])] and taken == (step, [])
    # AND a step with no answer to take (token 0) hands nothing
    quiet = SimpleNamespace(readback=(readback, 0), guard={"errors": buffer[:n]})
    copy.start(quiet)  # type: ignore[arg-type]
    assert copy.take(copied=True) == (quiet, []) and len(handed) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_steps_carry_the_audits_buffers_in_their_own_copies(pools: list) -> None:
    # GIVEN the tiny model on the GPU and step graphs captured over a guard-mode pool
    from kvscope.allocator import faults

    model = tiny_model(0).to(device="cuda", dtype=torch.float16).fuse()
    pool = make_pool(model, 96, guard=True)
    pools.append(pool)
    graphs = StepGraphs(model, pool, max_seqs=4, max_len=40, max_tokens=256, max_chunk=8)
    # THEN the audit's expected table is part of the int32 transfer (after the chunk starts),
    # and its answer part of the readback, after the error buffer
    readback, audit = graphs.readback, graphs.audit
    assert readback is not None and audit is not None and readback.audit is audit
    base = readback.buffer.data_ptr()
    assert graphs.guard["errors"].data_ptr() == base and readback.answer_at >= readback.errors
    assert audit.answer.data_ptr() == base + 4 * readback.answer_at
    assert audit.expected.data_ptr() == graphs.dev32.data_ptr() + 4 * graphs.n32
    # WHEN requests are served with stale-padding-row armed (a shorter step keeps the padding
    # rows of the one before), counting the answers handed over by the engine's readback
    taken = []
    answered = audit.answered

    def answer(token: int, words: Any) -> list:
        pending = audit.replaying is not None
        found = answered(token, words)
        taken.append(pending and audit.replaying is None)
        return found

    audit.answered = answer
    faults.configure("stale-padding-row:1")
    try:
        serve(model, pool, graphs)
    finally:
        faults.configure(None)
    # THEN the replay that read it is one block_table_mismatch about a padding row, the
    # replays' answers came back with their error buffers, the last one's too (nothing left
    # for the audit to copy back itself)
    assert graphs.num_replays == graphs.num_forwards > 10
    found = [f for f in pool.findings() if f.kind == "block_table_mismatch"]
    assert len(found) == 1 and "padding row" in found[0].message, found
    assert any(taken) and audit.replaying is None


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
