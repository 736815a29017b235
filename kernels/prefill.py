"""Paged prefill: causal attention of new tokens (ragged, packed) over cached prefix + self.

The chunked-prefill case: sequence i has `seq_lens[i]` tokens in the cache, of which the last
`query_start_loc[i+1] - query_start_loc[i]` are new and packed into `q`. A program owns a tile
of one sequence's new tokens times all query heads of one kv head (rows = token x group head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import backend, reference
from .common import KernelArgs, check_attention_inputs, guard_args
from .errors import _check_blocks

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters: new tokens per program and keys per inner iteration."""

    block_m: int = 32
    tile: int = 64
    num_warps: int = 4
    num_stages: int = 2


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, qsl_ptr, out_ptr,
    state_ptr, errors_ptr, k_scale_ptr, v_scale_ptr,
    scale_log2, num_blocks, max_blocks, error_capacity,
    stride_qt, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_tb, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, KV_FP8: tl.constexpr,
    GUARD: tl.constexpr, HAS_STATE: tl.constexpr, HAS_ERRORS: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    mt = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + b)
    num_new = tl.load(qsl_ptr + b + 1) - q_start
    if mt * BLOCK_M >= num_new:
        return
    seq_len = tl.load(lens_ptr + b)
    first_new = seq_len - num_new  # position of the first new token
    b64 = b.to(tl.int64)
    r = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = mt * BLOCK_M + r // GROUP_PAD
    gh = r % GROUP_PAD
    row_ok = (tok < num_new) & (gh < GROUP)
    heads = kvh * GROUP + gh
    d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        # the CPU interpreter multiplies bf16 as raw integers: do its dots in float32
        q = q.to(tl.float32)
    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    q_pos = first_new + tok
    tile_first = first_new + mt * BLOCK_M  # earlier tiles read every key before this one
    kv_end = tl.minimum(seq_len, tile_first + BLOCK_M)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    table = tables_ptr + b64 * stride_tb
    m_i = tl.full([BLOCK_M * GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM], tl.float32)
    for t0 in range(0, kv_end, TILE):
        toks = t0 + tl.arange(0, TILE)
        valid = toks < kv_end
        lb = toks // BLOCK_SIZE
        slot = toks % BLOCK_SIZE
        blk = tl.load(table + lb, mask=valid & (lb < max_blocks), other=-1)
        ok = valid
        if GUARD:
            # a block is recorded by the first tile that reads it, at its first slot
            first_reader = ((toks * 0 + mt) == 0) | (toks >= tile_first)
            ok = _check_blocks(
                blk, valid, (slot == 0) & ((toks * 0 + kvh) == 0) & first_reader, b, lb, state_ptr,
                errors_ptr, num_blocks, error_capacity, HAS_STATE, HAS_ERRORS,
            )  # fmt: skip
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
        causal = ok[None, :] & (toks[None, :] <= q_pos[:, None])
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def launch_prefill(
    a: KernelArgs,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor,
    cfg: PrefillConfig | None = None,
) -> None:
    """Launch the prefill kernel over (sequence, new-token tile, kv head) into `out`."""
    cfg = cfg or PrefillConfig()
    q, k, v = a.q, a.k_cache, a.v_cache
    _, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    # rows = tokens x group heads; keep at least 16 rows for tl.dot
    block_m = max(cfg.block_m // group_pad, 16 // group_pad, 1)
    batch = a.seq_lens.shape[0]
    g = guard_args(a)
    grid = (batch, triton.cdiv(max(max_query_len, 1), block_m), kv_heads)
    _prefill_kernel[grid](
        q, k, v, a.block_tables, a.seq_lens, query_start_loc, out,
        g.state, g.errors, g.k_scale, g.v_scale,
        a.scale * LOG2E, k.shape[0], a.block_tables.shape[1], g.capacity,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.block_tables.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_M=block_m, TILE=cfg.tile, BLOCK_SIZE=a.block_size, HEAD_DIM=head_dim,
        GROUP=group, GROUP_PAD=group_pad, KV_FP8=g.fp8, GUARD=g.guard,
        HAS_STATE=g.has_state, HAS_ERRORS=g.has_errors, UPCAST=backend.interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float | None = None,
    block_size: int | None = None,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    block_state: torch.Tensor | None = None,
    errors: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their paged prefix: [tokens, q_heads, dim]."""
    if not backend.use_triton(q):
        return reference.paged_prefill_ref(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, block_size,
            k_scale=k_scale, v_scale=v_scale, block_state=block_state, errors=errors,
        )  # fmt: skip
    a = check_attention_inputs(
        q, k_cache, v_cache, block_tables, seq_lens, scale, block_size,
        k_scale, v_scale, block_state, errors,
    )  # fmt: skip
    assert query_start_loc.dtype == torch.int32 and query_start_loc.is_contiguous()
    assert query_start_loc.shape[0] == seq_lens.shape[0] + 1
    if max_query_len is None:
        # one host read; pass max_query_len to keep the launch free of syncs
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    out = torch.zeros_like(q)
    launch_prefill(a, query_start_loc, max_query_len, out)
    return out
