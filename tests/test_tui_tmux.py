"""The installed `kvscope top` in a real terminal (tmux) against a live pool."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
    pytest.mark.slow,
]


# The terminal's size comes from tmux: never from COLUMNS / LINES that something in the test
# session may have exported (shutil.get_terminal_size, and so Textual, prefers them).
_ENV = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
# A tmux server of this test process's own: a command in a session gets the environment of the
# server, and a server another test suite started (with its own KVSCOPE_SHM_DIR) would run
# `kvscope top` against that suite's pools.
_SERVER = ["tmux", "-L", f"kvscope-test-{os.getpid()}"]


@pytest.fixture(autouse=True, scope="module")
def _own_server():
    yield
    subprocess.run([*_SERVER, "kill-server"], capture_output=True)


def _tmux(*args: str) -> str:
    return subprocess.run(
        [*_SERVER, *args], capture_output=True, text=True, check=False, env=_ENV
    ).stdout


def _tmux_rc(*args: str) -> int:
    return subprocess.run([*_SERVER, *args], capture_output=True, env=_ENV).returncode


def _new_session(session: str, width: int, height: int, command: str) -> None:
    subprocess.run(
        [
            *_SERVER,
            "new-session",
            "-d",
            "-s",
            session,
            "-x",
            str(width),
            "-y",
            str(height),
            command,
        ],
        check=True,
        env=_ENV,
    )


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
    _new_session(session, 160, 48, _top_command(pool.name))
    try:
        # WHEN kvscope top runs in a 160x48 terminal (panels render on their own frames: wait
        # for all of them)
        screen = _wait_for(session, "tmux-request", "healthy", "blocks (256)", pool.name)
        # THEN the screen shows the pool, its health, the block map and the request
        assert pool.name in screen
        assert "healthy" in screen
        assert "blocks (256)" in screen
        assert "tmux-request" in screen
        # AND a request the pool's user adds shows up live
        pool.allocate("late-request", list(range(4)))
        screen = _wait_for(session, "late-request")
        assert "late-request" in screen
        # AND q quits
        _tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + PATIENCE_S
        while not _tmux_rc("has-session", "-t", session) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _tmux_rc("has-session", "-t", session)
    finally:
        _tmux("kill-session", "-t", session)


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


# Only ever an upper bound for what happens anyway (a busy CI machine draws slowly).
PATIENCE_S = 120.0


def _wait_for(session: str, *needles: str) -> str:
    screen = ""
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        time.sleep(0.2)
        screen = _tmux("capture-pane", "-p", "-t", session, "-S", "-200")
        if all(n in screen for n in needles):
            break
    return screen


def _runs(marker: str) -> bool:
    """True while a process whose command line holds marker runs."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return bool(out.strip())


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
    _new_session(session, 120, 36, command)
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
        _tmux("kill-session", "-t", session)


def test_run_live_ends_when_its_terminal_hangs_up(tmp_path, pool_name):
    # GIVEN a script under `kvscope run --live` whose TUI is on the screen
    script = tmp_path / "live.py"
    script.write_text(LIVE_SCRIPT)
    go = tmp_path / "go"
    kvscope = shutil.which("kvscope", path=str(__import__("pathlib").Path(sys.executable).parent))
    session = f"kvscope-hup-{uuid.uuid4().hex[:8]}"
    command = f"cd {tmp_path} && {kvscope} run --live --stop-grace 1 {script} {pool_name} {go}"
    _new_session(session, 120, 36, command)
    try:
        screen = _wait_for(session, "req-live", "script running")
        assert "script running" in screen
    finally:
        # WHEN the terminal goes away (the session is killed: SIGHUP)
        _tmux("kill-session", "-t", session)
    # THEN kvscope closes its TUI, stops the script and exits: nothing of the run is left
    deadline = time.monotonic() + PATIENCE_S
    while _runs(str(script)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _runs(str(script))
    subprocess.run(["pkill", "-9", "-f", str(script)], capture_output=True)
    assert not left, "kvscope run --live kept running after its terminal hung up"
