"""Paged-attention kernels for kvscope: Triton on CUDA, a plain-torch reference on CPU.

`KVSCOPE_KERNELS=triton|torch` forces a backend (see `backend`); guard mode is on when
`block_state` or `errors` is passed (see `errors` for the buffer layout, `guard` for the canary).
"""

from .backend import backend_name, use_triton
from .copy import copy_blocks
from .decode import paged_decode
from .digest import block_digests
from .errors import (
    ERROR_FIELDS,
    KIND_NAMES,
    clear_errors,
    decode_errors,
    new_error_buffer,
    num_errors,
)
from .guard import CANARY_BITS, canary_dtype, canary_value, fill_guard, guard_scan
from .prefill import paged_prefill
from .reference import (
    copy_blocks_ref,
    guard_scan_ref,
    paged_decode_ref,
    paged_prefill_ref,
    store_kv_ref,
)
from .store import store_kv

__all__ = [
    "CANARY_BITS",
    "ERROR_FIELDS",
    "KIND_NAMES",
    "backend_name",
    "block_digests",
    "canary_dtype",
    "canary_value",
    "clear_errors",
    "copy_blocks",
    "copy_blocks_ref",
    "decode_errors",
    "fill_guard",
    "guard_scan",
    "guard_scan_ref",
    "new_error_buffer",
    "num_errors",
    "paged_decode",
    "paged_decode_ref",
    "paged_prefill",
    "paged_prefill_ref",
    "store_kv",
    "store_kv_ref",
    "use_triton",
]
