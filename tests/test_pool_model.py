"""Property test: random pool operations against a plain-Python model, invariants after every step.

The model knows each live sequence's tokens. After every step: check() is clean, blocks are
conserved, refcounts equal the references, and the KV bytes read through every block table
equal what the model wrote — so prefix sharing and copy-on-write can never hand a sequence
another prompt's KV.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvscope.allocator import KVPool, PoolConfig, PoolExhausted
from kvscope.allocator.segment import data_path, segment_path

BS = 4
NUM_BLOCKS = 24
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 1], [1, 2, 3, 4, 7]]


def kv_values(tokens: list[int]) -> list[float]:
    """A value per position that depends on the whole prefix, like real KV does."""
    out, v = [], 0
    for t in tokens:
        v = (v * 31 + t + 1) % 65521
        out.append(float(v))
    return out


class PoolModel(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    extra_config: dict = {}

    def __init__(self):
        super().__init__()
        self.name = f"model-{uuid.uuid4().hex[:8]}"
        self.pool = KVPool.create(
            self.name,
            PoolConfig(
                num_blocks=NUM_BLOCKS,
                block_size=BS,
                num_layers=1,
                num_kv_heads=1,
                head_dim=1,
                dtype="float32",
                local_cache_size=2,
                **self.extra_config,
            ),
        )
        self.live: dict[int, object] = {}
        self.n = 0

    def teardown(self):
        self.pool.close()
        for p in (segment_path(self.name), data_path(self.name)):
            if os.path.exists(p):
                os.unlink(p)

    # -- helpers --------------------------------------------------------------------------

    def _write_kv(self, seq, start: int) -> None:
        vals = kv_values(seq.tokens)
        kv = self.pool.kv
        for p in range(start, seq.num_tokens):
            kv[0, 0, seq.block_table[p // BS], p % BS, 0, 0] = vals[p]
        self.pool.mark_computed(seq, seq.num_tokens)

    def _copy(self, copies) -> None:
        for src, dst in copies:
            self.pool.kv[:, :, dst] = self.pool.kv[:, :, src]

    def _must_fit(self, extra_blocks: int) -> bool:
        """True when the request fits even if nothing evictable helped."""
        held = set()
        for s in self.live.values():
            if s.state == "running":
                held.update(s.block_table)
        return len(held) + extra_blocks <= NUM_BLOCKS

    # -- rules ----------------------------------------------------------------------------

    @rule(
        target=seqs, prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 20), max_size=9)
    )
    def allocate(self, prefix, tail):
        tokens = prefix + tail
        self.n += 1
        try:
            seq = self.pool.allocate(f"r{self.n}", tokens)
        except PoolExhausted:
            assert not self._must_fit(-(-len(tokens) // BS)), "exhausted while blocks were free"
            return None
        assert seq.num_blocks == -(-len(tokens) // BS)
        assert seq.num_cached_tokens % BS == 0 and seq.num_cached_tokens < len(tokens)
        self._write_kv(seq, seq.num_cached_tokens)
        self.live[id(seq)] = seq
        return seq

    @rule(seq=seqs, tokens=st.lists(st.integers(0, 20), min_size=1, max_size=6))
    def append(self, seq, tokens):
        if seq is None or id(seq) not in self.live or seq.state != "running":
            return
        start = seq.num_tokens
        try:
            copies = self.pool.append(seq, tokens)
        except PoolExhausted:
            assert seq.num_tokens == start
            return
        self._copy(copies)
        self._write_kv(seq, start)

    @rule(target=seqs, seq=seqs)
    def fork(self, seq):
        if seq is None or id(seq) not in self.live or seq.state != "running":
            return None
        self.n += 1
        child = self.pool.fork(seq, f"f{self.n}")
        self.live[id(child)] = child
        return child

    @rule(seq=consumes(seqs), abort=st.booleans())
    def end(self, seq, abort):
        if seq is None or id(seq) not in self.live:
            return
        del self.live[id(seq)]
        if seq.state == "preempted":
            self.pool.free(seq)
        elif abort:
            self.pool.abort(seq)
        else:
            self.pool.free(seq)

    @rule(seq=seqs, waiting=st.booleans())
    def set_state(self, seq, waiting):
        if seq is None or id(seq) not in self.live:
            return
        if seq.state == "preempted":
            try:
                self.pool.resume(seq)
            except PoolExhausted:
                return
            self._write_kv(seq, seq.num_cached_tokens)
        else:
            self.pool.set_state(seq, "waiting" if waiting else "running")

    @rule(n=st.integers(1, 8))
    def evict(self, n):
        before = self.pool.stats()["num_cached"]
        got = self.pool.evict(n)
        assert got == min(n, before)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self):
        assert self.pool.check() == []
        st_ = self.pool.stats()
        total = st_["num_free"] + st_["num_local"] + st_["num_cached"] + st_["num_allocated"]
        total += st_["num_quarantined"]
        assert total == NUM_BLOCKS
        refs = np.zeros(NUM_BLOCKS, int)
        for s in self.live.values():
            for b in s.block_table:
                refs[b] += 1
        rc = self.pool.view.blocks["refcount"]
        held = refs > 0
        assert (rc[held] == refs[held]).all()

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        kv = self.pool.kv
        for s in self.live.values():
            if s.state == "preempted":
                assert s.block_table == []
                continue
            vals = kv_values(s.tokens)
            got = [
                float(kv[0, 0, s.block_table[p // BS], p % BS, 0, 0]) for p in range(s.num_tokens)
            ]
            assert got == vals, f"{s.request_id} reads KV that is not its own"


PoolModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVSCOPE_HYPOTHESIS_EXAMPLES", "60")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPoolModel = PoolModel.TestCase


class GuardedPoolModel(PoolModel):
    """The same model on a guard-mode pool: guard slots, poisoning, a 3-allocation quarantine."""

    extra_config = {"guard": True, "quarantine": 3}


GuardedPoolModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("KVSCOPE_HYPOTHESIS_EXAMPLES", "60")) // 2,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestGuardedPoolModel = GuardedPoolModel.TestCase
