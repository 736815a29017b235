"""A pool's KV data read as integer bits with numpy: digests, poison and canaries without torch.

`kvscope check` and `kvscope analyze` check the data of a CPU pool's data file or of a dump
written with `--with-data`; both are bytes on disk, mapped read-only. Reading them through
numpy keeps torch (seconds to import) out of the reading verbs. The canary's bits are
kernels/canary.py's (a module that imports nothing); the rest of the arithmetic is the kernels'
own (kernels/digest.py, kernels/checks.py poison_bits), restated here because the allocator
must not import the kernels' torch (the digests' finalizer is allocator/prefix.py's);
tests/test_kvbits.py proves both give the same digests, the same poison and canary bits, and
the same findings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope.allocator.geometry import ELEMENT_BYTES
from kvscope.allocator.layout import SegmentView
from kvscope.allocator.prefix import fmix64
from kvscope.kernels.canary import CANARY_BITS

# Each element is read as the integer of its width (kernels/digest.py's int_view).
INT_DTYPES: dict[int, type[np.integer]] = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
# The bits of NaN in each KV dtype, as torch writes it (`torch.full(..., nan)`): the poison a
# freed block's token slots hold in guard mode.
NAN_BITS = {"float32": 0x7FC0_0000, "float16": 0x7E00, "bfloat16": 0x7FC0, "float8_e4m3fn": 0x7F}
# kernels/digest.py's coefficients: coef(i) = (i * DIGEST_MUL + DIGEST_ADD) | 1 (mod 2^64).
DIGEST_MUL = 0x5851_F42D_4C95_7F2D
DIGEST_ADD = 0x1405_7B7E_F767_814F
# Elements digested at once (blocks are taken in chunks of about this size).
_CHUNK_ELEMS = 1 << 22


@dataclass(frozen=True)
class KVBits:
    """The KV tensor's bits `[layers, 2, blocks, slots, heads, dim]`, and its element dtype."""

    bits: np.ndarray
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.bits.shape)


def kv_bits(view: SegmentView, data: np.ndarray | bytes | bytearray) -> KVBits:
    """The KV data bytes of a pool (a dump's, or a CPU pool's data file) as its bits; read-only."""
    h = view.h
    dtype = bytes(h["dtype"]).decode(errors="replace").strip("\0")
    width = ELEMENT_BYTES[dtype]
    shape = (
        int(h["num_layers"]),
        2,
        view.layout.num_blocks,
        int(h["slots_per_block"]),
        int(h["num_kv_heads"]),
        int(h["head_dim"]),
    )
    raw = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    need = int(np.prod(shape)) * width
    assert len(raw) >= need, "the KV data is shorter than the pool's geometry"
    return KVBits(raw[:need].view(INT_DTYPES[width]).reshape(shape), dtype)


def block_digests(kv: KVBits, ids: np.ndarray, block_size: int) -> list[int]:
    """Digest (u64) of each block of `ids` over its first `block_size` slots: kernels/digest.py's
    `block_digests`, in wrapping int64 arithmetic as there."""
    ids = np.asarray(ids, np.int64)
    layers, _, _, _, heads, head_dim = kv.shape
    per_block = layers * 2 * block_size * heads * head_dim
    coef = (np.arange(per_block, dtype=np.int64) * DIGEST_MUL + DIGEST_ADD) | 1
    step = max(1, _CHUNK_ELEMS // per_block)
    out: list[np.ndarray] = []
    with np.errstate(over="ignore"):
        for k in range(0, len(ids), step):
            part = ids[k : k + step]
            # [L, 2, n, bs, H, D] -> [n, L * 2 * bs * H * D]: the kernel's element order.
            x = kv.bits[:, :, part, :block_size].transpose(2, 0, 1, 3, 4, 5).reshape(len(part), -1)
            out.append((x.astype(np.int64) * coef).sum(1, dtype=np.int64))
    return fmix64(np.concatenate(out)).tolist() if out else []


def can_poison(kv: KVBits) -> bool:
    """Freed blocks are poisoned only in floating-point caches (all of ELEMENT_BYTES's)."""
    return kv.dtype in NAN_BITS


def blank_block(kv: KVBits, fill: int) -> KVBits:
    """A one-block cache of this geometry whose every element holds `fill` (bits)."""
    shape = (*kv.shape[:2], 1, *kv.shape[3:])
    return KVBits(np.full(shape, fill, kv.bits.dtype), kv.dtype)


def poisoned(kv: KVBits, ids: np.ndarray | list[int], block_size: int) -> np.ndarray:
    """Which elements of the token slots of blocks `ids` hold the poison: bool, [block, slot,
    the slot's elements in every layer, K and V]."""
    idx = np.asarray(ids, np.int64)
    same = kv.bits[:, :, idx, :block_size] == NAN_BITS[kv.dtype]  # [L, 2, n, bs, H, D]
    return same.transpose(2, 3, 0, 1, 4, 5).reshape(len(idx), block_size, -1)


def broken_canaries(kv: KVBits, ids: np.ndarray | None = None) -> list[int]:
    """Blocks (of `ids`, or all) whose guard slot no longer holds the canary."""
    canary = CANARY_BITS[kv.bits.itemsize]
    if ids is None:
        guard = kv.bits[:, :, :, -1]  # [L, 2, n, H, D]
        found = np.arange(kv.shape[2])
    else:
        found = np.asarray(ids, np.int64)
        guard = kv.bits[:, :, found, -1]
    bad = (guard != canary).any(axis=(0, 1, 3, 4))
    return sorted(found[bad].tolist())
