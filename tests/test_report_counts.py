"""The numbers analyze's text prints agree with each other: its headline counts every finding,
those the check only counted past its cap too (the "N more ... not listed (M in all)" line)."""

from __future__ import annotations

from kvscope.cli import main
from kvscope.dumpfile import write_dump
from tests.test_dead_workers import killed_worker


def test_the_headline_counts_the_findings_past_the_cap_as_the_list_does(
    make_pool, tmp_path, capsys
):
    # GIVEN a dump of a pool a worker died in holding 60 blocks: a leak_dead_owner each, past
    # the check's cap of 50 of a kind
    pool = make_pool(128)
    killed_worker(pool.name, [("w-1", 60 * 4)])
    path = write_dump(pool, tmp_path / "pool.kvd")
    # WHEN it is analyzed, and reported as HTML
    code = main(["analyze", str(path)])
    out = capsys.readouterr().out
    assert main(["report", str(path), "-o", str(tmp_path / "r.html")]) == 0
    html = (tmp_path / "r.html").read_text()
    # THEN the list's last line counts 60 in all, 10 of them not listed, and the headline and
    # the line under it count the same 60, saying that 10 are counted and not listed
    assert code == 0, out
    assert "leak_dead_owner: 10 more leak_dead_owner findings not listed (60 in all)" in out, out
    assert "health: OK with 60 warning(s); 10 of them counted, not listed" in out, out
    assert "  60 of them leak_dead_owner: blocks a dead process still held" in out, out
    assert "OK with 60 warning(s)" in html


def test_the_verdicts_headline_counts_them_as_errors_under_fail_on_leak(make_pool, tmp_path):
    # GIVEN the same dump, as `kvscope run`'s verdict sees it (--fail-on leak: leaks are errors)
    import io

    from kvscope.analysis import analyze_view
    from kvscope.dumpfile import alive_for, read_dump
    from kvscope.report import console, render
    from kvscope.verdict import _as_run_sees_it

    pool = make_pool(128)
    killed_worker(pool.name, [("w-1", 60 * 4)])
    view, header = read_dump(str(write_dump(pool, tmp_path / "pool.kvd")))
    report = analyze_view(view, alive=alive_for(header), dump_header=header)
    _as_run_sees_it(report, "leak")
    # WHEN it is printed
    buf = io.StringIO()
    render(report, console(buf))
    # THEN its headline counts the 60 errors, as the list's last line does
    assert "health: UNHEALTHY - 60 error(s), 0 warning(s); 10 of them counted, not listed" in (
        buf.getvalue()
    ), buf.getvalue()
