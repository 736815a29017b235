"""The scenario scripts in examples/scenarios: one per injectable fault, each runnable under
kvscope run, each producing its finding on every run (the example server runs on its step
clock, so the fault strikes the same request whatever the machine's speed)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.allocator.faults import FAULTS
from kvscope.dumpfile import read_dump

SCENARIOS = Path(__file__).resolve().parent.parent / "examples" / "scenarios"
# The README's table: each scenario and the finding(s) it produces.
FINDINGS = {
    "double_free": ["double_free"],
    "leak": ["leak_finished"],
    "oob_write": ["guard_violation"],
    "header_scribble": ["header_corrupt"],
    "block_scribble": ["block_header_corrupt"],
    "use_after_free": ["use_after_free"],
    "refcount_skew": ["refcount_mismatch"],
    "kill_holding_lock": ["lock_dead_holder", "leak_dead_owner"],
    "lock_inversion": ["lock_order_cycle"],
    "stale_padding_row": ["block_table_mismatch"],
    "gil_wait": ["wait_holds_gil"],
    "transfer_after_free": ["transfer_after_free"],
    "lease_leak": ["lease_leak"],
    "foreign_slot": ["foreign_slot"],
}


def test_there_is_a_scenario_for_every_fault():
    names = {p.stem.replace("_", "-") for p in SCENARIOS.glob("[!_]*.py")}
    assert names == set(FAULTS)
    assert {n.replace("_", "-") for n in FINDINGS} == set(FAULTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FINDINGS))
def test_scenario_under_the_installed_kvscope_reports_its_finding(tmp_path, name):
    # GIVEN a scenario script, WHEN run with the installed `kvscope run`
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    out = subprocess.run(
        [kvscope, "run", "--fail-on", "leak", str(SCENARIOS / f"{name}.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # THEN its fault is injected once, it fails with its findings printed and a dump left behind
    fault = name.replace("_", "-")
    assert out.stderr.count(f"injecting fault {fault!r}") == 1, out.stderr[-3000:]
    assert out.returncode != 0
    for kind in FINDINGS[name]:
        assert kind in out.stderr, f"{name}: no {kind} in\n{out.stderr[-3000:]}"
    assert "never fired" not in out.stderr
    (dump,) = glob.glob(str(tmp_path / "kvscope-*.kvd"))
    # A killed child leaves its pool for `kvscope check --repair`: clean up here.
    pid = int(read_dump(dump)[1]["pid"])
    shm = os.environ.get("KVSCOPE_SHM_DIR", "/dev/shm")
    for leftover in glob.glob(os.path.join(shm, f"kvscope.serve-{pid}*")):
        os.unlink(leftover)
