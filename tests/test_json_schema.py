"""Every `--json` output carries `"schema": 1` (docs/CLI.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.allocator.errors import PoolError
from kvscope.cli import main


def test_analyze_check_and_ls_json_carry_the_schema(make_pool, tmp_path, capsys):
    # GIVEN a live pool and a dump of it
    pool = make_pool(16)
    pool.allocate("r", [1, 2, 3])
    dump = tmp_path / "p.kvd"
    assert main(["dump", pool.name, "-o", str(dump)]) == 0
    capsys.readouterr()
    # THEN analyze (dump and live) and check print an object whose schema is 1, first
    for argv in (
        ["analyze", str(dump), "--json"],
        ["analyze", pool.name, "--json"],
        ["check", pool.name, "--json"],
    ):
        main(argv)
        report = json.loads(capsys.readouterr().out)
        assert list(report)[0] == "schema" and report["schema"] == 1, argv
        assert {"pool", "healthy", "summary", "findings"} <= set(report)
    # AND ls prints its list as always, each row with the schema
    assert main(["ls", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert isinstance(rows, list)
    (mine,) = [r for r in rows if r["name"] == pool.name]
    assert mine["schema"] == 1 and mine["num_held"] >= 1


def _documented_finding_keys() -> set[str]:
    doc = (Path(__file__).parent.parent / "docs" / "CLI.md").read_text()
    listed = doc.split('"findings": [{', 1)[1].split("}]", 1)[0]
    return {k.strip().rstrip("?") for k in listed.replace("\n", " ").split(",")}


def test_every_key_of_a_recorded_finding_is_documented(probes, make_pool, capsys):
    # GIVEN a double free on abort that the pool refused and recorded (an engine that frees a
    # request after aborting it; a new user's script reading `analyze --json`)
    pool = make_pool(16)
    seq = pool.allocate(3, [1, 2, 3, 4, 5])
    pool.abort(seq)
    with pytest.raises(PoolError):
        pool.free(seq)
    main(["analyze", pool.name, "--json"])
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    # THEN every key it carries is one docs/CLI.md lists, and a finding on no block says so
    assert set(finding) <= _documented_finding_keys()
    assert finding["kind"] == "double_free" and finding["block"] is None
    doc = (Path(__file__).parent.parent / "docs" / "CLI.md").read_text()
    assert "`block` is null" in " ".join(doc.split())
