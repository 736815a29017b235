"""Guard slots: the canary, `fill_guard` to write it and `guard_scan` to check it in one pass
(`guard_flags`: the same check, its answer left on the device).

In guard mode `slots_per_block = block_size + 1` and the last slot of every block, in every
layer, K and V, holds the canary: every element's bits equal `CANARY_BITS[element_size]`, read
through the integer type of the same width (`canary_dtype`):

- 2-byte caches (bf16, fp16): `0x7FA5` - a NaN in both bf16 and fp16;
- 1-byte caches (fp8 e4m3fn): `0x7F` - e4m3fn's NaN;
- 4-byte caches (fp32): `0x7FA57FA5` - a NaN.

A NaN canary makes an attention read that strays into a guard slot poison its output loudly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import backend, reference

CANARY_BITS = {1: 0x7F, 2: 0x7FA5, 4: 0x7FA5_7FA5}
CANARY_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def canary_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype through which the guard slots of a `dtype` cache are read."""
    return CANARY_DTYPES[torch.empty((), dtype=dtype).element_size()]


def canary_value(dtype: torch.dtype) -> int:
    """The canary bit pattern for a cache of `dtype`, as an integer of `canary_dtype(dtype)`."""
    return CANARY_BITS[torch.empty((), dtype=dtype).element_size()]


def canary_loaded(dtype: torch.dtype) -> int:
    """The canary as a kernel reading the guard slots through `canary_dtype` loads it (int16
    and int32 are signed: a constant at or above the sign bit must be given as negative)."""
    width = torch.empty((), dtype=dtype).element_size()
    value = CANARY_BITS[width]
    if width > 1 and value >= 1 << (8 * width - 1):
        value -= 1 << (8 * width)
    return value


def fill_guard(kv_cache: torch.Tensor, blocks: torch.Tensor | list[int] | None = None) -> None:
    """Write the canary into the last slot of the given blocks (all blocks when None)."""
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, "[layers, 2, blocks, slots, heads, dim]"
    ints = kv_cache.view(canary_dtype(kv_cache.dtype))
    value = canary_value(kv_cache.dtype)
    with backend.serial_cpu(kv_cache):
        if blocks is None:
            ints[:, :, :, -1] = value
        else:
            # index_fill_ on the guard slots' view: an assignment through an index tensor
            # uploads the value from the host, which waits for the GPU
            ints[:, :, :, -1].index_fill_(2, backend.block_ids(blocks, kv_cache.device), value)


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


def guard_scan(kv_cache: torch.Tensor, blocks: torch.Tensor | list[int] | None = None) -> list[int]:
    """Ids of blocks (all, or only `blocks`) whose guard slot no longer holds the canary."""
    int_dtype = canary_dtype(kv_cache.dtype)
    canary = canary_value(kv_cache.dtype)
    if not backend.use_triton(kv_cache):
        ids = None if blocks is None else backend.block_ids(blocks, torch.device("cpu"))
        with backend.serial_cpu(kv_cache):
            return reference.guard_scan_ref(kv_cache, canary, int_dtype, ids)
    ids = None if blocks is None else backend.block_ids(blocks, kv_cache.device)
    bad = _scan_triton(kv_cache, ids)
    hits = bad.nonzero(as_tuple=True)[0]
    found = hits if ids is None else ids[hits]
    return sorted(found.tolist())


def guard_flags(kv_cache: torch.Tensor, blocks: torch.Tensor | list[int]) -> torch.Tensor:
    """int32 [len(blocks)] on the cache's device, nonzero where the block's guard slot no longer
    holds the canary; launched, not waited for (read it when the answer is needed)."""
    ids = backend.block_ids(blocks, kv_cache.device)
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.int32, device=kv_cache.device)
    if not backend.use_triton(kv_cache):
        ints = kv_cache.view(canary_dtype(kv_cache.dtype))
        with backend.serial_cpu(kv_cache):
            guard = ints[:, :, ids, -1]  # [L, 2, n, H, D]
            bad = (guard != canary_value(kv_cache.dtype)).flatten(3).any(-1).any(0).any(0)
            return bad.to(torch.int32)
    return _scan_triton(kv_cache, ids)


def _scan_triton(kv_cache: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """The scan kernel's flags, one per block of `ids` (all blocks when None)."""
    int_dtype = canary_dtype(kv_cache.dtype)
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
        CANARY=canary_loaded(kv_cache.dtype), ELEMS=elems, LK_TILE=min(16, triton.next_power_of_2(layers * 2)),
        ELEM_TILE=min(1024, triton.next_power_of_2(elems)), HAS_BLOCKS=ids is not None,
        num_warps=4,
    )  # fmt: skip
    return bad
