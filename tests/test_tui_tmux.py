"""The installed `kvscope top` in a real terminal (tmux) against a live pool."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=False).stdout


def _top_command(name: str) -> str:
    """The installed `kvscope top` next to this interpreter."""
    kvscope = shutil.which("kvscope", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert kvscope, "the kvscope console script is not installed next to the interpreter"
    return f"{kvscope} top {name} --hz 20"


def test_kvscope_top_in_tmux_shows_the_live_pool(make_pool):
    # GIVEN a live pool with a request in it
    pool = make_pool(256)
    pool.allocate("tmux-request", list(range(12)))
    session = f"kvscope-top-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        [
            "tmux",
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            "160",
            "-y",
            "48",
            _top_command(pool.name),
        ],
        check=True,
    )
    try:
        # WHEN kvscope top runs in a 160x48 terminal
        screen = ""
        for _ in range(100):
            time.sleep(0.2)
            screen = _tmux("capture-pane", "-p", "-t", session)
            # Panels render on their own frames: wait for all of them.
            if all(x in screen for x in ("tmux-request", "healthy", "blocks (256)", pool.name)):
                break
        # THEN the screen shows the pool, its health, the block map and the request
        assert pool.name in screen
        assert "healthy" in screen
        assert "blocks (256)" in screen
        assert "tmux-request" in screen
        # AND a request the pool's user adds shows up live
        pool.allocate("late-request", list(range(4)))
        for _ in range(50):
            time.sleep(0.2)
            screen = _tmux("capture-pane", "-p", "-t", session)
            if "late-request" in screen:
                break
        assert "late-request" in screen
        # AND q quits
        _tmux("send-keys", "-t", session, "q")
        for _ in range(50):
            time.sleep(0.1)
            if subprocess.run(
                ["tmux", "has-session", "-t", session], capture_output=True
            ).returncode:
                break
        assert subprocess.run(
            ["tmux", "has-session", "-t", session], capture_output=True
        ).returncode
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


LIVE_SCRIPT = """
import os, sys, time
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=32, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
seq = pool.allocate("req-live", list(range(10)))
print("hello from the script")
print("a warning on stderr", file=sys.stderr)
while not os.path.exists(sys.argv[2]):  # the test says when to go on
    time.sleep(0.05)
pool.free(seq)
print("done serving")
pool.close()
pool.unlink()
sys.exit(3)
"""


def _wait_for(session: str, *needles: str, tries: int = 150) -> str:
    screen = ""
    for _ in range(tries):
        time.sleep(0.2)
        screen = _tmux("capture-pane", "-p", "-t", session, "-S", "-200")
        if all(n in screen for n in needles):
            break
    return screen


@pytest.mark.slow
def test_run_live_keeps_the_script_output_and_shows_its_exit(tmp_path, pool_name):
    # GIVEN a script under `kvscope run --live` in a 120x36 terminal, waiting for a file
    script = tmp_path / "live.py"
    script.write_text(LIVE_SCRIPT)
    go = tmp_path / "go"
    kvscope = shutil.which("kvscope", path=str(__import__("pathlib").Path(sys.executable).parent))
    session = f"kvscope-live-{uuid.uuid4().hex[:8]}"
    command = (
        f"cd {tmp_path} && {kvscope} run --live {script} {pool_name} {go}; echo EXIT=$?; sleep 60"
    )
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "120", "-y", "36", command], check=True
    )
    try:
        # THEN the TUI shows the pool, the script's output so far and that it runs
        screen = _wait_for(session, "req-live", "hello from the script", "script running")
        assert "hello from the script" in screen and "a warning on stderr" in screen
        assert "script running" in screen
        # WHEN the script goes on and exits with status 3 THEN the TUI says so
        go.write_text("")
        screen = _wait_for(session, "script exit 3", "done serving")
        assert "script exit 3" in screen and "done serving" in screen
        # WHEN the TUI closes THEN the script's whole output is printed, and the exit code kept
        _tmux("send-keys", "-t", session, "q")
        after = _wait_for(session, "EXIT=")
        # (the TUI's alternate screen is gone: this is the terminal's own text)
        assert "script output" not in after
        for line in ("hello from the script", "a warning on stderr", "done serving", "EXIT=3"):
            assert line in after
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
