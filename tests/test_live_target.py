"""A live pool read while its server shuts down (kvscope/target.py): a process that detached
cleanly after the copy was taken is not a dead owner of what the copy shows it holding, and a
pool removed while it was read is one line, not a report of dead processes and missing files."""

from __future__ import annotations

import os
import signal

import pytest

from kvscope.allocator import KVPool
from kvscope.allocator.errors import PoolError
from kvscope.target import live_target, removed_meanwhile
from tests.forking import fork_child, wait_child


def _attach_hold_then(name: str, ready_w: int, go_r: int, die: bool) -> int:
    """Attach and hold a request; once told, close cleanly (freeing it) or die attached."""
    p = KVPool.attach(name)
    seq = p.allocate("worker-req", list(range(10)))
    os.write(ready_w, b"1")
    os.read(go_r, 1)
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    p.free(seq)
    p.close()
    return 0


@pytest.mark.parametrize("die", [False, True])
def test_a_process_that_detached_after_the_copy_is_alive_in_it_one_that_died_is_not(make_pool, die):
    # GIVEN a copy of a live pool taken while a worker holds a request
    pool = make_pool(32)
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = fork_child(lambda: _attach_hold_then(pool.name, ready_w, go_r, die), 60)
    os.read(ready_r, 1)
    t = live_target(pool.name)
    c = [i for i in range(len(t.view.clients)) if int(t.view.clients["pid"][i]) == pid][0]
    start = int(t.view.clients["start"][c])
    # WHEN the worker then ends: closing cleanly, or killed while attached
    os.write(go_w, b"1")
    wait_child(pid)
    # THEN the copy counts it alive only where it detached (a shutdown, not a death) ...
    assert t.alive(pid, start) is (not die)
    findings = t.findings().findings
    assert any(f.kind == "leak_dead_owner" for f in findings) is die
    # ... and a process the copy did not show attached is judged as it is now
    assert t.alive(2**22 + 7, 1) is False
    pool.reclaim_dead()


def test_a_pool_removed_while_it_was_read_is_one_line(make_pool, capsys):
    from kvscope.cli import main

    # GIVEN a live pool read, then removed (its server shut down and unlinked it)
    pool = make_pool(32)
    live_target(pool.name)
    removed_meanwhile(pool.name)  # (still there: nothing said)
    name = pool.name
    pool.close()
    pool.unlink()
    # THEN the reader says so in one line instead of reporting on what is gone
    with pytest.raises(PoolError, match=f"pool '{name}' was removed while it was read"):
        removed_meanwhile(name)
    # (and a verb that finds it gone before reading says that it does not exist)
    assert main(["check", name]) == 2
    assert "does not exist" in capsys.readouterr().err
