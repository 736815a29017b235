"""Runs the `interp` kernel tests in a fresh process with TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET once, when it is first imported (its `@triton.jit` standard
library is built then), so the interpreter cannot be switched on inside this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels_cases import INTERPRETING

TESTS = Path(__file__).resolve().parent
FILES = [
    "test_kernels_triton.py",
    "test_kernels_guard.py",
    "test_kernels_backend.py",
    "test_kernels_digest.py",
    "test_kernels_checks.py",
    "test_core_guard.py",
    "test_hash_finalizer.py",
    "test_audit_kernel.py",
]


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="the interp cases already run in this process")
def test_triton_kernels_under_the_cpu_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("KVSCOPE_KERNELS", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-k",
        "interp or backend",
    ]
    result = subprocess.run(
        cmd + [str(TESTS / f) for f in FILES],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, report
    assert " passed" in report and " failed" not in report, report
