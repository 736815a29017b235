"""Block digests (kernels/digest.py): the Triton kernel equals the torch reference bit for bit,
and any change to one element of a block's token slots changes its digest."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import block_digests
from kvscope.kernels.digest import int_view
from tests.kernels_cases import TRITON_TARGETS, random_pool, use_torch, use_triton_on

BACKENDS = [pytest.param("torch", id="torch"), *TRITON_TARGETS]
CASES = [
    pytest.param(2, 8, 2, 16, torch.float32, 9, id="L2-bs8-H2x16-fp32-guard"),
    pytest.param(1, 16, 4, 64, torch.float16, 16, id="L1-bs16-H4x64-fp16"),
    pytest.param(3, 5, 1, 8, torch.bfloat16, 6, id="L3-bs5-H1x8-bf16-guard"),
]


@pytest.mark.parametrize("layers,block_size,heads,dim,dtype,slots", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_digest_matches_the_reference(
    monkeypatch, backend, layers, block_size, heads, dim, dtype, slots
):
    # GIVEN a pool and some of its blocks
    device = "cpu"
    if backend == "torch":
        use_torch(monkeypatch)
    else:
        use_triton_on(monkeypatch, backend)
        device = backend
    kv = random_pool(layers, block_size, heads, dim, dtype, slots, device)
    ids = [5, 0, 3, 3]
    # WHEN digested on this backend and on the reference
    got = block_digests(kv, ids, block_size)
    use_torch(monkeypatch)
    want = block_digests(kv.cpu(), ids, block_size)
    # THEN they agree bit for bit (and equal blocks' digests repeat)
    assert got == want and got[2] == got[3] and len(set(got[:3])) == 3


@pytest.mark.parametrize("layers,block_size,heads,dim,dtype,slots", CASES)
def test_one_changed_element_changes_the_digest_but_the_guard_slot_does_not(
    monkeypatch, layers, block_size, heads, dim, dtype, slots
):
    use_torch(monkeypatch)
    kv = random_pool(layers, block_size, heads, dim, dtype, slots, "cpu")
    before = block_digests(kv, [2], block_size)
    bits = int_view(kv)
    # WHEN one element of a token slot changes (its lowest bit), THEN the digest changes
    for where in [(0, 0, 2, 0, 0, 0), (layers - 1, 1, 2, block_size - 1, heads - 1, dim - 1)]:
        bits[where] ^= 1
        assert block_digests(kv, [2], block_size) != before
        bits[where] ^= 1
    assert block_digests(kv, [2], block_size) == before
    # AND a write into the guard slot (the canary's) leaves it alone
    if slots > block_size:
        kv[:, :, 2, block_size] = 0
        assert block_digests(kv, [2], block_size) == before
