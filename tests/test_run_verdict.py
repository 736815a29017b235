"""`kvscope run`'s verdict as a CI reads it: leaks and dead owners fail the run by default, a
worker killed mid-run is said while the run goes on, and a dumped pool does not stay in /dev/shm.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import threading

import pytest

from kvscope.allocator.segment import data_path, segment_path
from kvscope.cli import main
from kvscope.errors import EXIT_FAIL_ON

LEAK = """
import sys
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
seq = pool.allocate("req-1", list(range(10)))
"""

# argv: pool name, a FIFO the script reads once kvscope has said the worker died.
KILLED_WORKER = """
import multiprocessing as mp
import os
import signal
import sys

from kvscope.allocator import KVPool, PoolConfig


def worker(name, ready):
    pool = KVPool.attach(name)
    pool.allocate("w-1", list(range(9)))
    ready.set()
    signal.pause()


if __name__ == "__main__":
    name, go = sys.argv[1:3]
    pool = KVPool.create(name, PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=worker, args=(name, ready))
    proc.start()
    ready.wait()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    print(f"worker pid {proc.pid}", flush=True)
    with open(go) as f:  # blocks until the test has read kvscope's line about the worker
        f.read()
    pool.close()
"""


# argv: pool name, how the script ends (raise: an uncaught exception; close: closes its pool
# first). Three requests, one of them a fork sharing its parent's blocks.
CRASH = """
import sys
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
a = pool.allocate("req-a", list(range(9)))
b = pool.allocate("req-b", list(range(100, 106)))
c = pool.fork(a, "req-c")
if sys.argv[2] == "close":
    pool.close()
    sys.exit(0)
raise RuntimeError("the model exploded")
"""


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.slow
def test_a_leak_fails_the_run_by_default_and_fail_on_error_lets_it_pass(
    capfd, tmp_path, pool_name, monkeypatch
):
    # GIVEN a script that exits without freeing its request, run from a working directory
    # other than the dump directory
    work, dumps = tmp_path / "work", tmp_path / "dumps"
    work.mkdir()
    dumps.mkdir()
    monkeypatch.chdir(work)
    leak = write(tmp_path, "leak.py", LEAK)
    # WHEN it runs with the defaults
    code = main(["run", "--dump-dir", str(dumps), leak, pool_name])
    err = capfd.readouterr().err
    # THEN the run fails as LeakSanitizer's would, and says why
    assert code == EXIT_FAIL_ON, err
    assert "but leaks matched --fail-on leak" in err and "health: UNHEALTHY" in err
    # and the dump and its history lie in the dump directory, nothing in the working one
    assert os.listdir(work) == []
    names = sorted(os.listdir(dumps))
    assert [n for n in names if n.endswith(".kvd")] and any(
        n.endswith(".history.json") for n in names
    ), names
    # and the dumped pool, held by no live process, is gone from /dev/shm, as the verdict says
    assert f"removed pool {pool_name!r}" in err
    assert not os.path.exists(segment_path(pool_name))
    assert not os.path.exists(data_path(pool_name))
    # WHEN the same script runs with --fail-on error (the behaviour before leaks failed a run)
    code = main(["run", "--fail-on", "error", "--keep-pool", "--dump-dir", str(dumps), leak,
                 pool_name])  # fmt: skip
    err = capfd.readouterr().err
    # THEN the leak is a warning and the run passes; --keep-pool kept the pool and says so
    assert code == 0, err
    assert "(warning under --fail-on error)" in err
    assert f"kept pool {pool_name!r} (--keep-pool)" in err
    assert os.path.exists(segment_path(pool_name))
    # WHEN the script unlinks its pool before it exits, with --keep-pool
    unlinks = write(tmp_path, "unlinks.py", LEAK + "pool.unlink()\n")
    other = pool_name + "-u"
    code = main(["run", "--keep-pool", "--dump-dir", str(dumps), unlinks, other])
    err = capfd.readouterr().err
    # THEN the verdict says the pool could not be kept, and it is gone with the run
    assert code == EXIT_FAIL_ON, err
    assert f"pool {other!r} was unlinked by the script: --keep-pool cannot keep it" in err, err
    assert not os.path.exists(segment_path(other))


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_reported_while_the_script_still_runs(tmp_path, pool_name):
    # GIVEN a script whose worker is killed with SIGKILL holding a block; the script then waits
    # on a FIFO that this test opens only once kvscope has named the dead worker
    script = write(tmp_path, "killed.py", KILLED_WORKER)
    go = str(tmp_path / "go")
    os.mkfifo(go)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "run", "--dump-dir", str(tmp_path), script,
         pool_name, go],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    # (a run that never says it would wait on the FIFO for good: end it after two minutes)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        assert proc.stderr is not None and proc.stdout is not None
        said = ""
        for line in proc.stderr:
            if "died while attached" in line:
                said = line
                break
        # WHEN kvscope has said it, the script goes on to its end
        with open(go, "w") as f:
            f.write("go")
        out = proc.stdout.read()
        rest = proc.stderr.read()
        code = proc.wait()
    finally:
        watchdog.cancel()
    # THEN the line came while the script was still running, naming the worker and its block
    pid = int(re.findall(r"worker pid (\d+)", out)[0])
    assert f"leak_dead_owner block 0 pid {pid}" in said, said + rest
    assert "holding 3 block(s)" in said
    # and the dead owner fails the run by default, though the script itself succeeded
    assert code == EXIT_FAIL_ON, rest
    assert len(glob.glob(str(tmp_path / "kvscope-*.kvd"))) == 1


@pytest.mark.slow
@pytest.mark.parametrize("end", ["raise", "close"])
def test_after_a_crash_each_request_is_one_line_and_the_summary_agrees(
    capfd, tmp_path, pool_name, end
):
    # GIVEN a script that ends holding three requests (one a fork of another), by raising or
    # by closing its pool first
    crash = write(tmp_path, "crash.py", CRASH)
    # WHEN it runs under kvscope
    main(["run", "--dump-dir", str(tmp_path), crash, pool_name, end])
    err = capfd.readouterr().err
    # THEN the analysis lists each request once, as leak_finished (not also as a dead owner's)
    analysis = err[err.index("kvscope run: child pid") :]
    listed = re.findall(r"^  (\w+) block.* request '(req-\w)'", analysis, re.M)
    assert sorted(listed) == [("leak_finished", f"req-{r}") for r in "abc"], analysis
    # and the LEAK SUMMARY counts the same requests and their distinct blocks: 3 of req-a
    # (shared with its fork req-c) and 2 of req-b
    (line,) = [x for x in err.splitlines() if "LEAK SUMMARY" in x]
    when = "at exit" if end == "raise" else "when the pool was closed"
    assert "5 blocks (15 tokens of KV) in 3 request(s) still held by pid" in line, line
    assert line.endswith(when)


@pytest.mark.slow
def test_check_repair_clears_what_it_repaired_so_the_pool_reads_healthy(capfd, tmp_path, pool_name):
    # GIVEN the pool a crashed script left behind (kept), whose ring recorded its leaks
    crash = write(tmp_path, "crash.py", CRASH)
    main(["run", "--keep-pool", "--dump-dir", str(tmp_path), crash, pool_name, "raise"])
    capfd.readouterr()
    assert main(["check", pool_name]) == 1
    capfd.readouterr()
    # WHEN it is repaired
    code = main(["check", pool_name, "--repair"])
    out, err = capfd.readouterr()
    # THEN the repair returns the dead process's blocks, says which findings it cleared, and
    # the pool reads healthy, then and afterwards
    assert code == 0, err
    assert "reclaimed 3 sequences (" in err and "from 1 dead process(es) (pid " in err
    assert "): 5 blocks freed, the blocks they shared with live ones losing a reference" in err
    assert "cleared the recorded findings it repaired (3 leak_finished)" in err
    assert "health: OK - no findings" in out
    assert main(["check", pool_name]) == 0


# argv: pool name. One warning recorded in the findings ring, the pool closed and removed.
WARNED = """
import sys
from kvscope.allocator import KVPool, PoolConfig
from kvscope.allocator.findings import Finding, FindingKind
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
pool.report(Finding(FindingKind.LOCK_HELD_TOO_LONG, "lock 'user:sched' held 1.0 s so far"))
pool.close()
pool.unlink()
"""


@pytest.mark.slow
def test_a_clean_run_counts_each_warning_it_printed_once(capfd, tmp_path, pool_name):
    # GIVEN a script whose only finding is one warning in its pool's findings ring
    script = write(tmp_path, "warned.py", WARNED)
    # WHEN it runs
    code = main(["run", "--dump-dir", str(tmp_path), script, pool_name])
    err = capfd.readouterr().err
    # THEN the warning is printed once, and the verdict counts it once (the ring's finding is
    # in the final read of the pool too: one finding, not two)
    assert code == 0, err
    assert err.count("warning: lock_held_too_long") == 1, err
    assert "no error, no leak, 1 warning(s); nothing to dump" in err, err


# argv: pool name. A write after free the process's own checks never see: it leaves at once.
UNSEEN_WRITE = """
import os, sys
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
seq = pool.allocate("a", list(range(9)))
blocks = list(seq.block_table)
pool.free(seq)
pool.kv[0, 0, blocks[1], 1] = 5.0
os._exit(0)
"""


@pytest.mark.slow
def test_the_verdict_says_which_findings_the_dump_without_data_cannot_show(
    capfd, tmp_path, pool_name
):
    # GIVEN a script that writes into a freed block and leaves before any check of its own
    script = write(tmp_path, "unseen.py", UNSEEN_WRITE)
    # WHEN it runs under kvscope, which checks the live pool's K/V at the end
    main(["run", "--dump-dir", str(tmp_path), script, pool_name])
    err = capfd.readouterr().err
    # THEN the write after free is in the verdict, and a line says the dump (no K/V data) cannot
    # show it, so that analyze of the dump lists one finding fewer
    assert "use_after_free block" in err, err
    assert "1 of the findings above were read from the pool's K/V data" in err, err
    (dump,) = glob.glob(str(tmp_path / "*.kvd"))
    assert main(["analyze", dump, "--json"]) in (0, 1)
    out = capfd.readouterr().out
    assert '"use_after_free"' not in out
