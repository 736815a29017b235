"""Split-K plumbing for decode: the split plan (host), per-sequence splits (device), merging.

The host picks two numbers from what it knows without a device sync -- the batch, the longest
length (`max_seq_len`, default the block table's width) and the total length
(`total_seq_len`, default batch x longest, i.e. a uniform batch) -- and sizes the grid exactly:

- `grid_splits` S: programs per (sequence, kv head) on the grid's split axis;
- `chunk` C: tokens per split for the longest sequence.

On the device each sequence takes `n = min(S, ceil(len / C))` splits of whole blocks of equal
size (`_seq_splits`); programs past `n` exit after one scalar load. A uniform batch therefore
launches no idle programs; a ragged one gets ~1k-token splits so the longest sequences leave
no tail. The partial softmax states of a sequence with n > 1 are merged by the last of its
programs to finish (a per-(sequence, kv head) arrival counter that the merging program resets
to zero, so the buffer stays zeroed between launches and CUDA graphs can replay it), or by the
separate `_merge_kernel` when `DecodeConfig.fused_merge` is off.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _seq_splits(seq_len, grid_splits, chunk, BLOCK_SIZE: tl.constexpr):
    """(splits, tokens per split) of one sequence: at most grid_splits, whole blocks."""
    n = tl.minimum(tl.maximum(tl.cdiv(seq_len, chunk), 1), grid_splits)
    piece = tl.maximum(tl.cdiv(tl.cdiv(seq_len, n), BLOCK_SIZE), 1) * BLOCK_SIZE
    n = tl.maximum(tl.cdiv(seq_len, piece), 1)
    return n, piece


@triton.jit
def _merge_group(
    out_ptr, acc_ptr, ml_ptr, b64, kvh, num_splits,
    stride_ob, stride_oh, stride_ab, stride_as, stride_ah,
    GROUP: tl.constexpr, MERGE_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
):  # fmt: skip
    """Merge the partial (acc, max, sum) of `num_splits` splits of q heads [kvh * GROUP, +GROUP)."""
    s = tl.arange(0, SPLIT_TILE)
    g = tl.arange(0, MERGE_PAD)
    d = tl.arange(0, HEAD_DIM)
    gm = g < GROUP
    heads = kvh * GROUP + g
    base = acc_ptr + b64 * stride_ab
    ml_base = ml_ptr + (b64 * stride_ab) // HEAD_DIM * 2
    ml_stride = stride_as // HEAD_DIM * 2
    m_run = tl.full([MERGE_PAD], -1.0e30, tl.float32)
    l_run = tl.zeros([MERGE_PAD], tl.float32)
    acc = tl.zeros([MERGE_PAD, HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        rows = (s0 + s).to(tl.int64)
        msk = (rows < num_splits)[:, None] & gm[None, :]
        ml_off = ml_base + rows[:, None] * ml_stride + heads[None, :] * 2
        m = tl.load(ml_off, mask=msk, other=-1.0e30, cache_modifier=".cg")
        l_s = tl.load(ml_off + 1, mask=msk, other=0.0, cache_modifier=".cg")
        a = tl.load(
            base + rows[:, None, None] * stride_as + heads[None, :, None] * stride_ah
            + d[None, None, :],
            mask=msk[:, :, None], other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new[None, :])
        l_run = l_run * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * a, 0)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)[:, None]
    tl.store(
        out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=gm[:, None],
    )


@triton.jit
def _merge_kernel(
    lens_ptr, out_ptr, acc_ptr, ml_ptr, grid_splits, chunk,
    stride_ob, stride_oh, stride_ab, stride_as, stride_ah,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, MERGE_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, SPLIT_TILE: tl.constexpr, WAIT_PRIOR: tl.constexpr,
):  # fmt: skip
    """Separate merge launch: one program per sequence and group of GROUP query heads."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    num_splits, _ = _seq_splits(tl.load(lens_ptr + b), grid_splits, chunk, BLOCK_SIZE)
    if WAIT_PRIOR:
        # programmatic dependent launch: the decode grid's partials are complete after this
        tl.extra.cuda.gdc_wait()
    if num_splits > 1:
        _merge_group(
            out_ptr, acc_ptr, ml_ptr, b.to(tl.int64), kvh, num_splits,
            stride_ob, stride_oh, stride_ab, stride_as, stride_ah,
            GROUP, MERGE_PAD, HEAD_DIM, SPLIT_TILE,
        )  # fmt: skip


def plan_splits(
    batch: int, kv_heads: int, max_len: int, total_len: int, block_size: int, cfg, sms: int
) -> tuple[int, int]:
    """(grid splits S, tokens per split C) for the longest sequence, chosen on the host."""
    max_len = max(int(max_len), 1)
    if cfg.chunk_blocks:
        chunk = cfg.chunk_blocks * block_size
        return max(1, math.ceil(max_len / chunk)), chunk
    target = cfg.ctas_per_sm * sms
    if total_len >= batch * max_len:
        # uniform: about one wave of equal programs
        pieces = max(1, round(target / (batch * kv_heads)))
    else:
        # ragged: ragged_waves waves of smaller splits, so the longest leave no tail
        per_cta = math.ceil(total_len * kv_heads / (target * cfg.ragged_waves))
        pieces = max(1, round(max_len / max(per_cta, 1)))
    pieces = max(1, min(pieces, math.ceil(max_len / cfg.min_chunk_tokens)))
    chunk = math.ceil(math.ceil(max_len / pieces) / block_size) * block_size
    return max(1, math.ceil(max_len / chunk)), chunk


_SEMAPHORES: dict[tuple, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters for the fused merge, kept per device and stream.

    Each launch leaves them zero again (the merging program resets its counter), so they are
    allocated once, outside any CUDA graph capture, and reused; launches on one stream never
    overlap. A buffer first needed during a capture is made for that call only.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _SEMAPHORES.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            _SEMAPHORES[key] = buf
    return buf
