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


def _create_and_leave(name: str) -> int:
    from kvscope.allocator import PoolConfig

    KVPool.create(name, PoolConfig(num_blocks=8, num_layers=1, num_kv_heads=1, head_dim=8)).close()
    return 0


def test_a_pool_of_another_format_version_is_removed_by_check_unlink_once_unmapped(
    pool_name, capsys
):
    import mmap

    from kvscope.allocator.layout import HEADER_DTYPE
    from kvscope.allocator.segment import data_path, segment_path
    from kvscope.cli import main

    # GIVEN a pool another process left behind, of another format version (its version field)
    name = pool_name
    assert wait_child(fork_child(lambda: _create_and_leave(name), 60)) == 0
    path = segment_path(name)
    with open(path, "r+b") as f:
        f.seek(HEADER_DTYPE.fields["version"][1])
        f.write((8).to_bytes(4, "little"))
    # WHEN it is checked THEN one line says so and how to remove it
    assert main(["check", name]) == 2
    err = capsys.readouterr().err.strip()
    assert "has format version 8; this kvscope reads version" in err
    assert f"`kvscope check {name} --unlink` removes it once no process maps it" in err
    # AND --unlink refuses while a process (this one) maps its file ...
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        assert main(["check", name, "--unlink"]) == 2
        assert f"still mapped by pid {os.getpid()}" in capsys.readouterr().err
    assert os.path.exists(path)
    # ... and removes both files once none does
    assert main(["check", name, "--unlink"]) == 0
    assert "unlinked pool" in capsys.readouterr().err
    assert not os.path.exists(path) and not os.path.exists(data_path(name))


def _publish_then_die(name: str) -> int:
    p = KVPool.attach(name)
    done = p.allocate("published", list(range(16)))
    p.mark_computed(done, 16)
    p.allocate("private", list(range(100, 108)))
    os.kill(os.getpid(), signal.SIGKILL)
    return 0


def test_repair_says_which_of_a_dead_processs_blocks_went_back_to_the_prefix_cache(
    make_pool, capsys
):
    from kvscope.cli import main

    # GIVEN a process that died holding a request it published (4 blocks, block_size 4) and
    # one it did not (2 blocks)
    pool = make_pool(32, local_cache_size=0)
    wait_child(fork_child(lambda: _publish_then_die(pool.name), 60))
    # WHEN the pool is repaired
    assert main(["check", pool.name, "--repair", "--json"]) == 0
    err = capsys.readouterr().err
    # THEN the line says the published ones went back to the prefix cache, not freed
    assert "2 blocks freed and 4 back in the prefix cache" in err, err
    assert pool.stats()["num_cached"] == 4


def _serve_then_die_holding_a_lock(name: str) -> int:
    from kvscope.allocator import faults

    p = KVPool.attach(name)
    p.free(p.allocate("w1-r1", list(range(8))))
    held = p.allocate("w1-r2", list(range(20, 30)))
    faults.configure("kill-holding-lock:1")
    p.free(held)  # (killed inside it, holding its locks)
    return 0


def test_a_lock_a_dead_process_held_is_shown_with_what_that_process_did_last(
    make_pool, capsys, monkeypatch
):
    import json

    from kvscope.cli import main

    # GIVEN a worker, its flight recorder on, that served a request and was killed inside
    # the free of the next one, holding the pool's locks
    monkeypatch.setenv("KVSCOPE_EVENTS", "1")
    pool = make_pool(32)
    pid = fork_child(lambda: _serve_then_die_holding_a_lock(pool.name), 60)
    wait_child(pid)
    # WHEN the pool is analyzed
    main(["analyze", pool.name, "--json"])
    found = json.loads(capsys.readouterr().out)["findings"]
    # THEN each lock it died holding is shown with its last recorded operations
    dead = [f for f in found if f["kind"] == "lock_dead_holder"]
    assert dead and all(f["owner_pid"] == pid for f in dead)
    for f in dead:
        ops = [(e["op"], e["request"]) for e in f["events"]]
        assert ("allocate", "w1-r2") in ops and ("free", "w1-r1") in ops, ops
        assert ("free", "w1-r2") not in ops  # (the free it died in: rolled back)
        assert all(e["pid"] == pid for e in f["events"])
    main(["analyze", pool.name])
    text = capsys.readouterr().out
    assert "w1-r2" in text.split("lock_dead_holder", 1)[1]
    pool.reclaim_dead()


def test_the_mappers_of_a_pools_files_are_matched_by_the_whole_path(tmp_path):
    import mmap

    from kvscope.allocator.process import mapping

    # GIVEN this process mapping a file whose name extends another's ('pool-ab' beside 'pool-a')
    longer = tmp_path / "pool-ab"
    longer.write_bytes(b"\0" * 4096)
    with open(longer, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        # THEN it maps 'pool-ab', and not 'pool-a'
        assert os.getpid() in mapping([str(longer)])
        assert os.getpid() not in mapping([str(tmp_path / "pool-a")])
    assert os.getpid() not in mapping([str(longer)])
