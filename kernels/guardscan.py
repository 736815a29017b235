"""The guard scan's Triton kernel and its launch: one program per block reads the guard slot of
every layer, K and V, and flags the block when an element is not the canary (kernels/guard.py
calls it; kept apart so that filling and checking guard slots on CPU never imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _guard_scan_kernel(
    kv_ptr, blocks_ptr, bad_ptr, num_lk, stride_lk, stride_n, guard_offset,
    CANARY: tl.constexpr, ELEMS: tl.constexpr, LK_TILE: tl.constexpr, ELEM_TILE: tl.constexpr,
    HAS_BLOCKS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blk = pid.to(tl.int64)
    if HAS_BLOCKS:
        blk = tl.load(blocks_ptr + pid).to(tl.int64)
    base = kv_ptr + blk * stride_n + guard_offset
    lk = tl.arange(0, LK_TILE)
    e = tl.arange(0, ELEM_TILE)
    bad = tl.zeros([LK_TILE, ELEM_TILE], tl.int32)
    for l0 in range(0, num_lk, LK_TILE):
        rows = l0 + lk
        for e0 in range(0, ELEMS, ELEM_TILE):
            mask = (rows[:, None] < num_lk) & ((e0 + e)[None, :] < ELEMS)
            ptrs = base + rows.to(tl.int64)[:, None] * stride_lk + (e0 + e)[None, :]
            bits = tl.load(ptrs, mask=mask, other=CANARY)
            bad = bad | (bits != CANARY).to(tl.int32)
    tl.store(bad_ptr + pid, tl.max(tl.max(bad, 1), 0))


def scan_triton(
    kv_cache: torch.Tensor, ids: torch.Tensor | None, int_dtype: torch.dtype, canary: int
) -> torch.Tensor:
    """The kernel's flags, one per block of `ids` (all blocks when None): the guard slots read
    through `int_dtype`, compared with `canary` as that type loads it."""
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, "[layers, 2, blocks, slots, heads, dim]"
    layers, _, num_blocks, slots, heads, head_dim = kv_cache.shape
    assert kv_cache.stride(4) == head_dim and kv_cache.stride(5) == 1
    assert kv_cache.stride(0) == 2 * kv_cache.stride(1), "layer and K/V dims must merge"
    ints = kv_cache.view(int_dtype)
    count = num_blocks if ids is None else ids.numel()
    bad = torch.empty(count, dtype=torch.int32, device=kv_cache.device)
    if count == 0:
        return bad
    elems = heads * head_dim
    _guard_scan_kernel[(count,)](
        ints, ids if ids is not None else bad, bad, layers * 2,
        ints.stride(1), ints.stride(2), (slots - 1) * ints.stride(3),
        CANARY=canary, ELEMS=elems, LK_TILE=min(16, triton.next_power_of_2(layers * 2)),
        ELEM_TILE=min(1024, triton.next_power_of_2(elems)), HAS_BLOCKS=ids is not None,
        num_warps=4,
    )  # fmt: skip
    return bad
