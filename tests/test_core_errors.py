"""Every error a caller can cause is raised by the C core itself, as a one-line PoolError or
TypeError: a sequence that is not this handle's live one, a bad argument, a second free, a
closed handle, a forked child's copy of its parent's handle. None is a case the core does not
handle (that is a RuntimeError, which no test here expects)."""

from __future__ import annotations

import copy
import pickle
import re

import numpy as np
import pytest

from kvscope.allocator import Finding, HandleInherited, KVPool, PoolError
from tests.forking import fork_child, wait_child

# Each operation on a sequence, with arguments it would take.
SEQ_OPS = {
    "append": lambda pool, s: pool.append(s, [7]),
    "mark_computed": lambda pool, s: pool.mark_computed(s, 4),
    "fork": lambda pool, s: pool.fork(s, "child"),
    "free": lambda pool, s: pool.free(s),
    "abort": lambda pool, s: pool.abort(s),
    "set_state": lambda pool, s: pool.set_state(s, "waiting"),
    "resume": lambda pool, s: pool.resume(s),
}
# ... and every operation, allocate too.
ALL_OPS = {"allocate": lambda pool, s: pool.allocate("new", [1, 2, 3]), **SEQ_OPS}


@pytest.fixture
def pool(make_pool):
    return make_pool(32)


def refused(pool: KVPool, call, exc: type[Exception], message: str) -> None:
    """call() raises exc with exactly `message`."""
    with pytest.raises(exc) as e:
        call()
    assert str(e.value) == message


def double_frees(pool: KVPool) -> list:
    return [f for f in pool.findings() if f.kind == "double_free"]


@pytest.mark.parametrize("op", SEQ_OPS)
@pytest.mark.parametrize("thing, kind", [("r1", "str"), (None, "NoneType"), (7, "int")])
def test_what_is_not_a_sequence_is_refused(pool, op, thing, kind):
    # GIVEN a pool with a live sequence (so the handle's registry is not empty)
    seq = pool.allocate("r1", [1, 2, 3, 4, 5])
    # WHEN an operation gets something that is not a Sequence, THEN the core says what it got
    refused(pool, lambda: SEQ_OPS[op](pool, thing), PoolError, f"expected a Sequence, got {kind}")
    pool.free(seq)
    assert pool.check() == []


@pytest.mark.parametrize("op", SEQ_OPS)
def test_another_handles_sequence_is_refused(pool, op):
    # GIVEN a second handle on the same pool, with a sequence of its own
    other = KVPool.attach(pool.name)
    try:
        theirs = other.allocate("theirs", [1, 2, 3, 4, 5])
        table = list(theirs.block_table)
        # WHEN this handle is given it, THEN the core refuses it and it is left as it was
        refused(
            pool,
            lambda: SEQ_OPS[op](pool, theirs),
            PoolError,
            f"sequence 'theirs' belongs to another pool handle, not to pool {pool.name!r}",
        )
        assert (theirs.state, theirs.block_table) == ("running", table)
        other.free(theirs)
    finally:
        other.close()
    assert pool.check() == []


@pytest.mark.parametrize("op", SEQ_OPS)
@pytest.mark.parametrize("end", ["free", "abort"])
def test_an_ended_sequence_is_refused(pool, op, end):
    # GIVEN a sequence freed or aborted
    seq = pool.allocate("gone", [1, 2, 3, 4, 5])
    getattr(pool, end)(seq)
    state = {"free": "finished", "abort": "aborted"}[end]
    stats = pool.stats()
    # WHEN any operation is given it, THEN the core says it already ended, and nothing changed
    refused(pool, lambda: SEQ_OPS[op](pool, seq), PoolError, f"sequence 'gone' was already {state}")
    assert (seq.state, seq.slot, seq.block_table) == (state, -1, [])
    assert pool.stats() == stats
    # (without the probes, a second free is no finding)
    assert double_frees(pool) == []


@pytest.mark.parametrize("op", SEQ_OPS)
def test_a_copy_of_a_live_sequence_is_refused(pool, op):
    # GIVEN a live sequence and a copy of it (the same slot, not the pool's own object)
    seq = pool.allocate("orig", [1, 2, 3, 4, 5])
    twin = copy.copy(seq)
    # WHEN an operation is given the copy, THEN the core refuses it: it would write the
    # original's records
    refused(
        pool,
        lambda: SEQ_OPS[op](pool, twin),
        PoolError,
        f"sequence 'orig' is not a live sequence of this handle on pool {pool.name!r} "
        "(a copy of one, or made outside the pool)",
    )
    # AND once the original is freed, its stale copy cannot free its slot again
    pool.free(seq)
    other = pool.allocate("next", [9, 9, 9])
    refused(
        pool,
        lambda: pool.free(twin),
        PoolError,
        f"sequence 'orig' is not a live sequence of this handle on pool {pool.name!r} "
        "(a copy of one, or made outside the pool)",
    )
    assert other.state == "running" and pool.live() == {other.slot: other}
    pool.free(other)
    assert pool.check() == []


@pytest.mark.parametrize(
    "tokens",
    [[], (), np.array([], np.int64), range(0)],
    ids=["list", "tuple", "numpy", "range"],
)
def test_an_empty_prompt_is_refused(pool, tokens):
    refused(
        pool, lambda: pool.allocate("r", tokens), PoolError, "allocate needs at least one token"
    )
    assert pool.stats()["num_sequences"] == 0


@pytest.mark.parametrize("length", [6, 4 * 300 + 2], ids=["short", "long"])
def test_a_prompt_from_an_iterator_is_read_once(make_pool, length):
    # GIVEN a pool, and a prompt that comes from a generator (one longer than one
    # transaction's 128 blocks too: its rest is appended after the first)
    pool = make_pool(400, max_blocks_per_seq=512)
    # WHEN it is allocated, THEN the sequence holds every token, and nothing is left over
    seq = pool.allocate("gen", (t for t in range(length)))
    assert seq.tokens == list(range(length))
    pool.free(seq)
    assert pool.stats()["num_sequences"] == 0 and pool.check() == []


def test_a_prompt_past_max_blocks_per_seq_is_refused(make_pool):
    # GIVEN a pool whose sequences hold at most 4 blocks of 4 tokens
    pool = make_pool(32, max_blocks_per_seq=4)
    # WHEN a prompt needs 5, THEN the core says so, and nothing is allocated
    refused(
        pool,
        lambda: pool.allocate("long", list(range(17))),
        PoolError,
        "a prompt of 17 tokens needs 5 blocks; PoolConfig.max_blocks_per_seq is 4",
    )
    assert pool.stats()["num_sequences"] == 0 and pool.stats()["num_allocated"] == 0
    # (16 tokens fit)
    pool.free(pool.allocate("fits", list(range(16))))
    assert pool.check() == []


def test_an_append_past_max_blocks_per_seq_is_refused(make_pool):
    # GIVEN a pool whose sequences hold at most 4 blocks of 4 tokens, and one of 3 blocks
    pool = make_pool(32, max_blocks_per_seq=4)
    seq = pool.allocate("r", list(range(10)))
    stats = pool.stats()
    # WHEN an append needs a 5th block, THEN the core says so before appending anything
    for more in (7, 7 + 4 * 200):  # (one chunk, or several)
        refused(
            pool,
            lambda: pool.append(seq, list(range(more))),  # noqa: B023
            PoolError,
            f"sequence needs {-(-(10 + more) // 4)} blocks but PoolConfig.max_blocks_per_seq is 4",
        )
    assert (seq.num_tokens, seq.num_blocks) == (10, 3) and pool.stats() == stats
    # (up to the 4th block's last token fits)
    pool.append(seq, list(range(6)))
    assert seq.num_blocks == 4
    pool.free(seq)
    assert pool.check() == []


@pytest.mark.parametrize("bad, kind", [(1.5, "float"), ("7", "str"), (None, "NoneType")])
def test_a_token_that_is_not_an_integer_is_a_type_error(pool, bad, kind):
    # GIVEN a live sequence
    seq = pool.allocate("r", [1, 2, 3])
    message = f"'{kind}' object cannot be interpreted as an integer"
    # WHEN a prompt or an append holds something that is not an integer, THEN TypeError
    refused(pool, lambda: pool.allocate("r2", [1, bad]), TypeError, message)
    refused(pool, lambda: pool.append(seq, [4, bad]), TypeError, message)
    assert seq.tokens == [1, 2, 3] and pool.stats()["num_sequences"] == 1
    pool.free(seq)


@pytest.mark.parametrize("bad, kind", [(8.0, "float"), ("8", "str"), (None, "NoneType")])
def test_mark_computed_takes_an_integer_count(pool, bad, kind):
    seq = pool.allocate("r", list(range(10)))
    refused(
        pool,
        lambda: pool.mark_computed(seq, bad),
        TypeError,
        f"'{kind}' object cannot be interpreted as an integer",
    )
    assert seq.num_published == 0 and pool.stats()["num_cached"] == 0
    pool.free(seq)


def test_mark_computed_of_a_negative_count_or_one_past_the_tokens(pool):
    # GIVEN a sequence of 10 tokens: 2 full blocks of 4
    seq = pool.allocate("r", list(range(10)))
    # WHEN a negative count is marked computed, THEN nothing is published
    assert pool.mark_computed(seq, -5) == 0 and seq.num_published == 0
    # WHEN a count past the tokens is, THEN every full block is, once (numpy's ints too)
    assert pool.mark_computed(seq, np.int64(12)) == 2 and seq.num_published == 2
    assert pool.mark_computed(seq, 10**30) == 0 and seq.num_published == 2
    pool.free(seq)
    assert pool.stats()["num_cached"] == 2
    assert pool.check() == []


def test_set_state_and_resume_refuse_the_wrong_state(make_pool):
    # GIVEN a pool of 4 blocks: a waiting sequence of 2 is preempted by a prompt of 3
    pool = make_pool(4, local_cache_size=0, max_clients=4, max_seqs=64)
    wait = pool.allocate("w", list(range(8)))
    pool.set_state(wait, "waiting")
    big = pool.allocate("big", list(range(100, 112)))
    assert wait.state == "preempted"
    # THEN set_state takes only running or waiting, and not for a preempted sequence
    refused(
        pool,
        lambda: pool.set_state(big, "paused"),
        PoolError,
        "set_state takes 'running' or 'waiting', got 'paused'",
    )
    refused(
        pool,
        lambda: pool.set_state(big, 1),
        PoolError,
        "set_state takes 'running' or 'waiting', got 1",
    )
    refused(
        pool,
        lambda: pool.set_state(wait, "running"),
        PoolError,
        "a preempted sequence must be resumed with pool.resume(seq) first",
    )
    # AND a preempted sequence takes no append before its resume (nothing changed)
    for tokens in ([1], []):
        refused(
            pool,
            lambda tokens=tokens: pool.append(wait, tokens),
            PoolError,
            "a preempted sequence must be resumed with pool.resume(seq) first",
        )
    # AND resume only a preempted one
    refused(
        pool,
        lambda: pool.resume(big),
        PoolError,
        "resume needs a preempted sequence, this one is running",
    )
    pool.set_state(big, "waiting")
    refused(
        pool,
        lambda: pool.resume(big),
        PoolError,
        "resume needs a preempted sequence, this one is waiting",
    )
    assert (big.state, len(big.block_table)) == ("waiting", 3)
    pool.free(big)
    assert pool.resume(wait) == 0 and wait.state == "running"
    pool.free(wait)
    assert pool.check() == []


def test_the_core_checks_its_own_arguments(pool):
    # (what pool.py passes it: a call of another shape is a TypeError)
    seq = pool.allocate("r", [1, 2, 3])
    core = pool._core
    refused(pool, lambda: core.end(pool, seq, 9), TypeError, "end(pool, seq, final_state: 3 or 4)")
    refused(pool, lambda: core.end(pool, seq), TypeError, "end(pool, seq, final_state: 3 or 4)")
    refused(
        pool,
        lambda: core.mark_computed(pool, seq),
        TypeError,
        "mark_computed(pool, seq, num_tokens)",
    )
    assert seq.state == "running"
    pool.free(seq)


def test_a_second_release_under_the_probes_is_one_double_free(make_pool, probes):
    # GIVEN a pool under the probes `kvscope run` switches on, and a request freed
    pool = make_pool(32)
    seen: list = []
    pool.on_finding = seen.append
    seq = pool.allocate("twice", [1, 2, 3, 4, 5])
    pool.free(seq)
    # WHEN it is freed again, and then aborted
    refused(pool, lambda: pool.free(seq), PoolError, "sequence 'twice' was already finished")
    refused(pool, lambda: pool.abort(seq), PoolError, "sequence 'twice' was already finished")
    # THEN the core recorded one double_free, about no block, naming the request, this process
    # and the caller's line, and handed it to on_finding although the release raised
    (f,) = double_frees(pool)
    assert (f.block, f.owner_pid, f.request, f.severity) == (None, pool.pid, "twice", "error")
    assert re.fullmatch(
        r"request 'twice' was already finished and is released again at "
        r"\S*test_core_errors\.py:\d+ <lambda>: the pool refused it \(PoolError\), but the "
        r"caller frees twice",
        f.message,
    ), f.message
    assert [g.kind for g in seen] == ["double_free"]
    # AND another request released twice is a finding of its own
    other = pool.allocate("again", [7, 8, 9])
    pool.abort(other)
    refused(pool, lambda: pool.free(other), PoolError, "sequence 'again' was already aborted")
    assert [(f.request, f.message.split(" and ")[0]) for f in double_frees(pool)] == [
        ("twice", "request 'twice' was already finished"),
        ("again", "request 'again' was already aborted"),
    ]
    assert pool.check() == []


@pytest.mark.parametrize(
    "op, call",
    [
        ("append", lambda pool, seq: pool.append(seq, [9])),
        ("mark_computed", lambda pool, seq: pool.mark_computed(seq, 3)),
        ("fork", lambda pool, seq: pool.fork(seq, "child")),
        ("set_state", lambda pool, seq: pool.set_state(seq, "waiting")),
        ("resume", lambda pool, seq: pool.resume(seq)),
    ],
)
def test_a_call_on_an_ended_sequence_under_the_probes_is_one_use_after_free(
    make_pool, probes, op, call
):
    # GIVEN a pool under the probes `kvscope run` switches on, and a request aborted (a
    # cancelled client) whose sequence the program still holds
    pool = make_pool(32)
    seen: list = []
    pool.on_finding = seen.append
    seq = pool.allocate("gone", [1, 2, 3, 4, 5])
    pool.abort(seq)
    # WHEN the program calls the pool on it twice, catching the refusal each time
    for _ in range(2):
        refused(pool, lambda: call(pool, seq), PoolError, "sequence 'gone' was already aborted")
    # THEN the core recorded one use_after_free, about no block, naming the request, this
    # process, the call and the caller's line, and handed it to on_finding
    (f,) = [f for f in pool.findings() if f.kind == "use_after_free"]
    assert (f.block, f.owner_pid, f.request, f.severity) == (None, pool.pid, "gone", "error")
    assert re.fullmatch(
        r"request 'gone' was already aborted and is used again at "
        rf"\S*test_core_errors\.py:\d+ <lambda> \({op}\): the pool refused it \(PoolError\), "
        r"but the program kept its sequence after ending it",
        f.message,
    ), f.message
    assert [g.kind for g in seen] == ["use_after_free"]
    # AND the analysis names the cause: the request kept after its end, with the call's line
    from kvscope.analysis import analyze_view

    (cause,) = analyze_view(pool.view)["likely_causes"]
    assert cause.startswith("sequences the program still used after it ended their request")
    assert re.search(rf"\('gone' at \S*test_core_errors\.py:\d+ <lambda> \({op}\)\)", cause)
    # AND a release of it after is a double_free of its own
    refused(pool, lambda: pool.free(seq), PoolError, "sequence 'gone' was already aborted")
    assert [f.request for f in double_frees(pool)] == ["gone"]
    assert pool.check() == []


def test_slot_mapping_of_an_ended_sequence_is_refused(make_pool):
    # GIVEN a request freed
    pool = make_pool(32)
    seq = pool.allocate("gone", [1, 2, 3, 4, 5])
    pool.free(seq)
    # WHEN its slots are asked for THEN the pool refuses it as block_table does
    refused(
        pool,
        lambda: pool.slot_mapping(seq, 0, 5),
        PoolError,
        "sequence 'gone' was already finished",
    )
    refused(pool, lambda: pool.block_table(seq), PoolError, "sequence 'gone' was already finished")


@pytest.mark.parametrize("op", ALL_OPS)
def test_a_closed_handle_is_refused(make_pool, op):
    # GIVEN a handle with a live sequence, closed
    pool = make_pool(32)
    seq = pool.allocate("r", [1, 2, 3, 4, 5])
    pool.close()
    # WHEN any operation is asked of it, THEN the core says it is closed
    refused(pool, lambda: ALL_OPS[op](pool, seq), PoolError, f"pool {pool.name!r} is closed")


def test_a_forked_child_is_refused_its_parents_handle(make_pool):
    # GIVEN a handle with a running and a preempted sequence
    pool = make_pool(4, local_cache_size=0, max_clients=4, max_seqs=64)
    wait = pool.allocate("w", list(range(8)))
    pool.set_state(wait, "waiting")
    seq = pool.allocate("r", list(range(100, 112)))
    assert wait.state == "preempted"
    message = (
        f"this handle on pool {pool.name!r} was opened by pid {pool.pid}; in a forked child "
        "call KVPool.attach(name) instead"
    )
    stats = pool.stats()

    def child() -> int:
        # WHEN a forked child uses its parent's handle for any operation, or reports through it
        for name, op in ALL_OPS.items():
            target = wait if name == "resume" else seq
            refused(pool, lambda: op(pool, target), HandleInherited, message)  # noqa: B023
        refused(pool, lambda: pool.record(Finding("leak_orphan", "x")), HandleInherited, message)
        try:
            pool.free(seq)
        except HandleInherited as e:
            # (naming the pool and its opener, and whole across a pickle, as a worker's error
            # reaches its parent)
            again = pickle.loads(pickle.dumps(e))
            named = (
                (e.name, e.opener_pid) == (again.name, again.opener_pid) == (pool.name, pool.pid)
            )
            return 0 if named and str(again) == message else 5
        return 4

    # THEN the core refuses each with HandleInherited (a PoolError; the child exits 0 only if
    # every one said so)
    assert wait_child(fork_child(child, alarm_s=60)) == 0
    # AND the parent's handle and pool are as they were
    assert pool.stats() == stats
    pool.free(seq)
    assert pool.resume(wait) == 0
    pool.free(wait)
    assert pool.check() == []
