"""The text report prints the first few findings of one kind and allocation site in full and
the rest as one line (kvscope.report.SAME_CAUSE_SHOWN): one bug in one code path is one
finding per request, and the reader needs its few first cases, not every one."""

from __future__ import annotations

import io

from kvscope.report import SAME_CAUSE_SHOWN, console, render


def _finding(i, kind="kv_never_written", site="engine.py:30 step"):
    return {
        "kind": kind,
        "severity": "error",
        "block": 10 + i,
        "owner_pid": 7,
        "request": f"req-{i}",
        "message": f"request 'req-{i}' finished with positions unwritten",
        "source": "recorded",
        "site": site,
        "events": [],
    }


def _text(findings):
    report = {
        "pool": {
            "name": "p",
            "geometry": {
                "num_blocks": 64,
                "block_size": 4,
                "num_layers": 1,
                "num_kv_heads": 1,
                "head_dim": 4,
                "dtype": "float32",
            },
            "device": "cpu",
            "flags": {},
        },
        "healthy": False,
        "findings": findings,
    }
    buf = io.StringIO()
    render(report, console(buf))
    return buf.getvalue()


def test_many_findings_of_one_site_print_a_few_and_one_line_for_the_rest():
    n = SAME_CAUSE_SHOWN + 5
    other = _finding(99, kind="use_after_free", site="engine.py:50 free")
    text = _text([_finding(i) for i in range(n)] + [other])
    assert f"{n + 1} error(s)" in text
    shown = [f"request 'req-{i}'" for i in range(n) if f"request 'req-{i}' (recorded)" in text]
    assert len(shown) == SAME_CAUSE_SHOWN
    assert "... and 5 more kv_never_written allocated at engine.py:30 step" in text
    rest = ", ".join(f"'req-{i}'" for i in range(SAME_CAUSE_SHOWN, n))
    assert f"request(s) {rest}; blocks {10 + SAME_CAUSE_SHOWN}-{10 + n - 1}" in text
    # another kind (or site) is its own cause: printed in full
    assert "use_after_free block 109 pid 7 request 'req-99' (recorded)" in text
    assert text.count("... and") == 1


def test_a_few_findings_are_all_printed():
    text = _text([_finding(i) for i in range(SAME_CAUSE_SHOWN)])
    assert "... and" not in text
    assert all(f"request 'req-{i}' (recorded)" in text for i in range(SAME_CAUSE_SHOWN))


def test_findings_grouped_over_several_blocks_say_each_block():
    from kvscope.report import grouped

    # GIVEN one request's kv_never_written on two blocks, the same positions in each
    msg = "request 'r2' finished with positions 8-10 of this block never written"
    f = {"kind": "kv_never_written", "owner_pid": 7, "request": "r2", "message": msg}
    # WHEN they are grouped THEN the one entry names both blocks and says "each block"
    (g,) = grouped([{**f, "block": 8}, {**f, "block": 16}])
    assert g["blocks"] == [8, 16]
    assert g["message"] == msg.replace("of this block", "of each block")
    # AND a finding of one block keeps its words
    (one,) = grouped([{**f, "block": 8}])
    assert one["message"] == msg
