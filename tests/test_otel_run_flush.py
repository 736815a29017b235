"""`kvscope run` exports everything at the end of a run, whatever the export interval: the pool
metrics (of a pool the script unlinked too), the findings (the exit check's included) as log
records and counts, and the request spans with their finding events. And an exporter that is not
installed is one line and exit 2, naming what to install."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from kvscope.cli import main
from kvscope.probes import otel_config

# argv: two pool names. The first keeps a request at exit (the exit check reports it); the
# second is used cleanly, closed and unlinked before the script ends.
SCRIPT = """
import sys
from kvscope.allocator import KVPool, PoolConfig
cfg = PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32")
kept = KVPool.create(sys.argv[1], cfg)
gone = KVPool.create(sys.argv[2], cfg)
leaked = kept.allocate("req-leak", list(range(9)))
done = gone.allocate("req-done", list(range(9)))
gone.free(done)
gone.close()
gone.unlink()
"""


def exported(stderr: str) -> list[dict[str, Any]]:
    """The JSON objects the console exporters printed (each opens with `{` at column 0)."""
    out, lines = [], stderr.splitlines()
    for i, line in enumerate(lines):
        if line == "{":
            end = lines.index("}", i)
            out.append(json.loads("\n".join(lines[i : end + 1])))
    return out


def points(objs: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """Every data point of `metric` in the metric exports."""
    found = []
    for o in objs:
        for rm in o.get("resource_metrics", []):
            for sm in rm["scope_metrics"]:
                for m in sm["metrics"]:
                    if m["name"] == metric:
                        found += m["data"]["data_points"]
    return found


@pytest.mark.slow
def test_a_short_run_exports_pool_metrics_findings_and_spans_at_its_end(tmp_path, pool_name):
    # GIVEN a script that ends within a second, under the default 60 s export interval
    script = tmp_path / "short.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    gone = f"{pool_name}-gone"
    # WHEN it runs with the console exporters (they write to stderr)
    r = subprocess.run(
        [sys.executable, "-m", "kvscope", "run", "--dump-dir", str(tmp_path),
         "--metrics-exporter", "console", "--traces-exporter", "console",
         "--logs-exporter", "console", str(script), pool_name, gone],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )  # fmt: skip
    objs = exported(r.stderr)
    # THEN the pool metrics of both pools arrived, the unlinked one's too
    blocks = points(objs, "kvscope.pool.blocks")
    assert {p["attributes"]["kvscope.pool.name"] for p in blocks} == {pool_name, gone}, r.stderr
    # and the exit check's leak, counted by kind and sent as a log record
    counts = [
        p
        for p in points(objs, "kvscope.pool.findings")
        if p["attributes"]["kvscope.finding.kind"] == "leak_finished"
    ]
    # (one series a pool: the leaking pool's at 1, the other's at 0 from its first read)
    assert sorted(p["value"] for p in counts) == [0, 1], counts
    logs = [o for o in objs if "body" in o and o.get("attributes")]
    assert any(o["attributes"].get("kvscope.finding.kind") == "leak_finished" for o in logs)
    # and the leaked request's span, ended at exit, carries the finding as an event
    (span,) = [
        o
        for o in objs
        if o.get("name") == "kvscope.request"
        and o["attributes"]["kvscope.request.id"] == "req-leak"
    ]
    assert [e["attributes"]["kvscope.finding.kind"] for e in span["events"][1:]] == [
        "leak_finished"
    ]


def test_an_exporter_that_is_not_installed_is_one_line_and_exit_2(capfd, tmp_path, monkeypatch):
    # GIVEN an environment without the Prometheus exporter's packages
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name.startswith(("opentelemetry.exporter", "prometheus")) else real(name)

    monkeypatch.setattr(otel_config.importlib.util, "find_spec", find_spec)
    script = tmp_path / "x.py"
    script.write_text("print('ran')\n")
    # WHEN the README's exporter command runs
    code = main(["run", "--metrics-exporter", "prometheus", str(script)])
    out, err = capfd.readouterr()
    # THEN it is one line naming what to install, exit 2, and the script never ran
    assert code == 2
    assert err.splitlines() == [
        "kvscope: error: the prometheus exporter for metrics is not installed:"
        " pip install 'kvscope[otel]' (the console exporter needs nothing more)"
    ]
    assert "ran" not in out
