"""One hash finalizer per language: allocator/prefix.py's `fmix64` (numpy and Python ints), the C
core's (csrc/core.h, through the extension's `fmix64`) and the kernels' Triton `fmix64` (with its
torch reference) give the same bits, and 0 is reserved for "none" in all of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.allocator import _native, kvbits
from kvscope.allocator.prefix import fmix64
from kvscope.kernels import block_digests
from kvscope.kernels.digest import _finish_triton, fmix64_reference
from tests.kernels_cases import TRITON_TARGETS, use_torch, use_triton_on

MASK64 = (1 << 64) - 1
EDGES = [0, 1, 2, 2**32, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1]
VALUES = EDGES + [int(x) for x in np.random.default_rng(29).integers(0, 2**64, 64, np.uint64)]
# MurmurHash3's fmix64 of these inputs (the first is its published value of 1): the index keys of
# segments written before the finalizer had one convention for 0 are these same keys.
KNOWN = {
    1: 0xB456_BCFC_34C2_CB2C,
    2**63: 0x8F78_0810_AF31_A493,
    2**64 - 1: 0x64B5_720B_4B82_5F21,
    0x0123_4567_89AB_CDEF: 0x87CB_FBFE_8902_2CEA,
}


def as_int64(values: list[int]) -> torch.Tensor:
    """u64 values as the int64 tensor holding their bits."""
    return torch.tensor(np.asarray(values, np.uint64).view(np.int64))


def test_numpy_keeps_murmur_and_reserves_zero():
    # GIVEN known MurmurHash3 outputs WHEN finalized as ints and as an array
    got = fmix64(np.asarray(list(KNOWN), np.uint64)).tolist()
    # THEN both give them, and 0 (the "none" of an index slot and a digest) becomes 1
    assert [fmix64(x) for x in KNOWN] == list(KNOWN.values()) == got
    assert fmix64(0) == 1 and fmix64(np.zeros(3, np.uint64)).tolist() == [1, 1, 1]


def test_ints_and_arrays_agree():
    # GIVEN edge and random values, as Python ints (negative ones too) and as uint64 / int64 arrays
    ints = [fmix64(v) for v in VALUES]
    array = np.asarray(VALUES, np.uint64)
    # WHEN finalized each way THEN the bits are the same and never 0
    assert fmix64(array).tolist() == ints == fmix64(array.view(np.int64)).tolist()
    assert [fmix64(v - (1 << 64)) for v in VALUES] == ints
    assert 0 not in ints


def test_the_c_core_gives_the_same_bits():
    # GIVEN the built extension's finalizer (core.h's)
    # WHEN it runs on the values THEN it agrees with numpy bit for bit
    assert [_native.fmix64(v) for v in VALUES] == fmix64(np.asarray(VALUES, np.uint64)).tolist()
    assert _native.fmix64(-1) == fmix64(MASK64)


def test_the_torch_reference_gives_the_same_bits():
    # GIVEN the values as int64 bits WHEN finalized by the Triton function's torch reference
    got = [v & MASK64 for v in fmix64_reference(as_int64(VALUES)).tolist()]
    # THEN they are numpy's
    assert got == [fmix64(v) for v in VALUES]


@pytest.mark.parametrize("device", TRITON_TARGETS)
def test_triton_gives_the_same_bits(monkeypatch, device):
    # GIVEN the values as int64 bits on the Triton target
    use_triton_on(monkeypatch, device)
    raw = as_int64(VALUES).to(device)
    # WHEN the Triton finalizer runs on each (one-row sums: the value itself)
    got = [v & MASK64 for v in _finish_triton(raw.reshape(-1, 1)).tolist()]
    # THEN it agrees with numpy bit for bit
    assert got == [fmix64(v) for v in VALUES]


@pytest.mark.parametrize("device", TRITON_TARGETS)
def test_triton_finishes_a_wrapping_sum(monkeypatch, device):
    # GIVEN rows of partial sums that overflow int64
    use_triton_on(monkeypatch, device)
    rows = as_int64(VALUES[:60]).reshape(12, 5)
    # WHEN each row is added up and finalized on the Triton target
    got = [v & MASK64 for v in _finish_triton(rows.to(device)).tolist()]
    # THEN it is the finalizer of the wrapping sum
    assert got == [fmix64(int(s)) for s in rows.sum(1).tolist()]


def test_an_all_zero_block_digests_to_one_everywhere(monkeypatch):
    # GIVEN a block whose K/V is all zeros (its raw sum is 0)
    use_torch(monkeypatch)
    kv = torch.zeros(1, 2, 3, 4, 2, 8)
    # WHEN digested by the kernels' torch path and by kvbits's numpy path
    bits = kvbits.KVBits(kv.numpy().view(np.int32), "float32")
    # THEN both finalize 0 to 1, whose high half (the record's `kv_digest`) is still 0
    assert block_digests(kv, [1], 4) == kvbits.block_digests(bits, np.array([1]), 4) == [1]
