"""Paged attention decode: one new query token per sequence, split-K over the context.

Each program owns (kv head, split, sequence) -- kv head fastest, so the programs running side by
side read neighbouring 256-byte rows of the same physical blocks -- and every query head of that
kv head's group (grouped-query attention, one `tl.dot` of [group padded to 16, D] x [D, TILE]).
The host sizes the grid exactly from the batch's longest and total length (hints, or the block
table's width), see `split.py`; each sequence takes as many equal splits of whole blocks as its
length needs. Sequences with several splits are merged by a second launch, one program per
(sequence, query head) over up to 64 splits at a time (`split.py`), started early as a
programmatic dependent launch on Hopper. Programs with only a few
tiles (one long sequence cut into many splits) load K/V straight into registers with an L2
evict-first hint; longer ones use the cp.async pipeline (which drops that hint).

Guard mode runs a small check kernel first (`_sanitize_kernel`): it checks every block-table
entry the launch reads once per (sequence, logical block), records violations, and writes a
scratch copy of the table with bad entries replaced by -1. The attention kernel then reads that
copy and only masks `-1` entries: its inner loop is the unguarded one plus one compare.
The attention kernel is a programmatic dependent launch of the check kernel: its programs start
and load their queries while the check runs, and wait (`gdc_wait`) before reading the table.
(Checking inside the attention loop instead put the block-state load in the K/V load's
dependency chain: +15-22% on the H200 against +2-5% for the separate launch.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import backend, reference
from .common import KernelArgs, check_attention_inputs, guard_args
from .errors import _check_blocks
from .split import _merge_group, _merge_kernel, _seq_splits, arrival_counters, plan_splits

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters (`bench/bench_attention.py --sweep` varies them).

    `chunk_blocks > 0` forces the split size; otherwise `plan_splits` picks it from
    `ctas_per_sm` (programs per SM for a uniform batch), `ragged_waves` and `min_chunk_tokens`.
    `tile` / `fp8_tile`: keys per loop step for 16-bit / fp8 caches (several blocks gathered).
    `max_regs` / `guard_max_regs`: register cap per thread (0: none) for plain / guard mode;
    a uniform batch's plan fills exactly ctas_per_sm programs per SM, so the kernel must fit
    that many (4 x 4 warps: 128 registers).
    `fused_merge`: the last program of a sequence merges its splits instead of a second
    launch (measured slower on the H200: the merge is serial in one program).
    `merge_heads`: query heads per merge program (0: one kv head's group);
    `merge_split_tile`: splits merged per step (one step for up to 64 splits).
    `fused_split_tile`: splits per step of the fused merge (small: it adds no registers).
    `stream_max_tiles`: programs of at most this many tiles over a 16-bit cache load K/V
    straight into registers with an L2 evict-first hint (`num_stages=1`) instead of the
    cp.async pipeline (which drops the hint; see docs/BENCHMARKS.md).
    `guard_pdl`: in guard mode, start the attention kernel as a programmatic dependent launch
    of the check kernel (its prologue overlaps the check; it waits before reading the table).
    `merge_warps`: warps per merge program (0: one per 4,096 partial elements of a step, 1-4;
    the merge is latency-bound, and fewer warps sum across fewer of them).
    `merge_pdl`: start the merge as a programmatic dependent launch, triggered when the
    attention loops end (it reads the lengths, then waits for the partials).
    Both launches are plain ones below compute capability 9.0.
    """

    tile: int = 64
    fp8_tile: int = 128
    chunk_blocks: int = 0
    num_warps: int = 4
    num_stages: int = 2
    ctas_per_sm: int = 4
    ragged_waves: int = 4
    min_chunk_tokens: int = 256
    kvh_fast: bool = True
    fused_merge: bool = False
    fp8_f16: bool = True
    max_regs: int = 0
    guard_max_regs: int = 0
    merge_heads: int = 1
    merge_split_tile: int = 64
    fused_split_tile: int = 4
    stream_max_tiles: int = 8
    guard_pdl: bool = True
    merge_warps: int = 0
    merge_pdl: bool = True


@triton.jit
def _load_tile(
    k_base, v_base, table, t0, end, max_blocks, stride_kn, stride_ks, stride_vn, stride_vs,
    TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GUARD: tl.constexpr, EVICT: tl.constexpr,
):  # fmt: skip
    """K, V of keys [t0, t0 + TILE) and which are real; in guard mode -1 entries are masked."""
    toks = t0 + tl.arange(0, TILE)
    d = tl.arange(0, HEAD_DIM)
    ok = toks < end
    lb = toks // BLOCK_SIZE
    slot = toks % BLOCK_SIZE
    blk = tl.load(table + lb, mask=ok & (lb < max_blocks), other=-1)
    if GUARD:
        # the table is guard mode's scrubbed copy: bad entries are -1
        ok = ok & (blk >= 0)
    row = blk.to(tl.int64)[:, None]
    k_ptrs = k_base + row * stride_kn + slot[:, None] * stride_ks + d[None, :]
    v_ptrs = v_base + row * stride_vn + slot[:, None] * stride_vs + d[None, :]
    if EVICT:
        # streamed once: let these lines go first, before other data in L2
        k = tl.load(k_ptrs, mask=ok[:, None], other=0.0, eviction_policy="evict_first")
        v = tl.load(v_ptrs, mask=ok[:, None], other=0.0, eviction_policy="evict_first")
    else:
        k = tl.load(k_ptrs, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=ok[:, None], other=0.0)
    return k, v, ok


@triton.jit
def _attend(q, m_i, l_i, acc, k, v, ok, qk_scale, KV_FP8: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax step over a tile of keys."""
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
def _sanitize_kernel(
    tables_ptr, lens_ptr, state_ptr, errors_ptr, clean_ptr,
    max_blocks, num_blocks, error_capacity, stride_tb, stride_cb,
    BLOCK_SIZE: tl.constexpr, CHECK_TILE: tl.constexpr, HAS_STATE: tl.constexpr,
    HAS_ERRORS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Guard mode: check each entry a sequence reads once; copy the table with bad ones -1."""
    if PDL:
        # the attention launch may start its prologue now (it waits before reading the copy)
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    b64 = b.to(tl.int64)
    need = tl.cdiv(tl.load(lens_ptr + b), BLOCK_SIZE)
    table = tables_ptr + b64 * stride_tb
    for e0 in range(part * CHECK_TILE, tl.maximum(need, max_blocks), parts * CHECK_TILE):
        lb = e0 + tl.arange(0, CHECK_TILE)
        in_table = lb < max_blocks
        needed = lb < need
        blk = tl.load(table + lb, mask=in_table, other=-1)
        ok = _check_blocks(
            blk, needed, needed, b, lb, state_ptr, errors_ptr, num_blocks, error_capacity,
            HAS_STATE, HAS_ERRORS,
        )  # fmt: skip
        tl.store(clean_ptr + b64 * stride_cb + lb, tl.where(ok, blk, -1), mask=in_table)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr, sem_ptr,
    k_scale_ptr, v_scale_ptr,
    scale_log2, kv_heads, max_blocks, grid_splits, chunk,
    stride_qb, stride_qh, stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh,
    stride_tb, stride_ob, stride_oh, stride_ab, stride_as, stride_ah,
    TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, MERGE_PAD: tl.constexpr,
    SPLIT_TILE: tl.constexpr, KV_FP8: tl.constexpr, FP8_F16: tl.constexpr,
    GUARD: tl.constexpr, UPCAST: tl.constexpr, KVH_FAST: tl.constexpr,
    FUSED_MERGE: tl.constexpr, EVICT: tl.constexpr, WAIT_PRIOR: tl.constexpr,
    LAUNCH_DEP: tl.constexpr,
):  # fmt: skip
    if KVH_FAST:
        kvh = tl.program_id(0)
        b = tl.program_id(2)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(2)
    split = tl.program_id(1)
    seq_len = tl.load(lens_ptr + b)
    num_splits, piece = _seq_splits(seq_len, grid_splits, chunk, BLOCK_SIZE)
    if split >= num_splits:
        return
    start = split * piece
    end = tl.minimum(start + piece, seq_len)
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
    elif KV_FP8 and FP8_F16:
        # e4m3 -> fp16 is one hardware conversion per pair; -> bf16 is not
        q = q.to(tl.float16)
    qk_scale = scale_log2
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    table = tables_ptr + b64 * stride_tb
    if WAIT_PRIOR:
        # programmatic dependent launch: the sanitize kernel's table copy is complete after this
        tl.extra.cuda.gdc_wait()
    m_i = tl.full([GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for t0 in range(start, end, TILE):
        k, v, ok = _load_tile(
            k_base, v_base, table, t0, end, max_blocks, stride_kn, stride_ks, stride_vn,
            stride_vs, TILE, BLOCK_SIZE, HEAD_DIM, GUARD, EVICT,
        )  # fmt: skip
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, k, v, ok, qk_scale, KV_FP8, UPCAST)
    if LAUNCH_DEP:
        # the merge launch may start now; it waits for this grid before reading partials
        tl.extra.cuda.gdc_launch_dependents()
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
        if FUSED_MERGE:
            # the last of the sequence's programs for this kv head merges; it resets the
            # counter so the buffer is zero again for the next launch
            tl.debug_barrier()
            counter = sem_ptr + b64 * kv_heads + kvh
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == num_splits - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed")
                _merge_group(
                    out_ptr, acc_ptr, ml_ptr, b64, kvh, num_splits,
                    stride_ob, stride_oh, stride_ab, stride_as, stride_ah,
                    GROUP, MERGE_PAD, HEAD_DIM, SPLIT_TILE,
                )  # fmt: skip


def launch_decode(
    a: KernelArgs,
    out: torch.Tensor,
    cfg: DecodeConfig | None = None,
    max_seq_len: int | None = None,
    total_seq_len: int | None = None,
) -> None:
    """Launch the decode kernel(s) into `out` (a [batch, q_heads, head_dim] tensor).

    `max_seq_len` / `total_seq_len`: host-side hints for the split plan (the longest and the
    summed length); defaults: the block table's width and a uniform batch. A wrong hint is
    never wrong, only slower: a sequence longer than `max_seq_len` takes larger splits.
    """
    cfg = cfg or DecodeConfig()
    q, k, v = a.q, a.k_cache, a.v_cache
    batch, q_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = q_heads // kv_heads
    max_blocks = a.block_tables.shape[1]
    if max_seq_len is None:
        max_seq_len = max_blocks * a.block_size
    if total_seq_len is None:
        total_seq_len = batch * max_seq_len
    sms = backend.num_sms(q.device)
    splits, chunk = plan_splits(batch, kv_heads, max_seq_len, total_seq_len, a.block_size, cfg, sms)
    g = guard_args(a)
    tables = a.block_tables
    pdl = g.guard and cfg.guard_pdl and backend.has_pdl(q.device)
    if g.guard:
        tables = torch.empty((batch, max_blocks), dtype=torch.int32, device=q.device)
        check_tile = min(1024, triton.next_power_of_2(max(max_blocks, 16)))
        _sanitize_kernel[(batch, triton.cdiv(max_blocks, check_tile))](
            a.block_tables, a.seq_lens, g.state, g.errors, tables,
            max_blocks, k.shape[0], g.capacity, a.block_tables.stride(0), tables.stride(0),
            BLOCK_SIZE=a.block_size, CHECK_TILE=check_tile, HAS_STATE=g.has_state,
            HAS_ERRORS=g.has_errors, PDL=pdl, num_warps=4,
        )  # fmt: skip
    if splits > 1:
        acc = torch.empty(batch, splits, q_heads, head_dim, device=q.device, dtype=torch.float32)
        ml = torch.empty(batch, splits, q_heads, 2, device=q.device, dtype=torch.float32)
    else:  # never written: every sequence has one split
        acc = ml = out
    fused = cfg.fused_merge and splits > 1
    sem = arrival_counters(q.device, batch * kv_heads) if fused else a.seq_lens
    grid = (kv_heads, splits, batch) if cfg.kvh_fast else (batch, splits, kv_heads)
    merge_pad = triton.next_power_of_2(group)
    tile = cfg.fp8_tile if g.fp8 else cfg.tile
    regs = cfg.guard_max_regs if g.guard else cfg.max_regs
    extra = {"maxnreg": regs} if regs and not backend.interpreting() else {}
    if pdl:
        extra["launch_pdl"] = True
    # short programs: no cp.async pipeline to fill, and evict-first keeps L2's other lines
    stream = not g.fp8 and math.ceil(chunk / tile) <= cfg.stream_max_tiles
    stages = 1 if stream else cfg.num_stages
    merge_pdl = cfg.merge_pdl and splits > 1 and not fused and backend.has_pdl(q.device)
    _decode_kernel[grid](
        q, k, v, tables, a.seq_lens, out, acc, ml, sem, g.k_scale, g.v_scale,
        a.scale * LOG2E, kv_heads, max_blocks, splits, chunk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), tables.stride(0),
        out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
        TILE=tile, BLOCK_SIZE=a.block_size, HEAD_DIM=head_dim, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), MERGE_PAD=merge_pad,
        SPLIT_TILE=cfg.fused_split_tile, KV_FP8=g.fp8, FP8_F16=cfg.fp8_f16, GUARD=g.guard,
        UPCAST=backend.interpreting(), KVH_FAST=cfg.kvh_fast, FUSED_MERGE=fused,
        EVICT=stream, WAIT_PRIOR=pdl, LAUNCH_DEP=merge_pdl,
        num_warps=cfg.num_warps, num_stages=stages, **extra,
    )  # fmt: skip
    if splits > 1 and not fused:
        heads = cfg.merge_heads or group
        assert q_heads % heads == 0, f"merge_heads {heads} must divide {q_heads} query heads"
        heads_pad = triton.next_power_of_2(heads)
        split_tile = min(cfg.merge_split_tile, triton.next_power_of_2(splits))
        # a latency-bound step: one warp per 4096 partial elements (fewer cross-warp sums)
        warps = cfg.merge_warps or max(1, min(4, split_tile * heads_pad * head_dim // 4096))
        _merge_kernel[(batch, q_heads // heads)](
            a.seq_lens, out, acc, ml, splits, chunk,
            out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
            BLOCK_SIZE=a.block_size, GROUP=heads, MERGE_PAD=heads_pad,
            HEAD_DIM=head_dim, SPLIT_TILE=split_tile, WAIT_PRIOR=merge_pdl, num_warps=warps,
            **({"launch_pdl": True} if merge_pdl else {}),
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
    max_seq_len: int | None = None,
    total_seq_len: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V: [batch, q_heads, head_dim].

    `max_seq_len` / `total_seq_len` (optional, host ints): the batch's longest and summed
    length, when the caller knows them; they only shape the launch (see `launch_decode`).
    """
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
    launch_decode(a, out, max_seq_len=max_seq_len, total_seq_len=total_seq_len)
    return out
