"""Leases, slot provenance and the block-table audit on a CUDA pool (`device="cuda"`, marked
`gpu`: skipped without a CUDA device), each test body run on a CPU pool of the same geometry too
(so the logic runs in CI everywhere): a lease taken and released, a leased block freed
quarantined (its K/V untouched, in guard mode too) and never handed out, a write lease completing
into a freed block (transfer_after_free), a lease past its deadline (lease_leak), provenance
records and the foreign-slot fault and sweep, and the audit of a device table with wait=True.
No timing: deadlines are crossed with an explicit `now_ns`."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvscope.allocator import KVPool, PoolExhausted, Sequence, devicechecks, faults
from kvscope.allocator.findings import FindingKind
from kvscope.allocator.layout import BlockState
from kvscope.allocator.lease import lease_totals
from kvscope.kernels.digest import fmix64_reference
from tests.kernels_cases import slot_digests

DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"]
BLOCKS = 16


@pytest.fixture(params=DEVICES)
def device(request):
    yield request.param
    faults.configure(None)


@pytest.fixture
def pool(make_pool, device):
    """A 16-block pool of 16-token blocks (the CUDA pool tests' geometry) on `device`."""
    return pool_on(make_pool, device)


def pool_on(make_pool, device: str, **kw) -> KVPool:
    p = make_pool(BLOCKS, device=device, dtype="float16", block_size=16, head_dim=64, **kw)
    assert p.kv.is_cuda == (device == "cuda")
    return p


def tokens(pool: KVPool, blocks: float, start: int = 0) -> list[int]:
    return list(range(start, start + int(blocks * pool.block_size)))


def states(pool: KVPool, blocks: list[int]) -> list[int]:
    return [int(pool.view.blocks["state"][b]) for b in blocks]


def kinds(pool: KVPool) -> list[str]:
    return [f.kind for f in pool.findings()]


def test_a_lease_is_taken_and_released(pool):
    # GIVEN a request's blocks, read under a lease, and written under another in a with block
    seq = pool.allocate("r", tokens(pool, 2.5))
    lease = pool.lease(seq, "read", holder="offloader")
    # THEN the pool lists it, with its holder and blocks
    (row,) = pool.leases()
    assert (row["id"], row["mode"], row["holder"]) == (lease.lease_id, "read", "offloader")
    assert row["blocks"] == seq.block_table and row["request"] == "r"
    with pool.lease(seq.block_table[:1], "write", holder="rx") as w:
        pool.kv[:, :, w.blocks, : pool.block_size] = 1.0
        assert len(pool.leases()) == 2
    assert w.released
    # WHEN released THEN it is gone, once
    assert lease.release() is True and lease.release() is True
    assert pool.leases() == []
    assert lease_totals(pool.view)["released"] == 2
    pool.free(seq)
    assert kinds(pool) == [] and pool.check() == []


@pytest.mark.parametrize("guard", [False, True], ids=["plain", "guard"])
def test_a_leased_block_freed_is_quarantined_kept_and_never_handed_out(make_pool, device, guard):
    # GIVEN a request's written K/V, leased by an offload, the request freed
    pool = pool_on(make_pool, device, guard=guard)
    seq = pool.allocate("r", tokens(pool, 3))
    mine = list(seq.block_table)
    pool.kv[:, :, mine, : pool.block_size] = 3.0
    lease = pool.lease(seq, "read", holder="offloader")
    pool.free(seq)
    # THEN its blocks are quarantined, their K/V untouched (no poison in guard mode), and the
    # pool hands out every other block but not them
    assert states(pool, mine) == [BlockState.QUARANTINED] * 3
    assert bool((pool.kv[:, :, mine, : pool.block_size] == 3.0).all())
    with pytest.raises(PoolExhausted):
        pool.allocate("all", tokens(pool, BLOCKS))
    rest = pool.allocate("rest", tokens(pool, BLOCKS - 3, 1000))
    assert not set(rest.block_table) & set(mine)
    assert pool.check() == [] and pool.verify() == []
    # AND once the lease ends they are handed out again
    assert lease.release() is True
    again = pool.allocate("again", tokens(pool, 3, 5000))
    assert sorted(again.block_table) == sorted(mine)
    assert kinds(pool) == [] and pool.check() == []


def test_a_write_lease_completing_into_a_freed_block_is_transfer_after_free(pool):
    # GIVEN a receive into a request's blocks under a write lease
    seq = pool.allocate("req-7", tokens(pool, 2.5))
    lease = pool.lease(seq, "write", holder="kv-receiver")
    # WHEN the request is aborted, then the receive completes
    pool.abort(seq)
    assert lease.release() is True
    # THEN one transfer_after_free names the holder, the request and a leased block
    (f,) = pool.findings()
    assert f.kind == FindingKind.TRANSFER_AFTER_FREE.value and f.request == "req-7"
    assert "'kv-receiver'" in f.message and "freed" in f.message and f.block in lease.blocks
    assert lease_totals(pool.view)["late"] == 1
    assert pool.check() == []


def test_a_write_lease_struck_by_the_fault_is_transfer_after_free(pool):
    # GIVEN the transfer-after-free fault armed for the first write lease on a waiting request
    faults.configure("transfer-after-free:1")
    seq = pool.allocate("req-0", tokens(pool, 2))
    pool.set_state(seq, "waiting")
    # WHEN it is leased (and preempted at once, the transfer in flight), then the write completes
    lease = pool.lease(seq, "write", holder="kv-receiver")
    assert seq.state == "preempted" and faults.FIRED[-1] == "transfer-after-free"
    lease.release()
    # THEN one transfer_after_free says the preemption
    (f,) = pool.findings()
    assert f.kind == FindingKind.TRANSFER_AFTER_FREE.value and "preempted" in f.message


def test_a_lease_past_its_deadline_is_one_lease_leak(pool):
    seq = pool.allocate("r", tokens(pool, 2))
    lease = pool.lease(seq, "read", holder="offloader", timeout=5.0)
    now = time.monotonic_ns()
    assert pool.expire_leases(now) == 0
    assert pool.expire_leases(now + 6 * 10**9) == 1
    assert pool.expire_leases(now + 7 * 10**9) == 0
    (f,) = pool.findings()
    assert f.kind == FindingKind.LEASE_LEAK.value and f.request == "r"
    assert "'offloader'" in f.message and "past its deadline" in f.message
    # (held, and reported, it is no finding of the whole-pool check)
    assert pool.check() == []
    assert lease.release() is True and pool.leases() == []


def test_provenance_records_each_slot_and_the_sweep_is_clean(pool):
    # GIVEN every sequence sampled, a prompt of 1.5 blocks and two appended tokens
    pool.provenance_sample = 1
    seq = pool.allocate("a", tokens(pool, 1.5, 10))
    pool.append(seq, [70, 71])
    bs = pool.block_size
    n = len(tokens(pool, 1.5)) + 2
    # THEN each slot says its position and token, under its block's generation
    want = tokens(pool, 1.5, 10) + [70, 71]
    for j, b in enumerate(seq.block_table):
        rec = pool.view.provenance[b]
        used = min(bs, n - j * bs)
        assert list(rec["position"][:used]) == [j * bs + i for i in range(used)]
        assert list(rec["token"][:used]) == want[j * bs : j * bs + used]
        gen = int(pool.view.blocks["generation"][b])
        assert list(rec["generation"][:used]) == [gen] * used
        assert int(pool.view.provenance_recorded[b]) == gen
    assert pool.check_provenance([seq]) == []
    # AND a slot that says another position is the sweep's foreign_slot
    pool.view.provenance[seq.block_table[1], 0]["position"] = 999
    (f,) = pool.check_provenance([seq])
    assert (f.kind, f.block, f.request) == ("foreign_slot", seq.block_table[1], "a")
    assert "position 999" in f.message


def test_the_foreign_slot_fault_is_caught_at_a_prefix_hit(pool):
    # GIVEN a published prompt, and the foreign-slot fault armed for its first opportunity
    pool.provenance_sample = 1
    owner = pool.allocate("owner", tokens(pool, 2.5))
    assert pool.mark_computed(owner, 2 * pool.block_size) == 2
    writer = pool.allocate("writer", tokens(pool, 0.5, 500))
    faults.configure("foreign-slot:1")
    # WHEN the writer appends (its write lands in a slot of the owner's published block too)
    pool.append(writer, [99])
    assert faults.FIRED[-1] == "foreign-slot" and kinds(pool) == []
    # ... and a third request hits the prefix
    pool.allocate("reader", tokens(pool, 2.5))
    # THEN one foreign_slot, at the hit, naming the reader and the writer
    (f,) = pool.findings()
    assert f.kind == "foreign_slot" and f.request == "reader"
    assert f.block in owner.block_table[:2]
    assert "request 'writer'" in f.message and "token 99" in f.message


@pytest.fixture(params=["plain", "digest"])
def digest(request, monkeypatch):
    """Guard mode alone, or with the digest probe (whose publication stamps the blocks' digests
    and, on a CUDA pool, their slots' hashes in the same launch)."""
    if request.param == "digest":
        monkeypatch.setenv("KVSCOPE_DIGEST", "1")
    return request.param


@pytest.fixture(params=DEVICES + ["cpu-queued"])
def kv_device(request, monkeypatch, digest):
    """Where the K/V hashes are taken: a CUDA pool's by the check kernel the core launches, a
    CPU pool's by the core over its bytes, or ("cpu-queued") a CPU pool's through the core's
    queue of device checks, as a CUDA pool's are (the tests' seam DEFERRED_ON_CPU)."""
    if request.param == "cpu-queued":
        monkeypatch.setattr(devicechecks, "DEFERRED_ON_CPU", True)
    yield request.param.split("-")[0]
    faults.configure(None)


def published_and_scribbled(make_pool, device: str) -> tuple[KVPool, Sequence, int]:
    """A guard-mode pool recording every sequence's slots, a prompt of 2.5 blocks with its K/V
    stored and its two full blocks published (their slots' K/V hashed: waited for), then one
    element of slot 3 of its first block written afterwards."""
    pool = pool_on(make_pool, device, guard=True)
    pool.provenance_sample = 1
    owner = pool.allocate("owner", tokens(pool, 2.5))
    full = owner.block_table[:2]
    shape = pool.kv[:, :, full, : pool.block_size].shape
    pool.kv[:, :, full, : pool.block_size] = torch.randn(
        shape, generator=torch.Generator().manual_seed(1)
    ).to(pool.kv.device, pool.kv.dtype)
    assert pool.mark_computed(owner, 2 * pool.block_size) == 2
    pool.verify()  # (the hashes of a CUDA pool's slots land with the check's answer)
    # (each slot's hash: its own digest finalized, the same wherever it was taken)
    want = fmix64_reference(torch.tensor(slot_digests(pool.kv.cpu(), full, pool.block_size)))
    want = ((want >> 32) & 0xFFFFFFFF) | 1
    for b, hashes in zip(full, want.tolist()):
        assert [int(h) for h in pool.view.provenance[b]["kv_hash"]] == hashes
    assert kinds(pool) == []
    pool.kv[0, 1, full[0], 3] += 1.0
    return pool, owner, full[0]


def test_a_published_slot_whose_kv_changed_is_reported_at_the_hit(make_pool, kv_device):
    # GIVEN a published prompt one of whose slots' K/V was written after its publication
    pool, _, block = published_and_scribbled(make_pool, kv_device)
    # WHEN another request hits the prefix (a CUDA pool's answer applied at the next settle)
    pool.allocate("hitter", tokens(pool, 2.5))
    pool.verify()
    # THEN one foreign_slot, about that slot, naming the request that hit it
    (f,) = [f for f in pool.findings() if f.kind == "foreign_slot"]
    assert (f.block, f.request) == (block, "hitter")
    assert f.message.startswith("a prefix hit: slot 3 of block")
    assert "was written since its publication" in f.message and "request 'owner'" in f.message


def test_the_sweep_finds_a_published_slot_whose_kv_changed(make_pool, kv_device):
    # GIVEN the same, nothing hitting it
    pool, owner, block = published_and_scribbled(make_pool, kv_device)
    # WHEN the owner's slots are swept (a CUDA pool's answer applied at the next settle)
    pool.check_provenance([owner])
    pool.verify()
    # THEN one foreign_slot about that slot, naming the owner as its reader
    (f,) = [f for f in pool.findings() if f.kind == "foreign_slot"]
    assert (f.block, f.request) == (block, "owner")
    assert f.message.startswith("provenance sweep: slot 3 of block")
    assert "was written since its publication" in f.message


def table(pool: KVPool, rows: int, width: int, *seqs) -> torch.Tensor:
    t = np.full((rows, width), -1, dtype=np.int32)
    for i, s in enumerate(seqs):
        t[i, : len(s.block_table)] = s.block_table
    return torch.from_numpy(t).to(pool.kv.device)


def test_the_audit_of_a_table_on_the_pools_device_answers_with_wait(pool):
    # GIVEN two sequences and the 4x4 table a kernel reads, on the pool's device
    a = pool.allocate("a", tokens(pool, 2.5))
    b = pool.allocate("b", tokens(pool, 1.5, 100))
    good = table(pool, 4, 4, a, b)
    assert good.device == pool.kv.device
    # THEN the true table has no finding
    assert pool.audit_block_table(good, rows=[a, b], wait=True) == []
    # WHEN a padding row keeps an earlier batch's row (b's blocks) and the audit waits
    stale = table(pool, 4, 4, a, b)
    stale[2, :2] = stale[1, :2].clone()
    found = pool.audit_block_table(stale, rows=[a, b], wait=True)
    # THEN one block_table_mismatch names b's block there, in the answer and the ring
    (f,) = found
    assert f.kind == FindingKind.BLOCK_TABLE_MISMATCH.value
    assert f.block == b.block_table[0] and f.request == "b"
    assert "padding row 2 entry 0" in f.message
    assert kinds(pool) == [FindingKind.BLOCK_TABLE_MISMATCH.value]
