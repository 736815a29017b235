"""The guard slot's canary, by element width; this module imports nothing.

In guard mode `slots_per_block = block_size + 1` and the last slot of every block, in every
layer, K and V, holds the canary: every element's bits equal `CANARY_BITS[element_size]`, read
through the integer type of the same width (kernels/guard.py's `canary_dtype`):

- 2-byte caches (bf16, fp16): `0x7FA5` - a NaN in both bf16 and fp16;
- 1-byte caches (fp8 e4m3fn): `0x7F` - e4m3fn's NaN;
- 4-byte caches (fp32): `0x7FA57FA5` - a NaN.

A NaN canary makes an attention read that strays into a guard slot poison its output loudly.
The pool's C core and the numpy readers of the allocator (allocator/kvbits.py) take the bits
from here without importing torch or Triton.
"""

CANARY_BITS = {1: 0x7F, 2: 0x7FA5, 4: 0x7FA5_7FA5}


def canary_signed(width: int) -> int:
    """The canary of `width`-byte elements as a signed integer of that width reads it (int16 and
    int32 are signed: a constant at or above the sign bit is negative)."""
    value = CANARY_BITS[width]
    if width > 1 and value >= 1 << (8 * width - 1):
        value -= 1 << (8 * width)
    return value
