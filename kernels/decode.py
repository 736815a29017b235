"""Paged attention decode: one new query token per sequence, split-K over the context.

Each program owns (sequence, split, kv head) and every query head of that kv head's group
(grouped-query attention); a split is a fixed number of whole blocks, so a long sequence gets
many splits and a ragged batch gets splits in proportion to each length. A second small kernel
merges the splits' partial softmax states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import backend, reference
from .common import KernelArgs, check_attention_inputs, guard_args

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters; `chunk_blocks=0` lets the heuristic pick the split size."""

    tile: int = 64
    chunk_blocks: int = 0
    num_warps: int = 4
    num_stages: int = 2
    target_ctas_per_sm: int = 8
    min_chunk_tokens: int = 256


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr,
    state_ptr, errors_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2, chunk, num_blocks, max_blocks, error_capacity,
    stride_qb, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_tb, stride_ob, stride_oh, stride_ab, stride_as, stride_ah, stride_mb, stride_ms,
    TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    SPLIT: tl.constexpr, KV_FP8: tl.constexpr,
    GUARD: tl.constexpr, HAS_STATE: tl.constexpr, HAS_ERRORS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    split = tl.program_id(1)
    kvh = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = split * chunk
    if SPLIT:
        if start >= seq_len:
            return
    end = tl.minimum(start + chunk, seq_len)
    b64 = b.to(tl.int64)
    split64 = split.to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    q = tl.load(
        q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None],
        other=0.0,
    )
    if UPCAST:
        # the CPU interpreter multiplies bf16 as raw integers: do its dots in float32
        q = q.to(tl.float32)
    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    table = tables_ptr + b64 * stride_tb
    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for t0 in range(start, end, TILE):
        toks = t0 + tl.arange(0, TILE)
        valid = toks < end
        lb = toks // BLOCK_SIZE
        slot = toks % BLOCK_SIZE
        blk = tl.load(table + lb, mask=valid & (lb < max_blocks), other=-1)
        ok = valid
        if GUARD:
            in_range = (blk >= 0) & (blk < num_blocks)
            kind = tl.where(in_range, 0, 1)
            ok = valid & in_range
            if HAS_STATE:
                allocated = tl.load(state_ptr + blk, mask=ok, other=1) != 0
                kind = tl.where(ok & (allocated == 0), 2, kind)
                ok = ok & allocated
            if HAS_ERRORS:
                # one record per bad block: at its first slot, from kv head 0 only
                rec = valid & (kind != 0) & (slot == 0) & ((toks * 0 + kvh) == 0)
                idx = tl.atomic_add(errors_ptr + toks * 0, toks * 0 + 1, mask=rec)
                keep = rec & (idx < error_capacity)
                rec_ptr = errors_ptr + 2 + idx * 5
                tl.store(rec_ptr, toks * 0 + b, mask=keep)
                tl.store(rec_ptr + 1, lb, mask=keep)
                tl.store(rec_ptr + 2, blk, mask=keep)
                tl.store(rec_ptr + 3, toks * 0 - 1, mask=keep)
                tl.store(rec_ptr + 4, kind, mask=keep)
        row = blk.to(tl.int64)[:, None]
        k = tl.load(
            k_base + row * stride_kn + slot[:, None] * stride_ks + d[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        v = tl.load(
            v_base + row * stride_vn + slot[:, None] * stride_vs + d[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        if KV_FP8 or UPCAST:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    if SPLIT:
        part = acc_ptr + b64 * stride_ab + split64 * stride_as
        tl.store(part + heads[:, None] * stride_ah + d[None, :], acc, mask=gmask[:, None])
        ml = ml_ptr + b64 * stride_mb + split64 * stride_ms + heads * 2
        tl.store(ml, m_i, mask=gmask)
        tl.store(ml + 1, l_i, mask=gmask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])


@triton.jit
def _decode_merge_kernel(
    lens_ptr, out_ptr, acc_ptr, ml_ptr, chunk,
    stride_ob, stride_oh, stride_ab, stride_as, stride_ah, stride_mb, stride_ms,
    HEAD_DIM: tl.constexpr, SPLIT_TILE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    num_splits = tl.cdiv(tl.load(lens_ptr + b), chunk)
    s = tl.arange(0, SPLIT_TILE)
    d = tl.arange(0, HEAD_DIM)
    ml = ml_ptr + b64 * stride_mb + h * 2
    part = acc_ptr + b64 * stride_ab + h * stride_ah
    m_max = tl.full([SPLIT_TILE], -1.0e30, tl.float32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        sm = (s0 + s) < num_splits
        m_s = tl.load(ml + (s0 + s).to(tl.int64) * stride_ms, mask=sm, other=-1.0e30)
        m_max = tl.maximum(m_max, m_s)
    m_all = tl.max(m_max, 0)
    l_all = tl.zeros([SPLIT_TILE], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, SPLIT_TILE):
        sm = (s0 + s) < num_splits
        rows = (s0 + s).to(tl.int64)
        m_s = tl.load(ml + rows * stride_ms, mask=sm, other=-1.0e30)
        l_s = tl.load(ml + rows * stride_ms + 1, mask=sm, other=0.0)
        w = tl.where(sm, tl.exp2(m_s - m_all), 0.0)
        l_all += w * l_s
        a = tl.load(part + rows[:, None] * stride_as + d[None, :], mask=sm[:, None], other=0.0)
        acc += tl.sum(a * w[:, None], 0)
    l_tot = tl.sum(l_all, 0)
    out = acc / tl.where(l_tot > 0, l_tot, 1.0)
    tl.store(out_ptr + b64 * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def pick_chunk_blocks(
    batch: int, kv_heads: int, max_blocks: int, block_size: int, cfg: DecodeConfig, sms: int
) -> int:
    """Blocks per split: enough splits to fill the GPU, each at least `min_chunk_tokens` long."""
    if cfg.chunk_blocks:
        return max(1, min(cfg.chunk_blocks, max_blocks))
    target = cfg.target_ctas_per_sm * sms
    tokens = math.ceil(max_blocks * block_size * batch * kv_heads / target)
    tokens = max(tokens, cfg.min_chunk_tokens)
    return max(1, min(math.ceil(tokens / block_size), max_blocks))


def launch_decode(a: KernelArgs, out: torch.Tensor, cfg: DecodeConfig | None = None) -> None:
    """Launch the split kernel (and the merge when there is more than one split) into `out`."""
    cfg = cfg or DecodeConfig()
    q, k, v = a.q, a.k_cache, a.v_cache
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    max_blocks = a.block_tables.shape[1]
    chunk_blocks = pick_chunk_blocks(
        batch, kv_heads, max_blocks, a.block_size, cfg, backend.num_sms(q.device)
    )
    num_splits = math.ceil(max_blocks / chunk_blocks)
    chunk = chunk_blocks * a.block_size
    split = num_splits > 1
    if split:
        acc = torch.empty(
            batch, num_splits, q_heads, head_dim, device=q.device, dtype=torch.float32
        )
        ml = torch.empty(batch, num_splits, q_heads, 2, device=q.device, dtype=torch.float32)
    else:
        acc = ml = out
    g = guard_args(a)
    _decode_split_kernel[(batch, num_splits, kv_heads)](
        q, k, v, a.block_tables, a.seq_lens, out, acc, ml,
        g.state, g.errors, g.k_scale, g.v_scale,
        a.scale * LOG2E, chunk, k.shape[0], max_blocks, g.capacity,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.block_tables.stride(0),
        out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1),
        TILE=cfg.tile, BLOCK_SIZE=a.block_size, HEAD_DIM=head_dim,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        SPLIT=split, KV_FP8=g.fp8, GUARD=g.guard, HAS_STATE=g.has_state,
        HAS_ERRORS=g.has_errors, UPCAST=backend.interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split:
        _decode_merge_kernel[(batch, q_heads)](
            a.seq_lens, out, acc, ml, chunk,
            out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
            ml.stride(0), ml.stride(1),
            HEAD_DIM=head_dim, SPLIT_TILE=16, num_warps=4,
        )  # fmt: skip


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    block_size: int | None = None,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    block_state: torch.Tensor | None = None,
    errors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V: [batch, q_heads, head_dim]."""
    if not backend.use_triton(q):
        return reference.paged_decode_ref(
            q, k_cache, v_cache, block_tables, seq_lens, scale, block_size,
            k_scale=k_scale, v_scale=v_scale, block_state=block_state, errors=errors,
        )  # fmt: skip
    a = check_attention_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, scale, block_size,
        k_scale, v_scale, block_state, errors,
    )  # fmt: skip
    assert q.dim() == 3 and block_tables.shape[0] == q.shape[0] == seq_lens.shape[0]
    out = torch.empty_like(q)
    launch_decode(a, out)
    return out
