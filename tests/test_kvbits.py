"""`check` and `analyze` read a pool's KV data as bits with numpy (allocator/kvbits.py): the same
digests, poison and canaries as the kernels' torch path, hence the same findings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.allocator import integrity, kvbits
from kvscope.allocator.geometry import ELEMENT_BYTES
from kvscope.allocator.kvbits import KVBits, kv_bits
from kvscope.allocator.segment import data_path
from kvscope.allocator.snapshot import snapshot
from kvscope.kernels import block_digests
from kvscope.kernels import digest as kernel_digest
from kvscope.kernels.canary import canary_signed
from kvscope.kernels.checks import poison_bits
from kvscope.kernels.digest import int_view


def test_the_constants_are_the_kernels():
    # GIVEN the canaries (one table, kernels/canary.py), the kernels' digest coefficients, and
    # torch's NaN of each KV dtype
    # WHEN compared with kvbits's own copies THEN they are the same bits, and each canary is a
    # NaN of every KV dtype of its width (an attention read of a guard slot poisons its output)
    for name, width in ELEMENT_BYTES.items():
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]
        bits = torch.tensor([canary_signed(width)], dtype=ints).view(getattr(torch, name))
        assert torch.isnan(bits.float()).all(), name
    assert (kvbits.DIGEST_MUL, kvbits.DIGEST_ADD) == (
        kernel_digest.DIGEST_MUL,
        kernel_digest.DIGEST_ADD,
    )
    for name, width in ELEMENT_BYTES.items():
        nan = poison_bits(getattr(torch, name)) & ((1 << (8 * width)) - 1)
        assert kvbits.NAN_BITS[name] == nan, name
        assert np.dtype(kvbits.INT_DTYPES[width]).itemsize == width


def random_cache(dtype: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A KV cache of `dtype` holding random bits (NaNs and infinities included)."""
    width = ELEMENT_BYTES[dtype]
    gen = torch.Generator().manual_seed(seed)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]
    info = torch.iinfo(ints)
    bits = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(ints)
    return bits.view(getattr(torch, dtype))


@pytest.mark.parametrize(
    "dtype,layers,slots,heads,dim,block_size",
    [
        pytest.param("float16", 2, 5, 2, 8, 4, id="fp16-L2-bs4-guard"),
        pytest.param("bfloat16", 1, 16, 1, 63, 16, id="bf16-L1-bs16-D63"),
        pytest.param("float32", 3, 3, 2, 4, 3, id="fp32-L3-bs3"),
        pytest.param("float8_e4m3fn", 2, 9, 3, 5, 8, id="fp8-L2-bs8-guard"),
    ],
)
def test_digests_of_random_blocks_match_the_kernel(dtype, layers, slots, heads, dim, block_size):
    # GIVEN a cache of random bits, and the blocks to digest in an odd order with a repeat
    kv = random_cache(dtype, (layers, 2, 11, slots, heads, dim), seed=len(dtype))
    ids = np.array([10, 0, 3, 3, 7], np.int64)
    # WHEN the kernels' CPU path and numpy digest them
    want = block_digests(kv, ids.tolist(), block_size)
    got = kvbits.block_digests(KVBits(int_view(kv).numpy(), dtype), ids, block_size)
    # THEN every digest is the same 64-bit value
    assert got == want


def test_poison_and_canaries_read_the_same_bits():
    # GIVEN a guard-slot cache: canaries in every guard slot, blocks 1 and 4 poisoned (NaN),
    # then one element of block 4's poison and one canary of block 2 overwritten
    kv = torch.zeros(2, 2, 6, 5, 2, 3, dtype=torch.bfloat16)
    from kvscope.kernels import fill_guard

    fill_guard(kv)
    kv[:, :, [1, 4], :4] = float("nan")
    kv[1, 0, 4, 2, 1, 1] = 0.25
    kv[0, 1, 2, 4, 0, 0] = 1.0
    bits = KVBits(int_view(kv).numpy(), "bfloat16")
    # WHEN both paths look for broken poison and canaries
    # THEN they agree: block 4's poison, block 2's canary
    assert integrity.poison_broken(bits, np.array([1, 4]), 4) == [(4, 1)]
    assert integrity.poison_broken(kv, np.array([1, 4]), 4) == [(4, 1)]
    assert integrity.broken_canaries(bits) == integrity.broken_canaries(kv) == [2]
    assert integrity.broken_canaries(bits, np.array([0, 2])) == [2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_check_kv_of_a_data_file_finds_what_the_torch_path_finds(make_pool, probes, dtype):
    # GIVEN a live guard-mode CPU pool with three bad writes: into a published block, into a
    # freed (poisoned) block, and over a held block's canary
    pool = make_pool(16, guard=True, dtype=dtype)
    seq = pool.allocate("owner", list(range(9)))
    pool.kv[:, :, seq.block_table, : pool.block_size] = 0.5
    assert pool.mark_computed(seq, 8) == 2
    freed = pool.allocate("freed", list(range(40, 46)))
    stale = freed.block_table[0]
    pool.free(freed)
    held = pool.allocate("held", list(range(60, 63)))
    pool.kv[0, 1, seq.block_table[1], 2, 0, 3] = 2.0
    pool.kv[0, 0, stale, 1] = 0.0
    pool.kv[0, 0, held.block_table[0], pool.block_size] = 1.0
    view = snapshot(pool.view)
    # WHEN the pool's tensor (torch) and its data file read as bits (numpy) are checked
    via_torch = integrity.check_kv(view, pool.kv)
    data = np.memmap(data_path(pool.name), np.uint8, "r")
    via_numpy = integrity.check_kv(view, kv_bits(view, data))
    # THEN the same three findings come out, word for word
    as_tuples = [(f.kind, f.block, f.request, f.message) for f in via_numpy]
    assert as_tuples == [(f.kind, f.block, f.request, f.message) for f in via_torch]
    assert {(f.kind, f.block) for f in via_numpy} == {
        ("published_block_modified", seq.block_table[1]),
        ("use_after_free", stale),
        ("guard_violation", held.block_table[0]),
    }


def test_a_block_published_blank_is_named_so_by_both_paths():
    # GIVEN a float16 cache's geometry
    kv = torch.zeros(2, 2, 4, 5, 2, 3, dtype=torch.float16)
    bits = KVBits(int_view(kv).numpy(), "float16")
    # WHEN the digests of a block never written (zeros) and of a poisoned one (NaN) are known
    # THEN numpy and torch know the same two
    assert integrity._blank_digests(bits, 4) == integrity._blank_digests(kv, 4)
    assert sorted(integrity._blank_digests(bits, 4).values()) == ["NaN (poison)", "zero"]


def test_the_data_of_a_pool_on_a_gpu_is_said_not_checked(make_pool):
    # GIVEN a copy of a guard-mode pool's records whose header says its data is on a GPU
    from kvscope.kvread import for_live

    pool = make_pool(8, guard=True)
    view = snapshot(pool.view)
    view.h["device"] = b"cuda:0"
    # WHEN `check` looks for its KV data
    kv = for_live(pool.name, view)
    # THEN none is read, and the reason names the device and what to do instead
    assert kv is not None and kv.bits is None
    assert kv.unchecked is not None and "on cuda:0 and is not read" in kv.unchecked
    assert "pool.check()" in kv.unchecked and "--with-data" in kv.unchecked


def test_a_fifo_at_the_data_path_is_not_waited_on(make_pool):
    # GIVEN a guard-mode pool whose KV data file was replaced by a FIFO
    import json
    import os
    import subprocess
    import sys

    pool = make_pool(8, guard=True)
    os.unlink(data_path(pool.name))
    os.mkfifo(data_path(pool.name))
    # WHEN a fresh process checks it (a reader that opened the FIFO would wait for a writer)
    done = subprocess.run(
        [sys.executable, "-m", "kvscope", "check", pool.name, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # THEN it answers: the data file is an error, and its data checks say they did not run
    report = json.loads(done.stdout)
    assert done.returncode == 1
    assert any("is not a regular file" in f["message"] for f in report["findings"])
    assert report["data_checks"]["checked"] is False
    assert "cannot be read" in report["data_checks"]["unchecked"]
