"""Every `--json` output carries `"schema": 1` (docs/CLI.md)."""

from __future__ import annotations

import json

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
