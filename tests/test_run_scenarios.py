"""The scenario scripts in examples/scenarios: one per injectable fault, each runnable under kvscope run."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.allocator.faults import FAULTS

SCENARIOS = Path(__file__).resolve().parent.parent / "examples" / "scenarios"


def test_there_is_a_scenario_for_every_fault():
    names = {p.stem.replace("_", "-") for p in SCENARIOS.glob("[!_]*.py")}
    assert names == set(FAULTS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,kind", [("leak", "leak_finished"), ("lock_inversion", "lock_order_cycle")]
)
def test_scenario_under_the_installed_kvscope_reports_its_finding(tmp_path, name, kind):
    # GIVEN a scenario script, WHEN run with the installed `kvscope run`
    kvscope = os.path.join(os.path.dirname(sys.executable), "kvscope")
    out = subprocess.run(
        [kvscope, "run", "--fail-on", "leak", str(SCENARIOS / f"{name}.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # THEN it fails with its finding printed and a dump left behind
    assert out.returncode != 0
    assert kind in out.stderr
    assert glob.glob(str(tmp_path / "kvscope-*.kvd"))
