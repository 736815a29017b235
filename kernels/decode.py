"""Paged attention decode: one new query token per sequence, split-K over the context.

Each program owns (sequence, split, kv head) and every query head of that kv head's group
(grouped-query attention). A split is a fixed number of whole blocks chosen on the device from
the lengths, so a long sequence gets many splits and a ragged batch gets splits in proportion
to each length; a small second kernel merges the splits' partial softmax states. In guard mode
each split checks its block-table entries once up front; only a split holding a bad entry
runs the per-token checked loop, so guard mode costs little on a clean pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import backend, reference
from .common import KernelArgs, check_attention_inputs, guard_args
from .split import _merge_kernel, _split_tokens, grid_splits

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters; `chunk_blocks=0` lets the kernel pick the split size from seq_lens."""

    tile: int = 64
    chunk_blocks: int = 0
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 4
    ragged_waves: int = 4
    min_chunk_tokens: int = 256


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_base, v_base, table, state_ptr, t0, end, max_blocks, num_blocks,
    qk_scale, stride_kn, stride_ks, stride_vn, stride_vs,
    TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_FP8: tl.constexpr, UPCAST: tl.constexpr, CHECK: tl.constexpr, HAS_STATE: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys [t0, t0 + TILE); CHECK masks out bad blocks."""
    toks = t0 + tl.arange(0, TILE)
    d = tl.arange(0, HEAD_DIM)
    ok = toks < end
    lb = toks // BLOCK_SIZE
    slot = toks % BLOCK_SIZE
    blk = tl.load(table + lb, mask=ok & (lb < max_blocks), other=-1)
    if CHECK:
        ok = ok & (blk >= 0) & (blk < num_blocks)
        if HAS_STATE:
            ok = ok & (tl.load(state_ptr + blk, mask=ok, other=0) != 0)
    row = blk.to(tl.int64)[:, None]
    k = tl.load(k_base + row * stride_kn + slot[:, None] * stride_ks + d[None, :],
                mask=ok[:, None], other=0.0)  # fmt: skip
    v = tl.load(v_base + row * stride_vn + slot[:, None] * stride_vs + d[None, :],
                mask=ok[:, None], other=0.0)  # fmt: skip
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
    return m_new, l_i, acc


@triton.jit
def _check_blocks(
    table, state_ptr, errors_ptr, b, kvh, first_block, end_block, max_blocks, num_blocks,
    error_capacity, CHECK_TILE: tl.constexpr, HAS_STATE: tl.constexpr,
    HAS_ERRORS: tl.constexpr,
):  # fmt: skip
    """Check a split's block-table entries once; record violations; return how many."""
    num_bad = 0
    for e0 in range(first_block, end_block, CHECK_TILE):
        lb = e0 + tl.arange(0, CHECK_TILE)
        need = lb < end_block
        blk = tl.load(table + lb, mask=need & (lb < max_blocks), other=-1)
        in_range = (blk >= 0) & (blk < num_blocks)
        kind = tl.where(in_range, 0, 1)
        if HAS_STATE:
            allocated = tl.load(state_ptr + blk, mask=need & in_range, other=1) != 0
            kind = tl.where(in_range & (allocated == 0), 2, kind)
        bad = need & (kind != 0)
        num_bad += tl.sum(bad.to(tl.int32), 0)
        if HAS_ERRORS:
            rec = bad & ((lb * 0 + kvh) == 0)  # kv head 0 records for all
            idx = tl.atomic_add(errors_ptr + lb * 0, lb * 0 + 1, mask=rec)
            keep = rec & (idx < error_capacity)
            rec_ptr = errors_ptr + 2 + idx * 5
            tl.store(rec_ptr, lb * 0 + b, mask=keep)
            tl.store(rec_ptr + 1, lb, mask=keep)
            tl.store(rec_ptr + 2, blk, mask=keep)
            tl.store(rec_ptr + 3, lb * 0 - 1, mask=keep)
            tl.store(rec_ptr + 4, kind, mask=keep)
    return num_bad


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr,
    state_ptr, errors_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2, batch, kv_heads, num_blocks, max_blocks, error_capacity,
    grid_splits, target_ctas, ragged_waves, min_chunk, forced_blocks,
    stride_qb, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_tb, stride_ob, stride_oh, stride_ab, stride_as, stride_ah,
    TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, LENS_PAD: tl.constexpr,
    KV_FP8: tl.constexpr, GUARD: tl.constexpr, HAS_STATE: tl.constexpr,
    HAS_ERRORS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    split = tl.program_id(1)
    kvh = tl.program_id(2)
    chunk = _split_tokens(
        lens_ptr, batch, kv_heads, max_blocks, grid_splits, target_ctas, ragged_waves,
        min_chunk, forced_blocks, BLOCK_SIZE, LENS_PAD,
    )  # fmt: skip
    seq_len = tl.load(lens_ptr + b)
    num_splits = tl.maximum(tl.cdiv(seq_len, chunk), 1)
    if split >= num_splits:
        return
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    b64 = b.to(tl.int64)
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
    num_bad = 0
    if GUARD:
        # entries are checked once per split, so clean splits run the unchecked loop
        num_bad = _check_blocks(
            table, state_ptr, errors_ptr, b, kvh, start // BLOCK_SIZE,
            tl.cdiv(end, BLOCK_SIZE), max_blocks, num_blocks, error_capacity, 64,
            HAS_STATE, HAS_ERRORS,
        )  # fmt: skip
    if num_bad == 0:
        for t0 in range(start, end, TILE):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_base, v_base, table, state_ptr, t0, end, max_blocks,
                num_blocks, qk_scale, stride_kn, stride_ks, stride_vn, stride_vs,
                TILE, BLOCK_SIZE, HEAD_DIM, KV_FP8, UPCAST, False, HAS_STATE,
            )  # fmt: skip
    else:
        for t0 in range(start, end, TILE):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_base, v_base, table, state_ptr, t0, end, max_blocks,
                num_blocks, qk_scale, stride_kn, stride_ks, stride_vn, stride_vs,
                TILE, BLOCK_SIZE, HEAD_DIM, KV_FP8, UPCAST, True, HAS_STATE,
            )  # fmt: skip
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    if num_splits == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        part = acc_ptr + b64 * stride_ab + split.to(tl.int64) * stride_as
        tl.store(part + heads[:, None] * stride_ah + d[None, :], acc, mask=gmask[:, None])
        # (max, sum) pairs: ml has acc's layout with 2 in place of head_dim
        ml = ml_ptr + (b64 * stride_ab + split.to(tl.int64) * stride_as) // HEAD_DIM * 2
        tl.store(ml + heads * 2, m_i, mask=gmask)
        tl.store(ml + heads * 2 + 1, l_i, mask=gmask)


def launch_decode(a: KernelArgs, out: torch.Tensor, cfg: DecodeConfig | None = None) -> None:
    """Launch the decode kernel into `out` (a [batch, q_heads, head_dim] tensor)."""
    cfg = cfg or DecodeConfig()
    q, k, v = a.q, a.k_cache, a.v_cache
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    max_blocks = a.block_tables.shape[1]
    sms = backend.num_sms(q.device)
    splits = grid_splits(batch, kv_heads, max_blocks, a.block_size, cfg, sms)
    acc = torch.empty(batch, splits, q_heads, head_dim, device=q.device, dtype=torch.float32)
    ml = torch.empty(batch, splits, q_heads, 2, device=q.device, dtype=torch.float32)
    g = guard_args(a)
    chunk_args = (
        batch, kv_heads, max_blocks, splits, cfg.ctas_per_sm * sms, cfg.ragged_waves,
        cfg.min_chunk_tokens, cfg.chunk_blocks,
    )  # fmt: skip
    lens_pad = triton.next_power_of_2(batch)
    _decode_kernel[(batch, splits, kv_heads)](
        q, k, v, a.block_tables, a.seq_lens, out, acc, ml,
        g.state, g.errors, g.k_scale, g.v_scale,
        a.scale * LOG2E, batch, kv_heads, k.shape[0], max_blocks, g.capacity, *chunk_args[3:],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.block_tables.stride(0),
        out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        TILE=cfg.tile, BLOCK_SIZE=a.block_size, HEAD_DIM=head_dim, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), LENS_PAD=lens_pad,
        KV_FP8=g.fp8, GUARD=g.guard, HAS_STATE=g.has_state, HAS_ERRORS=g.has_errors,
        UPCAST=backend.interpreting(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(batch, q_heads)](
            a.seq_lens, out, acc, ml, *chunk_args,
            out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
            BLOCK_SIZE=a.block_size, HEAD_DIM=head_dim, LENS_PAD=lens_pad, SPLIT_TILE=16,
            num_warps=4,
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
