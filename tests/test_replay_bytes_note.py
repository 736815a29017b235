"""`kvscope replay` of a log whose K/V writes or copies the replay cannot make: a finding the
recording made from the K/V bytes (a skipped copy's kv_never_written) is a divergence there,
and the replay says why (the `note`: no store given its writers, copies not told to the
pool), instead of leaving a user to think the replay or the pool is wrong."""

from __future__ import annotations

import json

from kvscope.allocator.oplog import OpCode, read_log
from kvscope.cli import main
from tests.test_replay import ALL_PROBES, record_copies


def test_a_bytes_finding_the_log_cannot_replay_is_explained(tmp_path, pool_name, capsys):
    path = tmp_path / "untold.ops"
    record_copies(path, pool_name, skip=1, tell=False)  # copies made, not told; one skipped
    log = read_log(str(path))
    assert not log.replays_kv() and any(r.op == OpCode.STORE for r in log.records)
    assert main(["replay", str(path), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["reason"] == "divergence" and "found" in d["differs"]
    assert d["note"].startswith("kv_never_written judges the K/V bytes the program wrote")
    assert "copy-on-write copies are not in the log" in d["note"]
    assert "no K/V store" not in d["note"]  # its stores were given their writers
    # (and the fix it names is only what the program lacks)
    assert "call copy_blocks with pool= to replay it" in d["note"]
    assert "writers=Writers" not in d["note"]
    assert main(["replay", str(path)]) == 1
    assert "  note: kv_never_written judges" in capsys.readouterr().out


def test_a_log_that_replays_its_kv_has_no_note(tmp_path, pool_name, capsys):
    path = tmp_path / "told.ops"
    record_copies(path, pool_name, skip=1)
    assert main(["replay", str(path), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["reason"] == "finding" and "note" not in d


def test_a_finding_of_a_write_the_log_lacks_names_that_write(tmp_path, pool_name, capsys):
    import torch

    from kvscope.allocator import KVPool, PoolConfig
    from kvscope.allocator.probing import PoolProbes
    from kvscope.kernels import store_kv
    from kvscope.probes.stores import Writers

    # GIVEN a recording whose stores were given their writers, but for one: K/V written into a
    # block after its request was freed (through a table the program kept), not through a
    # store told its writers; the block handed out again, its poison found overwritten
    path = tmp_path / "zombie.ops"
    cfg = dict(num_blocks=4, block_size=4, num_layers=1, num_kv_heads=1, head_dim=4)
    pool = KVPool.create(
        pool_name,
        PoolConfig(**cfg, dtype="float32", guard=True, local_cache_size=0, record_ops=str(path)),
    )
    try:
        pool.probe = PoolProbes(pool, ALL_PROBES)
        a = pool.allocate("a", [1, 2, 3])
        slots = torch.tensor(pool.slot_mapping(a, 0, 3))
        kv = torch.ones(3, 1, 4)
        store_kv(kv, kv, pool.kv[0, 0], pool.kv[0, 1], slots, block_size=4,
                 writers=Writers(pool, [(a, 0, 3)]))  # fmt: skip
        kept = list(a.block_table)
        pool.free(a)
        pool.kv[0, 0, kept[0], 0] = 7.0  # the write through the kept table
        pool.free(pool.allocate("b", list(range(16))))  # (every block: the freed one too)
    finally:
        pool.close()
        pool.unlink()
    # WHEN it is replayed
    assert main(["replay", str(path), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    # THEN the finding does not come back, and the note says the write is not in the log
    assert d["reason"] == "divergence" and "found" in d["differs"], d
    assert d["note"].startswith("use_after_free judges the K/V bytes the program wrote"), d
    assert "the write that made it is not among the log's stores" in d["note"]
    assert "give every store_kv its writers to replay it" in d["note"]
