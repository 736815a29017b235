"""A shrink's progress on stderr (kvscope/verbs/replay.py `_Progress`): a line every 10 s where
stderr is no terminal, with the runs so far and the operations left."""

from __future__ import annotations

from kvscope.verbs import replay as verb


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
