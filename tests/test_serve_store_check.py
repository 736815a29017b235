"""The example engine's store check (examples/server/batch.py `check_writes`): under the probes a
step that would store into the prefix blocks its request hit names that request at the check's
line, and a served workload with shared prefixes, forks and preemption has no finding. In guard
mode with slot provenance the same call sweeps the step's sequences on its schedule (`sweeps`),
and once more as a request finishes (Engine._finish), which finds a foreign slot in a running
request's block before the request is freed."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from server.batch import Batch, sweeps  # noqa: E402
from server.checkpoint import tiny_model  # noqa: E402
from server.engine import Engine  # noqa: E402
from server.workload import Request, WorkloadSpec, generate_workload  # noqa: E402

from kvscope.allocator import faults  # noqa: E402


def probed_pool(make_pool, model, num_blocks: int, **config):
    c = model.config
    pool = make_pool(
        num_blocks, block_size=8, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, dtype=model.lm_head.weight.dtype, max_seqs=64, **config,
    )  # fmt: skip
    assert pool.probe is not None
    return pool


def test_a_step_storing_the_prefix_its_request_hit_names_the_request(make_pool, probes):
    # GIVEN a probed pool where request "first" published a 16-token prefix
    model = tiny_model(0)
    pool = probed_pool(make_pool, model, 32)
    prompt = list(range(1, 21))
    first = pool.allocate("first", prompt)
    pool.mark_computed(first, 20)
    hitter = pool.allocate("hitter", prompt)
    assert hitter.num_cached_tokens == 16
    # WHEN the engine's step would compute the hitter's whole prompt (start 0, not 16)
    stream = type("S", (), {"seq": hitter, "name": "hitter"})()
    chunk = type("C", (), {"stream": stream, "start": 0, "length": 20})()
    Batch([chunk], pool, "cpu").check_writes()
    # THEN each shared block is a finding naming the hitter, at the check's line in batch.py
    line = inspect.getsource(Batch).splitlines()
    at = next(i for i, text in enumerate(line) if "Writers(self.cache, spans)" in text)
    where = f"batch.py:{inspect.getsourcelines(Batch)[1] + at} check_writes"
    found = [f for f in pool.findings() if f.kind == "published_block_modified"]
    assert sorted(f.block for f in found) == sorted(first.block_table[:2])
    assert all(f.request == "hitter" and where in f.message for f in found), found


@pytest.mark.slow
def test_a_served_workload_with_the_store_check_has_no_finding(make_pool, probes, one_torch_thread):
    # GIVEN a probed pool too small for the workload: prefix hits, evictions, preemption, forks
    model = tiny_model(0)
    pool = probed_pool(make_pool, model, 24)
    spec = WorkloadSpec(num_requests=40, rate=0, seed=1, prompt_len=(8, 40), output_len=(2, 8))
    requests = generate_workload(spec, vocab_size=256)
    # WHEN served (every step's stores checked)
    results = Engine(model, pool).run(requests)
    # THEN every request is served and nothing is reported
    assert not [r.error for r in results if r.error]
    assert pool.stats()["prefix_hits"] > 0
    assert [f for f in pool.findings()] == [] and pool.check() == []


def test_a_decode_is_swept_where_it_starts_a_power_of_two_block():
    # block 0, 1, 2, 4, 8 (positions 0, 8, 16, 32, 64 of blocks of 8): not 3, 5, 6 or 7, nor
    # a position inside a block
    assert [p for p in range(80) if sweeps(p, 8)] == [0, 8, 16, 32, 64]


def test_a_foreign_slot_in_a_running_requests_block_is_found_before_it_is_freed(
    make_pool, probes, one_torch_thread
):
    # GIVEN a guard-mode pool recording every sequence's slot provenance, and the foreign-slot
    # fault armed: the first decode's write also lands in another running request's published
    # block
    model = tiny_model(0)
    pool = probed_pool(make_pool, model, 32, guard=True)
    pool.provenance_sample = 1
    faults.configure("foreign-slot:1")
    # (two requests of 20-token prompts, no prefix in common, ending before position 32: past
    # their prompts each decode starts only block 3, so only the sweep as each one finishes
    # reads the struck block again, and no prefix hit does)
    requests = [Request(f"r{i}", [i + 1] * 20, 10) for i in range(2)]
    # WHEN they are served
    results = Engine(model, pool).run(requests)
    # THEN the fault fired, and the sweep found the struck slot: one foreign_slot, naming one
    # of them as the reader
    assert not [r.error for r in results if r.error]
    assert "foreign-slot" in faults.FIRED
    found = [f for f in pool.findings() if f.kind == "foreign_slot"]
    assert len(found) == 1 and found[0].request in ("r0", "r1"), found
