"""KV store: write the new tokens' K and V into their cache slots from a slot mapping.

`slot = physical_block * slots_per_block + offset`; `-1` skips the token. One program per
token writes all its heads; fp8 caches store value / scale.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import backend, reference
from .common import FP8_DTYPES, is_fp8, scale_tensor
from .errors import error_capacity


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_ptr, v_ptr, slots_ptr, state_ptr, errors_ptr,
    k_scale_ptr, v_scale_ptr, num_blocks, error_capacity,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cn, stride_cs, stride_ch, stride_dn, stride_ds, stride_dh,
    SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
    GUARD: tl.constexpr, HAS_STATE: tl.constexpr, HAS_ERRORS: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    # a [1] vector rather than a scalar: the CPU interpreter mishandles scalar masks
    slot = tl.load(slots_ptr + t + tl.zeros([1], tl.int32)).to(tl.int64)
    write = slot != -1
    # floor division, as the reference does, so negative slots name the same block
    blk = tl.where(slot < 0, (slot - SLOTS + 1) // SLOTS, slot // SLOTS)
    off = slot - blk * SLOTS
    ok = write
    if GUARD:
        in_range = (slot >= 0) & (blk < num_blocks)
        kind = tl.where(in_range, 0, 1)
        if HAS_STATE:
            allocated = tl.load(state_ptr + blk, mask=in_range, other=1) != 0
            kind = tl.where(in_range & (allocated == 0), 2, kind)
        kind = tl.where((kind == 0) & (off >= BLOCK_SIZE), 3, kind)
        kind = tl.where(write, kind, 0)
        ok = write & (kind == 0)
        if HAS_ERRORS:
            rec = kind != 0
            idx = tl.atomic_add(errors_ptr + tl.zeros([1], tl.int32), 1, mask=rec)
            keep = rec & (idx < error_capacity)
            rec_ptr = errors_ptr + 2 + idx * 5
            tl.store(rec_ptr, t + tl.zeros([1], tl.int32), mask=keep)
            tl.store(rec_ptr + 1, tl.full([1], -1, tl.int32), mask=keep)
            tl.store(rec_ptr + 2, blk.to(tl.int32), mask=keep)
            tl.store(rec_ptr + 3, off.to(tl.int32), mask=keep)
            tl.store(rec_ptr + 4, kind, mask=keep)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = (h < HEADS) & (d < HEAD_DIM) & ok
    t64 = t.to(tl.int64)
    key = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d, mask=mask)
    value = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d, mask=mask)
    if KV_FP8:
        key = tl.clamp(key.to(tl.float32) / tl.load(k_scale_ptr), -FP8_MAX, FP8_MAX)
        value = tl.clamp(value.to(tl.float32) / tl.load(v_scale_ptr), -FP8_MAX, FP8_MAX)
    k_dst = k_ptr + blk * stride_cn + off * stride_cs + h * stride_ch + d
    v_dst = v_ptr + blk * stride_dn + off * stride_ds + h * stride_dh + d
    tl.store(k_dst, key.to(k_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, value.to(v_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    block_size: int | None = None,
    block_state: torch.Tensor | None = None,
    errors: torch.Tensor | None = None,
    writers: Any = None,
) -> None:
    """Write key/value [tokens, kv_heads, head_dim] into the caches at `slot_mapping` [tokens].

    `writers` (a `kvscope.probes.stores.Writers`: the requests whose positions these tokens
    are) has the pool's probes check where the store lands, once per slot mapping."""
    if writers is not None:
        writers.check(slot_mapping)
    if not backend.use_triton(key):
        reference.store_kv_ref(
            key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale,
            block_size=block_size, block_state=block_state, errors=errors,
        )  # fmt: skip
        return
    num_blocks, slots, heads, head_dim = k_cache.shape
    assert key.shape == value.shape and key.shape[1:] == (heads, head_dim)
    assert slot_mapping.shape == key.shape[:1] and slot_mapping.is_contiguous()
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert head_dim & (head_dim - 1) == 0 and v_cache.shape == k_cache.shape
    bs = slots if block_size is None else int(block_size)
    fp8 = is_fp8(k_cache.dtype)
    guard = block_state is not None or errors is not None
    dev = key.device
    ks = scale_tensor(k_scale, dev) if fp8 else key
    vs = scale_tensor(v_scale, dev) if fp8 else key
    if key.shape[0] == 0:
        return
    _store_kv_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        block_state.view(torch.uint8) if block_state is not None else slot_mapping,
        errors if errors is not None else slot_mapping, ks, vs,
        num_blocks, error_capacity(errors) if errors is not None else 0,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        SLOTS=slots, BLOCK_SIZE=bs, HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads),
        HEAD_DIM=head_dim, KV_FP8=fp8,
        FP8_MAX=float(torch.finfo(k_cache.dtype).max) if k_cache.dtype in FP8_DTYPES else 0.0,
        GUARD=guard, HAS_STATE=block_state is not None, HAS_ERRORS=errors is not None,
        num_warps=4,
    )  # fmt: skip
