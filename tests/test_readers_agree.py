"""Every reader tells the same story (issue 30): over pools and dumps with each injectable
fault, a K/V change only the offline check sees, a truncated data file and a healthy pool,
`analyze --json`, `check --json`, `report`, `timeline`, top's data, `kvscope run`'s verdict and
the exporter's findings name the same set of (kind, block)."""

from __future__ import annotations

import html
import json
import os
import re

import pytest

from kvscope.allocator.dumpfile import write_dump
from kvscope.allocator.errors import PoolError
from kvscope.allocator.layout import Layout
from kvscope.cli import main
from kvscope.supervisor import Supervisor, Watched, map_readonly
from kvscope.tui.app import TopApp
from kvscope.tui.source import open_source
from tests.readers_pools import PROBES, SCENARIOS, build, prefix, remove

Pair = tuple[str, int | None]


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    """scenario -> (pool name, dump path, the run's Watched of the pool), built once."""
    out: dict[str, tuple[str, str, Watched]] = {}
    made = []
    where = tmp_path_factory.mktemp("agree")
    pre = prefix()
    with pytest.MonkeyPatch.context() as mp:
        for p in PROBES:
            mp.setenv(f"KVSCOPE_{p}", "1")
        try:
            for scenario in SCENARIOS:
                name, pool, intact = build(scenario, pre)
                made.append((name, pool))
                w = watched(name, intact)
                dump = str(where / f"{scenario}.kvd")
                try:
                    write_dump(name, dump, with_data=True)
                except (PoolError, ValueError):
                    # A header scribbled over or a data file cut short: the segment as the
                    # run's supervisor copies it, without the data (as `kvscope run` dumps it).
                    write_dump(w.view, dump, header_prefix=intact)
                out[scenario] = (name, dump, w)
            yield out
        finally:
            for w in (v[2] for v in out.values()):
                os.close(w.fd)
            for name, pool in made:
                remove(name, pool)


def watched(name: str, intact: bytes) -> Watched:
    """The pool as `kvscope run`'s supervisor maps it: read-only, laid out by the header it
    saw intact when the pool was created."""
    from kvscope.allocator.segment import segment_path

    layout = Layout.from_header(_header(intact))
    view, fd = map_readonly(segment_path(name), layout)
    return Watched(name, 0, segment_path(name), layout, intact, view, fd)


def _header(prefix_bytes: bytes):
    import numpy as np

    from kvscope.allocator.layout import HEADER_DTYPE

    buf = bytearray(HEADER_DTYPE.itemsize)
    buf[: len(prefix_bytes)] = prefix_bytes
    return np.frombuffer(buf, HEADER_DTYPE, 1)[0]


def pairs_of(findings) -> set[Pair]:
    return {(f["kind"], f["block"]) for f in findings}


def cli_json(capsys, argv: list[str]) -> set[Pair] | None:
    code = main(argv)
    out = capsys.readouterr()
    if code == 2:
        return None
    return pairs_of(json.loads(out.out)["findings"])


def report_pairs(capsys, target: str, path: str) -> set[Pair] | None:
    """The (kind, block) of each finding the HTML report shows (its blocks row: every block)."""
    if main(["report", target, "-o", path]) == 2:
        capsys.readouterr()
        return None
    capsys.readouterr()
    with open(path) as f:
        page = f.read()
    out: set[Pair] = set()
    for div in re.findall(r'<div class="finding [a-z]+">(.*?)<details>', page, re.S):
        kind = re.match(r"<b>([a-z_]+)</b>", div).group(1)  # type: ignore[union-attr]
        row = re.search(r"<th>blocks</th><td>([^<]*)</td>", div)
        blocks = [int(b) for b in html.unescape(row.group(1)).split(", ")] if row else [None]
        out |= {(kind, b) for b in blocks}
    return out


def timeline_pairs(capsys, target: str, path: str) -> set[Pair] | None:
    """The (kind, block) of each finding instant of the trace."""
    if main(["timeline", target, "-o", path]) == 2:
        capsys.readouterr()
        return None
    capsys.readouterr()
    with open(path) as f:
        trace = json.load(f)
    out: set[Pair] = set()
    for e in trace["traceEvents"]:
        if e.get("cat") == "finding":
            blocks = e["args"].get("blocks") or [None]
            out |= {(e["name"], b) for b in blocks}
    return out


def top_pairs(target: str) -> set[Pair] | None:
    """What top's findings panel is handed: a frame after one full check."""
    try:
        source = open_source(target)
    except PoolError:
        return None
    try:
        app = TopApp(source)
        app._check(source.read_full())
        return {(f.kind, f.block) for f in app.take_frame().findings}
    finally:
        source.close()


def verdict_pairs(w: Watched, run_dir: str) -> set[Pair]:
    """The findings `kvscope run`'s verdict analyzes (Supervisor.final_findings)."""
    sup = Supervisor(["x"], run_dir=run_dir, env={}, echo=lambda line: None)
    _, found = sup.final_findings(w)
    return {(f.kind, f.block) for f in found}


class Logger:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def emit(self, **kw) -> None:
        self.records.append(kw)


def exporter_pairs(name: str) -> set[Pair] | None:
    """The findings the exporter emits as log records, up to and at its close."""
    from opentelemetry.sdk.metrics import MeterProvider

    from kvscope.probes.otel_metrics import KIND, PoolCollector

    logger = Logger()
    provider = MeterProvider()
    try:
        collector = PoolCollector(provider.get_meter("agree"), lambda: [name], logger=logger)
        collector.refresh()
        if not collector._readers:
            collector.close()
            return None  # the pool cannot be opened (its header is scribbled over)
        collector.close()
    finally:
        provider.shutdown()
    return {
        (r["attributes"][KIND], r["attributes"].get("kvscope.block.id")) for r in logger.records
    }


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_reader_names_the_same_findings(pools, scenario, capsys, tmp_path):
    # GIVEN a pool with one fault (or none) and its dump
    name, dump, w = pools[scenario]
    # WHEN each reader reads it
    live = {
        "analyze": cli_json(capsys, ["analyze", "--json", name]),
        "check": cli_json(capsys, ["check", "--json", name]),
        "report": report_pairs(capsys, name, str(tmp_path / "live.html")),
        "timeline": timeline_pairs(capsys, name, str(tmp_path / "live.json")),
        "top": top_pairs(name),
        "exporter": exporter_pairs(name),
    }
    verdict = verdict_pairs(w, str(tmp_path))
    dumped = {
        "analyze": cli_json(capsys, ["analyze", "--json", dump]),
        "report": report_pairs(capsys, dump, str(tmp_path / "dump.html")),
        "timeline": timeline_pairs(capsys, dump, str(tmp_path / "dump.json")),
        "top": top_pairs(dump),
    }
    # THEN the live pool's readers agree with each other and with the run's verdict
    if scenario == "header-scribble":
        # (its header no longer lays the segment out: every reader of the live pool refuses it
        # in one line; the run's supervisor kept the layout it saw intact)
        assert all(v is None for v in live.values()), live
        assert {k for k, _ in verdict} == {"header_corrupt"}
    else:
        assert all(v == verdict for v in live.values()), (verdict, live)
    # AND a dump's readers agree with each other; a dump with the KV data with the live pool
    # (the data file's own findings are about a file the dump does not carry)
    first = dumped["analyze"]
    assert first is not None
    assert all(v == first for v in dumped.values()), dumped
    if scenario == "data-truncated":
        assert first == verdict - {("out_of_bounds", None)}
    else:
        assert first == verdict
    # AND the faults and changes are found at all: a healthy pool has no finding
    assert bool(verdict) == (scenario != "healthy"), verdict
