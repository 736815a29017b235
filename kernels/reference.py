"""Plain-torch references for every kernel: the CPU backend and the tests' ground truth.

They compute in float32, record the same guard-mode violations as the Triton kernels and skip
the same bad reads and writes. Decode is vectorised over the batch; prefill loops per sequence.
"""

from __future__ import annotations

import torch

from .common import default_scale, is_fp8
from .errors import (
    ERROR_FIELDS,
    KIND_NOT_ALLOCATED,
    KIND_OUT_OF_RANGE,
    KIND_SLOT_OVERFLOW,
    record_errors,
)

NEG_INF = float("-inf")


def _scale_value(value: float | torch.Tensor | None) -> float | torch.Tensor:
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        return value.detach().float().reshape(()).cpu()
    return float(value)


def _block_status(
    blk: torch.Tensor, num_blocks: int, block_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per entry: readable (in range and allocated) and the violation kind (0 = none)."""
    in_range = (blk >= 0) & (blk < num_blocks)
    kind = torch.where(in_range, 0, KIND_OUT_OF_RANGE)
    ok = in_range
    if block_state is not None:
        state = block_state.to(blk.device)[blk.clamp(0, num_blocks - 1)] != 0
        kind = torch.where(in_range & ~state, KIND_NOT_ALLOCATED, kind)
        ok = in_range & state
    return ok, kind


def _table_blocks(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int,
    block_state: torch.Tensor | None, errors: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Physical block and readability of each logical block [batch, n]; records violations."""
    batch, max_blocks = block_tables.shape
    lens = seq_lens.long().cpu()
    n = int((lens.max().item() + block_size - 1) // block_size) if batch else 0
    lbs = torch.arange(n)
    blk = torch.full((batch, n), -1, dtype=torch.long)
    width = min(n, max_blocks)
    blk[:, :width] = block_tables[:, :width].long().cpu()
    needed = lbs[None, :] < (lens[:, None] + block_size - 1) // block_size
    ok, kind = _block_status(blk, num_blocks, None if block_state is None else block_state.cpu())
    if errors is not None:
        bad = needed & (kind != 0)
        seq, lb = bad.nonzero(as_tuple=True)
        rows = torch.stack([seq, lb, blk[seq, lb], torch.full_like(seq, -1), kind[seq, lb]], 1)
        record_errors(errors, rows.reshape(-1, ERROR_FIELDS))
    return blk.clamp(0, num_blocks - 1), ok & needed


def _gather(cache: torch.Tensor, blk: torch.Tensor, length: int, block_size: int, scale):
    """K or V of positions [0, length) of each row of `blk` [rows, n] as float32."""
    pos = torch.arange(length)
    phys = blk[:, pos // block_size].to(cache.device)
    return cache[phys, (pos % block_size).to(cache.device)].float() * scale


def paged_decode_ref(
    q, k_cache, v_cache, block_tables, seq_lens, scale=None, block_size=None, *,
    k_scale=None, v_scale=None, block_state=None, errors=None,
) -> torch.Tensor:  # fmt: skip
    """Reference for `paged_decode`: masked softmax attention over gathered K/V."""
    num_blocks, slots, kv_heads, head_dim = k_cache.shape
    bs = slots if block_size is None else int(block_size)
    batch, q_heads, _ = q.shape
    blk, ok = _table_blocks(block_tables, seq_lens, bs, num_blocks, block_state, errors)
    length = blk.shape[1] * bs
    if length == 0:
        return torch.zeros_like(q)
    pos = torch.arange(length)
    readable = ok[:, pos // bs] & (pos[None, :] < seq_lens.long().cpu()[:, None])
    k = _gather(k_cache, blk, length, bs, _scale_value(k_scale))  # [B, L, Hkv, D]
    v = _gather(v_cache, blk, length, bs, _scale_value(v_scale))
    # Never read past a sequence's end, as the kernels do not: those slots may hold anything
    # (the poison, NaN, in guard mode), and 0 * NaN would reach the output.
    v = v.masked_fill(~readable.to(v.device)[:, :, None, None], 0.0)
    qf = q.float().view(batch, kv_heads, q_heads // kv_heads, head_dim)
    s = torch.einsum("bhgd,blhd->bhgl", qf, k) * default_scale(head_dim, scale)
    s = s.masked_fill(~readable.to(s.device)[:, None, None, :], NEG_INF)
    out = _softmax_weighted(s, v, "bhgl,blhd->bhgd")
    return out.reshape(batch, q_heads, head_dim).to(q.dtype)


def _softmax_weighted(s: torch.Tensor, v: torch.Tensor, equation: str) -> torch.Tensor:
    """softmax(s) @ v over the last axis of `s`; rows with no readable key give zeros."""
    m = s.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp(s - m)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    return torch.einsum(equation, p, v)


def paged_prefill_ref(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=None, block_size=None,
    *, k_scale=None, v_scale=None, block_state=None, errors=None,
) -> torch.Tensor:  # fmt: skip
    """Reference for `paged_prefill`: causal attention of the new tokens over prefix + self."""
    num_blocks, slots, kv_heads, head_dim = k_cache.shape
    bs = slots if block_size is None else int(block_size)
    q_heads = q.shape[1]
    group = q_heads // kv_heads
    starts = query_start_loc.long().cpu().tolist()
    lens = seq_lens.long().cpu()
    new = torch.tensor([starts[i + 1] - starts[i] for i in range(len(lens))], dtype=torch.long)
    # blocks of sequences without new tokens are never read, so never checked
    lens_read = torch.where(new > 0, lens, 0)
    blk, ok = _table_blocks(block_tables, lens_read, bs, num_blocks, block_state, errors)
    out = torch.zeros_like(q)
    sm_scale = default_scale(head_dim, scale)
    ks, vs = _scale_value(k_scale), _scale_value(v_scale)
    for i, length in enumerate(lens.tolist()):
        n = int(new[i])
        if n == 0:
            continue
        k = _gather(k_cache, blk[i : i + 1], length, bs, ks)[0]  # [L, Hkv, D]
        v = _gather(v_cache, blk[i : i + 1], length, bs, vs)[0]
        pos = torch.arange(length)
        qpos = length - n + torch.arange(n)
        mask = (pos[None, :] <= qpos[:, None]) & ok[i, pos // bs][None, :]
        v = v.masked_fill(~ok[i, pos // bs].to(v.device)[:, None, None], 0.0)
        qi = q[starts[i] : starts[i + 1]].float().view(n, kv_heads, group, head_dim)
        s = torch.einsum("nhgd,lhd->hgnl", qi, k) * sm_scale
        s = s.masked_fill(~mask.to(s.device), NEG_INF)
        o = _softmax_weighted(s, v, "hgnl,lhd->nhgd")  # [n, Hkv, G, D]
        out[starts[i] : starts[i + 1]] = o.reshape(n, q_heads, head_dim).to(q.dtype)
    return out


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor | None):
    """`x` converted to the cache dtype; fp8 caches store x / scale, clamped to the finite range."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / _scale_value(scale)).clamp(-limit, limit).to(dtype)


def store_kv_ref(
    key, value, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None,
    block_size=None, block_state=None, errors=None,
) -> None:  # fmt: skip
    """Reference for `store_kv`: cache[slot // slots, slot % slots] = key/value; -1 skips."""
    num_blocks, slots = k_cache.shape[:2]
    bs = slots if block_size is None else int(block_size)
    slot = slot_mapping.long()
    blk = torch.div(slot, slots, rounding_mode="floor")
    off = slot % slots
    write = slot != -1
    in_range = (slot >= 0) & (blk < num_blocks)
    ok = write & in_range
    if block_state is not None or errors is not None:
        _, kind = _block_status(blk, num_blocks, block_state)
        kind = torch.where(in_range & (kind == 0) & (off >= bs), KIND_SLOT_OVERFLOW, kind)
        kind = torch.where(write, kind, 0)
        ok = ok & (kind == 0)
        if errors is not None:
            (tok,) = (kind != 0).nonzero(as_tuple=True)
            minus = torch.full_like(tok, -1)
            rows = torch.stack([tok, minus, blk[tok], off[tok], kind[tok]], 1)
            record_errors(errors, rows.cpu())
    idx = ok.nonzero(as_tuple=True)[0]
    k_cache[blk[idx], off[idx]] = quantize(key[idx], k_cache.dtype, k_scale)
    v_cache[blk[idx], off[idx]] = quantize(value[idx], v_cache.dtype, v_scale)


def copy_blocks_ref(kv_cache, src, dst, *, block_state=None, errors=None) -> None:
    """Reference for `copy_blocks`: kv_cache[:, :, dst[i]] = kv_cache[:, :, src[i]] for all i."""
    num_blocks = kv_cache.shape[2]
    src_l, dst_l = src.long().cpu(), dst.long().cpu()
    ok = torch.ones_like(src_l, dtype=torch.bool)
    if block_state is not None or errors is not None:
        ok_s, kind_s = _block_status(src_l, num_blocks, block_state)
        ok_d, kind_d = _block_status(dst_l, num_blocks, block_state)
        ok = ok_s & ok_d
        if errors is not None:
            rows = []
            for blocks, kind in ((src_l, kind_s), (dst_l, kind_d)):
                (pair,) = (kind != 0).nonzero(as_tuple=True)
                minus = torch.full_like(pair, -1)
                rows.append(torch.stack([pair, minus, blocks[pair], minus, kind[pair]], 1))
            record_errors(errors, torch.cat(rows))
    idx = ok.nonzero(as_tuple=True)[0]
    s, d = src_l[idx].to(kv_cache.device), dst_l[idx].to(kv_cache.device)
    kv_cache[:, :, d] = kv_cache[:, :, s]


def guard_scan_ref(kv_cache: torch.Tensor, canary: int, int_dtype: torch.dtype, blocks=None):
    """Reference for `guard_scan`: ids of blocks whose guard slot differs from the canary."""
    ints = kv_cache.view(int_dtype)
    ids = torch.arange(kv_cache.shape[2]) if blocks is None else blocks.long().cpu()
    guard = ints[:, :, ids.to(kv_cache.device), -1]  # [L, 2, n, H, D]
    bad = (guard != canary).flatten(3).any(-1).any(0).any(0)
    return sorted(ids[bad.cpu()].tolist())


def audit_table_ref(table: torch.Tensor, expected: torch.Tensor, answer: torch.Tensor) -> None:
    """kernels/audit.py's comparison in torch: bad entries, the first's flat index (rows *
    width: none) and value, and the rows with any."""
    diff = table.long() != expected.long()
    flat = table.reshape(-1)
    where = diff.reshape(-1).nonzero()
    first = int(where[0]) if len(where) else diff.numel()
    found = int(flat[first]) if len(where) else 0
    answer[:4] = torch.tensor(
        [int(diff.sum()), first, found, int(diff.any(dim=1).sum())], dtype=torch.int64
    )
