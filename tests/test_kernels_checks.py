"""The probes' block-check kernel (kernels/checks.py) answers as the torch ops it replaces, bit
for bit: digests, poison counts per slot, canary flags, and the poison it writes (alone, or
after the canary flags: CANARY_POISON)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.allocator import integrity
from kvscope.kernels import checks
from kvscope.kernels.digest import int_view, raw_digests
from kvscope.kernels.guard import guard_flags
from tests.kernels_cases import (
    HAS_CUDA,
    TRITON_TARGETS,
    random_pool,
    slot_digests,
    use_torch,
    use_triton_on,
)

CASES = [
    pytest.param(2, 8, 2, 16, torch.float32, 9, id="L2-bs8-H2x16-fp32-guard"),
    pytest.param(1, 16, 4, 64, torch.float16, 17, id="L1-bs16-H4x64-fp16-guard"),
    pytest.param(3, 5, 1, 8, torch.bfloat16, 5, id="L3-bs5-H1x8-bf16"),
    pytest.param(1, 80, 1, 4, torch.float16, 81, id="L1-bs80-H1x4-fp16-guard"),
    pytest.param(2, 4, 2, 8, torch.float8_e4m3fn, 5, id="L2-bs4-H2x8-fp8-guard"),
]


@pytest.mark.parametrize("layers,block_size,heads,dim,dtype,slots", CASES)
@pytest.mark.parametrize("target", TRITON_TARGETS)
def test_each_check_answers_as_the_torch_ops(
    monkeypatch, target, layers, block_size, heads, dim, dtype, slots
):
    # GIVEN a pool whose blocks 3 and 5 are poisoned, then written into: one element of block
    # 5's slot 2 in the last layer's V, and (guard mode) the guard slot of block 0
    kv = random_pool(layers, block_size, heads, dim, dtype, slots, target)
    use_triton_on(monkeypatch, target)
    checks.run_check(kv, [3, 5], checks.POISON, block_size)
    kv[layers - 1, 1, 5, 2, heads - 1, dim - 1] = 1.0
    if slots > block_size:
        kv[0, 1, 0, block_size, 0, dim - 1] = 0.0
    ids = [5, 0, 3, 3]
    # WHEN each check runs through the kernel, and as the torch ops on the same bytes
    digest = checks.run_check(kv, ids, checks.DIGEST, block_size)
    counts = checks.run_check(kv, ids, checks.COUNTS, block_size).reshape(len(ids), block_size)
    flags = checks.run_check(kv, ids, checks.CANARY, block_size) if slots > block_size else None
    use_torch(monkeypatch)
    cpu = kv.cpu()
    # THEN they agree
    assert digest.tolist() == raw_digests(cpu, ids, block_size).tolist()
    unpoisoned = integrity.unpoisoned_counts(cpu, np.asarray(ids), block_size)
    assert counts.sum(1).tolist() == unpoisoned.tolist()
    blank = (int_view(cpu)[:, :, ids, :block_size] != checks.poison_bits(cpu.dtype)).sum(
        (0, 1, 4, 5)
    ) == 0
    assert (counts == 0).tolist() == blank.tolist()
    assert counts[0].tolist() == [1 if s == 2 else 0 for s in range(block_size)]
    if flags is not None:
        assert flags.tolist() == guard_flags(cpu, ids).tolist() == [0, 1, 0, 0]


@pytest.mark.parametrize("layers,block_size,heads,dim,dtype,slots", CASES)
@pytest.mark.parametrize("target", TRITON_TARGETS)
def test_the_slots_check_answers_each_slots_own_digest(
    monkeypatch, target, layers, block_size, heads, dim, dtype, slots
):
    # GIVEN a pool of random K/V, one element of block 5's slot 1 changed afterwards
    kv = random_pool(layers, block_size, heads, dim, dtype, slots, target)
    use_triton_on(monkeypatch, target)
    ids = [5, 0, 3]
    before = checks.run_check(kv, ids, checks.SLOTS, block_size).reshape(3, block_size)
    kv[layers - 1, 0, 5, 1, 0, 0] = 2.0 if kv[layers - 1, 0, 5, 1, 0, 0] != 2.0 else 3.0
    # WHEN the kernel's SLOTS mode answers
    after = checks.run_check(kv, ids, checks.SLOTS, block_size).reshape(3, block_size)
    # THEN each word is that slot's own digest, and only the changed slot's moved
    assert after.tolist() == slot_digests(kv.cpu(), ids, block_size)
    moved = (before != after).nonzero().tolist()
    assert moved == [[0, 1]]
    # AND DIGEST_SLOTS answers each block's digest, then its slots', from one launch
    both = checks.run_check(kv, ids, checks.DIGEST_SLOTS, block_size).reshape(3, block_size + 1)
    assert both[:, 0].tolist() == checks.run_check(kv, ids, checks.DIGEST, block_size).tolist()
    assert both[:, 1:].tolist() == after.tolist()


@pytest.mark.parametrize("layers,block_size,heads,dim,dtype,slots", CASES)
@pytest.mark.parametrize("target", TRITON_TARGETS)
def test_the_poison_is_the_torch_poison_and_stays_in_the_token_slots(
    monkeypatch, target, layers, block_size, heads, dim, dtype, slots
):
    kv = random_pool(layers, block_size, heads, dim, dtype, slots, target)
    want = kv.cpu().clone()
    want[:, :, [1, 4], :block_size] = float("nan")  # the torch poison
    # WHEN blocks 1 and 4 are poisoned by the kernel
    use_triton_on(monkeypatch, target)
    checks.run_check(kv, [1, 4], checks.POISON, block_size)
    # THEN every bit equals the torch poison's: token slots NaN, guard slots and others untouched
    assert torch.equal(int_view(kv.cpu()), int_view(want))


@pytest.mark.parametrize(
    "layers,block_size,heads,dim,dtype,slots", [c for c in CASES if c.values[-1] > c.values[1]]
)
@pytest.mark.parametrize("target", TRITON_TARGETS)
def test_canary_poison_answers_canary_and_fills_as_poison_in_one_launch(
    monkeypatch, target, layers, block_size, heads, dim, dtype, slots
):
    # GIVEN a guarded pool of random K/V whose block 4's guard slot lost its canary
    kv = random_pool(layers, block_size, heads, dim, dtype, slots, target)
    kv[0, 1, 4, block_size, 0, dim - 1] = 0.0
    want = kv.cpu().clone()
    want[:, :, [1, 4], :block_size] = float("nan")  # the torch poison
    flags = guard_flags(kv.cpu(), [1, 4]).tolist()
    # WHEN blocks 1 and 4 are checked by the kernel's CANARY_POISON mode
    use_triton_on(monkeypatch, target)
    answer = checks.run_check(kv, [1, 4], checks.CANARY_POISON, block_size)
    # THEN its answer is CANARY's, and every bit is the torch poison's after it: token slots
    # NaN, guard slots (the broken one too) and other blocks untouched
    assert answer.tolist() == flags == [0, 1]
    assert torch.equal(int_view(kv.cpu()), int_view(want))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_on_a_gpu_each_check_launches_through_its_compiled_kernel_with_the_same_answer():
    # GIVEN a CUDA pool and a page-locked ring, the kernel compiled for five modes
    kv = random_pool(2, 8, 2, 16, torch.float16, 9, "cuda")
    ring = torch.zeros(160, dtype=torch.int64).pin_memory()
    fast = checks.Checks(kv, ring, 8)
    fast.warm_up([checks.DIGEST, checks.COUNTS, checks.CANARY, checks.SLOTS, checks.DIGEST_SLOTS])
    # THEN its launches skip Triton's JIT launcher, and its runner: straight to its launcher
    assert set(fast._compiled) >= {checks.DIGEST, checks.COUNTS, checks.CANARY}
    assert set(fast._direct) == set(fast._compiled)
    # AND answer as the JIT's launches do
    ids = [5, 0, 3]
    ring[:3] = torch.tensor(ids)
    for mode, at in (
        (checks.DIGEST, 4),
        (checks.COUNTS, 8),
        (checks.CANARY, 40),
        (checks.SLOTS, 48),
    ):
        fast.launch(mode, 0, len(ids), at)
    torch.cuda.synchronize()
    assert ring[48:72].tolist() == checks.run_check(kv, ids, checks.SLOTS, 8).tolist()
    assert ring[48:72].reshape(3, 8).tolist() == slot_digests(kv.cpu(), ids, 8)
    fast.launch(checks.DIGEST_SLOTS, 0, len(ids), 80)
    torch.cuda.synchronize()
    both = ring[80:107].reshape(3, 9)
    assert (
        both[:, 0].tolist() == ring[4:7].tolist()
        and both[:, 1:].tolist() == ring[48:72].reshape(3, 8).tolist()
    )
    assert ring[4:7].tolist() == checks.run_check(kv, ids, checks.DIGEST, 8).tolist()
    assert ring[8:32].tolist() == checks.run_check(kv, ids, checks.COUNTS, 8).tolist()
    assert ring[40:43].tolist() == checks.run_check(kv, ids, checks.CANARY, 8).tolist()
