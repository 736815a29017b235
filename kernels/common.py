"""Argument checks and the guard/fp8 launch arguments shared by the attention launchers."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import error_capacity

FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether `dtype` is one of torch's 8-bit float types (an fp8 KV cache)."""
    return dtype in FP8_DTYPES


@dataclass
class KernelArgs:
    """Validated attention inputs with the defaults filled in."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    block_size: int
    k_scale: float | torch.Tensor | None
    v_scale: float | torch.Tensor | None
    block_state: torch.Tensor | None
    errors: torch.Tensor | None


@dataclass
class GuardArgs:
    """Tensors and flags for the guard and fp8 parts of a launch (dummies when off)."""

    state: torch.Tensor
    errors: torch.Tensor
    capacity: int
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    fp8: bool
    guard: bool
    has_state: bool
    has_errors: bool


def default_scale(head_dim: int, scale: float | None) -> float:
    """The softmax scale: `scale`, or 1/sqrt(head_dim)."""
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def scale_tensor(value: float | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A float32 [1] tensor holding an fp8 dequantisation scale (1.0 when None); no host sync."""
    if value is None:
        value = 1.0
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float32).reshape(1)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def check_attention_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None,
    block_size: int | None,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    block_state: torch.Tensor | None,
    errors: torch.Tensor | None,
) -> KernelArgs:
    """Assert shapes, dtypes and strides the Triton launchers rely on; fill the defaults."""
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        "cache is [blocks, slots, heads, dim]"
    )
    num_blocks, slots, kv_heads, head_dim = k_cache.shape
    assert q.shape[-1] == head_dim and q.shape[-2] % kv_heads == 0, "q_heads % kv_heads != 0"
    assert q.dtype in (torch.float16, torch.bfloat16), "Triton kernels take fp16/bf16 queries"
    assert k_cache.dtype in (q.dtype, *FP8_DTYPES) and v_cache.dtype == k_cache.dtype
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of 2"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32
    assert block_tables.stride(-1) == 1 and seq_lens.is_contiguous()
    block_size = slots if block_size is None else int(block_size)
    assert 1 <= block_size <= slots, f"block_size {block_size} not in [1, {slots}]"
    if block_state is not None:
        assert block_state.shape == (num_blocks,) and block_state.element_size() == 1
    if errors is not None:
        error_capacity(errors)
    return KernelArgs(
        q, k_cache, v_cache, block_tables, seq_lens, default_scale(head_dim, scale),
        block_size, k_scale, v_scale, block_state, errors,
    )  # fmt: skip


def guard_args(a: KernelArgs) -> GuardArgs:
    """Guard and fp8 launch arguments; absent tensors are replaced by a harmless dummy."""
    device = a.q.device
    fp8 = is_fp8(a.k_cache.dtype)
    dummy_f = a.q if not fp8 else scale_tensor(1.0, device)
    return GuardArgs(
        state=a.block_state.view(torch.uint8) if a.block_state is not None else a.seq_lens,
        errors=a.errors if a.errors is not None else a.seq_lens,
        capacity=error_capacity(a.errors) if a.errors is not None else 0,
        k_scale=scale_tensor(a.k_scale, device) if fp8 else dummy_f,
        v_scale=scale_tensor(a.v_scale, device) if fp8 else dummy_f,
        fp8=fp8,
        guard=a.block_state is not None or a.errors is not None,
        has_state=a.block_state is not None,
        has_errors=a.errors is not None,
    )
