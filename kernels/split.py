"""Split-K plumbing for decode: the split size chosen on the device, and the merge kernel.

The split size comes from `seq_lens` on the device (no host sync, so launches can be captured
in CUDA graphs): uniform batches get about one wave of programs, ragged ones several waves of
smaller splits so the longest sequences leave no tail. The grid's split axis is sized on the
host for the smallest split allowed; programs past a sequence's last split exit at once.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl


@triton.jit
def _split_tokens(
    lens_ptr, batch, kv_heads, max_blocks, grid_splits, target_ctas, ragged_waves,
    min_chunk, forced_blocks, BLOCK_SIZE: tl.constexpr, LENS_PAD: tl.constexpr,
):  # fmt: skip
    """Tokens per split, from the lengths on the device (no host sync, graph-safe).

    Uniform batches get about `target_ctas` programs in one wave; ragged ones `ragged_waves`
    times more, smaller, so the longest sequences do not leave a tail. Always whole blocks.
    """
    if forced_blocks > 0:
        blocks = forced_blocks
    else:
        i = tl.arange(0, LENS_PAD)
        lens = tl.load(lens_ptr + i, mask=i < batch, other=0)
        total = tl.sum(lens, 0)
        longest = tl.max(lens, 0)
        waves = tl.where(longest * batch == total, 1, ragged_waves)
        per_cta = tl.maximum(tl.cdiv(total * kv_heads, target_ctas * waves), min_chunk)
        # split the longest sequence evenly into the nearest whole number of pieces
        pieces = tl.maximum((longest + per_cta // 2) // per_cta, 1)
        blocks = tl.cdiv(tl.cdiv(longest, pieces), BLOCK_SIZE)
    return tl.maximum(blocks, tl.cdiv(max_blocks, grid_splits)) * BLOCK_SIZE


@triton.jit
def _merge_kernel(
    lens_ptr, out_ptr, acc_ptr, ml_ptr, batch, kv_heads, max_blocks, grid_splits,
    target_ctas, ragged_waves, min_chunk, forced_blocks,
    stride_ob, stride_oh, stride_ab, stride_as, stride_ah,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, LENS_PAD: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    chunk = _split_tokens(
        lens_ptr, batch, kv_heads, max_blocks, grid_splits, target_ctas, ragged_waves,
        min_chunk, forced_blocks, BLOCK_SIZE, LENS_PAD,
    )  # fmt: skip
    num_splits = tl.cdiv(tl.load(lens_ptr + b), chunk)
    if num_splits <= 1:
        return
    b64 = b.to(tl.int64)
    s = tl.arange(0, SPLIT_TILE)
    d = tl.arange(0, HEAD_DIM)
    part = acc_ptr + b64 * stride_ab + h * stride_ah
    ml = ml_ptr + (b64 * stride_ab) // HEAD_DIM * 2 + h * 2
    ml_stride = stride_as // HEAD_DIM * 2
    m_max = tl.full([SPLIT_TILE], -1.0e30, tl.float32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        rows = (s0 + s).to(tl.int64)
        m_s = tl.load(ml + rows * ml_stride, mask=rows < num_splits, other=-1.0e30)
        m_max = tl.maximum(m_max, m_s)
    m_all = tl.max(m_max, 0)
    l_all = tl.zeros([SPLIT_TILE], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        rows = (s0 + s).to(tl.int64)
        sm = rows < num_splits
        m_s = tl.load(ml + rows * ml_stride, mask=sm, other=-1.0e30)
        l_s = tl.load(ml + rows * ml_stride + 1, mask=sm, other=0.0)
        w = tl.where(sm, tl.exp2(m_s - m_all), 0.0)
        l_all += w * l_s
        a = tl.load(part + rows[:, None] * stride_as + d[None, :], mask=sm[:, None], other=0.0)
        acc += tl.sum(a * w[:, None], 0)
    l_tot = tl.sum(l_all, 0)
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)
    tl.store(out_ptr + b64 * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def grid_splits(batch: int, kv_heads: int, max_blocks: int, block_size: int, cfg, sms: int) -> int:
    """Programs along the split axis: enough for the smallest split the kernel may choose."""
    if cfg.chunk_blocks:
        return max(1, math.ceil(max_blocks / cfg.chunk_blocks))
    most = cfg.ctas_per_sm * sms * cfg.ragged_waves
    by_load = math.ceil(most / (batch * kv_heads))
    by_size = math.ceil(max_blocks * block_size / cfg.min_chunk_tokens)
    return max(1, min(by_load, by_size, max_blocks))
