"""Peers installed at test time: a package pinned to a version, put into a folder of its own with
`pip install --target` (never into the test environment, never copied into the repo), and
checked to import from there; a test that needs one skips with the reason when it cannot."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def installed_peer(name: str, folder: str, pip_args: list[str], probe: str, *, marker: str) -> str:
    """`folder` with the peer in it: installed with `pip_args` unless `folder/marker` exists,
    then `probe` (Python code) run with the folder first on sys.path; pytest.skip naming the
    peer and why when the install fails or the probe does not run."""
    if not os.path.isdir(os.path.join(folder, marker)):
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", folder]
            + pip_args,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot install {name}: {r.stderr.strip()[-300:]}")
    r = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {folder!r}); {probe}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"{name} in {folder} does not import here: {why}")
    return folder
