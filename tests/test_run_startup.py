"""What `kvscope run` adds to a script's start: a guard-mode pool under the probes imports no
Triton (its canary is kernels/canary.py's, its guard slots filled with torch), and still checks
its canaries (docs/CLI.md, "Start-up")."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kvscope.kernels

# Run under the bootstrap, as `kvscope run` starts a script: a guard-mode pool, one block's
# canary overwritten, then the whole-pool check; prints what it found and what it imported.
SCRIPT = """
import json, sys
from kvscope.allocator import KVPool, PoolConfig
cfg = PoolConfig(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8)
pool = KVPool.create(sys.argv[1], cfg)
seq = pool.allocate("req-1", list(range(6)))
block = pool.block_table(seq)[0]
guarded = pool.kv.shape[3] == 5
pool.kv[0, 0, block, 4] = 1.0
kinds = sorted({f.kind for f in pool.check() if f.block == block})
pool.free(seq)
pool.close()
pool.unlink()
heavy = [m for m in ("triton", "kvscope.kernels.guardscan", "kvscope.kernels.errors") if m in sys.modules]
print(json.dumps({"guarded": guarded, "kinds": kinds, "heavy": heavy}))
"""


@pytest.mark.slow
def test_a_guard_mode_pool_under_the_probes_imports_no_triton(tmp_path, pool_name):
    # GIVEN a script that makes a guard-mode pool and breaks one block's canary, run as
    # `kvscope run` starts it (the bootstrap, the probes on)
    script = tmp_path / "guarded.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {
        **os.environ,
        "KVSCOPE_RUN_DIR": str(run_dir),
        "KVSCOPE_GUARD": "1",
        "KVSCOPE_LOCKDEP": "1",
        "KVSCOPE_EVENTS": "1",
    }
    env.pop("KVSCOPE_KERNELS", None)
    # WHEN it runs
    out = subprocess.run(
        [sys.executable, "-m", "kvscope.bootstrap", str(script), pool_name],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # (no supervisor ran: remove the files the bootstrap renamed aside at the script's unlink,
    # as the supervisor does after a run, so that none is left in /dev/shm)
    unlinks = run_dir / "unlinks"
    for line in unlinks.read_text().splitlines() if unlinks.exists() else []:
        aside = line.split("\t")[-1]
        for path in (aside, aside + ".data"):
            if os.path.exists(path):
                os.unlink(path)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # THEN the pool had its guard slots and the check found the broken canary, and neither
    # Triton nor a Triton kernel's module was imported
    assert seen["guarded"]
    assert "guard_violation" in seen["kinds"]
    assert seen["heavy"] == []


def test_the_kernels_public_names_resolve():
    # GIVEN the kernels' package, whose names are imported on first use
    # WHEN each public name is read THEN it is there, from the module the package names
    for name in kvscope.kernels.__all__:
        assert getattr(kvscope.kernels, name) is not None
    from kvscope.allocator import kvbits
    from kvscope.kernels import CANARY_BITS, guard

    # AND the canary is one constant: the numpy reader's and the guard slots' are it
    assert kvbits.CANARY_BITS is CANARY_BITS is guard.CANARY_BITS


# The supervisor's import of numpy, in a fresh process: its threads after it, and whether the
# environment was put back.
NUMPY_PROBE = """
import json, os, sys
from kvscope.verbs.run import numpy_without_blas_threads
assert "numpy" not in sys.modules
numpy_without_blas_threads()
print(json.dumps({"threads": len(os.listdir("/proc/self/task")),
                  "env": "OPENBLAS_NUM_THREADS" in os.environ}))
"""


@pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or not os.path.isdir("/proc/self/task"),
    reason="OpenBLAS starts worker threads only with 2 CPUs or more; threads read from /proc",
)
def test_the_supervisors_numpy_starts_no_blas_thread_and_leaves_the_environment():
    # GIVEN a fresh process on a machine of 2 CPUs or more, OPENBLAS_NUM_THREADS unset
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    # WHEN it imports numpy as the supervisor does
    done = subprocess.run(
        [sys.executable, "-c", NUMPY_PROBE], capture_output=True, text=True, env=env, check=True
    )
    # THEN numpy started no OpenBLAS worker (the process has its one thread), and the variable
    # is gone again (the processes it starts get the user's environment)
    assert json.loads(done.stdout) == {"threads": 1, "env": False}
