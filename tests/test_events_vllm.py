"""`kvscope events record` and `check` against vLLM's own publisher and its v1 BlockPool.

vLLM is installed at test time without its dependencies into a folder of its own
(bench/peer_vllm.py says how and why): KVSCOPE_VLLM_DIR names one already installed, else it
goes to /tmp/kvscope-vllm-peer. Where it cannot be installed or imported the tests skip with
the reason. tests/vllm_events_driver.py drives the BlockPool with events on and publishes
them with vLLM's ZmqEventPublisher; the stream is recorded by the `kvscope events record`
command (a process of its own, stopped with Ctrl-C) and checked.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvscope.errors import UsageError
from kvscope.events.checker import check_file
from kvscope.events.streamfile import NOTE, REPLAYED, StreamFile
from tests.peers import installed_peer

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.33.0"
DEFAULT_DIR = "/tmp/kvscope-vllm-peer"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_dir() -> str:
    return installed_peer(
        f"vLLM {VLLM_VERSION}",
        os.environ.get("KVSCOPE_VLLM_DIR", DEFAULT_DIR),
        [f"vllm=={VLLM_VERSION}", "-r", str(ROOT / "bench" / "vllm_import_deps.txt")],
        "import vllm.distributed.kv_events, vllm.v1.core.block_pool",
        marker="vllm",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _line(proc: subprocess.Popen, want: str, timeout_s: float = 900) -> str:
    """The driver's next line, which must start with `want`."""
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line.startswith(want), f"driver said {line!r}, expected {want!r}"
    return line


def record_vllm(vllm_dir: str, out: Path, *driver_args: str, env=None) -> tuple[int, int]:
    """Run the driver and `kvscope events record` on it until every batch is recorded.

    Returns (batches, events) the driver published.
    """
    pub, replay = _free_port(), _free_port()
    driver = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "vllm_events_driver.py"), vllm_dir]
        + [str(pub), str(replay), *driver_args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    recorder = None
    try:
        _line(driver, "ready")
        recorder = subprocess.Popen(
            [sys.executable, "-m", "kvscope", "events", "record"]
            + [f"tcp://127.0.0.1:{pub}", "--replay", f"tcp://127.0.0.1:{replay}", "-o", str(out)],
            stderr=subprocess.PIPE,
            text=True,
        )
        _line(driver, "accepted")
        assert driver.stdin is not None
        driver.stdin.write("go\n")
        driver.stdin.flush()
        _, batches, events = _line(driver, "done").split()
        # Every batch on disk (the recorder flushes when idle); a bound, not a pace.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if out.exists() and _num_batches(out) >= int(batches):
                break
            time.sleep(0.2)
        # SIGTERM, not SIGINT: a test run started as a background job of a shell without
        # job control starts every child with SIGINT ignored (CI's runs were)
        recorder.send_signal(signal.SIGTERM)
        try:
            _, err = recorder.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # (say what the recorder said and where it was; its signal masks too)
            with open(f"/proc/{recorder.pid}/status") as f:
                masks = [ln.strip() for ln in f if ln.startswith(("SigPnd", "SigBlk", "SigIgn"))]
            recorder.kill()
            _, err = recorder.communicate()
            on_disk = _num_batches(out) if out.exists() else 0
            raise AssertionError(
                f"`kvscope events record` did not stop within 60 s of SIGTERM ({on_disk} of "
                f"{batches} batches on disk); {masks}; its stderr: {err!r}"
            ) from None
        assert recorder.returncode == 0, err
        driver.stdin.write("quit\n")
        driver.stdin.flush()
        driver.wait(timeout=60)
        return int(batches), int(events)
    finally:
        for p in (recorder, driver):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def _num_batches(path: Path) -> int:
    """Batches (published or replayed) in the file so far; 0 before its header is on disk."""
    try:
        f = StreamFile(str(path))
    except UsageError:
        return 0
    try:
        return sum(1 for r in f.records() if r[1] != NOTE)
    finally:
        f.close()


@pytest.mark.parametrize(
    "hashes,full",
    [
        pytest.param("int", False, id="int-hashes"),
        pytest.param("bytes", True, id="bytes-hashes-full-mode"),
    ],
)
def test_vllms_own_stream_is_recorded_whole_and_checks_clean(vllm_dir, tmp_path, hashes, full):
    # GIVEN vLLM's BlockPool with events on, driven through prefix hits, two copies of one
    # prompt, evictions and a prefix-cache reset, published by vLLM's ZmqEventPublisher
    env = {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1" if hashes == "int" else "0"}
    out = tmp_path / "vllm.kvev"
    args = ["--steps", "300"] + (["--full"] if full else [])
    # WHEN `kvscope events record` records it and `events check` checks it
    batches, events = record_vllm(vllm_dir, out, *args, env=env)
    report = check_file(str(out))
    # THEN every batch is there from seq 0 and the stream is clean
    (pub,) = report["publishers"]
    assert (pub["first_seq"], pub["last_seq"]) == (0, batches - 1)
    assert pub["events"] == events and pub["gaps"] == 0 and pub["complete"]
    assert report["findings"] == [], report["findings"][:3]
    s = report["summary"]
    # the workload did what it says: stores, evictions, a clear, repeated hashes
    assert s["stored"] > s["removed"] > 0 and s["cleared"] == 1
    f = StreamFile(str(out))
    first = next(iter(f.records()))
    f.close()
    kind = bytes if hashes == "bytes" else int
    payload = first[3][2]
    from kvscope.events.wire import decode_payload

    assert all(type(h) is kind for e in decode_payload(payload)[2] for h in e.block_hashes)
    if full:
        assert s["stored"] > pub["blocks_stored"] + s["removed"] - 1


def test_a_recording_that_joins_late_is_filled_from_the_replay_socket(vllm_dir, tmp_path):
    # GIVEN vLLM publishing 40 steps before the recorder subscribes (those batches go to no
    # one): the recorder asks the replay socket for what it missed
    out = tmp_path / "late.kvev"
    batches, _ = record_vllm(vllm_dir, out, "--steps", "60", "--early", "40")
    # THEN the file holds every batch from seq 0, replayed ones marked, and checks clean
    report = check_file(str(out))
    (pub,) = report["publishers"]
    assert (pub["first_seq"], pub["last_seq"], pub["gaps"]) == (0, batches - 1, 0)
    f = StreamFile(str(out))
    replayed = sum(1 for r in f.records() if r[1] == REPLAYED)
    f.close()
    assert replayed == pub["replayed"] > 0
    assert report["findings"] == []
