"""`kvscope timeline`: the flight recorder as Chrome trace-event JSON (Perfetto, chrome://tracing).

Every trace is checked against the Trace Event Format: the JSON object form, the fields each
phase needs (`X`: ts and dur in µs, `i`: a scope, `M`: a known metadata name, `C`: numeric
args), and slices that nest on each thread, as Perfetto requires.
"""

from __future__ import annotations

import glob
import json
import time
from collections import defaultdict
from numbers import Number

import pytest

from kvscope.allocator.findings import Finding
from kvscope.allocator.snapshot import snapshot
from kvscope.analysis import collect_findings
from kvscope.cli import main
from kvscope.history import History
from kvscope.timeline import build_trace

METADATA = {"process_name", "thread_name", "process_sort_index", "thread_sort_index"}


def check_trace(trace: dict) -> list[dict]:
    """Assert `trace` follows the Trace Event Format; its events."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    events = trace["traceEvents"]
    json.dumps(trace)  # plain JSON values only
    for e in events:
        assert e["ph"] in ("X", "i", "M", "C"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["tid"] != 0, e
        assert isinstance(e["name"], str) and e["name"], e
        if e["ph"] == "M":
            assert e["name"] in METADATA and isinstance(e["args"], dict), e
            continue
        assert isinstance(e["ts"], Number) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], Number) and e["dur"] >= 0, e
        elif e["ph"] == "i":
            assert e["s"] in ("g", "p", "t"), e
        elif e["ph"] == "C":
            assert e["args"] and all(isinstance(v, Number) for v in e["args"].values()), e
    # Slices on one thread nest: each starts after, and ends before, any slice it starts in.
    by_thread: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_thread.values():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-6, (start, end, stack)
            stack.append(end)
    return events


def slices(events: list[dict], cat: str = "request") -> dict[str, dict]:
    return {e["name"]: e for e in events if e["ph"] == "X" and e["cat"] == cat}


def test_a_known_run_gives_its_slices(make_pool):
    # GIVEN a pool with the recorder on, a history, and a run whose story is known
    pool = make_pool(16, events=True)
    history = History.for_view(pool.view)
    history.add(pool.view)
    t0 = time.time_ns()
    a = pool.allocate("req-a", list(range(22)))  # 6 blocks, the last one partly filled
    pool.mark_computed(a, 22)
    b = pool.fork(a, "req-b")
    copies = pool.append(b, [7])  # writes into the shared partial block: a copy
    c = pool.allocate("req-c", list(range(100, 108)))
    pool.set_state(c, "waiting")
    history.add(pool.view)
    pool.allocate("req-d", list(range(200, 236)))  # 9 blocks: preempts req-c
    assert c.state == "preempted"
    a_blocks = list(a.block_table)
    pool.free(a)
    pool.report(Finding("leak_orphan", "block 5 is lost", block=5, owner_pid=pool.pid))
    history.add(pool.view)
    end = time.time_ns()
    view = snapshot(pool.view)
    # WHEN the trace is built
    trace = build_trace(
        view, history=history, findings=collect_findings(view, lambda p, s: True), end_ns=end
    )
    events = check_trace(trace)
    req = slices(events)
    origin = trace["otherData"]["origin_ns"]
    # THEN each request is one slice from its allocation to its end, with its blocks
    assert set(req) == {"req-a", "req-b", "req-c", "req-d"}
    assert req["req-a"]["args"]["end"] == "free"
    assert req["req-a"]["args"]["blocks"] == sorted(a_blocks)
    assert origin / 1e3 + req["req-a"]["ts"] >= t0 / 1e3
    assert req["req-b"]["args"]["forked_from_seq"] == a.seq_id
    assert len(copies) == 1 and req["req-b"]["args"]["copy_on_write"] == 1
    (cow,) = [e for e in events if e["ph"] == "i" and e["name"] == "copy-on-write"]
    assert (cow["args"]["src"], cow["args"]["dst"]) == copies[0]
    assert cow["tid"] == req["req-b"]["tid"]
    assert req["req-b"]["ts"] <= cow["ts"] <= req["req-b"]["ts"] + req["req-b"]["dur"]
    assert req["req-d"]["args"]["end"] == "still held at the end of the trace"
    assert req["req-d"]["ts"] + req["req-d"]["dur"] == pytest.approx((end - origin) / 1e3)
    # AND the preemption is a slice nested in its request, open until the end
    pre = slices(events, "preemption")["preempted"]
    assert pre["args"]["request"] == "req-c"
    assert (pre["pid"], pre["tid"]) == (req["req-c"]["pid"], req["req-c"]["tid"])
    assert req["req-c"]["args"]["end"] == "preempted at the end of the trace"
    # AND requests alive at once are on different threads of the same process
    assert req["req-a"]["tid"] != req["req-d"]["tid"] and req["req-a"]["pid"] == pool.pid
    # AND the finding is an instant naming its block
    (leak,) = [e for e in events if e["ph"] == "i" and e["name"] == "leak_orphan"]
    assert leak["args"]["blocks"] == [5] and leak["args"]["source"] == "recorded"
    # AND the history gave counter tracks of the blocks by state
    counters = [e for e in events if e["ph"] == "C" and e["name"] == "blocks"]
    assert len(counters) == 3 and counters[-1]["args"]["allocated"] == int(
        (view.blocks["state"] == 1).sum()
    )


def test_a_pool_without_events_gives_an_empty_valid_trace(make_pool, tmp_path, capsys):
    # GIVEN a pool whose recorder is off
    pool = make_pool(16)
    pool.allocate("r", [1, 2, 3])
    out = tmp_path / "t.json"
    # WHEN its timeline is written THEN it is valid, has no request, and says why
    assert main(["timeline", pool.name, "-o", str(out)]) == 0
    events = check_trace(json.loads(out.read_text()))
    assert not slices(events)
    assert "events probe was off" in capsys.readouterr().err


def test_timeline_of_a_dump_and_its_errors(make_pool, tmp_path, capsys):
    pool = make_pool(16, events=True)
    seq = pool.allocate("r", list(range(9)))
    pool.free(seq)
    dump = tmp_path / "p.kvd"
    assert main(["dump", pool.name, "-o", str(dump)]) == 0
    # WHEN the dump's timeline goes to stdout THEN it is the trace
    assert main(["timeline", str(dump), "-o", "-"]) == 0
    events = check_trace(json.loads(capsys.readouterr().out))
    assert slices(events)["r"]["args"]["num_blocks"] == 3
    # AND unusable input or output is one line and exit 2
    assert main(["timeline", str(tmp_path / "missing.kvd"), "-o", str(tmp_path / "t.json")]) == 2
    assert main(["timeline", str(dump), "-o", str(tmp_path / "no" / "dir.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("kvscope: error:") == 2 and "Traceback" not in err


@pytest.mark.slow
def test_run_timeline_writes_the_trace_and_history_beside_the_dump(tmp_path, pool_name, capfd):
    # GIVEN a script that leaks a request under `kvscope run --timeline`
    script = tmp_path / "leak.py"
    script.write_text(
        "import sys, time\n"
        "from kvscope.allocator import KVPool, PoolConfig\n"
        "pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=32, block_size=4, head_dim=8,"
        " num_layers=1, dtype='float32'))\n"
        "kept = pool.allocate('req-kept', list(range(10)))\n"
        "done = pool.allocate('req-done', list(range(50, 60)))\n"
        "pool.free(done)\n"
    )
    code = main(
        [
            "run",
            "--timeline",
            "--fail-on",
            "leak",
            "--dump-dir",
            str(tmp_path),
            str(script),
            pool_name,
        ]
    )
    assert code == 66
    err = capfd.readouterr().err
    (dump,) = glob.glob(str(tmp_path / "*.kvd"))
    base = dump[: -len(".kvd")]
    # THEN the trace and the history lie beside the dump, and the trace shows both requests
    events = check_trace(json.loads(open(base + ".trace.json").read()))
    req = slices(events)
    assert req["req-done"]["args"]["end"] == "free"
    assert req["req-kept"]["args"]["end"] == "still held at the end of the trace"
    assert any(e["ph"] == "i" and e["name"] == "leak_finished" for e in events)
    assert any(e["ph"] == "C" for e in events)
    history = json.loads(open(base + ".history.json").read())
    assert history["schema"] == 1 and len(history["columns"]["time_ns"]) >= 2
    assert "trace.json" in err and "capacity" in err
