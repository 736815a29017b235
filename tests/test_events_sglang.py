"""`kvscope events record` and `check` against SGLang's own KV-event publisher.

SGLang is installed at test time without its dependencies into a folder of its own
(KVSCOPE_SGLANG_DIR names one already installed, else /tmp/kvscope-sglang-peer), with the
few packages its KV-event module imports beyond kvscope's: psutil, and pydantic where kvscope's
environment lacks it. Where it cannot be installed or imported the tests skip with the reason.
tests/sglang_events_driver.py publishes a radix cache's lifecycle with SGLang's
`ZmqEventPublisher` and event classes and records it with kvscope's `Recorder`, filling what it
missed from SGLang's replay socket; the recording is checked here with `kvscope events check`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from kvscope.cli import main
from kvscope.events.streamfile import NOTE, StreamFile
from kvscope.events.wire import STORED, as_tuple, decode_payload, split_message
from tests.peers import installed_peer

ROOT = Path(__file__).resolve().parent.parent
SGLANG_VERSION = "0.5.23"
DEFAULT_DIR = "/tmp/kvscope-sglang-peer"
# What `sglang.srt.disaggregation.kv_events` imports beyond kvscope's dependencies (found by
# importing it until nothing was missing; the versions that imported together here).
IMPORT_DEPS = ["psutil==7.2.2"]
PYDANTIC_DEPS = [
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sglang_dir() -> str:
    deps = list(IMPORT_DEPS)
    try:
        import pydantic  # noqa: F401
    except ImportError:
        deps += PYDANTIC_DEPS
    folder = os.environ.get("KVSCOPE_SGLANG_DIR", DEFAULT_DIR)
    # (loaded as the driver loads it: SGLang's package __init__s are not run)
    probe = (
        f"sys.path.insert(0, {str(ROOT / 'tests')!r}); "
        f"import sglang_events_driver as d; d.load_kv_events({folder!r})"
    )
    return installed_peer(
        f"SGLang {SGLANG_VERSION}",
        folder,
        [f"sglang=={SGLANG_VERSION}", *deps],
        probe,
        marker="sglang",
    )


def record_sglang(sglang_dir: str, out: Path, fault: str = "") -> tuple[int, int, int, int]:
    """Run the driver; returns (batches published, events, gaps seen, batches replayed)."""
    cmd = [sys.executable, str(ROOT / "tests" / "sglang_events_driver.py"), sglang_dir, str(out)]
    done = subprocess.run(
        cmd + (["--fault", fault] if fault else []),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out.parent,
    )
    assert done.returncode == 0, done.stderr
    word, *numbers = done.stdout.split()
    assert word == "done"
    batches, events, gaps, filled = (int(n) for n in numbers)
    return batches, events, gaps, filled


def _check(path: Path, capsys) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["events", "check", str(path), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_sglangs_own_stream_is_recorded_whole_and_checks_clean(sglang_dir, tmp_path, capsys):
    # GIVEN SGLang's publisher publishing a radix cache's stores, evictions and a clear, a
    # batch of it lost on the way to the recorder
    out = tmp_path / "sglang.kvev"
    batches, events, gaps, filled = record_sglang(sglang_dir, out)
    # THEN the recorder saw the gap and filled it (and any heartbeat before it joined) from
    # SGLang's replay socket: every batch is in the file, once
    assert gaps == 1 and filled >= 1
    f = StreamFile(str(out))
    try:
        seqs, hashes, raw_events = [], [], []
        for record in f.records():
            if record[1] == NOTE:
                continue
            frames = record[3]
            _topic, seq, payload = split_message(frames)
            _ts, rank, evs = decode_payload(payload)
            assert rank == 0
            seqs.append(seq)
            hashes += [h for e in map(as_tuple, evs) if e[0] == STORED for h in e[1]]
            raw_events += msgpack.unpackb(payload, raw=False)[1]
    finally:
        f.close()
    assert sorted(seqs) == list(range(batches))
    # SGLang 0.5.23's wire: tagged-map events, signed 64-bit hashes
    assert raw_events and all(isinstance(e, dict) and "type" in e for e in raw_events)
    assert len(raw_events) == events
    assert min(hashes) < 0 < max(hashes)
    # AND `kvscope events check` finds nothing
    code, report = _check(out, capsys)
    assert code == 0, report["findings"][:3]
    assert report["healthy"] and report["findings"] == []
    [publisher] = report["publishers"]
    assert publisher["batches"] == batches


@pytest.mark.parametrize(
    "fault, kind",
    [
        ("remove-unstored", "kv_event_remove_unstored"),
        ("store-conflict", "kv_event_store_conflict"),
        ("unknown-parent", "kv_event_unknown_parent"),
        ("lost-batch", "kv_event_gap"),
    ],
)
def test_a_fault_planted_in_sglangs_stream_is_found(sglang_dir, tmp_path, capsys, fault, kind):
    # GIVEN SGLang's stream with one fault planted (lost-batch: a batch lost and no replay)
    out = tmp_path / f"{fault}.kvev"
    record_sglang(sglang_dir, out, fault)
    # WHEN it is checked
    code, report = _check(out, capsys)
    # THEN exactly that fault is found, once
    assert code == 1
    assert report["summary"]["findings_by_kind"] == {kind: 1}
