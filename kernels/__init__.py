"""Paged-attention kernels for kvscope: Triton on CUDA, a plain-torch reference on CPU.

`KVSCOPE_KERNELS=triton|torch` forces a backend (see `backend`); guard mode is on when
`block_state` or `errors` is passed (see `errors` for the buffer layout, `guard` for the canary).

Each public name is imported from its module when first used (PEP 562): a process that only
fills guard slots (a guard-mode pool) or reads the canary's bits imports neither Triton nor
the attention kernels.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module it lives in.
_NAME_TO_MODULE = {
    "audit_table": "audit",
    "audit_table_ref": "reference",
    "backend_name": "backend",
    "use_triton": "backend",
    "copy_blocks": "copy",
    "paged_decode": "decode",
    "block_digests": "digest",
    "ERROR_FIELDS": "errors",
    "KIND_NAMES": "errors",
    "clear_errors": "errors",
    "decode_errors": "errors",
    "new_error_buffer": "errors",
    "num_errors": "errors",
    "CANARY_BITS": "canary",
    "canary_dtype": "guard",
    "canary_value": "guard",
    "fill_guard": "guard",
    "guard_scan": "guard",
    "paged_prefill": "prefill",
    "copy_blocks_ref": "reference",
    "guard_scan_ref": "reference",
    "paged_decode_ref": "reference",
    "paged_prefill_ref": "reference",
    "store_kv_ref": "reference",
    "store_kv": "store",
}

__all__ = [
    "CANARY_BITS",
    "ERROR_FIELDS",
    "KIND_NAMES",
    "audit_table",
    "audit_table_ref",
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

if TYPE_CHECKING:
    from .audit import audit_table
    from .backend import backend_name, use_triton
    from .canary import CANARY_BITS
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
    from .guard import canary_dtype, canary_value, fill_guard, guard_scan
    from .prefill import paged_prefill
    from .reference import (
        audit_table_ref,
        copy_blocks_ref,
        guard_scan_ref,
        paged_decode_ref,
        paged_prefill_ref,
        store_kv_ref,
    )
    from .store import store_kv


def __getattr__(name: str) -> Any:
    module = _NAME_TO_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
