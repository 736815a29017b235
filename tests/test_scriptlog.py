"""kvscope.scriptlog: the script's output kept while the TUI has the terminal, then printed."""

from __future__ import annotations

import subprocess
import sys

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
    assert log.tail() == [
        ("stdout", "line one"),
        ("stdout", "progress 100%"),
        ("stderr", "on stderr"),
        ("stdout", "no newline at the end"),
    ]
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
