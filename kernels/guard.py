"""Guard slots: `fill_guard` writes the canary (kernels/canary.py) into them and `guard_scan`
checks it in one pass (`guard_flags`: the same check, its answer left on the device).

Triton is imported only when a scan runs (kernels/guardscan.py on the Triton backend, the torch
reference otherwise): filling the guard slots, what every guard-mode pool does, needs torch
alone.
"""

from __future__ import annotations

import torch

from . import backend
from .canary import CANARY_BITS, canary_signed

CANARY_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def canary_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype through which the guard slots of a `dtype` cache are read."""
    return CANARY_DTYPES[torch.empty((), dtype=dtype).element_size()]


def canary_value(dtype: torch.dtype) -> int:
    """The canary bit pattern for a cache of `dtype`, as an integer of `canary_dtype(dtype)`."""
    return CANARY_BITS[torch.empty((), dtype=dtype).element_size()]


def canary_loaded(dtype: torch.dtype) -> int:
    """The canary as a kernel reading the guard slots through `canary_dtype` loads it (int16
    and int32 are signed: a constant at or above the sign bit must be given as negative)."""
    return canary_signed(torch.empty((), dtype=dtype).element_size())


def fill_guard(kv_cache: torch.Tensor, blocks: torch.Tensor | list[int] | None = None) -> None:
    """Write the canary into the last slot of the given blocks (all blocks when None)."""
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, "[layers, 2, blocks, slots, heads, dim]"
    ints = kv_cache.view(canary_dtype(kv_cache.dtype))
    value = canary_value(kv_cache.dtype)
    with backend.serial_cpu(kv_cache):
        if blocks is None:
            ints[:, :, :, -1] = value
        else:
            # index_fill_ on the guard slots' view: an assignment through an index tensor
            # uploads the value from the host, which waits for the GPU
            ints[:, :, :, -1].index_fill_(2, backend.block_ids(blocks, kv_cache.device), value)


def guard_scan(kv_cache: torch.Tensor, blocks: torch.Tensor | list[int] | None = None) -> list[int]:
    """Ids of blocks (all, or only `blocks`) whose guard slot no longer holds the canary."""
    int_dtype = canary_dtype(kv_cache.dtype)
    canary = canary_value(kv_cache.dtype)
    if not backend.use_triton(kv_cache):
        # Here, not at the top: the references share the kernels' error buffer (Triton).
        from . import reference

        ids = None if blocks is None else backend.block_ids(blocks, torch.device("cpu"))
        with backend.serial_cpu(kv_cache):
            return reference.guard_scan_ref(kv_cache, canary, int_dtype, ids)
    ids = None if blocks is None else backend.block_ids(blocks, kv_cache.device)
    bad = _scan_triton(kv_cache, ids)
    hits = bad.nonzero(as_tuple=True)[0]
    found = hits if ids is None else ids[hits]
    return sorted(found.tolist())


def guard_flags(kv_cache: torch.Tensor, blocks: torch.Tensor | list[int]) -> torch.Tensor:
    """int32 [len(blocks)] on the cache's device, nonzero where the block's guard slot no longer
    holds the canary; launched, not waited for (read it when the answer is needed)."""
    ids = backend.block_ids(blocks, kv_cache.device)
    if ids.numel() == 0:
        return torch.zeros(0, dtype=torch.int32, device=kv_cache.device)
    if not backend.use_triton(kv_cache):
        ints = kv_cache.view(canary_dtype(kv_cache.dtype))
        with backend.serial_cpu(kv_cache):
            guard = ints[:, :, ids, -1]  # [L, 2, n, H, D]
            bad = (guard != canary_value(kv_cache.dtype)).flatten(3).any(-1).any(0).any(0)
            return bad.to(torch.int32)
    return _scan_triton(kv_cache, ids)


def _scan_triton(kv_cache: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """The scan kernel's flags, one per block of `ids` (all blocks when None)."""
    from .guardscan import scan_triton

    return scan_triton(kv_cache, ids, canary_dtype(kv_cache.dtype), canary_loaded(kv_cache.dtype))
