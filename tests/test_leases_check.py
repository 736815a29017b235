"""The whole-pool check of the lease section (allocator/checkleases.py, docs/FORMAT.md section 13):
each corruption planted in a live pool's segment is a finding naming the lease, its holder and
the block, and `kvscope check --repair` (KVPool.repair_leases, csrc/recovery.c) repairs what a
recount or an end of the lease can."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from kvscope.allocator import KVPool
from kvscope.allocator.checksums import block_checksums
from kvscope.allocator.findings import FindingKind
from kvscope.allocator.layout import BlockState, ClientState, LeaseState
from kvscope.allocator.lease import lease_totals
from kvscope.cli import main
from tests.forking import killed_after, wait_child


def leased(make_pool, free: bool = False):
    """A pool with request "r"'s 3 blocks under a read lease of holder 'offloader' (the request
    freed: its blocks quarantined): (pool, blocks, lease, its record)."""
    pool = make_pool(16)
    seq = pool.allocate("r", list(range(12)))
    lease = pool.lease(seq, "read", holder="offloader")
    blocks = list(seq.block_table)
    if free:
        pool.free(seq)
    assert pool.check() == []
    return pool, blocks, lease, pool.view.leases[lease.record]


def found(pool: KVPool, kind: FindingKind) -> list:
    return [f for f in pool.check() if f.kind == kind.value]


def names_the_lease(f, lease, block: int | None = None) -> bool:
    """One line naming the lease, its holder and pid, and (where given) the block."""
    m = f.message
    return (
        "\n" not in m
        and f"lease {lease.lease_id} " in m
        and "'offloader'" in m
        and f"pid {f.owner_pid}" in m
        and (block is None or f.block == block or f"block {block}" in m)
    )


def reseal(pool: KVPool, b: int) -> None:
    blocks = pool.view.blocks
    blocks["checksum"][b] = block_checksums(blocks, np.array([b]))[0]


def test_a_pool_with_leases_in_every_state_checks_clean(make_pool):
    # GIVEN a read lease on a freed (quarantined) request, a write lease on a live one's block
    # ids, a lease on a cached block, and one past its deadline
    pool = make_pool(32)
    a = pool.allocate("a", list(range(12)))
    la = pool.lease(a, "read", holder="offloader", timeout=None)
    pool.free(a)
    b = pool.allocate("b", list(range(100, 112)))
    lb = pool.lease(list(b.block_table[:2]), "write", holder="rdma", timeout=None)
    c = pool.allocate("c", list(range(200, 209)))
    pool.mark_computed(c, 9)
    cached = list(c.block_table[:2])
    pool.free(c)
    assert [pool.view.blocks["state"][x] for x in cached] == [BlockState.CACHED] * 2
    lc = pool.lease(cached, "read", holder="connector", timeout=1.0)
    assert pool.expire_leases(2**62) == 1
    # THEN the check finds nothing but the lease_leak the sweep recorded
    assert pool.check() == []
    for lease in (la, lb, lc):
        lease.release()
    assert pool.check() == []


def test_a_lease_naming_a_block_outside_the_pool_is_out_of_bounds(make_pool):
    pool, blocks, lease, rec = leased(make_pool)
    rec["blocks"][1] = 9999
    (f,) = found(pool, FindingKind.OUT_OF_BOUNDS)
    assert names_the_lease(f, lease, 9999) and "outside the pool's blocks [0, 16)" in f.message
    # (the block it no longer names keeps a count no lease explains)
    (g,) = found(pool, FindingKind.REFCOUNT_MISMATCH)
    assert g.block == blocks[1] and "lease count is 1 but 0 held lease(s)" in g.message


def test_a_lease_claiming_more_blocks_than_its_record_holds_is_out_of_bounds(make_pool):
    pool, _, lease, rec = leased(make_pool)
    rec["num_blocks"] = 10**6
    (f,) = found(pool, FindingKind.OUT_OF_BOUNDS)
    assert names_the_lease(f, lease) and "claims 1000000 blocks" in f.message


def test_a_lease_record_of_no_state_or_mode_is_corrupt(make_pool):
    pool, _, lease, rec = leased(make_pool)
    rec["mode"] = 7
    (f,) = found(pool, FindingKind.FREE_LIST_CORRUPT)
    assert f"lease record {lease.record} " in f.message and "mode 7" in f.message


def test_a_leased_block_handed_out_again_is_use_after_free(make_pool):
    # GIVEN a freed request's quarantined blocks whose lease counts the pool lost
    pool, blocks, lease, _ = leased(make_pool, free=True)
    pool.view.lease_counts[blocks] = 0
    # WHEN the pool hands them out again
    other = pool.allocate("other", list(range(16 * 4)))
    assert set(blocks) <= set(other.block_table)
    # THEN each is a use_after_free naming the lease, its holder and the generations
    uaf = found(pool, FindingKind.USE_AFTER_FREE)
    assert sorted(f.block for f in uaf) == sorted(blocks)
    f = uaf[0]
    assert names_the_lease(f, lease, f.block) and "handed out again while leased" in f.message
    assert f.request == "r" and f.extra["lease"] == lease.lease_id


def test_a_leased_block_freed_into_the_ring_unquarantined_is_use_after_free(make_pool):
    pool, blocks, lease, _ = leased(make_pool, free=True)
    pool.view.blocks["state"][blocks[0]] = BlockState.FREE
    reseal(pool, blocks[0])
    (f,) = found(pool, FindingKind.USE_AFTER_FREE)
    assert names_the_lease(f, lease, blocks[0]) and f.message.startswith("block is FREE but")
    # (and the header counts a quarantined block that is not)
    (g,) = found(pool, FindingKind.REFCOUNT_MISMATCH)
    assert "counts 3 quarantined leased blocks but 2" in g.message


def test_a_quarantined_block_no_lease_holds_is_lost_and_the_repair_frees_it(make_pool, capsys):
    # GIVEN a freed request's quarantined blocks whose lease record was wiped
    pool, blocks, lease, rec = leased(make_pool, free=True)
    rec["state"] = LeaseState.EMPTY
    # THEN each block is a leak_orphan (the ring passes it over for ever), the header's counts
    # disagree with the table, and nothing can allocate the whole pool
    orphans = found(pool, FindingKind.LEAK_ORPHAN)
    assert sorted(f.block for f in orphans) == sorted(blocks)
    assert "no lease holds it" in orphans[0].message
    header = [f.message for f in found(pool, FindingKind.REFCOUNT_MISMATCH)]
    assert any("counts 1 leases held but its table holds 0" in m for m in header)
    # WHEN repaired
    assert main(["check", pool.name, "--repair"]) == 0
    err = capsys.readouterr().err
    assert "recounted the lease counts of 3 block(s)" in err
    assert "set the lease header's active, quarantined to its records'" in err
    # THEN the pool checks clean and every block can be allocated
    assert pool.check() == []
    assert lease_totals(pool.view)["held"] == 0 and not pool.view.lease_counts.any()
    assert len(pool.allocate("all", list(range(16 * 4))).block_table) == 16
    assert lease.release() is False


def test_a_lease_count_below_its_leases_is_a_mismatch_and_the_repair_restores_it(make_pool):
    pool, blocks, lease, _ = leased(make_pool)
    pool.view.lease_counts[blocks[2]] = 0
    (f,) = found(pool, FindingKind.REFCOUNT_MISMATCH)
    assert names_the_lease(f, lease, blocks[2]) and "lease count is 0 but 1" in f.message
    assert pool.repair_leases() == {"ended": [], "counts": 1, "header": []}
    assert pool.check() == [] and int(pool.view.lease_counts[blocks[2]]) == 1


@pytest.mark.parametrize(
    "field, value, says, fixed",
    [
        ("active", 0, "counts 0 leases held but its table holds 1", ["active"]),
        ("quarantined", 5, "counts 5 quarantined leased blocks but 3", ["quarantined"]),
        ("next_id", 0, "last id handed out is 0 but lease 1 is held", ["next_id"]),
        ("capacity", 7, "header says 7 records; the pool's table holds 64", ["capacity"]),
    ],
)
def test_a_header_count_that_disagrees_with_the_records_is_found_and_repaired(
    make_pool, field, value, says, fixed
):
    pool, _, lease, _ = leased(make_pool, free=True)
    pool.view.lease_header[field] = value
    (f,) = pool.check()
    assert says in f.message and "`kvscope check --repair`" in f.message
    assert pool.repair_leases() == {"ended": [], "counts": 0, "header": fixed}
    assert pool.check() == []
    assert lease.release() is True
    assert pool.check() == []


@pytest.mark.parametrize("how", ["detached", "taken-over", "no-record"])
def test_a_lease_whose_holder_is_gone_without_ending_it_is_a_leak_the_repair_ends(
    make_pool, pool_name, capsys, how
):
    # GIVEN a lease whose client record is detached, another process's, or none at all
    pool, blocks, lease, rec = leased(make_pool, free=True)
    other = KVPool.attach(pool_name)
    c = other.client
    other.close()
    if how == "detached":
        rec["holder_client"] = c
        assert pool.view.clients["state"][c] == ClientState.DETACHED
    elif how == "taken-over":
        rec["holder_pid"] = 1
    else:
        rec["holder_client"] = 10**6
    # THEN it is one lease_leak naming the lease, its holder and its first block
    (f,) = pool.check()
    assert f.kind == FindingKind.LEASE_LEAK.value and f.severity == "error"
    assert names_the_lease(f, lease, blocks[0]) and "no holder, close or reclaim" in f.message
    # WHEN repaired THEN the lease is ended and its quarantined blocks are free again
    assert main(["check", pool.name, "--repair", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["repair"]["leases"] == {"ended": [lease.lease_id], "counts": 3, "header": fixed()}
    assert pool.check() == [] and pool.leases() == []
    assert lease_totals(pool.view)["reclaimed"] == 1
    assert len(pool.allocate("all", list(range(16 * 4))).block_table) == 16


def fixed() -> list[str]:
    return ["active", "quarantined"]


def test_a_dead_holders_lease_is_a_warning_the_repair_reclaims(make_pool, pool_name, capsys):
    # GIVEN a worker killed holding a lease on its freed request
    pool = make_pool(16, local_cache_size=0)

    def work() -> KVPool:
        p = KVPool.attach(pool_name)
        seq = p.allocate("r", list(range(12)))
        p.lease(seq, "read", holder="offloader")
        p.free(seq)
        return p

    pid = killed_after(work)
    # THEN the check says the lease's holder died (a warning: a reclaim returns it)
    (f,) = pool.check()
    assert f.kind == FindingKind.LEAK_DEAD_OWNER.value and f.owner_pid == pid
    (row,) = pool.leases()
    assert f"lease {row['id']} of holder 'offloader' (pid {pid})" in f.message
    assert f.block == row["blocks"][0] and "which died" in f.message
    # WHEN repaired THEN it is gone with the lease
    assert main(["check", pool.name, "--repair"]) == 0
    capsys.readouterr()
    assert pool.check() == [] and pool.leases() == []


def _repair_then_exit(name: str, kill_at: int) -> None:
    code = 4
    try:
        pool = KVPool.attach(name)
        pool._core.set_crash_at(kill_at)
        pool.repair_leases()
        code = 3  # (not killed: every save passed)
    finally:
        os._exit(code)


def test_a_repair_killed_at_any_journal_save_changes_nothing(make_pool, pool_name):
    # GIVEN a lease whose record was wiped (its blocks lost) and one whose holder detached
    pool, blocks, _, rec = leased(make_pool, free=True)
    rec["state"] = LeaseState.EMPTY
    seq = pool.allocate("s", list(range(500, 508)))
    pool.lease(seq, "read", holder="offloader")
    other = KVPool.attach(pool_name)
    c = other.client
    other.close()
    held = np.flatnonzero(pool.view.leases["state"] != LeaseState.EMPTY)
    pool.view.leases["holder_client"][held] = c
    planted = sorted((f.kind, f.block) for f in pool.check())
    assert len(planted) == 5
    for n in range(1, 100):
        # WHEN a repair is killed at its n-th journal save
        pid = os.fork()
        if pid == 0:
            _repair_then_exit(pool_name, n)
        status = wait_child(pid)
        # THEN once the dead repairer is reclaimed the pool is as it was, or repaired whole
        pool.reclaim_dead()
        if status == 3:
            break
        assert status == -signal.SIGKILL, (n, status)
        assert sorted((f.kind, f.block) for f in pool.check()) == planted, n
    else:
        pytest.fail("the repair never finished")
    assert n > 3
    assert pool.check() == [] and pool.leases() == []
    assert len(pool.allocate("all", list(range(14 * 4))).block_table) == 14
