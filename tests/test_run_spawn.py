"""`kvscope run` reaches the processes the script starts, whatever multiprocessing start method.

A worker started with spawn or forkserver is a fresh interpreter: it inherits the environment,
not the hooks. These tests run the same script with fork, spawn and forkserver and expect the
same findings, with the worker's pid, in the same places.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from kvscope.analysis import analyze_view
from kvscope.cli import main
from kvscope.dumpfile import alive_for, read_dump
from kvscope.errors import EXIT_FAIL_ON

# argv: start method, pool name, who creates the pool (worker|parent), what the worker does
# (leak: one request never freed; clean: every request freed).
WORKERS = """
import multiprocessing as mp
import os
import sys

from kvscope.allocator import KVPool, PoolConfig

CONFIG = PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32")


def worker(name, create, what):
    pool = KVPool.create(name, CONFIG) if create else KVPool.attach(name)
    print(f"worker pid {os.getpid()}", flush=True)
    seqs = [pool.allocate(f"req-{i}", list(range(i, i + 9))) for i in range(4)]
    for s in seqs:
        pool.append(s, [1, 2, 3])
    kept = seqs.pop() if what == "leak" else None
    for s in seqs:
        pool.free(s)
    if kept is None:
        pool.close()
        if create:
            pool.unlink()


if __name__ == "__main__":
    method, name, creator, what = sys.argv[1:5]
    parent = KVPool.create(name, CONFIG) if creator == "parent" else None
    proc = mp.get_context(method).Process(target=worker, args=(name, creator == "worker", what))
    proc.start()
    proc.join()
    if parent is not None:
        parent.close()
        parent.unlink()
    sys.exit(proc.exitcode)
"""

METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture
def workers(tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "workers.py"
    path.write_text(WORKERS)
    return str(path)


def worker_pid(out: str) -> int:
    (pid,) = re.findall(r"worker pid (\d+)", out)
    return int(pid)


def dumped_findings(tmp_path, kind: str) -> tuple[dict, list[dict]]:
    (path,) = glob.glob(str(tmp_path / "kvscope-*.kvd"))
    view, dh = read_dump(path)
    rep = analyze_view(view, alive=alive_for(dh), dump_header=dh)
    return rep, [f for f in rep["findings"] if f["kind"] == kind]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_workers_leak_is_reported_with_its_pid(capfd, tmp_path, pool_name, workers, method):
    # GIVEN a worker that creates its own pool and exits holding one request's blocks
    # WHEN the script that starts it runs under kvscope with --fail-on leak
    code = main(
        ["run", "--fail-on", "leak", "--dump-dir", str(tmp_path), workers]
        + [method, pool_name, "worker", "leak"]
    )
    out, err = capfd.readouterr()
    pid = worker_pid(out)
    # THEN the worker's exit check reports the leak as it happens, naming the worker
    assert code == EXIT_FAIL_ON, err
    assert "leak_finished block" in err and f"pid {pid} request 'req-3'" in err
    assert f"LEAK SUMMARY: pool '{pool_name}'" in err and f"held by pid {pid}" in err
    # AND the pool the worker created is dumped, and its analysis names the worker and request
    rep, leaks = dumped_findings(tmp_path, "leak_finished")
    assert [(f["owner_pid"], f["request"]) for f in leaks] == [(pid, "req-3")]
    assert "blocks leaked" in rep["pool"]["dump"]["reason"]


# A fault the allocator reports itself, and one only lockdep (installed per pool) finds.
FAULTS = {"double-free": "double_free", "lock-inversion": "lock_order_cycle"}


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("method", METHODS)
def test_a_fault_injected_in_a_worker_is_found(capfd, tmp_path, pool_name, workers, method, fault):
    # GIVEN a worker that attaches to its parent's pool and frees every request
    # WHEN the run injects a fault
    code = main(
        ["run", "--inject", fault, "--dump-dir", str(tmp_path), workers]
        + [method, pool_name, "parent", "clean"]
    )
    out, err = capfd.readouterr()
    pid = worker_pid(out)
    # THEN the fault fires in the worker and its finding is an error that names the worker
    kind = FAULTS[fault]
    assert code == EXIT_FAIL_ON, err
    assert f"injecting fault {fault!r} (pid {pid})" in err
    assert re.search(rf"error: {kind} (block \d+ )?pid {pid}", err), err
    _, found = dumped_findings(tmp_path, kind)
    assert found and {f["owner_pid"] for f in found} == {pid}


@pytest.mark.slow
def test_installed_command_reaches_a_spawned_worker(tmp_path, pool_name, workers):
    # GIVEN the installed `kvscope` command and a spawned worker that leaks
    exe = shutil.which("kvscope") or os.path.join(os.path.dirname(sys.executable), "kvscope")
    r = subprocess.run(
        [exe, "run", "--fail-on", "leak", workers, "spawn", pool_name, "worker", "leak"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # THEN the leak is found in the worker, and nothing else is said (no import warnings)
    assert r.returncode == EXIT_FAIL_ON, r.stderr
    pid = worker_pid(r.stdout)
    assert f"pid {pid} request 'req-3'" in r.stderr
    assert "Warning" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_processes_outside_a_run_get_no_hooks(tmp_path):
    # GIVEN a Python process that imports the pool with no run directory, a stale one, a live one
    probe = "import kvscope.allocator.pool as p; print(len(p.OPEN_HOOKS), p.UNLINK_HOOK is None)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSCOPE_")}

    def hooks(run_dir: str | None) -> str:
        e = env if run_dir is None else {**env, "KVSCOPE_RUN_DIR": run_dir}
        r = subprocess.run(
            [sys.executable, "-c", probe], env=e, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    # THEN only the live run's processes install anything
    assert hooks(None) == "0 True"
    assert hooks(str(tmp_path / "gone")) == "0 True"
    assert hooks(str(tmp_path)) == "2 False"


# A worker that imports kvscope inside its target (not at its module's top), opens the pool
# there, and raises holding a request.
RAISES = """
import multiprocessing as mp
import sys


def worker(name):
    from kvscope.allocator import KVPool

    pool = KVPool.attach(name)
    print(f"worker pid {__import__('os').getpid()}", flush=True)
    pool.allocate("held", list(range(9)))
    [][1]


if __name__ == "__main__":
    from kvscope.allocator import KVPool, PoolConfig

    method, name = sys.argv[1:3]
    parent = KVPool.create(name, PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1))
    proc = mp.get_context(method).Process(target=worker, args=(name,))
    proc.start()
    proc.join()
    parent.close()
    parent.unlink()
"""


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_a_worker_that_opens_the_pool_in_its_target_and_raises_is_named_by_the_exception(
    capfd, tmp_path, pool_name, method, monkeypatch
):
    # GIVEN a worker whose target imports kvscope, attaches, takes a request and raises
    monkeypatch.chdir(tmp_path)
    (tmp_path / "raises.py").write_text(RAISES)
    # WHEN the script that starts it runs under kvscope
    main(["run", "--dump-dir", str(tmp_path), str(tmp_path / "raises.py"), method, pool_name])
    out, err = capfd.readouterr()
    pid = worker_pid(out)
    # THEN its exit check ran as the exception ended it: its leak says so, and the likely
    # cause names the worker and the exception
    assert f"pid {pid} request 'held'" in err
    assert "when the process exited raising IndexError" in err, err
    assert f"pid {pid} raised IndexError" in err, err
