"""`kvscope run --inject FAULT`: each named fault produces its finding (the probes, issue 5, inject)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest

from kvscope.allocator.faults import FOUND_AS
from kvscope.analysis import analyze_view
from kvscope.cli import main
from kvscope.dumpfile import alive_for, read_dump
from kvscope.errors import UsageError
from kvscope.verbs.run import FAULTS, child_env, parse_faults

WORKLOAD = """
import sys
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
seqs = [pool.allocate(f"req-{i}", list(range(i, i + 9))) for i in range(4)]
for s in seqs:
    pool.append(s, [1, 2, 3])
for s in seqs:
    pool.free(s)
pool.close()
pool.unlink()
"""

EXPECTED = {
    "double-free": "double_free",
    "leak": "leak_finished",
    "oob-write": "guard_violation",  # guard mode is on under kvscope run
    "header-scribble": "header_corrupt",
    "block-scribble": "block_header_corrupt",
    "use-after-free": "use_after_free",
    "refcount-skew": "refcount_mismatch",
    "kill-holding-lock": "lock_dead_holder",
    "lock-inversion": "lock_order_cycle",
    "stale-padding-row": "block_table_mismatch",
    "gil-wait": "wait_holds_gil",
    "transfer-after-free": "transfer_after_free",
    "lease-leak": "lease_leak",
    "foreign-slot": "foreign_slot",
}
# The example server's options a fault needs: stale-padding-row strikes the padded block
# table of the step graphs' static buffers (on the CPU they run eagerly); lease-leak strikes the
# read leases of its offload. transfer-after-free strikes a write lease, which it takes none
# of: its scenario script does (tests/test_run_scenarios.py, tests/test_leases_faults.py).
NEEDS = {"stale-padding-row": ["--cuda-graphs"], "lease-leak": ["--offload"]}
NOT_IN_SERVER = {"transfer-after-free"}


TWO_REQUESTS = """
import sys
from kvscope.allocator import KVPool, PoolConfig
pool = KVPool.create(sys.argv[1], PoolConfig(num_blocks=64, block_size=4, head_dim=8, num_layers=1, dtype="float32"))
for i in range(2):
    pool.free(pool.allocate(f"req-{i}", list(range(i, i + 9))))
pool.close()
pool.unlink()
"""


@pytest.mark.slow
def test_a_fault_that_never_fired_fails_the_run(capfd, tmp_path, pool_name):
    # GIVEN a script that ends two requests, and double-free armed for the third
    script = tmp_path / "two.py"
    script.write_text(TWO_REQUESTS)
    # WHEN it runs under kvscope with the fault
    code = main(
        ["run", "--inject", "double-free", "--dump-dir", str(tmp_path), str(script), pool_name]
    )
    err = capfd.readouterr().err
    # THEN nothing claims the fault was injected, the run says it never fired and exits 1
    assert "injecting" not in err
    assert "fault 'double-free' was armed but never fired" in err
    assert code == 1


def test_every_fault_has_an_expected_finding():
    assert set(EXPECTED) == set(FAULTS)
    # and the run's own table of what finds each fault (the verdict's) says the same
    assert set(FOUND_AS) == set(FAULTS)
    assert all(EXPECTED[f] in FOUND_AS[f][0] for f in FAULTS)


@pytest.mark.slow
def test_a_fault_that_fired_unseen_fails_the_run_and_says_what_finds_it(capfd, tmp_path, pool_name):
    # GIVEN a script whose requests grow by a block each, oob-write armed, guard mode off
    script = tmp_path / "grow.py"
    script.write_text(
        TWO_REQUESTS.replace(
            '    pool.free(pool.allocate(f"req-{i}", list(range(i, i + 9))))',
            '    seq = pool.allocate(f"req-{i}", list(range(i, i + 9)))\n'
            "    pool.append(seq, [1, 2, 3, 4])\n"
            "    pool.free(seq)",
        ).replace("range(2)", "range(6)")
    )
    # WHEN it runs under kvscope with the fault: the write lands in the next block unseen
    code = main(
        ["run", "--no-guard", "--inject", "oob-write", "--dump-dir", str(tmp_path), str(script),
         pool_name]
    )  # fmt: skip
    err = capfd.readouterr().err
    # THEN the run says the fault fired, that no finding of its kind came and what finds it,
    # and exits 1: it proved nothing about the probe
    assert "injecting fault 'oob-write'" in err, err
    assert "fault 'oob-write' fired but no guard_violation finding came (it is found by " in err
    assert "guard mode" in err and code == 1, err


def test_faults_reach_the_child_environment(tmp_path):
    args = type("A", (), {"guard": True, "lockdep": False, "inject": ["leak,double-free"]})()
    env = child_env({}, str(tmp_path), args)
    assert env["KVSCOPE_INJECT"] == "leak,double-free"
    assert env["KVSCOPE_GUARD"] == "1" and env["KVSCOPE_LOCKDEP"] == "0"
    assert env["KVSCOPE_EVENTS"] == "1" and env["KVSCOPE_RUN_DIR"] == str(tmp_path)
    # (a flight recorder of 8,192 events a process, unless the user's environment says)
    assert env["KVSCOPE_EVENT_CAPACITY"] == "8192"
    assert (
        child_env({"KVSCOPE_EVENT_CAPACITY": "512"}, str(tmp_path), args)["KVSCOPE_EVENT_CAPACITY"]
        == "512"
    )
    # (one it cannot be: refused before the script starts, in one line)
    with pytest.raises(UsageError, match="KVSCOPE_EVENT_CAPACITY='lots': give a number"):
        child_env({"KVSCOPE_EVENT_CAPACITY": "lots"}, str(tmp_path), args)
    assert parse_faults(["oob-write", "use-after-free,lock-inversion"]) == [
        "oob-write",
        "use-after-free",
        "lock-inversion",
    ]


SERVE = str(Path(__file__).resolve().parent.parent / "examples" / "serve.py")
# Faults about one block must name it and its owner.
BLOCK_FAULTS = {
    "double-free",
    "leak",
    "oob-write",
    "block-scribble",
    "use-after-free",
    "refcount-skew",
    "stale-padding-row",
    "lease-leak",
    "foreign-slot",
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", [f for f in FAULTS if f not in NOT_IN_SERVER])
def test_injected_fault_produces_its_finding(capfd, tmp_path, monkeypatch, fault):
    # GIVEN the example server, WHEN run under kvscope with one injected fault
    monkeypatch.chdir(tmp_path)
    code = main(
        [
            "run",
            "--fail-on",
            "leak",
            "--inject",
            fault,
            "--dump-dir",
            str(tmp_path),
            SERVE,
            "--requests",
            "16",
            "--clock",
            "steps",
            "--no-progress",
            *NEEDS.get(fault, []),
        ]
    )
    err = capfd.readouterr().err
    # THEN the run fails, its finding is printed as it happens and the dump's analysis holds it
    assert code != 0
    assert EXPECTED[fault] in err
    (dump,) = glob.glob(str(tmp_path / "kvscope-*.kvd"))
    view, dh = read_dump(dump)
    rep = analyze_view(view, alive=alive_for(dh), dump_header=dh)
    found = [f for f in rep["findings"] if f["kind"] == EXPECTED[fault]]
    assert found, f"{fault}: no {EXPECTED[fault]} in {[f['kind'] for f in rep['findings']]}"
    pid = int(dh["pid"])
    # A killed child leaves its pool in /dev/shm for `kvscope check --repair`: clean up here.
    shm = os.environ.get("KVSCOPE_SHM_DIR", "/dev/shm")
    for leftover in glob.glob(os.path.join(shm, f"kvscope.serve-{pid}*")):
        os.unlink(leftover)
    if fault in BLOCK_FAULTS:
        # ... with the right block and owner
        assert any(f["block"] is not None and f["owner_pid"] == pid for f in found)
    elif fault == "kill-holding-lock":
        assert any(f["owner_pid"] == pid for f in found)
    elif fault in ("lock-inversion", "gil-wait"):
        assert f"pid {pid}" in found[0]["message"]
    if fault in ("stale-padding-row", "gil-wait", "lease-leak", "foreign-slot"):
        # ... exactly one finding of its kind, and no other error
        assert len(found) == 1, found
        errors = [f for f in rep["findings"] if f["severity"] == "error"]
        assert errors == found, errors


@pytest.mark.parametrize(
    "argv,env",
    [(["--redact"], {}), ([], {"KVSCOPE_EVENT_CAPACITY": "lots"})],
    ids=["redact-without-record-ops", "bad-event-capacity"],
)
def test_a_run_refused_before_its_script_starts_leaves_no_run_directory(
    tmp_path, monkeypatch, capsys, argv, env
):
    # GIVEN a flag or a variable kvscope run refuses, with the temporary directory in tmp_path
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    # WHEN it runs THEN it is one line, exit 2, the script not run, no run directory left
    assert main(["run", *argv, str(script)]) == 2
    out, err = capsys.readouterr()
    assert "ran" not in out and err.count("\n") == 1
    assert not list(tmp_path.glob("kvscope-run-*"))
