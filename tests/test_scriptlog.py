"""kvscope.scriptlog: the script's output kept while the TUI has the terminal, then printed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvscope.scriptlog import ScriptLog, describe_exit

CHILD = r"""
import sys
print("line one")
sys.stdout.write("progress 10%\rprogress 100%\n")
print("on stderr", file=sys.stderr)
sys.stdout.write("no newline at the end")
sys.exit(4)
"""


def test_output_is_kept_then_printed_whole(tmp_path, capfd):
    # GIVEN a child whose output goes to a ScriptLog
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    log = ScriptLog(proc, str(tmp_path))
    proc.wait()
    for t in log._threads:
        t.join(10)
    # THEN nothing reached the terminal yet, and the panel's lines are there (a carriage return
    # rewrites its line; the unfinished last line shows too)
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    # (two pipes, two reader threads: the order between streams is not the test's to fix)
    tail = log.tail()
    assert [line for s, line in tail if s == "stdout"] == [
        "line one",
        "progress 100%",
        "no newline at the end",
    ]
    assert [line for s, line in tail if s == "stderr"] == ["on stderr"]
    assert log.status() == "exited with status 4"
    # WHEN released THEN the whole output is printed to where it was going, byte for byte
    log.close()
    out, err = capfd.readouterr()
    assert out == "line one\nprogress 10%\rprogress 100%\nno newline at the end"
    assert err == "on stderr\n"


def test_exit_descriptions():
    assert describe_exit(None) == "running"
    assert describe_exit(0) == "exited with status 0"
    assert describe_exit(-9) == "killed by SIGKILL"


@pytest.mark.slow
def test_run_live_hands_the_output_to_the_tui_then_prints_it_once(
    tmp_path, pool_name, monkeypatch, capfd
):
    # GIVEN a TUI that records what the script panel would show
    import time

    import kvscope.verbs.run as run_verb
    from kvscope.cli import main

    seen: list[list[tuple[str, str]]] = []

    def fake_top(target, hz, script=None, stop=None):
        for _ in range(200):
            if any(line == "before the pool" for _, line in script.tail()):
                break
            time.sleep(0.05)
        seen.append(script.tail())
        return 0

    monkeypatch.setattr(run_verb, "load_run_top", lambda what="": fake_top)
    script = tmp_path / "s.py"
    script.write_text(
        "import sys\n"
        "print('before the pool')\n"
        "from kvscope.allocator import KVPool, PoolConfig\n"
        "pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=16, block_size=4, head_dim=8,"
        " num_layers=1, dtype='float32'))\n"
        "print('after the pool', file=sys.stderr)\n"
        "pool.close()\n"
        "pool.unlink()\n"
    )
    # WHEN it runs under --live
    assert main(["run", "--live", "--dump-dir", str(tmp_path), str(script), pool_name]) == 0
    out, err = capfd.readouterr()
    # THEN the panel had the output while the TUI was up, and it is printed once afterwards
    assert ("stdout", "before the pool") in seen[0]
    assert out.count("before the pool") == 1
    assert err.count("after the pool") == 1
