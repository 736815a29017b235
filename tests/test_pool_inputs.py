"""What allocate, append and fork take: any sequence of ints, numpy or torch integer arrays,
any request id, each read by the C core itself (csrc/tokens.c) and run by the same core call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.allocator import PoolError

PROMPT = [5, 6, 7, 8, 9, 10]

INPUTS = [
    pytest.param(list(PROMPT), id="list"),
    pytest.param(tuple(PROMPT), id="tuple"),
    pytest.param(range(5, 11), id="range"),
    pytest.param(np.asarray(PROMPT, np.int64), id="numpy-int64"),
    pytest.param(np.asarray(PROMPT, np.int32), id="numpy-int32"),
    pytest.param(np.asarray(PROMPT, ">u2"), id="numpy-uint16-big-endian"),
    pytest.param(np.repeat(PROMPT, 2)[::2], id="numpy-strided"),
    pytest.param(np.asarray(PROMPT[::-1], np.int64)[::-1], id="numpy-reversed"),
    pytest.param(np.asarray(PROMPT, ">i8"), id="numpy-int64-big-endian"),
    pytest.param(np.asarray(PROMPT, np.int8), id="numpy-int8"),
    pytest.param(np.asarray(PROMPT, np.uint64), id="numpy-uint64"),
    pytest.param(
        np.asarray(PROMPT, np.intc).view(type("Sub", (np.ndarray,), {})), id="numpy-subclass"
    ),
    pytest.param(torch.tensor(PROMPT), id="torch-int64"),
    pytest.param(torch.tensor(PROMPT, dtype=torch.int32), id="torch-int32"),
    pytest.param(torch.tensor([0, *PROMPT])[1:], id="torch-offset-view"),
    pytest.param(torch.tensor(PROMPT).repeat_interleave(2)[::2], id="torch-strided"),
    pytest.param([np.int64(t) for t in PROMPT], id="list-of-numpy-ints"),
]


@pytest.mark.parametrize("tokens", INPUTS)
def test_every_token_input_gives_the_same_sequence_through_the_core(make_pool, tokens):
    # GIVEN a pool run by the C core
    pool = make_pool(512, block_size=4)
    before = pool._core.stats()["native_ops"]
    # WHEN a prompt is allocated, appended to and forked with that input type
    seq = pool.allocate("r1", tokens)
    pool.append(seq, tokens[:1])
    child = pool.fork(seq, "r2")
    # THEN the sequence holds plain ints, as a list would have given
    assert seq.tokens == PROMPT + [5]
    assert all(type(t) is int for t in seq.tokens)
    assert child.tokens == seq.tokens
    # AND the core ran every call
    assert pool._core.stats()["native_ops"] == before + 3
    pool.free(child)
    pool.free(seq)
    assert pool.check() == []


@pytest.mark.parametrize(
    "request_id",
    [7, -7, 0, 2**64 + 5, -(2**63), True, 7.5, ("a", 1), "r7"],
    ids=[
        "int",
        "negative-int",
        "zero",
        "int-past-64-bits",
        "int64-min",
        "bool",
        "float",
        "tuple",
        "str",
    ],
)
def test_any_request_id_is_kept_as_its_str_through_the_core(make_pool, request_id):
    # GIVEN a pool run by the C core
    pool = make_pool(512, block_size=4)
    before = pool._core.stats()["native_ops"]
    # WHEN a request id of any type allocates and forks
    seq = pool.allocate(request_id, PROMPT)
    child = pool.fork(seq, request_id)
    # THEN the sequences carry its str, in the segment too, and the core ran both calls
    assert seq.request_id == child.request_id == str(request_id)
    assert str(request_id).encode() in {bytes(r).rstrip(b"\0") for r in pool.view.seqs["request"]}
    assert pool._core.stats()["native_ops"] == before + 2
    pool.free(child)
    pool.free(seq)


def test_int_request_ids_keep_their_own_str_when_given_again_and_in_between(make_pool):
    # GIVEN a pool
    pool = make_pool(512, block_size=4)
    # WHEN int ids are given, some again, some whose values are far apart or close
    ids = [7, 71, 7, 135, -57, 71, 7 + 2**40, 7]
    seqs = [pool.allocate(i, PROMPT) for i in ids]
    # THEN each sequence keeps its own id's str
    assert [s.request_id for s in seqs] == [str(i) for i in ids]
    for s in seqs:
        pool.free(s)


def test_a_non_integer_prompt_is_refused_with_a_pool_error(make_pool):
    # GIVEN a pool
    pool = make_pool(512, block_size=4)
    # WHEN a prompt holds something that is not an integer
    # THEN allocate refuses it, and nothing is left allocated
    with pytest.raises((ValueError, TypeError)):
        pool.allocate("r1", ["a", "b"])
    assert pool.stats()["num_sequences"] == 0


def test_a_two_dimensional_array_is_refused_with_a_pool_error(make_pool):
    # GIVEN a pool
    pool = make_pool(32)
    # WHEN a prompt is a 2-D array
    # THEN allocate says so, and nothing is left allocated
    with pytest.raises(PoolError, match="one-dimensional"):
        pool.allocate("r1", np.ones((2, 3), np.int64))
    assert pool.stats()["num_sequences"] == 0


@pytest.mark.parametrize(
    "tokens, dtype",
    [
        pytest.param(np.asarray(PROMPT, np.float64), "float64", id="numpy-float64"),
        pytest.param(
            torch.tensor(PROMPT, dtype=torch.float32), "torch.float32", id="torch-float32"
        ),
        pytest.param(torch.tensor(PROMPT, dtype=torch.bfloat16), "torch.bfloat16", id="torch-bf16"),
    ],
)
def test_a_float_array_is_refused_with_a_pool_error_naming_its_dtype(make_pool, tokens, dtype):
    # GIVEN a pool
    pool = make_pool(32)
    # WHEN a prompt is a float array
    # THEN allocate says which dtype it got, and nothing is left allocated
    with pytest.raises(PoolError, match=f"must be integers, got an array of dtype {dtype}$"):
        pool.allocate("r1", tokens)
    assert pool.stats()["num_sequences"] == 0


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param(torch.ones((2, 3), dtype=torch.long), id="torch-2d"),
        pytest.param(np.int64(5), id="numpy-scalar"),
    ],
)
def test_an_array_of_another_shape_is_refused_with_a_pool_error(make_pool, tokens):
    # GIVEN a pool
    pool = make_pool(32)
    # WHEN a prompt is a 2-D tensor or a 0-D array
    # THEN allocate says it must be one-dimensional
    with pytest.raises(PoolError, match="one-dimensional"):
        pool.allocate("r1", tokens)


@pytest.mark.parametrize(
    "tokens",
    [
        pytest.param([1, 2**31], id="list"),
        pytest.param(np.asarray([1, 2**31], np.int64), id="numpy-int64"),
        pytest.param(np.asarray([1, 2**63], np.uint64), id="numpy-uint64"),
        pytest.param(torch.tensor([1, -(2**31) - 1]), id="torch-int64"),
    ],
)
def test_a_token_outside_int32_is_refused_with_a_pool_error(make_pool, tokens):
    # GIVEN a pool and a sequence
    pool = make_pool(32)
    seq = pool.allocate("r0", [1])
    # WHEN a prompt or an append holds a token the records cannot store
    # THEN both say which token, and nothing changed
    with pytest.raises(PoolError, match="at position 1 is outside the int32 range"):
        pool.allocate("r1", tokens)
    with pytest.raises(PoolError, match="at position 1 is outside the int32 range"):
        pool.append(seq, tokens)
    assert seq.tokens == [1]
    assert pool.stats()["num_sequences"] == 1


def test_negative_tokens_are_kept_as_given(make_pool):
    # GIVEN a pool
    pool = make_pool(32)
    # WHEN a prompt holds negative ids and the int32 extremes, in a numpy array
    seq = pool.allocate("r1", np.asarray([-1, -(2**31), 2**31 - 1], np.int64))
    # THEN the sequence and the records hold them as given
    assert seq.tokens == [-1, -(2**31), 2**31 - 1]
    assert pool.view.blocks["tokens"][seq.block_table[0]][:3].tolist() == seq.tokens
