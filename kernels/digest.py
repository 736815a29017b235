"""Block digests: one 64-bit hash of each block's K/V, to prove a published block never changes.

The digest of block b covers its token slots `[0, block_size)` in every layer, K and V (not the
guard slot: that is the canary's). Each element is read as the integer of its width (the bits,
sign-extended to int64), multiplied by a coefficient of its position in the block and summed
modulo 2^64:

    raw = sum_i bits[i] * coef(i),   coef(i) = (i * DIGEST_MUL + DIGEST_ADD) | 1   (mod 2^64)

with `i` the element's index in `kv[:, :, b, :block_size]` flattened. Every coefficient is odd,
so changing any one element always changes the sum; `block_digests` returns `fmix64(raw)`.
Wrapping int64 arithmetic gives the same bits in torch and in Triton, so the CUDA kernel and the
CPU reference agree exactly (tests/test_kernels_digest.py).

`fmix64` is MurmurHash3's 64-bit finalizer with 0 reserved for "none" (0 maps to 1): the Triton
one here, the allocator's (allocator/prefix.py fmix64, numpy) and the C core's (csrc/core.h)
agree bit for bit (tests/test_hash_finalizer.py); `fmix64_reference` is the Triton one's torch
reference, for the torch backend (the kernels import nothing of the allocator).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import backend

# Both below 2^63, so they are plain int64 constants in torch and in Triton.
DIGEST_MUL = 0x5851_F42D_4C95_7F2D
DIGEST_ADD = 0x1405_7B7E_F767_814F
_MASK64 = (1 << 64) - 1
_INT_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The reference works on at most this many elements at once (blocks are chunked).
_REF_ELEMS = 1 << 22


def int_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache's bits as the integer type of the same width."""
    return kv_cache.view(_INT_DTYPES[kv_cache.element_size()])


@triton.jit
def fmix64(h):
    """MurmurHash3's 64-bit finalizer on uint64, never 0 (0 maps to 1)."""
    h ^= h >> 33
    h *= 0xFF51_AFD7_ED55_8CCD
    h ^= h >> 33
    h *= 0xC4CE_B9FE_1A85_EC53
    h ^= h >> 33
    return tl.where(h == 0, 1, h).to(tl.uint64)


def fmix64_reference(h: torch.Tensor) -> torch.Tensor:
    """`fmix64` in torch ops on int64 tensors (the u64 bits, two's complement)."""
    low31 = (1 << 31) - 1
    # torch's >> on int64 is arithmetic: keep the 31 bits a logical shift by 33 leaves
    h = h ^ ((h >> 33) & low31)
    h = h * (0xFF51_AFD7_ED55_8CCD - (1 << 64))
    h = h ^ ((h >> 33) & low31)
    h = h * (0xC4CE_B9FE_1A85_EC53 - (1 << 64))
    h = h ^ ((h >> 33) & low31)
    return torch.where(h == 0, 1, h)


@triton.jit
def _block_digest_kernel(
    kv_ptr, blocks_ptr, out_ptr, stride_lk, stride_n,
    ELEMS: tl.constexpr, MUL: tl.constexpr, ADD: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    # One program per (block, layer x K/V row): the row's partial sum, added up by the launcher.
    pid = tl.program_id(0)
    row = tl.program_id(1)
    num_rows = tl.num_programs(1)
    blk = tl.load(blocks_ptr + pid).to(tl.int64)
    row64 = row.to(tl.int64)
    row_ptr = kv_ptr + blk * stride_n + row64 * stride_lk
    first = row64 * ELEMS
    e = tl.arange(0, TILE)
    acc = tl.zeros([TILE], tl.int64)
    for e0 in range(0, ELEMS, TILE):
        offs = e0 + e
        mask = offs < ELEMS
        bits = tl.load(row_ptr + offs, mask=mask, other=0).to(tl.int64)
        coef = ((first + offs) * MUL + ADD) | 1
        acc += tl.where(mask, bits * coef, 0)
    tl.store(out_ptr + pid * num_rows + row, tl.sum(acc, 0))


@triton.jit
def _finish_kernel(partial_ptr, out_ptr, ROWS: tl.constexpr, ROWS_TILE: tl.constexpr):
    # One program per block: its rows' partial sums added up (wrapping) and finalized.
    pid = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, ROWS_TILE)
    part = tl.load(partial_ptr + pid * ROWS + r, mask=r < ROWS, other=0)
    raw = tl.sum(part, 0).to(tl.uint64, bitcast=True)
    tl.store(out_ptr + pid, fmix64(raw).to(tl.int64, bitcast=True))


def _finish_triton(partial: torch.Tensor) -> torch.Tensor:
    """`fmix64` of each row's wrapping sum of the int64 `partial` [blocks, rows], on its device."""
    n, rows = partial.shape
    out = torch.empty(n, dtype=torch.int64, device=partial.device)
    if n:
        _finish_kernel[(n,)](partial, out, ROWS=rows, ROWS_TILE=triton.next_power_of_2(rows))
    return out


def _partials_triton(kv_cache: torch.Tensor, ids: torch.Tensor, block_size: int) -> torch.Tensor:
    layers, _, _, slots, heads, head_dim = kv_cache.shape
    assert kv_cache.stride(3) == heads * head_dim and kv_cache.stride(4) == head_dim
    assert kv_cache.stride(5) == 1 and kv_cache.stride(0) == 2 * kv_cache.stride(1)
    bits = int_view(kv_cache)
    rows = layers * 2
    partial = torch.empty(ids.numel(), rows, dtype=torch.int64, device=kv_cache.device)
    elems = block_size * heads * head_dim
    _block_digest_kernel[(ids.numel(), rows)](
        bits, ids, partial, bits.stride(1), bits.stride(2),
        ELEMS=elems, MUL=DIGEST_MUL, ADD=DIGEST_ADD,
        TILE=min(2048, triton.next_power_of_2(elems)), num_warps=4,
    )  # fmt: skip
    return partial


@functools.lru_cache(maxsize=8)
def _coefficients(n: int, device: torch.device) -> torch.Tensor:
    """coef(i) for i in [0, n), int64."""
    return (torch.arange(n, dtype=torch.int64, device=device) * DIGEST_MUL + DIGEST_ADD) | 1


def block_digests_ref_raw(kv_cache: torch.Tensor, ids: torch.Tensor, block_size: int) -> list[int]:
    """Reference (torch ops) for the kernel's raw sums, one per block of `ids`."""
    layers, _, _, _, heads, head_dim = kv_cache.shape
    per_block = layers * 2 * block_size * heads * head_dim
    step = max(1, _REF_ELEMS // per_block)
    coef = _coefficients(per_block, kv_cache.device)
    bits = int_view(kv_cache)
    out: list[int] = []
    for k in range(0, ids.numel(), step):
        part = ids[k : k + step]
        # [L, 2, n, bs, H, D] -> [n, L * 2 * bs * H * D]: the kernel's element order.
        x = bits[:, :, part, :block_size].permute(2, 0, 1, 3, 4, 5).reshape(len(part), -1)
        out += (x.to(torch.int64) * coef).sum(1).tolist()
    return out


def raw_digests(
    kv_cache: torch.Tensor, blocks: torch.Tensor | list[int], block_size: int
) -> torch.Tensor:
    """The raw sums (int64 [len(blocks)] on the cache's device) whose `fmix64` are the blocks'
    digests; on a GPU launched, not waited for (read them when the answer is needed)."""
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, "[layers, 2, blocks, slots, heads, dim]"
    assert 0 < block_size <= kv_cache.shape[3]
    ids = backend.block_ids(blocks, kv_cache.device)
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.int64, device=kv_cache.device)
    if backend.use_triton(kv_cache):
        # int64 sums wrap like the kernel's: the same value as one sum over the whole block.
        return _partials_triton(kv_cache, ids, block_size).sum(1)
    with backend.serial_cpu(kv_cache):
        return torch.tensor(block_digests_ref_raw(kv_cache, ids, block_size), dtype=torch.int64)


def block_digests(
    kv_cache: torch.Tensor, blocks: torch.Tensor | list[int], block_size: int
) -> list[int]:
    """Digest (u64, as Python ints) of each block in `blocks` of the pool tensor
    `[layers, 2, num_blocks, slots, kv_heads, head_dim]`, over its first `block_size` slots."""
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, "[layers, 2, blocks, slots, heads, dim]"
    assert 0 < block_size <= kv_cache.shape[3]
    ids = backend.block_ids(blocks, kv_cache.device)
    if ids.numel() and backend.use_triton(kv_cache):
        digests = _finish_triton(_partials_triton(kv_cache, ids, block_size))
    else:
        digests = fmix64_reference(raw_digests(kv_cache, ids, block_size))
    return [d & _MASK64 for d in digests.tolist()]
