"""The lease faults (`--inject transfer-after-free`, `--inject lease-leak`): each strikes the C
core's lease operations once, at its n-th opportunity, and gives exactly one finding of its
kind; the scenario scripts show both under `kvscope run` (tests/test_run_scenarios.py)."""

from __future__ import annotations

import pytest

from kvscope.allocator import faults
from kvscope.allocator.findings import FindingKind


@pytest.fixture
def armed():
    yield faults.configure
    faults.configure(None)


def receive_each(pool, n: int, waiting: bool = True) -> list:
    """n requests, each waiting (or running) while a write lease's transfer fills its blocks,
    released when done, then freed (a preempted one resumed first)."""
    out = []
    for i in range(n):
        seq = pool.allocate(f"req-{i}", list(range(10 * i, 10 * i + 10)))
        if waiting:
            pool.set_state(seq, "waiting")
        with pool.lease(seq, "write", holder="kv-receiver") as lease:
            pool.kv[:, :, lease.blocks] = 1.0
        out.append(seq.state)
        if seq.state == "preempted":
            pool.resume(seq)
        pool.free(seq)
    return out


def test_transfer_after_free_preempts_the_third_waiting_receive_once(make_pool, armed):
    pool = make_pool(32)
    armed("transfer-after-free")
    # a read lease and a running request's write lease are not its opportunities
    seq = pool.allocate("r", list(range(10)))
    pool.lease(seq, "read", holder="h").release()
    receive_each(pool, 2, waiting=False)
    pool.free(seq)
    assert faults.ARMED == {"transfer-after-free": 3}
    # the third waiting request's receive is struck: preempted with the transfer in flight
    assert receive_each(pool, 5) == ["waiting", "waiting", "preempted", "waiting", "waiting"]
    assert faults.FIRED[-1] == "transfer-after-free" and not faults.ARMED
    (f,) = pool.findings()
    assert f.kind == FindingKind.TRANSFER_AFTER_FREE.value and f.request == "req-2"
    assert "'kv-receiver'" in f.message and "preempted" in f.message
    assert pool.leases() == []


def test_lease_leak_keeps_the_nth_read_lease_and_the_close_reports_it_once(make_pool, armed):
    pool = make_pool(32)
    armed("lease-leak:2")
    for i in range(3):
        seq = pool.allocate(f"req-{i}", list(range(10 * i, 10 * i + 10)))
        lease = pool.lease(seq, "read", holder="offloader", timeout=None)
        pool.free(seq)
        assert lease.release() is True
    # the second release never happened: its lease is still held, its blocks quarantined
    (row,) = pool.leases()
    assert row["request"] == "req-1" and row["holder"] == "offloader"
    assert pool.findings() == []
    pool.close()
    from kvscope.allocator import KVPool

    with KVPool.attach(pool.name) as again:
        (f,) = again.findings()
        assert f.kind == FindingKind.LEASE_LEAK.value and f.request == "req-1"
        assert again.leases() == []
