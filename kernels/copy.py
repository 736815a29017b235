"""Block copy: copy whole blocks, every layer, K and V (copy-on-write and compaction).

`kv_cache` is the whole pool `[layers, 2, blocks, slots, kv_heads, head_dim]`. Pairs run in
parallel, so a destination must not also be a source in the same call.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import backend, reference
from .errors import error_capacity


@triton.jit
def _copy_blocks_kernel(
    kv_ptr, src_ptr, dst_ptr, state_ptr, errors_ptr, num_blocks, error_capacity,
    stride_lk, stride_n, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
    GUARD: tl.constexpr, HAS_STATE: tl.constexpr, HAS_ERRORS: tl.constexpr,
):  # fmt: skip
    pair = tl.program_id(0)
    lk = tl.program_id(1)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    if GUARD:
        ends = tl.arange(0, 2)
        blk = tl.where(ends == 0, src, dst)
        in_range = (blk >= 0) & (blk < num_blocks)
        kind = tl.where(in_range, 0, 1)
        if HAS_STATE:
            allocated = tl.load(state_ptr + blk, mask=in_range, other=1) != 0
            kind = tl.where(in_range & (allocated == 0), 2, kind)
        if HAS_ERRORS:
            rec = (kind != 0) & ((ends * 0 + lk) == 0)
            idx = tl.atomic_add(errors_ptr + ends * 0, ends * 0 + 1, mask=rec)
            keep = rec & (idx < error_capacity)
            rec_ptr = errors_ptr + 2 + idx * 5
            tl.store(rec_ptr, ends * 0 + pair, mask=keep)
            tl.store(rec_ptr + 1, ends * 0 - 1, mask=keep)
            tl.store(rec_ptr + 2, blk.to(tl.int32), mask=keep)
            tl.store(rec_ptr + 3, ends * 0 - 1, mask=keep)
            tl.store(rec_ptr + 4, kind, mask=keep)
        if tl.max(kind, 0) != 0:
            return
    base = kv_ptr + lk.to(tl.int64) * stride_lk
    src_base = base + src * stride_n
    dst_base = base + dst * stride_n
    for i in range(0, BLOCK_NUMEL, CHUNK):
        offs = i + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(dst_base + offs, tl.load(src_base + offs, mask=mask), mask=mask)


def _block_ids(ids: Any, name: str) -> torch.Tensor:
    """Block ids as a tensor: a tensor as it is, a list, tuple or numpy array of ints as int64
    on the host (append's copy-on-write pairs come as lists)."""
    if isinstance(ids, torch.Tensor):
        return ids
    try:
        out = torch.as_tensor(ids, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError):
        out = None
    if out is None or out.dim() != 1:
        raise TypeError(f"copy_blocks: {name} must be a 1-D tensor or a sequence of block ids")
    return out


def copy_blocks(
    kv_cache: torch.Tensor,
    src: Any,
    dst: Any,
    *,
    block_state: torch.Tensor | None = None,
    errors: torch.Tensor | None = None,
    pool: Any = None,
) -> None:
    """Copy block src[i] to dst[i] in every layer, K and V, of the pool tensor.

    `pool` (the `KVPool` whose copy-on-write pairs these are) is told of the copies
    (`pool.copied(src, dst)`): while it records its operations, the log holds them, and a
    replay copies its K/V as the program did (docs/REPLAY.md). Pass `src` and `dst` on the host
    (the kernel uploads them): a CUDA tensor is read back while the pool records. `src` and
    `dst` are tensors or sequences of ints (lists, as append's pairs come)."""
    if pool is not None:
        pool.copied(src, dst)
    src, dst = _block_ids(src, "src"), _block_ids(dst, "dst")
    if not backend.use_triton(kv_cache):
        reference.copy_blocks_ref(kv_cache, src, dst, block_state=block_state, errors=errors)
        return
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, "[layers, 2, blocks, slots, heads, dim]"
    assert src.shape == dst.shape and src.dim() == 1
    layers, _, num_blocks, slots, heads, head_dim = kv_cache.shape
    # a block's [slots, heads, dim] must be contiguous and (layer, K/V) must merge
    assert kv_cache.stride(3) == heads * head_dim and kv_cache.stride(4) == head_dim
    assert kv_cache.stride(5) == 1 and kv_cache.stride(0) == 2 * kv_cache.stride(1)
    if src.numel() == 0:
        return
    if src.device.type == "cpu" and dst.device.type == "cpu" and src.dtype == dst.dtype:
        # (host pairs, as a pool's append returns them: uploaded in one copy)
        both = torch.stack((src, dst)).to(device=kv_cache.device, dtype=torch.int32)
        src, dst = both[0], both[1]
    else:
        src = src.to(device=kv_cache.device, dtype=torch.int32).contiguous()
        dst = dst.to(device=kv_cache.device, dtype=torch.int32).contiguous()
    numel = slots * heads * head_dim
    # copy bits, not values: fp8 and canary NaNs must survive unchanged
    bits = kv_cache.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[kv_cache.element_size()])
    _copy_blocks_kernel[(src.shape[0], layers * 2)](
        bits, src, dst,
        block_state.view(torch.uint8) if block_state is not None else src,
        errors if errors is not None else src, num_blocks,
        error_capacity(errors) if errors is not None else 0,
        kv_cache.stride(1), kv_cache.stride(2),
        BLOCK_NUMEL=numel, CHUNK=min(4096, triton.next_power_of_2(numel)),
        GUARD=block_state is not None or errors is not None,
        HAS_STATE=block_state is not None, HAS_ERRORS=errors is not None, num_warps=4,
    )  # fmt: skip
