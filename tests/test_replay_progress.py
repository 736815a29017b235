"""A shrink's progress on stderr (kvscope/verbs/replay.py `_Progress`): a line every 10 s where
stderr is no terminal, with the runs so far and the operations left."""

from __future__ import annotations

import os
import signal

import pytest

from kvscope.cli import main
from kvscope.verbs import replay as verb
from tests.test_replay import record, run_script


def test_a_shrink_says_how_far_it_got_every_ten_seconds_off_a_terminal(monkeypatch, capsys):
    # GIVEN a shrink's progress on a stderr that is no terminal, its clock at 0 s
    now = [100.0]
    monkeypatch.setattr(verb.time, "monotonic", lambda: now[0])
    progress = verb._Progress(618)
    # WHEN runs are reported at 4 s, 10.5 s, 15 s and 21 s
    for at, runs, left in [(4, 90, 500), (10.5, 233, 494), (15, 400, 420), (21, 522, 364)]:
        now[0] = 100.0 + at
        progress(runs, left)
    progress.done()
    # THEN a line at 10.5 s and one at 21 s, none between, and nothing left to clear
    assert capsys.readouterr().err.splitlines() == [
        "kvscope replay: shrinking: 233 runs, 494 of 618 operation(s) left, 10 s",
        "kvscope replay: shrinking: 522 runs, 364 of 618 operation(s) left, 21 s",
    ]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_shrink_stopped_by_a_signal_keeps_the_smallest_run_so_far_and_its_script(
    sig, monkeypatch, tmp_path, pool_name, capsys
):
    # GIVEN a recorded run with a double free, and a shrink of it stopped by a signal once
    # 5 candidates have run (raised where it lands, as a user's Ctrl-C or a timeout's SIGTERM)
    log = tmp_path / "run.ops"
    record(log, pool_name, "double-free")

    def stopping(self, runs: int, left: int) -> None:
        if runs >= 5:
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(verb._Progress, "__call__", stopping)
    # (SIGINT as a terminal's Ctrl-C delivers it: a process started in the background by a
    # non-interactive shell, a CI runner's, inherits it ignored)
    was = signal.signal(signal.SIGINT, signal.default_int_handler)
    script = tmp_path / "repro.py"
    # WHEN the shrink is stopped
    try:
        code = main(["replay", str(log), "--shrink", "--emit-script", str(script)])
    finally:
        signal.signal(signal.SIGINT, was)
    out = capsys.readouterr().out
    # THEN the replay's own result and the smallest run that found it so far are printed,
    # and written as a script that finds it; the exit code says how it was stopped
    assert code == (130 if sig == signal.SIGINT else 143)
    assert "reproduced the recorded run up to a finding" in out
    assert "shrink interrupted: the smallest run found so far" in out
    assert "still finds 'double_free'" in out
    run = run_script(str(script), tmp_path)
    assert run.returncode == 1 and "double_free" in run.stdout, run.stdout + run.stderr
    # AND SIGTERM's own handling is back as it was
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
