"""`kvscope replay` of a log whose K/V writes or copies the replay cannot make: a finding the
recording made from the K/V bytes (a skipped copy's kv_never_written) is a divergence there,
and the replay says why (the `note`: no store given its writers, copies not told to the
pool), instead of leaving a user to think the replay or the pool is wrong."""

from __future__ import annotations

import json

from kvscope.allocator.oplog import OpCode, read_log
from kvscope.cli import main
from tests.test_replay import record_copies


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
