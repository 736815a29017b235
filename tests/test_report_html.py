"""`kvscope report`: one self-contained HTML file, checked as text and in headless Chromium."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest

from kvscope.allocator.findings import Finding
from kvscope.cli import main
from kvscope.history import History, history_path
from tests.test_history import preempting_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def report_file(make_pool, tmp_path, monkeypatch, capsys):
    """The report of a dump of a preempting run with a finding, stacks and a history."""
    monkeypatch.setenv("KVSCOPE_OWNERSHIP", "1")
    monkeypatch.setenv("KVSCOPE_STACK_DEPTH", "2")
    pool = make_pool(16, events=True)
    history = History.for_view(pool.view)
    a, b, c = preempting_run(pool, history)
    pool.free(c)
    pool.report(
        Finding("leak_finished", "req-b never freed", block=b.block_table[0], request="req-b")
    )
    dump = tmp_path / "run.kvd"
    assert main(["dump", pool.name, "-o", str(dump)]) == 0
    history.write(history_path(str(dump)))
    out = tmp_path / "report.html"
    assert main(["report", str(dump), "-o", str(out)]) == 0
    assert "report.html" in capsys.readouterr().err
    return out


def test_report_is_one_self_contained_file(report_file):
    page = report_file.read_text()
    # THEN nothing is fetched: no script, no external reference, no URL at all
    assert "<script" not in page.lower()
    assert not re.search(r"\bsrc\s*=", page)
    assert re.findall(r'href="([^"]*)"', page) == ["data:,"]
    assert "http://" not in page and "https://" not in page and "url(" not in page
    # AND it holds every part the issue asks for
    for part in (
        "Block map",
        'class="legend"',
        "Over time",
        "utilization %",
        "preemptions (total)",
        "Capacity",
        "a pool of 20 blocks (+4) would have served this run without preemption",
        "blocks in use by refcount",
        "blocks by times allocated (reuse)",
        "leak_finished",
        "allocated by",
        "freed by",
        "called from",
        "test_history.py",
    ):
        assert part in page, part
    assert page.count("<svg") >= 7


def test_report_errors_are_one_line(make_pool, tmp_path, capsys):
    pool = make_pool(16)
    assert main(["report", pool.name, "-o", str(tmp_path / "no" / "dir.html")]) == 2
    assert main(["report", str(tmp_path / "missing.kvd"), "-o", str(tmp_path / "r.html")]) == 2
    assert main(["report", pool.name, "-o", str(tmp_path / "r.html"), "--history", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("kvscope: error:") == 3 and "Traceback" not in err
    # AND a live pool without a history still gets its report
    assert main(["report", pool.name, "-o", str(tmp_path / "r.html")]) == 0
    assert "No recorded history" in (tmp_path / "r.html").read_text()


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    # Every host name resolves to nothing: a page that needed the network would log an error.
    return subprocess.run(
        [
            CHROMIUM or "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--enable-logging=stderr",
            "--v=0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _console(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ":CONSOLE" in ln]


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)")
def test_report_loads_in_headless_chromium_without_a_console_error(report_file, tmp_path):
    # GIVEN a control page with a console error: the check below sees one when there is one
    control = tmp_path / "control.html"
    control.write_text(
        '<html><body><script>console.error("kvscope-control")</script></body></html>'
    )
    seen = _console(_chromium("--dump-dom", control.as_uri()).stderr)
    assert any("kvscope-control" in ln for ln in seen)
    # WHEN the report is loaded and screenshotted
    shot = tmp_path / "report.png"
    run = _chromium("--window-size=1000,1400", f"--screenshot={shot}", report_file.as_uri())
    # THEN the browser logged nothing on its console, and drew a page of that size
    assert _console(run.stderr) == []
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", png[16:24]) == (1000, 1400)
    assert len(png) > 20_000  # a blank page compresses to a few KiB
    dom = _chromium("--dump-dom", report_file.as_uri())
    assert _console(dom.stderr) == []
    assert "Block map" in dom.stdout and dom.stdout.count("<svg") >= 7


def test_report_of_a_dump_with_a_corrupt_header(make_pool, tmp_path, capsys):
    # GIVEN a dump whose segment header was scribbled over after it was written
    pool = make_pool(16)
    pool.allocate("r", [1, 2, 3])
    dump = tmp_path / "p.kvd"
    assert main(["dump", pool.name, "-o", str(dump)]) == 0
    with open(dump, "r+b") as f:
        f.seek(560 + 24)  # the dump header, then the segment header's geometry
        f.write(b"\xde\xad" * 4)
    # WHEN it is reported THEN the page says what is wrong and makes no capacity claim
    out = tmp_path / "r.html"
    assert main(["report", str(dump), "-o", str(out)]) == 0
    page = out.read_text()
    assert "header_corrupt" in page
    assert "its counters cannot be trusted" in page


def test_report_says_what_analyze_says_of_unchecked_data_and_the_hit_rate(
    make_pool, tmp_path, capsys
):
    import html
    import json

    # GIVEN a dump without its K/V data of a guard-mode pool (its data checks cannot run)
    pool = make_pool(16, guard=True)
    pool.free(pool.allocate("r1", [1, 2, 3, 4, 5]))
    pool.allocate("r2", [1, 2, 3, 4, 9])
    dump = tmp_path / "run.kvd"
    assert main(["dump", pool.name, "-o", str(dump)]) == 0
    assert main(["analyze", str(dump), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    unchecked = rep["data_checks"]["unchecked"]
    assert not rep["data_checks"]["checked"]
    # WHEN its report is written
    out = tmp_path / "report.html"
    assert main(["report", str(dump), "-o", str(out)]) == 0
    page = html.unescape(out.read_text())
    # THEN it says what analyze says: the checks that did not run, and the prefix hit rate
    assert f"note: {unchecked}" in page
    assert f"prefix hit rate {rep['summary']['prefix_hit_rate']:.1%}" in page
