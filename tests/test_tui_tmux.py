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
