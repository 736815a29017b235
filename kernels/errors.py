"""Guard-mode error buffer: where kernels record block-table and slot violations.

Layout of the int32 buffer made by `new_error_buffer(capacity)`:
`[count, capacity, record_0 ..., record_{capacity-1}]`, each record `ERROR_FIELDS` int32s
`(sequence, logical_block, physical_block, slot, kind)`. `count` counts every violation seen,
also those past `capacity`, which are dropped. Usage::

    errors = new_error_buffer(device=q.device)
    out = paged_decode(q, k, v, tables, lens, block_state=state, errors=errors)
    for e in decode_errors(errors): ...  # {"sequence", "logical_block", ...}
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ERROR_FIELDS = 5
HEADER_FIELDS = 2

KIND_OUT_OF_RANGE = 1
KIND_NOT_ALLOCATED = 2
KIND_SLOT_OVERFLOW = 3
KIND_NAMES = {
    KIND_OUT_OF_RANGE: "out_of_range",
    KIND_NOT_ALLOCATED: "not_allocated",
    KIND_SLOT_OVERFLOW: "slot_overflow",
}


def new_error_buffer(capacity: int = 256, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed error buffer that holds up to `capacity` violation records."""
    assert capacity >= 1
    buf = torch.zeros(HEADER_FIELDS + capacity * ERROR_FIELDS, dtype=torch.int32, device=device)
    buf[1] = capacity
    return buf


def error_capacity(errors: torch.Tensor) -> int:
    """How many records `errors` can hold (from its size, so it needs no device read)."""
    assert errors.dtype == torch.int32 and errors.dim() == 1 and errors.is_contiguous()
    return (errors.numel() - HEADER_FIELDS) // ERROR_FIELDS


def clear_errors(errors: torch.Tensor) -> None:
    """Reset the buffer so it can be reused for the next launch."""
    errors[0] = 0
    errors[HEADER_FIELDS:] = 0


def num_errors(errors: torch.Tensor) -> int:
    """Violations recorded since the buffer was made or cleared (dropped ones included)."""
    return int(errors[0].item())


def decode_errors(errors: torch.Tensor) -> list[dict[str, object]]:
    """The recorded violations as dicts {sequence, logical_block, physical_block, slot, kind}.

    `slot` is the offset inside the block for `store_kv` violations and -1 for attention reads;
    for `store_kv` and `copy_blocks` `sequence` is the token or pair index, `logical_block` -1.
    """
    # numpy on the host copy: this runs after every guarded step, where a tensor index and a
    # slice of an empty buffer cost the host several times what the read itself does
    host = errors.numpy() if errors.device.type == "cpu" else errors.detach().cpu().numpy()
    count = min(int(host[0]), (host.size - HEADER_FIELDS) // ERROR_FIELDS)
    if count <= 0:
        return []
    rows = host[HEADER_FIELDS : HEADER_FIELDS + count * ERROR_FIELDS].reshape(count, ERROR_FIELDS)
    records = []
    for seq, logical, physical, slot, kind in rows.tolist():
        records.append(
            {
                "sequence": seq,
                "logical_block": logical,
                "physical_block": physical,
                "slot": slot,
                "kind": KIND_NAMES.get(kind, f"unknown_{kind}"),
            }
        )
    records.sort(key=lambda r: (r["sequence"], r["logical_block"], r["physical_block"]))
    return records


def record_errors(errors: torch.Tensor, rows: torch.Tensor) -> None:
    """Append violation `rows` [n, ERROR_FIELDS] to `errors` (the torch references' writer)."""
    if rows.numel() == 0:
        return
    rows = rows.to(device=errors.device, dtype=torch.int32).view(-1, ERROR_FIELDS)
    start = int(errors[0].item())
    capacity = error_capacity(errors)
    keep = rows[: max(0, capacity - start)]
    if keep.shape[0]:
        lo = HEADER_FIELDS + start * ERROR_FIELDS
        errors[lo : lo + keep.numel()] = keep.reshape(-1)
    errors[0] = start + rows.shape[0]


@triton.jit
def _check_blocks(
    blk, valid, record, seq, lb, state_ptr, errors_ptr, num_blocks, error_capacity,
    HAS_STATE: tl.constexpr, HAS_ERRORS: tl.constexpr,
):  # fmt: skip
    """Guard mode, in a kernel: which of the `valid` table entries `blk` may be read.

    An entry must lie in [0, num_blocks) and, with a block-state array, be allocated. Each bad
    entry where `record` is set is written to the error buffer as (seq, lb, blk, -1, kind);
    callers set `record` on one reader per (sequence, logical block).
    """
    in_range = (blk >= 0) & (blk < num_blocks)
    kind = tl.where(in_range, 0, 1)  # KIND_OUT_OF_RANGE
    ok = valid & in_range
    if HAS_STATE:
        allocated = tl.load(state_ptr + blk, mask=ok, other=1) != 0
        kind = tl.where(ok & (allocated == 0), 2, kind)  # KIND_NOT_ALLOCATED
        ok = ok & allocated
    if HAS_ERRORS:
        rec = record & valid & (kind != 0)
        idx = tl.atomic_add(errors_ptr + lb * 0, lb * 0 + 1, mask=rec)
        keep = rec & (idx < error_capacity)
        rec_ptr = errors_ptr + 2 + idx * 5
        tl.store(rec_ptr, lb * 0 + seq, mask=keep)
        tl.store(rec_ptr + 1, lb, mask=keep)
        tl.store(rec_ptr + 2, blk, mask=keep)
        tl.store(rec_ptr + 3, lb * 0 - 1, mask=keep)
        tl.store(rec_ptr + 4, kind, mask=keep)
    return ok
