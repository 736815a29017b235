"""Shared builders for the kernel tests: paged caches with shuffled blocks, and dense truths."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from kvscope.kernels.backend import interpreting
from kvscope.kernels.digest import DIGEST_ADD, DIGEST_MUL, int_view

HAS_CUDA = torch.cuda.is_available()
INTERPRETING = interpreting()

# where the Triton kernels run: through the interpreter on CPU, natively on CUDA. Triton reads
# TRITON_INTERPRET once, when imported, so the interp cases run in a fresh process started by
# test_kernels_interpreter.py (or directly under `TRITON_INTERPRET=1 pytest ...`).
TRITON_TARGETS = [
    pytest.param(
        "cpu",
        id="interp",
        marks=pytest.mark.skipif(
            not INTERPRETING, reason="runs in a TRITON_INTERPRET=1 subprocess"
        ),
    ),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")],
    ),
]


def random_pool(layers, block_size, heads, dim, dtype, slots, device, num_blocks=7):
    """A random pool tensor [layers, 2, blocks, slots, heads, dim], canaries in its guard slots
    when it has them (slots > block_size)."""
    from kvscope.kernels import fill_guard

    kv = torch.randn(layers, 2, num_blocks, slots, heads, dim).to(dtype).to(device)
    if slots > block_size:
        fill_guard(kv)
    return kv


def use_triton_on(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Force the Triton backend for the rest of the test."""
    monkeypatch.setenv("KVSCOPE_KERNELS", "triton")


def use_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the torch reference backend for the rest of the test."""
    monkeypatch.setenv("KVSCOPE_KERNELS", "torch")


@dataclass
class PagedCase:
    """A paged K/V cache holding `seq_lens` tokens per sequence in shuffled physical blocks."""

    k_cache: torch.Tensor  # [blocks, slots, kv_heads, dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [batch, max_blocks], -1 unused
    seq_lens: torch.Tensor  # int32 [batch]
    block_size: int
    k_scale: float | None = None
    v_scale: float | None = None

    @property
    def num_blocks(self) -> int:
        return self.k_cache.shape[0]


def make_case(
    seq_lens: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    slots: int | None = None,
    spare_blocks: int = 3,
    seed: int = 0,
    fp8: bool = False,
) -> PagedCase:
    """Random K/V in shuffled blocks; the last block of each sequence partly filled."""
    gen = torch.Generator().manual_seed(seed)
    slots = slots or block_size
    need = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(max(need), 1) + 1  # one spare column of -1
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    shape = (num_blocks, slots, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    k_scale = v_scale = None
    if fp8:
        k_scale, v_scale = 0.02, 0.03
        k = (k / k_scale).to(torch.float8_e4m3fn)
        v = (v / v_scale).to(torch.float8_e4m3fn)
    else:
        k, v = k.to(dtype), v.to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedCase(
        k.to(device), v.to(device), tables.to(device), lens.to(device), block_size,
        k_scale, v_scale,
    )  # fmt: skip


def gathered(case: PagedCase, i: int, cache: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Sequence i's K or V, [len, kv_heads, dim] float64, read block by block."""
    n = int(case.seq_lens[i])
    rows = []
    for pos in range(0, n, case.block_size):
        blk = int(case.block_tables[i, pos // case.block_size])
        take = min(case.block_size, n - pos)
        rows.append(cache[blk, :take].double().cpu())
    out = torch.cat(rows) if rows else cache.new_zeros((0, *cache.shape[2:])).double().cpu()
    return out * (scale if scale is not None else 1.0)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_from: int | None):
    """Plain softmax attention in float64: q [n, Hq, D], k/v [L, Hkv, D] -> [n, Hq, D].

    With `causal_from`, query j sits at position causal_from + j and sees keys <= that.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double().cpu(), k) / math.sqrt(q.shape[-1])
    if causal_from is not None:
        qpos = causal_from + torch.arange(q.shape[0])
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qpos[:, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN never passes."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def slot_digests(kv: torch.Tensor, ids: list[int], block_size: int) -> list[list[int]]:
    """Each slot's raw digest, in torch ops: its elements in every layer, K and V, one row after
    the other, with the digest's coefficients (allocator/csrc/provenance.c prov_kv_hash)."""
    layers, _, _, _, heads, dim = kv.shape
    x = int_view(kv)[:, :, ids, :block_size].permute(2, 3, 0, 1, 4, 5)
    x = x.reshape(len(ids), block_size, layers * 2 * heads * dim).to(torch.int64)
    coef = (torch.arange(x.shape[-1], dtype=torch.int64) * DIGEST_MUL + DIGEST_ADD) | 1
    return (x * coef).sum(-1).tolist()
