"""Pools and dumps for tests/test_readers_agree.py: each injectable fault, a K/V change only the
offline check sees, a truncated data file and a healthy pool, built in this process (a fork
for the fault that kills its process)."""

from __future__ import annotations

import os
import uuid

import torch

from kvscope.allocator import KVPool, PoolConfig, faults
from kvscope.allocator.faults import FAULTS
from kvscope.allocator.segment import data_path, segment_path
from kvscope.probes import lockdep, watchdog
from tests.test_core_faults import work

PROBES = ("LEAKS", "MAGIC", "EVENTS", "OWNERSHIP", "DIGEST")
SCENARIOS = (*FAULTS, "kv-changed", "data-truncated", "healthy")


def _work(pool: KVPool) -> None:
    """The fault tests' operations (tests/test_core_faults.py `work`), run in order."""
    for op in work(pool):
        op()


# The faults that strike a lease's transfer (tests/test_leases_faults.py).
LEASE_FAULTS = ("transfer-after-free", "lease-leak")


def _lease_work(pool: KVPool, name: str) -> None:
    """A receive under a write lease into a waiting request (transfer-after-free preempts it),
    then an offload under a read lease by a second handle that frees its request and closes
    (lease-leak keeps the lease, which the close reports)."""
    seq = pool.allocate("rx", list(range(9)))
    pool.set_state(seq, "waiting")
    with pool.lease(seq, "write", holder="kv-receiver"):
        pass
    if seq.state == "preempted":
        pool.resume(seq)
    pool.free(seq)
    other = KVPool.attach(name)
    seq = other.allocate("off", list(range(100, 109)))
    other.lease(seq, "read", holder="offloader").release()
    other.free(seq)
    other.close()


def _foreign_slot(pool: KVPool) -> None:
    """Slot provenance on: a request publishes its prompt's blocks, another's append (the
    fault's opportunity) also writes a slot of them, and a third request's prefix hit on them
    reports it."""
    pool.provenance_sample = 1
    owner = pool.allocate("owner", list(range(9)))
    assert pool.mark_computed(owner, 8) == 2
    writer = pool.allocate("writer", list(range(50, 55)))
    faults.configure("foreign-slot:1")
    pool.append(writer, [99])
    pool.allocate("reader", list(range(9)))


def _config(**kw) -> PoolConfig:
    return PoolConfig(num_blocks=48, block_size=4, head_dim=8, num_layers=1, dtype="float32", **kw)


def _published(pool: KVPool) -> int:
    """A request whose first two blocks hold K/V and are published, still held; its second."""
    seq = pool.allocate("owner", list(range(9)))
    gen = torch.Generator().manual_seed(0)
    shape = pool.kv[:, :, seq.block_table, : pool.block_size].shape
    pool.kv[:, :, seq.block_table, : pool.block_size] = torch.randn(shape, generator=gen)
    assert pool.mark_computed(seq, 8) == 2
    return seq.block_table[1]


def _stale_padding(pool: KVPool) -> None:
    """A padded block table whose padding row keeps the row of a larger step, audited."""
    a = pool.allocate("step-a", list(range(9)))
    b = pool.allocate("step-b", list(range(20, 29)))
    table = torch.full((3, 4), -1, dtype=torch.int32)
    table[0, :3] = torch.tensor(a.block_table)
    table[1, :3] = torch.tensor(b.block_table)
    assert pool.audit_block_table(table, rows=[a, b]) == []
    assert len(pool.audit_block_table(table, rows=[a])) == 1


def build(scenario: str, prefix: str) -> tuple[str, KVPool | None, bytes]:
    """Make the pool of `scenario`; its name, the handle this process keeps (None when none
    is kept) and its header's first bytes while intact."""
    name = f"{prefix}-{scenario}"
    guard = scenario in ("oob-write",)
    pool = KVPool.create(name, _config(guard=guard))
    intact = bytes(pool.view.raw[:256])
    if scenario in ("lock-inversion", "gil-wait"):
        watchdog.install(pool, {"KVSCOPE_LOCKDEP": "1", "KVSCOPE_LOCK_HOLD_S": "0"})
    try:
        if scenario == "kill-holding-lock":
            pid = os.fork()
            if pid == 0:
                try:
                    child = KVPool.attach(name)
                    faults.configure("kill-holding-lock:1")
                    _work(child)
                finally:
                    os._exit(3)
            os.waitpid(pid, 0)
        elif scenario == "stale-padding-row":
            # (its opportunity is an engine's padded table: an audit of one that kept the row
            # of an earlier, larger batch)
            _stale_padding(pool)
        elif scenario == "foreign-slot":
            _foreign_slot(pool)
        elif scenario in LEASE_FAULTS:
            faults.configure(f"{scenario}:1")
            _lease_work(pool, name)
        elif scenario in FAULTS:
            faults.configure(f"{scenario}:1")
            _work(pool)
            if scenario == "header-scribble":
                pool.verify()
        elif scenario == "kv-changed":
            blk = _published(pool)
            # Written around every operation of the pool: only a check of the data sees it.
            pool.kv[0, 0, blk, 0, 0, 0] += 1.0
        elif scenario == "data-truncated":
            _work(pool)
            pool.close()
            os.truncate(data_path(name), 4096)
            return name, None, intact
        else:
            _work(pool)
    finally:
        faults.configure(None)
        if scenario in ("lock-inversion", "gil-wait") and lockdep.LOCKDEP is not None:
            lockdep.LOCKDEP.uninstrument(pool)
    return name, pool, intact


def prefix() -> str:
    return f"agree-{uuid.uuid4().hex[:8]}"


def remove(name: str, pool: KVPool | None) -> None:
    try:
        if pool is not None:
            pool.close()
    except Exception:  # noqa: BLE001 - a scribbled pool may not close cleanly
        pass
    finally:
        for p in (segment_path(name), data_path(name)):
            if os.path.lexists(p):
                os.unlink(p)
